#!/usr/bin/env bash
# One batched GPU session (e.g. nightly GPU CI, or the lent H200 machines): installs kvconnect
# (and NIXL from carried wheels in .whl/ when present), then runs every `gpu` test, the
# benchmarks and kvconnect-validate on CUDA. Everything is logged under $OUT (default
# ./gpu-out). Each step has its own time limit; a failing step does not stop the others.
#
#   bash scripts/gpu_session.sh            # quick: tests, benchmarks, 1P1D
#   KVC_FULL=1 bash scripts/gpu_session.sh # also the offload benchmark and 2P2D
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }

{
  step environment
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && echo "NIXL installed from .whl/"
  fi
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . && echo "kvconnect installed"
  $PY - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count())
try:
    import nixl_cu13 as n; print("nixl-cu13 from", n.__file__)
except ImportError as e:
    print("NIXL missing:", e)
EOF
} > "$OUT/env.log" 2>&1

step "gpu tests" | tee "$OUT/pytest_gpu.log"
timeout 200 $PY -m pytest tests -m gpu -q -rs -p no:cacheprovider >> "$OUT/pytest_gpu.log" 2>&1
echo "pytest exit $?" >> "$OUT/pytest_gpu.log"

{
  step "bench_commit cuda:0 (100 GiB)"
  timeout 150 $PY benchmarks/bench_commit.py --device cuda:0 --repeats 3 --out "$OUT/commit-h200.md"
  echo "bench_commit exit $?"
  if [ -n "${KVC_FULL:-}" ]; then
    step "bench_offload cuda:0"
    timeout 120 $PY benchmarks/bench_offload.py --device cuda:0 --out "$OUT/offload-h200.md"
    echo "bench_offload exit $?"
  fi
} > "$OUT/bench.log" 2>&1

{
  step "kvconnect-validate 1P1D cuda (prefill GPU0, decode GPU1 where two GPUs exist)"
  timeout 180 $PY -m kvconnect.harness.cli --device cuda --prefill 1 --decode 1 --plain \
    --layout llama3-8b-like --num-layers 32 --num-blocks 2048 --timeout 120 \
    --json "$OUT/validate-1p1d.json"
  echo "validate 1P1D exit $?"
  if [ -n "${KVC_FULL:-}" ]; then
    step "kvconnect-validate 2P2D cuda"
    timeout 240 $PY -m kvconnect.harness.cli --device cuda --prefill 2 --decode 2 --plain \
      --timeout 120 --json "$OUT/validate-2p2d.json"
    echo "validate 2P2D exit $?"
  fi
} > "$OUT/validate.log" 2>&1
tail -n 5 "$OUT"/*.log
