"""Keep one GPU architecture's device code in a CUDA shared library, zeroing the rest, so the
library compresses to a size that travels (scripts/pack_vllm_for_gpu.sh).

vLLM's ``_C_stable_libtorch.abi3.so`` is 92.6 MB, 62 MB of it device code (``.nv_fatbin``)
for eight architectures; already compressed, it packs to about 61 MiB with xz, which fills
a 64 MiB carry on its own. A GPU loads only the machine code (cubin) of its own
architecture, or JIT-compiles PTX where no cubin fits. This tool walks every fatbin in the
section and overwrites with zeros the payload of

- every cubin whose architecture is not ``--sm`` (sm_90 for an H100 / H200), and
- every PTX entry of a fatbin that also holds a cubin for ``--sm`` (that cubin is what the
  driver loads; PTX of fatbins without one is kept, for the driver to JIT).

Headers, sizes and offsets stay as they were, so the file layout is unchanged; zeros then
compress to almost nothing. The result runs only on GPUs of that architecture: it is a
carry for one lent machine, not a build to distribute. The walk checks that every fatbin's
entries end exactly at its declared size, and refuses (exit 2) a file it does not
understand. Prints a JSON summary (bytes per architecture, kept and zeroed)::

    python scripts/prune_fatbin.py IN.so OUT.so --sm 90
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections import Counter
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
#: fatbin header: magic u32, version u16, header size u16, payload size u64
FATBIN_HEADER = struct.Struct("<IHHQ")
#: entry header start: kind u16 (1 PTX, 2 cubin), version u16, header size u32, payload u64
ENTRY_HEADER = struct.Struct("<HHIQ")
ENTRY_ARCH_OFFSET = 28
KIND_NAMES = {1: "ptx", 2: "cubin"}


class FatbinError(ValueError):
    """The file is not an ELF with fatbins laid out as this tool expects."""


def section(data: bytes | bytearray, name: str) -> tuple[int, int]:
    """``(file offset, size)`` of the ELF64 little-endian section ``name``."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    strtab_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        hdr = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, hdr)
        end = data.index(b"\0", strtab_off + name_off)
        if data[strtab_off + name_off:end].decode() == name:
            offset, size = struct.unpack_from("<QQ", data, hdr + 0x18)
            return offset, size
    raise FatbinError(f"no {name} section")


def _entries(data: bytes | bytearray, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """``(kind, arch, payload offset, payload size)`` of one fatbin's entries."""
    out, pos = [], start
    while pos < end:
        kind, _, header_size, size = ENTRY_HEADER.unpack_from(data, pos)
        if kind not in KIND_NAMES or header_size < ENTRY_ARCH_OFFSET + 4:
            raise FatbinError(f"unexpected fatbin entry at {pos:#x} (kind {kind})")
        arch, = struct.unpack_from("<I", data, pos + ENTRY_ARCH_OFFSET)
        out.append((kind, arch, pos + header_size, size))
        pos += header_size + size
    if pos != end:
        raise FatbinError(f"fatbin entries end at {pos:#x}, not at its declared end {end:#x}")
    return out


def prune(data: bytearray, sm: int) -> dict[str, object]:
    """Zero, in place, what an ``sm`` GPU never loads (module docstring); returns a summary."""
    offset, size = section(data, ".nv_fatbin")
    kept: Counter[str] = Counter()
    zeroed: Counter[str] = Counter()
    pos, end, fatbins = offset, offset + size, 0
    while pos + FATBIN_HEADER.size <= end:
        magic, _, header_size, payload = FATBIN_HEADER.unpack_from(data, pos)
        if magic != FATBIN_MAGIC:  # padding between fatbins (8-byte aligned)
            pos += 8
            continue
        fatbins += 1
        entries = _entries(data, pos + header_size, pos + header_size + payload)
        has_cubin = any(kind == 2 and arch == sm for kind, arch, _, _ in entries)
        for kind, arch, start, n in entries:
            key = f"{KIND_NAMES[kind]}_{arch}"
            if (kind == 2 and arch != sm) or (kind == 1 and has_cubin):
                data[start:start + n] = bytes(n)
                zeroed[key] += n
            else:
                kept[key] += n
        pos += header_size + payload
    if not fatbins:
        raise FatbinError("no fatbin found in .nv_fatbin")
    if not any(k == f"cubin_{sm}" for k in kept):
        raise FatbinError(f"no sm_{sm} cubin in this library: it would not run there")
    return {"sm": sm, "fatbins": fatbins, "section_bytes": size,
            "kept_bytes": dict(sorted(kept.items())), "zeroed_bytes": dict(sorted(zeroed.items())),
            "kept_total": sum(kept.values()), "zeroed_total": sum(zeroed.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--sm", type=int, required=True, help="architecture to keep (90: H100/H200)")
    args = ap.parse_args(argv)
    data = bytearray(args.src.read_bytes())
    try:
        summary = prune(data, args.sm)
    except (FatbinError, struct.error, IndexError) as exc:
        print(f"prune_fatbin: {args.src}: {exc}", file=sys.stderr)
        return 2
    args.dst.write_bytes(data)
    args.dst.chmod(args.src.stat().st_mode & 0o777)
    print(json.dumps({"src": str(args.src), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
