"""RMSNorm with an optional fused residual add, over the last dimension.

Two weight conventions, chosen by keyword:

- ``cast_before_weight=True`` (Llama, Qwen, DeepSeek):
  ``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``;
- ``cast_before_weight=False, weight_offset=1.0`` (Gemma, Qwen3-Next):
  ``(x_f32 * rsqrt(mean(x_f32^2) + eps) * (weight_offset + weight_f32)).to(x.dtype)``.

``x`` is ``[T, D]`` (a hidden state) or ``[T, H, D]`` (per-head norm of queries or keys; each
head normalised over its ``D``); any other shape is flattened to rows of its last dimension.
With ``residual`` (same shape and dtype as ``x``), ``new_residual = x + residual`` is computed
in ``x.dtype``, as the unfused ``residual + hidden`` is, and the norm is taken of it.

With ``quantize`` (an ``ActivationLayout``; hidden states ``[T, D]`` only) the output is not
stored 16-bit but as FP8 with scales (``QuantizedActivation``): the value the 16-bit output
would have held, quantized as ``quantize_token_groups`` would quantize it (``fp8_activation``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from tandem.kernels.fp8_activation import (ActivationLayout, QuantizedActivation, allocate_quantized,
                                           quantize_reference, store_quantized_tile, tile_block)
from tandem.kernels.triton_support import (early_launch_arguments, jit, launch_dependents, tl, triton,
                                           wait_for_producer)

# Elements one program normalises at most (several short rows share a program).
ELEMENTS_PER_PROGRAM = 4096


class HeadNorm(NamedTuple):
    """A per-head RMSNorm handed to a kernel that applies it itself on the way (the query/key
    norm of Qwen3 and Gemma-3 inside ``rotary_kv_write.rotate_and_write_kv``): each head
    normalised over its ``D`` exactly as ``rms_norm(x, weight, eps, weight_offset=...,
    cast_before_weight=...)`` normalises it. ``weight`` is ``[D]``."""
    weight: torch.Tensor
    eps: float
    weight_offset: float = 0.0
    cast_before_weight: bool = True


def head_norm_reference(x: torch.Tensor, norm: HeadNorm) -> torch.Tensor:
    """``norm`` applied to ``x [T, H, D]`` by ``rms_norm_reference``."""
    return rms_norm_reference(x, norm.weight, norm.eps, weight_offset=norm.weight_offset,
                              cast_before_weight=norm.cast_before_weight)


# the step's token count, and token-major scales' group stride (the padded token count)
@jit(do_not_specialize=["num_rows", "scale_group_stride"])
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, scales_ptr,
                     num_rows, num_heads, dim,
                     x_token_stride, x_head_stride, residual_token_stride, residual_head_stride,
                     scale_token_stride, scale_group_stride, eps, weight_offset,
                     HAS_RESIDUAL: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr, GROUP: tl.constexpr,
                     PDL: tl.constexpr):
    """Normalises ``ROWS`` rows (row = token * num_heads + head) of ``dim`` elements each;
    ``out`` and ``new_residual`` are dense ``[num_rows, dim]``. ``QUANTIZE``: ``out`` is FP8,
    the output in groups of ``GROUP`` columns, and ``scales`` gets one scale per row and group
    (``num_heads == 1``). ``PDL``: launched early (``triton_support``): the weight is requested
    before the wait for the kernel that wrote ``x``, and the next kernel may start at once."""
    launch_dependents(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    columns = tl.arange(0, BLOCK)
    column_mask = columns < dim
    mask = (rows < num_rows)[:, None] & column_mask[None, :]
    token = (rows // num_heads).to(tl.int64)
    head = rows % num_heads
    dense = rows.to(tl.int64)[:, None] * dim + columns[None, :]
    scale = tl.load(weight_ptr + columns, mask=column_mask, other=0.0).to(tl.float32) + weight_offset
    wait_for_producer(PDL)
    x_offsets = (token * x_token_stride + head * x_head_stride)[:, None] + columns[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_offsets = (token * residual_token_stride + head * residual_head_stride)[:, None] + columns[None, :]
        residual = tl.load(residual_ptr + residual_offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + dense, x, mask=mask)
    hidden = x.to(tl.float32)
    variance = tl.sum(hidden * hidden, axis=1) / dim
    hidden = hidden * tl.math.rsqrt(variance + eps)[:, None]
    if CAST_BEFORE_WEIGHT:
        hidden = hidden.to(x_ptr.dtype.element_ty).to(tl.float32)
    out = (hidden * scale[None, :]).to(x_ptr.dtype.element_ty)
    if QUANTIZE:
        store_quantized_tile(out.to(tl.float32), rows, columns, num_rows, dim, out_ptr, scales_ptr,
                             scale_token_stride, scale_group_stride, ROWS, BLOCK, GROUP)
    else:
        tl.store(out_ptr + dense, out, mask=mask)


def as_token_head_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a ``[T, H, D]`` view (``H == 1`` for a hidden state) whose last dimension is
    contiguous; copies only when no such view exists."""
    if x.dim() == 3:
        rows = x
    elif x.dim() == 2:
        rows = x.unsqueeze(1)
    else:
        rows = x.reshape(-1, 1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch_shape(num_rows: int, dim: int, block: int) -> tuple[int, int, int]:
    """(rows per program, column block, warps) for rows of ``dim`` elements in ``block``
    columns (a power of two)."""
    rows = max(1, min(ELEMENTS_PER_PROGRAM // block, triton.next_power_of_2(num_rows)))
    return rows, block, min(16, max(1, rows * block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             residual: Optional[torch.Tensor] = None, weight_offset: float = 0.0,
             cast_before_weight: bool = True, quantize: Optional[ActivationLayout] = None):
    """The Triton kernel (one launch): ``out``, or ``(out, new_residual)`` with ``residual``.

    Returns new contiguous tensors of ``x``'s shape and dtype; reads ``x`` and ``residual``
    through their strides (the last dimension must be contiguous, else they are copied). With
    ``quantize`` (``x`` two-dimensional), ``out`` is a ``QuantizedActivation`` in that layout.
    No host synchronisation: capturable in a CUDA graph."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if quantize is not None and x.dim() != 2:
        raise ValueError(f"rms_norm: an FP8 output is for hidden states [T, D], got x {tuple(x.shape)}")
    if quantize is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        out = allocate_quantized(x.shape[0], x.shape[1], quantize, x.dtype, x.device)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() > 0:
        _launch(as_token_head_rows(x), weight, eps, out,
                None if residual is None else (as_token_head_rows(residual), new_residual),
                weight_offset, cast_before_weight)
    return out if residual is None else (out, new_residual)


def _launch(rows: torch.Tensor, weight: torch.Tensor, eps: float, out: Union[torch.Tensor, QuantizedActivation],
            residual_pair: Optional[tuple[torch.Tensor, torch.Tensor]], weight_offset: float,
            cast_before_weight: bool) -> None:
    num_tokens, num_heads, dim = rows.shape
    num_rows = num_tokens * num_heads
    quantized = isinstance(out, QuantizedActivation)
    block = tile_block(dim, out.layout) if quantized else triton.next_power_of_2(dim)
    rows_per_program, block, num_warps = _launch_shape(num_rows, dim, block)
    out_values = out.values if quantized else out
    scales = out.scales if quantized else out_values
    residual_rows, new_residual = residual_pair if residual_pair is not None else (rows, out_values)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        rows, residual_rows, weight, out_values, new_residual, scales,
        num_rows, num_heads, dim,
        rows.stride(0), rows.stride(1), residual_rows.stride(0), residual_rows.stride(1),
        scales.stride(0), scales.stride(-1), eps, weight_offset,
        HAS_RESIDUAL=residual_pair is not None, CAST_BEFORE_WEIGHT=cast_before_weight,
        ROWS=rows_per_program, BLOCK=block, QUANTIZE=quantized,
        GROUP=out.layout.group_size(block) if quantized else block, num_warps=num_warps,
        **early_launch_arguments(rows, num_tokens))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       residual: Optional[torch.Tensor] = None, weight_offset: float = 0.0,
                       cast_before_weight: bool = True, quantize: Optional[ActivationLayout] = None):
    """``rms_norm`` in plain PyTorch: the same contract, any device. With ``weight_offset == 0``
    and ``cast_before_weight`` it is, bit for bit, ``weight * normed.to(x.dtype)`` (Llama's
    ``RMSNorm``); with ``weight_offset=1.0, cast_before_weight=False`` it is Gemma's. With
    ``quantize``, that output quantized (``quantize_reference``)."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        scale = weight if weight_offset == 0 else weight.float() + weight_offset
        out = (scale * hidden.to(dtype)).to(dtype)
    else:
        out = (hidden * (weight.float() + weight_offset)).to(dtype)
    if quantize is not None:
        out = quantize_reference(out, quantize)
    return out if residual is None else (out, x)
