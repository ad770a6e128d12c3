"""Activations written already quantized for the FP8 product that reads them.

The kernel that computes an activation (an RMSNorm, SiLU·mul) can write it as FP8 plus scales
(``tandem.kernels.fp8_activation``) in the layout the FP8 product consuming it would quantize
it into, sparing that product's own quantization pass. Two roles:

- a **producer** module has an ``output_quantization`` attribute, None unless linked: an
  ``InputQuantization`` that names, per token count and device, the layout to write (None:
  write 16-bit, as always on a CPU and at the decode sizes the weight-only product serves);
- a module that holds a producer and the linear layer reading its output declares the pair in
  ``quantized_input_pairs`` (producer path → consumer path, relative to itself), only where the
  producer's output feeds that consumer and nothing else (not the residual, not a captured
  hidden state, not a second projection).

``tandem.quantization`` links every declared pair whose consumer computes in FP8 when it
converts the model; nothing else changes, so a 16-bit model and every CPU run are untouched.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from tandem.kernels.fp8_activation import ActivationLayout


class InputQuantization(Protocol):
    """What a producer asks its linked consumer."""

    def layout(self, tokens: int, device: torch.device) -> Optional[ActivationLayout]:
        """The layout to write ``tokens`` activations in on ``device``; None: 16-bit. Fixed per
        token count, so a CUDA graph captured at one token count stays valid."""


def output_layout(producer, hidden: torch.Tensor) -> Optional[ActivationLayout]:
    """The layout ``producer`` writes its output of ``hidden [T, D]`` in (None: 16-bit)."""
    quantization: Optional[InputQuantization] = getattr(producer, "output_quantization", None)
    if quantization is None or hidden.dim() != 2 or not hidden.is_cuda:
        return None
    return quantization.layout(hidden.shape[0], hidden.device)
