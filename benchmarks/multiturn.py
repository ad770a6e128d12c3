"""Multi-turn conversations with the state tiers on and off, and a long prompt's host hit.

    python -m benchmarks.multiturn                                # tiny model on CPU
    python -m benchmarks.multiturn --shape llama3-8b              # Llama-3.1-8B shape, bf16 (GPU)
    python -m benchmarks.multiturn --pd                           # over PD: decode offload off vs on

Conversations: ``--users`` users × ``--rounds`` rounds. Each round's prompt is the user's whole
conversation so far (previous prompts and answers) plus a new message of ``--message-len``
tokens; every user's round r is submitted together, answers are ``--output-len`` tokens. The
device pool is kept small (``--device-pool-tokens``) so the conversations do not all fit and
earlier turns get evicted: without tiers they are recomputed, with a host tier they come back
from host memory. Printed: TTFT p50/p90 (time from submission to a request's first token, the
engine stepping all requests together), output throughput, and prompt tokens by where they came
from (device cache, host tier, disk tier, computed).

Long prompt: TTFT of one ``--long-prompt`` token prompt computed from nothing against the same
prompt restored from the host tier after the device cache was flushed (``--host-cache-size``),
and the host→device bandwidth of that restore against the measured pinned-copy rate.
"""
from __future__ import annotations

import argparse
import random
import time

import torch


