#!/usr/bin/env bash
# Create the virtual environment and install fxshard with its dev extras.
# torch: reuse one already installed in the base interpreter; else pin the CPU wheel that lies on
# these machines (torch==2.13.0).  An unpinned `torch` would pull a multi-GB CUDA build.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet "torch==2.13.0"
fi
"$VENV/bin/pip" install --quiet -e ".[dev]"
"$VENV/bin/python" -c "import torch, fxshard; print(f'fxshard {fxshard.__version__} with torch {torch.__version__}')"
