"""Reading a quantized checkpoint's tensors: each FP8 weight is paired with its scale and
handed to the model either as FP8 (weight + a ``weight_scale`` in the row-block layout, for a
linear layer converted to FP8 compute) or dequantized to float32 (every other weight: on a CPU,
MoE experts, MLA's ``kv_b_proj``, layers kept 16-bit).

Online quantization (``fp8-online``) quantizes the float weights of the linear layers named
in ``online`` per output channel; a layer that is not converted gets the quantize-dequantize
of its weight, so a CPU run computes exactly what the FP8 weights mean."""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from tandem.quantization.config import QuantizationConfig
from tandem.quantization.fp8 import (FP8_DTYPE, dequantize_blocks, dequantize_rows, quantize_rows,
                                     row_block_scales)

WEIGHT_SUFFIX = ".weight"


def quantized_modules(names: Iterable[str], quantization: Optional[QuantizationConfig]) -> set[str]:
    """Checkpoint module names that carry a weight scale (``x.weight_scale_inv`` → ``x``)."""
    if quantization is None or quantization.method == "fp8-online":
        return set()
    suffix = "." + quantization.scale_suffix
    return {name[:-len(suffix)] for name in names if name.endswith(suffix)}


class _Pairing:
    """FP8 weights and scales seen so far, matched by module name (either may come first)."""

    def __init__(self, quantization: QuantizationConfig, keep_fp8: set[str]) -> None:
        self.quantization = quantization
        self.keep_fp8 = keep_fp8
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def add_weight(self, module: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        self.weights[module] = tensor
        return self._ready(module)

    def add_scale(self, module: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        self.scales[module] = tensor
        return self._ready(module)

    def _ready(self, module: str) -> list[tuple[str, torch.Tensor]]:
        if module not in self.weights or module not in self.scales:
            return []
        weight, scale = self.weights.pop(module), self.scales.pop(module)
        if weight.dim() != 2:
            raise ValueError(f"checkpoint tensor {module + WEIGHT_SUFFIX!r}: an FP8 weight must be a matrix, "
                             f"got shape {tuple(weight.shape)}")
        block = self.quantization.weight_block
        if module in self.keep_fp8:
            return [(module + WEIGHT_SUFFIX, weight),
                    (module + ".weight_scale", row_block_scales(scale, tuple(weight.shape), block))]
        dequantized = dequantize_blocks(weight, scale, block) if block else dequantize_rows(weight, scale)
        return [(module + WEIGHT_SUFFIX, dequantized)]

    def check_complete(self) -> None:
        """Raise naming the first FP8 weight left without its scale, or scale without its weight."""
        if self.weights:
            module = min(self.weights)
            raise ValueError(f"checkpoint tensor {module + WEIGHT_SUFFIX!r} is FP8 but the checkpoint has no "
                             f"{module + '.' + self.quantization.scale_suffix!r}")
        if self.scales:
            module = min(self.scales)
            raise ValueError(f"checkpoint tensor {module + '.' + self.quantization.scale_suffix!r} scales "
                             f"no FP8 weight {module + WEIGHT_SUFFIX!r}")


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]], quantization: Optional[QuantizationConfig],
                       keep_fp8: set[str], online: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``(name, tensor)`` stream as the model's parameters take it.

    ``keep_fp8``: checkpoint module names whose weights stay FP8 (their layers were converted);
    ``online``: (fp8-online) checkpoint module names whose float weights are quantized here.
    Raises ValueError naming the tensor for an FP8 weight without a scale, or the reverse."""
    if quantization is None:
        yield from weights
        return
    if quantization.method == "fp8-online":
        yield from _quantized_online(weights, keep_fp8, online)
        return
    pairing = _Pairing(quantization, keep_fp8)
    scale_suffix = "." + quantization.scale_suffix
    for name, tensor in weights:
        if name.endswith(scale_suffix):
            yield from pairing.add_scale(name[:-len(scale_suffix)], tensor)
        elif name.endswith(WEIGHT_SUFFIX) and tensor.dtype == FP8_DTYPE:
            yield from pairing.add_weight(name[:-len(WEIGHT_SUFFIX)], tensor)
        elif name.endswith((".input_scale", ".activation_scale")):
            raise ValueError(f"checkpoint tensor {name!r}: static activation scales are not supported "
                             "(dynamic activation quantization only)")
        else:
            yield name, tensor
    pairing.check_complete()


def _quantized_online(weights, keep_fp8: set[str], online: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        module = name[:-len(WEIGHT_SUFFIX)] if name.endswith(WEIGHT_SUFFIX) else None
        if module not in online or not tensor.is_floating_point() or tensor.dim() != 2:
            yield name, tensor
            continue
        quantized, scale = quantize_rows(tensor)
        if module in keep_fp8:
            yield name, quantized
            yield module + ".weight_scale", scale
        else:
            yield name, dequantize_rows(quantized, scale)
