"""Gated activations: ``x [..., 2I]`` (gate, then up, as a stacked ``gate_up_proj`` writes
them) to ``activation(x[..., :I]) * x[..., I:]``.

As in the unfused ``activation(gate) * up``, the activation is computed in float32 and rounded
to the input dtype, then multiplied by ``up`` and rounded again. Activations: ``silu``,
``gelu_tanh`` (``gelu(approximate="tanh")``, Gemma's ``gelu_pytorch_tanh``) and ``gelu``
(exact, erf).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.kernels.triton_support import jit, tl, triton

SILU, GELU_TANH, GELU = 0, 1, 2
BLOCK = 1024


@jit
def _gated_activation_kernel(x_ptr, out_ptr, intermediate_size, x_row_stride, gelu_tanh_scale,
                             ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(row, block)`` writes ``BLOCK`` columns of dense ``out [rows, I]``."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < intermediate_size
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_row_stride + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + intermediate_size + columns, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:  # SILU
        activated = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 1:  # GELU_TANH: 0.5 g (1 + tanh(u)) == g / (1 + exp(-2u))
        inner = gelu_tanh_scale * (gate + 0.044715 * gate * gate * gate)
        activated = gate / (1.0 + tl.exp(-2.0 * inner))
    else:  # GELU
        activated = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    activated = activated.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * intermediate_size + columns, (activated * up).to(dtype), mask=mask)


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
                                   ACTIVATION=activation, BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out


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
