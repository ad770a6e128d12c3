#!/usr/bin/env bash
# On a CUDA machine whose Python already has torch, triton and transformers: run the GPU tests
# and benchmarks from this checkout without installing it. Packages the machine lacks (msgspec,
# pyzmq, a pinned transformers) may be put as wheels in .whl/; they go to a private directory.
#
#   bash scripts/gpu_checks.sh tests        # pytest -m gpu (kernels and every family)
#   bash scripts/gpu_checks.sh kernels      # kernel benchmarks
#   bash scripts/gpu_checks.sh latency      # benchmarks/latency.py, Llama-3.1-8B shape
#   bash scripts/gpu_checks.sh offline      # benchmarks/offline.py presets
#   bash scripts/gpu_checks.sh qwen3-moe    # Qwen3-MoE GPU tests, Qwen3-30B-A3B shape decode at batch 64 and 256
#   bash scripts/gpu_checks.sh tiers        # state-tier GPU tests and benchmarks/multiturn.py (8B shape)
#   bash scripts/gpu_checks.sh page-major   # page-major pools: GPU tests, offline and latency beside layer-major
#   bash scripts/gpu_checks.sh pd-one-gpu   # PD on one GPU (NIXL): where TTFT goes without the link
#   bash scripts/gpu_checks.sh pd           # two GPUs: PD over NIXL VRAM and NCCL (bandwidth, added TTFT)
#   bash scripts/gpu_checks.sh tp           # two GPUs: TP GPU tests, all-reduce latency, TP=2 vs TP=1 decode at batch 64
#   bash scripts/gpu_checks.sh four-gpus    # four GPUs: TP=4 against TP=1, PD between TP=2 engines, the four-rank
#                                           # all-reduce table, batch 64 at TP=4
#   bash scripts/gpu_checks.sh tp-mixed     # two GPUs: TP tests (mixed-step graphs on every rank); a mixed step's
#                                           # time with them on and off at TP=2 and TP=1; batch 64 at TP=2 with its
#                                           # prefill steps in graphs against eager, alternated
#   bash scripts/gpu_checks.sh tp-latency   # two GPUs: batch-1 TPOT and prefill at 512 tokens at TP=2, TP=1 beside
#   bash scripts/gpu_checks.sh tp-host      # two GPUs: where the hosts' time goes in prefill-heavy batch-64 runs at
#                                           # TP=2 and TP=1 (py-spy samples of every rank when carried, else cProfile)
#   bash scripts/gpu_checks.sh structured   # structured outputs: GPU tests, step time with a schema (8B shape)
#   bash scripts/gpu_checks.sh itl-slo      # one GPU: --max-itl-ms test; ITL at concurrency 16 with and without it
#   bash scripts/gpu_checks.sh goodput-colocated  # two GPUs: goodput of two colocated replicas behind the router
#   bash scripts/gpu_checks.sh goodput-slo  # the same with --max-itl-ms 25
#   bash scripts/gpu_checks.sh goodput-pd   # two GPUs: goodput of 1P1D behind the router
#   bash scripts/gpu_checks.sh deploy       # two GPUs: tandem deploy 1P1D (Ray) equals a colocated server; TTFT beside PD
#   bash scripts/gpu_checks.sh ray          # two GPUs: the Ray executor's GPU tests; TP=2 through Ray vs the multiprocess executor
#   bash scripts/gpu_checks.sh regressions  # one GPU: batch-1 TPOT, the nano-vllm workload, 8B batch 256 with FP8 K/V
#   bash scripts/gpu_checks.sh targets      # one GPU: the open performance targets' figures (TPOT and prefill at 512,
#                                           # bf16 and FP8; the nano-vllm workload; 8B batch 256 with FP8 weights and K/V)
#   bash scripts/gpu_checks.sh sweeps       # one GPU: decode attention launch options (FP8 and bf16 pages), FP8 GEMMs
#                                           # (full accumulation beside), the fused FP8 producers
#   bash scripts/gpu_checks.sh fp8-attention  # one GPU: decode attention over FP8 pages in random and in-order pages,
#                                           # and what it takes inside the 8B batch-256 workload (profiled warm)
#
# NIXL's CUDA 13 wheels (nixl-cu13 and the nixl meta package, 59 MB) may be put in .nixl/, the
# server's web stack in .whl2/ (a device call carries at most 64 MiB in all, the checkout and any
# other carried folder counted: .nixl leaves room for a .whl2 of msgspec and pyzmq alone, not for
# .whl, which is enough for the engine-level PD tests such as four-gpus' NIXL variant; on a machine still warm, a first call can install .whl and a second carry .nixl, the
# private directory keeping the first's); every wheel of .whl/, .whl2/ and .nixl/ is installed
# to the private directory.
#
# Logs go to $LOG_DIR (default ./gpu-logs), one file per part.
# To time a change against the code before it, see scripts/compare_versions.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-gpu-logs}
mkdir -p "$LOG_DIR"
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
status=0
run() {  # run NAME COMMAND...: log to $LOG_DIR/NAME.log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$LOG_DIR/$name.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "=== $name FAILED"; status=1; }
}
# Batch 64 at TP=2, the Llama-3.1-8B shape (the TP parts' A/B runs).
b64_tp2=(python3 -m benchmarks.offline --preset llama3-8b-b64 --repeat 2 --skip-transformers --timeline
         --tensor-parallel-size 2)
