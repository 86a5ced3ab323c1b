"""Helper for tests/test_nixl_connector.py: the prefill side of a two-process NIXL test.

Run as a script, it holds host-backend ExtensibleKVCaches filled with position-dependent
content and one NixlRegionWorker per cache, and answers JSON-line commands
(tests/_json_peer.py). Imported, it provides the fill / check helpers both processes share.

Commands: ``setup`` (layouts -> metadata), ``notifs`` (wait for notifications), ``stall``
(stop serving NIXL for a while: reply, sleep, reply again), ``sleep_wake``
(release_physical + recommit + refill + reregister -> new metadata), ``close`` (close workers
and report whether NIXL still knows their memory), ``exit``. Its hello: ``ready``.
"""

from __future__ import annotations

import ctypes
import sys
import time
import zlib
from typing import Any

import numpy as np

# -- shared helpers ---------------------------------------------------------------------------

def block_pattern(key: str, block_id: int, length: int, seed: int) -> np.ndarray:
    """Content of block ``block_id`` of region ``key``: depends on the seed, the region, the
    block and each byte's position, so a block landing anywhere else is detected."""
    k = np.uint32(zlib.crc32(f"{seed}:{key}:{block_id}".encode()))
    x = np.arange(length, dtype=np.uint32) * np.uint32(2654435761) + k
    return ((x >> np.uint32(11)) ^ x).astype(np.uint8)


def region_key(region: Any) -> str:
    return f"{region.layer_name}/{region.part}"


def block_array(region: Any, block_id: int) -> np.ndarray:
    """A writable numpy view of one committed block (host memory only)."""
    buf = (ctypes.c_uint8 * int(region.block_len)).from_address(region.block_address(block_id))
    return np.ctypeslib.as_array(buf)


def block_view(cache: Any, region: Any, block_id: int) -> Any:
    """A uint8 torch view of one committed block, on the cache's device."""
    start = block_id * region.block_stride
    return cache.region_view(region)[start:start + region.block_len]


def read_block(cache: Any, region: Any, block_id: int) -> np.ndarray:
    """A host copy of one committed block (any device)."""
    return block_view(cache, region, block_id).cpu().numpy()


def fill_cache(cache: Any, seed: int) -> None:
    """Write :func:`block_pattern` into every committed block of every transfer region
    (regions aliasing the same pages, as hybrid layers sharing a KV tensor do, count once)."""
    import torch

    from kvconnect.connectors.nixl.descriptors import transfer_regions

    for region in transfer_regions(cache.committed_regions()):
        view = cache.region_view(region)
        rows = np.stack([block_pattern(region_key(region), b, region.block_len, seed)
                         for b in range(region.num_blocks)])
        src = torch.from_numpy(rows).to(view.device)
        if region.block_stride == region.block_len:
            view.copy_(src.reshape(-1))
        else:
            for b in range(region.num_blocks):
                block_view(cache, region, b).copy_(src[b])
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


def sample_metadata() -> Any:
    """A valid handshake document of a two-region (K, V) peer, built by hand (no NIXL)."""
    from kvconnect.connectors.nixl.handshake import HandshakeMetadata, RegionAddress
    from kvconnect.peer_layout import LayoutRegion, PeerLayout

    layout = PeerLayout(regions=(LayoutRegion("layer0", "k", 4096, 4096),
                                 LayoutRegion("layer0", "v", 4096, 4096)), num_blocks=8,
                        block_size=16, dtype="bfloat16", layout="kv_split_nhd",
                        layer_names=("layer0",))
    return HandshakeMetadata(engine_id="p", agent_name="p-1", agent_metadata=b"\x00\x01md",
                             memory_type="DRAM", layout=layout,
                             regions=(RegionAddress(1 << 40), RegionAddress(1 << 41)),
                             registrations=((1 << 40, 32768, 0), (1 << 41, 32768, 0)),
                             generation=3)


