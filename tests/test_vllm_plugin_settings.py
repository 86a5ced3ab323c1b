"""The vLLM plugin's settings and version check, without vLLM (runs in every suite)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvconnect.vllm.plugin_settings import (
    CAPACITY_ENV,
    SWITCH_ENV,
    PluginConfigError,
    PluginSettings,
    UnsupportedVllmError,
    capacity_bytes_from_env,
    check_vllm_version,
    enabled,
)


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_switch_on(value: str) -> None:
    assert enabled({SWITCH_ENV: value})


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", "off"])
def test_switch_off(value: str | None) -> None:
    assert not enabled({} if value is None else {SWITCH_ENV: value})


def test_switch_typo_is_an_error_not_off() -> None:
    with pytest.raises(PluginConfigError, match="use 1 to turn"):
        enabled({SWITCH_ENV: "ture"})


def test_capacity_knob() -> None:
    assert capacity_bytes_from_env({}) is None
    assert capacity_bytes_from_env({CAPACITY_ENV: "8_589_934_592"}) == 8 << 30
    for bad in ("8GiB", "-1", "0", "1.5"):
        with pytest.raises(PluginConfigError, match=CAPACITY_ENV):
            capacity_bytes_from_env({CAPACITY_ENV: bad})


@pytest.mark.parametrize("bad", ["\u0661\u0660\u0662\u0664", "\uff11\uff10", "_1_", "1__0",
                                 "+5", "\xa05", "5\u2003", str(2 ** 70), "1_", "0x10", "1e9"])
def test_capacity_takes_ascii_digits_within_a_bound(bad: str) -> None:
    """Issue 23: Arabic-Indic and full-width digits, ``_1_``, ``1__0``, ``+5``, a leading
    no-break space and 2**70 were accepted (int() takes them all)."""
    with pytest.raises(PluginConfigError, match=f"{CAPACITY_ENV}.*ASCII digits"):
        capacity_bytes_from_env({CAPACITY_ENV: bad})


@pytest.mark.parametrize(("text", "value"), [(" 4096 ", 4096), ("1_024", 1024),
                                             (str(2 ** 63 - 1), 2 ** 63 - 1), ("  ", None)])
def test_capacity_forms_taken(text: str, value: int | None) -> None:
    assert capacity_bytes_from_env({CAPACITY_ENV: text}) == value


def test_settings_read_every_knob_only_with_the_switch_on() -> None:
    bad = {CAPACITY_ENV: "8GiB", "KVCONNECT_KV_GROW_MAX_BYTES": "x"}
    assert PluginSettings.from_env(bad) == PluginSettings()  # off: nothing else is read
    on = PluginSettings.from_env({SWITCH_ENV: "1", CAPACITY_ENV: "4096",
                                  "KVCONNECT_KV_SHRINK_IDLE_SECONDS": "2"})
    assert (on.enabled, on.capacity_bytes, on.elastic.shrinks) == (True, 4096, True)
    with pytest.raises(PluginConfigError, match=CAPACITY_ENV):
        PluginSettings.from_env({**bad, SWITCH_ENV: "1"})


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.2+cpu"])
def test_supported_versions(version: str) -> None:
    assert check_vllm_version(version) == version[:4]


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.33", "dev"])
def test_other_versions_are_refused_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(UnsupportedVllmError) as info:
        check_vllm_version(version)
    assert "0.32.x, 0.33.x" in str(info.value) and version in str(info.value)


def test_register_with_the_switch_off_imports_and_patches_nothing() -> None:
    code = ("import os, sys, json; os.environ.pop('KVCONNECT_EXTENSIBLE_KV', None); "
            "from kvconnect.vllm import plugin; plugin.register(); "
            "print(json.dumps({'vllm': sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'),"
            " 'torch': 'torch' in sys.modules, 'installed': plugin.installed()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"vllm": [], "torch": False, "installed": False}
