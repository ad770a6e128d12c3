"""The product of a linear layer whose weight is FP8 (see ``convert.py``)."""
from __future__ import annotations

from typing import Optional

import torch

from tandem.kernels.fp8_gemm import fp8_linear


class Fp8LinearMethod:
    """``hidden @ (weight * weight_scale).T + bias`` with the activations quantized on the fly,
    per token (``block_columns=None``) or per ``block_columns`` features of a token."""

    def __init__(self, block_columns: Optional[int]) -> None:
        self.block_columns = block_columns

    def apply(self, module, hidden: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        output = fp8_linear(flat, module.weight, module.weight_scale, self.block_columns)
        if bias is not None:
            output = output + bias
        return output.reshape(*hidden.shape[:-1], output.shape[-1])
