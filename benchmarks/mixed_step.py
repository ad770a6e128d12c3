"""Step time of a step holding a prompt chunk beside running decodes, with and without the
mixed-step CUDA graphs (``tandem/worker/mixed_graphs.py``), beside a decode-only step.

    python -m benchmarks.mixed_step                       # tiny model on CPU (no graphs: both rows eager)
    python -m benchmarks.mixed_step --shape llama3-8b     # Llama-3.1-8B shape, random bf16 weights (GPU)
    python -m benchmarks.mixed_step --shape llama3-8b --tensor-parallel-size 2   # two GPUs

``--decodes`` requests decode while one long prompt is prefilled ``--chunk`` tokens a step
(``max_num_batched_tokens`` is decodes + chunk); each row is the wall time per engine step over
``--steps`` steps (the overlapped loop: host and device time overlap) and the host's time inside
``step()``. A mixed step far above a decode step while the device is idle is launch-bound.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import add_model_arguments, model_dir_for, release, resolve_model_arguments, vocab_size_of


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--chunk", type=int, default=135)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    return parser.parse_args()


def timed_steps(engine, steps: int) -> tuple[float, float]:
    """(wall ms per step, median host ms inside ``step()``) over ``steps`` steps."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start, hosts = time.perf_counter(), []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        hosts.append(time.perf_counter() - began)
    sync()
    return (time.perf_counter() - start) / steps * 1e3, sorted(hosts)[steps // 2] * 1e3


def measure(model_dir: str, args, mixed_step_graphs: bool) -> tuple[tuple[float, float], tuple[float, float]]:
    from tandem import LLM, SamplingParams
    from tandem.protocol import EngineRequest
    llm = LLM(model=model_dir, dtype=args.dtype, load_format=args.load_format, max_num_seqs=args.decodes + 1,
              max_num_batched_tokens=args.decodes + args.chunk, enable_prefix_caching=False,
              mixed_step_graphs=mixed_step_graphs, tensor_parallel_size=args.tensor_parallel_size)
    engine, rng, vocab = llm.engine, random.Random(0), vocab_size_of(model_dir)
    prompt_len, max_len = args.chunk * (args.steps + 4), engine.model_info.max_model_len
    if prompt_len + 1 > max_len:
        raise SystemExit(f"mixed_step.py: --chunk x (--steps + 4) = {prompt_len} tokens exceeds the model's {max_len}")
    params = SamplingParams(temperature=0, max_tokens=max_len - max(prompt_len, 64), ignore_eos=True)
    for number in range(args.decodes):
        engine.add_request(EngineRequest(request_id=f"decode{number}", sampling_params=params,
                                         prompt_token_ids=[rng.randrange(10, vocab) for _ in range(64)]))
    for _ in range(8):  # every decode past its prompt
        engine.step()
    decode = timed_steps(engine, args.steps)
    engine.add_request(EngineRequest(request_id="long", sampling_params=params,
                                     prompt_token_ids=[rng.randrange(10, vocab) for _ in range(prompt_len)]))
    engine.step(), engine.step()
    mixed = timed_steps(engine, args.steps)
    release(llm)
    return decode, mixed


def main() -> None:
    args = parse_args()
    resolve_model_arguments(args)
    model_dir = args.model or model_dir_for(args.shape, args.load_format)
    rows = []
    for graphs in (True, False):
        decode, mixed = measure(model_dir, args, graphs)
        rows.append((f"{args.decodes} decodes + {args.chunk}-token chunk, mixed graphs {'on' if graphs else 'off'}",
                     mixed))
    rows.insert(0, (f"{args.decodes} decodes alone", decode))
    print(f"\nmodel {model_dir} ({args.shape}), {args.dtype}, tensor_parallel_size {args.tensor_parallel_size}")
    print(f"{'step':<58}{'ms/step':>10}{'host ms':>10}")
    for name, (wall, host) in rows:
        print(f"{name:<58}{wall:>10.2f}{host:>10.2f}")


if __name__ == "__main__":
    main()
