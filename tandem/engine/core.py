"""The engine core: schedule → plan → execute → sample → update, one step at a time.

Owner of the books of one model replica (registry, pools, coordinator, scheduler) and the executor
through which every rank's worker runs each step's forward pass (rank 0's worker, with its shard of
the model and of the state, lives in this process: ``engine/ranks/worker.py``). Rank 0's worker
also samples: after the forward pass the engine core hands it the step's sampling message
(``engine/ranks/sampling_plan.py``: which rows sample, their parameters and sequence keys, the
penalties' token ids, min_tokens' banned ids, the grammar bitmask), and reads the tokens back.
It speaks token ids only; text, stop strings and detokenizing belong to the frontend.
"""
from __future__ import annotations

import itertools
import logging
import time
from functools import partial
from typing import Optional

import torch

from tandem.config import EngineConfig
from tandem.protocol import EngineRequest, EngineStats, PositionLogprobs, RequestDelta, tier_stats
from tandem.kv.block_pool import SanitizerError
from tandem.kv.spec import KV_CACHE_DTYPES
from tandem.engine.memory import on_engine_device, resolve_device
from tandem.engine.ranks.build import build_rank
from tandem.engine.ranks.launcher import RankFailure
from tandem.engine.ranks.sampling_plan import SamplingPlan
from tandem.engine.ranks.start import start_executor
from tandem.engine.ranks.worker import Worker
from tandem.engine.step_planner import ExecuteResult, StepPlanner
from tandem.scheduler.scheduler import Scheduler, holds_prompt_chunk
from tandem.scheduler.step_time import HostStepClock
from tandem.scheduler.sequence import PENDING_TOKEN, Sequence
from tandem.engine.admission import check_prompt, check_transfer_leg, resolve_max_tokens
from tandem.engine.launched_step import LaunchedStep
from tandem.engine.structured_outputs import StructuredOutputs
from tandem.structured.matcher import GrammarViolation
from tandem.engine.token_rules import TokenRules, reported_logprobs

logger = logging.getLogger(__name__)


