"""Linking producers of activations to the FP8 projections that read them
(``tandem.layers.quantized_input``), so each producer writes FP8 where its consumer would
quantize: after ``convert_model``, every ``quantized_input_pairs`` entry of the model whose
consumer computes in FP8 (``Fp8LinearMethod``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tandem.kernels.fp8_activation import ActivationLayout
from tandem.quantization.linear_method import Fp8LinearMethod


class ConsumerInput:
    """The layout ``consumer`` (an FP8 linear layer) quantizes its input into
    (``Fp8LinearMethod.input_layout``). Holds the consumer outside the module tree: the
    producer keeps this plain object, not a second registration of the consumer."""

    def __init__(self, consumer: nn.Module) -> None:
        self._consumer = consumer

    def layout(self, tokens: int, device: torch.device) -> Optional[ActivationLayout]:
        return self._consumer.weight_method.input_layout(self._consumer, tokens, device)


def _submodule(module: nn.Module, path: str) -> Optional[nn.Module]:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def link_quantized_inputs(model: nn.Module) -> list[str]:
    """Link every declared producer whose consumer is an FP8 linear layer; returns the linked
    producers' names."""
    linked = []
    for name, module in model.named_modules():
        for producer_path, consumer_path in getattr(module, "quantized_input_pairs", {}).items():
            producer, consumer = _submodule(module, producer_path), _submodule(module, consumer_path)
            if producer is None or consumer is None:
                continue
            if isinstance(getattr(consumer, "weight_method", None), Fp8LinearMethod):
                producer.output_quantization = ConsumerInput(consumer)
                linked.append(f"{name}.{producer_path}" if name else producer_path)
    return linked
