"""Offline throughput: tandem vs transformers on the same model and prompts, and the roofline.

Prints output tokens/s of tandem's ``LLM.generate``, of ``transformers``' ``generate`` (one
left-padded batch) and of its continuous-batching ``generate_batch`` (when present), the ratio
of tandem to the better of the two, and the workload's roofline (weights + state bytes of every
decode step over the measured copy bandwidth, FLOPs over the measured matrix rate).

    python -m benchmarks.offline                                  # ~30M-parameter llama on CPU, fp32
    python -m benchmarks.offline --preset qwen3-0.6b-nanovllm     # nano-vllm's workload (GPU)
    python -m benchmarks.offline --preset llama3-8b-b1            # Llama-3.1-8B shape, batch 1, 32, 256
    python -m benchmarks.offline --preset llama3-8b-b32
    python -m benchmarks.offline --preset llama3-8b-b256 --skip-transformers
    python -m benchmarks.offline --preset llama3-8b-b256 --skip-transformers --kv-cache-dtype fp8
    python -m benchmarks.offline --preset llama3-8b-b256 --kv-cache-dtype fp8 --quantization fp8  # FP8 weights
    python -m benchmarks.offline --preset llama3-8b-b256 --kv-cache-dtype fp8 --quantization fp8-block
    python -m benchmarks.offline --min-output-len 16 --output-len 128   # mixed output lengths
    python -m benchmarks.offline --preset llama3-8b-b64 --skip-transformers --tensor-parallel-size 2  # 2 GPUs
    python -m benchmarks.offline --preset llama3-8b-b64 --skip-transformers --tensor-parallel-size 2 \
        --distributed-executor-backend ray                        # the same, rank 1 a Ray actor
    python -m benchmarks.offline --preset qwen3-30b-a3b-b64 --skip-transformers    # MoE, batch 64 (and -b256)

For MoE models a decode step's roofline reads the routed experts its batch is expected to pick
(uniform routing), and a token's FLOPs count its ``top_k`` experts only.

With ``--tensor-parallel-size N`` the roofline is one rank's: its shard's weights and state
over one device's bandwidth (the ranks read theirs at once; collectives are not counted).

GPU presets use random bf16 weights made on the device (``--load-format dummy``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Callable, Optional

import torch


from tandem.config import KV_CACHE_DTYPE_CHOICES
from benchmarks.common import (Ceilings, ModelCost, add_quantization_argument, best_seconds, compiled_kernel_variants,
                    is_fp8_model, quantized_model_dir, release, synchronize, vocab_size_of)

GPU = dict(dtype="bfloat16", load_format="dummy", skip_transformers_batch=True)
# name: model shape and workload (defaults of the command line, which still override them)
PRESETS = {
    "tiny-30m": dict(shape="tiny-30m"),
    # nano-vllm's benchmark: 256 prompts, input and output lengths uniform in 100..1024.
    "qwen3-0.6b-nanovllm": dict(GPU, shape="qwen3-0.6b", num_prompts=256, min_input_len=100, max_input_len=1024,
                                min_output_len=100, output_len=1024, max_num_batched_tokens=16384),
    "llama3-8b-b1": dict(GPU, shape="llama3-8b", num_prompts=1, min_input_len=128, max_input_len=128,
                         output_len=256),
    # decode batches the FP8 weight-only products serve (2-16 tokens a step)
    "llama3-8b-b16": dict(GPU, shape="llama3-8b", num_prompts=16, min_input_len=128, max_input_len=128,
                          output_len=256),
    "llama3-8b-b32": dict(GPU, shape="llama3-8b", num_prompts=32, min_input_len=128, max_input_len=128,
                          output_len=256),
    "llama3-8b-b64": dict(GPU, shape="llama3-8b", num_prompts=64, min_input_len=128, max_input_len=128,
                          output_len=256),
    "llama3-8b-b256": dict(GPU, shape="llama3-8b", num_prompts=256, min_input_len=1000, max_input_len=1000,
                           output_len=1000, max_num_batched_tokens=16384),
    # Qwen3-30B-A3B shape (bf16 weights: 61 GB; K/V 96 KiB a token): decode-bound, 128-token
    # prompts and 256 output tokens each, all in the state pool of one 80 GB GPU at batch 256.
    "qwen3-30b-a3b-b64": dict(GPU, shape="qwen3-30b-a3b", num_prompts=64, min_input_len=128, max_input_len=128,
                              output_len=256, max_num_batched_tokens=8192),
    "qwen3-30b-a3b-b256": dict(GPU, shape="qwen3-30b-a3b", num_prompts=256, min_input_len=128, max_input_len=128,
                               output_len=256, max_num_batched_tokens=8192),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: build the preset's shape)")
    parser.add_argument("--preset", default="tiny-30m", choices=sorted(PRESETS))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--min-output-len", type=int, default=None,
                        help="draw each request's output length from [min, --output-len] (default: all "
                             "--output-len). transformers' batch APIs take one max_new_tokens per batch, "
                             "so they generate --output-len for every request; only requested tokens count")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto")
    add_quantization_argument(parser)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true", help="tandem without CUDA graphs")
    parser.add_argument("--mixed-step-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="CUDA graphs for steps with a prompt chunk (tandem serve --mixed-step-graphs)")
    parser.add_argument("--mixed-step-graph-sizes", type=int, nargs="+", default=None, metavar="TOKENS",
                        help="the token counts to capture them for (tandem serve --mixed-step-graph-sizes)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="tandem's paged K/V: auto (the model dtype) or fp8 (e4m3; the roofline counts "
                             "the state bytes the engine actually stores)")
    parser.add_argument("--kv-cache-layout", choices=("layer-major", "page-major"), default=None,
                        help="tandem's device pools (default: the engine's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="tandem over this many ranks (GPUs) (default: %(default)s)")
    parser.add_argument("--disable-custom-all-reduce", action="store_true", default=None,
                        help="tensor parallelism: NCCL for every all-reduce (the engine's peer all-reduce off)")
    parser.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                        help="how ranks 1..N-1 run: processes of this host (mp) or Ray actors (ray: the cluster "
                             "at RAY_ADDRESS, or a local one) (default: the engine's, mp)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="fraction of device memory tandem may use (default: the engine's)")
    parser.add_argument("--preemption-mode", choices=("recompute", "swap"), default=None,
                        help="how tandem preempts when the state pool is full (default: the engine's)")
    parser.add_argument("--host-cache-size", type=float, default=None,
                        help="GiB of pinned host memory for the host tier (swap preemption needs it)")
    parser.add_argument("--timeline", action="store_true",
                        help="also print where tandem's time went: steps while prompts are still being "
                             "prefilled against steps of decode alone, and preemptions")
    parser.add_argument("--profile-steps", type=int, default=0, metavar="N",
                        help="with --timeline: also profile N steps of each phase on the device (from the "
                             "prefill-phase step --profile-prefill-from, and decode-only steps from the middle "
                             "of the decode phase's expected length) in the last timed run: GPU busy per step and the "
                             "kernels taking the most time (that run's time includes the profiler's: "
                             "--repeat 3 keeps two runs without it)")
    parser.add_argument("--profile-prefill-from", type=int, default=3, metavar="K",
                        help="with --profile-steps: the prefill-phase step of the last timed run the profiler "
                             "starts at (default 3; 0 for workloads of a few prefill-phase steps)")
    parser.add_argument("--profile-trace", metavar="DIR",
                        help="with --profile-steps: also write each profiled phase's trace (Chrome format) here")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="after the timed runs, one more run under cProfile (the engine process's main thread; "
                             "each worker rank's too): print the N functions taking the most host time of their "
                             "own, and every thread's CPU time during that run")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-transformers-batch", action="store_true",
                        help="skip transformers' continuous-batching generate_batch")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per system (best is kept)")
    parser.add_argument("--json", help="also write the results here")
    preset = PRESETS[parser.parse_known_args()[0].preset]
    parser.set_defaults(**{key: value for key, value in preset.items() if key != "shape"})
    args = parser.parse_args()
    args.shape = preset["shape"]
    return args


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab_size) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
            for _ in range(args.num_prompts)]


def make_output_lengths(args) -> list[int]:
    rng = random.Random(1)
    low = args.output_len if args.min_output_len is None else args.min_output_len
    return [rng.randint(low, args.output_len) for _ in range(args.num_prompts)]


def timed(function, repeat: int) -> float:
    return best_seconds(function, repeat, warm_up=False)


def optional_engine_arguments(args) -> dict:
    """The engine options this run sets only when asked, so the engine's defaults stay its own."""
    names = ("gpu_memory_utilization", "preemption_mode", "host_cache_size", "kv_cache_layout", "quantization",
             "distributed_executor_backend", "disable_custom_all_reduce", "mixed_step_graph_sizes")
    return {name: tuple(value) if isinstance(value, list) else value
            for name in names if (value := getattr(args, name)) is not None}


