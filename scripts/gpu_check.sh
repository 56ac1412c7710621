#!/usr/bin/env bash
# The checks that need a GPU, in one run, each step with its own time limit and log (a failing step does not stop
# the next): what the machine has, fxshard's refusal of more ranks than GPUs, the tp=2 step-time table on NCCL
# (python -m benchmarks.run --device cuda: results in $OUT/nccl.json and nccl.md; on one GPU again under MPS, the
# CUDA Multi-Process Service, in $OUT/mps/), `fxshard verify` on the GPU, eager and --compile, against
# one-device training, and the matrix: every layout verified on NCCL with all its ranks on one GPU
# (scripts/nccl_matrix.py; FXSHARD_SHARE_GPU=1 and MPS; $OUT/nccl-matrix.log and .md), where the eager tp step's
# time goes (profile), and world size 1 against transformers in a plain loop, a ~1B Llama in bf16 (single:
# $OUT/single-cuda.*).  STEPS names the steps to run (default: all of them, in this order).
#
#     OUT=out/gpu-check bash scripts/gpu_check.sh
#     STEPS="env bench bench-mps" OUT=out/gpu-check bash scripts/gpu_check.sh
#
# It installs nothing: it runs the python3 that holds torch (PYTHON to choose another) on a copy of fxshard laid out
# as installed (the package with its passes and cli), so it also runs where pip cannot fetch, as on the lent GPU
# machines, whose torch may be older than the one the CPU suite pins.  Packages a caller installed into a folder on
# PYTHONPATH (wheels carried there: transformers 5.24) come before the machine's own.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/out/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SITE=$(mktemp -d /tmp/fxshard-gpu-XXXX)
cp -r "$REPO/fxshard" "$SITE/fxshard"
cp -r "$REPO/passes" "$SITE/fxshard/passes"
cp -r "$REPO/cli" "$SITE/fxshard/cli"
trap 'rm -rf "$SITE"' EXIT
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
cd "$SITE"  # not the checkout: its fxshard/ has no passes/ or cli/
FX=("$PY" -m fxshard.cli.app)

STEPS=${STEPS:-env refuse matrix bench bench-mps verify verify-compile profile single}

step() {  # step NAME LIMIT_S COMMAND...: its output in $OUT/NAME.log, its tail and exit status here
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  echo "=== $name (limit ${limit} s)"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "--- $name: exit $rc after $((SECONDS - start)) s"
  tail -n "${TAIL:-15}" "$OUT/$name.log"
}

step env 30 bash -c "nvidia-smi -L; $PY -c '
import torch, torch.distributed as dist
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpus\", torch.cuda.device_count(),
      \"nccl available\", dist.is_nccl_available())
import fxshard.compiler, fxshard.train.launch, fxshard.runtime.compiled, benchmarks.run
from fxshard.environment import describe
print(describe())
'"

# two ranks on one GPU: refused by the local launcher before NCCL's "Duplicate GPU detected" (it counts the processes
# it starts against the GPUs); under torchrun each rank takes the one GPU it sees, and the ranks find by the GPUs'
# UUIDs that they share it (fxshard.train.device)
refuse() {
  "$PY" -m fxshard.cli.app compile "$REPO/samples/gpt.py" --tp 2 --out "$SITE/gpt-tp2" >/dev/null || return 1
  "$PY" -m fxshard.cli.app run "$SITE/gpt-tp2" --steps 1
  echo "run exited $? (2, refused, where the machine has 1 GPU)"
  timeout 60 "$PY" -m torch.distributed.run --nproc-per-node 2 -m fxshard.cli.app run "$SITE/gpt-tp2" --steps 1 \
    >"$SITE/torchrun.log" 2>&1
  local code=$?
  grep -E '^error|would all train' "$SITE/torchrun.log" | head -4
  echo "torchrun exited $code (1, both ranks refused, where the machine has 1 GPU)"
}
export -f refuse
export PY OUT REPO SITE
step refuse 90 bash -c refuse

# every layout against one device, all ranks on the one GPU (FXSHARD_SHARE_GPU=1), under MPS
matrix() {
  nvidia-cuda-mps-control -d || echo "nvidia-cuda-mps-control could not start: the ranks' kernels take turns"
  trap 'echo quit | nvidia-cuda-mps-control 2>/dev/null' EXIT TERM
  # shellcheck disable=SC2086  # MATRIX_ARGS: more options, e.g. --only CASE (repeatable)
  "$PY" "$REPO/scripts/nccl_matrix.py" --device cuda --jobs "${MATRIX_JOBS:-3}" --out "$OUT" ${MATRIX_ARGS:-}
}
export -f matrix
TAIL=30 step matrix 330 bash -c matrix

TAIL=60 step bench 240 "$PY" -m benchmarks.run --device cuda --out "$OUT"

# two ranks on one GPU run in turns unless MPS lets their kernels run side by side
mps() {
  local gpus
  gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -lt 2 ] || { echo "$gpus GPUs: one rank per GPU, no MPS needed"; return 0; }
  nvidia-cuda-mps-control -d || { echo "nvidia-cuda-mps-control could not start"; return 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT TERM  # stopped at its time limit too
  "$PY" -m benchmarks.run --device cuda --out "$OUT/mps"
}
export -f mps
TAIL=40 step bench-mps 240 bash -c mps

step verify 80 "${FX[@]}" verify "$REPO/samples/gpt.py" --steps 3
step verify-compile 100 "${FX[@]}" verify "$REPO/samples/gpt.py" --steps 3 --compile

# where each eager step's host time goes (torch.profiler), under MPS as bench-mps ran
profile() {
  nvidia-cuda-mps-control -d || echo "nvidia-cuda-mps-control could not start: profiling without MPS"
  trap 'echo quit | nvidia-cuda-mps-control 2>/dev/null' EXIT TERM
  "$PY" -m benchmarks.profile_tp --device cuda --size small --out "$OUT"
}
export -f profile
TAIL=80 step profile 150 bash -c profile

# world size 1: fxshard's generated code against the same transformers model in a plain loop, eager and compiled
TAIL=20 step single 300 "$PY" -m benchmarks.run --only single --device cuda --out "$OUT"
