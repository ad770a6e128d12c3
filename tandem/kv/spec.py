"""State specs: what each stateful layer keeps, declared by the layer itself.

A spec is a frozen dataclass; layers whose specs are equal form one group (one page table per
request per group). A spec names the buffers a page holds (``buffer_layouts``) and the manager
kind that interprets it; nothing outside ``kv/managers/`` and the registry branches on the
spec's type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class BufferLayout:
    """One buffer of a layer.

    ``per_token`` buffers hold ``shape`` for each of a page's ``page_size`` token slots (KV,
    latents, indexer keys); other buffers hold one ``shape`` per page (a recurrent state slot).
    Either way a page is the buffer's first dimension, which is all movers rely on.
    """
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    per_token: bool = True

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        return (page_size, *self.shape) if self.per_token else self.shape

    def page_bytes(self, page_size: int) -> int:
        count = 1
        for size in self.page_shape(page_size):
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """Base class of every spec. Subclasses set ``manager_kind`` and ``buffer_layouts``."""
    manager_kind: ClassVar[str] = ""

    def buffer_layouts(self) -> tuple[BufferLayout, ...]:
        raise NotImplementedError

    def page_bytes(self, page_size: int) -> int:
        """Bytes one page of one layer takes across all its buffers."""
        return sum(layout.page_bytes(page_size) for layout in self.buffer_layouts())


@dataclass(frozen=True)
class FullAttentionSpec(StateSpec):
    """Full causal attention: a key and a value vector per KV head for every token."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    manager_kind: ClassVar[str] = "full_attention"

    def buffer_layouts(self) -> tuple[BufferLayout, ...]:
        shape = (self.num_kv_heads, self.head_dim)
        return (BufferLayout("key", shape, self.dtype), BufferLayout("value", shape, self.dtype))
