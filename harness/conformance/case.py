"""One conformance case: one connector, one vLLM layout, one VMM-style cache (needs vLLM).

:func:`run_case` runs inside its own process (see :mod:`.runner`). It builds vLLM's config
for a tiny local model, a :class:`~kvconnect.vllm.cache.VllmKVCache` whose capacity is many
times the committed blocks (host backend on CPU: touching uncommitted memory faults), fills
the committed blocks with random bytes, creates the connector through vLLM's own
``KVConnectorFactory`` (worker role) with the config an extensible cache hands it, calls
``register_kv_caches`` with vLLM's views over the whole reservation, and checks:

- ``committed_only``: every registered range and region lies in committed memory;
- ``block_geometry``: regions stride by the layout's block stride, stay inside one block,
  and together cover every KV byte of a block;
- ``transfer`` (NIXL: a second real agent reads blocks, byte-exact) or
  ``offload_round_trip`` (store, scribble, load, byte-exact);
- ``sleep_wake``: ``unregister_kv_caches``, release, recommit, ``restore_kv_caches``, then
  registrations committed-only again and blocks moving byte-exact again (skipped where the
  vLLM version's connector API has no such hooks: 0.32).

A connector of no kind the kit knows (any ``KVConnectorBase_V1`` subclass: see
:class:`~kvconnect.harness.conformance.probes.GenericProbe`) is checked by its NIXL
registrations and the views it holds; what could not be checked is in the result's
``unchecked``, check name -> reason in words.

Each check is ``{"status": "pass" | "fail" | "skip" | "refused", ...evidence}``, written by
:func:`kvconnect.verdicts.check_entry` (the harness's :class:`~kvconnect.verdicts.Check`).
Units: bytes.
"""

from __future__ import annotations

import importlib
import random
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

from kvconnect.errors import KvconnectError
from kvconnect.layout import LayoutError
from kvconnect.verdicts import FAIL, PASS, REFUSED, SKIP, check_entry

from .holdings import holdings_check, outside_bytes
from .probes import ConnectorProbe, GenericProbe, Region, probe_for

__all__ = ["CASE_DEFAULTS", "ConnectorSpecError", "DeviceBytes", "fill_committed",
           "kv_cache_config", "resolve_connector", "run_case", "transfer_config"]

#: the geometry every case uses unless told otherwise (small: the machine is shared)
CASE_DEFAULTS: dict[str, Any] = {
    "num_layers": 2, "num_kv_heads": 2, "head_size": 64, "block_size": 32, "dtype": "bfloat16",
    "num_blocks": 128, "capacity_blocks": 1024, "transfer_blocks": 8, "device": "cpu",
    "seed": 0,
}

Stage = Callable[[str], None]
Report = Callable[[str, dict[str, Any]], None]


class ConnectorSpecError(KvconnectError, TypeError):
    """The connector a case names is not a vLLM KV connector class."""


def resolve_connector(name: str) -> tuple[str, str | None, type]:
    """``"module:Class"`` or a name vLLM registers (``"NixlConnector"``) -> ``(class name,
    module path or None, class)``. :class:`ConnectorSpecError` when ``module`` has no such
    attribute or it is not a subclass of vLLM's ``KVConnectorBase_V1``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if ":" not in name:
        return name, None, KVConnectorFactory.get_connector_class_by_name(name)
    module, _, cls_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except AttributeError:
        raise ConnectorSpecError(f"{name}: module {module} has no attribute {cls_name!r}"
                                 ) from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else \
            f"a {type(cls).__name__}"
        raise ConnectorSpecError(f"{name} is {what}, not a vLLM KV connector (a subclass of "
                                 f"KVConnectorBase_V1): name a connector class")
    return cls_name, module, cls


def _inside(extents: list[tuple[int, int]], a: int, n: int) -> bool:
    return any(s <= a and a + n <= s + m for s, m in extents)


class DeviceBytes:
    """Reads and writes bytes of an :class:`~kvconnect.tensor.ExtensibleTensor`'s committed
    memory through torch views (host or CUDA alike: no raw host pointers), synchronising
    the device around them so that copies on other streams are ordered."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.device = tensor.device

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def _view(self, address: int, n: int) -> Any:
        return self.tensor.committed_view(address - self.tensor.base_ptr, n)

    def read(self, address: int, n: int) -> bytes:
        self.sync()
        return self._view(address, n).cpu().numpy().tobytes()

    def fill(self, address: int, n: int, value: int) -> None:
        self._view(address, n).fill_(value)
        self.sync()


