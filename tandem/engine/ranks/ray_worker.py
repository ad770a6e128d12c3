"""A worker rank in a Ray actor: the same ``Worker`` a worker process of the multiprocess
executor runs, and rank 0 too (``worker.py``: ``serve_plans``), in the bundle of the placement group that
``RayExecutor`` (``ray_executor.py``) gave it.

The executor makes two calls on each actor. ``describe`` says where Ray put it (node, address,
GPU) once it has loaded the worker's modules. ``run`` joins the rank group (the store at rank 0's address, gloo on this node's address,
NCCL between GPUs) and serves rank 0's plans until the STOP plan: the long-running call whose end,
or the actor's death, the executor's watcher waits on. The config arrives as the JSON a worker
process reads on its standard input (a PD role's secret included: through Ray, never on a
command line); what every rank reads from the environment (the sanitizer, NCCL's and gloo's
settings) arrives as the actor's runtime environment.

This module is imported in the actor (Ray unpickles the class by reference): it imports torch
and Ray only inside the calls.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RankPlace:
    """Where Ray put one actor (or, for rank 0, the bundle on the driver's node)."""
    node_id: str
    address: str  # the node's IP address, as Ray knows it
    gpu_ids: tuple[str, ...]  # the GPUs Ray assigned (ids as in the node's CUDA_VISIBLE_DEVICES); () on a CPU
    pid: int = 0


@dataclass(frozen=True)
class RankLaunch:
    """What one rank needs to join the group and build its shard."""
    config_json: bytes  # launcher.config_to_json
    rank: int
    size: int
    store_host: str  # where rank 0's TCP store listens
    store_port: int
    address: str  # this rank's own address for gloo (its node's, or loopback on a one-node group)
    log_level: str
    visible_devices: Optional[str] = None  # CUDA_VISIBLE_DEVICES for the rank (its node's group GPUs)
    device_index: Optional[int] = None  # its GPU among ``visible_devices``; None on a CPU


def describe_place() -> RankPlace:
    """The calling worker's place (in an actor or a task Ray scheduled)."""
    import ray

    context = ray.get_runtime_context()
    return RankPlace(node_id=context.get_node_id(), address=ray.util.get_node_ip_address(),
                     gpu_ids=tuple(str(gpu) for gpu in ray.get_gpu_ids()), pid=os.getpid())


class TensorParallelRank:
    """One rank (1 .. N-1) of a tensor-parallel engine. Owner: the ``RayExecutor`` that created
    the actor; it kills the actor at close (or when any rank fails)."""

    def describe(self) -> RankPlace:
        """Where Ray put this actor. It also loads what ``run`` needs (torch, tandem's worker
        modules; no CUDA yet), so a node without them fails here, reported at start-up, rather
        than after rank 0 began waiting for the group to form."""
        import torch  # noqa: F401

        import tandem.engine.ranks.launcher  # noqa: F401  (the model loader, the plans, the group)
        import tandem.engine.ranks.worker  # noqa: F401

        return describe_place()

    def run(self, launch: RankLaunch) -> None:
        """Join the group and serve rank 0's plans until the STOP plan."""
        if launch.visible_devices is not None:  # before anything initializes CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = launch.visible_devices
        import torch

        from tandem.engine.ranks.launcher import config_from_json
        from tandem.engine.ranks.worker import serve_plans
        from tandem.parallel.group import join

        logging.basicConfig(level=launch.log_level.upper(), force=True,
                            format=f"%(asctime)s %(levelname)s rank{launch.rank} %(name)s: %(message)s")
        config = config_from_json(launch.config_json)
        if launch.device_index is not None:
            device = torch.device("cuda", launch.device_index)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(assigned_cpus())
        groups = join(launch.rank, launch.size, device, port=launch.store_port, store_host=launch.store_host,
                      address=launch.address, custom_all_reduce=not config.disable_custom_all_reduce)
        serve_plans(config, groups, device)


def assigned_cpus() -> int:
    """The CPUs Ray assigned this actor (its bundle's): the rank's torch threads."""
    import ray

    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