class EngineCore:
    """One model replica's engine core; the ``StepContext`` (``tandem/step_context.py``) that
    speculative decoding and PD hook into."""

    def __init__(self, config: EngineConfig) -> None:
        # The ranks (one: this process; several: this process is rank 0), then this rank's
        # shard of the model and the state, built as every rank builds its own.
        self.executor = start_executor(config, resolve_device(config.device))
        self.device = self.executor.device
        parts = build_rank(config, self.device, self.executor, rank=0)
        self.config = config = parts.config
        self.model, self.hf_config, self.model_info = parts.model, parts.hf_config, parts.model_info
        self.token_rules = TokenRules(self.model_info.eos_token_ids, self.model_info.max_model_len)
        self.registry, self.coordinator = parts.registry, parts.coordinator
        # Rank 0's worker (its model runner, page executor, tier worker, a sharded draft): the
        # executor runs it on every step's message, as every other rank runs its own. The
        # engine core reads its runner only at start-up and for rank 0's own draft passes; the
        # step planner chooses each step's graph with what the worker says it captured.
        self.worker = Worker(parts)
        self.executor.attach_worker(self.worker)
        self.runner = parts.runner
        self.planner = StepPlanner(self.coordinator, self.worker.graph_choice())
        plan = parts.plan
        # The host and disk tiers (kv/tiers), when configured: registered as the coordinator's
        # listener (fed its events: frees, cached nodes, hits); the engine and the scheduler
        # drive them through this handle.
        self.tiers = parts.tiers
        if self.tiers is not None:
            self.tiers.peers = self.executor
        self.speculator = None  # speculative decoding (tandem/spec_decode), when configured
        if parts.draft is not None:
            from tandem.spec_decode import Speculator

            self.speculator = Speculator(config, parts.draft, parts.target_layers, self.model)
        self.structured = StructuredOutputs(
            config.tokenizer or config.model, self.model_info.vocab_size, self.model_info.eos_token_ids,
            config.structured_outputs_compile_timeout, device=self.device, check_history=config.sanitizer_on)
        self._rejections: list[tuple[str, str]] = []  # (request id, why): refused after add_request returned
        self.scheduler = Scheduler(self.coordinator, tiers=self.tiers, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   preemption_mode=config.resolved_preemption_mode, max_itl_ms=config.max_itl_ms)
        if self.speculator is not None:
            self.speculator.attach(self)
        self._in_flight: Optional[LaunchedStep] = None  # launched, not yet read back
        self.host_step_clock = HostStepClock()  # steps off a GPU (on one the device times them)
        self.steps_read_back = 0
        self._sequences: dict[str, list[Sequence]] = {}
        self._arrival = itertools.count()
        self.pd = None  # prefill/decode disaggregation (tandem/disagg), when configured
        if config.transfer is not None:
            from tandem.disagg import create_pd

            self.pd = create_pd(self, config.transfer)
        overlap = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self.overlap = overlap
        logger.info("engine ready: %s on %s (%s), %d pages of %d tokens (%d tokens, KV cache %s), sanitizer %s",
                    self.model_info.architecture, self.device, self.model_info.dtype,
                    plan.usable_pages, plan.page_size, plan.usable_pages * plan.page_size,
                    KV_CACHE_DTYPES[config.kv_cache_dtype] or self.model_info.dtype,
                    "on" if config.sanitizer_on else "off")

    # -- requests ------------------------------------------------------------------------------
    @on_engine_device
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises ValueError("field: message") if it can never be served."""
        params = request.sampling_params
        prompt = list(request.prompt_token_ids)
        if request.request_id in self._sequences:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        check_prompt(prompt, self.model_info.vocab_size)
        max_tokens = resolve_max_tokens(len(prompt), params.max_tokens, self.model_info.max_model_len,
                                        self.coordinator.max_tokens_per_request())
        sequence = self._new_sequence(request.request_id, 0, prompt, params, max_tokens)
        sequence.pending_forks = params.n - 1
        if request.transfer is not None:
            check_transfer_leg(request, self.pd.role if self.pd is not None else None)
        self._sequences[request.request_id] = [sequence]
        try:
            if params.structured_outputs is not None and not self._grammar_ready(sequence, request.transfer):
                return  # admitted once its grammar has compiled (``_admit_compiled``)
            self._admit(sequence, request.transfer)
        except ValueError:
            del self._sequences[request.request_id]
            raise

    def _admit(self, sequence: Sequence, transfer) -> None:
        if transfer is not None:
            self.pd.add(sequence, transfer)  # held until its state or destination is known
        else:
            self.scheduler.add(sequence)

    def _grammar_ready(self, sequence: Sequence, transfer) -> bool:
        """Start compiling the sequence's grammar; give it its matcher if the grammar is already
        compiled, else park it until it is. Raises ``ValueError`` for an invalid grammar."""
        future = self.structured.compile(sequence.params.structured_outputs)
        if future.done():
            self.structured.attach(sequence, future)
            return True
        self.structured.wait(sequence, transfer, future)
        return False

    def _admit_compiled(self) -> None:
        """Admit the requests whose grammar has compiled; reject those whose compilation failed
        or timed out. An engine with nothing else to do waits a moment for a compilation."""
        idle = not self.scheduler.has_unfinished() and self._in_flight is None
        ready, failed = self.structured.compiled(block=idle)
        for sequence, transfer in ready:
            try:
                self._admit(sequence, transfer)
            except ValueError as error:
                failed.append((sequence, str(error)))
        for sequence, error in failed:
            self._end(sequence, "abort")
            self._sequences.pop(sequence.request_id, None)
            self._rejections.append((sequence.request_id, error))

    def take_rejections(self) -> list[tuple[str, str]]:
        """Requests refused after ``add_request`` returned (their grammar failed to compile or
        timed out): ``(request id, "field: why")``, each reported once."""
        rejections, self._rejections = self._rejections, []
        return rejections

    def _new_sequence(self, request_id: str, index: int, prompt: list[int], params, max_tokens: int) -> Sequence:
        return Sequence(request_id=request_id, index=index, token_ids=list(prompt),
                        num_prompt_tokens=len(prompt), params=params,
                        state=self.coordinator.new_state(f"{request_id}#{index}"),
                        arrival_order=next(self._arrival), max_tokens=max_tokens)

    @on_engine_device
    def abort_requests(self, request_ids: list[str]) -> None:
        """End every sequence of these requests and free their pages at once (no deltas)."""
        for request_id in request_ids:
            self.structured.forget(request_id)  # (a request still waiting for its grammar)
            if self.pd is not None:
                self.pd.on_abort_request(request_id)  # in-flight transfers end before pages go
            for sequence in self._sequences.pop(request_id, []):
                if sequence.pending_forks:
                    sequence.pending_forks = 0
                self._end(sequence, "abort")
        self.drop_finished_generators()

    @on_engine_device
    def finish_sequences(self, keys: list[tuple[str, int]]) -> None:
        """End single sequences as "stop" (the frontend saw a stop string); frees their pages."""
        for request_id, index in keys:
            for sequence in self._sequences.get(request_id, []):
                if sequence.index == index:
                    sequence.pending_forks = 0
                    self._end(sequence, "stop")
            self.forget_if_done(request_id)
        self.drop_finished_generators()

    def forget_if_done(self, request_id: str) -> None:
        sequences = self._sequences.get(request_id)
        if sequences is not None and all(s.is_finished and not s.pending_forks for s in sequences):
            del self._sequences[request_id]

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self._in_flight is not None or self.structured.has_waiting()
                or (self.pd is not None and self.pd.has_work()))

    # PD engines: the process loop waits on these between steps instead of spinning.
    def idle_wait_milliseconds(self) -> float:
        return self.pd.idle_wait_milliseconds() if self.pd is not None else 0

    def wakeup_sockets(self) -> list:
        return self.pd.wakeup_sockets() if self.pd is not None else []

    # -- the step -------------------------------------------------------------------------------
    @on_engine_device
    def step(self, poll_transfers: bool = True) -> list[RequestDelta]:
        """One engine step; with PD, the transfers' progress first (``poll_transfers``; the
        engine process polls them itself to send their deltas before the step runs)."""
        if self.pd is None:
            return self._step()
        transfer_deltas = self.poll_transfers() if poll_transfers else []
        return transfer_deltas + self.pd.filter_deltas(self._step())

    @on_engine_device
    def poll_transfers(self) -> list[RequestDelta]:
        """PD: control messages, completions, admissions, timeouts. Their deltas (a decode
        engine's first tokens, transfer errors) need no step: the engine process sends them at
        once instead of after the next step's launch (and the read-back of the one in flight)."""
        return self.pd.poll() if self.pd is not None else []

    def _step(self) -> list[RequestDelta]:
        """Schedule, launch and complete steps. With the overlapped loop, a launched step is
        completed (its tokens read back) only after the next one has been launched, so the
        host prepares step N+1 while the device runs step N; the next step then reads step N's
        tokens on the device. Where the next step needs step N's results first (a preemption,
        a fork, penalties over output tokens), step N is completed before it is scheduled; a
        step with grammar-constrained rows completes step N between its forward pass and its
        sampling (the masks need step N's tokens; ``_launch``).
        While speculating, the speculator runs the step (one at a time)."""
        if self.tiers is not None:
            self.tiers.poll()  # tier copies that completed release their pages
        if self.structured.has_waiting():
            self._admit_compiled()
        if self.speculator is not None:
            deltas = self.speculator.run_step()
            self.drop_finished_generators()
            return deltas
        previous = self._in_flight
        started = time.perf_counter()
        output = self.scheduler.schedule(allow_preemption=previous is None)
        if previous is not None and (output is None or not self._can_overlap(output)):
            self._in_flight = None
            deltas = self._complete(previous)
            self.drop_finished_generators()
            self.check_books()
            return deltas
        deltas: list[RequestDelta] = []
        current = self._launch(output.chunks, previous, started) if output.chunks else None
        if isinstance(current, list):  # the forward pass failed: its sequences ended
            current, deltas = None, current
        if previous is not None:
            self._in_flight = current
            deltas += self._complete(previous)
            if current is not None:
                deltas = current.earlier_deltas + deltas
                self._after_computed(current)
        elif current is not None:
            self._after_computed(current)
            if self.overlap:
                self._in_flight = current
            else:
                deltas += self._complete(current)
        self.drop_finished_generators()
        self.check_books()
        return deltas

    def check_books(self) -> None:
        if not self.coordinator.sanitizer.enabled:
            return
        live = self.scheduler.live_sequences()
        held = [s.state for step in (self._in_flight,) if step is not None for s in step.held]
        self.coordinator.sanitizer.check_books(self.coordinator, [s.state for s in live] + held)
        if self.tiers is not None:
            self.tiers.check_books()
        self.check_generators(live)

    def check_generators(self, live: list[Sequence]) -> None:
        """No generator (nor drafts' distributions, nor a carried hidden state, nor a proposal's
        drafts) outlives its sequence: each key rank 0's worker keeps anything under is a live
        sequence's, or one whose end the next sampling message reports."""
        orphans = (self.worker.live_keys() - {s.arrival_order for s in live}
                   - set(self.scheduler.pending_finished_keys()))
        if orphans:
            raise SanitizerError(f"generators of sequences that ended and were reported: keys {sorted(orphans)}")

    def _can_overlap(self, output) -> bool:
        """Whether ``output`` may run before the step in flight has been read back: its
        sampling must not read output tokens (penalties) and no sequence in it may fork."""
        return not any(chunk.sequence.pending_forks or chunk.sequence.params.uses_penalties
                       for chunk in output.chunks)

    def _launch(self, chunks, previous: Optional["LaunchedStep"], started: float = 0.0):
        """Run the forward pass, then rank 0's worker samples (on the device, not waited for); each sampled
        sequence gets a pending token. Returns the launched step, or the error deltas."""
        pending = previous.pending_tokens() if previous is not None else None
        try:
            result = self.execute(chunks, pending)
        except (SanitizerError, RankFailure):  # (the engine cannot go on: not one step's failure)
            raise
        except Exception as error:  # a failed forward ends its sequences, not the engine
            logger.exception("forward pass failed")
            return self.fail_chunks(chunks, f"{type(error).__name__}: {error}")
        step = LaunchedStep(chunks=chunks, prompt_logprobs=result.prompt_logprobs, started=started)
        if previous is None:  # forks copy computed state: only without a step in flight
            for chunk in chunks:
                self.scheduler.on_computed(chunk)
            step.computed = True
        elif any(chunk.sequence.grammar is not None for chunk in result.sampling_chunks):
            # A grammar's mask needs the previous step's tokens: read them back now, while the
            # device runs this step's forward pass (this step is the one in flight from here on,
            # so sequences that finish hold their pages until it completes).
            self._in_flight = step
            step.earlier_deltas = self._complete(previous)
        self._sample(step, result)
        return step

    @torch.inference_mode()
    def execute(self, chunks, pending=None, hidden_states: bool = False) -> ExecuteResult:
        """One forward pass over ``chunks``: planned here (``step_planner.py``), run by every
        rank's worker through the executor; rank 0's result (its worker checked it and computed
        the prompt logprobs). A chunk whose input token is still pending reads it on rank 0's
        device (``pending``: the sampled rows of the step in flight, whose tokens its worker
        kept). ``hidden_states``: rank 0's worker keeps the step's hidden states (speculation's
        draft passes, which it runs, read them)."""
        # (a speculating engine verifies what its steps sample: their logits stay whole)
        planned = self.planner.plan(chunks, pending, hidden_states, samples=self.speculator is None)
        output = self.executor.execute_step(planned.plan)
        return self.planner.result(planned, output)

    def _after_computed(self, step: "LaunchedStep") -> None:
        """Book the step's chunks as computed, once every token they read is known (the
        prefix cache hashes them)."""
        computed, pd = step.computed, self.pd
        sampled = partial(self._sampled_row, step) if pd is not None else None
        for chunk in step.chunks:
            if not computed and not chunk.sequence.is_finished:
                self.scheduler.on_computed(chunk)
            if pd is not None:  # PD prefill: send the pages this chunk completed
                pd.after_computed(chunk, sampled)
            if chunk.prompt_logprobs:
                self.collect_prompt_logprobs(chunk, step.prompt_logprobs.get(id(chunk)))
        step.computed = True

    def _sampled_row(self, step: "LaunchedStep", sequence):
        """``(output, row)``: where ``step`` sampled ``sequence``'s token, on rank 0's device (the
        output its worker keeps: the step's sampling message was the last one sent); None if the
        step sampled none for it."""
        output, pending = self.worker.sampled, step.pending_tokens()
        if output is None or pending is None or output.token_ids.shape[0] != len(step.sequences):
            return None
        row = pending.row_of.get(id(sequence))
        return None if row is None else (output, row)

    def collect_prompt_logprobs(self, chunk, logprobs: Optional[list[PositionLogprobs]]) -> None:
        if not chunk.prompt_logprobs:
            return
        sequence = chunk.sequence
        if chunk.start == 0 or sequence.prompt_logprobs is None:
            sequence.prompt_logprobs = [None]
        sequence.prompt_logprobs.extend(logprobs or [])

    def _sample(self, step: "LaunchedStep", result) -> None:
        """Make the step's forks, then hand rank 0's worker the step's sampling message; each
        sampled sequence gets a pending token."""
        sequences = step.sequences
        rows = None  # logits row of each sampled sequence, where forks repeat their parent's
        for row, chunk in enumerate(result.sampling_chunks):
            sequence = chunk.sequence
            sequences.append(sequence)
            if sequence.pending_forks and not sequence.num_output_tokens:
                rows = rows or list(range(row))
                rows.append(row)
                for child in self.fork(sequence):
                    sequences.append(child)
                    rows.append(row)
            elif rows is not None:
                rows.append(row)
        if not sequences:
            return
        step.host = self.executor.sample(self.sampling_plan(sequences, rows))  # (the step's one device-to-host copy)
        positions = step.positions
        for sequence in sequences:
            token_ids = sequence.token_ids
            positions.append(len(token_ids))
            if not sequence.is_finished:  # (it finished as the previous step completed: see _launch)
                token_ids.append(PENDING_TOKEN)

    def sampling_plan(self, sequences: list[Sequence], rows: Optional[list[int]] = None) -> SamplingPlan:
        """The sampling message of ``sequences`` (reading logits ``rows``; None: one row each, in
        order). Token ids are gathered only when some row's penalties read them, banned ids only
        while some row is below its min_tokens; the sequences that ended since the last message
        go with it (their generators are dropped after it is sampled)."""
        params = [s.params for s in sequences]
        penalties = any(p.uses_penalties for p in params)
        empty = [[]] * len(sequences)
        return SamplingPlan(
            keys=[s.arrival_order for s in sequences], params=params, seeds=[s.seed for s in sequences],
            logits_rows=rows,
            prompt_token_ids=[s.prompt_token_ids for s in sequences] if penalties else empty,
            output_token_ids=[s.output_token_ids for s in sequences] if penalties else empty,
            banned_token_ids=[self.banned_tokens(s) for s in sequences] if any(p.min_tokens > 0 for p in params)
            else empty,
            token_bitmask=self.structured.host_bitmask(sequences),
            finished_keys=self.scheduler.take_finished_keys())

    def drop_finished_generators(self) -> None:
        """Tell rank 0's worker the sequences that ended since the last sampling message (their
        generators go): after each step, an abort, a stop string."""
        keys = self.scheduler.take_finished_keys()
        if keys:
            self.executor.sample(SamplingPlan([], [], [], finished_keys=keys))

    def _complete(self, step: "LaunchedStep") -> list[RequestDelta]:
        """Read the step's tokens back, write them over the pending ones, finish sequences (a
        step already completed gives nothing)."""
        host, step.host = step.host, None
        if host is None:
            self._release_held(step)
            return []
        sampled = host.wait()
        self._record_step_time(step, host)
        self._release_held(step)  # the device is done with the step: held pages may go
        token_ids = sampled.token_ids.tolist()
        logprobs = reported_logprobs(step.sequences, sampled)
        deltas = []
        for sequence, position, token, position_logprobs in zip(step.sequences, step.positions, token_ids,
                                                                logprobs):
            if sequence.is_finished:  # ended while the step ran (abort, stop string, its last token)
                continue
            sequence.token_ids[position] = token
            deltas.append(self.token_delta(sequence, position, token, position_logprobs))
        return deltas

    def _record_step_time(self, step: "LaunchedStep", host) -> None:
        """Give the scheduler the step's duration as a running decode saw it: the device's time
        from the step's beginning to its tokens' copy on a GPU, the host's off one
        (``step_time.py``)."""
        seconds = host.device_seconds()
        if seconds is None:
            seconds = self.host_step_clock.interval(step.started)
        self.steps_read_back += 1
        if self.steps_read_back == 1:
            return  # a process's first step compiles kernels and uploads graphs: not its size's cost
        self.scheduler.record_step(sum(chunk.num_query_tokens for chunk in step.chunks), seconds,
                                   with_prefill=holds_prompt_chunk(step.chunks))

    def _release_held(self, step: "LaunchedStep") -> None:
        for sequence in step.held:
            self.coordinator.free(sequence.state)
        step.held.clear()

    def _end(self, sequence: Sequence, reason: str) -> None:
        """Finish a sequence; while a launched step still computes for it, its pages are held
        until that step completes (I2: no page is freed under a reader)."""
        step = self._in_flight
        if step is not None and not sequence.is_finished and step.includes(sequence):
            self.scheduler.finish(sequence, reason, release=False)
            step.held.append(sequence)
        else:
            self.scheduler.finish(sequence, reason)

    @on_engine_device
    def finish_in_flight(self) -> list[RequestDelta]:
        """Complete the launched step, if any (the engine is then quiescent)."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        deltas = self._complete(step)
        self.drop_finished_generators()
        self.check_books()
        return deltas

    def fork(self, parent: Sequence) -> list[Sequence]:
        """At the end of the parent's prompt: make its n-1 siblings, sharing its pages."""
        if not parent.pending_forks or parent.num_output_tokens:
            return []
        children = []
        for index in range(1, parent.pending_forks + 1):
            child = self._new_sequence(parent.request_id, index, parent.prompt_token_ids,
                                       parent.params, parent.max_tokens)
            child.num_cached_tokens = parent.num_cached_tokens
            child.grammar = parent.grammar.fork() if parent.grammar is not None else None
            forked = self.coordinator.forks.fork(parent.state, child.state, parent.num_computed_tokens)
            child.num_computed_tokens = parent.num_computed_tokens if forked else 0
            self.scheduler.place_fork(child, forked)
            self._sequences[parent.request_id].append(child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def banned_tokens(self, sequence: Sequence, ahead: int = 0) -> list[int]:
        return self.token_rules.banned_tokens(sequence, ahead)

    def finish_reason(self, sequence: Sequence, token: int, num_output: int):
        return self.token_rules.finish_reason(sequence, token, num_output)

    def append_first_token(self, sequence: Sequence, token: int,
                      logprobs: Optional[PositionLogprobs]) -> RequestDelta:
        """Append a token known on the host (PD: the first token, from the prefill server). A
        token the sequence's grammar forbids ends it with an error."""
        sequence.token_ids.append(token)
        if sequence.grammar is not None:
            try:
                sequence.grammar.sync(sequence.output_token_ids, self.structured.check_history)
            except GrammarViolation as error:
                self._end(sequence, "error")
                self.forget_if_done(sequence.request_id)
                return RequestDelta(request_id=sequence.request_id, index=sequence.index,
                                    finish_reason="error", error=f"structured_outputs: {error}")
        return self.token_delta(sequence, len(sequence.token_ids) - 1, token, logprobs)

    def token_delta(self, sequence: Sequence, position: int, token: int,
                     logprobs: Optional[PositionLogprobs]) -> RequestDelta:
        """The delta of the token now at ``position`` (later pending tokens may follow it)."""
        reason, stop_reason = self.finish_reason(sequence, token, position + 1 - sequence.num_prompt_tokens)
        delta = RequestDelta(request_id=sequence.request_id, index=sequence.index,
                             new_token_ids=[token],
                             new_logprobs=[logprobs] if logprobs is not None else None)
        if not sequence.sent_first_delta:
            sequence.sent_first_delta = True
            delta.num_prompt_tokens = sequence.num_prompt_tokens
            delta.num_cached_tokens = max(sequence.num_cached_tokens, 0)
            if sequence.params.prompt_logprobs is not None and sequence.index == 0:
                delta.prompt_logprobs = sequence.prompt_logprobs
        if reason is not None:
            del sequence.token_ids[position + 1:]  # tokens a later step computed past its end
            delta.finish_reason, delta.stop_reason = reason, stop_reason
            self._end(sequence, reason)
            self.forget_if_done(sequence.request_id)
        return delta

    def fail_chunks(self, chunks, message: str) -> list[RequestDelta]:
        deltas = []
        for chunk in chunks:
            sequence = chunk.sequence
            self._end(sequence, "error")
            deltas.append(RequestDelta(request_id=sequence.request_id, index=sequence.index,
                                       finish_reason="error", error=message))
            self.forget_if_done(sequence.request_id)
        return deltas

    # -- introspection ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           kv_pages_used=self.coordinator.pages_used(),
                           kv_pages_total=self.coordinator.pages_total(),
                           prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
                           prefix_cache_query_tokens=self.scheduler.prefix_query_tokens,
                           num_preemptions=self.scheduler.num_preemptions,
                           page_size=self.coordinator.page_size,
                           transfer=self.pd.stats() if self.pd is not None else None,
                           tiers=tier_stats(self.tiers) if self.tiers is not None else None,
                           speculation=self.speculator.stats() if self.speculator is not None else None,
                           structured_outputs=self.structured.stats(),
                           inter_token_budget=budget.stats() if (budget := self.scheduler.inter_token_budget) else None)

    @on_engine_device
    def reset_prefix_cache(self) -> int:
        return self.coordinator.prefix_hits.reset()

    @on_engine_device
    def check_all_free(self) -> None:
        """I5 at idle: flush the prefix cache, then every page must be free."""
        if self.finish_in_flight():
            raise SanitizerError("check_all_free called while a launched step still had tokens to deliver")
        if self.scheduler.has_unfinished() or (self.pd is not None and self.pd.busy()):
            raise SanitizerError("check_all_free called while requests are unfinished")
        tiers = self.tiers
        if tiers is not None:
            tiers.drain()
        self.reset_prefix_cache()
        if tiers is not None:
            tiers.drain()  # write-back saves of the flushed nodes
            tiers.check_idle()
        self.coordinator.sanitizer.check_all_free(self.coordinator)

    @on_engine_device
    def shutdown(self) -> None:
        self.finish_in_flight()
        self._sequences.clear()
        self.structured.close()
        if self.pd is not None:
            self.pd.close()
        if self.tiers is not None:
            self.tiers.close()  # queued disk writes finish first
        self.worker.release_graphs()  # (before the workers leave the group: runner.release_graphs)
        self.executor.close()

    @on_engine_device
    def check_health(self) -> None:
        """Raises when a tensor-parallel rank has died (the engine cannot step any more); an idle
        engine's page operations since its last step reach the other ranks here."""
        self.executor.flush()
