"""Speculative decoding: batch-1 time per output token (TPOT) with a draft model at simulated
acceptance lengths, against no speculation, on random weights.

    python -m benchmarks.spec_decode                        # tiny shapes on CPU (a smoke run)
    python -m benchmarks.spec_decode --shape llama3-8b      # GPU: Llama-3.1-8B shape, Llama-3.2-1B-shaped draft

Random weights agree with nothing, so the verification's outcome is simulated:
``TANDEM_SIMULATE_ACCEPT_LEN=L`` makes each verification accept drafts as if the mean
acceptance length (accepted drafts plus the target's own token) were ``L``, whatever they are.
That is a performance-only switch: the tokens it produces are not the target's. Everything else
runs as in production: the draft's catch-up and its chain of ``k`` proposals, one target
forward pass over the last token and the drafts, rollback of the rejected ones. The baseline
runs with speculation off (CUDA graphs and the overlapped loop on, as deployed); speculation
runs with CUDA graphs (verification and the draft's passes) and the overlapped loop off.
``speedup`` is the baseline's TPOT over the row's.

TPOT: one request of ``--prompt-len`` tokens generating ``--output-len`` tokens, minus the time
to its first token, over the remaining tokens (best of three).
"""
from __future__ import annotations

import argparse
import os
import random

import torch


from benchmarks.common import SHAPES, best_seconds, model_dir_for, release, vocab_size_of

DRAFT_SHAPES = {"llama3-8b": "llama3.2-1b", "tiny-30m": "tiny-draft"}
SIMULATE = "TANDEM_SIMULATE_ACCEPT_LEN"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, choices=sorted(DRAFT_SHAPES),
                        help="target shape (default: tiny-30m on CPU, llama3-8b on a GPU)")
    parser.add_argument("--draft-shape", default=None, choices=sorted(SHAPES),
                        help="draft shape (default: llama3.2-1b for llama3-8b, tiny-draft for tiny-30m)")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on a GPU")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--accept-lengths", default="2.5,3.5", help="simulated mean acceptance lengths")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="speculation without CUDA graphs (the baseline keeps them)")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    args.shape = args.shape or ("llama3-8b" if gpu else "tiny-30m")
    args.draft_shape = args.draft_shape or DRAFT_SHAPES[args.shape]
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.load_format = "dummy" if gpu else "auto"
    return args


def measure(args, target: str, prompt: list[int], accept_length=None, draft=None):
    """(TPOT in seconds, mean acceptance length or None) of one engine configuration."""
    from tandem import LLM, SamplingParams

    if accept_length is None:
        os.environ.pop(SIMULATE, None)
    else:
        os.environ[SIMULATE] = str(accept_length)
    speculation = dict(speculative_model=draft, num_speculative_tokens=args.num_speculative_tokens,
                       enforce_eager=args.enforce_eager) if draft else {}
    llm = LLM(model=target, dtype=args.dtype, load_format=args.load_format, enable_prefix_caching=False,
              max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=8, **speculation)
    generate = lambda tokens: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                                           use_tqdm=False)
    first = best_seconds(lambda: generate(1), args.repeat)
    whole = best_seconds(lambda: generate(args.output_len), args.repeat)
    speculation_stats = llm.engine.stats().speculation
    graphs = graphs_in_use(llm.engine)
    release(llm)
    os.environ.pop(SIMULATE, None)
    length = speculation_stats.mean_acceptance_length if speculation_stats is not None else None
    return (whole - first) / (args.output_len - 1), length, graphs


def graphs_in_use(engine) -> str:
    """Which passes replay CUDA graphs: the target's decode steps, its verification, the draft's."""
    runner, speculator = engine.runner, engine.speculator
    if runner.graphs is None:
        return "none"
    if speculator is None:
        return "decode"
    used = ["decode"] + (["verify"] if runner.verify_as_decode_rows else [])
    return "+".join(used + (["draft"] if speculator.network.graphs is not None else []))


def main() -> None:
    args = parse_args()
    target = model_dir_for(args.shape, args.load_format)
    draft = model_dir_for(args.draft_shape, args.load_format)
    rng = random.Random(0)
    prompt = [rng.randrange(10, vocab_size_of(target)) for _ in range(args.prompt_len)]
    rows = [("no speculation", *measure(args, target, prompt))]
    for length in [float(value) for value in args.accept_lengths.split(",")]:
        label = f"draft, k={args.num_speculative_tokens}, simulated L={length:g}"
        rows.append((label, *measure(args, target, prompt, length, draft)))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\ntarget {args.shape}, draft {args.draft_shape}, {args.dtype}, {args.load_format} weights, {device}")
    print(f"batch 1, {args.prompt_len}-token prompt, {args.output_len} output tokens "
          f"({SIMULATE}: simulated acceptance, outputs are not the target's)")
    print(f"{'':<42}{'TPOT (ms)':>11}{'tokens/verification':>21}{'speedup':>9}  CUDA graphs")
    baseline = rows[0][1]
    for label, tpot, length, graphs in rows:
        measured = f"{length:.2f}" if length is not None else "-"
        print(f"{label:<42}{tpot * 1e3:>11.2f}{measured:>21}{baseline / tpot:>9.2f}  {graphs}")


if __name__ == "__main__":
    main()
