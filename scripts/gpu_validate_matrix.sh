#!/usr/bin/env bash
# kvconnect-validate on CUDA at transfer sizes that measure bandwidth, 1P1D and 2P2D, plus the
# NIXL connector's gpu tests; logs and JSON reports under $OUT (default ./gpu-out).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && echo "NIXL installed from .whl/"
  fi
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . && echo "kvconnect installed"
  timeout 120 $PY -m pytest tests/test_nixl_connector.py -m gpu -v -rs -p no:cacheprovider
  echo "pytest exit $?"
} > "$OUT/nixl_gpu_tests.log" 2>&1
run() {  # name, then kvconnect-validate arguments
  local name=$1; shift
  echo "=== kvconnect-validate $*" > "$OUT/$name.log"
  timeout 150 $PY -m kvconnect.harness.cli --device cuda --plain --timeout 120 \
    --json "$OUT/$name.json" "$@" >> "$OUT/$name.log" 2>&1
  echo "exit $?" >> "$OUT/$name.log"
}
run validate-1p1d-1gib --prefill 1 --decode 1 --layout llama3-8b-like --num-layers 32 \
  --num-blocks 2048 --transfer-blocks 512
run validate-2p2d --prefill 2 --decode 2 --layout llama3-8b-like --num-layers 32 \
  --num-blocks 1024 --transfer-blocks 256
tail -n 12 "$OUT"/*.log
