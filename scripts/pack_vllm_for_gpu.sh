#!/usr/bin/env bash
# Pack vLLM 0.33 and NIXL for a GPU machine that has neither and no registry (the lent H200:
# torch 2.11+cu130, Python 3.12, 64 MiB per run, working tree included). On a GPU node that
# reaches a registry, install vLLM's CUDA wheel the ordinary way instead (docs/vllm-plugin.md).
#
#   make .venv-vllm/.installed && bash scripts/pack_vllm_for_gpu.sh   # here
#   bash scripts/gpu_vllm_setup.sh && . /tmp/kvc-vllm/env.sh         # there (one run)
#
# Writes .vllm-carry/ (git-ignored; name it in the device call's `carry`):
# - vllm-src.tar.xz   vLLM's Python sources and dist-info, no compiled extensions
# - vllm-ops.tar.xz   vllm/_C_stable_libtorch.abi3.so (its compiled ops, built on libtorch's
#                     stable ABI: they load on the image's torch 2.11) with device code for
#                     GPU_SM only (scripts/prune_fatbin.py: 92.6 MB -> ~17 MB of xz), and
#                     vllm/cumem_allocator.abi3.so (vLLM's sleep mode)
# - nixl.tar.xz       nixl-cu13's Python package, UCX plugin and UCX (scripts/nixl_closure.py),
#                     plus the `nixl` meta package vLLM imports (`nixl._api`)
# - wheels/           the pure or cp312 wheels vLLM imports that the GPU image lacks
# - manifest.json     versions, sizes, the fatbin summary; MANIFEST.txt the same for people
# Flash attention is not carried (308 + 173 MB): scripts/vllm_flash_attn_absent.py stands in.
#
# Environment: VLLM_VENV (.venv-vllm: vLLM's files and versions come from there), CARRY
# (.vllm-carry), GPU_SM (90; "all" keeps every architecture: the ops then go to
# .vllm-carry-ops/ and must travel in a run of their own, about 61 MiB), LIMIT_MIB (64: fail
# when the carry plus the tracked files would exceed what one device run takes).
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
CARRY=${CARRY:-.vllm-carry}
GPU_SM=${GPU_SM:-90}
LIMIT_MIB=${LIMIT_MIB:-64}
PYVER=3.12  # the GPU image's Python
PY=$VENV/bin/python
[ -x "$PY" ] || { echo "no $PY: run 'make .venv-vllm/.installed' first" >&2; exit 2; }
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VERSION=$($PY -c 'from importlib.metadata import version; print(version("vllm"))')
NIXL_VERSION=1.5.1
HERE=$(cd "$(dirname "$0")" && pwd)

# Imported by an engine (found by importing until nothing was missing: the conformance kit's
# path, then real engines on the H200, gpu-facts.md 2026-12-02) and absent from the GPU image.
# Versions: those of $VENV where it has them, else vLLM 0.33's pin or the newest.
# Present there, not carried: numpy, transformers, torch, triton, cuda-bindings, aiohttp,
# requests, pillow, psutil, regex, pyyaml, cloudpickle, einops, uvloop, rich, tqdm,
# prometheus-client, py-cpuinfo, safetensors, tokenizers, huggingface-hub, sentencepiece.
WHEELS=(pyzmq cbor2 msgspec pybase64 cachetools partial-json-parser pydantic pydantic-core
        annotated-types typing-inspection fastapi starlette sniffio openai jiter httpx2 httpcore2
        truststore oss-harmony llguidance xgrammar apache-tvm-ffi)
PINNED=(compressed-tensors==0.17.0 loguru blake3 orjson ijson setproctitle depyf==0.20.0 astor
        python-json-logger watchfiles gguf diskcache lark==1.2.2)

rm -rf "$CARRY"
mkdir -p "$CARRY/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "vLLM $VERSION sources from $SITE"
# compiled extensions, the 58 MB vllm-rs binary and C++ sources (JIT kernels) stay behind
tar cf - -C "$SITE" --exclude='*.so' --exclude=__pycache__ --exclude='vllm/vllm-rs' \
  --exclude='*.h' --exclude='*.hpp' --exclude='*.cuh' --exclude='*.inl' --exclude='*.cu' \
  --exclude='*.cpp' vllm "vllm-$VERSION.dist-info" | xz -6 -T2 > "$CARRY/vllm-src.tar.xz"

