"""FP8 GEMMs (``tandem/kernels/fp8_gemm.py``) against bfloat16 ``torch.matmul`` at the
Llama-3.1-8B projection shapes (GPU): median time (``triton.testing.do_bench``) of

- ``bf16``: ``hidden @ weight.T`` in bfloat16;
- ``channel``: FP8 per-output-channel weights, activations quantized per token, ``torch._scaled_mm``
  with row-wise scales (what compressed-tensors and ``--quantization fp8`` run);
- ``block``: FP8 128x128-block weights, activations per 1x128 token group, the Triton
  block-scaled GEMM (what DeepSeek/GLM/Qwen ``-FP8`` checkpoints run);

each whole (activation quantization included) and the GEMM alone (the per-channel one with fast
accumulation, as the engine runs it: the tensor cores' FP8 sums not promoted to float32 every few
steps); ``full`` is the per-channel GEMM with ``use_fast_accum=False`` and ``f.err`` the engine's
product's largest difference from it, relative to the output's largest
value — what choosing it would cost in accuracy; at M <= 16 also

- ``w-only chan``, ``w-only block``: the weight-only path the FP8 linear method takes there
  (``tandem/kernels/fp8_weight_only.py``: 16-bit activations, FP8 weights dequantized in
  registers, split-K for small N), its fraction of the weight-read roofline, timed as a decode
  graph runs it: 32 distinct weights of the shape replayed from a CUDA graph (a single launch
  carries a launch latency as long as the product), and a layer's four products summed;

and each one's fraction of its roofline: the slower of the bytes it must move (weights, their
scales, activations in and out) over the measured copy bandwidth and its FLOPs over the measured
matrix rate (bfloat16's for bf16, FP8's ``_scaled_mm`` rate at 8192^3 for the FP8 products).
Targets: >= 0.8 of the FP8 rate at M >= 4096, >= 0.85 of the weight-read bandwidth at M <= 16.

A second table times the producers of the FP8 products' activations, fused against unfused
(``tandem/kernels/fp8_activation.py``): the residual add + RMSNorm (hidden 4,096) and SiLU·mul
(intermediate 14,336), each followed by ``quantize_token_groups`` (unfused) or writing FP8 itself
(fused), per token and in cuBLASLt's block-wise layout, at 512, 4,096 and 16,384 tokens; with the
fused kernel's fraction of the copy bandwidth (its bytes: 16-bit in, FP8 and scales out) and the
time saved per layer.

    python -m benchmarks.kernels_fp8            # the tables
    python -m benchmarks.kernels_fp8 --fused    # the fused-producer table only
    python -m benchmarks.kernels_fp8 --weight-only   # the weight-only table only
    python -m benchmarks.kernels_fp8 --sweep    # also: weight-only tiles at M = 2 and 16 (in graphs), block
                                                # GEMM tiles and torch._scaled_mm block-wise at M = 512, 4096
"""
from __future__ import annotations

import argparse

import torch
import triton


from benchmarks.common import Ceilings
from benchmarks.kernels_gemv import LAYERS, graph_microseconds, stack
from tandem.kernels.activation import silu_and_mul, silu_and_mul_quantized
from tandem.kernels.fp8_gemm import (BLOCK_WISE_LAYOUT, PER_TOKEN_LAYOUT, BlockGemmConfig, block_gemm_config,
                                     block_scaled_matmul, fp8_linear, quantize_activation, quantize_token_groups,
                                     row_wise_product)
from tandem.kernels.norm import rms_norm
from tandem.kernels.triton_support import multiprocessors
from tandem.kernels.fp8_weight_only import (FP8_GEMV_MAX_TOKENS, MAX_TOKENS, WeightOnlyConfig, weight_only_config,
                                            weight_only_matmul)
from tandem.quantization.fp8 import quantize_blocks, quantize_rows, row_block_scales

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = (1, 16, 256, 512, 4096)  # (256: a batch-256 decode step)
WEIGHT_ONLY_FORMATS = (("fp8 chan", None), ("fp8 block", 128))  # kernels_gemv.stack's names
WEIGHT_ONLY_TOKENS = (1, 2, 4, 16)


