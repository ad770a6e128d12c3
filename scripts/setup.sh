#!/usr/bin/env bash
# Sets tandem up from nothing in ./.venv: a CPU build of torch (pinned, so pip never pulls a
# multi-GB CUDA build on a CPU machine), then tandem with its dev extras. Idempotent.
# pip stays quiet; each step says what it does, and the last line says how to serve or test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "setup: $*"; }
if [ -x .venv/bin/python ]; then
  step "using the existing virtual environment .venv"
else
  step "creating the virtual environment .venv with $PY"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
step "upgrading pip"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if python -c "import torch" >/dev/null 2>&1; then
  step "torch $(python -c 'import torch; print(torch.__version__)') is already installed"
elif command -v nvidia-smi >/dev/null 2>&1; then
  step "installing torch (an NVIDIA driver is present: the CUDA build; a few minutes)"
  python -m pip install -q "torch>=2.11"
else
  step "installing the CPU build of torch 2.13.0 and triton 3.6.0 (no NVIDIA driver found)"
  python -m pip install -q torch==2.13.0 triton==3.6.0
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
  step "installing tandem with its dev and ray extras (editable)"
  python -m pip install -q -e ".[dev,ray]"
  step "installing NIXL for CUDA ${cuda_major} (prefill/decode disaggregation)"
  python -m pip install -q "nixl-cu${cuda_major}==1.5.1"
else
  step "installing tandem with its dev, pd and ray extras (editable; about a minute)"
  python -m pip install -q -e ".[dev,pd,ray]"
fi
step "installing NIXL's meta package"
python -m pip install -q --no-deps "nixl==1.5.1"
step "ready. Serve the demo model: .venv/bin/tandem serve --port 8000;" \
  "run the tests: . .venv/bin/activate && python -m pytest -m \"not gpu\" -q -n 2 --dist loadfile"
