"""RMSNorm, computed in float32 and cast back, as the reference implementations do.

On CUDA one fused kernel (``tandem.kernels.norm``) does the residual add and the norm; elsewhere
its plain-PyTorch reference does, bit for bit as the unfused ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tandem.kernels.norm import HeadNorm, rms_norm, rms_norm_reference
from tandem.layers.quantized_input import output_layout
from tandem.parallel.shard import TensorShard


class RMSNorm(nn.Module):
    """``weight * normed.to(dtype)`` (Llama's convention). A producer of FP8 inputs
    (``tandem.layers.quantized_input``): where linked, on CUDA, its output is a
    ``QuantizedActivation`` for the FP8 projection that reads it."""

    output_quantization = None  # set by tandem.quantization where the norm feeds one FP8 projection

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor] = None,
                reduce_over: Optional[TensorShard] = None):
        """``norm(hidden)``; with ``residual``, ``(norm(hidden + residual), hidden + residual)``.
        ``hidden`` is ``[T, D]`` or ``[T, H, D]`` (per head). With ``reduce_over`` (and a
        residual), ``hidden`` is this rank's partial sum: it is summed over the shard's ranks
        first, in the same kernel as the add and the norm where the shard's peer path fuses it."""
        if reduce_over is not None and reduce_over.is_parallel:
            if residual is not None:
                fused = reduce_over.reduce_add_norm(hidden, residual, self.weight, self.variance_epsilon)
                if fused is not None:
                    return fused
            hidden = reduce_over.all_reduce(hidden)
        if not hidden.is_cuda:
            return rms_norm_reference(hidden, self.weight, self.variance_epsilon, residual=residual)
        return rms_norm(hidden, self.weight, self.variance_epsilon, residual=residual,
                        quantize=output_layout(self, hidden))

    def head_norm(self) -> HeadNorm:
        """This norm as a kernel applies it to each head of ``[T, H, D]`` itself (a per-head
        output is always 16-bit: ``output_layout`` quantizes hidden states ``[T, D]`` only)."""
        return HeadNorm(self.weight, self.variance_epsilon)
