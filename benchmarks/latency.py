"""Latency: batch-1 time per output token (TPOT) and prefill throughput by prompt length, for
tandem and ``transformers`` on the same model, each beside its roofline.

    python -m benchmarks.latency                         # tiny model on CPU
    python -m benchmarks.latency --shape llama3-8b       # Llama-3.1-8B shape, random bf16 weights (GPU)
    python -m benchmarks.latency --shape llama3-8b --quantization fp8   # the same with FP8 weights
    python -m benchmarks.latency --shape llama3-8b --tensor-parallel-size 2 --skip-transformers  # 2 GPUs

TPOT: one request of ``--prompt-len`` tokens generating ``--output-len`` tokens, minus the time
to its first token, over the remaining tokens; the roofline is the weights plus the state read by
each step over the measured copy bandwidth. Prefill: ``--prefill-tokens`` prompt tokens in
prompts of each length (one output token each); the roofline is their FLOPs over the measured
matrix rate. With ``--tensor-parallel-size N`` the rooflines are one rank's (its shard's weights
and state); ``transformers`` runs on one GPU.
"""
from __future__ import annotations

import argparse
import random

import torch

from benchmarks.common import (add_model_arguments, add_quantization_argument, is_fp8_model, resolve_model_arguments,
                    Ceilings, ModelCost, best_seconds, quantized_model_dir, release, vocab_size_of)
from benchmarks.gpu_clocks import ClockSampler


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefill-lengths", default="128,512,2048,8192")
    parser.add_argument("--prefill-tokens", type=int, default=32768, help="prompt tokens per prefill measurement")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-layout", choices=("auto", "layer-major", "page-major"), default="auto",
                        help="tandem's device pools (default: %(default)s)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="tandem's ranks, one GPU each (NCCL, the peer all-reduce between them)")
    add_quantization_argument(parser)
    args = parser.parse_args()
    resolve_model_arguments(args)
    return args


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]


def seconds_of(function, repeat: int = 3) -> float:
    return best_seconds(function, repeat)


def tandem_figures(model_dir, args, vocab_size, prefill_lengths):
    from tandem import LLM, SamplingParams

    longest = max(prefill_lengths + [args.prompt_len + args.output_len])
    llm = LLM(model=model_dir, dtype=args.dtype, load_format=args.load_format, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=longest + 16,
              max_num_seqs=256, enforce_eager=args.enforce_eager, kv_cache_layout=args.kv_cache_layout,
              quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size)
    generate = lambda prompts, tokens: llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    (prompt,) = random_prompts(1, args.prompt_len, vocab_size, seed=0)
    first = seconds_of(lambda: generate([prompt], 1))
    whole = seconds_of(lambda: generate([prompt], args.output_len))
    tpot = (whole - first) / (args.output_len - 1)
    prefill, clocks = {}, {}
    for length in prefill_lengths:
        prompts = random_prompts(max(1, args.prefill_tokens // length), length, vocab_size, seed=length)
        with ClockSampler(torch.cuda.current_device() if torch.cuda.is_available() else 0) as sampler:
            prefill[length] = len(prompts) * length / seconds_of(lambda: generate(prompts, 1), repeat=2)
        clocks[length] = sampler.summary()
    cost = ModelCost.of_engine(llm.engine)
    release(llm)
    return first, tpot, prefill, clocks, cost


def transformers_figures(model_dir, args, vocab_size, prefill_lengths):
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()

    def generate(prompts, tokens):
        with torch.inference_mode():
            ids = torch.tensor(prompts, device=device)
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    (prompt,) = random_prompts(1, args.prompt_len, vocab_size, seed=0)
    first = seconds_of(lambda: generate([prompt], 1), repeat=2)
    whole = seconds_of(lambda: generate([prompt], args.output_len), repeat=1)
    prefill = {}
    for length in prefill_lengths:
        batch = max(1, min(args.prefill_tokens, 8192) // length)  # transformers takes one padded batch
        prompts = random_prompts(batch, length, vocab_size, seed=length)
        prefill[length] = batch * length / seconds_of(lambda: generate(prompts, 1), repeat=2)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return first, (whole - first) / (args.output_len - 1), prefill


def main() -> None:
    args = parse_args()
    model_dir, args.quantization = quantized_model_dir(args)
    vocab_size = vocab_size_of(model_dir)
    prefill_lengths = [int(length) for length in args.prefill_lengths.split(",")]
    fp8 = is_fp8_model(model_dir, args.quantization)
    ceilings = Ceilings.measure(getattr(torch, args.dtype), fp8=fp8)
    first, tpot, prefill, clocks, cost = tandem_figures(model_dir, args, vocab_size, prefill_lengths)
    reference = None if args.skip_transformers or fp8 else transformers_figures(model_dir, args, vocab_size,
                                                                         prefill_lengths)
    floor_tpot = (cost.decode_weight_bytes(1) + cost.state_bytes_per_token * (args.prompt_len + args.output_len / 2)) \
        / ceilings.bandwidth
    parallel = f", TP={args.tensor_parallel_size} (rooflines per rank)" if args.tensor_parallel_size > 1 else ""
    print(f"\nmodel {model_dir} ({args.shape}), {args.dtype}{' (tandem eager)' if args.enforce_eager else ''}{parallel}")
    print(ceilings.describe())
    print(f"weights read per decode step {cost.decode_weight_bytes(1) / 1e9:.2f} GB{' (FP8 weights and scales)' if fp8 and torch.cuda.is_available() else ''}; "
          f"{cost.flops_per_token / 1e9:.1f} GFLOP per token\n")
    print(f"batch 1, {args.prompt_len}-token prompt, {args.output_len} output tokens")
    print(f"{'':<28}{'tandem':>12}{'transformers':>14}{'roofline':>10}{'tandem/roof':>13}{'tandem/hf':>11}")
    hf_tpot = reference[1] if reference else float("nan")
    print(f"{'TPOT (ms)':<28}{tpot * 1e3:>12.2f}{hf_tpot * 1e3:>14.2f}{floor_tpot * 1e3:>10.2f}"
          f"{floor_tpot / tpot:>13.2f}{hf_tpot / tpot:>11.2f}")
    hf_first = reference[0] if reference else float("nan")
    print(f"{'time to first token (ms)':<28}{first * 1e3:>12.2f}{hf_first * 1e3:>14.2f}\n")
    print(f"prefill, {args.prefill_tokens} prompt tokens per length, one output token each")
    print(f"{'prompt length':<28}{'tandem tok/s':>12}{'transformers':>14}{'roofline':>10}"
          f"{'tandem/roof':>13}{'tandem/hf':>11}")
    for length in prefill_lengths:
        flops = cost.flops_per_token + cost.attention_flops_per_pair * (length + 1) / 2
        roof = ceilings.flops / flops
        hf = reference[2][length] if reference else float("nan")
        print(f"{length:<28}{prefill[length]:>12.0f}{hf:>14.0f}{roof:>10.0f}{prefill[length] / roof:>13.2f}"
              f"{prefill[length] / hf:>11.2f}")
    if torch.cuda.is_available():  # a long prefill can hold the GPU at its power limit, below the clock
        for length in prefill_lengths:  # the matrix rate was measured at
            print(f"prefill at {length}: {clocks[length]}")


if __name__ == "__main__":
    main()
