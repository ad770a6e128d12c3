"""The Ray executor: ranks 1..N-1 of a tensor-parallel engine as Ray actors, across the nodes of a
Ray cluster (``distributed_executor_backend="ray"``, vLLM's name).

Owner: the engine core (rank 0, in the Ray driver: the engine process) creates one before it
builds its model and closes it at shutdown. Start-up:

1. join the cluster at ``RAY_ADDRESS`` (``ray.init()``: a local cluster when none is named, shut
   down again at close) unless this process has joined one already;
2. reserve a placement group of one bundle per rank, bundle 0 on this node (``ray_placement.py``);
3. start one ``TensorParallelRank`` actor per further rank in its bundle (``ray_worker.py``: the
   ``Worker`` every rank runs), each with the environment every rank reads (the
   sanitizer, NCCL's and gloo's settings), and ask where each landed;
4. open the TCP store (on loopback when every rank is on this node, else on this node's address
   as Ray knows it) and start each actor's long-running ``run`` call: it joins the group and
   serves plans; rank 0 joins here.

From then on it is the multiprocess executor's plan half (every step's message over the control
group, collective calls, the page operations): only starting, watching and stopping the ranks
differ. Lifecycle when an actor dies: a watcher thread waiting on the actors' ``run`` calls
notices at once, marks the group failed and kills the other actors; rank 0's next (or pending)
collective fails and the engine ends, as with a dead worker process (``launcher.py``; on CUDA the
engine process exits if a collective may still wait on the dead rank). ``close`` sends the STOP
plan, kills the actors and removes the placement group. If the engine process dies, Ray ends
its actors and placement group with it (they belong to its job). The actors' logs reach the
driver's (Ray forwards them).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tandem.config import RAY_MISSING, EngineConfig
from tandem.kv.planner import PoolPlan
from tandem.engine.process import with_sleeping_openmp_threads
from tandem.engine.ranks.launcher import (CUDA_HANG_GRACE_SECONDS, STOP_TIMEOUT_SECONDS, MultiprocessExecutor,
                                          RankFailure, config_to_json)
from tandem.kv.page_operations import Outbox
from tandem.engine.ranks.plan import STOP, PlanChannel, StepPlan
from tandem.engine.ranks.ray_placement import (Placement, bundle_strategy, local_gpu_index, rank_devices,
                                               rank_zero_place, release, reserve)
from tandem.engine.ranks.ray_worker import RankLaunch, RankPlace, TensorParallelRank
from tandem.models.loader import check_tensor_parallel
from tandem.parallel.group import LOOPBACK, join, open_store

logger = logging.getLogger("tandem.parallel")

START_TIMEOUT_SECONDS = 300.0  # how long an actor may take to start (a fresh worker process, imports)
FAILURE_REPORT_SECONDS = 5.0  # after a broken collective: how long the watcher may take to say why
# What every rank reads from the environment, handed to each actor (a worker process inherits
# it). Secrets stay out: Ray records an actor's runtime environment where the cluster shows it.
FORWARDED_PREFIXES = ("TANDEM_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "TRITON_", "NVSHMEM_", "UCX_", "NIXL_",
                      "OMP_WAIT_POLICY")
SECRET_VARIABLES = frozenset({"TANDEM_PD_SECRET", "TANDEM_API_KEY"})


def import_ray():
    try:
        import ray
    except ImportError as error:
        raise ValueError(f"distributed_executor_backend: {RAY_MISSING} ({error})") from None
    return ray


def forwarded_environment() -> dict[str, str]:
    """The actors' environment variables: this process's settings the ranks share; idle OpenMP
    threads sleep unless told otherwise (``process.with_sleeping_openmp_threads``)."""
    return with_sleeping_openmp_threads({name: value for name, value in os.environ.items()
                                         if name.startswith(FORWARDED_PREFIXES) and name not in SECRET_VARIABLES})


def join_cluster(ray) -> bool:
    """Join the Ray cluster at RAY_ADDRESS (a new local one when unset); True when this call
    joined it (and close leaves it), False when this process had already."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or None
    if address is not None and address.startswith("ray://"):
        raise ValueError(f"distributed_executor_backend: rank 0 runs in the engine process, which must be on a "
                         f"node of the Ray cluster: set RAY_ADDRESS to its head (host:port), not a Ray client "
                         f"address ({address})")
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    return True


@dataclass
class StartedOnCluster:
    """What an executor started on the Ray cluster; ``_release`` ends it all, once."""
    owns_ray: bool  # this executor joined the cluster (``join_cluster``): it leaves it too
    placement: Optional[Placement] = None
    actors: list = field(default_factory=list)  # rank r's actor at r - 1


