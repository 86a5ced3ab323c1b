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
# KVC_FLOORS="validate:ipc=0.5 transfer:ipc/kernel=0.7" to override floors, KVC_ONLY="a b" to run
# only the steps named (a lent machine's 10-minute calls: e.g. the vllm-* steps in one call).
#
# vLLM steps. Where vLLM is installed (a GPU node that reaches a registry: pip install vllm)
# they use it; where the carry of scripts/pack_vllm_for_gpu.sh is in the checkout
# (.vllm-carry/, a machine without a registry), vllm-setup installs it first
# (scripts/gpu_vllm_setup.sh) and the later steps source its env.sh. Without either, each vLLM
# step says "SKIPPED: vLLM not installed" and the summary lists it as skipped, never passed:
# - vllm-probe: which engine settings the carried vLLM needs (scripts/gpu_vllm_settings_probe.py)
# - vllm-engine: the real-engine tests on CUDA (tests/test_engine_*.py, KVCONNECT_ENGINE_DEVICE=cuda)
# - vllm-pd: 1P1D engines, ipc / NIXL / stock, 1k-32k prompts (benchmarks/bench_vllm_pd.py)
# - vllm-pd-cross: the same across GPUs (prefill GPU0, decode GPU1) where two are visible
# - vllm-conformance: the kit on cuda:0, connector-API mode and engine mode (GPU rows); the
#   engine rows start two engines per connector and cache, one after another (about 50 s a
#   row on the H200): KVC_CONF_CACHES=extensible (or plain) runs half of them, for 10-minute calls
# KVC_PD_TOKENS="1024 8192" sets vllm-pd's prompt lengths.
set -u
ART=${ARTIFACTS:-$PWD/gpu-artifacts}
mkdir -p "$ART"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
FAILED=()
SKIPPED=()
STEPS=()
ONLY=" ${KVC_ONLY:-} "

wanted() { [ -z "${KVC_ONLY:-}" ] || [[ "$ONLY" == *" $1 "* ]]; }

