#!/usr/bin/env bash
# `make test-compat`'s environment: a second virtual environment with another torch, beside `make setup`'s
# .venv, which it never touches.  torch==2.14.1 is the release these machines keep on disk for Python 3.11 (a
# CUDA build, which runs on the CPU; the machine's pip configuration caps torch at it).  The install is refused
# if pip would download a torch or a CUDA library from the network instead of taking the one on disk.
set -euo pipefail
VENV=${1:-.venv-compat}
TORCH=${TORCH:-2.14.1}
PYTHON=${PYTHON:-python3.11}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"   # without the system's site-packages: their torch 2.13 must not be seen here
fi
log=$(mktemp)
pins=$(mktemp)
trap 'rm -f "$log" "$pins"' EXIT
# torch's CUDA libraries at the versions on disk: pip would otherwise prefer a newer one from the network
WHEELS=${WHEELS:-/opt/pypi-more/files}
if [ -d "$WHEELS" ]; then
  for wheel in "$WHEELS"/nvidia_*.whl "$WHEELS"/cuda_*.whl; do
    [ -e "$wheel" ] || continue
    name=$(basename "$wheel" | cut -d- -f1 | tr _ -)
    version=$(basename "$wheel" | cut -d- -f2)
    echo "$name==$version" >> "$pins"
  done
fi
"$VENV/bin/pip" install --progress-bar off -c "$pins" "torch==$TORCH" > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
grep -v "^Requirement already satisfied" "$log" || true
if grep -E "^ *Downloading .*(torch|nvidia)" "$log"; then
  echo "error: pip downloaded torch or a CUDA library from the network (above); expected the wheels on disk" >&2
  exit 1
fi
"$VENV/bin/pip" install --quiet -e ".[test]"
"$VENV/bin/python" -c "import torch, fxshard; print(f'fxshard {fxshard.__version__} with torch {torch.__version__} in $VENV')"
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH') else 'expected torch $TORCH')"