def place_ranks(ray, size: int, device_type: str, strategy: str, started: StartedOnCluster) -> list[RankPlace]:
    """Reserve the placement group and start one actor per further rank in its bundle (both
    recorded in ``started``, which releases them); every rank's place, in rank order."""
    started.placement = placement = reserve(ray, size, device_type, strategy)
    cuda = device_type == "cuda"
    actor_class = ray.remote(TensorParallelRank)
    for rank in range(1, size):
        options = actor_class.options(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0,
                                      scheduling_strategy=bundle_strategy(placement, placement.rank_bundles[rank]),
                                      runtime_env={"env_vars": forwarded_environment()})
        started.actors.append(options.remote())
    rank_zero = rank_zero_place(ray, placement, device_type)
    try:
        return [rank_zero] + ray.get([actor.describe.remote() for actor in started.actors],
                                     timeout=START_TIMEOUT_SECONDS)
    except Exception as error:
        raise RuntimeError(f"tensor_parallel_size: the Ray actors of ranks 1..{size - 1} did not start "
                           f"({type(error).__name__}: {first_line(error)})") from error


class RayExecutor(MultiprocessExecutor):
    """Ranks 1..N-1 as Ray actors (rank 0 is the engine core's process, the Ray driver). The
    plan half is the multiprocess executor's; the ranks' start, watch and stop are Ray's."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        ray = import_ray()
        size = config.tensor_parallel_size
        self.world_size = size
        self.context = None
        self.failed: Optional[str] = None
        self._closing = threading.Event()
        check_tensor_parallel(config.model, size, max_model_len=config.max_model_len,
                              indexer_cache_dtype=config.indexer_cache_dtype, quantization=config.quantization)
        self._runs: list[Any] = []  # the actors' ``run`` calls (ObjectRefs), in rank order
        self.started = StartedOnCluster(owns_ray=join_cluster(ray))
        # Whoever drops this object without closing it (a failed engine start) still ends the
        # actors and the placement group; the watcher holds only a weak reference.
        self._finalizer = weakref.finalize(self, _release, ray, self.started)
        try:
            places = place_ranks(ray, size, device.type, config.ray_placement_strategy, self.started)
            self.device = self._rank_zero_device(places[0], device)
            self._start_group(ray, config, places)
        except BaseException:
            self._closing.set()
            self._finalizer()
            raise

    @property
    def actors(self) -> list:
        """The actors of ranks 1..N-1, in rank order."""
        return self.started.actors

    @property
    def placement(self) -> Optional[Placement]:
        return self.started.placement

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> "RayExecutor":
        return cls(config, device)

    def _rank_zero_device(self, place: RankPlace, device: torch.device) -> torch.device:
        """Rank 0's device: on CUDA the GPU Ray reserved for bundle 0 (made current)."""
        if device.type != "cuda":
            return device
        (gpu_id,) = place.gpu_ids
        rank_zero = torch.device("cuda", local_gpu_index(gpu_id, os.environ.get("CUDA_VISIBLE_DEVICES")))
        torch.cuda.set_device(rank_zero)
        return rank_zero

    def _start_group(self, ray, config: EngineConfig, places: list[RankPlace]) -> None:
        """The store, every actor's ``run`` call, the watcher; then rank 0 joins."""
        spans = self.placement.spans_nodes
        store_host = places[0].address if spans else LOOPBACK
        store, port = open_store(self.world_size, store_host)
        config_json = config_to_json(config.with_changes(sanitize=config.sanitizer_on))
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        devices = rank_devices(places)
        for rank, (actor, place) in enumerate(zip(self.actors, places[1:]), start=1):
            visible, index = devices[rank]
            launch = RankLaunch(config_json=config_json, rank=rank, size=self.world_size, store_host=store_host,
                                store_port=port, address=place.address if spans else LOOPBACK, log_level=log_level,
                                visible_devices=visible, device_index=index)
            self._runs.append(actor.run.remote(launch))
        self.places = places
        self._watcher = threading.Thread(target=_watch, args=(ray, weakref.ref(self), list(self._runs), self._closing),
                                         name="tandem-ray-watch", daemon=True)
        self._watcher.start()
        logger.info("tensor-parallel ranks on Ray: placement group %s (%s), %s",
                    self.placement.group.id.hex(), self.placement.strategy,
                    ", ".join(f"rank {rank} on {place.address} node {place.node_id[:8]} pid {place.pid}"
                              + (f" GPU {place.gpu_ids[0]}" if place.gpu_ids else "")
                              for rank, place in enumerate(places)))
        self.groups = join(0, self.world_size, self.device, store=store, address=store_host,
                           custom_all_reduce=not config.disable_custom_all_reduce)
        self.shard = self.groups.shard
        self.channel = PlanChannel(self.groups.control, 0)
        self.outbox: Optional[Outbox] = None  # rank 0's coordinator's, once attached
        self.worker = None  # rank 0's Worker (worker.py), once attached
        self.graph_sizes: list[int] = []

    # The start-up agreements: a rank whose build failed (a node without the model directory)
    # breaks them; its own error, which the watcher records, says more than the broken socket.
    def agree_on_pages(self, plan: PoolPlan) -> PoolPlan:
        return self._naming_the_failed_rank(super().agree_on_pages, plan)

    def agree_on_count(self, count: int) -> int:
        return self._naming_the_failed_rank(super().agree_on_count, count)

    def capture_graphs(self, runner, batch_sizes: list[int], max_model_len: int, max_num_batched_tokens: int):
        return self._naming_the_failed_rank(super().capture_graphs, runner, batch_sizes, max_model_len,
                                            max_num_batched_tokens)

    def capture_mixed_graphs(self, runner, token_sizes: list[int]):
        return self._naming_the_failed_rank(super().capture_mixed_graphs, runner, token_sizes)

    def _naming_the_failed_rank(self, collective, *arguments):
        try:
            return collective(*arguments)
        except RuntimeError as error:
            deadline = time.monotonic() + FAILURE_REPORT_SECONDS
            while self.failed is None and time.monotonic() < deadline and self._watcher.is_alive():
                time.sleep(0.05)
            if self.failed is not None:
                raise RankFailure(self.failed) from error
            raise

    @property
    def worker_pids(self) -> list[int]:
        """The actors' process ids (each on its own node)."""
        return [place.pid for place in self.places[1:]]

    def fail(self, reason: str) -> None:
        """Rank 0 cannot finish a step the actors started: stop them; later steps raise."""
        if self.failed is None:
            self.failed = f"tensor_parallel_size: {reason}; the engine cannot continue"
            logger.error("%s", self.failed)
        self._closing.set()
        _kill_actors(import_ray(), self.actors)

    def close(self) -> None:
        """The STOP plan, then the actors killed, the placement group removed (and the cluster
        left, when this executor joined it)."""
        if not self._finalizer.alive:
            return
        self._closing.set()
        ray = import_ray()
        if self.failed is None:
            try:
                self.channel.send(StepPlan(STOP, self.page_operations()))  # (the last page operations: disk writes)
                self.channel.settle()
                ray.wait(self._runs, num_returns=len(self._runs), timeout=STOP_TIMEOUT_SECONDS)
            except RuntimeError:  # an actor died meanwhile: it is killed below
                logger.warning("tensor-parallel actors did not take the stop plan")
        _kill_actors(ray, self.actors)
        self._watcher.join(timeout=STOP_TIMEOUT_SECONDS)  # (its wait ends with the actors)
        self._finalizer()


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _kill_actors(ray, actors: list) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # (already dead, or the cluster is gone)
            pass


