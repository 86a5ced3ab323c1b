#!/usr/bin/env bash
# On the GPU machine (no registry, no vLLM, torch 2.11): run the conformance kit's offload
# connectors (vLLM 0.33's SimpleCPUOffload and Offloading, stock vs kvconnect's) on cuda:0
# with CUDA VMM caches, for every vLLM layout, from the carry scripts/pack_vllm_for_gpu.sh
# builds (.vllm-carry/: vLLM's Python sources without .so, plus the wheels it imports).
# Whole script bounded by BUDGET seconds (default 230). KVC_DEVICE=cpu (with a carry packed
# for this machine's Python, PYTHON_VERSION=3.11) dry-runs the same steps on a CPU machine. Writes to $OUT (default
# ./gpu-vllm-out): import.json (what vLLM needed and what failed to import),
# conformance-cuda.jsonl (one line per case, as they finish), conformance-cuda.json / .md,
# summary.md, and a log per step. Exit 0 when every step ran (whatever the cases found).
set -u
START=$SECONDS
BUDGET=${BUDGET:-230}
OUT=${OUT:-$PWD/gpu-vllm-out}
CARRY=${CARRY:-.vllm-carry}
PY=${PYTHON:-python3}
DEVICE=${KVC_DEVICE:-cuda:0}  # KVC_DEVICE=cpu: a dry run of this script on a CPU machine
export OUT CARRY PY DEVICE
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=${DEVICE%%:*} PYTORCH_NVML_BASED_CUDA_CHECK=1
export PYTHONPATH=/tmp/vllm-site:/tmp/vllm-src${PYTHONPATH:+:$PYTHONPATH}
FAILED=()

left() { echo $(( BUDGET - (SECONDS - START) )); }
step() {  # name, limit (s, capped by what is left), command...
  local name=$1 limit=$2 rc
  shift 2
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  if [ "$limit" -le 5 ]; then echo "=== $name: skipped, budget spent"; FAILED+=("$name (no time)"); return; fi
  echo "=== $name (limit ${limit}s, $(( SECONDS - START ))s in)"
  if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash
    export -f "$1"
    timeout --kill-after=5 "$limit" bash -c "$*" > "$OUT/$name.log" 2>&1
  else
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  fi
  rc=$?
  echo "    rc=$rc"; tail -n 4 "$OUT/$name.log" | sed 's/^/    /'
  [ "$rc" -ne 0 ] && FAILED+=("$name (rc $rc)")
  return 0
}

