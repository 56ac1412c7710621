#!/usr/bin/env bash
# FP8 against bf16 on one GPU (issue 46 §2), in one run of about 5 minutes: fxshard's rank code compiled --dtype fp8
# and --dtype bf16, eager and --compile, on a 1B- and an 8B-shaped Llama with fewer layers (benchmarks/fp8.py);
# results in $OUT/fp8-cuda.json and fp8-cuda.md, each step's log in $OUT/NAME.log.  Target: fp8 ≥ 1.3× bf16's
# tokens/s compiled.
#
#     OUT=out/gpu-fp8 bash scripts/gpu_fp8.sh
#     SIZES=1b-8l ROUNDS=6 OUT=out/gpu-fp8 bash scripts/gpu_fp8.sh      # less
#
# It installs nothing and needs no torchao (the recipe is fxshard's runtime): it runs the python3 that holds torch
# (PYTHON to choose another) on a copy of fxshard laid out as installed, as scripts/gpu_check.sh does.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/out/gpu-fp8}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SITE=$(mktemp -d /tmp/fxshard-fp8-XXXX)
cp -r "$REPO/fxshard" "$SITE/fxshard"
cp -r "$REPO/passes" "$SITE/fxshard/passes"
cp -r "$REPO/cli" "$SITE/fxshard/cli"
trap 'rm -rf "$SITE"' EXIT
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$SITE"

step() {  # step NAME LIMIT_S COMMAND...: its output in $OUT/NAME.log, its tail here
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit} s)"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "--- $name: exit $? after $((SECONDS - start)) s"
  tail -n "${TAIL:-40}" "$OUT/$name.log"
}

step env 60 "$PY" -c '
import torch
from fxshard.runtime.fp8 import fp8_linear
print("torch", torch.__version__, torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = fp8_linear(x, w)
y.sum().backward()
ref = torch.nn.functional.linear(x, w)
print("fp8 against bf16 linear, relative:", float((y - ref).norm() / ref.norm()))'
step bench "${LIMIT:-480}" "$PY" -m benchmarks.fp8 --device cuda --out "$OUT" --sizes "${SIZES:-1b-8l,8b-4l}" \
  --rounds "${ROUNDS:-10}" --warmup 2
