#!/usr/bin/env bash
# The peers on one lent GPU (issue 46 §1), about 10 minutes: python -m benchmarks.peers.gpu (world size 1, bf16,
# fxshard eager and --compile, torchtitan with compile, Megatron-Core's local spec, on the 1B and the 4-layer
# 8B-shaped Llama: tokens/s, MFU, peak memory; then tp2 with both ranks on the GPU under MPS, fxshard and
# torchtitan).  Results in $OUT/peers-gpu.{md,json}, the log in $OUT/peers-gpu.log.
#
#     OUT=out/peers-gpu bash scripts/gpu_peers.sh
#     DRY_RUN=1 OUT=/tmp/peers-dry .venv-peers/bin/python ... bash scripts/gpu_peers.sh   # toy size on the CPU
#
# The device machine has no registry: the peers travel as wheels in .whl/ (carry it; `pip download` them here as
# /work/.library/device/README.md says: torchtitan 0.3.0, megatron-core 0.16.1 and their pure-Python needs) and are
# installed into /tmp/site, or are already importable (PYTHON=.venv-peers/bin/python here).  A missing peer stops
# the run at once, naming it; nothing is fetched.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/out/peers-gpu}
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-540}  # seconds for the whole benchmark: inside a 10-minute device call with the installs
mkdir -p "$OUT"
cd "$REPO"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" - <<'EOF'
import importlib, sys
import torch
missing = []
for name in ("fxshard", "torchtitan", "megatron.core", "transformers"):
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        missing.append(f"{name}: {type(e).__name__}: {e}")
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
if missing:
    sys.exit("gpu_peers.sh: cannot import " + "; ".join(missing) + " (carry the wheels in .whl/, see the header)")
EOF
if [ "${DRY_RUN:-0}" = 1 ]; then
  ARGS=(--device cpu --sizes toy --rounds 1 --warmup 0)
else
  ARGS=(--sizes "${SIZES:-1b,8b-4l}" --rounds "${ROUNDS:-8}" --warmup 2)
  if command -v nvidia-cuda-mps-control >/dev/null; then  # tp2's two ranks share the GPU side by side
    nvidia-cuda-mps-control -d || true
  fi
fi
timeout -k 10 "$LIMIT" "$PY" -m benchmarks.peers.gpu "${ARGS[@]}" --out "$OUT" 2>&1 | tee "$OUT/peers-gpu.log"
exit "${PIPESTATUS[0]}"
