"""The product of a linear layer whose weight is FP8 (see ``convert.py``)."""
from __future__ import annotations

from typing import Optional

import torch

from tandem.kernels.fp8_activation import ActivationLayout, QuantizedActivation
from tandem.kernels.fp8_gemm import (BLOCK_WISE_LAYOUT, block_wise_product, block_wise_scaled_mm,
                                     block_wise_scaled_mm_available, block_wise_scales, fp8_linear, fp8_linear_layout,
                                     fp8_product)
from tandem.kernels.fp8_weight_only import MAX_TOKENS, takes_gemv, weight_only_matmul
from tandem.kernels.gemv import gemv


class Fp8LinearMethod:
    """``hidden @ (weight * weight_scale).T + bias``.

    By token count, which is fixed for each captured CUDA graph (a decode batch size), so each
    graph holds the kernel its size takes:

    - on CUDA, up to ``MAX_TOKENS`` tokens (decode): 16-bit activations times the FP8 weight
      dequantized in registers (``weight_only_matmul``): bound by reading the weight, with no
      activation quantization launch;
    - 128x128 block weights on an H100-class GPU above that: cuBLASLt's block-wise
      ``torch._scaled_mm`` (``block_wise_scaled_mm``), where the scales are whole blocks;
    - otherwise: the activations quantized on the fly, per token (``block_columns=None``) or
      per ``block_columns`` features of a token, and FP8 tensor-core products (``fp8_linear``;
      on a CPU its PyTorch reference, which is what the format prescribes and what
      ``transformers`` computes for compressed-tensors checkpoints).

    ``hidden`` may also arrive already quantized (``QuantizedActivation``), written by the
    kernel that produced it in the layout ``input_layout`` named for this token count; it goes
    straight to the FP8 product."""

    def __init__(self, block_columns: Optional[int]) -> None:
        self.block_columns = block_columns
        self.weight_only_tokens = MAX_TOKENS  # (either scale layout)

    def _block_wise_scales(self, module) -> Optional[torch.Tensor]:
        """The module's block scales in cuBLASLt's layout (``block_wise_scales``), made on its
        first eager product and kept (``module.weight_block_wise_scales``); None where the weight
        or the GPU cannot take that path, or while a CUDA graph is being captured before it
        was made (that graph keeps the Triton GEMM)."""
        if not hasattr(module, "weight_block_wise_scales"):
            if self.block_columns is None or not module.weight.is_cuda or torch.cuda.is_current_stream_capturing():
                return None
            usable = block_wise_scaled_mm_available(module.weight.device)
            module.weight_block_wise_scales = (block_wise_scales(module.weight_scale, self.block_columns)
                                               if usable else None)
        return module.weight_block_wise_scales

    def input_layout(self, module, tokens: int, device: torch.device) -> Optional[ActivationLayout]:
        """The layout this product quantizes ``tokens`` activations into on ``device``, or None
        where it takes them 16-bit (CPU, the weight-only decode sizes, the PyTorch reference).
        The token count is fixed per CUDA graph, so a producer asking at capture gets the
        answer every replay needs."""
        if device.type != "cuda" or tokens <= self.weight_only_tokens:
            return None
        if self._block_wise_scales(module) is not None:
            return BLOCK_WISE_LAYOUT
        return fp8_linear_layout(module.weight, self.block_columns)

    def apply(self, module, hidden, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(hidden, QuantizedActivation):
            output = self._apply_quantized(module, hidden)
        else:
            output = self._apply_16_bit(module, hidden)
        if bias is not None:
            output = output + bias
        return output.reshape(*hidden.shape[:-1], output.shape[-1])

    def gated_silu(self, module, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` of a stacked ``[gate; up]`` FP8 projection in the product's own
        launch where ``weight_only_matmul`` takes ``gemv`` (``linear.gated_silu_product``);
        None elsewhere."""
        tokens = hidden.shape[0]
        if not (hidden.is_cuda and tokens <= self.weight_only_tokens and takes_gemv(tokens) and hidden.stride(-1) == 1):
            return None
        return gemv(hidden, module.weight, module.weight_scale, self.block_columns, gated=True)

    def _apply_16_bit(self, module, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        if flat.is_cuda and 0 < flat.shape[0] <= self.weight_only_tokens:
            return weight_only_matmul(flat, module.weight, module.weight_scale, self.block_columns)
        if flat.is_cuda and self._block_wise_scales(module) is not None:
            return block_wise_scaled_mm(flat, module.weight, module.weight_block_wise_scales)
        return fp8_linear(flat, module.weight, module.weight_scale, self.block_columns)

    def _apply_quantized(self, module, activation: QuantizedActivation) -> torch.Tensor:
        expected = self.input_layout(module, activation.tokens, activation.device)
        if activation.layout != expected:
            raise ValueError(f"an FP8 activation in layout {activation.layout} reached a product that reads "
                             f"{expected} at {activation.tokens} tokens")
        if expected == BLOCK_WISE_LAYOUT:
            return block_wise_product(activation, module.weight, module.weight_block_wise_scales)
        return fp8_product(activation, module.weight, module.weight_scale)