from benchmarks.common import add_model_arguments, resolve_model_arguments, model_dir_for, release, synchronize, vocab_size_of


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--users", type=int, default=None, help="default: 8 on CPU, 32 on a GPU")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=None, help="first prompt (default: 256 CPU, 2000 GPU)")
    parser.add_argument("--message-len", type=int, default=None, help="each later message (default: 64, 500)")
    parser.add_argument("--output-len", type=int, default=None, help="answer length (default: 16, 100)")
    parser.add_argument("--device-pool-tokens", type=int, default=None,
                        help="device pool in tokens (default: a third of what all conversations need)")
    parser.add_argument("--host-cache-size", type=float, default=None, help="GB (default: 0.5 CPU, 24 GPU)")
    parser.add_argument("--long-prompt", type=int, default=None, help="tokens (default: 2000 CPU, 10000 GPU)")
    parser.add_argument("--skip-conversations", action="store_true")
    parser.add_argument("--skip-long-prompt", action="store_true")
    parser.add_argument("--pd", action="store_true",
                        help="conversations over PD instead (multiturn_pd.py): TTFT of rounds 2..R with decode "
                             "offload off and on (defaults: answers longer than messages, as in chat)")
    args = parser.parse_args()
    gpu = resolve_model_arguments(args)
    defaults = dict(users=(32, 8), first_len=(2000, 256), message_len=(500, 64), output_len=(100, 16),
                    host_cache_size=(24.0, 0.5), long_prompt=(10000, 2000))
    if args.pd:
        defaults.update(users=(32, 4), message_len=(100, 16), output_len=(500, 128))
    for name, (on_gpu, on_cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    return args


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def make_llm(model_dir, args, pool_tokens: int, host_cache_size: float, max_model_len: int):
    from tandem import LLM

    return LLM(model=model_dir, dtype=args.dtype, load_format=args.load_format, max_total_tokens=pool_tokens,
               max_model_len=max_model_len, max_num_batched_tokens=8192, max_num_seqs=max(args.users, 1),
               host_cache_size=host_cache_size)


def run_round(engine, prompts: list[list[int]], output_len: int, round_number: int):
    """Submit every prompt, step until all finish; per request TTFT and its output tokens."""
    from tandem import SamplingParams
    from tandem.protocol import EngineRequest

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    submitted = time.perf_counter()
    for user, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=f"u{user}r{round_number}", prompt_token_ids=prompt,
                                         sampling_params=params))
    first_token: dict[str, float] = {}
    outputs: dict[str, list[int]] = {f"u{user}r{round_number}": [] for user in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id not in first_token:
                first_token[delta.request_id] = time.perf_counter() - submitted
            outputs[delta.request_id].extend(delta.new_token_ids)
    engine.finish_in_flight()
    return [first_token[f"u{user}r{round_number}"] for user in range(len(prompts))], \
        [outputs[f"u{user}r{round_number}"] for user in range(len(prompts))], time.perf_counter() - submitted


def conversations(model_dir, args, vocab_size, host_cache_size: float) -> dict:
    rng = random.Random(0)
    histories = [[rng.randrange(10, vocab_size) for _ in range(args.first_len)] for _ in range(args.users)]
    longest = args.first_len + (args.rounds - 1) * args.message_len + args.rounds * args.output_len + 16
    needed = args.users * longest
    pool = args.device_pool_tokens or max(needed // 3, longest + 256)
    llm = make_llm(model_dir, args, pool, host_cache_size, longest)
    engine = llm.engine
    ttfts, seconds, generated = [], 0.0, 0
    computed_before = 0
    for round_number in range(args.rounds):
        if round_number:
            for history in histories:
                history.extend(rng.randrange(10, vocab_size) for _ in range(args.message_len))
        ttft, outputs, elapsed = run_round(engine, [list(h) for h in histories], args.output_len, round_number)
        ttfts += ttft
        seconds += elapsed
        generated += sum(len(output) for output in outputs)
        for history, output in zip(histories, outputs):
            history.extend(output)
    stats = engine.stats()
    tiers = stats.tiers
    host = tiers.host_hit_tokens if tiers else 0
    disk = tiers.disk_hit_tokens if tiers else 0
    result = dict(pool=pool, p50=percentile(ttfts, 0.5), p90=percentile(ttfts, 0.9), throughput=generated / seconds,
                  device=stats.prefix_cache_hit_tokens - host - disk, host=host, disk=disk,
                  computed=stats.prefix_cache_query_tokens - stats.prefix_cache_hit_tokens - computed_before,
                  swaps=tiers.swaps if tiers else {}, preemptions=stats.num_preemptions)
    release(llm)
    return result


def long_prompt(model_dir, args, vocab_size) -> dict:
    from tandem import SamplingParams

    rng = random.Random(1)
    prompt = [rng.randrange(10, vocab_size) for _ in range(args.long_prompt)]
    llm = make_llm(model_dir, args, args.long_prompt + 1024, args.host_cache_size, args.long_prompt + 64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(flush_host: bool) -> float:
        engine.tiers.drain()
        engine.reset_prefix_cache()
        if flush_host:
            drop_host_copies(engine)
        synchronize()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        synchronize()
        return time.perf_counter() - start

    ttft(True)  # warm-up: kernels for this length
    recompute = min(ttft(True) for _ in range(2))
    before = engine.stats().tiers
    hit = min(ttft(False) for _ in range(2))
    after = engine.stats().tiers
    moved = after.copy_bytes["h2d"] - before.copy_bytes["h2d"]
    moved_seconds = after.copy_seconds["h2d"] - before.copy_seconds["h2d"]
    result = dict(recompute=recompute, hit=hit, h2d_rate=moved / moved_seconds if moved_seconds else float("nan"),
                  pinned_rate=pinned_copy_rate(), hit_tokens=after.host_hit_tokens - before.host_hit_tokens)
    release(llm)
    return result


def drop_host_copies(engine) -> None:
    tiers = engine.tiers
    for node in engine.coordinator.prefix_cache.all_nodes():
        if node.host_pages is not None and node.pages is None and not node.lock_count:
            tiers._evict_from_host(node)


def pinned_copy_rate() -> float:
    """Host→device bytes per second of one large pinned copy (the ceiling for restores)."""
    if not torch.cuda.is_available():
        return float("nan")
    source = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(source, device="cuda")
    best = float("inf")
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return source.numel() / best


def main() -> None:
    args = parse_args()
    model_dir = args.model or model_dir_for(args.shape, args.load_format)
    vocab_size = vocab_size_of(model_dir)
    print(f"\nmodel {model_dir} ({args.shape}), {args.dtype}")
    if args.pd:
        from benchmarks.multiturn_pd import report_pd

        report_pd(model_dir, args, vocab_size, percentile)
        return
    if not args.skip_conversations:
        off = conversations(model_dir, args, vocab_size, 0.0)
        on = conversations(model_dir, args, vocab_size, args.host_cache_size)
        print(f"\n{args.users} users x {args.rounds} rounds: first prompt {args.first_len}, messages "
              f"{args.message_len}, answers {args.output_len} tokens; device pool {on['pool']} tokens")
        print(f"{'tiers':<24}{'TTFT p50 (ms)':>14}{'TTFT p90 (ms)':>14}{'out tok/s':>11}"
              f"{'device hit':>12}{'host hit':>10}{'disk hit':>10}{'preempt':>9}")
        for name, figures in (("off", off), (f"host {args.host_cache_size} GB", on)):
            print(f"{name:<24}{figures['p50'] * 1e3:>14.1f}{figures['p90'] * 1e3:>14.1f}{figures['throughput']:>11.0f}"
                  f"{figures['device']:>12}{figures['host']:>10}{figures['disk']:>10}{figures['preemptions']:>9}")
        print(f"TTFT p50 ratio off/on: {off['p50'] / on['p50']:.2f}x; p90: {off['p90'] / on['p90']:.2f}x")
    if not args.skip_long_prompt:
        figures = long_prompt(model_dir, args, vocab_size)
        print(f"\none {args.long_prompt}-token prompt, TTFT (one output token)")
        print(f"{'recompute (ms)':<28}{figures['recompute'] * 1e3:>10.1f}")
        print(f"{'host-tier hit (ms)':<28}{figures['hit'] * 1e3:>10.1f}   ({figures['hit_tokens'] // 2} tokens restored)")
        rate, pinned = figures["h2d_rate"], figures["pinned_rate"]
        if not torch.cuda.is_available():
            return  # on a CPU the "copies" are memory moves inside one forward pass: no rate
        print(f"{'host->device (GB/s)':<28}{rate / 1e9:>10.1f}   pinned-copy rate {pinned / 1e9:.1f} GB/s "
              f"-> {rate / pinned:.2f} of it")


if __name__ == "__main__":
    main()
