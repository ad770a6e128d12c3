"""Prefix-cache nodes to and from the disk store (part of ``TieredState``).

A node goes to disk as one object: a presence byte per group, then the blocks of the groups it
holds, in group order. A payload is a private copy of the host blocks, so a disk write holds no
host page (I2). Reading checks the payload against this layout (groups and block sizes) on top
of the store's own checks; a mismatch is a miss.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from tandem.kv.block_pool import CACHE_OWNER
from tandem.kv.planner import NULL_PAGE
from tandem.kv.prefix_cache import CacheNode

logger = logging.getLogger(__name__)


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
    """Node payloads; mixed into ``TieredState`` (its host pool, layouts and disk store).

    Under tensor parallelism (``peers`` set) every rank keeps its own store of its own shard;
    rank 0 decides, and a read counts only as far as every rank read the same pages (the
    ranks' ``agree_on_disk_reads``); each write and install is journaled for the other ranks."""

    def _payload(self, node: CacheNode) -> torch.Tensor:
        return encode_payload(self.host, node.host_pages)

    def _write_to_disk(self, node: CacheNode) -> bool:
        if self.disk is None or node.host_pages is None:
            return False
        self.disk.write_async(node.hash, self._payload(node))
        if self.coordinator.mirror is not None:
            self.coordinator.mirror.disk_write(node.hash, list(node.host_pages))
        return True

    def _write_nodes_to_disk(self, nodes: list[CacheNode]) -> None:
        for node in nodes:
            if node.host_pages is not None and not self.disk.contains(node.hash):
                self._write_to_disk(node)

    def _read_from_disk(self, node: CacheNode) -> bool:
        """Bring a node's pages from disk into new host pages; False on a miss (a rejected
        file is a miss: the store counted, logged and deleted it)."""
        entry = self.disk.read_entry(node.hash)
        if self.peers is not None and not self.peers.agree_on_disk_reads([node.hash], int(entry is not None)):
            return False
        return entry is not None and self._install_payload(node, *entry)

    def _agreed_entries(self, entries: dict) -> dict:
        """The leading read payloads (key -> entry, in chain order) every rank has too."""
        if self.peers is None or not entries:
            return entries
        agreed = self.peers.agree_on_disk_reads(list(entries), len(entries))
        return dict(list(entries.items())[:agreed])

    def _install_payload(self, node: CacheNode, payload, origin: str) -> bool:
        """A payload read from the store into new host pages of ``node``; False when it does
        not match this layout or the host tier has no room."""
        data = torch.frombuffer(payload, dtype=torch.uint8)
        mask = payload_mask(data, self.layouts)
        if mask is None:
            logger.warning("disk tier: page %s does not match this layout; treated as a miss", node.hash.hex())
            return False
        host = self._allocate_host(mask, CACHE_OWNER)
        if host is None:
            return False
        node.host_pages = tuple(pages[0] if present else NULL_PAGE for pages, present in zip(host, mask))
        copy_payload(self.host, data, node.host_pages)
        if self.coordinator.mirror is not None:
            self.coordinator.mirror.disk_install(node.hash, list(node.host_pages))
        self._host_resident(node)
        self._read_from_disk_now[id(node)] = origin
        return True
