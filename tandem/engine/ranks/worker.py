"""A worker rank (1 .. N-1): its shard of the model and of the state, driven by rank 0's plans.

The process rank 0 starts (``launcher.py``). It joins the groups first (so a failure after that
reaches rank 0 through the collectives), builds its shard exactly as rank 0 builds its own (same
config, its own rank), agrees on the page counts (and the host tier's), then loops: receive a
plan, apply its page operations to this rank's shard through the same ``PageExecutor`` rank 0
applied them with (``kv/page_operations.py``; the tiers' kinds through this rank's ``TierWorker``), run
the forward pass (replaying the CUDA graph the plan names: every rank captures the same ones at
start-up, ``graphs.py``). It samples nothing and keeps no scheduler: its page tables arrive in
every plan. It exits on a STOP plan; if rank 0 dies, the kernel kills it (``PR_SET_PDEATHSIG``)
and a pending collective fails. With a PD role it also has its own transfer agent, which TRANSFER
plans drive instead of a forward pass (``pd_ranks.py``). With an MTP draft (sharded as the
target) it runs the draft's passes too, as DRAFT plans name them.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import torch

from tandem.config import EngineConfig

logger = logging.getLogger("tandem.parallel")


def main() -> None:
    """``python -m tandem.engine.ranks.worker RANK SIZE PORT LOG_LEVEL``, the config (JSON) on stdin."""
    from tandem.engine.ranks.launcher import config_from_json

    rank, size, port = (int(value) for value in sys.argv[1:4])
    run_worker(config_from_json(sys.stdin.buffer.read()), rank, size, port, sys.argv[4])


def run_worker(config: EngineConfig, rank: int, size: int, port: int, log_level: str = "info") -> None:
    from tandem.engine.memory import resolve_device
    from tandem.engine.process import die_with_parent, wait_passively_between_parallel_regions
    from tandem.parallel.group import join, rank_device

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop (a STOP plan)
    die_with_parent()
    wait_passively_between_parallel_regions()
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    groups = join(rank, size, device, port=port, custom_all_reduce=not config.disable_custom_all_reduce)
    serve_plans(config, groups, device)


def serve_plans(config: EngineConfig, groups, device: torch.device) -> None:
    from tandem.engine.ranks.plan import PlanChannel

    rank = WorkerRank(config, groups, device)
    channel = PlanChannel(groups.control, groups.rank)
    logger.info("tensor-parallel rank %d of %d ready on %s", groups.rank, groups.size, device)
    while rank.serve(channel.receive()):
        pass


class WorkerGroup:
    """A worker rank's side of the start-up agreements (``build.RankGroup``), over the control
    group: the same collectives, in the same order, as rank 0's executor makes them."""

    def __init__(self, groups) -> None:
        self.groups = groups
        self.shard = groups.shard

    def agree_on_pages(self, plan):
        from tandem.engine.ranks.launcher import agree_on_pages

        return agree_on_pages(plan, self.groups.control)

    def agree_on_count(self, count: int) -> int:
        from tandem.engine.ranks.launcher import agree_on_count

        return agree_on_count(count, self.groups.control)

    def attach(self, coordinator, runner) -> None:
        return None  # rank 0's plans drive this rank: nothing of its own is handed on

    def capture_graphs(self, runner, batch_sizes: list[int], max_model_len: int,
                       max_num_batched_tokens: int) -> list[int]:
        from tandem.parallel.graphs import capture_on_every_rank

        return capture_on_every_rank(runner, self.groups, batch_sizes, max_model_len, max_num_batched_tokens)


class WorkerRank:
    """This rank's shard of the model and of the state (``build_rank``, as rank 0 builds its
    own), and what each kind of plan makes it do."""

    def __init__(self, config: EngineConfig, groups, device: torch.device) -> None:
        from tandem.disagg.pd_ranks import WorkerTransfers
        from tandem.engine.ranks.build import build_rank

        self.groups = groups
        parts = build_rank(config, device, WorkerGroup(groups), rank=groups.rank)
        self.coordinator, self.tiers, self.runner = parts.coordinator, parts.tiers, parts.runner
        self.pages = self.coordinator.outbox.executor  # this rank's page executor (rank 0's: the same class)
        # A draft model runs on rank 0 alone: its state groups exist here too (the same group
        # ids), unused; its layers' loads (registered here too) are waited for after each
        # forward pass. An MTP module is sharded as the target is: this rank runs its passes.
        self.network = parts.draft
        self.unread_layers = ([] if self.network is not None else
                              [name for name in parts.registry.layer_names() if name not in self.runner.graph_layers])
        # PD: this rank's own transfer agent (pd_ranks.py), made last, as rank 0 makes its PD side
        self.transfers = WorkerTransfers(config, groups, parts.registry) if config.transfer is not None else None

    def serve(self, plan) -> bool:
        """Carry out one plan; False once it was the STOP plan."""
        from tandem.engine.ranks.launcher import agree_on_count
        from tandem.engine.ranks.plan import DISK, DRAFT, PAGES, RPC, STOP, TRANSFER
        from tandem.spec_decode.draft_batch import run_planned_rows

        self.pages.apply_all(plan.page_operations)
        if self.tiers is not None:
            self.tiers.poll()
        if plan.kind == STOP:
            self.runner.release_graphs()  # before the process group goes (runner.release_graphs)
            if self.transfers is not None:
                self.transfers.close()
            if self.tiers is not None:
                self.tiers.close()  # (queued store writes finish first)
            return False
        if plan.kind == TRANSFER:
            self.transfers.serve(plan.transfer_operations)
        elif plan.kind == DISK:  # how many of the pages this rank has; every rank takes the fewest
            self.tiers.keep(agree_on_count(self.tiers.readable(plan.disk_keys), self.groups.control))
        elif plan.kind == RPC:
            self._answer(plan.rpc_method, msgspec.msgpack.decode(plan.rpc_arguments))
        elif plan.kind == DRAFT:
            run_planned_rows(self.runner, self.network, plan.step_inputs(), plan.inputs_from_root, plan.hidden_dtype)
        elif plan.kind != PAGES:
            self.runner.execute_plan(plan.step_inputs(), plan.prompt_logit_ranges, plan.inputs_from_root,
                                     plan.graph_size)
            for name in self.unread_layers:  # (after the forward pass: its own layers load first)
                self.coordinator.pending_loads.wait(name)
        return True

    def _answer(self, method: str, arguments: list) -> None:
        """This rank's answer to a ``collective_rpc`` (gathered by rank 0)."""
        from tandem.engine.ranks.executor import RankContext, rank_call
        from tandem.parallel.group import exchange

        answer = rank_call(method)(RankContext(self.coordinator, self.runner), *arguments)
        exchange(self.groups.control, msgspec.msgpack.encode(answer))


if __name__ == "__main__":
    main()