def _release(ray, started: StartedOnCluster) -> None:
    """Kill the actors, remove the placement group, leave the cluster if the executor joined it."""
    if not ray.is_initialized():  # (the cluster is gone, and everything on it)
        return
    _kill_actors(ray, started.actors)
    if started.placement is not None:
        release(started.placement)
    if started.owns_ray:
        ray.shutdown()


def _watch(ray, owner: "weakref.ref[RayExecutor]", runs: list, closing: threading.Event) -> None:
    """The watcher thread: the first ``run`` call to end, unless asked to, fails the group."""
    try:
        (ended,), _ = ray.wait(runs, num_returns=1)
    except Exception:  # the cluster went away (Ray shut down): whoever did that is closing
        return
    group = owner()
    if closing.is_set() or group is None:
        return
    rank = runs.index(ended) + 1
    try:
        ray.get(ended)
        outcome = "returned without a STOP plan"
    except ray.exceptions.RayActorError as error:  # the actor's process or node is gone
        outcome = f"died ({type(error).__name__}: {first_line(error)})"
    except Exception as error:  # its call raised (a shard that failed to build, ...): the cause
        cause = getattr(error, "cause", None) or error
        outcome = f"failed ({type(cause).__name__}: {first_line(cause)})"
    place = group.places[rank]
    group.failed = (f"tensor_parallel_size: rank {rank} (Ray actor, pid {place.pid} on {place.address}) {outcome}; "
                    f"the engine cannot continue")
    logger.error("%s", group.failed)
    _kill_actors(ray, group.actors)
    cuda = group.device.type == "cuda"
    del group
    if cuda and not closing.wait(CUDA_HANG_GRACE_SECONDS):
        logger.error("ending the engine process: a collective may be waiting on the dead rank")
        os._exit(1)