def make_cache(spec: dict[str, Any]) -> Any:
    """An ExtensibleKVCache taken through the seeds' commit protocol.

    ``spec``: preset, overrides, num_blocks, capacity_blocks, warmup_blocks, single_handle,
    final (False stops after the warm-up commit), device (default ``"cpu"``: host backend).
    """
    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset
    from kvconnect.vmm import AllocationOptions

    cfg = preset(spec["preset"], num_blocks=spec["num_blocks"], **spec.get("overrides", {}))
    device = spec.get("device", "cpu")
    cache = ExtensibleKVCache(cfg, device=device, capacity_blocks=spec["capacity_blocks"],
                              options=AllocationOptions(shareable=device != "cpu"))
    try:
        cache.allocate()
        cache.ensure_kv_cache_blocks(spec.get("warmup_blocks", 3))
        if spec.get("final", True):
            cache.extend_kv_cache(spec["num_blocks"], single_handle=spec.get("single_handle", True))
    except BaseException:
        cache.close()
        raise
    return cache


# -- the prefill process ----------------------------------------------------------------------

def _nixl_knows(agent: Any, extents: list[tuple[int, int, int]], mem_type: str) -> list[bool]:
    """Whether NIXL still accepts local descriptors over each extent (i.e. it is registered)."""
    out = []
    for addr, length, dev in extents:
        try:
            h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr, length, dev)], mem_type)
        except Exception:  # noqa: BLE001 - nixlNotFoundError: not registered
            out.append(False)
        else:
            agent.release_dlist_handle(h)
            out.append(True)
    return out


def main() -> int:
    from _json_peer import reply, serve

    from kvconnect.connectors.nixl.worker import NixlRegionWorker

    caches: dict[str, Any] = {}
    workers: dict[str, NixlRegionWorker] = {}

    def serve_reads() -> None:  # no NIXL progress thread: serve peers' reads meanwhile
        for worker in workers.values():
            if worker.is_registered:
                worker.progress()

    def handle(cmd: dict[str, Any]) -> None:
        op = cmd.get("op")
        if op == "setup":
            metadata = {}
            for spec in cmd["layouts"]:
                name = spec["name"]
                caches[name] = make_cache(spec)
                fill_cache(caches[name], spec["seed"])
                workers[name] = NixlRegionWorker(f"prefill-{name}", progress_thread=False)
                workers[name].register_kv_cache(caches[name])
                metadata[name] = workers[name].metadata_json().decode()
            reply({"metadata": metadata})
        elif op == "notifs":
            got = []
            for _ in range(cmd["count"]):
                agent, msg = workers[cmd["name"]].wait_for_notification(cmd["wait_s"])
                got.append([agent, msg.decode()])
            reply({"notifs": got})
        elif op == "sleep_wake":
            name = cmd["name"]
            workers[name].deregister()
            caches[name].release_physical()
            caches[name].recommit()
            fill_cache(caches[name], cmd["seed"])
            md = workers[name].reregister()
            reply({"metadata": md.to_json().decode(), "generation": md.generation})
        elif op == "close":
            report = {}
            for name, worker in workers.items():
                agent, extents = worker._agent, worker.registered_extents
                mem_type = worker.memory_type
                worker.close()
                worker.close()  # idempotent
                report[name] = {"still_registered": _nixl_knows(agent, extents, mem_type),
                                "num_registrations": worker.num_registrations}
                del agent
            reply({"report": report})
        elif op == "stall":  # stop serving peers for a while (no NIXL progress)
            reply({})
            time.sleep(cmd["seconds"])
            reply({"stalled": cmd["seconds"]})
        else:
            reply({"ok": False, "error": f"unknown op {op!r}"})

    try:
        reply({"ready": True})
        return serve(handle, idle=serve_reads)
    finally:
        for worker in workers.values():
            worker.close()
        for cache in caches.values():
            cache.close()


if __name__ == "__main__":
    sys.exit(main())