class StepTimeline:
    """Wraps the engine's ``step`` to time each call and note whether any prompt was still
    waiting or being prefilled when it began (a prefill-phase step) and the preemptions so far.
    With ``profile_steps``, ``profile_steps`` steps of each phase run under the torch profiler
    (from prefill-phase step ``prefill_profile_at``, and from decode-only step ``decode_profile_at``) in the
    last of ``runs`` timed runs, when the engine has paid its one-time costs (a fresh engine's
    first run meets new shapes: cuBLAS's choices, allocator growth)."""

    def __init__(self, engine, profile_steps: int = 0, decode_profile_at: int = 0, trace_dir=None,
                 runs: int = 1, prefill_profile_at: int = 3) -> None:
        import time

        self.trace_dir = trace_dir
        self.engine, self.steps, self._step, self._clock = engine, [], engine.step, time.perf_counter
        self.profile_steps, self._profile_from = profile_steps, {True: prefill_profile_at, False: decode_profile_at}
        self._profiler, self._profiled, self.profiles = None, 0, {}
        self._runs_left, self._run_steps = runs, {True: 0, False: 0}  # this run's steps of each phase so far
        engine.step = self._timed_step

    def start_run(self) -> None:
        """Called before each timed run: the profiler waits for the last one."""
        self._runs_left -= 1
        self._run_steps = {True: 0, False: 0}

    def _timed_step(self):
        scheduler = self.engine.scheduler
        prefilling = bool(scheduler.waiting) or any(
            sequence.num_computed_tokens < sequence.num_prompt_tokens for sequence in scheduler.running)
        self._maybe_profile(prefilling)
        batch, context = len(scheduler.running), sum(sequence.num_computed_tokens for sequence in scheduler.running)
        preempted, start = scheduler.num_preemptions, self._clock()
        deltas = self._step()
        self.steps.append((prefilling, self._clock() - start, scheduler.num_preemptions - preempted, batch, context))
        self._run_steps[prefilling] += 1
        return deltas

    def _report_decode_by_batch(self, cost: ModelCost, ceilings: Ceilings) -> None:
        """Decode-only steps by batch size (powers of two): their wall time against the time
        their bytes take at the copy bandwidth (the weights and every running sequence's state),
        so where in a run the steps fall short of the bytes shows."""
        groups: dict[int, list] = {}
        for prefilling, seconds, _, batch, context in self.steps:
            if not prefilling and batch:
                bound = (cost.decode_weight_bytes(batch) + cost.state_bytes_per_token * context) / ceilings.bandwidth
                group = groups.setdefault(1 << (batch - 1).bit_length(), [0, 0.0, 0.0])
                group[0], group[1], group[2] = group[0] + 1, group[1] + seconds, group[2] + bound
        if not groups:
            return
        print(f"{'decode-only steps by batch':<30}{'steps':>8}{'seconds':>10}{'ms/step':>10}{'of bytes':>13}")
        for top, (count, seconds, bound) in sorted(groups.items()):
            least = top // 2 + 1
            name = f"  {least}-{top} sequences" if least < top else f"  {top} sequence{'s' if top > 1 else ''}"
            print(f"{name:<30}{count:>8}{seconds:>10.2f}{1e3 * seconds / count:>10.2f}{bound / seconds:>13.2f}")

    def _maybe_profile(self, prefilling: bool) -> None:
        """Start the profiler at a phase's chosen step; stop it ``profile_steps`` steps later."""
        if not self.profile_steps or prefilling in self.profiles or self._runs_left > 0:
            return
        if self._profiler is not None:
            self._profiled += 1
            if self._profiled == self.profile_steps or self._profiler_phase != prefilling:
                self._finish_profile()
            return
        if self._run_steps[prefilling] == self._profile_from[prefilling]:
            from torch.profiler import ProfilerActivity, profile

            # (on a CPU the operators stand in for kernels: nested, so their sum overstates the busy time)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profiler, self._profiler_phase, self._profiled = profile(activities=activities), prefilling, 0
            self._profiler.__enter__()
            self._profile_start = self._clock()

    def _finish_profile(self) -> None:
        synchronize()
        seconds = self._clock() - self._profile_start
        self._profiler.__exit__(None, None, None)
        if self.trace_dir:
            Path(self.trace_dir).mkdir(parents=True, exist_ok=True)
            phase = "prefill" if self._profiler_phase else "decode"
            self._profiler.export_chrome_trace(str(Path(self.trace_dir) / f"{phase}.json"))
        kernels: dict[str, tuple[float, int]] = {}  # name: (milliseconds, launches)
        for event in self._profiler.events():
            if torch.cuda.is_available() and event.device_type == torch.autograd.DeviceType.CUDA:
                milliseconds = event.device_time / 1e3
            elif not torch.cuda.is_available():
                milliseconds = event.self_cpu_time_total / 1e3
            else:
                continue
            total, launches = kernels.get(event.name, (0.0, 0))
            kernels[event.name] = (total + milliseconds, launches + 1)
        host = self._profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        self.profiles[self._profiler_phase] = (self._profiled, seconds, kernels, host)
        self._profiler = None

    def report(self, cost: Optional[ModelCost] = None, ceilings: Optional[Ceilings] = None) -> None:
        print(f"{'tandem steps (timed runs)':<30}{'steps':>8}{'seconds':>10}{'ms/step':>10}{'preemptions':>13}")
        for name, phase in (("prompts waiting/prefilling", True), ("decode only", False)):
            rows = [step for step in self.steps if step[0] == phase]
            seconds = sum(step[1] for step in rows)
            print(f"{name:<30}{len(rows):>8}{seconds:>10.2f}{1e3 * seconds / max(len(rows), 1):>10.2f}"
                  f"{sum(step[2] for step in rows):>13}")
        if cost is not None and ceilings is not None:
            self._report_decode_by_batch(cost, ceilings)
        for phase, (count, seconds, kernels, host) in self.profiles.items():
            busy = sum(milliseconds for milliseconds, _ in kernels.values())
            launches = sum(launched for _, launched in kernels.values())
            print(f"profiled {'prefill-phase' if phase else 'decode-only'} steps: {count}, wall "
                  f"{1e3 * seconds / count:.2f} ms/step, GPU kernels {busy / count:.2f} ms/step "
                  f"(busy {busy / 1e3 / seconds:.2f}), {launches / count:.0f} launches/step")
            for name, (milliseconds, launched) in sorted(kernels.items(), key=lambda item: -item[1][0])[:20]:
                print(f"   {milliseconds / count:>8.3f} ms/step {launched / count:>6.0f} x  {name[:100]}")
            print(f"host operators (all {count} steps):\n{host}")
        if torch.cuda.is_available():
            variants = compiled_kernel_variants()
            print("Triton kernels compiled (specialisations): "
                  + ", ".join(f"{name} {count}" for name, count in sorted(variants.items(), key=lambda x: -x[1])))
            stats = torch.cuda.memory_stats()
            print("device allocator: " + ", ".join(f"{key} {stats.get(key, 0)}" for key in (
                "num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")))
        self.steps.clear()


