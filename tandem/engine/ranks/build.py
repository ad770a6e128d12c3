"""Building one rank: its shard of the model and of the state, in the one order every rank follows.

Rank 0 (the engine core's process) and every worker rank build through ``build_rank``; the
steps that are collectives (the pool plan, the host tier's page count, the CUDA graphs) run at
the same points on every rank because there is only this one order:

    model shard → registry (+ the draft's state specs) → pools and coordinator (agreed)
      → tiers (host pages agreed) → model runner → the rank group attached → draft bound
      → decode graphs (captured in step)

What differs by rank is named, not written twice: every rank has the same ``TierWorker`` (its
side of the tiers, applying the page operations), and rank 0 keeps the books, so its tiers are
the ``TieredState`` (which decides every copy) over its own tier worker; a draft model runs on
rank 0 alone (a worker registers its state specs only, so its groups are rank 0's), an MTP
module is sharded as the target is and runs on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from tandem.config import EngineConfig
from tandem.engine.state_setup import build_coordinator, register_state
from tandem.kv.coordinator import StateCoordinator
from tandem.kv.planner import PoolPlan
from tandem.kv.registry import StateRegistry
from tandem.kv.tiers.setup import build_tier_worker, build_tiers, host_page_count
from tandem.models.loader import build_model
from tandem.parallel.shard import TensorShard
from tandem.spec_decode import build_draft_network, draft_state_specs, engine_config_for_speculation, graph_rows, \
    speculative_tokens
from tandem.worker.cuda_graphs import decode_graph_sizes
from tandem.worker.mixed_graphs import default_mixed_graph_sizes
from tandem.worker.model_runner import ModelRunner


class RankGroup(Protocol):
    """What a rank's build does with the other ranks: its place in the group and the start-up
    agreements (each a collective every rank makes at the same point). Rank 0's is its
    executor; a worker rank's is ``WorkerGroup`` (``worker.py``)."""

    shard: TensorShard

    def agree_on_pages(self, plan: PoolPlan) -> PoolPlan: ...

    def agree_on_count(self, count: int) -> int: ...

    def attach(self, coordinator: StateCoordinator, runner: ModelRunner) -> None: ...

    def capture_graphs(self, runner: ModelRunner, batch_sizes: list[int], max_model_len: int,
                       max_num_batched_tokens: int) -> list[int]: ...

    def capture_mixed_graphs(self, runner: ModelRunner, token_sizes: list[int]) -> list[int]: ...


@dataclass
class RankParts:
    """One rank's model shard and state, as ``build_rank`` made them."""
    config: EngineConfig  # as the rank runs it (speculation turns the overlapped loop off)
    model: torch.nn.Module
    hf_config: Any
    model_info: Any
    registry: StateRegistry
    target_layers: list[str]  # the target model's state layers (a draft's come after them)
    draft: Optional[Any]  # the draft network this rank runs (spec_decode/networks.py), or None
    plan: PoolPlan
    coordinator: StateCoordinator
    tiers: Optional[Any]  # rank 0: the books, TieredState; a worker: its TierWorker; None without a host tier
    runner: ModelRunner


def build_rank(config: EngineConfig, device: torch.device, group: RankGroup, rank: int) -> RankParts:
    """Build this rank's shard (``rank`` 0 keeps the books: see the module docstring)."""
    torch.manual_seed(config.seed)
    model, hf_config, info = build_model(
        config.model, dtype=config.dtype, load_format=config.load_format, device=device,
        max_model_len=config.max_model_len, seed=config.seed, indexer_cache_dtype=config.indexer_cache_dtype,
        quantization=config.quantization, fp8_compute=config.fp8_compute, tensor_shard=group.shard)
    registry = register_state(model, config.kv_cache_dtype)
    target_layers = registry.layer_names()
    speculating = config.speculative_method is not None
    draft = None
    if speculating:
        config = engine_config_for_speculation(config, device.type) if rank == 0 else config
        draft = build_draft_network(config, model, info, device, loads_draft_model=rank == 0)
        specs = draft.state_specs() if draft is not None else draft_state_specs(config, device, info.max_model_len)
        for name, spec in specs.items():
            registry.register(name, spec)
    registry.finalize()
    plan, coordinator = build_coordinator(config, device, registry, info.max_model_len, speculating,
                                          agree=group.agree_on_pages)
    tiers = _build_tiers(config, coordinator, device, group, rank)
    runner = ModelRunner(model, coordinator, device)
    group.attach(coordinator, runner)
    if draft is not None:
        draft.bind(runner, registry)
    if not config.enforce_eager:
        rows = graph_rows(config.max_num_seqs, speculative_tokens(config, model)) if speculating \
            else config.max_num_seqs
        group.capture_graphs(runner, decode_graph_sizes(config, rows), info.max_model_len,
                             config.max_num_batched_tokens)
        if config.mixed_step_graphs:
            group.capture_mixed_graphs(runner, list(config.mixed_step_graph_sizes or
                                                    default_mixed_graph_sizes(config.max_num_batched_tokens,
                                                                              config.tensor_parallel_size > 1)))
    if speculating:
        _prepare_verification(runner, coordinator, registry, target_layers)
    return RankParts(config, model, hf_config, info, registry, target_layers, draft, plan, coordinator, tiers, runner)


def _build_tiers(config: EngineConfig, coordinator: StateCoordinator, device: torch.device, group: RankGroup,
                 rank: int):
    """The host tier (and the disk tier behind it), the same host pages on every rank (each
    holds its shard's bytes of a page): every rank's tier worker, and on rank 0 the books over
    it; None without one."""
    if not config.has_host_tier:
        return None
    host_pages = group.agree_on_count(host_page_count(config, coordinator))
    local = build_tier_worker(config, coordinator, device, host_pages, rank)
    return build_tiers(config, coordinator, local, host_pages) if rank == 0 else local


def _prepare_verification(runner: ModelRunner, coordinator: StateCoordinator, registry: StateRegistry,
                          target_layers: list[str]) -> None:
    """While speculating, the target's graphs read the target's layers only, and verification
    steps replay them as single-token rows when no target group sets pages aside."""
    runner.graph_layers = frozenset(target_layers)
    if runner.graphs is not None:
        target_groups = sorted({registry.group_of(name) for name in target_layers})
        runner.verify_as_decode_rows = not coordinator.speculation.copies_needed(target_groups)
