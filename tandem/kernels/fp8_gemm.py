"""FP8 matrix products with dynamically quantized activations, and their PyTorch references.

``fp8_linear(hidden, weight, weight_scale, group)`` computes ``hidden @ W.T`` for an FP8 weight
``W = weight * scale`` held in the row-block layout (``weight [N, K]`` float8_e4m3fn,
``weight_scale [N, ceil(K / group)]`` float32; ``group=None``: one scale per row):

- the activations are quantized per token (``group=None``) or per token and ``group``
  consecutive features (1x128 for DeepSeek's 128x128 blocks), scale ``max|x| / 448``;
- per-row weights on CUDA: ``torch._scaled_mm`` with row-wise scales (FP8 tensor cores);
- block weights on CUDA: ``torch._scaled_mm``'s block-wise mode (cuBLASLt, SM90: 1x128
  activation groups times 128x128 weight blocks; ``block_wise_scaled_mm``) where the weight's
  scales are whole 128x128 blocks, else the Triton kernel ``_block_scaled_gemm`` below: per K
  group one FP8 ``tl.dot`` into float32, multiplied by the token's and the row's scales and
  accumulated. On an H100 (Llama-3.1-8B shapes, 4,096 tokens) cuBLASLt ran at 0.79–0.82 of the
  FP8 matrix rate, the Triton kernel at 0.37–0.42 (``benchmarks/kernels_fp8.py --sweep``);
- elsewhere (CPU, or shapes ``_scaled_mm`` does not take): ``fp8_linear_reference``.

An activation may also arrive already quantized (``QuantizedActivation``, written by the norm or
activation kernel that computed it in the layout ``fp8_linear_layout`` or ``BLOCK_WISE_LAYOUT``
names): ``fp8_product`` and ``block_wise_product`` take it as it is.

Everything is shape-static and host-sync free, so it runs inside CUDA graphs.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

# The FP8 constants and the reference quantization live beside the quantized activation; this
# module exports them too, as the home of the FP8 products.
from tandem.kernels.fp8_activation import (FP8_DTYPE, FP8_MAX, MINIMUM_SCALE,  # noqa: F401
                                           ActivationLayout, QuantizedActivation, _fp8_scale, _fp8_values,
                                           quantize_token_groups_reference)
from tandem.kernels.triton_support import jit, tl, triton


@jit
def _quantize_groups_kernel(hidden, stride_hidden, quantized, scales, features, stride_scale_token,
                            stride_scale_group, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token, group): amax, scale, quantize."""
    token = tl.program_id(0)
    group = tl.program_id(1)
    columns = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (columns < features)
    values = tl.load(hidden + token * stride_hidden + columns, mask=mask, other=0.0).to(tl.float32)
    scale = _fp8_scale(tl.max(tl.abs(values), axis=0))
    quantized_values = _fp8_values(values, scale)
    tl.store(quantized + token * features + columns, quantized_values.to(quantized.dtype.element_ty), mask=mask)
    tl.store(scales + token * stride_scale_token + group * stride_scale_group, scale)


