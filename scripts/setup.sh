#!/usr/bin/env bash
# Sets tandem up from nothing in ./.venv: a CPU build of torch (pinned, so pip never pulls a
# multi-GB CUDA build on a CPU machine), then tandem with its dev extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then python -m pip install -q "torch>=2.11"; else python -m pip install -q torch==2.13.0 triton==3.6.0; fi
fi
# NIXL: its meta package requires both CUDA builds; take one build and the meta package alone.
# On a GPU machine the build matches the CUDA major version torch runs on (nixl-cu12 or
# nixl-cu13; wheels may come from a local directory through PIP_FIND_LINKS); elsewhere the cu12
# build the pd extra names (it runs on host memory without a GPU).
cuda_major=""
if command -v nvidia-smi >/dev/null 2>&1; then
  cuda_major=$(python -c "import torch; print((torch.version.cuda or '').split('.')[0])" 2>/dev/null || true)
  [ -n "$cuda_major" ] || cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
fi
if [ -n "$cuda_major" ]; then
  python -m pip install -q -e ".[dev]"
  python -m pip install -q "nixl-cu${cuda_major}==1.5.1"
else
  python -m pip install -q -e ".[dev,pd]"
fi
python -m pip install -q --no-deps "nixl==1.5.1"
