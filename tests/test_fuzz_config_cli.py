"""Layout configs and command-line arguments fuzzed (hypothesis).

- ``KVCacheConfig.from_dict`` + ``plan_layout`` over mutated real preset configs (fields
  deleted, wrong types, huge or negative integers, unknown layouts and dtypes): a plan or a
  :class:`~kvconnect.layout.LayoutError`, nothing else.
- ``kvconnect-validate``'s argument parsing (``build_parser().parse_args`` then
  ``build_config``; no run is started): argparse's usage error (SystemExit 2) or the
  kvconnect.errors.OptionError, nothing else.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import _reliability as fuzz
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.errors import OptionError
from kvconnect.layout import PRESETS, KVCacheConfig, LayoutError, plan_layout, preset


def _preset_dicts() -> list[dict]:
    return [preset(name, num_blocks=8, num_layers=2).to_dict() for name in sorted(PRESETS)]


def test_layout_configs_plan_or_raise_layout_error() -> None:
    """Mutated preset config dicts: a plan whose config round-trips, or LayoutError."""
    n = fuzz.examples(1000)
    tally = fuzz.Tally("layout configs: KVCacheConfig.from_dict + plan_layout", "LayoutError", n)
    bases = _preset_dicts()
    for base in bases:  # the unmutated configs plan
        plan_layout(KVCacheConfig.from_dict(base))

    @fuzz.fuzz_settings(1000)
    @given(st.sampled_from(range(len(bases))).flatmap(lambda i: fuzz.mutated(bases[i])))
    def run(doc: Any) -> None:
        got = tally.run(lambda: plan_layout(KVCacheConfig.from_dict(doc)), (LayoutError,))
        if not isinstance(got, LayoutError):  # a plan: its config round-trips
            cfg = KVCacheConfig.from_dict(doc)
            assert KVCacheConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg

    run()
    tally.record()
    assert tally.tried >= n and tally.outcomes["LayoutError"] > 0


# -- kvconnect-validate arguments ---------------------------------------------------------------

_FLAGS = ["--prefill", "--decode", "--device", "--layout", "--num-blocks", "--num-layers",
          "--transfer-blocks", "--transports", "--json", "--junit", "--min-gbps", "--timeout",
          "--seed", "--rendezvous", "--role", "--rank"]
_SWITCHES = ["--corrupt", "--plain", "-q", "--quiet", "-v", "--verbose", "--help", "--"]
_VALUES = st.one_of(
    st.sampled_from(["0", "1", "2", "-1", "4", "64", "65", "1000001", "1e999", "nan", "inf",
                     "-0", "0x10", "1_000", "٣", "9" * 5000, "", " ", "host", "cuda", "cpu",
                     "ipc", "nixl", "ipc,nixl", "ipc,ipc", ",", "prefill", "decode",
                     "llama3-8b-like", "packed", "nope", "127.0.0.1:29500", "[::1]:0",
                     "host:70000", ":1", "/proc/nope.json", "/tmp", "/nonexistent/x.json",
                     "a\x00b", "-", "--prefill"]),
    st.text(max_size=12),
    st.integers(-(1 << 70), 1 << 70).map(str),
    st.floats().map(str),
)
argvs = st.lists(st.one_of(st.tuples(st.sampled_from(_FLAGS), _VALUES).map(list),
                           st.sampled_from(_SWITCHES).map(lambda s: [s]),
                           _VALUES.map(lambda v: [v])),
                 max_size=8).map(lambda parts: [x for p in parts for x in p])


def test_cli_arguments_parse_or_fail_with_a_usage_error() -> None:
    """Random argument lists: a RunConfig within bounds, argparse's usage error (exit 2)
    or OptionError."""
    from kvconnect.harness import cli

    n = fuzz.examples(1000)
    tally = fuzz.Tally("kvconnect-validate arguments: build_parser + build_config",
                       "SystemExit(2) / OptionError", n)

    @fuzz.fuzz_settings(1000)
    @given(argvs)
    def run(argv: list[str]) -> None:
        def parse() -> Any:
            sink = io.StringIO()
            with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
                args = cli.build_parser().parse_args(argv)
            return cli.build_config(args)

        got = tally.run(parse, (SystemExit, OptionError))
        if isinstance(got, SystemExit):
            assert got.code in (0, 2), got.code  # 0: --help
        elif not isinstance(got, OptionError):
            cfg, _ = got
            assert 1 <= cfg.num_prefill <= cli.MAX_WORKERS_PER_ROLE
            assert 2 <= cfg.transfer_blocks < cfg.num_blocks

    run()
    tally.record()
    assert tally.tried >= n and tally.outcomes["SystemExit"] > 0
