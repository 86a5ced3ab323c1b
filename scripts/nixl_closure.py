"""The files of an unpacked ``nixl-cu13`` wheel that NIXL's UCX backend needs, for a carry
to a GPU machine without a registry (scripts/pack_vllm_for_gpu.sh).

The wheel is 56 MiB (238 MB unpacked), most of it code kvconnect and vLLM's NIXL connector
never load: the expert-parallel torch extensions (``nixl_ep_cu13``, 91 MB), object-store,
GDS and GPUNETIO plugins with their SDKs, UCX's perf-test modules. This lists the Python
package, its dist-info, the UCX plugin and UCX's transport modules (loaded by path at run
time), and everything those need by ``DT_NEEDED`` (read with ``readelf -d``, resolved inside
the wheel; system libraries stay the machine's). Every listed file is the wheel's own, byte
for byte. Prints one relative path per line; ``--json`` prints the sizes as well.

    python scripts/nixl_closure.py UNPACKED_WHEEL_DIR [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = "nixl_cu13"
#: NIXL's backend plugins kept (vLLM's NixlConnector and kvconnect use UCX only), where its
#: plugin manager looks for them (``$ORIGIN/plugins`` of libnixl.so)
PLUGINS = (f".{PACKAGE}.mesonpy.libs/plugins/libplugin_UCX.so",)
NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[(.+?)\]")
RUNPATH = re.compile(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[(.+?)\]")


def needed(path: Path, root: Path) -> list[Path]:
    """The libraries ``path`` needs that its RUNPATH finds inside the wheel at ``root``."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True).stdout
    dirs = [Path(d.replace("$ORIGIN", str(path.parent))) for m in RUNPATH.findall(out)
            for d in m.split(":")]
    found = []
    for name in NEEDED.findall(out):
        for d in dirs:
            lib = Path(os.path.normpath(d / name))
            if lib.is_file() and lib.is_relative_to(root):
                found.append(lib)
                break
    return found


def closure(root: Path) -> list[Path]:
    """Relative paths of what the UCX backend loads, from the unpacked wheel at ``root``."""
    root = root.resolve()
    pkg = root / PACKAGE
    if not pkg.is_dir():
        raise SystemExit(f"{root} holds no {PACKAGE}/: not an unpacked nixl-cu13 wheel")
    start = list(pkg.glob("*.so"))
    start += [root / plugin for plugin in PLUGINS]
    start += [p for p in root.glob(f"{PACKAGE}.libs/ucx/*.so*")
              if p.is_file() and "perftest" not in p.name]
    seen: set[Path] = set()
    todo = list(start)
    while todo:
        lib = todo.pop()
        if lib in seen:
            continue
        seen.add(lib)
        todo += needed(lib, root)
    files = seen | set(pkg.glob("*.py")) | set(pkg.glob("py.typed"))
    files |= {p for p in root.glob(f"{PACKAGE}-*.dist-info/*") if p.is_file()}
    return sorted(p.relative_to(root) for p in files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    files = closure(args.root)
    if args.json:
        sizes = {str(f): (args.root / f).stat().st_size for f in files}
        print(json.dumps({"files": len(files), "bytes": sum(sizes.values()), "sizes": sizes}))
    else:
        print("\n".join(map(str, files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
