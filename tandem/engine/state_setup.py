"""Building a model replica's state system: the registry of the model's state specs, the
pools sized from the memory budget, and the coordinator over them.

Shared by the engine core and, under tensor parallelism, by every worker rank (each rank's
registry describes its shard; ``agree`` makes the ranks' page counts equal).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from tandem.config import EngineConfig
from tandem.engine.memory import state_memory_budget
from tandem.kv.coordinator import StateCoordinator
from tandem.kv.planner import PoolPlan, allocate_buffers, plan_pools
from tandem.kv.registry import StateRegistry
from tandem.kv.spec import KV_CACHE_DTYPES


def register_state(model: torch.nn.Module, kv_cache_dtype: str = "auto") -> StateRegistry:
    """A registry holding every state spec the model's layers declare (not yet finalized), its
    paged K/V stored as ``kv_cache_dtype`` (``--kv-cache-dtype``)."""
    registry = StateRegistry(KV_CACHE_DTYPES[kv_cache_dtype])
    for layer_name, spec in model.state_specs().items():
        registry.register(layer_name, spec)
    return registry


def build_coordinator(config: EngineConfig, device: torch.device, registry: StateRegistry, max_model_len: int,
                      speculating: bool, agree: Optional[Callable[[PoolPlan], PoolPlan]] = None
                      ) -> tuple[PoolPlan, StateCoordinator]:
    """Size the pools (``agree``: the plan every rank can hold), allocate every buffer the
    (finalized) registry names, and make the coordinator over them."""
    budget = state_memory_budget(config, device, registry, max_model_len, speculating)
    plan = plan_pools(registry, config.page_size, max_total_tokens=config.max_total_tokens,
                      memory_budget_bytes=budget, max_num_seqs=config.max_num_seqs,
                      prefix_caching=config.enable_prefix_caching, speculative=speculating,
                      layout=config.resolved_kv_cache_layout)
    if agree is not None:
        plan = agree(plan)
    allocate_buffers(registry, plan, device, config.resolved_kv_cache_layout)
    coordinator = StateCoordinator(registry, plan, enable_prefix_caching=config.enable_prefix_caching,
                                   sanitize=config.sanitizer_on)
    return plan, coordinator