mkdir -p "$work/ops/vllm"
cp "$SITE/vllm/cumem_allocator.abi3.so" "$work/ops/vllm/"
OPS_DIR=$CARRY
if [ "$GPU_SM" = all ]; then
  cp "$SITE/vllm/_C_stable_libtorch.abi3.so" "$work/ops/vllm/"
  echo '{"sm": "all"}' > "$work/fatbin.json"
  OPS_DIR=${CARRY}-ops  # ~61 MiB: a device run of its own
  rm -rf "$OPS_DIR" && mkdir -p "$OPS_DIR"
else
  python3 "$HERE/prune_fatbin.py" "$SITE/vllm/_C_stable_libtorch.abi3.so" \
    "$work/ops/vllm/_C_stable_libtorch.abi3.so" --sm "$GPU_SM" > "$work/fatbin.json"
fi
tar cf - -C "$work/ops" vllm | xz -6 -T2 > "$OPS_DIR/vllm-ops.tar.xz"

pins=()
for name in "${WHEELS[@]}"; do
  v=$($PY -c "from importlib.metadata import version; print(version('$name'))" 2>/dev/null) \
    || { echo "$name is not in $VENV: not carried"; continue; }
  pins+=("$name==$v")
done
pins+=("${PINNED[@]}" "nixl==$NIXL_VERSION")
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$@"
}
download -d "$CARRY/wheels" "${pins[@]}"

download -d "$work/nixl-wheel" "nixl-cu13==$NIXL_VERSION"
mkdir -p "$work/nixl"
(cd "$work/nixl" && python3 -m zipfile -e "$work"/nixl-wheel/nixl_cu13-*.whl .)
python3 "$HERE/nixl_closure.py" "$work/nixl" > "$work/nixl-files.txt"
python3 "$HERE/nixl_closure.py" "$work/nixl" --json > "$work/nixl.json"
tar cf - -C "$work/nixl" -T "$work/nixl-files.txt" | xz -6 -T2 > "$CARRY/nixl.tar.xz"

tracked=$(git ls-files -z | du -cb --files0-from=- | tail -n 1 | cut -f1)
total=$(du -sb "$CARRY" | cut -f1)
python3 - "$CARRY" "$VERSION" "$work/fatbin.json" "$work/nixl.json" "$tracked" "$total" \
  "$OPS_DIR" "${pins[@]}" <<'EOF'
import json, os, sys
carry, version, fatbin, nixl, tracked, total, ops_dir, *pins = sys.argv[1:]
sizes = {os.path.relpath(os.path.join(d, f), carry): os.path.getsize(os.path.join(d, f))
         for d, _, fs in os.walk(carry) for f in fs}
doc = {"vllm": version, "nixl_cu13": "1.5.1", "ops_dir": ops_dir, "pins": pins,
       "fatbin": json.load(open(fatbin)),
       "nixl_files": {k: v for k, v in json.load(open(nixl)).items() if k != "sizes"},
       "carry_bytes": int(total), "tracked_bytes": int(tracked), "sizes": sizes}
json.dump(doc, open(os.path.join(carry, "manifest.json"), "w"), indent=1)
with open(os.path.join(carry, "MANIFEST.txt"), "w") as f:
    f.write(f"vllm {version} (sources; ops for sm {doc['fatbin']['sm']}); nixl-cu13 1.5.1 "
            f"(UCX closure, {doc['nixl_files']['files']} files)\n")
    f.writelines(p + "\n" for p in pins)
    f.writelines(f"{n} {s}\n" for n, s in sorted(sizes.items()))
EOF
mib=$(( (total + tracked) / 1048576 ))
echo "carry: $CARRY, $(ls "$CARRY/wheels" | wc -l) wheels, $total bytes; with the tracked" \
  "files $((total + tracked)) bytes ($mib MiB; one device run takes $LIMIT_MIB MiB)"
if [ "$OPS_DIR" != "$CARRY" ]; then
  echo "ops: $OPS_DIR/vllm-ops.tar.xz, $(du -b "$OPS_DIR/vllm-ops.tar.xz" | cut -f1) bytes:" \
    "carry it alone first (scripts/gpu_vllm_setup.sh --ops-only)"
fi
if [ $((total + tracked)) -ge $((LIMIT_MIB * 1048576)) ]; then
  echo "the carry and the tracked files exceed $LIMIT_MIB MiB" >&2
  exit 1
fi