def quantize_token_groups(hidden: torch.Tensor, group: int, padded_tokens: Optional[int] = None,
                          token_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_token_groups_reference`` as one Triton launch (CUDA, or the interpreter).

    ``padded_tokens``: the outputs have that many rows, those past ``hidden``'s zeros with
    scale 1. ``token_major_scales``: the scales ``[tokens, groups]`` are stored token-major
    (stride ``[1, tokens]``), the layout cuBLASLt's block-wise mode reads."""
    tokens, features = hidden.shape
    rows = tokens if padded_tokens is None else padded_tokens
    groups = -(-features // group)
    quantized = torch.empty(rows, features, dtype=FP8_DTYPE, device=hidden.device)
    if token_major_scales:
        scales = torch.empty(groups, rows, dtype=torch.float32, device=hidden.device).t()
    else:
        scales = torch.empty(rows, groups, dtype=torch.float32, device=hidden.device)
    if rows > tokens:
        quantized[tokens:].zero_()
        scales[tokens:].fill_(1.0)
    if tokens:
        block = triton.next_power_of_2(group)
        warps = 4 if block <= 2048 else 8 if block <= 8192 else 16  # a whole 14336-feature token per program
        _quantize_groups_kernel[(tokens, groups)](hidden, hidden.stride(0), quantized, scales, features,
                                                  scales.stride(0), scales.stride(1), GROUP=group, BLOCK=block,
                                                  num_warps=warps)
    return quantized, scales


def quantize_activation(hidden: torch.Tensor, layout: ActivationLayout) -> QuantizedActivation:
    """``hidden [M, K]`` quantized in ``layout`` (``quantize_token_groups``): what a fused
    producer kernel writes instead of ``hidden``."""
    tokens, features = hidden.shape
    values, scales = quantize_token_groups(hidden, layout.group_size(features), layout.rows(tokens),
                                           token_major_scales=layout.token_major_scales)
    return QuantizedActivation(values, scales, tokens, layout, hidden.dtype)


BLOCK_WISE = 128  # cuBLASLt's block-wise mode: 1x128 activation groups, 128x128 weight blocks
# The activations cuBLASLt's block-wise mode reads: 1x128 groups, token-major scales, rows
# padded to a multiple of 4.
BLOCK_WISE_LAYOUT = ActivationLayout(group=BLOCK_WISE, row_multiple=4, token_major_scales=True)
PER_TOKEN_LAYOUT = ActivationLayout()
# Row-wise products accumulate without periodic promotion to float32 unless
# TANDEM_FP8_FULL_ACCUMULATION=1 (fp8_gemm's products only; the CPU reference is exact either way).
FAST_ACCUMULATION = os.environ.get("TANDEM_FP8_FULL_ACCUMULATION", "") != "1"


def block_wise_scales(weight_scale: torch.Tensor, group: Optional[int]) -> Optional[torch.Tensor]:
    """A weight's scales in the layout ``torch._scaled_mm``'s block-wise mode reads — ``[K/128,
    N/128]``, K-major (stride ``[1, K/128]``) — or None where that mode cannot take them: a
    group other than 128, N not whole blocks, K/128 not a multiple of 4 (cuBLASLt pads the
    scales' K to 4), or row-block scales that differ within a 128-row block (a tensor-parallel
    shard cut inside a block). Reads the scales back (host synchronisation): call it at load or
    on an eager step, never during a CUDA graph capture."""
    rows, columns = weight_scale.shape
    if group != BLOCK_WISE or rows % BLOCK_WISE or columns % 4:
        return None
    blocks = weight_scale[::BLOCK_WISE].contiguous()
    if not torch.equal(blocks.repeat_interleave(BLOCK_WISE, dim=0), weight_scale):
        return None
    return blocks.t()


def block_wise_scaled_mm_available(device: torch.device) -> bool:
    """Whether this GPU and torch run ``block_wise_scaled_mm`` (SM90 with cuBLASLt >= 12.9): tried
    once per device on a small product."""
    return device.type == "cuda" and _block_wise_probe(device.index if device.index is not None else
                                                        torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _block_wise_probe(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    device = torch.device("cuda", device_index)
    weight = torch.zeros(BLOCK_WISE, 4 * BLOCK_WISE, dtype=FP8_DTYPE, device=device)
    scale = torch.ones(BLOCK_WISE, 4, device=device)
    try:
        block_wise_scaled_mm(torch.zeros(4, 4 * BLOCK_WISE, dtype=torch.bfloat16, device=device), weight,
                             block_wise_scales(scale, BLOCK_WISE))
    except (RuntimeError, ValueError):
        return False
    return True


def block_wise_scaled_mm(hidden: torch.Tensor, weight: torch.Tensor, weight_blocks: torch.Tensor) -> torch.Tensor:
    """``fp8_linear`` with 128x128 block scales through cuBLASLt: the activations quantized per
    1x128 group (``BLOCK_WISE_LAYOUT``), then ``torch._scaled_mm`` block-wise; ``weight_blocks``
    from ``block_wise_scales``."""
    return block_wise_product(quantize_activation(hidden, BLOCK_WISE_LAYOUT), weight, weight_blocks)


def block_wise_product(activation: QuantizedActivation, weight: torch.Tensor,
                       weight_blocks: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm`` block-wise of an activation in ``BLOCK_WISE_LAYOUT``; its padded rows
    are cut off."""
    output = torch._scaled_mm(activation.values, weight.t(), scale_a=activation.scales, scale_b=weight_blocks,
                              out_dtype=torch.bfloat16)
    output = output[:activation.tokens] if output.shape[0] != activation.tokens else output
    return output if activation.dtype == torch.bfloat16 else output.to(activation.dtype)


def row_wise_product(activation: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                     fast_accumulation: bool = FAST_ACCUMULATION) -> torch.Tensor:
    """``torch._scaled_mm`` with row-wise scales: a per-token activation times a per-row weight
    (``fast_accumulation``: the engine's setting unless a benchmark asks for the other)."""
    # Row-wise scaling writes bfloat16 only. Fast accumulation: the tensor cores' FP8 sums are not
    # promoted to float32 every few k-steps (what vLLM's and TensorRT-LLM's FP8 GEMMs run).
    output = torch._scaled_mm(activation.values, weight.t(), scale_a=activation.scales,
                              scale_b=weight_scale.reshape(1, -1), out_dtype=torch.bfloat16,
                              use_fast_accum=fast_accumulation)
    return output if activation.dtype == torch.bfloat16 else output.to(activation.dtype)


def _expand_columns(scale: torch.Tensor, group: int, features: int) -> torch.Tensor:
    return scale.repeat_interleave(group, dim=1)[:, :features]


def block_scaled_matmul_reference(quantized: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                                  weight_scale: torch.Tensor, group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``(quantized * scales) @ (weight * weight_scale).T`` in float32, each scale covering
    ``group`` consecutive features (the last group may be partial)."""
    features = quantized.shape[1]
    activations = quantized.float() * _expand_columns(scales, group, features)
    weights = weight.float() * _expand_columns(weight_scale.float(), group, features)
    return (activations @ weights.t()).to(out_dtype)


@jit(do_not_specialize=["M"])  # the step's token count
def _block_scaled_gemm(a, a_scale, b, b_scale, c, M, N, stride_a, stride_b, stride_c,
                       K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       SWIZZLE_M: tl.constexpr, UPCAST: tl.constexpr):
    """``c[M, N] = sum over K groups g of (a[:, g] @ b[:, g].T) * a_scale[:, g] * b_scale[:, g]``:
    a ``[M, K]`` and b ``[N, K]`` FP8 (row-major), a_scale ``[M, G]``, b_scale ``[N, G]``
    float32 (``G = ceil(K / GROUP)``). ``UPCAST``: multiply in float32 (the interpreter's path).

    One program per output tile, numbered down ``SWIZZLE_M`` row tiles before moving to the
    next column tile, so programs running together share their weight tiles in L2."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    column_tiles = tl.cdiv(N, BLOCK_N)
    program = tl.program_id(0)
    band = program // (SWIZZLE_M * column_tiles)
    first_row_tile = band * SWIZZLE_M
    band_rows = tl.minimum(row_tiles - first_row_tile, SWIZZLE_M)
    row_tile = first_row_tile + (program % (SWIZZLE_M * column_tiles)) % band_rows
    column_tile = (program % (SWIZZLE_M * column_tiles)) // band_rows
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, GROUP)
    row_mask = rows < M
    column_mask = columns < N
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale_columns = (K + GROUP - 1) // GROUP
    # The scales are loaded one group ahead: the tiles are software-pipelined by the compiler,
    # but a load waited on in the step that issues it would stall every step.
    a_scales = tl.load(a_scale + rows * scale_columns, mask=row_mask, other=0.0)
    b_scales = tl.load(b_scale + columns * scale_columns, mask=column_mask, other=0.0)
    for start in range(0, K, GROUP):
        following = start // GROUP + 1
        next_a_scales = tl.load(a_scale + rows * scale_columns + following, mask=row_mask & (following < scale_columns),
                                other=0.0)
        next_b_scales = tl.load(b_scale + columns * scale_columns + following,
                                mask=column_mask & (following < scale_columns), other=0.0)
        k = start + inner
        k_mask = k < K
        a_tile = tl.load(a + rows[:, None] * stride_a + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_tile = tl.load(b + columns[None, :] * stride_b + k[:, None], mask=column_mask[None, :] & k_mask[:, None],
                         other=0.0)
        if UPCAST:
            partial = tl.dot(a_tile.to(tl.float32), b_tile.to(tl.float32))
        else:
            partial = tl.dot(a_tile, b_tile)
        accumulator += partial * a_scales[:, None] * b_scales[None, :]
        a_scales, b_scales = next_a_scales, next_b_scales
    tl.store(c + rows[:, None] * stride_c + columns[None, :], accumulator.to(c.dtype.element_ty),
             mask=row_mask[:, None] & column_mask[None, :])


@dataclass(frozen=True)
class BlockGemmConfig:
    block_m: int
    block_n: int
    warps: int
    stages: int
    swizzle_m: int = 8  # row tiles walked before the next column tile (L2 reuse of weight tiles)


def block_gemm_config(tokens: int) -> BlockGemmConfig:
    """Few-token products (decode) are weight-read bound: small M tiles and more programs
    along N. Large ones: 64x128 tiles of one warp group, 3 stages. Each K group's product
    is scaled before it is added, so a program waits for its tensor-core product every
    step; smaller programs (three resident per SM: 3 x 3 stages x 24 KB of FP8 tiles) let one
    program's products overlap another's scaling, which 128x128 tiles of 8 warps (two per SM)
    did not (0.3 of the FP8 roofline at M = 4096 on an H100)."""
    if tokens <= 16:
        return BlockGemmConfig(16, 32, 4, 3)
    if tokens <= 64:
        return BlockGemmConfig(64, 64, 4, 3)
    return BlockGemmConfig(64, 128, 4, 3)


def block_scaled_matmul(quantized: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                        weight_scale: torch.Tensor, group: int, out_dtype: torch.dtype,
                        config: Optional[BlockGemmConfig] = None) -> torch.Tensor:
    """``block_scaled_matmul_reference`` as one Triton launch (``group`` ≥ 16, a power of two).
    ``config``: tiles other than ``block_gemm_config``'s (benchmarks, tests)."""
    tokens, features = quantized.shape
    rows = weight.shape[0]
    output = torch.empty(tokens, rows, dtype=out_dtype, device=quantized.device)
    if tokens == 0:
        return output
    config = config or block_gemm_config(tokens)
    grid = (triton.cdiv(tokens, config.block_m) * triton.cdiv(rows, config.block_n),)
    interpreted = not quantized.is_cuda
    _block_scaled_gemm[grid](quantized, scales, weight, weight_scale, output, tokens, rows,
                             quantized.stride(0), weight.stride(0), output.stride(0), K=features, GROUP=group,
                             BLOCK_M=config.block_m, BLOCK_N=config.block_n, SWIZZLE_M=config.swizzle_m,
                             UPCAST=interpreted, num_warps=config.warps, num_stages=config.stages)
    return output


def fp8_linear_reference(hidden: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         group: Optional[int]) -> torch.Tensor:
    """What ``fp8_linear`` computes, in plain PyTorch (float32 accumulation)."""
    features = hidden.shape[-1]
    size = features if group is None else group
    quantized, scales = quantize_token_groups_reference(hidden, size)
    return block_scaled_matmul_reference(quantized, scales, weight, weight_scale, size, hidden.dtype)


def takes_scaled_mm(weight: torch.Tensor) -> bool:
    """``torch._scaled_mm`` wants 16-aligned inner and output sizes."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def takes_block_scaled_gemm(group: int) -> bool:
    """Whether the Triton block-scaled GEMM takes groups of ``group`` features."""
    return group >= 16 and group & (group - 1) == 0


def fp8_linear_layout(weight: torch.Tensor, group: Optional[int]) -> Optional[ActivationLayout]:
    """The activation layout ``fp8_linear`` quantizes into on CUDA for this weight (None: its
    PyTorch reference runs)."""
    if group is None:
        return PER_TOKEN_LAYOUT if takes_scaled_mm(weight) else None
    return ActivationLayout(group=group) if takes_block_scaled_gemm(group) else None


def fp8_linear(hidden: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               group: Optional[int]) -> torch.Tensor:
    """``hidden [M, K]`` (16-bit or float32) @ the FP8 weight's transpose → ``[M, N]`` in
    ``hidden.dtype``. See the module docstring for the paths."""
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if hidden.shape[0] == 0:
        return hidden.new_empty(0, weight.shape[0])
    layout = fp8_linear_layout(weight, group) if hidden.is_cuda else None
    if layout is None:
        return fp8_linear_reference(hidden, weight, weight_scale, group)
    return fp8_product(quantize_activation(hidden, layout), weight, weight_scale)


def fp8_product(activation: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The product of an activation quantized in ``fp8_linear_layout(weight, group)`` (by a
    fused producer, or by ``fp8_linear``) with the FP8 weight, in ``activation.dtype``."""
    if activation.tokens == 0:
        return torch.empty(0, weight.shape[0], dtype=activation.dtype, device=weight.device)
    if activation.layout.group is None:
        return row_wise_product(activation, weight, weight_scale)
    return block_scaled_matmul(activation.values, activation.scales, weight, weight_scale, activation.layout.group,
                               activation.dtype)