def run_tandem(model_dir, prompts, output_lengths, args,
               ceilings: Optional[Ceilings] = None) -> tuple[float, ModelCost]:
    from tandem import LLM, SamplingParams

    rank_profiles = None
    if args.host_profile and args.tensor_parallel_size > 1:  # (the worker ranks read it when they start)
        import tempfile

        rank_profiles = tempfile.mkdtemp(prefix="tandem-rank-profiles-")
        os.environ["TANDEM_RANK_PROFILE"] = rank_profiles
    llm = LLM(model=model_dir, dtype=args.dtype, load_format=args.load_format, page_size=args.page_size,
              max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager, mixed_step_graphs=args.mixed_step_graphs,
              kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size,
              max_model_len=max(map(len, prompts)) + max(output_lengths),
              **optional_engine_arguments(args))
    pool_tokens = llm.engine.coordinator.plan.usable_pages * llm.engine.coordinator.page_size
    peak_tokens = sum(len(prompt) + output for prompt, output in zip(prompts, output_lengths))
    print(f"state pool: {pool_tokens} tokens; every request at full length: {peak_tokens}"
          + (" (preemption expected)" if peak_tokens > pool_tokens else ""))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lengths]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    timeline = (StepTimeline(llm.engine, args.profile_steps, max(output_lengths) // 2, args.profile_trace,
                             runs=args.repeat, prefill_profile_at=args.profile_prefill_from)
                if args.timeline else None)

    def run() -> None:
        if timeline is not None:
            timeline.start_run()
        llm.generate(prompts, params, use_tqdm=False)

    seconds = timed(run, args.repeat)
    print(f"tandem timed run: {seconds:.3f} s, {sum(output_lengths) / seconds:.1f} output tok/s", flush=True)
    cost = ModelCost.of_engine(llm.engine)
    if timeline is not None:
        timeline.report(cost, ceilings)
    if args.host_profile:
        processes = [os.getpid(), *getattr(llm.engine.executor, "worker_pids", [])]
        profile_host(lambda: llm.generate(prompts, params, use_tqdm=False), args.host_profile, processes)
    preemptions = llm.engine.stats().num_preemptions
    if preemptions:
        print(f"tandem preempted {preemptions} times (state pool too small for the whole batch)")
    release(llm)
    if rank_profiles is not None:
        os.environ.pop("TANDEM_RANK_PROFILE", None)
        print_rank_profiles(rank_profiles, args.host_profile)
    return seconds, cost


