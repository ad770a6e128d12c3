"""A sequence's state handle: its page tables (one per group) and what else ties it to the
state system. Owner: the sequence; the coordinator allocates into it and frees from it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tandem.kv.prefix_cache import CacheNode


@dataclass
class SwappedState:
    """A preempted sequence's state in the host tier (``kv/tiers/swap.py`` makes it): per
    group, its page table's entries as host pages (null where the device table had null), and
    how many tokens it had computed."""
    owner: str
    host_tables: list[list[int]]
    num_computed_tokens: int


@dataclass
class RequestState:
    """A sequence's state handle. ``owner`` tags every page reference it holds."""
    owner: str
    page_tables: list[list[int]]
    cache_path: list[CacheNode] = field(default_factory=list)  # locked prefix-cache nodes
    swapped: Optional["SwappedState"] = None  # preempted by swap: the state is in the host tier
    # PD decode: the leading tokens whose state a transfer wrote (the prompt). Entries of sparse
    # groups (recurrent checkpoints) at pages inside it were never written here: not cached.
    remote_tokens: int = 0

    @classmethod
    def empty(cls, owner: str, num_groups: int) -> "RequestState":
        return cls(owner=owner, page_tables=[[] for _ in range(num_groups)])