unpack() {
  [ -f "$CARRY/vllm-src.tar.gz" ] || { echo "no $CARRY/vllm-src.tar.gz: carry .vllm-carry"; return 1; }
  rm -rf /tmp/vllm-src /tmp/vllm-site && mkdir -p /tmp/vllm-src /tmp/vllm-site
  tar xzf "$CARRY/vllm-src.tar.gz" -C /tmp/vllm-src || return 1
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vllm-site \
    "$CARRY"/wheels/*.whl || return 1
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
  cat "$CARRY/MANIFEST.txt"
}

probe_imports() {  # which modules load, in the order the kit needs them; JSON to $OUT
  $PY - "$OUT/import.json" <<'EOF'
import importlib, json, os, sys, time, traceback
out = {"python": sys.version.split()[0]}
try:
    import torch
    out.update(torch=torch.__version__, cuda_built=torch.version.cuda)
    from kvconnect.vllm.runtime import prepare_runtime
    out["extension_shims"] = prepare_runtime(os.environ["DEVICE"])
except Exception:
    out["error"] = traceback.format_exc()
cuda = os.environ["DEVICE"].startswith("cuda")
mods = ["vllm", "vllm.platforms", *(["vllm.platforms.cuda"] if cuda else []), "vllm.config", "vllm.engine.arg_utils",
        "vllm.distributed.kv_transfer.kv_connector.factory",
        "vllm.v1.simple_kv_offload.worker", "vllm.v1.simple_kv_offload.copy_backend",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker",
        "kvconnect.vllm.patched_offload", "kvconnect.vllm.conformance.case"]
res = out["imports"] = {}
for m in mods:
    t0 = time.monotonic()
    try:
        importlib.import_module(m)
        res[m] = {"ok": True, "s": round(time.monotonic() - t0, 2)}
    except BaseException as e:
        res[m] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "missing_module": getattr(e, "name", None),
                  "trace": traceback.format_exc()[-1500:]}
        print(f"IMPORT FAILED: {m}: {type(e).__name__}: {e}", flush=True)
try:
    from vllm.platforms import current_platform
    out["platform"] = type(current_platform).__name__
    out["cuda_initialised_in_parent"] = torch.cuda.is_initialized()
except BaseException as e:
    out["platform_error"] = f"{type(e).__name__}: {e}"
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if k != "imports"}))
bad = [m for m, r in res.items() if not r["ok"]]
print("imports:", "all ok" if not bad else f"FAILED {bad}")
sys.exit(1 if bad or "error" in out else 0)
EOF
}

kit() {
  rm -f "$OUT/conformance-cuda.jsonl"
  $PY -m kvconnect.vllm.conformance.cli SimpleCPUOffloadConnector \
    kvconnect.vllm:KvconnectSimpleCPUOffloadConnector OffloadingConnector \
    kvconnect.vllm:KvconnectOffloadingConnector --device "$DEVICE" --timeout 45 \
    --jsonl "$OUT/conformance-cuda.jsonl" --json "$OUT/conformance-cuda.json" \
    --markdown "$OUT/conformance-cuda.md"
  local rc=$?
  [ "$rc" -le 1 ] && return 0  # 1: some case did not pass (stock connectors are expected to)
  return "$rc"
}

summary() {
  $PY - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
rows = []
p = os.path.join(out, "conformance-cuda.jsonl")
if os.path.exists(p):
    rows = [json.loads(line) for line in open(p) if line.strip()]
lines = [f"# vLLM offload connectors on {os.environ['DEVICE']} (VMM caches, 1024 reserved / 128 committed blocks)", ""]
imp = os.path.join(out, "import.json")
if os.path.exists(imp):
    d = json.load(open(imp))
    bad = {m: r["error"] for m, r in d.get("imports", {}).items() if not r["ok"]}
    lines.append(f"- torch {d.get('torch')}, platform {d.get('platform')}, shims "
                 f"{d.get('extension_shims')}, imports failed: {bad or 'none'}")
lines += ["", "| connector | layout | status | checks | evidence |", "|---|---|---|---|---|"]
for r in rows:
    checks = ", ".join(f"{k}={v.get('status')}" for k, v in r.get("checks", {}).items())
    ev = str(r.get("evidence") or r.get("checks", {}).get("offload_round_trip", {}).get("error", ""))
    lines.append(f"| {r['connector'].rsplit(':', 1)[-1]} | {r['layout']} | {r['status']} | "
                 f"{checks} | {ev[:200].replace('|', '/')} |")
lines.append("")
lines.append(f"cases: {len(rows)} of 24")
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

step unpack 60 unpack
step imports 60 probe_imports
if grep -q '"ok": false' "$OUT/import.json" 2>/dev/null || [ ! -f "$OUT/import.json" ]; then
  echo "vLLM did not load: see $OUT/imports.log and import.json (missing_module per import)"
  grep "IMPORT FAILED" "$OUT/imports.log"
else
  step kit 170 kit
fi
step gpu-plumbing-tests 30 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_vllm_conformance_device.py
summary > /dev/null 2>&1
cat "$OUT/summary.md" 2>/dev/null
echo "total $(( SECONDS - START )) s; steps not ok: ${FAILED[*]:-none}"
[ ${#FAILED[@]} -eq 0 ]
