#!/usr/bin/env bash
# On a GPU machine without vLLM, NIXL or a registry (the lent H200): unpack the carry of
# scripts/pack_vllm_for_gpu.sh into $KVC_VLLM_DIR (/tmp/kvc-vllm), install kvconnect (editable:
# its vllm.general_plugins entry point), check that vLLM's compiled ops and NIXL load, and
# write $KVC_VLLM_DIR/env.sh, which every engine process needs sourced:
#
#   bash scripts/gpu_vllm_setup.sh && . /tmp/kvc-vllm/env.sh
#   bash scripts/gpu_vllm_setup.sh --ops-only   # GPU_SM=all packs: the 61 MiB ops, run 1 of 2
#
# A second call on the same machine (files outside the working tree stay while it is held)
# finds the same manifest and only re-installs kvconnect. Exit 0: ready; 1: a check failed
# (it says which); 2: no carry. Prints one JSON line, "kvc-vllm-setup {...}", with the
# versions, the seconds taken and what was checked.
set -euo pipefail
CARRY=${CARRY:-.vllm-carry}
DEST=${KVC_VLLM_DIR:-/tmp/kvc-vllm}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
START=$SECONDS

if [ "${1:-}" = --ops-only ]; then
  [ -f "${CARRY}-ops/vllm-ops.tar.xz" ] || { echo "no ${CARRY}-ops/vllm-ops.tar.xz" >&2; exit 2; }
  rm -rf "$DEST/ops" && mkdir -p "$DEST/ops"
  tar xJf "${CARRY}-ops/vllm-ops.tar.xz" -C "$DEST/ops"
  echo "ops unpacked to $DEST/ops in $((SECONDS - START)) s: keep this machine, run the setup next"
  exit 0
fi
[ -f "$CARRY/manifest.json" ] || { echo "no $CARRY/manifest.json: pack it with scripts/pack_vllm_for_gpu.sh" >&2; exit 2; }

if ! cmp -s "$CARRY/manifest.json" "$DEST/manifest.json"; then
  rm -rf "$DEST/src" "$DEST/site" "$DEST/manifest.json"
  mkdir -p "$DEST/src" "$DEST/site"
  tar xJf "$CARRY/vllm-src.tar.xz" -C "$DEST/src"
  if [ -f "$CARRY/vllm-ops.tar.xz" ]; then
    tar xJf "$CARRY/vllm-ops.tar.xz" -C "$DEST/src"
  elif [ -d "$DEST/ops/vllm" ]; then  # unpacked by an earlier run (--ops-only)
    cp "$DEST"/ops/vllm/*.so "$DEST/src/vllm/"
  else
    echo "vLLM's compiled ops are neither in $CARRY nor in $DEST/ops (run --ops-only first)" >&2
    exit 2
  fi
  cp "$DEST/src/vllm/vllm_flash_attn/__init__.py" "$DEST/src/vllm/vllm_flash_attn/__init__.py.vllm"
  cp "$HERE/vllm_flash_attn_absent.py" "$DEST/src/vllm/vllm_flash_attn/__init__.py"
  tar xJf "$CARRY/nixl.tar.xz" -C "$DEST/site"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$DEST/site" \
    "$CARRY"/wheels/*.whl
  cp "$CARRY/manifest.json" "$DEST/manifest.json"
fi
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e .

cat > "$DEST/env.sh" <<EOF
# written by scripts/gpu_vllm_setup.sh: vLLM and NIXL from the carry, before the image's paths
export PYTHONPATH=$DEST/site:$DEST/src\${PYTHONPATH:+:\$PYTHONPATH}
# vLLM's sampler imports flashinfer (not carried) unless told not to
export VLLM_USE_FLASHINFER_SAMPLER=0
# no model hub here: models are local folders (kvconnect.vllm.tiny_model)
export HF_HUB_OFFLINE=1
# the engines run on CUDA. Without the flash-attention package vLLM still picks FLASH_ATTN
# and asserts in its first forward ("FlashAttention version not detected"): ask for Triton's.
# Torch-native norms / rotary / activations: the recipe that first ran (gpu-facts.md);
# scripts/gpu_vllm_settings_probe.py says whether each setting is needed
export KVCONNECT_ENGINE_DEVICE=cuda VLLM_TARGET_DEVICE=cuda
export KVCONNECT_ENGINE_KWARGS='{"attention_backend": "TRITON_ATTN", "compilation_config": {"custom_ops": ["none"]}}'
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EOF

# shellcheck disable=SC1091
. "$DEST/env.sh"
$PY - "$((SECONDS - START))" <<'EOF'
import json, sys, time
t0 = time.monotonic()
out = {"setup_s": int(sys.argv[1])}
import torch
out["torch"] = torch.__version__
import vllm
out["vllm"] = vllm.__version__
out["vllm_from"] = vllm.__file__
import vllm._C_stable_libtorch  # noqa: F401 - the compiled ops load on this torch
x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
torch.ops._C.rms_norm(y, x, w, 1e-5)  # a kernel of the pruned library runs here
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
out["rms_norm_max_error"] = float((y.float() - ref).abs().max())
import nixl._api  # noqa: F401 - what vLLM imports
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("kvc-setup-check", nixl_agent_config(backends=["UCX"]))
out["nixl_plugins"] = sorted(agent.get_plugin_list())
import importlib.metadata as md
out["kvconnect_entry_point"] = [e.value for e in md.entry_points(group="vllm.general_plugins")]
out["check_s"] = round(time.monotonic() - t0, 1)
ok = out["rms_norm_max_error"] < 0.05 and "UCX" in out["nixl_plugins"] and any(
    v.startswith("kvconnect.vllm") for v in out["kvconnect_entry_point"])
out["ok"] = ok
print("kvc-vllm-setup " + json.dumps(out), flush=True)
sys.exit(0 if ok else 1)
EOF