def profile_host(run: Callable[[], None], count: int, processes: list[int]) -> None:
    """One untimed ``run`` under cProfile (this process's main thread: the engine core and rank 0's
    worker); prints the ``count`` functions with the most time of their own, then by cumulative
    time, and the CPU time every thread of ``processes`` (this one and the worker ranks') took
    during the run, with the CPUs it may run on: a thread that spins, or two busy threads held to
    the same CPUs, show there."""
    import cProfile
    import time

    profiler = cProfile.Profile()
    before, started = {pid: thread_times(pid) for pid in processes}, time.perf_counter()
    profiler.runcall(run)
    seconds = time.perf_counter() - started
    print_host_profile("one run, rank 0 (the engine core's process)", profiler, count)
    print(f"threads during that run ({seconds:.2f} s; CPU seconds, the share of the run, the CPUs allowed):")
    for rank, pid in enumerate(processes):
        for tid, (name, cpu, allowed) in sorted(thread_times(pid).items(), key=lambda item: -item[1][1]):
            used = cpu - before[pid].get(tid, (name, 0.0, allowed))[1]
            if used >= 0.01 * seconds:
                print(f"  rank {rank} pid {pid} thread {tid} {name:<16} {used:7.2f} s {used / seconds:5.0%}  "
                      f"cpus {cpu_ranges(allowed)}")


