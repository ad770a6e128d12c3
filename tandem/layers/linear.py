"""Linear layers and checkpoint loading by name.

``StackedLinear`` computes several checkpoint projections (q/k/v, gate/up) as one matrix
product; each checkpoint tensor is copied into its row slice when loading.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


class StackedLinear(nn.Linear):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in parts.items():
            self.parts[name] = (offset, size)
            offset += size


def _stacked_targets(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Checkpoint name → (parameter name, row offset, rows) for every stacked part."""
    targets = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, StackedLinear):
            continue
        parent = module_name.rsplit(".", 1)[0]
        for part, (offset, size) in module.parts.items():
            for kind in ("weight", "bias"):
                if getattr(module, kind, None) is not None:
                    targets[f"{parent}.{part}.{kind}"] = (f"{module_name}.{kind}", offset, size)
    return targets


def load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 skip: Callable[[str], bool] = lambda name: False) -> None:
    """Copy each checkpoint tensor into the parameter (or stacked slice) of the same name.

    Raises ValueError naming the tensor on an unknown name or a shape mismatch, and when any
    parameter (or slice) is left unloaded."""
    params = dict(model.named_parameters())
    stacked = _stacked_targets(model)
    expected = {name for name in params if not any(t[0] == name for t in stacked.values())}
    expected |= set(stacked)
    loaded = set()
    for name, tensor in weights:
        if name in stacked:
            param_name, offset, size = stacked[name]
            target = params[param_name].data[offset:offset + size]
        elif name in params:
            target = params[name].data
        elif skip(name):
            continue
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(tensor)
        loaded.add(name)
    missing = sorted(expected - loaded - {n for n in expected if skip(n)})
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