def median_ms(function) -> float:
    return triton.testing.do_bench(function, return_mode="median")


def roofline_ms(tokens, rows, features, weight_bytes, activation_bytes, flops_rate, bandwidth) -> float:
    moved = weight_bytes + tokens * features * activation_bytes + tokens * rows * 2
    return max(moved / bandwidth, 2.0 * tokens * rows * features / flops_rate) * 1e3


def weight_only_microseconds(hidden, weights, config=None) -> float:
    """Microseconds per product of the weight-only path over ``weights`` (a stack of ``LAYERS``
    distinct weights of one shape), replayed from a CUDA graph as a decode graph runs them: a
    single launch would carry the launch latency a graph hides, which at these sizes is as long
    as the product."""
    return graph_microseconds([lambda w=weight, s=scale, g=group: weight_only_matmul(hidden, w, s, g, config)
                               for weight, scale, group in weights]) / LAYERS


def weight_only_row(name, rows, features, tokens, stacks, bandwidth) -> tuple[str, list[float]]:
    """The weight-only path at ``tokens`` for per-row and block weights: µs and roof each (and
    the µs, for the layer's sum)."""
    hidden = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
    cells, times = [], []
    for format_name, group in WEIGHT_ONLY_FORMATS:
        weights = stacks[format_name]
        microseconds = weight_only_microseconds(hidden, weights)
        config = weight_only_config(rows, features, group, multiprocessors(hidden))
        tiles = "gemv" if tokens <= FP8_GEMV_MAX_TOKENS else f"n{config.block_n} k{config.block_k} s{config.split}"
        cells.append(f"{microseconds:>9.2f}{stack_bytes(weights) / bandwidth * 1e6 / microseconds:>6.2f}  ({tiles})")
        times.append(microseconds)
    return f"{name:<9}{tokens:>6}" + "".join(f"{cell:<36}" for cell in cells), times


def stack_bytes(weights) -> float:
    """Bytes one product reads: a weight of the stack and its scales (the activations are noise)."""
    return sum(weight.numel() + scale.numel() * 4 for weight, scale, _ in weights) / LAYERS


def sweep(name, rows, features, stacks, bandwidth) -> None:
    """The tensor-core weight-only tiles at 2 and 16 tokens (one token takes ``gemv.py``, tuned
    by ``benchmarks/kernels_gemv.py --sweep``), timed as ``weight_only_microseconds`` times them,
    the default first, then the best three (for tuning ``weight_only_config``)."""
    for format_name, group in WEIGHT_ONLY_FORMATS:
        weights = stacks[format_name]
        moved = stack_bytes(weights)
        for tokens in (2, MAX_TOKENS):
            hidden = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
            default = weight_only_config(rows, features, group, multiprocessors(hidden))
            results = []
            for block_n in (16, 32, 64):
                for block_k in (128, 256):
                    for split in (1, 2, 4):
                        for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
                            config = WeightOnlyConfig(block_n, block_k, split, warps, stages)
                            try:
                                microseconds = weight_only_microseconds(hidden, weights, config)
                            except triton.runtime.errors.OutOfResources:
                                continue  # a tile this GPU's shared memory cannot hold
                            results.append((microseconds, config))
            results.sort(key=lambda item: item[0])
            shown = [(weight_only_microseconds(hidden, weights, default), default)] + results[:3]
            cells = ", ".join(f"{us:.2f} us ({moved / bandwidth * 1e6 / us:.2f}) n{c.block_n} k{c.block_k} "
                              f"s{c.split} w{c.warps} st{c.stages}" for us, c in shown)
            print(f"sweep {name:<8} M={tokens:<3} {format_name:<9} default {cells}")


BLOCK_GEMM_TILES = [BlockGemmConfig(64, 128, 4, 3), BlockGemmConfig(64, 128, 4, 4), BlockGemmConfig(128, 128, 8, 3),
                    BlockGemmConfig(128, 128, 8, 4), BlockGemmConfig(128, 64, 4, 3), BlockGemmConfig(64, 256, 8, 3)]


