"""An activation already quantized to FP8 for the matrix product that reads it, and what the
kernels that produce activations share to write one.

A kernel that computes an activation (RMSNorm, SiLU·mul) can write it as FP8 plus scales
instead of 16-bit values, in the layout the FP8 product that consumes it reads
(``ActivationLayout``), sparing that product's separate quantization pass: one read and one
write of the 16-bit activation less.

The fused kernels quantize the 16-bit value the unfused kernel would have stored (rounded to
the activation dtype first, then ``scale = max|x| / 448`` per group, floored at
``MINIMUM_SCALE``), so their FP8 values and scales equal, bit for bit, those of the unfused
kernel followed by ``quantize_token_groups``: enabling the fusion does not move any output.
(vLLM quantizes the float32 value before rounding; that is closer to the exact activation by
at most one bfloat16 rounding step, but differs from the unfused path.)

    values  [rows, K] float8_e4m3fn   rows = tokens, or tokens rounded up to a multiple of
                                      ``row_multiple``; padded rows are zeros
    scales  [rows, G] float32         G = 1 (per token) or ceil(K / group); token-major
                                      (stride [1, rows]) where ``token_major_scales``; padded
                                      rows have scale 1
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tandem.kernels.triton_support import jit, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# A floor under every computed scale, so that an all-zero row quantizes to zeros (not NaN).
MINIMUM_SCALE = 1e-12


@dataclass(frozen=True)
class ActivationLayout:
    """How an FP8 product wants its activations quantized: per token (``group=None``) or per
    ``group`` consecutive features of a token; ``row_multiple``: rows padded to a multiple of
    it; ``token_major_scales``: scales stored token-major (cuBLASLt's block-wise mode reads
    both)."""

    group: Optional[int] = None
    row_multiple: int = 1
    token_major_scales: bool = False

    def group_size(self, features: int) -> int:
        return features if self.group is None else self.group

    def rows(self, tokens: int) -> int:
        return -(-tokens // self.row_multiple) * self.row_multiple


@dataclass(frozen=True)
class QuantizedActivation:
    """``tokens`` activations of ``values.shape[1]`` features as FP8 ``values`` and float32
    ``scales`` in ``layout`` (module docstring); ``dtype``: the 16-bit type the activation
    would have had, which the product returns. Produced by a fused kernel for exactly one
    consumer, which owns it from then on (nothing else reads it)."""

    values: torch.Tensor
    scales: torch.Tensor
    tokens: int
    layout: ActivationLayout
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The shape of the activation it stands for: ``[tokens, features]``."""
        return torch.Size((self.tokens, self.values.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dequantize(self) -> torch.Tensor:
        """The activation as ``values * scales`` in float32 (tests and fallbacks)."""
        features = self.values.shape[1]
        group = self.layout.group_size(features)
        scales = self.scales[:self.tokens].repeat_interleave(group, dim=1)[:, :features]
        return self.values[:self.tokens].float() * scales


def quantize_token_groups_reference(hidden: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [M, K]`` in groups of ``group`` consecutive features per token (``group = K``:
    per token) → ``(fp8 [M, K], scale [M, ceil(K/group)] float32)``."""
    tokens, features = hidden.shape
    groups = -(-features // group)
    padded = hidden.float()
    if groups * group != features:
        padded = torch.nn.functional.pad(padded, (0, groups * group - features))
    grouped = padded.view(tokens, groups, group)
    scale = (grouped.abs().amax(dim=-1) / FP8_MAX).clamp(min=MINIMUM_SCALE)
    quantized = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(tokens, groups * group)[:, :features].contiguous(), scale


def quantize_reference(hidden: torch.Tensor, layout: ActivationLayout) -> QuantizedActivation:
    """``hidden [T, K]`` quantized into ``layout`` in plain PyTorch (padded rows zero, scale 1):
    the reference of every fused producer's quantized output."""
    tokens, features = hidden.shape
    values, scales = quantize_token_groups_reference(hidden, layout.group_size(features))
    out = allocate_quantized(tokens, features, layout, hidden.dtype, hidden.device)
    out.values[:tokens] = values
    out.scales[:tokens] = scales
    return out


def allocate_quantized(tokens: int, features: int, layout: ActivationLayout, dtype: torch.dtype,
                       device: torch.device) -> QuantizedActivation:
    """Empty outputs for ``tokens`` rows in ``layout``, padded rows already zero with scale 1
    (two small fills, only where rows are padded). The kernel writing the first ``tokens`` rows
    owns the result."""
    rows = layout.rows(tokens)
    groups = -(-features // layout.group_size(features))
    values = torch.empty(rows, features, dtype=FP8_DTYPE, device=device)
    if layout.token_major_scales:
        scales = torch.empty(groups, rows, dtype=torch.float32, device=device).t()
    else:
        scales = torch.empty(rows, groups, dtype=torch.float32, device=device)
    if rows > tokens:
        values[tokens:].zero_()
        scales[tokens:].fill_(1.0)
    return QuantizedActivation(values, scales, tokens, layout, dtype)


def tile_block(features: int, layout: ActivationLayout) -> int:
    """The column block a fused kernel covers a row with: a power of two holding every feature
    and whole groups."""
    block = triton.next_power_of_2(features)
    return block if layout.group is None else max(block, layout.group)


@jit
def _fp8_scale(largest):
    """The scale of values whose largest magnitude is ``largest``: ``max(largest / 448, 1e-12)``
    (an IEEE-rounded division: see ``quantize_tile``)."""
    return tl.maximum(tl.math.div_rn(largest, 448.0), 1e-12)


@jit
def _fp8_values(values, scales):
    """``values / scales`` (IEEE-rounded) clamped to ±448: float32, ready for the FP8 cast."""
    return tl.clamp(tl.math.div_rn(values, scales), -448.0, 448.0)


@jit
def quantize_tile(values, ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """``values [ROWS, BLOCK]`` float32 (masked columns zero) in groups of ``GROUP`` columns →
    ``(quantized [ROWS, BLOCK] float32, already clamped to ±448, scales [ROWS, BLOCK // GROUP])``
    with ``scale = max(max|group| / 448, 1e-12)``, the arithmetic of
    ``fp8_gemm._quantize_groups_kernel``. Both divide with IEEE rounding (``div_rn``): a plain
    ``/`` compiles to an approximate division, and to a multiplication by the reciprocal where
    the divisor is one value per program, so two kernels computing the same quotients could
    round them differently (and differ from PyTorch's)."""
    grouped = tl.reshape(values, (ROWS, BLOCK // GROUP, GROUP))
    scales = _fp8_scale(tl.max(tl.abs(grouped), axis=2))
    quantized = _fp8_values(grouped, scales[:, :, None])
    return tl.reshape(quantized, (ROWS, BLOCK)), scales


@jit
def store_quantized_tile(values, rows, columns, num_rows, features, quantized_ptr, scales_ptr,
                         scale_token_stride, scale_group_stride,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Quantize ``values [ROWS, BLOCK]`` (rows ``rows``, columns ``columns``: the first column a
    multiple of ``GROUP``) and store the FP8 values into dense ``quantized [num_rows, features]``
    and the scales, one per row and group, through their strides."""
    quantized, scales = quantize_tile(values, ROWS, BLOCK, GROUP)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (columns < features)[None, :]
    dense = rows.to(tl.int64)[:, None] * features + columns[None, :]
    tl.store(quantized_ptr + dense, quantized.to(quantized_ptr.dtype.element_ty), mask=mask)
    groups = tl.min(columns, axis=0) // GROUP + tl.arange(0, BLOCK // GROUP)
    scale_mask = row_mask[:, None] & (groups * GROUP < features)[None, :]
    scale_offsets = rows.to(tl.int64)[:, None] * scale_token_stride + groups[None, :] * scale_group_stride
    tl.store(scales_ptr + scale_offsets, scales, mask=scale_mask)
