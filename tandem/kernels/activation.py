"""Gated activations: ``x [..., 2I]`` (gate, then up, as a stacked ``gate_up_proj`` writes
them) to ``activation(x[..., :I]) * x[..., I:]``.

As in the unfused ``activation(gate) * up``, the activation is computed in float32 and rounded
to the input dtype, then multiplied by ``up`` and rounded again. Activations: ``silu``,
``gelu_tanh`` (``gelu(approximate="tanh")``, Gemma's ``gelu_pytorch_tanh``) and ``gelu``
(exact, erf).

``silu_and_mul_quantized`` (and ``gated_activation_quantized``) write the product as FP8 with
scales in an ``ActivationLayout`` instead (``QuantizedActivation``): the 16-bit product the
unfused kernel stores, quantized as ``quantize_token_groups`` would (``fp8_activation``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.kernels.fp8_activation import (ActivationLayout, QuantizedActivation, _fp8_scale, _fp8_values,
                                           allocate_quantized, quantize_reference, store_quantized_tile, tile_block)
from tandem.kernels.triton_support import (early_launch_arguments, jit, launch_dependents, tl, triton,
                                           wait_for_producer)

SILU, GELU_TANH, GELU = 0, 1, 2
BLOCK = 1024


@jit
def activate(gate, gelu_tanh_scale, ACTIVATION: tl.constexpr):
    """``activation(gate)`` in float32."""
    if ACTIVATION == 0:  # SILU
        activated = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 1:  # GELU_TANH: 0.5 g (1 + tanh(u)) == g / (1 + exp(-2u))
        inner = gelu_tanh_scale * (gate + 0.044715 * gate * gate * gate)
        activated = gate / (1.0 + tl.exp(-2.0 * inner))
    else:  # GELU
        activated = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    return activated


@jit
def _gated_activation_kernel(x_ptr, out_ptr, intermediate_size, x_row_stride, gelu_tanh_scale,
                             ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program ``(row, block)`` writes ``BLOCK`` columns of dense ``out [rows, I]``. ``PDL``:
    launched early (``triton_support``)."""
    launch_dependents(PDL)
    wait_for_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    product = _gated_product(x_ptr + row * x_row_stride, columns, intermediate_size, gelu_tanh_scale, dtype,
                             ACTIVATION)
    tl.store(out_ptr + row * intermediate_size + columns, product.to(dtype), mask=columns < intermediate_size)


@jit
def _gated_product(row_ptr, columns, intermediate_size, gelu_tanh_scale, dtype: tl.constexpr,
                   ACTIVATION: tl.constexpr):
    """``activation(gate) * up`` of a row's ``columns`` as ``_gated_activation_kernel`` rounds
    it (each factor and the product in ``dtype``), in float32; masked columns are 0."""
    mask = columns < intermediate_size
    gate = tl.load(row_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + intermediate_size + columns, mask=mask, other=0.0).to(tl.float32)
    activated = activate(gate, gelu_tanh_scale, ACTIVATION).to(dtype).to(tl.float32)
    return (activated * up).to(dtype).to(tl.float32)


# the step's token count, and the token-major scales' group stride (the padded token count)
@jit(do_not_specialize=["num_rows", "scale_group_stride"])
def _gated_activation_quantize_kernel(x_ptr, quantized_ptr, scales_ptr, num_rows, intermediate_size, x_row_stride,
                                      scale_token_stride, scale_group_stride, gelu_tanh_scale,
                                      ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """``_gated_activation_kernel``'s product, quantized: program ``(row, block)`` writes
    ``BLOCK`` columns (whole groups of ``GROUP``; per token: the whole row) of dense FP8
    ``quantized [rows, I]`` and their scales."""
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    product = _gated_product(x_ptr + row.to(tl.int64) * x_row_stride, columns, intermediate_size, gelu_tanh_scale,
                             x_ptr.dtype.element_ty, ACTIVATION)
    store_quantized_tile(tl.reshape(product, (1, BLOCK)), row + tl.arange(0, 1), columns, num_rows,
                         intermediate_size, quantized_ptr, scales_ptr, scale_token_stride, scale_group_stride,
                         1, BLOCK, GROUP)


@jit
def _gated_activation_quantize_rows_kernel(x_ptr, quantized_ptr, scales_ptr, intermediate_size,
                                           x_row_stride, scale_token_stride, gelu_tanh_scale,
                                           ACTIVATION: tl.constexpr, CHUNK: tl.constexpr):
    """``_gated_activation_quantize_kernel``'s per-token result for long rows, bit for bit, in
    ``CHUNK``-column steps: program ``row`` finds the row's largest ``|product|``, then computes
    the products again (reading the row from L2 this time) and stores them quantized with the
    row's scale. A whole 14,336-feature row held at once takes a program so many registers that
    an SM holds one and waits on its loads; in chunks of 2,048 the activation computed twice
    costs less than that wait (H100, 16,384 tokens: 559 against 694 us, 0.71 of the copy rate
    against 0.57; the unquantized activation alone takes 485)."""
    row = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    row_ptr = x_ptr + row.to(tl.int64) * x_row_stride
    largest = tl.zeros((CHUNK,), dtype=tl.float32)
    for start in range(0, intermediate_size, CHUNK):
        product = _gated_product(row_ptr, start + tl.arange(0, CHUNK), intermediate_size, gelu_tanh_scale, dtype,
                                 ACTIVATION)
        largest = tl.maximum(largest, tl.abs(product))
    scale = _fp8_scale(tl.max(largest, axis=0))
    out_ptr = quantized_ptr + row.to(tl.int64) * intermediate_size
    for start in range(0, intermediate_size, CHUNK):
        columns = start + tl.arange(0, CHUNK)
        product = _gated_product(row_ptr, columns, intermediate_size, gelu_tanh_scale, dtype, ACTIVATION)
        tl.store(out_ptr + columns, _fp8_values(product, scale).to(quantized_ptr.dtype.element_ty),
                 mask=columns < intermediate_size)
    tl.store(scales_ptr + row * scale_token_stride, scale)


def _gated_activation(x: torch.Tensor, activation: int) -> torch.Tensor:
    """One launch; returns a new contiguous ``[..., I]`` tensor. ``x``'s last dimension must be
    even; rows are read through their stride. No host synchronisation (CUDA-graph capturable)."""
    if x.shape[-1] % 2:
        raise ValueError(f"gated activation: last dimension {x.shape[-1]} of x must be even (gate, up)")
    intermediate_size = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], intermediate_size, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(intermediate_size))
    grid = (rows.shape[0], triton.cdiv(intermediate_size, block))
    _gated_activation_kernel[grid](rows, out, intermediate_size, rows.stride(0), math.sqrt(2.0 / math.pi),
                                   ACTIVATION=activation, BLOCK=block,
                                   num_warps=4 if block >= 512 else 1, **early_launch_arguments(rows, rows.shape[0]))
    return out