def sweep_block_gemm(name, rows, features, block_weight, block_scale, blocks, flops_rate) -> None:
    """The block-scaled GEMM's tiles at M = 512 and 4096, best first, and ``torch._scaled_mm``'s
    block-wise scaling (1x128 activations, 128x128 weights) where this torch takes it."""
    for tokens in (512, 4096):
        hidden = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
        grouped, group_scales = quantize_token_groups(hidden, 128)
        results = []
        for config in BLOCK_GEMM_TILES:
            results.append((median_ms(lambda: block_scaled_matmul(grouped, group_scales, block_weight, block_scale,
                                                                  128, torch.bfloat16, config)), config))
        results.sort(key=lambda item: item[0])
        roof = 2.0 * tokens * rows * features / flops_rate * 1e3
        best = ", ".join(f"{ms:.4f} ms ({roof / ms:.2f}) m{c.block_m} n{c.block_n} w{c.warps} st{c.stages}"
                         for ms, c in results[:3])
        print(f"sweep {name:<8} M={tokens:<5} block GEMM (default {block_gemm_config(tokens)}): {best}")
        # cuBLASLt's layouts for 1x128 activations times 128x128 weights (``A [M, K]``, ``B = W.T``):
        # activation scales ``[M, K/128]`` M-major (stride ``[1, M]``), weight scales ``[K/128,
        # N/128]`` K-major (stride ``[1, K/128]``: the transposed view of ``blocks``), K/128 a
        # multiple of 4; anything else is refused or, in older torch, wrong.
        expected = block_scaled_matmul(grouped, group_scales, block_weight, block_scale, 128, torch.bfloat16).float()
        for layout, scale_a, scale_b in (("M-major, K-major", group_scales.t().contiguous().t(), blocks.t()),
                                         ("row-major, contiguous", group_scales, blocks.t().contiguous())):
            try:
                product = lambda: torch._scaled_mm(grouped, block_weight.t(), scale_a=scale_a, scale_b=scale_b,  # noqa: E731
                                                   out_dtype=torch.bfloat16)
                error = float((product().float() - expected).abs().max() / expected.abs().max())
                milliseconds = median_ms(product)
                print(f"sweep {name:<8} M={tokens:<5} torch._scaled_mm block-wise (scales {layout}): "
                      f"{milliseconds:.4f} ms ({roof / milliseconds:.2f}), max error against the Triton GEMM "
                      f"{error:.1e}")
            except (RuntimeError, ValueError) as error:
                print(f"sweep {name:<8} M={tokens:<5} torch._scaled_mm block-wise ({layout}): not taken: "
                      f"{str(error).splitlines()[0][:160]}")


FUSED_TOKENS = (512, 4096, 16384)
FUSED_LAYOUTS = {"token": PER_TOKEN_LAYOUT, "1x128": BLOCK_WISE_LAYOUT}