step() {  # name, time limit (s), command...: log to $ART/<name>.log, record rc and time
  local name=$1 limit=$2 start rc
  shift 2
  wanted "$name" || return 0
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
  local why
  why=$(grep -m1 '^SKIPPED: ' "$ART/$name.log" | cut -c10-)
  if [ "$rc" -eq 0 ] && [ -n "$why" ]; then  # never counted as passed
    STEPS+=("| $name | skipped | $(( $(date +%s) - start )) | $why |")
    SKIPPED+=("$name")
  else
    STEPS+=("| $name | $rc | $(( $(date +%s) - start )) | |")
  fi
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

VLLM_ENV=${KVC_VLLM_DIR:-/tmp/kvc-vllm}/env.sh
vllm_setup() {
  if [ -f .vllm-carry/manifest.json ]; then
    bash scripts/gpu_vllm_setup.sh
  elif $PY -c 'import vllm' 2>/dev/null; then
    echo "vLLM installed: $($PY -c 'import vllm; print(vllm.__version__, vllm.__file__)')"
  else
    echo "SKIPPED: vLLM not installed and no .vllm-carry/ in the checkout"
  fi
}
if [ "${KVC_INSTALL:-1}" != 0 ]; then step install 300 install; fi
step vllm-setup 300 vllm_setup
# every later step sees the carried vLLM and NIXL, as a node with vLLM installed would
# shellcheck disable=SC1090
if [ -f "$VLLM_ENV" ] && wanted vllm-setup; then . "$VLLM_ENV"; fi
step environment 60 environment
step pytest-gpu 300 $PY -m pytest tests -m gpu -q -rs -p no:cacheprovider \
  --junitxml="$ART/pytest-gpu.xml"

validate validate-1p1d-llama-1gib --prefill 1 --decode 1 --layout llama3-8b-like \
  --num-layers 32 --num-blocks 2048 --transfer-blocks 512
validate validate-2p2d-llama --prefill 2 --decode 2 --layout llama3-8b-like \
  --num-layers 32 --num-blocks 1024 --transfer-blocks 128
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then  # cross-GPU rows: prefills on GPU0, decodes on GPU1
  validate validate-2p2d-split --prefill 2 --decode 2 --placement split \
    --layout llama3-8b-like --num-layers 32 --num-blocks 1024 --transfer-blocks 128
  validate validate-1p1d-split-sweep --prefill 1 --decode 1 --placement split \
    --transports ipc --layout llama3-8b-like --num-layers 32 --sizes 1M:1G
fi
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

vllm_ready() {  # false (and say why) without vLLM
  if ! $PY -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
    echo "SKIPPED: vLLM not installed (pip install vllm, or carry scripts/pack_vllm_for_gpu.sh's .vllm-carry/)"
    return 1
  fi
}
vllm_probe() {
  vllm_ready || return 0
  $PY scripts/gpu_vllm_settings_probe.py --json "$ART/vllm-probe.json" --timeout 200
}
vllm_engine() {  # the real-engine tests on cuda:0, one test module per xdist worker
  vllm_ready || return 0
  KVCONNECT_ENGINE_DEVICE=cuda $PY -m pytest -m engine -q -rs -p no:cacheprovider \
    -n 3 --dist loadfile tests/test_engine_plugin.py tests/test_engine_connectors.py \
    tests/test_engine_conformance.py --junitxml="$ART/vllm-engine.xml" \
    --basetemp="$ART/vllm-engine-tmp"  # each engine's log stays with the artifacts
}
vllm_pd() {  # 1P1D engines: TTFT and KV transfer time, ipc / NIXL / stock
  vllm_ready || return 0
  # shellcheck disable=SC2086
  $PY benchmarks/bench_vllm_pd.py --prompt-tokens ${KVC_PD_TOKENS:-1024 8192 32768} \
    --repeats 2 --timeout 500 --json "$ART/vllm-pd.json" --markdown "$ART/vllm-pd.md" \
    --logs "$ART/vllm-pd-logs"
}
vllm_conformance() {  # the kit on cuda:0: connector-API mode, then engine mode (GPU rows)
  vllm_ready || return 0
  $PY -m kvconnect.harness.conformance.cli --stock-and-patched --device cuda:0 --timeout 120 \
    --jsonl "$ART/vllm-conformance.jsonl" --json "$ART/vllm-conformance.json" \
    --markdown "$ART/vllm-conformance.md"
  local rc=$?
  [ "$rc" -gt 1 ] && return "$rc"  # 1 only says a case did not pass: stock ones are expected to
  $PY scripts/conformance_doc.py engine --device cuda:0 --caches "${KVC_CONF_CACHES:-extensible,plain}" \
    --json "$ART/conformance-engine-h200.json" || return $?
  $PY - "$ART/vllm-conformance.json" "$ART/conformance-engine-h200.json" <<'EOF'
import json, sys
api = json.load(open(sys.argv[1]))["results"]
engine = json.load(open(sys.argv[2]))["results"]
bad = [(r["connector"], r["layout"], r["status"]) for r in api
       if r["connector"].startswith("kvconnect.connectors.vllm:") and r["status"] not in ("pass", "refused")]
bad += [(r["connector"], r["cache"], r["status"]) for r in engine
        if r["connector"].startswith("kvconnect.connectors.vllm:") and r["status"] not in ("pass", "unsupported")]
print("kvconnect's connectors:", "all pass, refused or unsupported" if not bad else f"NOT PASSING {bad}")
sys.exit(1 if bad else 0)
EOF
}
export ART
export -f vllm_ready
step vllm-probe 240 vllm_probe
step vllm-engine 900 vllm_engine
step vllm-pd 540 vllm_pd
vllm_pd_cross() {  # 1P1D engines with the prefill on GPU0 and the decode on GPU1
  vllm_ready || return 0
  if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
    echo "SKIPPED: one GPU visible (the cross-GPU row needs two)"
    return 0
  fi
  $PY benchmarks/bench_vllm_pd.py --prefill-gpu 0 --decode-gpu 1 --routes ipc nixl \
    --prompt-tokens 8192 --repeats 2 --timeout 300 --json "$ART/vllm-pd-cross.json" \
    --markdown "$ART/vllm-pd-cross.md" --logs "$ART/vllm-pd-cross-logs"
}
step vllm-pd-cross 360 vllm_pd_cross
step vllm-conformance 900 vllm_conformance

FLOOR_ARGS=()
for f in ${KVC_FLOORS:-}; do FLOOR_ARGS+=(--floor "$f"); done
shopt -s nullglob
FLOOR_INPUTS=()
for f in "$ART"/validate-*.json; do FLOOR_INPUTS+=(--validate "$f"); done
[ -f "$ART/bench_transfer.json" ] && FLOOR_INPUTS+=(--transfer "$ART/bench_transfer.json")
[ -f "$ART/bench_offload.json" ] && FLOOR_INPUTS+=(--offload "$ART/bench_offload.json")
for f in "$ART"/vllm-pd.json "$ART"/vllm-pd-cross.json; do
  if [ -f "$f" ]; then FLOOR_INPUTS+=(--pd "$f"); fi
done
step floors 60 $PY scripts/ratio_floors.py "${FLOOR_INPUTS[@]}" \
  "${FLOOR_ARGS[@]}" --junit "$ART/floors.xml" --json "$ART/floors.json"

{
  echo "# kvconnect nightly GPU run"
  echo
  echo "- when: $(date -u +%Y-%m-%dT%H:%M:%SZ); host: $(hostname)"
  echo "- GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | paste -sd, -)"
  echo "- command: ARTIFACTS=$ART KVC_QUICK=${KVC_QUICK:-} KVC_SWEEP=${KVC_SWEEP:-} KVC_ONLY='${KVC_ONLY:-}' KVC_CONF_CACHES='${KVC_CONF_CACHES:-}' KVC_PD_TOKENS='${KVC_PD_TOKENS:-}' bash scripts/nightly-gpu.sh"
  echo
  echo "| step | exit | seconds | skipped because |"
  echo "| --- | ---: | ---: | --- |"
  printf '%s\n' "${STEPS[@]}"
  echo
  echo '```'
  cat "$ART/floors.log" 2>/dev/null
  echo '```'
  echo
  if [ ${#SKIPPED[@]} -gt 0 ]; then echo "SKIPPED (not passed): ${SKIPPED[*]}"; echo; fi
  if [ ${#FAILED[@]} -ne 0 ]; then echo "RESULT: FAIL: ${FAILED[*]}"
  elif [ ${#SKIPPED[@]} -gt 0 ]; then echo "RESULT: PASS of the steps that ran; skipped: ${SKIPPED[*]}"
  else echo "RESULT: PASS"; fi
} > "$ART/summary.md"
cat "$ART/summary.md"
[ ${#FAILED[@]} -eq 0 ]
