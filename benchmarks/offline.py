"""Offline throughput: tandem vs transformers on the same model and prompts.

Prints output tokens/s of tandem's ``LLM.generate``, of ``transformers``' ``generate`` (one
left-padded batch) and of its continuous-batching ``generate_batch`` (when present), and the
ratio of tandem to the better of the two.

    python benchmarks/offline.py                      # ~30M-parameter llama on CPU, fp32
    python benchmarks/offline.py --preset llama3-8b --load-format dummy --dtype bfloat16 \
        --skip-transformers-batch                     # Llama-3.1-8B shape on a GPU
    python benchmarks/offline.py --min-output-len 16 --output-len 128   # mixed output lengths
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESETS = {
    # name: make_model keyword arguments
    "tiny-30m": dict(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                     intermediate_size=1536, vocab_size=8192),
    "llama3-8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, vocab_size=128256, rope_scaling="llama3",
                      max_position_embeddings=8192),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: build the preset)")
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
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-transformers-batch", action="store_true",
                        help="skip transformers' continuous-batching generate_batch")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per system (best is kept)")
    parser.add_argument("--json", help="also write the results here")
    return parser.parse_args()


def build_model_dir(args) -> str:
    if args.model:
        return args.model
    from tandem.tools.make_model import make_model

    options = dict(PRESETS[args.preset])
    out = Path(tempfile.gettempdir()) / f"tandem-bench-{args.preset}-{args.load_format}"
    if (out / "config.json").is_file():
        return str(out)
    if args.load_format != "dummy":
        make_model("llama", out, seed=0, **options)
        return str(out)
    # Dummy weights: a tokenizer from a small model, and the preset's config without weights.
    small = dict(options, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64)
    make_model("llama", out, seed=0, **small)
    for weights in out.glob("*.safetensors*"):
        weights.unlink()
    config = json.loads((out / "config.json").read_text())
    full = make_model_config(options)
    config.update({key: full[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "intermediate_size", "head_dim",
                                              "rope_parameters", "max_position_embeddings") if key in full})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def make_model_config(options: dict) -> dict:
    from transformers import LlamaConfig

    hidden, heads = options["hidden_size"], options["num_heads"]
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if options.get("rope_scaling") == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=options["num_layers"],
                         num_attention_heads=heads, num_key_value_heads=options["num_kv_heads"],
                         intermediate_size=options["intermediate_size"], head_dim=hidden // heads,
                         vocab_size=options["vocab_size"], rope_parameters=rope,
                         max_position_embeddings=max(options.get("max_position_embeddings", 8192), 131072))
    return config.to_dict()


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab_size) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
            for _ in range(args.num_prompts)]


def make_output_lengths(args) -> list[int]:
    rng = random.Random(1)
    low = args.output_len if args.min_output_len is None else args.min_output_len
    return [rng.randint(low, args.output_len) for _ in range(args.num_prompts)]


def timed(function, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def run_tandem(model_dir, prompts, output_lengths, args) -> float:
    from tandem import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=args.dtype, load_format=args.load_format, page_size=args.page_size,
              max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lengths]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False), args.repeat)
    del llm
    return seconds


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
    model_dir = build_model_dir(args)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args, vocab)
    output_lengths = make_output_lengths(args)
    output_tokens = sum(output_lengths)
    results = {"tandem": run_tandem(model_dir, prompts, output_lengths, args)}
    if not args.skip_transformers:
        model, device = load_transformers(model_dir, args)
        results["transformers generate (padded)"] = run_transformers_padded(model, device, prompts, args)
        if not args.skip_transformers_batch:
            results["transformers generate_batch"] = run_transformers_continuous(model, prompts, args)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU x{torch.get_num_threads()} threads"
    print(f"\nmodel {model_dir} ({args.preset if not args.model else 'given'}), {args.dtype}, {device_name}")
    lengths = (f"{args.output_len}" if args.min_output_len is None
               else f"{args.min_output_len}-{args.output_len} (total {output_tokens})")
    print(f"{len(prompts)} prompts of {args.min_input_len}-{args.max_input_len} tokens, {lengths} output tokens each\n")
    print(f"{'system':<34}{'seconds':>10}{'output tok/s':>15}")
    for name, seconds in results.items():
        if seconds is None:
            print(f"{name:<34}{'n/a':>10}{'n/a':>15}")
        else:
            print(f"{name:<34}{seconds:>10.3f}{output_tokens / seconds:>15.1f}")
    baselines = [s for name, s in results.items() if name != "tandem" and s is not None]
    if baselines:
        print(f"\ntandem / best transformers: {min(baselines) / results['tandem']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "output_tokens": output_tokens}, indent=2))


if __name__ == "__main__":
    main()
