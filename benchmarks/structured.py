"""Structured outputs: what a grammar costs per decode step, and what compiling one costs.

    python -m benchmarks.structured                      # tiny model on CPU
    python -m benchmarks.structured --shape llama3-8b    # Llama-3.1-8B shape, random bf16 weights (GPU)

Decode: ``--batch-sizes`` requests of ``--prompt-len`` tokens, each generating up to
``--output-len`` tokens, unconstrained and constrained by a function-calling JSON Schema of 10
argument fields. The time per decode step is (whole run - first step) over the steps between, so
requests that end early (a grammar may end them) do not skew it; the overhead is the constrained
step time over the unconstrained one; "mask ms (host)" is the median host time of a step's masks
(matchers advanced: "sync"; rows filled: "fill"; the copy queued), which the overlapped loop hides behind the
step's forward pass as long as it is shorter. Compile: distinct 10-field schemas compiled against the
model's tokenizer (first compile), then the same schema again (a cache hit: the compiled grammar
found and a matcher made for a request).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace


from benchmarks.common import add_model_arguments, model_dir_for, release, resolve_model_arguments, synchronize, vocab_size_of


def function_call_schema(name: str = "search_flights") -> dict:
    """A tool call (name, then its arguments) whose arguments have 10 fields of every JSON kind."""
    arguments = {
        "origin": {"type": "string", "description": "IATA code"},
        "destination": {"type": "string"},
        "departure_date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "return_date": {"type": ["string", "null"]},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin": {"enum": ["economy", "premium", "business", "first"]},
        "max_price": {"type": "number", "minimum": 0},
        "nonstop": {"type": "boolean"},
        "airlines": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "loyalty": {"type": "object", "properties": {"program": {"type": "string"}, "number": {"type": "string"}},
                    "required": ["program", "number"], "additionalProperties": False},
    }
    return {"type": "object", "properties": {"name": {"const": name},
                                             "arguments": {"type": "object", "properties": arguments,
                                                           "required": sorted(arguments),
                                                           "additionalProperties": False}},
            "required": ["name", "arguments"], "additionalProperties": False}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--compiles", type=int, default=10, help="distinct schemas compiled (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    resolve_model_arguments(args)
    return args


class StepCounter:
    """Counts the engine's steps (wraps ``engine.step``)."""

    def __init__(self, engine) -> None:
        self.count = 0
        step = engine.step

        def counted(*arguments, **options):
            self.count += 1
            return step(*arguments, **options)

        engine.step = counted


class MaskTimer:
    """Host seconds of each step's masks (``StructuredOutputs.bitmask``: the work the overlapped
    loop must finish while the device runs the step's forward pass), and of its two parts: the
    matchers accepting the new tokens (``sync``) and the rows being filled (``fill``)."""

    def __init__(self, structured) -> None:
        from tandem.engine import structured_outputs

        self.seconds: dict[str, list[float]] = {"mask": [], "sync": [], "fill": []}
        structured.bitmask = self._timed("mask", structured.bitmask)
        structured.pool  # (builds the matchers' helpers)
        structured._batch_sync.sync = self._timed("sync", structured._batch_sync.sync)
        structured_outputs.fill_bitmask = self._timed("fill", structured_outputs.fill_bitmask)

    def _timed(self, name: str, function):
        def timed(*arguments, **options):
            start = time.perf_counter()
            result = function(*arguments, **options)
            if name != "mask" or result is not None:
                self.seconds[name].append(time.perf_counter() - start)
            return result

        return timed

    def clear(self) -> None:
        for seconds in self.seconds.values():
            seconds.clear()

    def medians(self) -> tuple[float, float, float]:
        return tuple(statistics.median(self.seconds[name] or [0.0]) for name in ("mask", "sync", "fill"))


def step_seconds(llm, counter: StepCounter, prompts, params, repeat: int) -> tuple[float, float]:
    """(seconds per decode step, mean output tokens): the whole run less its first step
    (prefill), each the best of ``repeat``, over the steps between."""
    def timed(batch_params) -> tuple[float, int, list]:
        synchronize()
        counter.count = 0
        start = time.perf_counter()
        outputs = llm.generate(prompts, batch_params, use_tqdm=False)
        synchronize()
        return time.perf_counter() - start, counter.count, outputs

    first_params = [p.clone(max_tokens=1) for p in params]
    first = min((timed(first_params) for _ in range(repeat)), key=lambda result: result[0])
    whole = min((timed(params) for _ in range(repeat)), key=lambda result: result[0])
    tokens = statistics.mean(len(output.outputs[0].token_ids) for output in whole[2])
    return (whole[0] - first[0]) / max(whole[1] - first[1], 1), tokens


