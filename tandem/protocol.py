"""Typed messages between the frontend and the engine core (msgspec structs).

The same structs are used in-process (offline ``LLM``) and over ZMQ (``tandem serve``). They
sit here, above every package, because several floors speak them: the frontend, the engine,
the scheduler's sequences, the model runner, speculative decoding and PD.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from tandem.sampling_params import SamplingParams
from tandem.transfer.messages import StateLayout


class EngineRequest(msgspec.Struct, kw_only=True):
    """A request as the engine sees it: token ids only, no text."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    transfer: Optional["TransferParams"] = None  # PD: this request's leg (None: colocated)


class PositionLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top-k (rank order).

    ``token_ids[0]``/``logprobs[0]`` are the sampled (or prompt) token and ``rank`` its rank
    in the model's raw distribution (1 = most likely). The rest are the top-k tokens.
    """
    token_ids: list[int]
    logprobs: list[float]
    rank: int


class RequestDelta(msgspec.Struct, kw_only=True):
    """What one engine step produced for one sequence (one of the ``n`` of a request)."""
    request_id: str
    index: int = 0
    new_token_ids: list[int] = []
    new_logprobs: Optional[list[PositionLogprobs]] = None
    # Sent once, with the first delta; entry 0 is None (the first prompt token has no context).
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[int] = None  # the stop token id that ended it, if any
    error: Optional[str] = None


class SpeculationStats(msgspec.Struct, kw_only=True):
    """Cumulative speculative-decoding counts of one engine."""
    method: str  # "mtp" or "draft"
    num_speculative_tokens: int
    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified (proposed and scheduled)
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average: accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class StructuredOutputsStats(msgspec.Struct, kw_only=True):
    """Grammar-constrained decoding (engines that have seen a constrained request)."""
    num_compiled: int = 0  # grammars compiled
    compile_seconds: float = 0.0  # summed over those compilations
    num_cache_hits: int = 0  # requests whose grammar was already compiled (or compiling)
    num_constrained_steps: int = 0  # steps that masked at least one row
    num_constrained_rows: int = 0  # rows masked, over those steps
    num_waiting: int = 0  # requests waiting for their grammar to compile


class InterTokenBudgetStats(msgspec.Struct, kw_only=True):
    """The prefill cap under an inter-token gap target (``--max-itl-ms``) of one engine."""
    target_seconds: float
    num_capped_steps: int = 0  # steps whose prompt tokens the target held below what the budget left
    out_of_reach: bool = False  # the last verdict: even a page of prompt beside the decodes misses the target
    intercept_seconds: Optional[float] = None  # the fit over steps with a prompt chunk (None before two sizes)
    seconds_per_token: Optional[float] = None


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    num_preemptions: int = 0
    page_size: int = 0
    transfer: Optional["TransferStats"] = None  # PD engines only
    tiers: Optional["TierStats"] = None  # engines with a host (and disk) tier
    speculation: Optional[SpeculationStats] = None  # engines that speculate only
    structured_outputs: Optional[StructuredOutputsStats] = None  # once a constrained request arrived
    inter_token_budget: Optional[InterTokenBudgetStats] = None  # engines with --max-itl-ms


class AbortRequest(msgspec.Struct, kw_only=True):
    request_ids: list[str]


# ---------------------------------------------------------------------------------------------
# Messages between the server's frontend process and its engine process (ZMQ, msgpack).
# Frontend -> engine: ``FrontendMessage``; engine -> frontend: ``EngineMessage``.
# ---------------------------------------------------------------------------------------------


class AddRequestMessage(msgspec.Struct, kw_only=True, tag="add"):
    """Frontend -> engine: admit a request (already validated and tokenized)."""
    request: EngineRequest


class AbortRequestsMessage(msgspec.Struct, kw_only=True, tag="abort"):
    """Frontend -> engine: end these requests now and free their pages (client went away)."""
    request_ids: list[str]


class FinishSequencesMessage(msgspec.Struct, kw_only=True, tag="finish"):
    """Frontend -> engine: a stop string ended these (request_id, index) sequences."""
    keys: list[tuple[str, int]]


class ResetPrefixCacheMessage(msgspec.Struct, kw_only=True, tag="reset_prefix_cache"):
    """Frontend -> engine: drop every unreferenced prefix-cache page (pages in use stay)."""


class ShutdownMessage(msgspec.Struct, kw_only=True, tag="shutdown"):
    """Frontend -> engine: stop after aborting whatever still runs, then exit."""


FrontendMessage = (AddRequestMessage | AbortRequestsMessage | FinishSequencesMessage | ResetPrefixCacheMessage
                   | ShutdownMessage)


class EngineReadyMessage(msgspec.Struct, kw_only=True, tag="ready"):
    """Engine -> frontend, once: the engine core is built and accepts requests."""
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    stats: EngineStats
    transfer: Optional["TransferEndpoint"] = None  # PD engines only


class RequestRejectedMessage(msgspec.Struct, kw_only=True):
    """A request the engine refused at admission (``EngineCore.add_request`` raised)."""
    request_id: str
    error: str


class EngineStepMessage(msgspec.Struct, kw_only=True, tag="step"):
    """Engine -> frontend: one step's deltas (possibly none), rejections, and fresh stats."""
    deltas: list[RequestDelta] = []
    rejected: list[RequestRejectedMessage] = []
    stats: EngineStats


