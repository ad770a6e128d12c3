"""Structured outputs: the host's share of a constrained decode step, without a model.

    python -m benchmarks.structured_host                 # 64 rows, 128 steps, Llama-3's 128k vocabulary
    python -m benchmarks.structured_host --profile       # and where the time goes (cProfile)

``--batch`` sequences constrained by the 10-field function-calling schema of
``benchmarks/structured.py`` each take, step after step, a random token their grammar allows (as a
random-weight model does: mostly inside JSON strings, where a mask costs the most). Timed per step:
the engine's ``StructuredOutputs.bitmask`` (matchers brought level with the new tokens, the
mask filled on the fill threads, staged and copied to the device), i.e. what the host must finish
while the device runs the step's forward pass; and a cache hit (the grammar found, a matcher made).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch


from benchmarks.common import model_dir_for, vocab_size_of
from benchmarks.structured import function_call_schema


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", help="whose tokenizer (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--hits", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true")
    return parser.parse_args()


def allowed_tokens(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def decode_steps(structured, constraint, args, vocab_size: int) -> list[float]:
    """Seconds of ``bitmask`` per step, each row then taking a random allowed token."""
    rng = random.Random(0)
    sequences = []
    for _ in range(args.batch):
        sequence = SimpleNamespace(grammar=None, output_token_ids=[], is_finished=False)
        structured.attach(sequence, structured.compile(constraint))
        sequences.append(sequence)
    seconds = []
    for _ in range(args.steps):
        live = [sequence for sequence in sequences if not sequence.grammar.is_terminated]
        if not live:
            break
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        mask = structured.bitmask(live)
        seconds.append(time.perf_counter() - start)
        host = mask.cpu().numpy()
        for row, sequence in enumerate(live):
            sequence.output_token_ids = sequence.output_token_ids + [rng.choice(allowed_tokens(host[row], vocab_size))]
    return seconds


def cache_hits(structured, constraint, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        structured.attach(SimpleNamespace(grammar=None), structured.compile(constraint))  # what a request does
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    from tandem.engine.structured_outputs import StructuredOutputs
    from tandem.sampling_params import StructuredOutputsParams

    args = parse_args()
    model_dir = model_dir_for(args.shape, "dummy")  # config and tokenizer only
    vocab_size = vocab_size_of(model_dir)
    structured = StructuredOutputs(model_dir, vocab_size, (0,), compile_timeout=60.0, device=torch.device(args.device))
    constraint = StructuredOutputsParams(json=function_call_schema())
    structured.compile(constraint).result()
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    steps = decode_steps(structured, constraint, args, vocab_size)
    if profiler is not None:
        profiler.disable()
    hits = cache_hits(structured, constraint, args.hits)
    structured.close()
    from tandem.structured.bitmask import available_cores, fill_threads

    print(f"{args.shape} tokenizer, vocabulary {vocab_size}, {args.batch} rows, {len(steps)} steps, device {args.device}; "
          f"{available_cores()} cores, {fill_threads()} fill threads")
    print(f"bitmask per step: median {statistics.median(steps) * 1e3:.2f} ms, mean {statistics.mean(steps) * 1e3:.2f} ms, "
          f"max {max(steps) * 1e3:.2f} ms")
    print(f"cache hit: median {statistics.median(hits) * 1e3:.3f} ms, max {max(hits) * 1e3:.3f} ms")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
