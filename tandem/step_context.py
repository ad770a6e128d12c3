"""The engine core's public surface to the features that hook into its step.

Speculative decoding (``tandem/spec_decode``) runs the step while speculating and verifies
drafts; prefill/decode disaggregation (``tandem/disagg``) feeds a decode engine its first token
and ends requests whose transfer failed. Both sit below the engine in the layering, so they see
the engine core only as this ``StepContext``: the books (scheduler, coordinator, registry), the
executor (every call to the executing side is a host-only message to rank 0's worker: ``verify``
a speculating step's verification, ``draft_pass`` and ``end_proposal`` the proposer's draft
passes, ``keep_carried_hidden`` and ``skip_first_draw`` PD decode's start of a sequence), and the
hooks below. The context names no model runner, sampler or generator. Nothing outside the
engine calls a private method of the engine core.

The step pipeline and where the hooks sit:

    schedule ─► plan + execute (every rank's worker) ─► sample or verify (rank 0's worker) ─► update
                                                     │                              │
                          banned_tokens (the verification message) token_delta, finish_reason,
                                                                   fork, collect_prompt_logprobs,
                                                                   fail_chunks, check_books
    PD decode, before its first step: append_first_token; a leg that ends: forget_if_done
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    import torch

    from tandem.config import EngineConfig
    from tandem.kv.coordinator import StateCoordinator
    from tandem.kv.registry import StateRegistry
    from tandem.protocol import PositionLogprobs, RequestDelta
    from tandem.scheduler.scheduler import Scheduler
    from tandem.scheduler.sequence import Sequence


class StepContext(Protocol):
    """What an engine core offers the features that hook into its step (``EngineCore`` is one)."""

    config: "EngineConfig"
    device: "torch.device"
    model_info: Any  # the target model's dimensions (models/loader.py ModelInfo)
    registry: "StateRegistry"
    coordinator: "StateCoordinator"
    scheduler: "Scheduler"
    structured: Any  # the grammar masks of constrained rows (engine/structured_outputs.py)
    executor: Any  # the ranks (engine/ranks/executor.py Executor): the messages to rank 0's worker
    speculator: Any  # spec_decode.Speculator, or None
    pd: Any  # the PD side (disagg), or None

    # -- executing a step ---------------------------------------------------------------------
    def execute(self, chunks, pending=None, hidden_states: bool = False) -> Any:
        """One forward pass over ``chunks`` on every rank (``engine/step_planner.py`` plans it, the
        executor runs it): rank 0's ``ExecuteResult`` (host values; with ``hidden_states``, rank
        0's worker keeps the step's hidden states for the draft's passes). A failure of rank 0's
        pass raises."""

    # -- sampling or verifying a step's rows --------------------------------------------------
    def banned_tokens(self, sequence: "Sequence", ahead: int = 0) -> list[int]:
        """Token ids the sequence's next token (``ahead`` tokens later) may not take (min_tokens)."""

    # -- updating the books with a step's tokens ------------------------------------------------
    def token_delta(self, sequence: "Sequence", position: int, token: int,
                    logprobs: Optional["PositionLogprobs"]) -> "RequestDelta":
        """The delta of the token now at ``position``; ends the sequence when it finishes there."""

    def finish_reason(self, sequence: "Sequence", token: int, num_output: int) -> tuple[Optional[str], Any]:
        """(reason, stop reason) if the sequence ends with ``token`` as its ``num_output``-th output."""

    def fork(self, parent: "Sequence") -> list["Sequence"]:
        """At the end of the parent's prompt: its n-1 siblings, sharing its pages."""

    def collect_prompt_logprobs(self, chunk, logprobs: Optional[list["PositionLogprobs"]]) -> None:
        """Keep a computed chunk's prompt logprobs with its sequence."""

    def fail_chunks(self, chunks, message: str) -> list["RequestDelta"]:
        """End the sequences of a step whose forward pass failed; their error deltas."""

    def check_books(self) -> None:
        """I5 after a step (sanitizer mode): every pool's books balance."""

    # -- PD -----------------------------------------------------------------------------------
    def append_first_token(self, sequence: "Sequence", token: int,
                           logprobs: Optional["PositionLogprobs"]) -> "RequestDelta":
        """A token known on the host (a decode engine's first token, from the prefill server)."""

    def forget_if_done(self, request_id: str) -> None:
        """Drop the request once every sequence of it has finished."""
