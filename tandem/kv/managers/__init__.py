"""Manager lookup by the spec's ``manager_kind`` (the one place kinds map to classes)."""
from __future__ import annotations

from tandem.kv.managers.base import StateManager
from tandem.kv.managers.full_attention import FullAttentionManager
from tandem.kv.managers.recurrent import RecurrentManager
from tandem.kv.managers.sliding_window import SlidingWindowManager

MANAGER_CLASSES: dict[str, type[StateManager]] = {
    "full_attention": FullAttentionManager,
    "recurrent": RecurrentManager,
    "sliding_window": SlidingWindowManager,
    # MLA latents and DSA indexer keys are per token and every past token is read (the indexer
    # scores all of them): whole-history state, managed exactly as full attention.
    "mla": FullAttentionManager,
    "indexer": FullAttentionManager,
}


def manager_class_for(manager_kind: str) -> type[StateManager]:
    try:
        return MANAGER_CLASSES[manager_kind]
    except KeyError:
        raise ValueError(f"no state manager for spec kind {manager_kind!r}") from None
