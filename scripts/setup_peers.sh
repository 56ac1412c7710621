#!/usr/bin/env bash
# `make peers`' environment: a third virtual environment, .venv-peers, beside `make setup`'s .venv (never touched),
# holding fxshard (editable) and the peers `python -m benchmarks.run --only peers` measures it against: torchtitan
# 0.3.0 and megatron-core 0.16.1 (the newest release the package registry here serves; issue 46 names 0.19.2), and
# DeepSpeed 0.19.8 where it builds.  torch is pinned to the CPU wheel on disk in the same command: none of the
# peers pins torch, and an unpinned one would pull a multi-GB CUDA build.  The install is refused if pip would
# download a torch or a CUDA library from the network instead.
set -euo pipefail
VENV=${1:-.venv-peers}
TORCH=${TORCH:-2.13.0}
PYTHON=${PYTHON:-python3.11}   # torchtitan 0.3.0 requires Python >= 3.11
TORCHTITAN=${TORCHTITAN:-0.3.0}
MEGATRON=${MEGATRON:-0.16.1}
DEEPSPEED=${DEEPSPEED:-0.19.8}
TRITON=${TRITON:-3.8.0}       # torchtitan imports triton at import time (its EP kernels); the CPU torch has none
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"   # without the system's site-packages
fi
log=$(mktemp)
pins=$(mktemp)
trap 'rm -f "$log" "$pins"' EXIT
echo "torch==$TORCH" > "$pins"
install() {  # pip install "$@" under the torch pin; fail if torch or a CUDA library came from the network
  "$VENV/bin/python" -m pip install --progress-bar off -c "$pins" "$@" > "$log" 2>&1 || { cat "$log" >&2; return 1; }
  grep -E "^(Successfully|Would) install" "$log" || true
  if grep -E "^ *Downloading .*(torch-|nvidia)" "$log"; then
    echo "error: pip downloaded torch or a CUDA library from the network (above); expected the wheel on disk" >&2
    exit 1
  fi
}
install "torch==$TORCH" -e ".[test]" "torchtitan==$TORCHTITAN" "megatron-core==$MEGATRON" "triton==$TRITON"
# DeepSpeed builds from its sdist (its ops compile just in time, when used): a failure here leaves it out
if install "deepspeed==$DEEPSPEED"; then
  echo "deepspeed $DEEPSPEED installed; building its CPU shared-memory collectives (once: minutes)"
  # what its CPU accelerator otherwise builds with ninja inside the first deepspeed.init_distributed (cached in
  # ~/.cache/torch_extensions), where it would count against the benchmark's time limit
  "$VENV/bin/python" -c "from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('ShareMemCommBuilder').load()" > "$log" 2>&1 || { tail -5 "$log" >&2;
    echo "warning: deepspeed's shm_comm extension did not build; deepspeed.init_distributed will try again" >&2; }
else
  echo "warning: deepspeed $DEEPSPEED did not install (above); the peers benchmark reports it as not run" >&2
fi
"$VENV/bin/python" - <<EOF
import importlib.metadata as md, torch
assert torch.__version__.startswith("$TORCH"), f"expected torch $TORCH in $VENV, found {torch.__version__}"
import fxshard, megatron.core, torchtitan  # noqa: F401  (each must import on this torch)
found = {n: md.version(n) for n in ("torch", "torchtitan", "megatron-core")}
try:
    found["deepspeed"] = md.version("deepspeed")
except md.PackageNotFoundError:
    pass
print("$VENV:", ", ".join(f"{n} {v}" for n, v in found.items()))
EOF