def producer_cases(tokens: int, hidden_size: int = 4096, intermediate_size: int = 14336):
    """(name, unfused, fused, bytes the fused kernel moves) for each producer and layout."""
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(hidden)
    weight = torch.randn(hidden_size, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(tokens, 2 * intermediate_size, device="cuda", dtype=torch.bfloat16)
    cases = []
    for layout_name, layout in FUSED_LAYOUTS.items():
        groups = 1 if layout.group is None else hidden_size // layout.group
        norm_bytes = tokens * hidden_size * (2 + 2 + 2 + 1) + tokens * groups * 4  # x, residual in; sum, FP8 out
        cases.append((f"add+norm {layout_name}",
                      lambda layout=layout: quantize_activation(rms_norm(hidden, weight, 1e-5, residual=residual)[0],
                                                                layout),
                      lambda layout=layout: rms_norm(hidden, weight, 1e-5, residual=residual, quantize=layout),
                      norm_bytes))
        groups = 1 if layout.group is None else intermediate_size // layout.group
        activation_bytes = tokens * intermediate_size * (2 * 2 + 1) + tokens * groups * 4
        cases.append((f"silu*mul {layout_name}",
                      lambda layout=layout: quantize_activation(silu_and_mul(gate_up), layout),
                      lambda layout=layout: silu_and_mul_quantized(gate_up, layout), activation_bytes))
    return cases


def fused_producer_table(bandwidth: float) -> None:
    """Unfused (16-bit kernel, then quantize) against fused (the producer writes FP8), per layer
    of the Llama-3.1-8B shape (one add+norm before qkv, one before gate_up, one SiLU·mul)."""
    print(f"\nactivation producers writing FP8 (fused) against 16-bit kernel + quantize (unfused)\n"
          f"{'producer':<17}{'M':>7}{'unfused ms':>12}{'fused ms':>10}{'saved ms':>10}{'fused bw':>10}")
    for tokens in FUSED_TOKENS:
        per_layer = {}
        for name, unfused, fused, moved in producer_cases(tokens):
            unfused_ms, fused_ms = median_ms(unfused), median_ms(fused)
            layout = name.split()[-1]
            count = 2 if name.startswith("add+norm") else 1
            per_layer[layout] = per_layer.get(layout, 0.0) + count * (unfused_ms - fused_ms)
            print(f"{name:<17}{tokens:>7}{unfused_ms:>12.4f}{fused_ms:>10.4f}{unfused_ms - fused_ms:>10.4f}"
                  f"{moved / bandwidth * 1e3 / fused_ms:>10.2f}")
        print("  saved per layer (2 norms + 1 activation): "
              + ", ".join(f"{layout} {saved:.4f} ms (x32 layers: {32 * saved:.2f} ms)"
                          for layout, saved in per_layer.items()))
        torch.cuda.empty_cache()
    print("fused bw: the fused kernel's bytes (16-bit in, FP8 and scales out) over its time, as a fraction "
          "of the measured copy bandwidth")


def gemm_rows(name, rows, features, bf16_ceilings, fp8_ceilings, sweep_tiles: bool) -> None:
    """The GEMM table's rows for one projection shape (bf16, per-channel and block FP8 at each of
    ``TOKENS``), and with ``sweep_tiles`` the block GEMM's tiles."""
    float_weight = torch.randn(rows, features, device="cuda") * 0.02
    bf16_weight = float_weight.to(torch.bfloat16)
    channel_weight, channel_scale = quantize_rows(float_weight)
    block_weight, blocks = quantize_blocks(float_weight, (128, 128))
    block_scale = row_block_scales(blocks, (rows, features), (128, 128))
    del float_weight
    for tokens in TOKENS:
        hidden = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
        bf16 = median_ms(lambda: hidden @ bf16_weight.t())
        channel = median_ms(lambda: fp8_linear(hidden, channel_weight, channel_scale, None))
        activation = quantize_activation(hidden, PER_TOKEN_LAYOUT)
        channel_gemm = median_ms(lambda: row_wise_product(activation, channel_weight, channel_scale))
        full_gemm = median_ms(lambda: row_wise_product(activation, channel_weight, channel_scale, False))
        full = row_wise_product(activation, channel_weight, channel_scale, False).float()
        fast_error = ((row_wise_product(activation, channel_weight, channel_scale).float() - full).abs().max()
                      / full.abs().max()).item()
        block = median_ms(lambda: fp8_linear(hidden, block_weight, block_scale, 128))
        grouped, group_scales = quantize_token_groups(hidden, 128)
        block_gemm = median_ms(lambda: block_scaled_matmul(grouped, group_scales, block_weight, block_scale,
                                                           128, torch.bfloat16))
        bf16_roof = roofline_ms(tokens, rows, features, rows * features * 2, 2, bf16_ceilings.flops,
                                bf16_ceilings.bandwidth)
        channel_roof = roofline_ms(tokens, rows, features, rows * features + rows * 4, 2, fp8_ceilings.flops,
                                   fp8_ceilings.bandwidth)
        block_roof = roofline_ms(tokens, rows, features, rows * features + block_scale.numel() * 4, 2,
                                 fp8_ceilings.flops, fp8_ceilings.bandwidth)
        print(f"{name:<9}{tokens:>6}{bf16:>9.4f}{bf16_roof / bf16:>6.2f}{channel:>9.4f}{channel_gemm:>8.4f}"
              f"{channel_roof / channel:>6.2f}{full_gemm:>8.4f}{fast_error:>9.1e}{block:>10.4f}{block_gemm:>8.4f}"
              f"{block_roof / block:>6.2f}{bf16 / channel:>10.2f}{bf16 / block:>11.2f}")
    if sweep_tiles:
        sweep_block_gemm(name, rows, features, block_weight, block_scale, blocks, fp8_ceilings.flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true",
                        help="also try kernel tiles (weight-only at M = 2 and 16, block GEMM at M = 512, 4096)")
    parser.add_argument("--fused", action="store_true",
                        help="only the table of activation producers writing FP8, fused against unfused")
    parser.add_argument("--weight-only", action="store_true",
                        help="only the weight-only table (M <= 16; with --sweep, its tiles)")
    arguments = parser.parse_args()
    bf16_ceilings = Ceilings.measure(torch.bfloat16)
    fp8_ceilings = Ceilings.measure(torch.bfloat16, fp8=True)
    print(bf16_ceilings.describe())
    print(fp8_ceilings.describe())
    if arguments.fused:
        fused_producer_table(fp8_ceilings.bandwidth)
        return
    weight_only_rows, layer_times, layer_bytes = [], {}, {}
    if not arguments.weight_only:
        print(f"\n{'shape':<9}{'M':>6}{'bf16 ms':>9}{'roof':>6}{'chan ms':>9}{'gemm':>8}{'roof':>6}{'full':>8}"
              f"{'f.err':>9}{'block ms':>10}{'gemm':>8}{'roof':>6}{'chan/bf16':>10}{'block/bf16':>11}")
    for name, (rows, features) in SHAPES.items():
        if not arguments.weight_only:
            gemm_rows(name, rows, features, bf16_ceilings, fp8_ceilings, arguments.sweep)
        stacks = stack(rows, features)
        for tokens in WEIGHT_ONLY_TOKENS:
            row, times = weight_only_row(name, rows, features, tokens, stacks, fp8_ceilings.bandwidth)
            weight_only_rows.append(row)
            for format_name, microseconds in zip((f for f, _ in WEIGHT_ONLY_FORMATS), times):
                layer_times[(tokens, format_name)] = layer_times.get((tokens, format_name), 0.0) + microseconds
        for format_name, _ in WEIGHT_ONLY_FORMATS:
            layer_bytes[format_name] = layer_bytes.get(format_name, 0.0) + stack_bytes(stacks[format_name])
        if arguments.sweep:
            sweep(name, rows, features, stacks, fp8_ceilings.bandwidth)
        del stacks
        torch.cuda.empty_cache()
    print(f"\nweight-only path (M <= 16), {LAYERS} weights of a shape replayed from a CUDA graph\n"
          f"{'shape':<9}{'M':>6}{'chan us':>9}{'roof':>6}{'':<21}{'block us':>9}{'roof':>6}")
    print("\n".join(weight_only_rows))
    for tokens in WEIGHT_ONLY_TOKENS:  # the target: a layer's four products at >= 0.85 of the read rate
        cells = [f"{f} {layer_times[(tokens, f)]:.1f} us "
                 f"({layer_bytes[f] / fp8_ceilings.bandwidth * 1e6 / layer_times[(tokens, f)]:.2f})"
                 for f, _ in WEIGHT_ONLY_FORMATS]
        print(f"a layer's four products at M={tokens}: " + ", ".join(cells))
    print("\nroof: the roofline's time over the measured time (1.00 = at the roofline); chan/bf16, "
          "block/bf16: speed-up over bf16")
    if not arguments.weight_only:
        fused_producer_table(fp8_ceilings.bandwidth)


if __name__ == "__main__":
    main()
