"""I3: the forward pass reads and writes state only through this accessor.

``StateAccessor.layer(name)`` first waits for that layer's pending loads (host→device restores
register themselves in ``PendingLoads``), then hands the attention backend the layer's buffers.
Raw buffers are private to ``kv/``; nothing else holds a reference to them across steps.
"""
from __future__ import annotations

from typing import Callable

import torch

from tandem.kv.registry import StateRegistry


class PendingLoads:
    """Per-layer completion waits registered by movers that load state asynchronously."""

    def __init__(self) -> None:
        self._waits: dict[str, list[Callable[[], None]]] = {}

    def add(self, layer_name: str, wait: Callable[[], None]) -> None:
        self._waits.setdefault(layer_name, []).append(wait)

    def wait(self, layer_name: str) -> None:
        for wait in self._waits.pop(layer_name, ()):
            wait()

    def __len__(self) -> int:
        return sum(len(v) for v in self._waits.values())

    def any_for(self, layer_names) -> bool:
        """Whether any of ``layer_names`` has a load pending."""
        return any(name in self._waits for name in layer_names)


class StateAccessor:
    def __init__(self, registry: StateRegistry, pending: PendingLoads) -> None:
        self._registry = registry
        self._pending = pending
        self._layer_cache: dict[str, dict[str, torch.Tensor]] = {}

    def layer(self, layer_name: str) -> dict[str, torch.Tensor]:
        """The layer's buffers by kind, after its pending loads have landed."""
        self._pending.wait(layer_name)
        buffers = self._layer_cache.get(layer_name)
        if buffers is None:
            buffers = self._registry.layer_buffers(layer_name)
            self._layer_cache[layer_name] = buffers
        return buffers

    def group_of(self, layer_name: str) -> int:
        return self._registry.group_of(layer_name)
