"""Building the tiers from the engine's options: host pool size, write policy, the disk store
and its layout fingerprint.

The fingerprint names everything that makes a stored page meaningful: the model's identity
(its ``config.json`` and a sample of its weight files, or the seed of dummy weights), the
weights' quantization options (FP8 at load, FP8 or dequantized products: the K/V they compute
differ), the state dtype per buffer, the page size and the ordered buffer list. A disk page written under
another fingerprint never hits.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.kv.tiers.hierarchy import TieredState
from tandem.kv.tiers.host_pool import layouts_of, node_bytes
from tandem.kv.tiers.tier_worker import TierWorker

if TYPE_CHECKING:
    from tandem.config import EngineConfig
    from tandem.kv.coordinator import StateCoordinator

logger = logging.getLogger(__name__)

GIB = 1 << 30
WEIGHT_SAMPLE_BYTES = 1 << 20


def model_identity(model_dir: str, load_format: str, seed: int) -> str:
    """A digest of the model's config and weights: the config file, each weight file's name
    and size and its first MiB (random weights differ there), or the dummy weights' seed."""
    digest = hashlib.blake2b(digest_size=16)
    path = Path(model_dir)
    config = path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    if load_format == "dummy":
        digest.update(f"dummy weights, seed {seed}".encode())
    else:
        for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
            with open(weights, "rb") as handle:
                digest.update(handle.read(WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()


def layout_fingerprint_parts(config: "EngineConfig", coordinator: "StateCoordinator") -> list[object]:
    # The quantization options: a checkpoint's own quantization is in the weights' identity, an
    # online one (and how quantized weights compute) only here.
    return [model_identity(config.model, config.load_format, config.seed), config.dtype,
            f"quantization={config.quantization}/{config.quantized_compute}",
            coordinator.page_size, coordinator.registry.describe()]


def host_page_count(config: "EngineConfig", coordinator: "StateCoordinator") -> int:
    """Host pages (one page of every group each) that ``host_cache_size`` holds; a disk directory
    without a host size: as many as the device pool."""
    per_node = max(node_bytes(layouts_of(coordinator.registry)), 1)
    if config.host_cache_size > 0:
        host_pages = int(config.host_cache_size * GIB) // per_node
    else:
        host_pages = coordinator.plan.num_pages - 1
    if host_pages < 1:
        raise ValueError(f"host_cache_size: {config.host_cache_size} GB holds no page "
                         f"({per_node} bytes per page of every group)")
    return host_pages


def store_location(config: "EngineConfig", rank: int = 0) -> str:
    """Where this rank's store lives: ``disk_cache_dir``, or under tensor parallelism a directory
    of its own in it per rank (``tp2-rank1``: its shard of each page; engines of the same size
    naming the same directory share each rank's)."""
    location = config.disk_cache_dir
    if config.tensor_parallel_size > 1:
        location = os.path.join(location.removeprefix("file://"), f"tp{config.tensor_parallel_size}-rank{rank}")
    return location


def open_disk_store(config: "EngineConfig", coordinator: "StateCoordinator", rank: int = 0):
    """This rank's page store (logged and left unavailable when it cannot be used)."""
    from tandem.kv.keys import layout_fingerprint
    from tandem.kv.tiers.store import open_store

    disk = open_store(store_location(config, rank), int(config.disk_cache_size * GIB),
                      layout_fingerprint(layout_fingerprint_parts(config, coordinator)),
                      origin=config.transfer.role if config.transfer is not None else "colocated")
    # Test hook (zero in production): each store write waits this long first, so a test can
    # kill a server while its writes are in flight.
    disk.write_delay_s = float(os.environ.get("TANDEM_TEST_STORE_WRITE_DELAY", "0") or 0)
    if not disk.available:
        logger.warning("disk tier off, serving without it: %s", disk.disabled_reason)
    elif config.transfer is not None and config.transfer.role == "decode" and not config.decode_offload:
        # A decode server reads the shared store (prefix hits at binding) but writes to it
        # only with decode offload.
        disk.writes_enabled = False
        disk.write_disabled_reason = "a decode server writes to the shared store only with --decode-offload"
    return disk


def build_tier_worker(config: "EngineConfig", coordinator: "StateCoordinator", device: torch.device,
                      host_pages: int, rank: int = 0) -> TierWorker:
    """This rank's side of the tiers (every rank's, rank 0's included): ``host_pages`` host pages
    (``host_page_count``, the smallest any rank proposed: each holds its shard's bytes), its tier
    stream and its own disk store; attached to the coordinator's page executor."""
    disk = open_disk_store(config, coordinator, rank) if config.disk_cache_dir else None
    worker = TierWorker(coordinator, host_pages, device, disk)
    coordinator.outbox.executor.attach_tiers(worker)
    return worker


def build_tiers(config: "EngineConfig", coordinator: "StateCoordinator", local: TierWorker,
                host_pages: int) -> TieredState:
    """The tiers' books (the engine core's), over this rank's tier worker ``local``."""
    per_node = node_bytes(layouts_of(coordinator.registry))
    tiers = TieredState(coordinator, local, host_pages=host_pages, write_policy=config.host_cache_write_policy)
    logger.info("host tier: %d pages (%.2f GB, %s)%s", host_pages, host_pages * per_node / GIB,
                config.host_cache_write_policy,
                f"; disk tier: {config.disk_cache_dir} (cap {config.disk_cache_size} GB)"
                if tiers.disk is not None else "")
    return tiers