def decode_figures(llm, args, vocab_size: int) -> list[tuple]:
    from tandem import SamplingParams
    from tandem.sampling_params import StructuredOutputsParams

    counter = StepCounter(llm.engine)
    masks = MaskTimer(llm.engine.structured)
    rng = random.Random(0)
    rows = []
    for batch in [int(size) for size in args.batch_sizes.split(",")]:
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab_size) for _ in range(args.prompt_len)]}
                   for _ in range(batch)]
        free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                     structured_outputs=StructuredOutputsParams(json=function_call_schema()))
        llm.generate(prompts, [constrained] * batch, use_tqdm=False)  # warm-up: compile, graphs
        plain, plain_tokens = step_seconds(llm, counter, prompts, [free] * batch, args.repeat)
        masks.clear()
        masked, masked_tokens = step_seconds(llm, counter, prompts, [constrained] * batch, args.repeat)
        rows.append((batch, plain, masked, plain_tokens, masked_tokens, *masks.medians()))
    return rows


def compile_figures(llm, count: int) -> tuple[list[float], list[float]]:
    """(first-compile seconds, cache-hit seconds) per schema."""
    from tandem.sampling_params import StructuredOutputsParams

    structured = llm.engine.structured
    structured.compile(StructuredOutputsParams(json_object=True)).result()  # the tokenizer info, built once
    firsts, hits = [], []
    for number in range(count):
        constraint = StructuredOutputsParams(json=function_call_schema(f"tool_{number}_{time.time_ns()}"))
        start = time.perf_counter()
        structured.compile(constraint).result()
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        structured.attach(SimpleNamespace(grammar=None), structured.compile(constraint))  # what a request does
        hits.append(time.perf_counter() - start)
    return firsts, hits


def main() -> None:
    from tandem import LLM

    args = parse_args()
    model_dir = args.model or model_dir_for(args.shape, args.load_format)
    vocab_size = vocab_size_of(model_dir)
    longest = args.prompt_len + args.output_len + 16
    llm = LLM(model=model_dir, dtype=args.dtype, load_format=args.load_format, enable_prefix_caching=False,
              max_model_len=longest, max_num_seqs=max(64, *[int(b) for b in args.batch_sizes.split(",")]),
              max_num_batched_tokens=max(8192, longest), enforce_eager=args.enforce_eager)
    firsts, hits = compile_figures(llm, args.compiles)
    rows = decode_figures(llm, args, vocab_size)
    release(llm)
    print(f"\nmodel {model_dir} ({args.shape}), {args.dtype}, vocabulary {vocab_size}; "
          f"{args.prompt_len}-token prompts, up to {args.output_len} output tokens")
    from tandem.structured.bitmask import available_cores, fill_threads

    print(f"host: {available_cores()} cores for this process, {fill_threads()} threads fill and sync a step's masks")
    print(f"10-field function-calling schema: first compile median {statistics.median(firsts) * 1e3:.1f} ms "
          f"(max {max(firsts) * 1e3:.1f}), cache hit median {statistics.median(hits) * 1e3:.3f} ms "
          f"(max {max(hits) * 1e3:.3f})")
    print(f"{'batch':>6}{'step ms (free)':>16}{'step ms (schema)':>18}{'overhead':>10}{'tokens free':>13}"
          f"{'tokens schema':>15}{'mask ms (host)':>16}{'sync ms':>9}{'fill ms':>9}")
    for batch, plain, masked, plain_tokens, masked_tokens, mask, sync, fill in rows:
        print(f"{batch:>6}{plain * 1e3:>16.2f}{masked * 1e3:>18.2f}{(masked / plain - 1) * 100:>9.1f}%"
              f"{plain_tokens:>13.1f}{masked_tokens:>15.1f}{mask * 1e3:>16.2f}{sync * 1e3:>9.2f}{fill * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
