"""Prefix-cache nodes to and from the disk store (part of ``TieredState``).

A node goes to disk as one object: a presence byte per group, then the blocks of the groups it
holds, in group order. A payload is a private copy of the host blocks, so a disk write holds no
host page (I2). Reading checks the payload against this layout (groups and block sizes) on top
of the store's own checks; a mismatch is a miss.
"""
from __future__ import annotations

from typing import Optional

import torch

from tandem.kv.block_pool import CACHE_OWNER
from tandem.kv.page_operations import DISK_INSTALL, DISK_WRITE, PageOperation
from tandem.kv.planner import NULL_PAGE
from tandem.kv.prefix_cache import CacheNode

def encode_payload(host, host_pages) -> torch.Tensor:
    """A node's host pages (one per group, null where absent) as one object: a presence byte per
    group, then the present groups' blocks (a private copy)."""
    mask = torch.tensor([int(page != NULL_PAGE) for page in host_pages], dtype=torch.uint8)
    blocks = [host.arrays[group][page] for group, page in enumerate(host_pages) if page != NULL_PAGE]
    return torch.cat([mask, *blocks])


def payload_mask(data: torch.Tensor, layouts) -> Optional[list[int]]:
    """The presence byte per group of a payload (uint8 tensor) written under ``layouts``, or
    None when it does not match them (groups, block sizes)."""
    num_groups = len(layouts)
    mask = data[:num_groups].tolist() if data.numel() >= num_groups else []
    if len(mask) != num_groups or any(value not in (0, 1) for value in mask):
        return None
    expected = num_groups + sum(layout.block_bytes for layout, present in zip(layouts, mask) if present)
    return mask if data.numel() == expected else None


def copy_payload(host, data: torch.Tensor, host_pages) -> None:
    """A matching payload's blocks into the host pages (one per present group, in order)."""
    offset = len(host.layouts)
    for group, page in enumerate(host_pages):
        if page == NULL_PAGE:
            continue
        width = host.layouts[group].block_bytes
        host.arrays[group][page].copy_(data[offset:offset + width])
        offset += width


class DiskPages:
    """Nodes to and from the disk store; mixed into ``TieredState`` (its host page books, its
    outbox and this rank's ``TierWorker``, whose store and reads these are).

    The books decide and the ranks' tier workers move the bytes: a DISK_WRITE writes a node's
    host pages on every rank; a read counts only as far as every rank read the same pages (each
    rank's ``readable``, the smallest count taken: ``peers.agree_on_disk_reads`` under tensor
    parallelism), and a DISK_INSTALL per node fills its new host pages on every rank."""

    def _write_to_disk(self, node: CacheNode) -> bool:
        if self.disk is None or node.host_pages is None:
            return False
        self.outbox.send(PageOperation(DISK_WRITE, -1, list(node.host_pages), [node.hash]))
        return True

    def _write_nodes_to_disk(self, nodes: list[CacheNode]) -> None:
        for node in nodes:
            if node.host_pages is not None and not self.disk.contains(node.hash):
                self._write_to_disk(node)

    def _read_from_disk(self, node: CacheNode) -> bool:
        """Bring a node's pages from disk into new host pages; False on a miss (a rejected
        file is a miss: the store counted, logged and deleted it)."""
        entry = self._agree_on_reads([node.hash]).get(node.hash)
        return entry is not None and self._install_payload(node, *entry)

    def _agree_on_reads(self, keys: list[bytes]) -> dict[bytes, tuple[list[int], str]]:
        """The leading pages of ``keys`` every rank read (its started reads, or read now): key ->
        (presence per group, who wrote it), in chain order; each rank keeps their payloads."""
        count = self.local.readable(keys)
        if count and self.peers is not None:
            count = self.peers.agree_on_disk_reads(list(keys), count)
        return self.local.keep(count)

    def _install_payload(self, node: CacheNode, mask: list[int], origin: str) -> bool:
        """An agreed payload into new host pages of ``node``; False when the host tier has no room."""
        host = self._allocate_host(mask, CACHE_OWNER)
        if host is None:
            return False
        node.host_pages = tuple(pages[0] if present else NULL_PAGE for pages, present in zip(host, mask))
        self.outbox.send(PageOperation(DISK_INSTALL, -1, list(node.host_pages), [node.hash]))
        self._host_resident(node)
        self._read_from_disk_now[id(node)] = origin
        return True
