#!/usr/bin/env bash
# Nightly GPU run: every `gpu` test, a kvconnect-validate matrix (layouts x 1P1D / 2P2D), the
# transfer and offload benchmarks, then ratio floors over all of it (each floor a ratio to a
# reference copy measured in the same run, never absolute GB/s). JSON + JUnit + logs land in
# one artifacts folder; exit status is non-zero when any step or floor fails.
#
#   ARTIFACTS=out bash scripts/nightly-gpu.sh
#
# Environment: ARTIFACTS (default ./gpu-artifacts), PYTHON (python3), KVC_INSTALL=0 to use the
# kvconnect already importable (default: pip install --no-deps -e . and NIXL from .whl/ when
# wheels are there), KVC_QUICK=1 for a shorter matrix (what a lent single-GPU call can fit),
# KVC_SWEEP=1 to compare the copy kernel's launch shapes first (bench_transfer --sweep),
# KVC_FLOORS="validate:ipc=0.5 transfer:ipc/kernel=0.7" to override floors. The vllm-conformance
# step runs the conformance kit on cuda:0 (vLLM's offload connectors, stock vs kvconnect's)
# when vLLM is importable, and records "skipped: vLLM not installed" otherwise (never a failure);
# the vllm-engine step likewise runs the real-engine tests of kvconnect's vLLM plugin on CUDA
# (tests/test_engine_*.py, KVCONNECT_ENGINE_DEVICE=cuda; host-memory checks skip there).
set -u
ART=${ARTIFACTS:-$PWD/gpu-artifacts}
mkdir -p "$ART"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
FAILED=()
STEPS=()

step() {  # name, time limit (s), command...: log to $ART/<name>.log, record rc and time
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
  if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash
    export -f "$1"
    export PY
    timeout --kill-after=10 "$limit" bash -c "$*" > "$ART/$name.log" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@" > "$ART/$name.log" 2>&1
  fi
  rc=$?
  STEPS+=("| $name | $rc | $(( $(date +%s) - start )) |")
  echo "    rc=$rc in $(( $(date +%s) - start )) s"
  tail -n 3 "$ART/$name.log" | sed 's/^/    /'
  if [ "$rc" -ne 0 ]; then FAILED+=("$name (rc $rc)"); fi
}

install() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1
    echo "NIXL installed from .whl/"
  fi
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
  echo "kvconnect installed"
}

environment() {
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  $PY - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count())
for mod in ("triton", "nixl_cu13", "matplotlib", "cuda.bindings"):
    try:
        m = __import__(mod, fromlist=["x"])
        print(mod, getattr(m, "__version__", "present"))
    except ImportError as e:
        print(mod, "missing:", e)
EOF
}

validate() {  # name, then kvconnect-validate arguments
  local name=$1
  shift
  step "$name" 240 $PY -m kvconnect.harness.cli --device cuda --plain --timeout 120 \
    --json "$ART/$name.json" --junit "$ART/$name.xml" "$@"
}

if [ "${KVC_INSTALL:-1}" != 0 ]; then step install 300 install; fi
step environment 60 environment
step pytest-gpu 300 $PY -m pytest tests -m gpu -q -rs -p no:cacheprovider \
  --junitxml="$ART/pytest-gpu.xml"

validate validate-1p1d-llama-1gib --prefill 1 --decode 1 --layout llama3-8b-like \
  --num-layers 32 --num-blocks 2048 --transfer-blocks 512
validate validate-2p2d-llama --prefill 2 --decode 2 --layout llama3-8b-like \
  --num-layers 32 --num-blocks 1024 --transfer-blocks 128
if [ -z "${KVC_QUICK:-}" ]; then
  validate validate-1p1d-llama-48mib --prefill 1 --decode 1 --layout llama3-8b-like \
    --num-layers 32 --num-blocks 2048 --transfer-blocks 24
  validate validate-1p1d-mla --prefill 1 --decode 1 --layout deepseek-mla-like \
    --num-layers 27 --num-blocks 1024 --transfer-blocks 256
  validate validate-1p1d-hybrid --prefill 1 --decode 1 --layout jamba-hybrid-like \
    --num-layers 32 --num-blocks 512 --transfer-blocks 128
