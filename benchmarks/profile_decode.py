"""Where a decode step's time goes: kernel launches per step, GPU busy fraction, the replayed
forward alone against the whole engine step, and the host's share (scheduling, inputs, sampling
and output handling).

    python -m benchmarks.profile_decode                      # Llama-3.1-8B shape, batch 1 (GPU)
    python -m benchmarks.profile_decode --batch 64 --shape qwen3-0.6b
    python -m benchmarks.profile_decode --shape micro --batch 256 --prompt-len 800   # CPU: host work per sequence

On a CPU the forward pass is timed apart (it is synchronous there), and the rest of a step, over
the batch, is the host's work per sequence per step: scheduling, step inputs, sampling metadata,
token bookkeeping and output handling. Those two figures are CPU time of the process (steadier
than wall time on a shared machine; run with ``OMP_NUM_THREADS=1``).
"""
from __future__ import annotations

import argparse
import random
import time

import torch


from benchmarks.common import SHAPES, model_dir_for, synchronize, vocab_size_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", help="tandem's paged K/V dtype: auto or fp8")
    parser.add_argument("--python-profile", action="store_true",
                        help="also print the host's Python functions by time over a few steps (cProfile)")
    parser.add_argument("--python-profile-sort", choices=("tottime", "cumulative"), default="tottime",
                        help="with --python-profile: order the functions by their own time or by the time "
                             "under them")
    args = parser.parse_args()
    from tandem import LLM, SamplingParams
    from tandem.protocol import EngineRequest

    gpu = torch.cuda.is_available()
    model_dir = model_dir_for(args.shape, "dummy" if gpu else "auto")
    llm = LLM(model=model_dir, dtype="bfloat16" if gpu else "float32", load_format="dummy" if gpu else "auto",
              max_num_seqs=max(args.batch, 1), max_model_len=args.prompt_len + 4 * args.steps + 64,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
              async_scheduling=True)  # the overlapped loop, as on a GPU, on a CPU too
    engine = llm.engine
    rng = random.Random(0)
    vocab = vocab_size_of(model_dir)
    params = SamplingParams(temperature=0, max_tokens=4 * args.steps, ignore_eos=True)
    for index in range(args.batch):
        engine.add_request(EngineRequest(request_id=str(index), sampling_params=params,
                                         prompt_token_ids=[rng.randrange(10, vocab) for _ in range(args.prompt_len)]))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill until every sequence decodes
    for _ in range(8):
        engine.step()  # warm-up
    forward_seconds = time_forward_passes(engine.runner.model) if not gpu else [0.0]
    synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        engine.step()
    synchronize()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    step_cpu_ms = (time.process_time() - start_cpu) / args.steps * 1e3
    forward_ms = forward_seconds[0] / args.steps * 1e3

    replay_ms = float("nan")
    graphs = engine.runner.graphs
    if graphs is not None:
        size = next(s for s in graphs.batch_sizes if s >= args.batch)
        graph = graphs.graphs[size]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        begin.record()
        for _ in range(args.steps):
            graph.replay()
        end.record()
        synchronize()
        replay_ms = begin.elapsed_time(end) / args.steps

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as profiler:
        for _ in range(8):
            engine.step()
        synchronize()
    kernels = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(event.device_time for event in kernels) / 1e3 / 8
    print(f"\n{args.shape}, batch {args.batch}, {'CUDA graphs' if graphs is not None else 'eager'}")
    print(f"{'engine step (ms)':<36}{step_ms:>10.3f}")
    if not gpu:
        print(f"{'engine step, CPU time (ms)':<36}{step_cpu_ms:>10.3f}")
        print(f"{'forward pass, CPU time (ms)':<36}{forward_ms:>10.3f}")
        print(f"{'host per sequence per step (us)':<36}{(step_cpu_ms - forward_ms) / args.batch * 1e3:>10.2f}")
    print(f"{'graph replay alone (ms)':<36}{replay_ms:>10.3f}")
    print(f"{'host share of a step (ms)':<36}{step_ms - replay_ms:>10.3f}")
    print(f"{'GPU kernels per step':<36}{len(kernels) / 8:>10.1f}")
    print(f"{'GPU busy per step (ms)':<36}{busy_ms:>10.3f}")
    print(f"{'GPU busy fraction':<36}{busy_ms / step_ms:>10.2f}")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if args.python_profile:
        import cProfile
        import pstats

        python_profiler = cProfile.Profile()
        python_profiler.runcall(lambda: [engine.step() for _ in range(16)])
        pstats.Stats(python_profiler).sort_stats(args.python_profile_sort).print_stats(25)


def time_forward_passes(model: torch.nn.Module) -> list[float]:
    """Hooks adding each forward pass's CPU time (synchronous on a CPU) to the returned cell."""
    total, starts = [0.0], []
    model.register_forward_pre_hook(lambda module, inputs: starts.append(time.process_time()))

    def finished(module, inputs, output):
        total[0] += time.process_time() - starts.pop()

    model.register_forward_hook(finished)
    return total


if __name__ == "__main__":
    main()
