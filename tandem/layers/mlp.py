"""The SiLU-gated MLP shared by most families; ``gate_proj``/``up_proj`` load into one
stacked matrix so the pair is one matrix product."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import StackedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = StackedLinear(hidden_size, {"gate_proj": intermediate_size,
                                                        "up_proj": intermediate_size}, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
