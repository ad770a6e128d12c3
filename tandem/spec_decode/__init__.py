"""Speculative decoding: a draft proposes ``k`` tokens, one target forward pass verifies them.

Drafts: a DeepSeek-V3 / V3.2 / GLM-5 checkpoint's next-n (MTP) layer (``speculative_method=
"mtp"``), or a smaller model with the same vocabulary (``"draft"``, ``speculative_model``).
Either declares its state (MLA latents and indexer keys; a draft model's KV or recurrent
state) as ordinary specs in the target's registry, so prefix caching, preemption, PD transfer,
host copies and the sanitizer carry it as they carry the target's, with no draft-specific code.

- ``networks.py``   the two drafts and how their state is named in the registry
- ``proposer.py``   the draft's catch-up with the target and its chain of proposals (the books)
- ``draft_pass_plan.py`` the proposer's host-only messages to rank 0's worker: a draft pass,
                    the end of a proposal
- ``rank_drafts.py`` rank 0's worker's side: runs the passes, draws, keeps the drafts so far
                    and an MTP layer's carried hidden states
- ``draft_batch.py`` a draft forward pass over rows of several sequences
- ``verify.py``     greedy acceptance and rejection sampling (exact target distribution): the
                    verification message rank 0's worker runs (``worker/rank_verification.py``)
- ``step.py``       the engine step while speculating
- ``state.py``      what is kept per sequence; ``metrics.py`` the counters

Owner: ``Speculator``, built by the engine core when its config asks for speculation.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from tandem.config import EngineConfig
from tandem.protocol import RequestDelta, SpeculationStats
from tandem.scheduler.sequence import Sequence
from tandem.spec_decode.metrics import SpeculationMetrics
from tandem.spec_decode.networks import DraftModelNetwork, MTPNetwork
from tandem.spec_decode.proposer import DraftModelProposer, MTPProposer
from tandem.spec_decode.step import SpeculativeStep
from tandem.spec_decode.verify import Verifier
from tandem.step_context import StepContext

logger = logging.getLogger(__name__)

SIMULATE_ACCEPT_LENGTH_VARIABLE = "TANDEM_SIMULATE_ACCEPT_LEN"

__all__ = ["Speculator", "build_draft_network", "draft_state_specs", "engine_config_for_speculation", "graph_rows",
           "simulated_accept_length", "speculative_tokens"]


def simulated_accept_length() -> Optional[float]:
    """``TANDEM_SIMULATE_ACCEPT_LEN`` (a mean acceptance length >= 1), or None when unset."""
    value = os.environ.get(SIMULATE_ACCEPT_LENGTH_VARIABLE, "")
    if not value:
        return None
    try:
        length = float(value)
    except ValueError:
        length = float("nan")
    if not length >= 1:
        raise ValueError(f"{SIMULATE_ACCEPT_LENGTH_VARIABLE}: must be a number >= 1, got {value!r}")
    return length


def speculative_tokens(config: EngineConfig, target) -> int:
    """Draft tokens per step: ``num_speculative_tokens``, or with MTP by default one per module."""
    if config.speculative_method == "mtp":
        return config.num_speculative_tokens or len(target.next_n_layers())
    return config.num_speculative_tokens


def graph_rows(max_num_seqs: int, num_speculative_tokens: int) -> int:
    """The most single-token rows a graph replays while speculating: ``k + 2`` per sequence
    (a verification's known token and ``k`` drafts; a draft's catch-up over them and the
    target's token)."""
    return max_num_seqs * (num_speculative_tokens + 2)


def draft_state_specs(config: EngineConfig, device, max_model_len: int) -> dict:
    """The draft model's state as the speculator registers it, without building the draft:
    what a tensor-parallel worker registers so that its groups are rank 0's (the draft runs
    on rank 0 only)."""
    from tandem.models.loader import model_state_specs

    specs = model_state_specs(config.speculative_model, dtype=config.dtype, device=device,
                              max_model_len=max_model_len, indexer_cache_dtype=config.indexer_cache_dtype)
    return {DraftModelNetwork.PREFIX + name: spec for name, spec in specs.items()}


def build_draft_network(config: EngineConfig, target, target_info, device, loads_draft_model: bool):
    """The draft network a rank runs: the target's MTP module (sharded as the target: every
    rank), or the draft model (``loads_draft_model``: rank 0 alone; None on the other ranks,
    which register its state specs only, ``draft_state_specs``)."""
    if config.speculative_method == "mtp":
        return MTPNetwork(target)
    if not loads_draft_model:
        return None
    return DraftModelNetwork(load_draft_model(config, device, target_info))


def load_draft_model(config: EngineConfig, device, target_info):
    """The draft model (``speculative_model``), checked against the target's vocabulary."""
    from tandem.models.loader import build_model

    try:
        model, _, info = build_model(config.speculative_model, dtype=config.dtype, load_format=config.load_format,
                                     device=device, max_model_len=target_info.max_model_len,
                                     seed=config.seed + 1, indexer_cache_dtype=config.indexer_cache_dtype)
    except ValueError as error:
        raise ValueError(f"speculative_model: {error}") from None
    if info.vocab_size != target_info.vocab_size:
        raise ValueError(f"speculative_model: the draft has a vocabulary of {info.vocab_size} tokens, the "
                         f"target {target_info.vocab_size}; a draft must share the target's tokenizer")
    return model


def engine_config_for_speculation(config: EngineConfig, device_type: str) -> EngineConfig:
    """Speculation runs with the overlapped loop off: a step's inputs (which drafts, how many
    tokens each sequence has) depend on the previous verification's outcome, known on the host
    only once that step has finished, so the host cannot prepare step N+1 while step N runs.
    CUDA graphs stay on (unless ``enforce_eager``): verification and the draft's passes replay
    them (see ``Speculator.capture_graphs``)."""
    if config.async_scheduling:
        logger.warning("speculative decoding: --async-scheduling is not supported; the engine loop runs "
                       "one step at a time")
    elif device_type == "cuda":
        logger.info("speculative decoding: the overlapped engine loop is off")
    return config.with_changes(async_scheduling=False)


class Speculator:
    """Speculative decoding for one engine (see the package docstring).

    Built in two phases: ``__init__`` takes the draft network the rank's build made, registered
    and bound (``tandem/engine/ranks/build.py``; rank 0's worker runs its passes and captures its
    graphs, ``Worker.capture_draft_graphs``); ``attach`` (once the engine core's books exist)
    makes the proposer, the verifier and the step."""

    def __init__(self, config: EngineConfig, network, target_layers: list[str], target) -> None:
        self.method = config.speculative_method
        self.target_layers = target_layers
        self.network = network  # built, registered and bound with the rank (``build_draft_network``)
        self.num_speculative_tokens = speculative_tokens(config, target)
        self.simulate_accept_length = simulated_accept_length()
        if self.simulate_accept_length is not None:
            logger.warning("%s=%g: drafts are accepted as if the mean acceptance length were %g, whatever "
                           "they are; outputs change (a performance-only switch for benchmarks)",
                           SIMULATE_ACCEPT_LENGTH_VARIABLE, self.simulate_accept_length,
                           self.simulate_accept_length)
        self.metrics = SpeculationMetrics(self.method, self.num_speculative_tokens)
        self.proposer = None
        self.step: Optional[SpeculativeStep] = None
        logger.info("speculative decoding: %s, %d draft tokens per step, %d draft state layers", self.method,
                    self.num_speculative_tokens, self.num_state_layers)

    @property
    def num_state_layers(self) -> int:
        return len(self.network.layer_names)

    def attach(self, core: StepContext) -> None:
        core.coordinator.state_reads_next_token = self.network.reads_next_token
        if self.method == "mtp":
            self.proposer = MTPProposer(core, self.network, self.num_speculative_tokens,
                                        int(core.model_info.hidden_size))
        else:
            self.proposer = DraftModelProposer(core, self.network, self.num_speculative_tokens)
        self.target_groups = sorted({core.registry.group_of(name) for name in self.target_layers})
        # Every page a speculative step copies aside is reserved when its sequence is scheduled.
        core.coordinator.speculation.reserve_for(self.target_groups + list(self.network.groups))
        self.step = SpeculativeStep(core, self.proposer, Verifier(core, self.simulate_accept_length),
                                    self.target_groups, self.metrics)

    # -- what the engine core and the PD sides call ------------------------------------------------
    def run_step(self) -> list[RequestDelta]:
        return self.step()

    def stats(self) -> SpeculationStats:
        return self.metrics.stats()

    def metadata_hidden(self, sequence: Sequence) -> tuple[float, ...]:
        """PD prefill: what the metadata row carries for the decode side's draft (the target's
        hidden state at the last prompt position, for an MTP layer; nothing for a draft model)."""
        state = sequence.speculation
        if state is None or state.last_hidden is None:
            return ()
        return state.last_hidden

    def on_remote_prefill(self, sequence: Sequence, hidden: tuple[float, ...]) -> Optional[str]:
        """PD decode: the sequence's prompt state arrived (``hidden`` copied out of the metadata
        row); its drafts are proposed before its first step. Returns an error, or None."""
        return self.proposer.on_remote_prefill(sequence, hidden)
