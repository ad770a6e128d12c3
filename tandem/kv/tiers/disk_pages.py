"""Prefix-cache nodes to and from the disk store (part of ``TieredState``).

A node goes to disk as one object: a presence byte per group, then the blocks of the groups it
holds, in group order. A payload is a private copy of the host blocks, so a disk write holds no
host page (I2). Reading checks the payload against this layout (groups and block sizes) on top
of the store's own checks; a mismatch is a miss.
"""
from __future__ import annotations

import logging

import torch

from tandem.kv.block_pool import CACHE_OWNER
from tandem.kv.planner import NULL_PAGE
from tandem.kv.prefix_cache import CacheNode

logger = logging.getLogger(__name__)


class DiskPages:
    """Node payloads; mixed into ``TieredState`` (its host pool, layouts and disk store)."""

    def _payload(self, node: CacheNode) -> torch.Tensor:
        """A node as one object: a presence byte per group, then the present groups' blocks."""
        mask = torch.tensor([int(page != NULL_PAGE) for page in node.host_pages], dtype=torch.uint8)
        blocks = [self.host.arrays[group][page] for group, page in enumerate(node.host_pages) if page != NULL_PAGE]
        return torch.cat([mask, *blocks])

    def _write_to_disk(self, node: CacheNode) -> bool:
        if self.disk is None or node.host_pages is None:
            return False
        self.disk.write_async(node.hash, self._payload(node))
        return True

    def _write_nodes_to_disk(self, nodes: list[CacheNode]) -> None:
        for node in nodes:
            if node.host_pages is not None and not self.disk.contains(node.hash):
                self._write_to_disk(node)

    def _read_from_disk(self, node: CacheNode) -> bool:
        """Bring a node's pages from disk into new host pages; False on a miss (a rejected
        file is a miss: the store counted, logged and deleted it)."""
        entry = self.disk.read_entry(node.hash)
        return entry is not None and self._install_payload(node, *entry)

    def _install_payload(self, node: CacheNode, payload, origin: str) -> bool:
        """A payload read from the store into new host pages of ``node``; False when it does
        not match this layout or the host tier has no room."""
        data = torch.frombuffer(payload, dtype=torch.uint8)
        mask = data[:self.num_groups].tolist() if data.numel() >= self.num_groups else []
        expected = self.num_groups + sum(layout.block_bytes for layout, present in zip(self.layouts, mask) if present)
        if len(mask) != self.num_groups or any(value not in (0, 1) for value in mask) or data.numel() != expected:
            logger.warning("disk tier: page %s does not match this layout; treated as a miss", node.hash.hex())
            return False
        host = self._allocate_host(mask, CACHE_OWNER)
        if host is None:
            return False
        offset, host_pages = self.num_groups, []
        for group, present in enumerate(mask):
            if not present:
                host_pages.append(NULL_PAGE)
                continue
            width = self.layouts[group].block_bytes
            self.host.arrays[group][host[group][0]].copy_(data[offset:offset + width])
            offset += width
            host_pages.append(host[group][0])
        node.host_pages = tuple(host_pages)
        self._host_resident(node)
        self._read_from_disk_now[id(node)] = origin
        return True
