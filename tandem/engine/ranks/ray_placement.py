"""Where a tensor-parallel engine's ranks go on a Ray cluster: a placement group of one bundle per
rank (one GPU, or one CPU), placed with the configured strategy, whose bundle 0 is pinned to the
driver's node: rank 0 is the engine core, which runs in the driver (Ray's node-id label
selects the node). The other ranks take the remaining bundles, those on the driver's node first,
then node by node (ranks of one node adjacent, as NCCL's rings prefer).

On GPUs, rank 0 uses the GPU Ray reserved for bundle 0 (asked of a task scheduled there), so no
actor is given it; each actor sees all its node's group GPUs (as one host's worker processes do,
so NCCL finds the peer-to-peer paths between them) and uses its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from tandem.engine.ranks.ray_worker import RankPlace, describe_place

PLACEMENT_TIMEOUT_SECONDS = 120.0  # how long the cluster may take to reserve every bundle
PROBE_TIMEOUT_SECONDS = 60.0  # how long the task asking bundle 0's GPU may take
NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id


@dataclass
class Placement:
    """The reserved placement group. Owner: the ``RayExecutor`` that reserved it (removed at close)."""
    group: Any  # ray.util.placement_group.PlacementGroup
    strategy: str  # Ray's name: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    driver_node: str
    rank_bundles: list[int]  # the bundle index of each rank (rank 0: bundle 0)
    rank_nodes: list[str]  # the node id of each rank's bundle

    @property
    def spans_nodes(self) -> bool:
        return any(node != self.driver_node for node in self.rank_nodes)


def bundle_resources(device_type: str) -> dict[str, float]:
    return {"GPU": 1.0} if device_type == "cuda" else {"CPU": 1.0}


def reserve(ray, size: int, device_type: str, strategy: str) -> Placement:
    """A placement group for ``size`` ranks (``strategy``: ``EngineConfig.ray_placement_strategy``)."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    driver_node = ray.get_runtime_context().get_node_id()
    resources = bundle_resources(device_type)
    strategy = strategy.upper()
    group = placement_group([dict(resources) for _ in range(size)], strategy=strategy,
                            bundle_label_selector=[{NODE_LABEL: driver_node}] + [{} for _ in range(size - 1)])
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_SECONDS)
    if not ready:
        remove_placement_group(group)
        raise ValueError(f"tensor_parallel_size: {size} ranks need {size} bundles of {resources} on the Ray "
                         f"cluster (strategy {strategy}, rank 0's on this node, {ray.util.get_node_ip_address()}); "
                         f"none placed within {PLACEMENT_TIMEOUT_SECONDS:.0f} s (cluster: "
                         f"{ray.cluster_resources()}, available: {ray.available_resources()})")
    nodes = placement_group_table(group)["bundles_to_node_id"]
    others = sorted(range(1, size), key=lambda bundle: (nodes[bundle] != driver_node, nodes[bundle], bundle))
    rank_bundles = [0] + others
    return Placement(group=group, strategy=strategy, driver_node=driver_node, rank_bundles=rank_bundles,
                     rank_nodes=[nodes[bundle] for bundle in rank_bundles])


def release(placement: Placement) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(placement.group)


def bundle_strategy(placement: Placement, bundle: int):
    """Ray's scheduling strategy for an actor or task in ``bundle``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=placement.group, placement_group_bundle_index=bundle,
                                            placement_group_capture_child_tasks=False)


def rank_zero_place(ray, placement: Placement, device_type: str) -> RankPlace:
    """Bundle 0's place; on GPUs its GPU, from a task scheduled into it."""
    if device_type != "cuda":
        return RankPlace(node_id=placement.driver_node, address=ray.util.get_node_ip_address(), gpu_ids=(),
                         pid=os.getpid())
    probe = ray.remote(describe_place).options(num_cpus=0, num_gpus=1,
                                               scheduling_strategy=bundle_strategy(placement, 0))
    place = ray.get(probe.remote(), timeout=PROBE_TIMEOUT_SECONDS)
    return RankPlace(node_id=place.node_id, address=place.address, gpu_ids=place.gpu_ids, pid=os.getpid())


def node_gpu_lists(places: list[RankPlace]) -> dict[str, list[str]]:
    """Each node's group GPUs, in ascending id order (every rank of a node sees this list)."""
    lists: dict[str, list[str]] = {}
    for place in places:
        lists.setdefault(place.node_id, []).extend(place.gpu_ids)
    return {node: sorted(set(ids), key=lambda gpu: (len(gpu), gpu)) for node, ids in lists.items()}


def rank_devices(places: list[RankPlace]) -> list[tuple[Optional[str], Optional[int]]]:
    """Per rank: its CUDA_VISIBLE_DEVICES (its node's group GPUs) and its GPU's index among them;
    ``(None, None)`` for a rank without a GPU."""
    lists = node_gpu_lists(places)
    devices: list[tuple[Optional[str], Optional[int]]] = []
    for place in places:
        visible = lists[place.node_id]
        devices.append((",".join(visible), visible.index(place.gpu_ids[0])) if place.gpu_ids else (None, None))
    return devices


def local_gpu_index(gpu_id: str, visible: Optional[str]) -> int:
    """The index in this process of the GPU Ray calls ``gpu_id`` (``visible``: this process's
    CUDA_VISIBLE_DEVICES, None when unset: every GPU, by id)."""
    if visible is None:
        return int(gpu_id)
    ids = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if gpu_id not in ids:
        raise ValueError(f"distributed_executor_backend: Ray reserved GPU {gpu_id} for rank 0, which "
                         f"CUDA_VISIBLE_DEVICES={visible} hides from the engine process")
    return ids.index(gpu_id)