def _read_runs(extents: list[tuple[int, int]], unreadable: list[int], memory: DeviceBytes
               ) -> Callable[[list[tuple[int, int]]], bytes]:
    """Bytes at ``(address, n)`` runs; runs outside committed memory are not touched (they
    would fault): they read as zeros and count in ``unreadable[0]``."""
    def read(runs: list[tuple[int, int]]) -> bytes:
        out = []
        for a, n in runs:
            if _inside(extents, a, n):
                out.append(memory.read(a, n))
            else:
                unreadable[0] += n
                out.append(bytes(n))
        return b"".join(out)
    return read


def _committed_only(probe: ConnectorProbe, regions: list[Region],
                    extents: list[tuple[int, int]]) -> dict[str, Any]:
    registered = probe.registered() or [(r.base, r.end - r.base) for r in regions]
    outside = [(a, n) for a, n in registered if not _inside(extents, a, n)]
    bad = [r for r in regions if not _inside(extents, r.base, r.end - r.base)]
    return check_entry(FAIL if outside or bad else PASS,
                       registered_bytes=sum(n for _, n in registered),
                       committed_bytes=sum(n for _, n in extents),
                       registered_outside_bytes=sum(outside_bytes(extents, a, n)
                                                    for a, n in registered),
                       ranges=len(registered), ranges_outside=len(outside),
                       regions=len(regions), regions_outside=len(bad))


def _block_geometry(regions: list[Region], kv_runs: list[tuple[int, int, int]]
                    ) -> dict[str, Any]:
    """``kv_runs``: kvconnect's ``(address of block 0, length, block stride)`` runs."""
    bad_stride, bad_extent = [], []
    for r in regions:
        home = [k for k in kv_runs if k[0] <= r.base < k[0] + k[2]]
        row = min(home, key=lambda k: r.base - k[0]) if home else None
        if row is None or r.block_stride != row[2]:
            bad_stride.append((hex(r.base), r.block_stride, None if row is None else row[2]))
        elif r.base + r.block_len > row[0] + row[2]:
            bad_extent.append((hex(r.base), r.block_len))
    covered = sorted((r.base, r.base + r.block_len) for r in regions)
    missing = 0
    for a, n, _ in kv_runs:
        for lo, hi in covered:
            if lo <= a < hi:
                take = min(hi, a + n) - a
                a, n = a + take, n - take
            if n == 0:
                break
        missing += n
    ok = not bad_stride and not bad_extent and missing == 0 and bool(regions)
    return check_entry(PASS if ok else FAIL, regions=len(regions),
                       wrong_stride=bad_stride[:4], beyond_block=bad_extent[:4],
                       uncovered_kv_bytes_per_block=missing)


def fill_committed(cache: Any, rng: random.Random) -> None:
    """Random bytes into every committed block prefix of a VllmKVCache (nothing else)."""
    import torch

    (t,) = cache.tensors
    used = cache.num_blocks * cache.plan.tensors[0].segment_bytes_per_block
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for s in range(t.num_segments):
        view = t.committed_view(s * t.segment_capacity, used)
        view.copy_(torch.randint(0, 256, (used,), dtype=torch.uint8, generator=gen))