# Columns one program of the grouped quantized kernel covers (whole groups).
QUANTIZED_GROUP_BLOCK = 1024
# Per-token scales on rows longer than this: the two-pass kernel, in chunks of this many columns.
ROW_CHUNK = 2048
ROW_CHUNK_WARPS = 16


def _warps(block: int) -> int:
    """Warps for a program of ``block`` columns: a whole 14336-feature token takes 16. Past
    16,384 columns (a whole 18,944-feature token, Qwen2.5-7B) 32: with 16, gate and up alone
    take 127 registers a thread (one program an SM), and at 65,536 they spill (H100, ptxas)."""
    return 1 if block < 512 else 4 if block <= 2048 else 8 if block <= 8192 else 16 if block <= 16384 else 32


def gated_activation_quantized(x: torch.Tensor, activation: int, layout: ActivationLayout) -> QuantizedActivation:
    """``_gated_activation``'s product of ``x [T, 2I]`` as a ``QuantizedActivation`` in
    ``layout``; one launch (plus the padded rows' fills). Capturable in a CUDA graph."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"gated activation: x must be [T, 2I] (gate, up), got {tuple(x.shape)}")
    tokens, intermediate_size = x.shape[0], x.shape[1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = allocate_quantized(tokens, intermediate_size, layout, x.dtype, x.device)
    if tokens == 0 or intermediate_size == 0:
        return out
    block = tile_block(intermediate_size, layout)
    if layout.group is None and block > ROW_CHUNK:
        _gated_activation_quantize_rows_kernel[(tokens,)](
            x, out.values, out.scales, intermediate_size, x.stride(0), out.scales.stride(0),
            math.sqrt(2.0 / math.pi), ACTIVATION=activation, CHUNK=ROW_CHUNK, num_warps=ROW_CHUNK_WARPS)
        return out
    if layout.group is not None:
        block = max(layout.group, min(block, QUANTIZED_GROUP_BLOCK))
    group = layout.group_size(block)
    _gated_activation_quantize_kernel[(tokens, triton.cdiv(intermediate_size, block))](
        x, out.values, out.scales, tokens, intermediate_size, x.stride(0), out.scales.stride(0),
        out.scales.stride(1), math.sqrt(2.0 / math.pi), ACTIVATION=activation, BLOCK=block, GROUP=group,
        num_warps=_warps(block))
    return out


def silu_and_mul_quantized(x: torch.Tensor, layout: ActivationLayout) -> QuantizedActivation:
    """The Triton kernel: ``silu(x[..., :I]) * x[..., I:]`` as FP8 in ``layout``."""
    return gated_activation_quantized(x, SILU, layout)


def silu_and_mul_quantized_reference(x: torch.Tensor, layout: ActivationLayout) -> QuantizedActivation:
    """``silu_and_mul_quantized`` in plain PyTorch: the 16-bit product, then quantized."""
    return quantize_reference(silu_and_mul_reference(x), layout)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel: ``silu(x[..., :I]) * x[..., I:]``."""
    return _gated_activation(x, SILU)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel: ``gelu_tanh(x[..., :I]) * x[..., I:]``. Computed as
    ``g * sigmoid(2u)``, equal to ``0.5 * g * (1 + tanh(u))`` up to float32 rounding."""
    return _gated_activation(x, GELU_TANH)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The Triton kernel: ``gelu(x[..., :I]) * x[..., I:]`` (exact, erf)."""
    return _gated_activation(x, GELU)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul`` in plain PyTorch; any device."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh_and_mul`` in plain PyTorch; any device."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``gelu_and_mul`` in plain PyTorch; any device."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate) * up
