"""The model-wide state registry: every stateful layer's spec, its group, and its buffers.

Owner: the engine builds one registry per model replica. Layers register their specs while the
model is built (target and draft models alike); ``finalize`` forms the groups; the planner then
attaches the buffers. Every mover (sanitizer poison, the tiers' page mover, PD transfer) iterates
``buffers()`` — that is what makes invariant I1 hold: a buffer that is not here does not
exist, and a buffer that is here is moved by everyone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from tandem.kv.spec import BufferLayout, StateSpec


LAYER_MAJOR = "layer-major"
PAGE_MAJOR = "page-major"


@dataclass(frozen=True)
class BufferDescriptor:
    """One state buffer: ``tensor`` is ``[num_pages, *page_shape]``, each page contiguous.

    ``page_bytes`` is the length of one page's contiguous slice and ``page_stride`` the bytes
    from one page to the next; movers address page ``p`` at ``tensor.data_ptr() + p *
    page_stride``. Layer-major (the buffer is its own allocation): ``page_stride ==
    page_bytes``, ``pool`` is None and ``offset`` 0. Page-major: the buffer is a view of its
    group's ``pool`` (``[num_pages, block bytes]`` uint8, ``GroupPool``); page ``p`` lies at
    bytes ``offset .. offset + page_bytes`` of the pool's row ``p`` and ``page_stride`` is the
    block's bytes.
    """
    group_id: int
    layer_name: str
    kind: str
    tensor: torch.Tensor
    item_size: int
    page_bytes: int
    page_stride: int = 0  # 0: page_bytes (a buffer that is its own allocation)
    pool: Optional[torch.Tensor] = None
    offset: int = 0

    def __post_init__(self) -> None:
        if self.page_stride == 0:
            object.__setattr__(self, "page_stride", self.page_bytes)

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.group_id, self.layer_name, self.kind)

    def page_rows(self) -> torch.Tensor:
        """The buffer as ``[pages, page_bytes]`` uint8 (a view, row stride ``page_stride``)."""
        return self.tensor.view(self.tensor.shape[0], -1).view(torch.uint8)


@dataclass(frozen=True)
class GroupPool:
    """A page-major group's one allocation: ``tensor`` is ``[num_pages, block_bytes]`` uint8;
    every buffer of the group is a view of a column range of it (``BufferDescriptor.offset``)."""
    group_id: int
    tensor: torch.Tensor

    @property
    def block_bytes(self) -> int:
        return self.tensor.shape[1]


@dataclass
class StateGroup:
    """Layers with equal specs; they share page ids (one page table per request)."""
    group_id: int
    spec: StateSpec
    layer_names: list[str] = field(default_factory=list)


class StateRegistry:
    """``kv_cache_dtype``: the dtype every registered spec's paged K/V is stored in (see
    ``StateSpec.with_kv_cache_dtype``); None keeps the dtypes the layers declare."""

    def __init__(self, kv_cache_dtype: Optional[torch.dtype] = None) -> None:
        self.kv_cache_dtype = kv_cache_dtype
        self._specs: dict[str, StateSpec] = {}
        self._groups: list[StateGroup] = []
        self._layer_group: dict[str, int] = {}
        self._buffers: dict[tuple[int, str, str], BufferDescriptor] = {}
        self._pools: dict[int, GroupPool] = {}
        self.kv_cache_layout = LAYER_MAJOR  # set by the planner when it allocates
        self._finalized = False

    # -- declaration ---------------------------------------------------------------------
    def register(self, layer_name: str, spec: StateSpec) -> None:
        if self._finalized:
            raise RuntimeError(f"registry is finalized; cannot register {layer_name!r}")
        if layer_name in self._specs:
            raise ValueError(f"layer {layer_name!r} registered twice")
        if self.kv_cache_dtype is not None:
            spec = spec.with_kv_cache_dtype(self.kv_cache_dtype)
        self._specs[layer_name] = spec

    def finalize(self) -> list[StateGroup]:
        """Group layers by equal spec, in registration order. With a ``kv_cache_dtype``, some
        layer must store its state in it (else the option would silently do nothing)."""
        stored = {layout.dtype for spec in self._specs.values() for layout in spec.buffer_layouts()}
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in stored:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype} applies to the paged K/V of attention layers "
                             "(full or sliding window); this model keeps none (MLA latents, indexer keys and "
                             "recurrent state keep their own dtype): use kv_cache_dtype='auto'")
        by_spec: dict[StateSpec, StateGroup] = {}
        for layer_name, spec in self._specs.items():
            group = by_spec.get(spec)
            if group is None:
                group = StateGroup(len(self._groups), spec)
                by_spec[spec] = group
                self._groups.append(group)
            group.layer_names.append(layer_name)
            self._layer_group[layer_name] = group.group_id
        self._finalized = True
        return self._groups

    # -- buffers (attached by the planner) ---------------------------------------------
    def attach_buffer(self, group_id: int, layer_name: str, layout: BufferLayout,
                      tensor: torch.Tensor, pool: Optional[GroupPool] = None, offset: int = 0) -> None:
        """``tensor``: its own allocation, or (``pool`` given) a view of the group's pool whose
        pages start ``offset`` bytes into the pool's rows."""
        page_bytes = tensor[0].numel() * tensor.element_size()
        descriptor = BufferDescriptor(
            group_id=group_id, layer_name=layer_name, kind=layout.kind, tensor=tensor,
            item_size=tensor.element_size(), page_bytes=page_bytes,
            page_stride=tensor.stride(0) * tensor.element_size(),
            pool=pool.tensor if pool is not None else None, offset=offset)
        if pool is not None:
            self._pools[group_id] = pool
        self._buffers[descriptor.key] = descriptor

    # -- queries -------------------------------------------------------------------------
    @property
    def groups(self) -> list[StateGroup]:
        return self._groups

    def group_of(self, layer_name: str) -> int:
        return self._layer_group[layer_name]

    def spec_of(self, layer_name: str) -> StateSpec:
        return self._specs[layer_name]

    def layer_names(self) -> list[str]:
        """Every stateful layer, in registration (the model's) order."""
        return list(self._specs)

    def buffers(self, group_id: Optional[int] = None) -> Iterator[BufferDescriptor]:
        for descriptor in self._buffers.values():
            if group_id is None or descriptor.group_id == group_id:
                yield descriptor

    def group_pool(self, group_id: int) -> Optional[GroupPool]:
        """The group's one allocation when the pools are page-major, else None."""
        return self._pools.get(group_id)

    def allocations(self) -> list[torch.Tensor]:
        """Every distinct allocation holding state, in registry order: a page-major group's
        pool once, a layer-major buffer's tensor."""
        seen: dict[int, torch.Tensor] = {}
        for descriptor in self._buffers.values():
            allocation = descriptor.pool if descriptor.pool is not None else descriptor.tensor
            seen.setdefault(id(allocation), allocation)
        return list(seen.values())

    def layer_buffers(self, layer_name: str) -> dict[str, torch.Tensor]:
        group_id = self._layer_group[layer_name]
        return {d.kind: d.tensor for d in self._buffers.values()
                if d.group_id == group_id and d.layer_name == layer_name}

    def describe(self) -> list[tuple[int, str, str, int, str]]:
        """The ordered buffer list (group, layer, kind, item size, dtype): a handshake key."""
        return [(d.group_id, d.layer_name, d.kind, d.item_size, str(d.tensor.dtype))
                for d in self._buffers.values()]
