"""Speculation's job in the state system: the slots a speculative step copies pages aside into.

A speculative step may have to restore a group's state from before its verification, or run a
draft's chain on a copy of the state (a recurrent working slot: the managers say which groups
and which pages). The copies go into slots reserved with the sequence's pages, so a step never
allocates midway: a sequence that cannot get its slots waits or is preempted with the rest of
its pages, and ``OutOfPagesError`` never escapes a step.

Owner: the ``StateCoordinator`` (``coordinator.speculation``), which asks it what growing a
sequence needs (``missing``), reserves with every allocation (``reserve``) and releases with
every free (``release``). The slots are held under an in-flight owner tag per sequence, so the
books count them (I5) and the sanitizer poisons them when they go (I6).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

from tandem.kv.block_pool import INFLIGHT_PREFIX, BlockPool
from tandem.kv.request_state import RequestState


class SetAsideSlots:
    def __init__(self, managers: list, pools: list[BlockPool],
                 copy_page: Callable[[int, int, int], None]) -> None:
        self._managers = managers
        self._pools = pools
        self._copy_page = copy_page  # the coordinator's mover (iterates the registry; I1, I3)
        self._groups: frozenset[int] = frozenset()  # where slots are reserved (``reserve_for``)
        self._slots: dict[str, list[list[int]]] = {}  # owner tag -> reserved pages per group
        self._in_use: set[str] = set()  # owner tags whose copies are being read

    def references(self, group_index: int) -> Iterator[tuple[str, list[int]]]:
        """(owner tag, reserved pages) of every sequence's slots in one group (the books, I5)."""
        for owner, tables in self._slots.items():
            yield owner, tables[group_index]

    def copies_needed(self, groups: Iterable[int]) -> bool:
        """Whether a speculative step in ``groups`` needs copies set aside (the managers say)."""
        return any(self._managers[group].speculation_sets_aside for group in groups)

    def reserve_for(self, groups: Iterable[int]) -> None:
        """Speculation runs with copies set aside in ``groups`` (the target's and the draft's):
        from now on every allocation that grows a sequence also reserves, in each of those groups
        whose manager sets pages aside, the slots ``set_aside`` copies into. The slots are the
        sequence's until it is freed."""
        self._groups = frozenset(group for group in groups if self._managers[group].speculation_sets_aside)

    @staticmethod
    def _owner(state: RequestState) -> str:
        return f"{INFLIGHT_PREFIX}speculation:{state.owner}"

    def missing(self, state: RequestState, num_tokens: int) -> list[int]:
        """Per group: the slots growing the sequence to ``num_tokens`` must reserve."""
        if not self._groups:
            return [0] * len(self._pools)
        held = self._slots.get(self._owner(state))
        return [max(0, self._managers[index].set_aside_slots(num_tokens) - (len(held[index]) if held else 0))
                if index in self._groups else 0 for index in range(len(self._pools))]

    def reserve(self, state: RequestState, num_tokens: int) -> None:
        """Take the ``missing`` slots (the coordinator made room for them with the pages)."""
        missing = self.missing(state, num_tokens)
        if not any(missing):
            return
        owner = self._owner(state)
        held = self._slots.setdefault(owner, [[] for _ in self._pools])
        for pool, pages, count in zip(self._pools, held, missing):
            if count:
                pages.extend(pool.allocate(count, owner))

    def release(self, state: RequestState) -> None:
        owner = self._owner(state)
        held = self._slots.pop(owner, None)
        self._in_use.discard(owner)
        if held is not None:
            for pool, pages in zip(self._pools, held):
                pool.release(pages, owner)

    def set_aside(self, state: RequestState, groups: Iterable[int]) -> Optional[str]:
        """Copy aside, in ``groups``, the pages the managers say a speculative step may have to
        restore or run a draft chain on (a recurrent working slot), into the slots the sequence
        reserved with its pages. Returns the copies' tag, in use until ``end_set_aside``; None
        when nothing needed copying. A sequence uses its slots for one set-aside at a time."""
        wanted = set(groups)
        sources = [manager.speculation_sources(table) if index in wanted else []
                   for index, (manager, table) in enumerate(zip(self._managers, state.page_tables))]
        if not any(sources):
            return None
        owner = self._owner(state)
        slots = self._slots.get(owner)
        if owner in self._in_use or slots is None or any(
                len(pages) > len(reserved) for pages, reserved in zip(sources, slots)):
            raise RuntimeError(f"speculation: {state.owner} sets aside {[len(p) for p in sources]} pages "
                               f"without slots reserved for them (reserved: {slots}, in use: "
                               f"{owner in self._in_use})")
        for group_index, (pages, reserved) in enumerate(zip(sources, slots)):
            for source, destination in zip(pages, reserved):
                self._copy_page(group_index, source, destination)
        self._in_use.add(owner)
        return owner

    def end_set_aside(self, owner: str) -> None:
        """The copies ``set_aside`` made are no longer read: the slots stay reserved."""
        self._in_use.discard(owner)

    def _copies(self, owner: Optional[str]) -> list[list[int]]:
        return self._slots[owner] if owner is not None else [[] for _ in self._managers]

    def chain_page_tables(self, state: RequestState, owner: Optional[str]) -> list[list[int]]:
        """Per group, the table a draft's speculative chain reads and writes (the managers say:
        the sequence's own, or the copies ``set_aside`` made)."""
        return [manager.chain_page_table(table, group_copies)
                for manager, table, group_copies in zip(self._managers, state.page_tables, self._copies(owner))]

    def roll_back(self, state: RequestState, owner: Optional[str], groups: Iterable[int], *, num_valid: int,
                  num_written: int) -> bool:
        """After a verification that wrote ``num_written`` tokens' state of which ``num_valid``
        are accepted, in ``groups`` (those ``set_aside`` was given): every group drops what holds
        only rejected tokens. Returns whether each holds exactly ``num_valid`` tokens' state;
        False when some group had to restore the state from before the verification."""
        copies = self._copies(owner)
        exact = True
        for group_index in groups:
            exact &= self._managers[group_index].rollback(
                state.page_tables[group_index], copies[group_index], state.owner, num_valid, num_written,
                lambda source, destination, group=group_index: self._copy_page(group, source, destination))
        return exact