def _exercise(probe: ConnectorProbe, connector: Any, cache: Any, extents: list[tuple[int, int]],
              block_ids: list[int], rng: random.Random) -> dict[str, Any]:
    runs = [(r.base_ptr + b * r.block_stride, r.block_len)
            for r in cache.committed_regions() for b in block_ids]

    memory = DeviceBytes(cache.tensors[0])

    def scribble() -> None:  # kvconnect's runs: committed memory only
        for a, n in runs:
            memory.fill(a, n, rng.randrange(256))

    unreadable = [0]
    try:
        moved, mismatched = probe.exercise(connector, block_ids, scribble,
                                           _read_runs(extents, unreadable, memory), runs)
    except NotImplementedError as exc:
        return check_entry(SKIP, reason=str(exc))
    except Exception as exc:  # the connector's geometry made the move fail: evidence
        return check_entry(FAIL, error=_error(exc))
    bad = mismatched + unreadable[0]
    return check_entry(PASS if moved and not bad else FAIL, moved_bytes=moved,
                       mismatched_bytes=mismatched, unreadable_bytes=unreadable[0],
                       blocks=len(block_ids))


class _Checks(dict):
    """The case's checks; each one is also sent to the parent as soon as it is known (so
    a later fault does not lose it)."""

    def __init__(self, send: Report | None) -> None:
        super().__init__()
        self._send = send

    def __setitem__(self, key: str, value: dict[str, Any]) -> None:
        super().__setitem__(key, value)
        if self._send is not None:
            self._send(key, value)


def transfer_config(connector: str, **fields: Any) -> tuple[dict[str, Any], type]:
    """vLLM's ``kv_transfer_config`` (a dict) naming ``connector`` (see
    :func:`resolve_connector`) with ``fields`` (``kv_role``, ``engine_id``, ...); its class."""
    cls_name, module, cls = resolve_connector(connector)
    ktc: dict[str, Any] = {"kv_connector": cls_name, **fields}
    if module:
        ktc["kv_connector_module_path"] = module
    return ktc, cls


