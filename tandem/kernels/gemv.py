"""One- and two-token products bound by reading the weight (batch-1 decode): 16-bit activations
times a 16-bit or FP8 weight, on the CUDA cores, and the PyTorch reference beside it.

``gemv(hidden, weight, weight_scale=None, group=None)`` computes ``hidden @ W.T`` for
``hidden [M <= 2, K]`` and ``W = weight`` (16-bit) or ``W = weight * scale`` (FP8
``float8_e4m3fn`` in the row-block layout of ``fp8_gemm.py``: ``weight_scale [N, ceil(K /
group)]`` float32, ``group=None``: one scale per row).

At one or two tokens a tensor-core tile would be 15/16 padding, and the product's time is the
time to read the weight: the kernels' one job is keeping enough weight bytes in flight. Each
program streams ``BLOCK_N`` whole rows (or a ``1 / SPLIT`` of their K range) in
``BLOCK_K``-input steps of 16-byte loads. Two kernels share that plan and differ in how a step's
products are summed:

- ``_gemv_kernel`` ("elementwise") multiplies into float32 accumulators the shape of a step and
  sums across K once, after the loop, so a step is loads and fused multiply-adds only, with the
  next step's weight loads issued before them. Each weight row reads its own copy of the
  activations (from L1), so no step moves data between threads;
- ``_gemv_step_sums_kernel`` ("step sums") reads the activations once per step and sums each
  step's products per row across threads. Converting an FP8 weight costs more instructions per
  byte than a 16-bit one, and there the fewer activation reads and conversions pay on the
  shapes ``gemv_config`` names.

Block scales multiply each ``group``-wide sub-tile's products (a step spans whole groups or lies
within one); per-row scales, requested with the first weight tile, multiply the totals. Narrow
strips make many programs, so every SM holds several and their loads overlap; where even the
narrowest leave SMs idle (small N, as under tensor parallelism), ``SPLIT`` programs share a
strip's K range and add float32 partials into a zeroed buffer, cast afterwards. The tiles are
static per shape, so a CUDA graph captured at a batch size replays the same launch.

    grid = (ceil(N / BLOCK_N), SPLIT)
    program (n, s):  rows n*BLOCK_N .. +BLOCK_N of W,  K range s*K_PER_SPLIT .. +K_PER_SPLIT
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from tandem.kernels.activation import SILU, activate
from tandem.kernels.triton_support import (early_launch_arguments, jit, launch_dependents, multiprocessors, tl,
                                           triton, wait_for_producer)

GEMV_MAX_TOKENS = 2  # the tokens one program multiplies (a float32 accumulator per token)
# A scale group larger than any K: per-row scales (applied after the K loop).
WHOLE_ROW = 1 << 30


ELEMENTWISE, STEP_SUMS = "elementwise", "step sums"
_SILU = tl.constexpr(SILU)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows per program
    block_k: int  # inputs per loop step
    split: int = 1  # programs sharing one strip's K range
    warps: int = 4
    stages: int = 1
    kernel: str = ELEMENTWISE  # or STEP_SUMS (see the module's docstring)


def gemv_reference(hidden: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor] = None,
                   group: Optional[int] = None) -> torch.Tensor:
    """``hidden @ W.T`` in float32, returned in ``hidden.dtype`` (``W``: ``weight``, times its
    scales where ``weight_scale`` is given)."""
    matrix = weight.float()
    if weight_scale is not None:
        features = weight.shape[1]
        size = features if group is None else group
        matrix = matrix * weight_scale.float().repeat_interleave(size, dim=1)[:, :features]
    return (hidden.float() @ matrix.t()).to(hidden.dtype)


def gemv_config(rows: int, features: int, element_size: int, processors: int,
                block_scaled: bool = False) -> GemvConfig:
    """Tiles for H100-class GPUs (132 SMs, ~3 TB/s), from ``benchmarks/kernels_gemv.py --sweep``
    (the Llama-3.1-8B projections, each a stack of 32 replayed from a CUDA graph):

    - 16-bit weights: the elementwise kernel, 2-row strips, steps of 2 KiB of a row, four warps
      (0.86-1.04 of the copy rate on every projection, where cuBLAS reads at 0.72-0.97);
    - FP8 weights with per-row scales: the elementwise kernel on long rows (K >= 8,192: the down
      projection; 2-row strips of 512 inputs, eight warps), step sums over 16-row strips of 512
      inputs elsewhere (q/k/v, o and gate/up, where they read faster);
    - FP8 weights with block scales: the elementwise kernel (4-row strips of 512 inputs, four
      warps) on fewer than 16,384 rows, step sums on more (gate/up).

    K is split in halves only while the strips make fewer programs than there are SMs (keeping
    four or more steps per program): split-K costs two more launches, which took more than the
    idle SMs gave back on these shapes."""
    if element_size > 1:
        config = GemvConfig(block_n=2, block_k=1024, warps=4)
    elif block_scaled and rows < 16384:
        config = GemvConfig(block_n=4, block_k=512, warps=4)
    elif not block_scaled and features >= 8192:
        config = GemvConfig(block_n=2, block_k=512, warps=8)
    else:
        config = GemvConfig(block_n=16, block_k=512, warps=8, kernel=STEP_SUMS)
    block_k = min(config.block_k, max(16, triton.next_power_of_2(features)))
    split = 1
    while (triton.cdiv(rows, config.block_n) * split < processors
           and triton.cdiv(features, block_k) // (2 * split) >= 4):
        split *= 2
    return dataclasses.replace(config, block_k=block_k, split=split)


def sub_tile_inputs(block_k: int, group: Optional[int]) -> int:
    """Inputs per sub-tile: within one weight scale column (per-row scales: the whole step)."""
    return block_k if group is None else min(group, block_k)


def split_inputs(features: int, split: int, block_k: int) -> int:
    """The inputs each of ``split`` programs sharing a row's ``features`` takes: whole
    ``block_k`` steps (the last program's range may run past the row)."""
    return triton.cdiv(triton.cdiv(features, split), block_k) * block_k


def split_output(hidden: torch.Tensor, rows: int, split: int, block_k: int) -> tuple[int, torch.Tensor]:
    """For ``hidden [M, K]`` times ``rows`` weight rows with K split ``split`` ways: the inputs per
    split program (``split_inputs``) and the output, float32 zeros the programs add their
    partials into where ``split`` > 1 (cast afterwards), else uninitialised in ``hidden``'s dtype."""
    tokens, features = hidden.shape
    k_per_split = split_inputs(features, split, block_k)
    if split > 1:
        return k_per_split, torch.zeros(tokens, rows, dtype=torch.float32, device=hidden.device)
    return k_per_split, torch.empty(tokens, rows, dtype=hidden.dtype, device=hidden.device)


@jit
def _gemv_kernel(x, w, w_scale, out, N, K, stride_x, stride_w, stride_out, scale_columns, K_PER_SPLIT, gate_rows,
                 GROUP: tl.constexpr, TOKENS: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, EVEN: tl.constexpr, ATOMIC: tl.constexpr,
                 GATED: tl.constexpr, PDL: tl.constexpr):
    """``out[TOKENS, N] (+)= x @ W.T`` over this program's ``BLOCK_N`` rows and K range, float32
    throughout. ``SCALED``: ``W = w * w_scale`` (``GROUP`` inputs per scale column;
    ``WHOLE_ROW``: one per row). ``EVEN``: N a multiple of ``BLOCK_N`` and the K ranges whole
    steps inside K (no masks but the last prefetch's).

    A step's tile is ``[BLOCK_N, PARTS, SUB_K]``: ``PARTS`` sub-tiles of ``SUB_K`` inputs, one
    scale column each (per-row scales: one part, the whole step), loaded as one tile so each
    thread's share of a row stays 16 contiguous bytes. The next step's weight tile is loaded
    before this step's multiply (the compiler pipelines only loads that feed ``tl.dot``), so
    two steps' bytes are in flight per program. The activations are read as a tile of the
    weight tile's shape (each row's copy from L1), in its layout: a row vector broadcast to it
    would be moved between layouts through shared memory, with two barriers, every step."""
    PARTS: tl.constexpr = BLOCK_K // SUB_K
    PER_ROW: tl.constexpr = GROUP >= (1 << 30)
    launch_dependents(PDL)
    columns, real = _strip_rows(N, gate_rows, BLOCK_N, GATED)
    column_mask = real[:, None, None]
    inputs = (tl.program_id(1) * K_PER_SPLIT + tl.arange(0, PARTS)[None, :, None] * SUB_K
              + tl.arange(0, SUB_K)[None, None, :])  # [1, PARTS, SUB_K]: the first step's inputs
    w_pointers = w + columns[:, None, None] * stride_w + inputs
    x_pointers = x + (columns[:, None, None] * 0 + inputs)  # every row's copy of the activations
    if EVEN:
        w_next = tl.load(w_pointers)
    else:
        w_next = tl.load(w_pointers, mask=column_mask & (inputs < K), other=0.0)
    row_scales = _row_scales(w_scale, columns, real, scale_columns, GROUP, SCALED)
    wait_for_producer(PDL)  # the weight's first tile is on its way; the activations are the producer's
    first = tl.zeros((BLOCK_N, PARTS, SUB_K), dtype=tl.float32)
    second = tl.zeros((BLOCK_N, PARTS, SUB_K), dtype=tl.float32)
    for step in range(0, K_PER_SPLIT, BLOCK_K):
        w_tile = w_next.to(tl.float32)
        more = step + BLOCK_K < K_PER_SPLIT
        if EVEN:
            w_next = tl.load(w_pointers + step + BLOCK_K, mask=more, other=0.0)
            x_first = tl.load(x_pointers + step).to(tl.float32)
        else:
            k_mask = inputs + step < K
            w_next = tl.load(w_pointers + step + BLOCK_K, mask=more & column_mask & (inputs + step + BLOCK_K < K),
                             other=0.0)
            x_first = tl.load(x_pointers + step, mask=k_mask, other=0.0).to(tl.float32)
        if SCALED and not PER_ROW:
            groups = (tl.program_id(1) * K_PER_SPLIT + step + tl.arange(0, PARTS)[None, :, None] * SUB_K) // GROUP
            scale = tl.load(w_scale + columns[:, None, None] * scale_columns + groups, mask=column_mask, other=0.0)
            w_tile = w_tile * scale
        first += w_tile * x_first
        if TOKENS > 1:
            if EVEN:
                x_second = tl.load(x_pointers + stride_x + step).to(tl.float32)
            else:
                x_second = tl.load(x_pointers + stride_x + step, mask=k_mask, other=0.0).to(tl.float32)
            second += w_tile * x_second
    _finish(tl.sum(tl.sum(first, axis=2), axis=1), tl.sum(tl.sum(second, axis=2), axis=1), row_scales, out, columns,
            real, stride_out, gate_rows, TOKENS, ATOMIC, GATED, BLOCK_N)


@jit
def _gemv_step_sums_kernel(x, w, w_scale, out, N, K, stride_x, stride_w, stride_out, scale_columns, K_PER_SPLIT,
                           gate_rows, GROUP: tl.constexpr, TOKENS: tl.constexpr, SCALED: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, ATOMIC: tl.constexpr,
                           GATED: tl.constexpr, PDL: tl.constexpr):
    """``_gemv_kernel``'s product with each ``SUB_K``-wide sub-tile's products summed per row
    inside the step (and scaled there by block scales), the activations read once per step."""
    PARTS: tl.constexpr = BLOCK_K // SUB_K
    PER_ROW: tl.constexpr = GROUP >= (1 << 30)
    columns, column_mask = _strip_rows(N, gate_rows, BLOCK_N, GATED)
    k_begin = tl.program_id(1) * K_PER_SPLIT
    launch_dependents(PDL)
    row_scales = _row_scales(w_scale, columns, column_mask, scale_columns, GROUP, SCALED)
    wait_for_producer(PDL)
    first = tl.zeros((BLOCK_N,), dtype=tl.float32)
    second = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in range(0, K_PER_SPLIT, BLOCK_K):
        for part in tl.static_range(PARTS):
            offset = k_begin + step + part * SUB_K
            k = offset + tl.arange(0, SUB_K)
            k_mask = k < K
            w_tile = tl.load(w + columns[:, None] * stride_w + k[None, :],
                             mask=column_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x_first = tl.load(x + k, mask=k_mask, other=0.0).to(tl.float32)
            partial_first = tl.sum(w_tile * x_first[None, :], axis=1)
            if TOKENS > 1:
                x_second = tl.load(x + stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
                partial_second = tl.sum(w_tile * x_second[None, :], axis=1)
            if SCALED and not PER_ROW:
                scale = tl.load(w_scale + columns * scale_columns + offset // GROUP, mask=column_mask, other=0.0)
                partial_first *= scale
                if TOKENS > 1:
                    partial_second *= scale
            first += partial_first
            if TOKENS > 1:
                second += partial_second
    _finish(first, second, row_scales, out, columns, column_mask, stride_out, gate_rows, TOKENS, ATOMIC, GATED,
            BLOCK_N)


@jit
def _strip_rows(N, gate_rows, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """The weight rows program ``n`` streams, and which of them exist: ``BLOCK_N`` consecutive
    rows; ``GATED`` (a stacked ``[gate; up]`` weight of ``2 * gate_rows`` rows): ``BLOCK_N // 2``
    gate rows, each followed by its up row, so the program holds both factors of its outputs."""
    index = tl.arange(0, BLOCK_N)
    if GATED:
        pair = tl.program_id(0) * (BLOCK_N // 2) + index // 2
        return pair + (index % 2) * gate_rows, pair < gate_rows
    rows = tl.program_id(0) * BLOCK_N + index
    return rows, rows < N


@jit
def _row_scales(w_scale, columns, column_mask, scale_columns, GROUP: tl.constexpr, SCALED: tl.constexpr):
    """The strip's per-row scales (``GROUP`` ``WHOLE_ROW``), requested at the program's start
    with its first weight tile, so no load waits at its end; 1.0 for other weights."""
    if SCALED and GROUP >= (1 << 30):
        return tl.load(w_scale + columns * scale_columns, mask=column_mask, other=0.0)
    return tl.full(columns.shape, 1.0, tl.float32)


@jit
def _finish(first, second, row_scales, out, columns, column_mask, stride_out, gate_rows, TOKENS: tl.constexpr,
            ATOMIC: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per-row scales (``_row_scales``: 1.0 for other weights) on the totals, then the store
    (split-K: the float32 add). ``GATED``: ``silu(gate) * up`` of each (gate, up) pair of rows,
    rounded as the product's output and then ``silu_and_mul`` would round it."""
    first *= row_scales
    second *= row_scales
    for token in tl.static_range(TOKENS):
        result = first if token == 0 else second
        if GATED:
            dtype = out.dtype.element_ty
            gate, up = tl.split(tl.reshape(result.to(dtype).to(tl.float32), (BLOCK_N // 2, 2)))
            activated = activate(gate, 0.0, _SILU).to(dtype).to(tl.float32)
            pairs = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out + token * stride_out + pairs, (activated * up).to(dtype), mask=pairs < gate_rows)
        elif ATOMIC:
            tl.atomic_add(out + token * stride_out + columns, result, mask=column_mask)
        else:
            tl.store(out + token * stride_out + columns, result.to(out.dtype.element_ty), mask=column_mask)


def gemv_serves(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` is the product to take for ``hidden [M, K] @ weight.T`` with a 16-bit
    weight: on CUDA, one or two tokens, both of one 16-bit dtype, rows contiguous."""
    return (hidden.is_cuda and 0 < hidden.shape[0] <= GEMV_MAX_TOKENS
            and weight.dtype in (torch.bfloat16, torch.float16) and hidden.dtype == weight.dtype
            and hidden.stride(-1) == 1 and weight.is_contiguous())


def gemv(hidden: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor] = None,
         group: Optional[int] = None, config: Optional[GemvConfig] = None, gated: bool = False) -> torch.Tensor:
    """``gemv_reference`` as one Triton launch (two more with split-K: the zeroed float32 buffer
    and the cast). ``hidden [M <= GEMV_MAX_TOKENS, K]`` contiguous rows; ``weight [N, K]``
    contiguous; ``group`` None or a power of two >= 16. ``config``: tiles other than
    ``gemv_config``'s (benchmarks, tests).

    ``gated``: ``weight`` is a stacked ``[gate; up]`` projection (``N`` even) and the result is
    ``silu(gate) * up`` ``[M, N / 2]``, computed in the same launch and bit for bit what
    ``silu_and_mul`` makes of the ungated product (never split over K: each program sums its
    rows whole)."""
    tokens, features = hidden.shape
    rows = weight.shape[0]
    if tokens > GEMV_MAX_TOKENS:
        raise ValueError(f"gemv serves at most {GEMV_MAX_TOKENS} tokens, got {tokens}")
    if config is None:
        config = gemv_config(rows, features, weight.element_size(), multiprocessors(hidden),
                             block_scaled=weight_scale is not None and group is not None)
    gate_rows = rows // 2 if gated else 0
    if gated:
        if rows % 2 or config.block_n % 2:
            raise ValueError(f"a gated gemv takes [gate; up] rows in pairs: {rows} rows, strips of {config.block_n}")
        config = dataclasses.replace(config, split=1)
    sub_k = sub_tile_inputs(config.block_k, group)
    k_per_split, output = split_output(hidden, rows - gate_rows, config.split, config.block_k)
    atomic = config.split > 1
    if tokens == 0:
        return output.to(hidden.dtype)
    scaled = weight_scale is not None
    scale_arguments = (weight_scale, weight_scale.shape[1]) if scaled else (weight, 0)
    grid = (triton.cdiv(rows, config.block_n), config.split)  # (gated: a strip's rows are half gate, half up)
    # Launched early where the GPU allows (not after split-K's zeroing, which does not signal).
    common = dict(GROUP=WHOLE_ROW if group is None else group, TOKENS=tokens, SCALED=scaled, BLOCK_N=config.block_n,
                  BLOCK_K=config.block_k, SUB_K=sub_k, ATOMIC=atomic, GATED=gated, num_warps=config.warps,
                  num_stages=config.stages, **early_launch_arguments(hidden, tokens, allowed=not atomic))
    if config.kernel == STEP_SUMS:
        kernel, specific = _gemv_step_sums_kernel, {}
    else:
        kernel = _gemv_kernel
        specific = dict(EVEN=rows % config.block_n == 0 and k_per_split * config.split == features)
    kernel[grid](hidden, weight, scale_arguments[0], output, rows, features, hidden.stride(0), weight.stride(0),
                 output.stride(0), scale_arguments[1], k_per_split, gate_rows, **common, **specific)
    return output.to(hidden.dtype) if atomic else output
