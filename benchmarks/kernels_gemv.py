"""Batch-1 decode products (GPU): the Llama-3.1-8B projections at one token, each shape as a
stack of 32 distinct weights (a decode step's worth, so no weight is read from L2) replayed
from a CUDA graph, as the engine's decode graph runs them. For each shape and weight format,
microseconds per product and the fraction of the measured copy bandwidth its bytes reach:

- ``bf16``: ``torch.nn.functional.linear`` (cuBLAS) on bfloat16 weights, and ``gemv`` on them
  (``tandem/kernels/gemv.py``);
- ``fp8 chan`` / ``fp8 block``: ``gemv`` on FP8 weights with per-row / 128x128-block scales (the
  FP8 linear method's path at one and two tokens);

then a whole decode step's products (the four projections of 32 layers, in order) for each
path, in ms: the figure to hold against the decode step's weight-read floor. ``--sweep`` also
tries ``gemv`` tiles on every shape and format and prints the best three (for tuning
``gemv_config``; ~2 min on an H100).

    python -m benchmarks.kernels_gemv [--sweep] [--tokens 1|2] [--tensor-parallel-size N]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import torch.nn.functional as F

from benchmarks.common import Ceilings
from tandem.kernels.gemv import STEP_SUMS, GemvConfig, gemv, gemv_config
from tandem.kernels.triton_support import early_launch, multiprocessors
from tandem.quantization.fp8 import quantize_blocks, quantize_rows, row_block_scales

LAYERS = 32
HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144


def shapes(tensor_parallel: int) -> dict:
    """(rows, features) of each projection on one rank: column-parallel qkv and gate_up keep
    1/TP of their rows, row-parallel o and down 1/TP of their inputs."""
    return {"qkv": (QKV // tensor_parallel, HIDDEN), "o": (HIDDEN, HIDDEN // tensor_parallel),
            "gate_up": (2 * INTERMEDIATE // tensor_parallel, HIDDEN), "down": (HIDDEN, INTERMEDIATE // tensor_parallel)}


def stack(rows: int, features: int, device: str = "cuda") -> dict:
    """32 weights of one shape in each format: (weight, scale, group) triples."""
    formats = {"bf16": [], "fp8 chan": [], "fp8 block": []}
    for _ in range(LAYERS):
        weight = torch.randn(rows, features, device=device, dtype=torch.bfloat16) / features ** 0.5
        formats["bf16"].append((weight, None, None))
        fp8, row_scale = quantize_rows(weight)
        formats["fp8 chan"].append((fp8, row_scale, None))
        block_fp8, blocks = quantize_blocks(weight, (128, 128))
        formats["fp8 block"].append((block_fp8, row_block_scales(blocks, (rows, features), (128, 128)), 128))
    return formats


def graph_microseconds(products, early: bool = False) -> float:
    """Median microseconds of one replay of a CUDA graph running ``products`` (callables) in order;
    ``early``: captured as a decode graph of few tokens is, each kernel launched before the one
    before it finishes (``triton_support.early_launch``; no effect above its token limit)."""
    with early_launch(early):
        for product in products:  # compile and warm outside the capture
            product()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for product in products:
                product()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def bytes_of(weights) -> int:
    return sum(weight.numel() * weight.element_size() + (0 if scale is None else scale.numel() * 4)
               for weight, scale, _ in weights)


def paths(format_name: str, hidden: torch.Tensor) -> dict:
    """Name -> function(weight, scale, group) -> product, the paths to compare for a format."""
    if format_name == "bf16":
        return {"cuBLAS": lambda weight, scale, group: F.linear(hidden, weight),
                "gemv": lambda weight, scale, group: gemv(hidden, weight)}
    return {"gemv": lambda weight, scale, group: gemv(hidden, weight, scale, group)}


def bound(function, weight, scale, group):
    return lambda: function(weight, scale, group)


def sweep_configs(element_size: int):
    """The elementwise kernel: strips of 2 to 16 rows, steps of 512 B to 2 KiB of each row, 2 to 8
    warps; software pipelining (stages) and split-K on a few; the step sums: strips of 8 to 32
    rows."""
    for block_n, step_bytes, warps in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (2, 4, 8)):
        yield GemvConfig(block_n, step_bytes // element_size, 1, warps, 1)
    for block_n, step_bytes in itertools.product((4, 8), (1024, 2048)):
        yield GemvConfig(block_n, step_bytes // element_size, 1, 4, 3)
    for block_n, split in itertools.product((2, 4), (2, 4)):
        yield GemvConfig(block_n, 1024 // element_size, split, 4, 1)
    for block_n, step_bytes, warps in itertools.product((8, 16, 32), (512, 1024), (4, 8)):
        yield GemvConfig(block_n, step_bytes // element_size, 1, warps, 1, kernel=STEP_SUMS)


def sweep(name, format_name, weights, hidden, bandwidth) -> None:
    results = []
    moved = bytes_of(weights)
    for config in sweep_configs(weights[0][0].element_size()):
        try:
            microseconds = graph_microseconds([bound(lambda w, s, g, c=config: gemv(hidden, w, s, g, c), *entry)
                                               for entry in weights])
        except triton.runtime.errors.OutOfResources:
            continue
        results.append((microseconds, config))
    results.sort(key=lambda item: item[0])
    best = ", ".join(f"{us / LAYERS:.2f} us ({moved / bandwidth * 1e6 / us:.2f}) n{c.block_n} k{c.block_k} "
                     f"s{c.split} w{c.warps} st{c.stages} {c.kernel}" for us, c in results[:3])
    print(f"sweep {name:<8} {format_name:<9} {best}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", type=int, default=1, choices=(1, 2))
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    arguments = parser.parse_args()
    ceilings = Ceilings.measure(torch.bfloat16)
    print(ceilings.describe())
    hidden_of = {}
    stacks = {}
    step_paths: dict = {}
    print(f"{'shape':<9}{'format':<11}{'path':<13}{'us/product':>11}{'of copy':>9}  tiles")
    for name, (rows, features) in shapes(arguments.tensor_parallel_size).items():
        hidden = hidden_of.setdefault(features, torch.randn(arguments.tokens, features, device="cuda",
                                                            dtype=torch.bfloat16))
        stacks[name] = stack(rows, features)
        for format_name, weights in stacks[name].items():
            moved = bytes_of(weights)
            for path, function in paths(format_name, hidden).items():
                microseconds = graph_microseconds([bound(function, *entry) for entry in weights])
                step_paths.setdefault((format_name, path), []).append((function, weights))
                config = gemv_config(rows, features, weights[0][0].element_size(), multiprocessors(hidden),
                                     block_scaled=format_name == "fp8 block")
                tiles = (f"{config.kernel} n{config.block_n} k{config.block_k} s{config.split} w{config.warps}"
                         if path == "gemv" else "")
                print(f"{name:<9}{format_name:<11}{path:<13}{microseconds / LAYERS:>11.2f}"
                      f"{moved / ceilings.bandwidth * 1e6 / microseconds:>9.2f}  {tiles}", flush=True)
            if arguments.sweep:
                sweep(name, format_name, weights, hidden, ceilings.bandwidth)
    print("\na decode step's products (4 projections x 32 layers, in order; 'early': each launched before the one "
          "before it ends, as in a decode graph)")
    for (format_name, path), entries in step_paths.items():
        products = [bound(function, *weights[layer]) for layer in range(LAYERS) for function, weights in entries]
        moved = sum(bytes_of(weights) for _, weights in entries)
        for early in (False, True) if path == "gemv" else (False,):
            microseconds = graph_microseconds(products, early)
            label = f"{path} early" if early else path
            print(f"{format_name:<11}{label:<13}{microseconds / 1e3:>8.3f} ms  {moved / 1e9:.2f} GB  "
                  f"{moved / microseconds / 1e6:.2f} TB/s  {moved / ceilings.bandwidth * 1e6 / microseconds:.2f} "
                  "of copy")


if __name__ == "__main__":
    main()
