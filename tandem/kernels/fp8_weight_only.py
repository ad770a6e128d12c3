"""Few-token FP8 products (decode): 16-bit activations times FP8 weights dequantized in
registers, and the PyTorch reference beside it.

``weight_only_matmul(hidden, weight, weight_scale, group)`` computes ``hidden @ W.T`` for
``W = weight * scale`` in the row-block layout of ``fp8_gemm.py`` (``weight [N, K]``
float8_e4m3fn, ``weight_scale [N, ceil(K / group)]`` float32; ``group=None``: one scale per row).
At ``M <= 16`` tokens the product is bound by reading the weight (an 8B model's decode step reads
~8 GB of FP8 weights; at ~3 TB/s that is ~2.7 ms), so this path skips the activation
quantization launch altogether: each program streams a ``BLOCK_N x K`` strip of the weight (or
a ``1 / SPLIT`` of it) and multiplies each tile by the tokens' activations on the tensor cores,
the weight strip as the tile's tall operand and the (up to 16) tokens as its narrow one, into
float32, applying the row's scale per K group. Without activation rounding it is closer to the
dequantized weights than the activation-quantized path.

The operands go to the tensor cores as float16: an e4m3 value converts to it exactly in one
instruction per two values (to bfloat16 it takes several, which read the weight ~15% slower on
an H100), and so does a 16-bit activation of magnitude 2^-14 to 65,504 (smaller ones round to
float16's subnormal steps of 2^-24, far below the products' float32 sum's rounding). A
program whose sum comes out non-finite (an activation past float16's range) multiplies again
in float32, so such input gives the reference's result, never infinities of the conversion.

Split-K: where ``N / BLOCK_N`` programs would leave SMs idle (small N), ``SPLIT`` programs share
a strip's K range, each storing a float32 partial; the strip's last program to finish sums
them in split order and stores the output (one launch, the same sums every time); otherwise
each program stores its tile. Everything is shape-static per token count, so a CUDA graph
captured at a batch size replays the same launch.

At one token (``FP8_GEMV_MAX_TOKENS``) a tensor-core tile would be 15/16 padding and the
CUDA-core kernels of ``gemv.py`` read the weight faster; from two tokens up this kernel does.

    grid = (ceil(N / BLOCK_N), SPLIT)
    program (n, s):  rows n*BLOCK_N .. +BLOCK_N of W,  K range s*K_PER_SPLIT .. +K_PER_SPLIT
                     per BLOCK_K step: SUB_K-wide sub-tiles, one weight scale column each
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from tandem.kernels.gemv import WHOLE_ROW, gemv, split_inputs, sub_tile_inputs
from tandem.kernels.triton_support import jit, multiprocessors, tl, triton

MAX_TOKENS = 16  # the largest token count this path serves (one 16-row tensor-core tile)
FP8_GEMV_MAX_TOKENS = 1  # the token counts ``gemv.py`` serves instead (its own tiles)


def takes_gemv(tokens: int) -> bool:
    """Whether ``weight_only_matmul`` of ``tokens`` rows is ``gemv.py``'s product."""
    return 0 < tokens <= FP8_GEMV_MAX_TOKENS


@dataclass(frozen=True)
class WeightOnlyConfig:
    block_n: int  # weight rows per program
    block_k: int  # inputs per loop step (a multiple of the sub-tile)
    split: int  # programs sharing one strip's K range
    warps: int = 4
    stages: int = 4
    # The operands' type on the tensor cores: "float16", "bfloat16" (the activations as they
    # are) or "float32"; None: float16 on a GPU, float32 interpreted on a CPU.
    dot: Optional[str] = None


def weight_only_matmul_reference(hidden: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                 group: Optional[int]) -> torch.Tensor:
    """``hidden @ (weight * weight_scale).T`` in float32, returned in ``hidden.dtype``."""
    features = weight.shape[1]
    size = features if group is None else group
    scales = weight_scale.float().repeat_interleave(size, dim=1)[:, :features]
    return (hidden.float() @ (weight.float() * scales).t()).to(hidden.dtype)