def kv_cache_config(vc: Any, s: dict[str, Any]) -> Any:
    """vLLM's ``KVCacheConfig`` of the tiny model of geometry ``s`` (see
    :data:`CASE_DEFAULTS`), planned for ``num_blocks``."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from .compat import kv_cache_config_from_groups

    page = FullAttentionSpec(block_size=s["block_size"], num_kv_heads=s["num_kv_heads"],
                             head_size=s["head_size"], dtype=getattr(torch, s["dtype"]))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(s["num_layers"])]
    return kv_cache_config_from_groups(
        vc, [KVCacheGroupSpec(names, page)],
        s["num_blocks"] * s["num_layers"] * page.page_size_bytes)


def _build(s: dict[str, Any], tmp: str) -> tuple[Any, Any, type]:
    """vLLM's config for the case's tiny model, with the connector named by the spec, the
    cache's vLLM ``KVCacheConfig`` (planned for ``num_blocks``) and the connector's class."""
    from kvconnect.vllm.runtime import make_vllm_config, write_tiny_model

    ktc, cls = transfer_config(s["connector"], kv_role="kv_both",
                               engine_id=f"conformance-{s['layout']}",
                               kv_connector_extra_config={"cpu_bytes_to_use": 64 << 20})
    model = write_tiny_model(f"{tmp}/model", num_layers=s["num_layers"],
                             num_kv_heads=s["num_kv_heads"], head_dim=s["head_size"],
                             dtype=s["dtype"])
    vc = make_vllm_config(model, layout=s["layout"], block_size=s["block_size"],
                          kv_transfer_config=ktc, dtype=s["dtype"], device=s["device"])
    return vc, kv_cache_config(vc, s), cls


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def _register(connector: Any, views: dict[str, Any], checks: _Checks) -> bool:
    """``register_kv_caches``; False (the check says why) when it raised."""
    try:
        connector.register_kv_caches(views)
    except Exception as exc:
        # kvconnect's bounding refusing a layout it cannot describe is not a fault
        refused = isinstance(exc, LayoutError)
        checks["register"] = check_entry(
            REFUSED if refused else FAIL, error=_error(exc),
            where=traceback.extract_tb(exc.__traceback__)[-1].name)
        return False
    checks["register"] = check_entry(PASS)
    return True


def _committed_checks(probe: ConnectorProbe, connector: Any, cache: Any, views: dict[str, Any],
                      extents: list[tuple[int, int]]) -> dict[str, Any]:
    """``committed_only`` for the probe's kind: its regions and registrations; for a
    connector of unknown kind, its NIXL registrations and the views it holds."""
    regions = probe.regions(connector)
    out = _committed_only(probe, regions, extents)
    if isinstance(probe, GenericProbe):
        t = cache.tensors[0]
        held = holdings_check(connector, views, (t.base_ptr, t.capacity_bytes), extents)
        out.update(held_views=held["held_views"],
                   views_reaching_uncommitted=held["views_reaching_uncommitted"],
                   held_examples=held["examples"])
        if held["status"] == FAIL:
            out["status"] = FAIL
    return out


def _sleep_wake(probe: ConnectorProbe, connector: Any, cache: Any, views: dict[str, Any],
                extents: list[tuple[int, int]], block_ids: list[int], rng: random.Random,
                stage: Stage) -> dict[str, Any]:
    """Unregister, release, recommit, restore; nothing registered while asleep, committed
    memory only after wake, blocks moving again."""
    from .compat import sleep_hooks, vllm_version

    hooks = sleep_hooks(connector)
    if hooks is None:
        return check_entry(SKIP, reason=f"vLLM {vllm_version()}'s connector API has no "
                                        "unregister_kv_caches / restore_kv_caches")
    unregister, restore = hooks
    stage("sleep")
    unregister()
    left = probe.registered()
    cache.release_physical()
    cache.recommit()
    fill_committed(cache, rng)
    stage("wake")
    restore()
    after = _committed_checks(probe, connector, cache, views, extents)
    stage(f"{probe.exercise_name} after wake")
    moved = _exercise(probe, connector, cache, extents, block_ids, rng)
    ok = not left and after["status"] == PASS and moved["status"] in (PASS, SKIP)
    return check_entry(PASS if ok else FAIL, **{
        "registered_while_asleep_bytes": sum(n for _, n in left),
        "registered_after_wake_bytes": after["registered_bytes"],
        "outside_after_wake": after["ranges_outside"] + after["regions_outside"]
        + after.get("views_reaching_uncommitted", 0),
        probe.exercise_name: moved["status"]})


def _inspect(probe: ConnectorProbe, connector: Any, cache: Any, views: dict[str, Any],
             extents: list[tuple[int, int]], result: dict[str, Any]) -> None:
    """What the connector registered (into ``result["registration"]``, relative to the
    reservation), ``committed_only`` and ``block_geometry`` (skipped where the probe
    cannot tell)."""
    checks, unchecked = result["checks"], result["unchecked"]
    regions = probe.regions(connector)
    base = cache.tensors[0].base_ptr
    result["registration"] = {  # relative to the reservation: comparable across runs
        "regions": [[r.base - base, r.block_len, r.block_stride, r.num_blocks]
                    for r in regions],
        "ranges": [[a - base, n] for a, n in probe.registered()]}
    checks["committed_only"] = _committed_checks(probe, connector, cache, views, extents)
    if "block_geometry" in unchecked:
        checks["block_geometry"] = check_entry(SKIP, reason=unchecked["block_geometry"])
    else:
        kv_runs = [(r.base_ptr, r.block_len, r.block_stride)
                   for r in cache.committed_regions()]
        checks["block_geometry"] = _block_geometry(regions, kv_runs)


def run_case(spec: dict[str, Any], stage: Stage, report: Report | None = None
             ) -> dict[str, Any]:
    """Run one case; ``stage(name)`` is called before each step and ``report(check,
    value)`` after each check (the parent keeps both if this process dies). Returns the
    case's JSON result; ``unchecked`` names, in words, what could not be checked."""
    from kvconnect.vllm.runtime import init_single_process_group

    s = {**CASE_DEFAULTS, **spec}
    result: dict[str, Any] = {"connector": s["connector"], "layout": s["layout"],
                              "num_blocks": s["num_blocks"],
                              "capacity_blocks": s["capacity_blocks"], "device": s["device"]}
    _prepare_device(s["device"], result)
    from vllm.config import set_current_vllm_config

    result["checks"] = _Checks(report)
    rng = random.Random(s["seed"])
    tmp = s.get("workdir") or tempfile.mkdtemp(prefix="kvconnect-conformance-")
    stage("setup")
    vc, kv_cfg, cls = _build(s, tmp)
    probe = probe_for(cls, s["device"])
    result["probe"] = probe.kind
    result["unchecked"] = dict(probe.limits)
    with set_current_vllm_config(vc):
        init_single_process_group(f"{tmp}/dist")
        probe.install()
        cache = _committed_cache(s, kv_cfg, rng, result)
        stage("construct")
        connector = _construct(vc, cache, result["checks"])
        if connector is not None:
            _check_connector(probe, connector, cache, s, rng, stage, result)
    return result