for part in "${@:-tests}"; do
  case $part in
    tests) run tests python3 -m pytest -m gpu -q --maxfail=10 -p no:cacheprovider tests ;;
    kernels) run kernels_attention python3 -m benchmarks.kernels_attention
             run kernels_fused python3 -m benchmarks.kernels_fused
             run kernels_mla python3 -m benchmarks.kernels_mla
             run kernels_moe python3 -m benchmarks.kernels_moe ;;
    latency) run latency python3 -m benchmarks.latency --shape llama3-8b ;;
    offline) for preset in llama3-8b-b1 llama3-8b-b32 qwen3-0.6b-nanovllm; do
               run "offline_$preset" python3 -m benchmarks.offline --preset "$preset" --repeat 1
             done ;;
    qwen3-moe) run qwen3_moe_tests python3 -m pytest -m gpu -q -p no:cacheprovider -k qwen3_moe tests/gpu/test_gpu.py \
                 tests/gpu/test_gpu_tiers.py tests/models/test_spec_decode.py
               run kernels_moe python3 -m benchmarks.kernels_moe
               for preset in qwen3-30b-a3b-b64 qwen3-30b-a3b-b256; do
                 run "offline_$preset" python3 -m benchmarks.offline --preset "$preset" --repeat 1 --skip-transformers
               done ;;
    tiers) run tiers_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_tiers.py tests/kernels/test_kernels_page_copy.py
           run multiturn python3 -m benchmarks.multiturn --shape llama3-8b ;;
    page-major) run page_major_tests python3 -m pytest -m gpu -q -p no:cacheprovider -k page-major tests
                for layout in layer-major page-major; do
                  run "offline_b64_$layout" python3 -m benchmarks.offline --preset llama3-8b-b64 --repeat 1 \
                    --skip-transformers --kv-cache-layout "$layout"
                  run "latency_$layout" python3 -m benchmarks.latency --shape llama3-8b --kv-cache-layout "$layout"
                done ;;
    pd-one-gpu) run pd_one_gpu python3 -m benchmarks.pd_gpu --device one-gpu --deadline 330 --rounds 5 ;;
    pd) run pd python3 -m benchmarks.pd_gpu --deadline 300 --rounds 5
        run pd_layer_major python3 -m benchmarks.pd_gpu --kv-cache-layout layer-major --skip-serving --deadline 120 ;;
    tp) run tp_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py \
          tests/pd/test_transfer_ordering.py tests/gpu/test_allreduce_gpu.py
        run allreduce python3 -m benchmarks.allreduce
        for size in 1 2; do
          run "offline_tp$size" python3 -m benchmarks.offline --preset llama3-8b-b64 --repeat 1 --skip-transformers \
            --tensor-parallel-size "$size"
        done ;;
    four-gpus) # Four GPUs: TP=4 against TP=1; PD between TP=2 engines of one process (cuda:0-1 -> cuda:2-3) over
               # NCCL, and over NIXL where its wheels were carried; the four-rank all-reduce table; batch 64 at TP=4.
      run four_gpu_tests python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -o faulthandler_timeout=300 \
        tests/gpu/test_tensor_parallel_gpu.py::test_cuda_tp4_equals_tp1_float32 \
        tests/pd/test_pd_tensor_parallel.py::test_cuda_tp2_pd_equals_colocated_float32
      run allreduce_4 python3 -m benchmarks.allreduce --ranks 4 --max-bytes 16777216
      run offline_tp4 python3 -m benchmarks.offline --preset llama3-8b-b64 --repeat 2 --skip-transformers \
        --tensor-parallel-size 4 ;;
    tp-mixed) # Mixed-step graphs under TP=2 (on by default there): the TP GPU tests, then a mixed step's time
              # with them on and off at TP=2 and at TP=1, then batch 64 at TP=2 with and without them.
              run tp_mixed_tests python3 -m pytest -m gpu -q -p no:cacheprovider \
                tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_allreduce_gpu.py
              for size in 2 1; do
                run "mixed_step_tp$size" python3 -m benchmarks.mixed_step --shape llama3-8b --tensor-parallel-size "$size"
              done
              # Batch 64 at TP=2 (4,096-token prefill-phase steps) with its prefill steps replayed and eager.
              for round in 1 2; do
                run "b64_tp2_eager_$round" "${b64_tp2[@]}" --no-mixed-step-graphs
                run "b64_tp2_graphs_$round" "${b64_tp2[@]}"
              done ;;
    tp-latency) # Batch-1 TPOT and prefill at 512 tokens at TP=2, TP=1 beside.
                latency=(python3 -m benchmarks.latency --shape llama3-8b --skip-transformers --prefill-lengths 512)
                run latency_tp2 "${latency[@]}" --tensor-parallel-size 2
                run latency_tp1 "${latency[@]}" ;;
    tp-host) # Prefill-heavy batch 64 (four output tokens: every run one prefill and three decode steps),
             # at TP=2 and TP=1: with py-spy carried, both processes sampled for 8 s without pausing them
             # (waits included) once the engine runs, summed by benchmarks/host_samples.py; without it,
             # one run under cProfile on every rank.
             spy=$(command -v py-spy || ls /tmp/tandem-site/bin/py-spy 2>/dev/null)
             for size in 2 1; do
               command=(python3 -m benchmarks.offline --preset llama3-8b-b64 --output-len 4 --skip-transformers
                        --timeline --tensor-parallel-size "$size")
               if [ -z "$spy" ]; then
                 run "tp${size}_host" "${command[@]}" --repeat 2 --host-profile 40
                 continue
               fi
               "${command[@]}" --repeat 150 > "$LOG_DIR/tp${size}_host.log" 2>&1 &
               pid=$!
               for _ in $(seq 600); do grep -q "state pool" "$LOG_DIR/tp${size}_host.log" && break; sleep 0.5; done
               sleep 4
               "$spy" record --pid "$pid" --subprocesses --threads --idle --nonblocking --rate 250 --duration 8 \
                 --format raw -o "$LOG_DIR/tp${size}_host.samples" > /dev/null 2>&1
               wait "$pid" || status=1
               grep -E "prompts waiting|decode only|^tandem" "$LOG_DIR/tp${size}_host.log"
               run "tp${size}_host_samples" python3 -m benchmarks.host_samples "$LOG_DIR/tp${size}_host.samples" \
                 --focus ModelRunner.forward PlanChannel.send PlanChannel.receive Event.synchronize JITFunction.run
             done ;;
    structured) run structured_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_structured_gpu.py
                run structured python3 -m benchmarks.structured --shape llama3-8b ;;
    itl-slo) run itl_slo_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/models/test_inter_token_budget.py
             model=$(python3 -c "from benchmarks.common import model_dir_for; \
print(model_dir_for('llama3-8b', 'dummy'))")
             for target in none 25; do
               flags=(); [ "$target" = none ] || flags=(--max-itl-ms "$target")
               run "serve_c16_itl_$target" python3 -m benchmarks.serve --model "$model" --load-format dummy \
                 --dtype bfloat16 --input-len 2048 --output-len 256 --concurrency 16 --requests-per-level 96 \
                 --no-offline "${flags[@]}"
             done ;;
    goodput-colocated) run goodput_colocated2 python3 -m benchmarks.goodput_deployments --deployment colocated:2 \
                         --request-rates 2 4 6 8 10 --num-requests 96 --ttft-slo-ms 1000 --itl-slo-ms 50 ;;
    goodput-slo) run goodput_colocated2_itl25 python3 -m benchmarks.goodput_deployments --deployment colocated:2 \
                   --max-itl-ms 25 --request-rates 2 4 6 8 10 --num-requests 96 --ttft-slo-ms 1000 --itl-slo-ms 50 ;;
    goodput-pd) run goodput_1p1d python3 -m benchmarks.goodput_deployments --deployment 1p1d \
                  --request-rates 2 4 6 8 10 --num-requests 96 --ttft-slo-ms 1000 --itl-slo-ms 50 ;;
    deploy) run deploy_gpu python3 -m benchmarks.deploy_gpu --log-dir "$LOG_DIR/deploy" ;;
    ray) run ray_tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_ray_executor_gpu.py
         for backend in mp ray; do
           run "offline_tp2_$backend" python3 -m benchmarks.offline --preset llama3-8b-b64 --repeat 2 --skip-transformers \
             --tensor-parallel-size 2 --distributed-executor-backend "$backend"
         done ;;
    regressions) run latency_bf16 python3 -m benchmarks.latency --shape llama3-8b --skip-transformers --prefill-lengths 512
                 run offline_nanovllm python3 -m benchmarks.offline --preset qwen3-0.6b-nanovllm --repeat 1 --skip-transformers
                 run offline_b256_fp8kv python3 -m benchmarks.offline --preset llama3-8b-b256 --repeat 1 --skip-transformers \
                   --kv-cache-dtype fp8 ;;
    targets) run latency_bf16 python3 -m benchmarks.latency --shape llama3-8b --skip-transformers --prefill-lengths 512
             run latency_fp8 python3 -m benchmarks.latency --shape llama3-8b --skip-transformers --prefill-lengths 512 \
               --quantization fp8
             run offline_nanovllm python3 -m benchmarks.offline --preset qwen3-0.6b-nanovllm --repeat 2 --skip-transformers \
               --timeline
             run offline_b256_fp8 python3 -m benchmarks.offline --preset llama3-8b-b256 --repeat 1 --skip-transformers \
               --kv-cache-dtype fp8 --quantization fp8 --timeline ;;
    sweeps) run attention_sweep_fp8 python3 -m benchmarks.kernels_attention --kv-cache-dtype fp8 --sweep
            run attention_sweep_bf16 python3 -m benchmarks.kernels_attention --sweep
            run kernels_fp8 python3 -m benchmarks.kernels_fp8 ;;
    fp8-attention) run attention_fp8_random python3 -m benchmarks.kernels_attention --kv-cache-dtype fp8
                   run attention_fp8_in_order python3 -m benchmarks.kernels_attention --kv-cache-dtype fp8 --pages in-order
                   run offline_b256_fp8_profiled python3 -m benchmarks.offline --preset llama3-8b-b256 --repeat 2 \
                     --skip-transformers --kv-cache-dtype fp8 --quantization fp8 --timeline --profile-steps 4 ;;
    *) echo "unknown part $part"; status=2 ;;
  esac
done
exit $status