def weight_only_config(rows: int, features: int, group: Optional[int], multiprocessors: int) -> WeightOnlyConfig:
    """Tiles for H100-class GPUs (132 SMs, ~3 TB/s), from a sweep of the Llama-3.1-8B
    projections at 1, 2 and 16 tokens (stacks of 32 weights replayed from a CUDA graph):
    strips of 32 weight rows, 64 on tall weights (16,384 rows or more: gate/up); steps of 256
    inputs for per-row scales on rows shorter than 8,192 inputs of weights that are not tall,
    else 128 (one block-scale column a step; on gate/up with per-row scales 128-input steps
    read at 0.82-0.85 of the copy rate where 256 read at 0.74-0.75, timed in CUDA graphs).
    Split-K costs each program a float32 partial, stored and read back by the strip's last one;
    it pays only where a program's loop is long or carries block scales: K is split in halves
    while fewer than 2.5 programs per SM result (keeping two or more steps a program), except
    for per-row scales on short rows, which read fastest unsplit."""
    block_n = 64 if rows >= 16384 else 32
    per_row_short = group is None and features < 8192
    block_k = min(256 if per_row_short and block_n == 32 else 128, max(16, triton.next_power_of_2(features)))
    split = 1
    steps = triton.cdiv(features, block_k)
    while (not per_row_short and 2 * triton.cdiv(rows, block_n) * split < 5 * multiprocessors
           and steps // (2 * split) >= 2):
        split *= 2
    return WeightOnlyConfig(block_n=block_n, block_k=block_k, split=split)


@jit
def _step_scales(w_scale, columns, column_mask, scale_columns, start, K, GROUP: tl.constexpr,
                 SUB_K: tl.constexpr, PARTS: tl.constexpr):
    """The weight scales of one K step: ``[BLOCK_N, PARTS]``, one column per sub-tile."""
    offsets = start + tl.arange(0, PARTS) * SUB_K
    return tl.load(w_scale + columns[:, None] * scale_columns + (offsets // GROUP)[None, :],
                   mask=column_mask[:, None] & (offsets < K)[None, :], other=0.0)


@jit
def _weight_only_sum(x, w, w_scale, M, N, K, stride_x, stride_w, scale_columns, K_PER_SPLIT, GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
                     DOT: tl.constexpr):
    """``(w * w_scale)[rows, k] @ x[:, k].T`` over this program's ``BLOCK_N`` weight rows and K
    range: ``[BLOCK_N, BLOCK_M]`` float32, the operands multiplied on the tensor cores in ``DOT``.

    The weight tiles are software-pipelined by the compiler (``num_stages``); the scales are
    loaded by hand one step ahead (a load waited on in the step that issues it would stall
    every step), or, per-row (``GROUP`` = ``WHOLE_ROW``), once, applied after the loop."""
    PARTS: tl.constexpr = BLOCK_K // SUB_K
    PER_ROW: tl.constexpr = GROUP >= (1 << 30)
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(1) * K_PER_SPLIT
    tokens = tl.arange(0, BLOCK_M)
    token_mask = tokens < M
    column_mask = columns < N
    parts = tl.arange(0, PARTS)
    accumulator = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if not PER_ROW:
        scales = _step_scales(w_scale, columns, column_mask, scale_columns, k_begin, K, GROUP, SUB_K, PARTS)
    for start in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        if not PER_ROW:
            next_scales = _step_scales(w_scale, columns, column_mask, scale_columns, start + BLOCK_K, K, GROUP,
                                       SUB_K, PARTS)
        for part in tl.static_range(PARTS):
            k = start + part * SUB_K + tl.arange(0, SUB_K)
            k_mask = k < K
            w_tile = tl.load(w + columns[:, None] * stride_w + k[None, :],
                             mask=column_mask[:, None] & k_mask[None, :], other=0.0)
            x_tile = tl.load(x + tokens[None, :] * stride_x + k[:, None], mask=token_mask[None, :] & k_mask[:, None],
                             other=0.0)
            if DOT == "float16":
                partial = tl.dot(w_tile.to(tl.float16), x_tile.to(tl.float16))
            elif DOT == "bfloat16":
                partial = tl.dot(w_tile.to(tl.bfloat16), x_tile.to(tl.bfloat16))
            else:
                partial = tl.dot(w_tile.to(tl.float32), x_tile.to(tl.float32))
            if PER_ROW:
                accumulator += partial
            else:
                scale = tl.sum(tl.where(parts[None, :] == part, scales, 0.0), axis=1)
                accumulator += partial * scale[:, None]
        if not PER_ROW:
            scales = next_scales
    if PER_ROW:
        accumulator *= tl.load(w_scale + columns * scale_columns, mask=column_mask, other=0.0)[:, None]
    return accumulator


@jit(do_not_specialize=["M"])  # the step's token count (K_PER_SPLIT: always a multiple of BLOCK_K)
def _weight_only_gemm(x, w, w_scale, out, partials, arrivals, M, N, K, stride_x, stride_w, stride_out, scale_columns,
                      K_PER_SPLIT, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, SPLIT_SUM: tl.constexpr, DOT: tl.constexpr):
    """``out[M, N] = x[M, K] @ (w * w_scale)[N, K].T`` over this program's rows; with split-K
    (``SPLIT_SUM``) over its K range, summed by the strip's last program (see
    ``_sum_split_partials``). ``DOT`` float16: the FP8 weight converts exactly, two values an
    instruction, and so do 16-bit activations of magnitude 2^-14 to 65,504 (smaller ones round
    to float16's subnormal steps of 2^-24); a non-finite sum (an activation past float16's
    range, or a non-finite input) sends the program through the product again in float32,
    which gives what the reference gives."""
    accumulator = _weight_only_sum(x, w, w_scale, M, N, K, stride_x, stride_w, scale_columns, K_PER_SPLIT, GROUP,
                                   BLOCK_M, BLOCK_N, BLOCK_K, SUB_K, DOT)
    if DOT == "float16":
        finite = tl.abs(accumulator) <= 3.4028234663852886e38  # (False for inf and NaN)
        if tl.min(tl.min(finite.to(tl.int32), axis=1), axis=0) == 0:
            accumulator = _weight_only_sum(x, w, w_scale, M, N, K, stride_x, stride_w, scale_columns, K_PER_SPLIT,
                                           GROUP, BLOCK_M, BLOCK_N, BLOCK_K, SUB_K, "float32")
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_M)
    mask = (tokens < M)[None, :] & (columns < N)[:, None]
    if SPLIT_SUM:
        _sum_split_partials(accumulator, out, partials, arrivals, M, N, stride_out, columns, tokens, mask)
    else:
        tl.store(out + tokens[None, :] * stride_out + columns[:, None], accumulator.to(out.dtype.element_ty),
                 mask=mask)


@jit
def _sum_split_partials(accumulator, out, partials, arrivals, M, N, stride_out, columns, tokens, mask):
    """Split-K without extra launches: each of a strip's programs stores its float32 partial in
    ``partials[split]`` and counts itself in on the strip's arrival counter; the one that
    arrives last sums every split's partial in split order (the same sums every launch, unlike
    atomic adds), stores the output in its dtype and sets the counter back to zero for the next
    launch. The partials are stored before the count (a barrier, then a release) and read after
    it (an acquire) from L2, past the SM's own cache."""
    strip = tl.program_id(0)
    splits = tl.num_programs(1)
    offsets = tokens[None, :] * N + columns[:, None]
    tl.store(partials + tl.program_id(1) * M * N + offsets, accumulator, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals + strip, 1, sem="acq_rel")
    if arrived == splits - 1:
        total = tl.zeros(accumulator.shape, dtype=tl.float32)
        for split in range(0, splits):
            total += tl.load(partials + split * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out + tokens[None, :] * stride_out + columns[:, None], total.to(out.dtype.element_ty), mask=mask)
        tl.atomic_xchg(arrivals + strip, 0)


# Per device: one arrival counter per strip of a split-K product, zero between launches (each
# launch's last programs set theirs back). Products on one device run one after another on its
# compute stream, so one set serves them all. Made (zeroed) by the first eager split product:
# a CUDA graph's capture never records the zeroing; a capture that comes first (never in the
# engine: every graph is warmed up eagerly) runs that product unsplit.
ARRIVAL_SLOTS = 1 << 16
_ARRIVALS: dict[tuple[str, Optional[int]], torch.Tensor] = {}


def _arrival_counters(device: torch.device) -> Optional[torch.Tensor]:
    key = (device.type, device.index)
    counters = _ARRIVALS.get(key)
    if counters is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counters = _ARRIVALS[key] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return counters


def weight_only_matmul(hidden: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group: Optional[int],
                       config: Optional[WeightOnlyConfig] = None) -> torch.Tensor:
    """``weight_only_matmul_reference``: up to ``FP8_GEMV_MAX_TOKENS`` tokens ``gemv.gemv`` (its
    own tiles), above that the tensor-core tile as one Triton launch (split-K included: the
    strip's last program sums the partials). ``hidden [M <= 16, K]`` contiguous rows; ``group``
    None or a power of two >= 16. ``config``: tiles other than ``weight_only_config``'s
    (benchmarks, tests)."""
    tokens, features = hidden.shape
    rows = weight.shape[0]
    if tokens > MAX_TOKENS:
        raise ValueError(f"weight_only_matmul serves at most {MAX_TOKENS} tokens, got {tokens}")
    if takes_gemv(tokens) and config is None:
        return gemv(hidden, weight, weight_scale, group)
    if config is None:
        config = weight_only_config(rows, features, group, multiprocessors(hidden))
    output = torch.empty(tokens, rows, dtype=hidden.dtype, device=hidden.device)
    if tokens == 0:
        return output
    strips = triton.cdiv(rows, config.block_n)
    arrivals = _arrival_counters(hidden.device) if config.split > 1 and strips <= ARRIVAL_SLOTS else None
    if arrivals is None:  # (no split, or a capture before any eager split product: unsplit, one launch)
        config = dataclasses.replace(config, split=1)
    partials = (torch.empty(config.split, tokens, rows, dtype=torch.float32, device=hidden.device)
                if config.split > 1 else output)
    _weight_only_gemm[(strips, config.split)](
        hidden, weight, weight_scale, output, partials, arrivals if arrivals is not None else output, tokens, rows,
        features, hidden.stride(0), weight.stride(0), output.stride(0), weight_scale.shape[1],
        split_inputs(features, config.split, config.block_k), GROUP=WHOLE_ROW if group is None else group,
        BLOCK_M=MAX_TOKENS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SUB_K=sub_tile_inputs(config.block_k, group), SPLIT_SUM=config.split > 1,
        DOT=config.dot or ("float16" if hidden.is_cuda else "float32"), num_warps=config.warps,
        num_stages=config.stages)
    return output