def thread_times(pid: int) -> dict[int, tuple[str, float, set]]:
    """Each thread of ``pid``: its name, the CPU seconds it has used, the CPUs it may run on
    (Linux ``/proc``; empty where it is not there or the process is gone)."""
    from benchmarks.serve import cpu_seconds

    threads = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            threads[int(tid)] = (name, cpu_seconds(f"/proc/{pid}/task/{tid}/stat"), os.sched_getaffinity(int(tid)))
        except OSError:  # (the thread ended meanwhile)
            continue
    return threads


def cpu_ranges(cpus: set) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``."""
    ranges, ordered = [], sorted(cpus)
    for cpu in ordered:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{first}-{last}" if last > first else f"{first}" for first, last in ranges)


def print_host_profile(what: str, profile, count: int) -> None:
    import pstats

    for order in ("tottime", "cumulative"):
        print(f"host profile of {what} (cProfile, by {order}):")
        pstats.Stats(profile).sort_stats(order).print_stats(count)


def print_rank_profiles(directory: str, count: int) -> None:
    """The plan loops of ranks 1..N-1 (``TANDEM_RANK_PROFILE``), written when they stopped."""
    for path in sorted(Path(directory).glob("rank*.prof")):
        print_host_profile(f"{path.stem}'s whole life (its plan loop, warm-up and every run)", str(path), count)


def load_transformers(model_dir, args):
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.load_format == "dummy":
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return model.eval(), device


def run_transformers_padded(model, device, prompts, args) -> float:
    longest = max(len(p) for p in prompts)
    input_ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)

    def generate():
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    generate() if args.repeat > 1 else None
    return timed(generate, max(1, args.repeat - 1))


def run_transformers_continuous(model, prompts, args):
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)

    def generate():
        model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    try:
        generate()
        return timed(generate, max(1, args.repeat - 1))
    except Exception as error:  # report, don't hide: the table says why it is missing
        print(f"generate_batch failed: {type(error).__name__}: {error}", file=sys.stderr)
        return None


def main() -> None:
    args = parse_args()
    model_dir, args.quantization = quantized_model_dir(args)
    prompts = make_prompts(args, vocab_size_of(model_dir))
    output_lengths = make_output_lengths(args)
    output_tokens = sum(output_lengths)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    fp8 = is_fp8_model(model_dir, args.quantization)
    if fp8 and not args.skip_transformers:
        print("FP8 weights: transformers is not run (it has no FP8 products on this path)")
        args.skip_transformers = True
    ceilings = Ceilings.measure(dtype, fp8=fp8)
    tandem_seconds, cost = run_tandem(model_dir, prompts, output_lengths, args, ceilings)
    name = "tandem" + (" (eager)" if args.enforce_eager else "" if args.mixed_step_graphs else " (no mixed graphs)")
    backend = f", {args.distributed_executor_backend}" if args.distributed_executor_backend else ""
    backend += ", NCCL all-reduce" if args.disable_custom_all_reduce else ""
    name += f" (TP={args.tensor_parallel_size}{backend})" if args.tensor_parallel_size > 1 else ""
    results = {name: tandem_seconds}
    if not args.skip_transformers:
        model, device = load_transformers(model_dir, args)
        results["transformers generate (padded)"] = run_transformers_padded(model, device, prompts, args)
        if not args.skip_transformers_batch:
            results["transformers generate_batch"] = run_transformers_continuous(model, prompts, args)
    roofline = cost.roofline_seconds(ceilings, list(map(len, prompts)), output_lengths)
    print(f"\nmodel {model_dir} ({args.preset if not args.model else 'given'}), {args.dtype}, "
          f"KV cache {args.kv_cache_dtype} ({cost.state_bytes_per_token / 1024:.0f} KiB per token)")
    print(ceilings.describe())
    print(f"weights read per decode step of {len(prompts)} sequences {cost.decode_weight_bytes(len(prompts)) / 1e9:.2f} GB"
          + (" (FP8 weights and their scales)" if fp8 and torch.cuda.is_available() else "")
          + (f"; routed experts read: {cost.experts.fraction_read(len(prompts)):.0%}" if cost.experts.top_k else ""))
    lengths = (f"{args.output_len}" if args.min_output_len is None
               else f"{args.min_output_len}-{args.output_len} (total {output_tokens})")
    print(f"{len(prompts)} prompts of {args.min_input_len}-{args.max_input_len} tokens, {lengths} output tokens each\n")
    print(f"{'system':<34}{'seconds':>10}{'output tok/s':>15}{'of roofline':>13}")
    for name, seconds in list(results.items()) + [("roofline", roofline)]:
        if seconds is None:
            print(f"{name:<34}{'n/a':>10}{'n/a':>15}")
        else:
            print(f"{name:<34}{seconds:>10.3f}{output_tokens / seconds:>15.1f}{roofline / seconds:>13.2f}")
    tandem = next(iter(results.values()))
    baselines = [s for name, s in list(results.items())[1:] if s is not None]
    if baselines:
        print(f"\ntandem / best transformers: {min(baselines) / tandem:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "roofline": roofline,
                                               "output_tokens": output_tokens}, indent=2))


if __name__ == "__main__":
    main()