class EngineFailedMessage(msgspec.Struct, kw_only=True, tag="failed"):
    """Engine -> frontend: the engine hit an unrecoverable error (start-up or step) and exits."""
    error: str


EngineMessage = EngineReadyMessage | EngineStepMessage | EngineFailedMessage


# ---------------------------------------------------------------------------------------------
# Prefill/decode disaggregation (tandem/transfer, tandem/disagg).
# ---------------------------------------------------------------------------------------------


class TransferParams(msgspec.Struct, kw_only=True):
    """A request's PD leg, set by the router (``kv_transfer_params`` in the HTTP body)."""
    room: str  # 128-bit room id, 32 hex digits
    role: str  # "prefill" or "decode": must equal the engine's role
    prefill_address: Optional[str] = None  # decode: the prefill engine's bootstrap address


class TransferEndpoint(msgspec.Struct, kw_only=True):
    """What a PD engine tells its frontend once ready (served at ``GET /pd/info``)."""
    role: str
    backend: str
    bootstrap_address: str
    layout: StateLayout


class HistogramSnapshot(msgspec.Struct, kw_only=True):
    """A cumulative histogram: ``counts[i]`` observations <= ``bounds[i]`` (last: +Inf)."""
    bounds: list[float]
    counts: list[int]
    total: float = 0.0


class TransferStats(msgspec.Struct, kw_only=True):
    """Cumulative PD transfer figures and current queue lengths of one engine."""
    role: str
    outcomes: dict[str, int] = {}  # transfers by outcome: done, failed, aborted
    bytes_total: int = 0
    size_bytes: Optional[HistogramSnapshot] = None
    duration_seconds: Optional[HistogramSnapshot] = None
    bandwidth_bytes_per_second: Optional[HistogramSnapshot] = None
    queues: dict[str, int] = {}  # e.g. waiting_for_destination, sending, waiting_for_admission
    num_held_back: int = 0  # decode: requests that had to wait for admission (pool full)
    control_rejected: dict[str, int] = {}  # control messages dropped, by reason (transfer/frames.py)
    phase_seconds: dict[str, HistogramSnapshot] = {}  # completed transfers' phases (disagg/metrics.py PHASES)


class TierStats(msgspec.Struct, kw_only=True):
    """Cumulative figures of the host and disk tiers, and what they hold now."""
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    copy_bytes: dict[str, int] = {}  # by direction: d2h, h2d, disk_write, disk_read
    copy_seconds: dict[str, float] = {}  # d2h, h2d (device time on CUDA)
    copies_in_flight: int = 0
    swaps: dict[str, int] = {}  # out, in, refused (host tier full: recomputed instead)
    host_pages_used: int = 0
    host_pages_total: int = 0
    disk_enabled: bool = False
    disk_files: int = 0
    disk_bytes: int = 0
    disk_rejected: dict[str, int] = {}  # files rejected by reason (truncated, checksum, foreign, ...)
    disk_write_failures: int = 0
    # The shared store: disk hit tokens by who wrote the pages (prefill, decode, colocated,
    # unknown), pages and bytes this server wrote to it (decode offload on a decode server), and
    # device→host copies plus store writes in flight.
    disk_hit_tokens_by_origin: dict[str, int] = {}
    offloaded_pages: int = 0
    offloaded_bytes: int = 0
    offloads_in_flight: int = 0


def tier_stats(tiers) -> TierStats:
    """A snapshot of a ``TieredState``'s figures."""
    stats = tiers.stats
    disk = tiers.disk
    disk_stats = disk.stats if disk is not None else None
    used = sum(pool.num_usable - pool.num_free for pool in tiers.host.pools)
    total = sum(pool.num_usable for pool in tiers.host.pools)
    copy_bytes = {"d2h": stats.d2h_bytes, "h2d": stats.h2d_bytes}
    if disk_stats is not None:
        copy_bytes.update(disk_write=_stat(disk_stats, "bytes_written"), disk_read=_stat(disk_stats, "bytes_read"))
    return TierStats(
        host_hit_tokens=stats.host_hit_tokens, disk_hit_tokens=stats.disk_hit_tokens, copy_bytes=copy_bytes,
        copy_seconds={"d2h": stats.d2h_seconds, "h2d": stats.h2d_seconds},
        copies_in_flight=tiers.copies_in_flight,
        swaps={"out": stats.swap_outs, "in": stats.swap_ins, "refused": stats.swaps_refused},
        host_pages_used=used, host_pages_total=total, disk_enabled=disk is not None,
        disk_files=_stat(disk_stats, "files"), disk_bytes=_stat(disk_stats, "bytes"),
        disk_rejected=dict(_stat(disk_stats, "rejected", {})),
        disk_write_failures=_stat(disk_stats, "write_failures"),
        disk_hit_tokens_by_origin=dict(stats.disk_hit_tokens_by_origin),
        offloaded_pages=_stat(disk_stats, "writes"), offloaded_bytes=_stat(disk_stats, "bytes_written"),
        offloads_in_flight=tiers.offloads_in_flight)


def _stat(stats, name: str, default=0):
    if stats is None:
        return default
    return stats.get(name, default) if isinstance(stats, dict) else getattr(stats, name, default)
