"""The books on hand-built inputs: a state registry, coordinator and scheduler over the specs a
test names, with no model behind them (CPU buffers, sanitizer on), and sequences to feed them."""
from __future__ import annotations

import torch

from tandem.kv.coordinator import StateCoordinator
from tandem.kv.planner import allocate_buffers, plan_pools
from tandem.kv.registry import StateRegistry
from tandem.kv.spec import FullAttentionSpec, RecurrentSpec, SlidingWindowSpec, StateSpec
from tandem.sampling_params import SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.sequence import Sequence

# Tiny specs of each token-paged and per-sequence kind.
FULL = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)
SLIDING = SlidingWindowSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, window=6)
RECURRENT = RecurrentSpec(conv_shape=(3, 2), conv_dtype=torch.float32, ssm_shape=(2, 2), ssm_dtype=torch.float32)


def make_coordinator(specs: dict[str, StateSpec], *, page_size: int = 4, max_total_tokens: int = 64,
                     max_num_seqs: int = 8, prefix_caching: bool = False) -> StateCoordinator:
    """A coordinator over one layer per entry of ``specs`` (layer name -> spec), its buffers on
    the CPU, the sanitizer on (freed and never-written pages read as poison)."""
    registry = StateRegistry()
    for layer_name, spec in specs.items():
        registry.register(layer_name, spec)
    registry.finalize()
    plan = plan_pools(registry, page_size, max_total_tokens=max_total_tokens, memory_budget_bytes=None,
                      max_num_seqs=max_num_seqs, prefix_caching=prefix_caching)
    allocate_buffers(registry, plan, torch.device("cpu"))
    return StateCoordinator(registry, plan, enable_prefix_caching=prefix_caching, sanitize=True)


def make_scheduler(coordinator: StateCoordinator, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                   **options) -> Scheduler:
    return Scheduler(coordinator, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     **options)


def make_sequence(coordinator: StateCoordinator, name: str, prompt: list[int], order: int,
                  max_tokens: int = 8) -> Sequence:
    """Sequence 0 of request ``name``, waiting, with an empty state owned by ``name#0``."""
    return Sequence(request_id=name, index=0, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                    params=SamplingParams(max_tokens=max_tokens), state=coordinator.new_state(f"{name}#0"),
                    arrival_order=order, max_tokens=max_tokens)


def write_page(coordinator: StateCoordinator, group_id: int, page: int, value: float) -> None:
    """Fill ``page`` of every buffer of the group with ``value`` (what a forward pass would write)."""
    for descriptor in coordinator.registry.buffers(group_id):
        descriptor.tensor[page].fill_(value)


def page_holds(coordinator: StateCoordinator, group_id: int, page: int, value: float) -> bool:
    """Whether every element of ``page`` in every buffer of the group equals ``value`` (NaN:
    whether the page is poisoned, as the sanitizer leaves a freed page)."""
    def equal(tensor: torch.Tensor) -> bool:
        return bool(tensor.isnan().all()) if value != value else bool((tensor == value).all())
    return all(equal(descriptor.tensor[page]) for descriptor in coordinator.registry.buffers(group_id))


def check_books(coordinator: StateCoordinator, states) -> None:
    """I5 for the live ``states``: every page's holders are exactly what they, the prefix cache
    and in-flight operations account for."""
    coordinator.sanitizer.check_books(coordinator, states)