def _prepare_device(device: str, result: dict[str, Any]) -> None:
    """vLLM's platform for ``device`` (the shims it needed go into ``result``); on CUDA,
    this process's device (only here: the parent never touches CUDA)."""
    from kvconnect.vllm.runtime import is_cuda_device, prepare_runtime

    shims = prepare_runtime(device)
    if shims:
        result["extension_shims"] = shims
    if is_cuda_device(device):
        import torch

        torch.cuda.set_device(torch.device(device))


def _committed_cache(s: dict[str, Any], kv_cfg: Any, rng: random.Random,
                     result: dict[str, Any]) -> Any:
    """The case's VllmKVCache: ``capacity_blocks`` reserved, ``num_blocks`` committed (in
    two steps) and filled with random bytes; its sizes go into ``result`` (bytes)."""
    from kvconnect.vllm.cache import VllmKVCache

    cache = VllmKVCache(kv_cfg, s["device"], layout=s["layout"],
                        capacity_blocks=s["capacity_blocks"])
    cache.allocate()
    cache.ensure_kv_cache_blocks(max(1, s["num_blocks"] // 2))
    cache.extend_kv_cache(s["num_blocks"])
    fill_committed(cache, rng)
    result["reserved_bytes"] = cache.tensors[0].capacity_bytes
    result["committed_bytes"] = sum(n for _, n in cache.committed_extents())
    return cache


def _construct(vc: Any, cache: Any, checks: _Checks) -> Any:
    """The connector in vLLM's worker role, through ``KVConnectorFactory``; None (the
    ``register`` check says why) when constructing it raised."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    try:
        return KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER,
                                                   cache.connector_config())
    except Exception as exc:
        checks["register"] = check_entry(FAIL, stage="construct", error=_error(exc))
        return None


def _check_connector(probe: ConnectorProbe, connector: Any, cache: Any, s: dict[str, Any],
                     rng: random.Random, stage: Stage, result: dict[str, Any]) -> None:
    """Register the cache with the connector, then every check (see the module docstring)
    into ``result``; the connector is shut down at the end."""
    checks, unchecked = result["checks"], result["unchecked"]
    extents = cache.committed_extents()
    stage("register")
    views = cache.kv_caches()
    if not _register(connector, views, checks):
        return
    stage("inspect")
    _inspect(probe, connector, cache, views, extents, result)
    block_ids = sorted(rng.sample(range(s["num_blocks"]), s["transfer_blocks"]))
    stage(probe.exercise_name)
    checks[probe.exercise_name] = _exercise(probe, connector, cache, extents, block_ids, rng)
    checks["sleep_wake"] = _sleep_wake(probe, connector, cache, views, extents, block_ids,
                                       rng, stage)
    if checks["sleep_wake"]["status"] == SKIP:
        unchecked["sleep_wake"] = checks["sleep_wake"]["reason"]
    stage("shutdown")
    connector.shutdown()
