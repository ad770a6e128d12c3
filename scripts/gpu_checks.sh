#!/usr/bin/env bash
# On a CUDA machine whose Python already has torch, triton and transformers: run the GPU tests
# and benchmarks from this checkout without installing it. Packages the machine lacks (msgspec,
# pyzmq, a pinned transformers) may be put as wheels in .whl/; they go to a private directory.
#
#   bash scripts/gpu_checks.sh tests        # pytest -m gpu (kernels and every family)
#   bash scripts/gpu_checks.sh kernels      # kernel benchmarks
#   bash scripts/gpu_checks.sh latency      # benchmarks/latency.py, Llama-3.1-8B shape
#   bash scripts/gpu_checks.sh offline      # benchmarks/offline.py presets
#   bash scripts/gpu_checks.sh tiers        # state-tier GPU tests and benchmarks/multiturn.py (8B shape)
#
# Logs go to $LOG_DIR (default ./gpu-logs), one file per part.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-gpu-logs}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tandem-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/tandem-site:$PWD
else
  export PYTHONPATH=$PWD
fi
status=0
run() {  # run NAME COMMAND...: log to $LOG_DIR/NAME.log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$LOG_DIR/$name.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "=== $name FAILED"; status=1; }
}
for part in "${@:-tests}"; do
  case $part in
    tests) run tests python3 -m pytest -m gpu -q --maxfail=10 -p no:cacheprovider tests ;;
    kernels) run kernels_attention python3 benchmarks/kernels_attention.py
             run kernels_fused python3 benchmarks/kernels_fused.py
             run kernels_mla python3 benchmarks/kernels_mla.py
             run kernels_moe python3 benchmarks/kernels_moe.py ;;
    latency) run latency python3 benchmarks/latency.py --shape llama3-8b ;;
    offline) for preset in llama3-8b-b1 llama3-8b-b32 qwen3-0.6b-nanovllm; do
               run "offline_$preset" python3 benchmarks/offline.py --preset "$preset" --repeat 1
             done ;;
    tiers) run tiers_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_tiers.py tests/test_kernels_page_copy.py
           run multiturn python3 benchmarks/multiturn.py --shape llama3-8b ;;
    *) echo "unknown part $part"; status=2 ;;
  esac
done
exit $status
