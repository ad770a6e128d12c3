"""The coordinator's events, and the listener above it that they feed.

The books below (``StateCoordinator`` and its jobs, ``prefix_hits.py``) publish what happens to
a request's state and to the prefix cache through one ``StateListener``; a layer above them (the
host and disk tiers, ``kv/tiers/hierarchy.TieredState``) registers as it
(``StateCoordinator.attach_listener``). The dependency points one way: the books know this
interface only, and the listener imports the books and calls back into them (making room,
counting evictable pages). Without a listener every event is nobody's, and a hit is what the
device holds.

Two kinds of call: events (nothing returned: the listener does its part) and the queries a
prefix hit needs answered (``loading``, ``complete_path``, ``restore``, ``keeps_below``).
"""
from __future__ import annotations

from typing import Protocol

from tandem.kv.prefix_cache import CacheNode
from tandem.kv.request_state import RequestState


class StateListener(Protocol):
    # -- events --------------------------------------------------------------------------------------
    def on_cached(self, nodes: list[CacheNode]) -> None:
        """A sequence inserted ``nodes`` (locked, device-resident) into the prefix cache."""

    def on_freed(self, state: RequestState) -> None:
        """The sequence's state is being freed for good (not kept for a swap-in), before its
        pages are released: a copy of it held above the device goes too."""

    def on_path_released(self, owner: str) -> None:
        """The sequence ``owner`` let go of its cache path: work started for its hit (a disk
        read ahead of its match) is no longer wanted."""

    # -- queries a hit needs answered ----------------------------------------------------------------
    def loading(self, owner: str, token_ids: list[int], max_pages: int, idle: bool) -> bool:
        """Whether pages a match of ``token_ids`` would take are still being fetched for
        ``owner`` (the match must wait). ``idle``: nothing else can run meanwhile."""

    def complete_path(self, path: list[CacheNode], token_ids: list[int], max_pages: int) -> list[CacheNode]:
        """The matched ``path`` completed from the tiers below the device (every node resident
        in some tier, extended past the tree's end), returned locked."""

    def restore(self, path: list[CacheNode]) -> int:
        """Make ``path``'s nodes device-resident as far as the pools allow; how many leading
        nodes are on the device."""

    def keeps_below(self, node: CacheNode) -> bool:
        """The prefix cache evicts ``node`` from the device: whether a tier below keeps it."""
