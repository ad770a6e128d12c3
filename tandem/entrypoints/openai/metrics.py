"""Prometheus metrics of one server, in a registry of its own (no module-level state).

Request-level series are recorded by the frontend as outputs arrive (``RequestTimer``); engine
series (running/waiting requests, KV pages, prefix-cache hits) are read from the engine's latest
``EngineStats`` at scrape time.
"""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tandem.protocol import EngineStats
from tandem.outputs import RequestOutput

PREFIX = "tandem:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_OUTCOMES = ("stop", "length", "abort", "error", "rejected")


def new_registry() -> CollectorRegistry:
    """A registry for one server's or router's series, without ``*_created`` series (a process-wide
    prometheus_client setting: no tandem process exposes them; scrapers record series' starts)."""
    disable_created_metrics()
    return CollectorRegistry(auto_describe=True)


class EngineStatsCollector:
    """Exposes the engine's newest stats; ``read_stats`` is called on every scrape."""

    def __init__(self, read_stats: Callable[[], EngineStats]):
        self.read_stats = read_stats

    def collect(self):
        stats = self.read_stats()
        gauges = {
            "num_requests_running": ("Sequences the engine is running.", stats.num_running),
            "num_requests_waiting": ("Sequences waiting to be scheduled.", stats.num_waiting),
            "kv_pages_used": ("KV-cache pages held by requests.", stats.kv_pages_used),
            "kv_pages_total": ("KV-cache pages in the pool.", stats.kv_pages_total),
            "kv_page_size_tokens": ("Tokens per KV-cache page.", stats.page_size),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, documentation, value=value)
        counters = {
            "prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache.", stats.prefix_cache_hit_tokens),
            "prefix_cache_query_tokens": ("Prompt tokens looked up in the prefix cache.",
                                          stats.prefix_cache_query_tokens),
            "num_preemptions": ("Sequences preempted by the scheduler.", stats.num_preemptions),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, documentation, value=value)
        if stats.transfer is not None:
            yield from transfer_metric_families(stats.transfer)
        if stats.tiers is not None:
            yield from tier_metric_families(stats)
        if stats.speculation is not None:
            yield from speculation_metric_families(stats.speculation)
        if stats.structured_outputs is not None:
            yield from structured_outputs_metric_families(stats.structured_outputs)
        if stats.inter_token_budget is not None:
            yield from inter_token_budget_metric_families(stats.inter_token_budget)


