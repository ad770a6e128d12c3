"""State specs: what each stateful layer keeps, declared by the layer itself.

A spec is a frozen dataclass; layers whose specs are equal form one group (one page table per
request per group). A spec names the buffers a page holds (``buffer_layouts``) and the manager
kind that interprets it; nothing outside ``kv/managers/`` and the registry branches on the
spec's type.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional

import torch

# ``kv_cache_dtype`` names -> the dtype of paged K/V (None: the model dtype). FP8 pages hold
# float8 e4m3 at a fixed scale of 1.0: writes saturate at +-448 (tandem/kernels/kv_write.py),
# reads upcast exactly. Keys and values of real models sit far inside that range; the cost is
# e4m3's 3-bit mantissa (about 2**-4 relative error per element).
KV_CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


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

    def with_kv_cache_dtype(self, dtype: torch.dtype) -> "StateSpec":
        """This spec with its paged K/V stored in ``dtype`` (``kv_cache_dtype``). Specs that hold
        no K/V read by the paged attention kernels (MLA latents, indexer keys, recurrent state)
        keep their own dtype: they return themselves."""
        return self

    def pages_per_sequence(self, prefix_caching: bool, speculative: bool = False) -> int | None:
        """How the group's pool is sized: None when its pages hold tokens (the pool is sized in
        pages of ``page_size`` tokens, from the token count or the memory budget); otherwise
        the number of pages each live sequence may hold (the pool is sized in sequences).
        ``speculative``: speculative decoding runs, which may set a page aside per sequence."""
        return None


@dataclass(frozen=True)
class FullAttentionSpec(StateSpec):
    """Full causal attention: a key and a value vector per KV head for every token."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    manager_kind: ClassVar[str] = "full_attention"

    def with_kv_cache_dtype(self, dtype: torch.dtype) -> StateSpec:
        return replace(self, dtype=dtype)

    def buffer_layouts(self) -> tuple[BufferLayout, ...]:
        shape = (self.num_kv_heads, self.head_dim)
        return (BufferLayout("key", shape, self.dtype), BufferLayout("value", shape, self.dtype))


@dataclass(frozen=True)
class SlidingWindowSpec(StateSpec):
    """Sliding-window causal attention: K and V per token, like full attention, but a query at
    position ``p`` reads only keys at positions ``p - window + 1 .. p`` (the last ``window``
    tokens, itself included), so pages wholly before that may be released while decoding."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int
    manager_kind: ClassVar[str] = "sliding_window"

    def with_kv_cache_dtype(self, dtype: torch.dtype) -> StateSpec:
        return replace(self, dtype=dtype)

    def buffer_layouts(self) -> tuple[BufferLayout, ...]:
        shape = (self.num_kv_heads, self.head_dim)
        return (BufferLayout("key", shape, self.dtype), BufferLayout("value", shape, self.dtype))


@dataclass(frozen=True)
class RecurrentSpec(StateSpec):
    """Recurrent state kept per sequence, not per token (Mamba-2, gated DeltaNet): a
    convolution window and an SSM (or delta-rule) state, fixed in size however long the
    sequence. A page of the group is one slot holding both for one layer.

    A sequence holds one working slot; with prefix caching also a second one, into which the
    forward pass snapshots the state at a page boundary (a prefix-cache checkpoint), and the
    pool keeps one more slot per sequence seat for checkpoints the cache holds. Speculative
    decoding adds one slot per seat: a copy of the working slot, taken for one step (the state
    before a verification, restored if tokens are rejected; a draft's scratch state).
    """
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]
    ssm_dtype: torch.dtype
    manager_kind: ClassVar[str] = "recurrent"

    def buffer_layouts(self) -> tuple[BufferLayout, ...]:
        return (BufferLayout("conv", self.conv_shape, self.conv_dtype, per_token=False),
                BufferLayout("ssm", self.ssm_shape, self.ssm_dtype, per_token=False))

    def pages_per_sequence(self, prefix_caching: bool, speculative: bool = False) -> int | None:
        return (3 if prefix_caching else 1) + (1 if speculative else 0)


@dataclass(frozen=True)
class PackedPageLayout(BufferLayout):
    """A page held as one flat run of bytes, field by field: ``shape`` is ``(bytes per token,)``
    and the page is ``page_size * shape[0]`` bytes, which the layer that owns the state reads
    page-major (e.g. the FP8 keys of all the page's tokens, then all their FP32 scales). Movers
    see an ordinary per-page buffer. ``per_token`` is False: a page is not split into slots."""

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        return (page_size * self.shape[0],)


@dataclass(frozen=True)
class MLASpec(StateSpec):
    """Multi-head latent attention (DeepSeek-V3): per token one compressed KV vector of
    ``kv_lora_rank`` values followed by the shared rotary key part of ``rope_dim`` values; every
    head's key and value are expanded from it. Every past token is read: pages are kept."""
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype
    manager_kind: ClassVar[str] = "mla"

    def buffer_layouts(self) -> tuple[BufferLayout, ...]:
        return (BufferLayout("latent", (self.kv_lora_rank + self.rope_dim,), self.dtype),)


@dataclass(frozen=True)
class IndexerSpec(StateSpec):
    """The DeepSeek sparse-attention (DSA) lightning indexer's key cache: one ``head_dim`` key
    per token, scored against every later query to pick the tokens it attends to.

    ``quantized``: FP8 (e4m3) keys with one FP32 scale per token, packed page-major as production
    deployments store them: ``page_size * head_dim`` key bytes, then ``page_size * 4`` scale bytes.
    Otherwise one float32 key per token (exactness tests)."""
    head_dim: int
    quantized: bool
    manager_kind: ClassVar[str] = "indexer"

    SCALE_BYTES: ClassVar[int] = 4

    def buffer_layouts(self) -> tuple[BufferLayout, ...]:
        if self.quantized:
            return (PackedPageLayout("index_key", (self.head_dim + self.SCALE_BYTES,), torch.uint8,
                                     per_token=False),)
        return (BufferLayout("index_key", (self.head_dim,), torch.float32),)