fi

if [ -n "${KVC_QUICK:-}" ]; then
  BT=(--block-kib 16 32 256 2048 --request-mib 48 128 512 2048 --iters 5)
else
  BT=(--block-kib 16 32 64 256 2048 --request-mib 32 48 128 512 2048 --iters 9)
fi
BT+=(--latency-blocks 1 4 16)  # decode-sized fetches: p50 / p99 against a plain copy
if [ -n "${KVC_SWEEP:-}" ]; then BT+=(--sweep); fi
step bench-transfer 420 $PY benchmarks/bench_transfer.py --nixl "${BT[@]}" \
  --json "$ART/bench_transfer.json" --png "$ART/bench_transfer.png"
step bench-offload 300 $PY benchmarks/bench_offload.py --device cuda:0 \
  --batch 4 16 64 256 --slots runs scattered --path direct staged --iters 9 \
  --out "$ART/bench_offload.md" --json "$ART/bench_offload.json"

vllm_conformance() {  # the kit on CUDA where vLLM is installed; a skip (rc 0) where it is not
  if ! $PY -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
    echo "skipped: vLLM not installed"
    return 0
  fi
  $PY -m kvconnect.vllm.conformance.cli --stock-and-patched --device cuda:0 --timeout 120 \
    --jsonl "$ART/vllm-conformance.jsonl" --json "$ART/vllm-conformance.json" \
    --markdown "$ART/vllm-conformance.md"
  local rc=$?
  [ "$rc" -gt 1 ] && return "$rc"  # 1 only says a case did not pass: stock ones are expected to
  $PY - "$ART/vllm-conformance.json" <<'EOF'
import json, sys
bad = [(r["connector"], r["layout"], r["status"]) for r in json.load(open(sys.argv[1]))["results"]
       if r["connector"].startswith("kvconnect.vllm:") and r["status"] not in ("pass", "refused")]
print("kvconnect's connectors:", "all pass or refused" if not bad else f"NOT PASSING {bad}")
sys.exit(1 if bad else 0)
EOF
}
export ART
step vllm-conformance 600 vllm_conformance

vllm_engine() {  # real engines with kvconnect's plugin on cuda:0; a skip (rc 0) without vLLM
  if ! $PY -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
    echo "skipped: vLLM not installed"
    return 0
  fi
  KVCONNECT_ENGINE_DEVICE=cuda $PY -m pytest -m engine -q -rs -p no:cacheprovider \
    tests/test_engine_plugin.py tests/test_engine_connectors.py --junitxml="$ART/vllm-engine.xml"
}
step vllm-engine 1200 vllm_engine

FLOOR_ARGS=()
for f in ${KVC_FLOORS:-}; do FLOOR_ARGS+=(--floor "$f"); done
shopt -s nullglob
step floors 60 $PY scripts/ratio_floors.py --validate "$ART"/validate-*.json \
  --transfer "$ART/bench_transfer.json" --offload "$ART/bench_offload.json" \
  "${FLOOR_ARGS[@]}" --junit "$ART/floors.xml" --json "$ART/floors.json"

{
  echo "# kvconnect nightly GPU run"
  echo
  echo "- when: $(date -u +%Y-%m-%dT%H:%M:%SZ); host: $(hostname)"
  echo "- GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | paste -sd, -)"
  echo "- command: ARTIFACTS=$ART KVC_QUICK=${KVC_QUICK:-} KVC_SWEEP=${KVC_SWEEP:-} bash scripts/nightly-gpu.sh"
  echo
  echo "| step | exit | seconds |"
  echo "| --- | ---: | ---: |"
  printf '%s\n' "${STEPS[@]}"
  echo
  echo '```'
  cat "$ART/floors.log" 2>/dev/null
  echo '```'
  echo
  if [ ${#FAILED[@]} -eq 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL: ${FAILED[*]}"; fi
} > "$ART/summary.md"
cat "$ART/summary.md"
[ ${#FAILED[@]} -eq 0 ]
