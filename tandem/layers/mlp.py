"""The SiLU-gated MLP shared by most families; ``gate_proj``/``up_proj`` load into one
stacked matrix so the pair is one matrix product; on CUDA ``silu(gate) * up`` is one kernel,
which writes FP8 for an FP8 ``down_proj`` where linked (``tandem.layers.quantized_input``), or,
at the decode sizes the one- and two-token product serves, the product's own epilogue."""
from __future__ import annotations

import torch
from torch import nn

from tandem.kernels.activation import silu_and_mul, silu_and_mul_quantized, silu_and_mul_reference
from tandem.layers.linear import StackedLinear, gated_silu_product
from tandem.layers.quantized_input import output_layout
from tandem.parallel.layers import RowParallelLinear
from tandem.parallel.shard import SINGLE, TensorShard


class SiluAndMul(nn.Module):
    """``silu(x[..., :I]) * x[..., I:]``; a producer of FP8 inputs (no parameters)."""

    output_quantization = None  # set by tandem.quantization where an FP8 projection reads the product

    def forward(self, gate_up: torch.Tensor):
        if not gate_up.is_cuda:
            return silu_and_mul_reference(gate_up)
        layout = output_layout(self, gate_up)
        return silu_and_mul(gate_up) if layout is None else silu_and_mul_quantized(gate_up, layout)

    def of_product(self, gate_up_proj, hidden) -> torch.Tensor:
        """``self(gate_up_proj(hidden))`` (``hidden`` 16-bit or a ``QuantizedActivation``); where
        the product's kernel can apply the activation itself (a 16-bit output,
        ``gated_silu_product``), in that one launch."""
        if isinstance(hidden, torch.Tensor) and hidden.is_cuda and output_layout(self, hidden) is None:
            activated = gated_silu_product(gate_up_proj, hidden)
            if activated is not None:
                return activated
        return self(gate_up_proj(hidden))


class GatedMLP(nn.Module):
    """Under tensor parallelism each rank computes its share of the intermediate size (gate/up
    column parallel, down row parallel)."""

    # The activation's product is read by down_proj alone.
    quantized_input_pairs = {"activation": "down_proj"}

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.intermediate_size = shard.split(intermediate_size, "intermediate_size")
        self.gate_up_proj = StackedLinear(hidden_size, {"gate_proj": intermediate_size,
                                                        "up_proj": intermediate_size}, bias=bias, shard=shard)
        self.activation = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, shard=shard,
                                           what="intermediate_size")

    @property
    def defers_reduction(self) -> bool:
        """Whether ``forward(..., reduce=False)`` may leave the sum over ranks to the caller."""
        return self.down_proj.bias is None

    def forward(self, hidden: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The block's output; with ``reduce=False`` (``defers_reduction``) this rank's partial
        sum of it."""
        return self.down_proj(self.activation.of_product(self.gate_up_proj, hidden), reduce=reduce)
