#!/usr/bin/env bash
# Pack vLLM 0.33 for the GPU machine (no registry there, 64 MiB carry): its Python sources
# without compiled extensions, plus the wheels of the modules it imports on the conformance
# kit's path that the GPU image lacks (KINDS.md, "Python packages already there"). Output:
# .vllm-carry/ (git-ignored): vllm-src.tar.gz, wheels/*.whl, MANIFEST.txt. Prints the total.
#
#   bash scripts/pack_vllm_for_gpu.sh            # from .venv-vllm (make test-vllm builds it)
#
# Environment: VLLM_VENV (default .venv-vllm: where vLLM's sources and the versions come
# from), CARRY (default .vllm-carry), LIMIT_MB (default 60: fail above it).
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
CARRY=${CARRY:-.vllm-carry}
LIMIT_MB=${LIMIT_MB:-60}
PYVER=${PYTHON_VERSION:-3.12}  # the GPU image's Python
PY=$VENV/bin/python
[ -x "$PY" ] || { echo "no $PY: run make test-vllm first" >&2; exit 2; }
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VERSION=$($PY -c 'from importlib.metadata import version; print(version("vllm"))')

# Imported on the kit's path (found by importing until nothing was missing, on CPU, with
# vLLM's .so files removed) and absent from the GPU image. Versions: those of $VENV.
# Not carried, present there: numpy, transformers (5.17), torch, triton, cuda-bindings,
# aiohttp, requests, pillow, psutil, regex, pyyaml, cloudpickle, einops, uvloop, rich,
# prometheus-client, py-cpuinfo, safetensors, tokenizers, huggingface-hub.
WHEELS=(pyzmq cbor2 msgspec pybase64 cachetools partial-json-parser pydantic pydantic-core
        annotated-types typing-inspection fastapi starlette sniffio openai jiter httpx2 httpcore2
        truststore
        oss-harmony llguidance xgrammar apache-tvm-ffi)

rm -rf "$CARRY"
mkdir -p "$CARRY/wheels"
echo "vLLM $VERSION sources from $SITE"
# compiled extensions, the 58 MB vllm-rs binary and C++ headers (JIT kernels) stay behind
tar czf "$CARRY/vllm-src.tar.gz" -C "$SITE" --exclude='*.so' --exclude=__pycache__ \
  --exclude='vllm/vllm-rs' --exclude='*.h' --exclude='*.hpp' --exclude='*.cuh' \
  --exclude='*.inl' --exclude='*.cu' --exclude='*.cpp' vllm "vllm-$VERSION.dist-info"

pins=()
for name in "${WHEELS[@]}"; do
  v=$($PY -c "from importlib.metadata import version; print(version('$name'))" 2>/dev/null) \
    || { echo "$name is not in $VENV: not carried"; continue; }
  pins+=("$name==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$CARRY/wheels" "${pins[@]}"

{
  echo "vllm $VERSION (sources, no .so) from $SITE"
  printf '%s\n' "${pins[@]}"
  echo
  (cd "$CARRY" && ls -l vllm-src.tar.gz wheels/)
} > "$CARRY/MANIFEST.txt"
total=$(du -sb "$CARRY" | cut -f1)
echo "carry: $CARRY, $(ls "$CARRY/wheels" | wc -l) wheels, total $total bytes" \
  "($((total / 1048576)) MiB; limit ${LIMIT_MB} MB)"
if [ "$total" -gt $((LIMIT_MB * 1000 * 1000)) ]; then
  echo "carry exceeds ${LIMIT_MB} MB" >&2
  exit 1
fi