def labelled_counter(name: str, documentation: str, label: str, values: dict) -> CounterMetricFamily:
    """A counter with one series per key of ``values`` (sorted), the key as ``label``."""
    family = CounterMetricFamily(PREFIX + name, documentation, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def tier_metric_families(stats: EngineStats):
    """Host and disk tier series: hit tokens by tier, bytes and seconds per direction, copies in
    flight, swaps, pages held, disk files rejected."""
    tiers = stats.tiers
    hits = CounterMetricFamily(PREFIX + "prefix_cache_hit_tokens_by_tier",
                               "Prompt tokens served from the prefix cache, by the tier they came from.",
                               labels=["tier"])
    device = stats.prefix_cache_hit_tokens - tiers.host_hit_tokens - tiers.disk_hit_tokens
    for tier, value in (("device", max(device, 0)), ("host", tiers.host_hit_tokens), ("disk", tiers.disk_hit_tokens)):
        hits.add_metric([tier], value)
    yield hits
    yield labelled_counter("tier_copy_bytes", "Bytes copied between tiers, by direction.", "direction",
                           tiers.copy_bytes)
    yield labelled_counter("tier_copy_seconds", "Time spent copying between device and host, by direction "
                           "(bytes over seconds: the bandwidth).", "direction", tiers.copy_seconds)
    yield labelled_counter("swaps", "Preemptions by swap: out, in, refused (recomputed).", "event", tiers.swaps)
    yield labelled_counter("disk_cache_rejected_files",
                           "Disk-tier files rejected (deleted, treated as misses), by reason.", "reason",
                           tiers.disk_rejected)
    yield labelled_counter("store_hit_tokens", "Prompt tokens served from the shared store (disk tier), by the "
                           "role of the server that wrote them.", "origin", tiers.disk_hit_tokens_by_origin)
    yield CounterMetricFamily(PREFIX + "offloaded_pages", "Pages this server wrote to the shared store.",
                              value=tiers.offloaded_pages)
    yield CounterMetricFamily(PREFIX + "offloaded_bytes", "Bytes this server wrote to the shared store.",
                              value=tiers.offloaded_bytes)
    gauges = {
        "offloads_in_flight": ("Device-to-host copies and store writes issued and not yet complete.",
                               tiers.offloads_in_flight),
        "tier_copies_in_flight": ("Tier copies issued and not yet observed complete.", tiers.copies_in_flight),
        "host_cache_pages_used": ("Host-tier pages held (all groups).", tiers.host_pages_used),
        "host_cache_pages_total": ("Host-tier pages (all groups).", tiers.host_pages_total),
        "disk_cache_files": ("Pages stored in the disk tier.", tiers.disk_files),
        "disk_cache_bytes": ("Bytes stored in the disk tier.", tiers.disk_bytes),
    }
    for name, (documentation, value) in gauges.items():
        yield GaugeMetricFamily(PREFIX + name, documentation, value=value)


def speculation_metric_families(speculation):
    """Speculative decoding: verifications, draft tokens verified and accepted, and their ratio."""
    counters = {
        "spec_decode_num_drafts": ("Verifications of at least one draft token.", speculation.num_drafts),
        "spec_decode_num_draft_tokens": ("Draft tokens verified.", speculation.num_draft_tokens),
        "spec_decode_num_accepted_tokens": ("Draft tokens accepted.", speculation.num_accepted_tokens),
    }
    for name, (documentation, value) in counters.items():
        yield CounterMetricFamily(PREFIX + name, documentation, value=value)
    yield GaugeMetricFamily(PREFIX + "spec_decode_mean_acceptance_length",
                            "Tokens per verification: accepted drafts plus the target's own (0 before any).",
                            value=speculation.mean_acceptance_length)


def inter_token_budget_metric_families(budget):
    """The prefill cap under ``--max-itl-ms``: the target, the steps it held back, whether it is
    out of reach, and the step-time fit it predicts with (NaN before steps with a prompt chunk
    came in two sizes)."""
    yield CounterMetricFamily(PREFIX + "itl_capped_steps",
                              "Steps whose prompt tokens the inter-token gap target held below what the budget left.",
                              value=budget.num_capped_steps)
    nan = float("nan")
    gauges = {
        "itl_target_seconds": ("The inter-token gap target (--max-itl-ms).", budget.target_seconds),
        "itl_target_out_of_reach": ("1 while not even a page of prompt beside the decodes is predicted within "
                                    "the target (prefill then runs uncapped).", float(budget.out_of_reach)),
        "itl_step_intercept_seconds": ("Predicted seconds of a step with a prompt chunk, at no tokens.",
                                       nan if budget.intercept_seconds is None else budget.intercept_seconds),
        "itl_step_seconds_per_token": ("Predicted seconds a token adds to a step with a prompt chunk.",
                                       nan if budget.seconds_per_token is None else budget.seconds_per_token),
    }
    for name, (documentation, value) in gauges.items():
        yield GaugeMetricFamily(PREFIX + name, documentation, value=value)


def structured_outputs_metric_families(structured):
    """Grammar-constrained decoding: compilations and their seconds, cache hits, masked steps."""
    counters = {
        "structured_outputs_compiled": ("Grammars compiled.", structured.num_compiled),
        "structured_outputs_compile_seconds": ("Seconds spent compiling grammars.", structured.compile_seconds),
        "structured_outputs_cache_hits": ("Constrained requests whose grammar was already compiled.",
                                          structured.num_cache_hits),
        "structured_outputs_constrained_steps": ("Steps that masked at least one row by a grammar.",
                                                 structured.num_constrained_steps),
        "structured_outputs_constrained_rows": ("Rows masked by a grammar, over all steps.",
                                                structured.num_constrained_rows),
    }
    for name, (documentation, value) in counters.items():
        yield CounterMetricFamily(PREFIX + name, documentation, value=value)
    yield GaugeMetricFamily(PREFIX + "structured_outputs_waiting",
                            "Requests waiting for their grammar to compile.", value=structured.num_waiting)


def histogram_buckets(snapshot) -> list[tuple[str, int]]:
    """A snapshot's cumulative counts as Prometheus buckets, +Inf last."""
    buckets = [(format(bound, "g"), count) for bound, count in zip(snapshot.bounds, snapshot.counts)]
    buckets.append(("+Inf", snapshot.counts[-1]))
    return buckets


def transfer_metric_families(transfer):
    """PD transfer series: bytes, duration and bandwidth histograms, outcomes, queue lengths."""
    outcomes = CounterMetricFamily(PREFIX + "pd_transfers", "PD transfers by outcome.", labels=["role", "outcome"])
    for outcome, count in sorted(transfer.outcomes.items()):
        outcomes.add_metric([transfer.role, outcome], count)
    yield outcomes
    yield CounterMetricFamily(PREFIX + "pd_transfer_bytes", "Bytes of completed PD transfers.",
                              value=transfer.bytes_total)
    rejected = CounterMetricFamily(PREFIX + "pd_control_rejected",
                                   "PD control messages dropped unread (unauthenticated, replayed, malformed), by reason.",
                                   labels=["role", "reason"])
    for reason, count in sorted(transfer.control_rejected.items()):
        rejected.add_metric([transfer.role, reason], count)
    yield rejected
    yield CounterMetricFamily(PREFIX + "pd_requests_held_back",
                              "Decode: requests that waited for admission because the pool was full.",
                              value=transfer.num_held_back)
    histograms = (("pd_transfer_size_bytes", "Bytes per completed PD transfer.", transfer.size_bytes),
                  ("pd_transfer_duration_seconds", "Duration of completed PD transfers.", transfer.duration_seconds),
                  ("pd_transfer_bandwidth_bytes_per_second", "Bandwidth of completed PD transfers (writer side).",
                   transfer.bandwidth_bytes_per_second))
    for name, documentation, snapshot in histograms:
        if snapshot is None:
            continue
        yield HistogramMetricFamily(PREFIX + name, documentation, buckets=histogram_buckets(snapshot),
                                    sum_value=snapshot.total)
    if transfer.phase_seconds:
        phases = HistogramMetricFamily(PREFIX + "pd_phase_seconds", "Phases of completed PD transfers, per side "
                                       "(prefill: compute, destination_wait, last_write; decode: admission_wait, "
                                       "receive).", labels=["role", "phase"])
        for phase, snapshot in sorted(transfer.phase_seconds.items()):
            phases.add_metric([transfer.role, phase], histogram_buckets(snapshot), sum_value=snapshot.total)
        yield phases
    queues = GaugeMetricFamily(PREFIX + "pd_queue_length", "PD requests per transfer queue.", labels=["role", "queue"])
    for queue, length in sorted(transfer.queues.items()):
        queues.add_metric([transfer.role, queue], length)
    yield queues


class RequestTimer:
    """Timing of one request, fed by the engine client as outputs arrive. Owned by its stream."""

    def __init__(self, metrics: "ServerMetrics", arrival_time: float):
        self.metrics = metrics
        self.arrival_time = arrival_time
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.tokens_per_choice: list[int] = []
        self.ended = False

    def record_output(self, output: RequestOutput, now: float) -> None:
        counts = [len(choice.token_ids) for choice in output.outputs]
        previous = self.tokens_per_choice or [0] * len(counts)
        new_per_choice = [count - before for count, before in zip(counts, previous)]
        self.tokens_per_choice = counts
        new_tokens = sum(new_per_choice)
        if new_tokens <= 0:
            return
        self.metrics.generation_tokens.inc(new_tokens)
        if self.first_token_time is None:
            self.first_token_time = now
            self.metrics.time_to_first_token.observe(now - self.arrival_time)
        else:
            steps = max(new_per_choice)
            for _ in range(steps):
                self.metrics.inter_token_latency.observe((now - self.last_token_time) / steps)
        self.last_token_time = now

    def record_end(self, outcome: str, now: float) -> None:
        if self.ended:
            return
        self.ended = True
        self.metrics.requests.labels(outcome=outcome).inc()
        self.metrics.end_to_end_latency.observe(now - self.arrival_time)


class ServerMetrics:
    """All series of one server; also the engine client's request observer."""

    def __init__(self, read_stats: Callable[[], EngineStats]):
        self.registry = new_registry()
        self.requests = Counter(PREFIX + "requests", "Requests by outcome (finish reason, abort, error, rejected).",
                                ["outcome"], registry=self.registry)
        for outcome in REQUEST_OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=self.registry)
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.end_to_end_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, end to end.",
                                            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(EngineStatsCollector(read_stats))

    def start_request(self, num_prompt_tokens: int, arrival_time: float) -> RequestTimer:
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, arrival_time)

    def count_rejected(self) -> None:
        """A request refused by the frontend before it reached the engine."""
        self.requests.labels(outcome="rejected").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
