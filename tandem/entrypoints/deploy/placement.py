"""Placing one replica: a placement group of one bundle per rank, packed on one node
(``STRICT_PACK``), and the replica's actor (``replica.py``) in its first bundle.

On GPUs each bundle holds one GPU; a holder actor per bundle claims it and reports its device
id, so the replica's ``tandem serve`` sees exactly the GPUs of its placement group
(``CUDA_VISIBLE_DEVICES``); the holders live as long as the replica. On CPUs a bundle holds ``cpus_per_rank`` CPUs.

``PlacedReplica`` owns the actor and the placement group: ``destroy`` removes both (the actor's
server dies with it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.entrypoints.deploy.replica import ReplicaServer

STARTING, SERVING, DRAINING = "starting", "serving", "draining"


class GpuHolder:
    """Claims one GPU of a bundle just long enough to say which one it is."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(gpu) for gpu in ray.get_gpu_ids()]


@dataclass(frozen=True)
class Placement:
    """How every replica is placed: ranks per replica, GPUs or CPUs, CPUs per rank."""
    tensor_parallel_size: int = 1
    use_gpus: bool = False
    cpus_per_rank: float = 1.0

    def bundles(self) -> list[dict]:
        bundle = {"GPU": 1, "CPU": self.cpus_per_rank} if self.use_gpus else {"CPU": self.cpus_per_rank}
        return [dict(bundle) for _ in range(self.tensor_parallel_size)]


@dataclass(eq=False)
class PlacedReplica:
    name: str
    role: str
    actor: Any
    placement_group: Any
    ready: Any  # the ObjectRef of actor.wait_ready
    started: float = field(default_factory=time.monotonic)
    state: str = STARTING
    record: Optional[dict] = None
    failed_checks: int = 0
    drain_version: int = -1
    drain_started: float = 0.0
    stopping: Any = None  # the ObjectRef of actor.stop, once sent
    holders: list = field(default_factory=list)  # GPU holder actors, killed with the replica


def place_replica(spec: dict, secret: bytes, placement: Placement, startup_timeout: float) -> PlacedReplica:
    """Reserve the replica's placement group and start its actor; ``ready`` resolves to its
    registry record once its server is healthy."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group(placement.bundles(), strategy="STRICT_PACK",
                            name=f"tandem-{spec['deployment']}-{spec['name']}")

    def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)

    holders = []
    if placement.use_gpus:
        holder = ray.remote(GpuHolder)
        holders = [holder.options(num_cpus=0, num_gpus=1, scheduling_strategy=in_bundle(index)).remote()
                   for index in range(placement.tensor_parallel_size)]
    actor_class = ray.remote(ReplicaServer)
    actor = actor_class.options(num_cpus=placement.cpus_per_rank, num_gpus=0, max_restarts=0,
                                scheduling_strategy=in_bundle(0)).remote(
        {**spec, "gpus": placement.use_gpus}, secret, *[holder.gpu_ids.remote() for holder in holders])
    return PlacedReplica(spec["name"], spec["role"], actor, group, actor.wait_ready.remote(startup_timeout),
                         holders=holders)


def destroy(replica: PlacedReplica) -> None:
    """Kill the replica's actor (its server dies with it) and free its placement group."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in (replica.actor, *replica.holders):
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            pass
    try:
        remove_placement_group(replica.placement_group)
    except Exception:  # already removed
        pass
