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
python -m pip install -q -e ".[dev,pd]"
# NIXL: its meta package requires both CUDA builds; take the cu12 build (pulled by the pd
# extra) and the meta package alone.
python -m pip install -q --no-deps "nixl==1.5.1"
