"""One engine step with speculative decoding (the engine core's step while it speculates).

    propose for sequences whose state just arrived (PD decode), then schedule: a sampling
      chunk carries the sequence's drafts after its known tokens
    set aside what a rollback may restore (recurrent working slots of the target's groups), into
      slots each sequence reserved with its pages when it was scheduled
    one target forward pass over every chunk (known tokens and drafts)
    chunks without drafts have computed their tokens; fork n > 1 siblings at the end of a prompt
    verify: accepted drafts plus one token of the target's, per sampling sequence
    append them (up to a finishing token); roll back every group past the accepted tokens
    draft work: every chunk's draft state catches up with the target; continuing sequences
      get new drafts
    book the chunks as computed: the prefix cache takes their pages, now that every group's
      state is written; PD prefill sends the pages they completed (target and draft alike)
    deltas, one per token (a finishing token ends the sequence and frees its pages)

The overlapped loop is off while speculating: the next step's rows (how many tokens each
sequence kept, which drafts it carries) are only known once verification has finished. On CUDA
the target's pass replays a graph when it is a pure decode or a verification whose every token
is sampled (one known token and its drafts per sequence, laid out as single-token rows), and the
draft's passes replay the draft's own graphs; other steps (prefill chunks) run eagerly.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from tandem.protocol import RequestDelta
from tandem.kv.block_pool import SanitizerError
from tandem.scheduler.scheduler import holds_prompt_chunk
from tandem.scheduler.sequence import Sequence
from tandem.spec_decode.metrics import SpeculationMetrics
from tandem.spec_decode.proposer import DraftWork, HiddenRows, Proposer
from tandem.spec_decode.verify import Verdict, Verifier, VerifyItem
from tandem.step_context import StepContext

logger = logging.getLogger(__name__)


class SpeculativeStep:
    def __init__(self, core: StepContext, proposer: Proposer, verifier: Verifier, target_groups: list[int],
                 metrics: SpeculationMetrics) -> None:
        self.core = core
        self.proposer = proposer
        self.verifier = verifier
        self.target_groups = target_groups
        self.metrics = metrics

    def __call__(self) -> list[RequestDelta]:
        core = self.core
        pending = [sequence for sequence in core.scheduler.running
                   if sequence.speculation is not None and sequence.speculation.pending]
        if pending:
            self.proposer.run([DraftWork(sequence, propose=True) for sequence in pending])
        started = time.perf_counter()
        output = core.scheduler.schedule()
        deltas = self._run(output.chunks) if output.chunks else []
        if output.chunks:  # the step is synchronous: its tokens are on the host now
            core.scheduler.record_step(output.num_tokens, time.perf_counter() - started,
                                       with_prefill=holds_prompt_chunk(output.chunks))
        core.check_books()
        return deltas

    def _run(self, chunks) -> list[RequestDelta]:
        core, coordinator = self.core, self.core.coordinator
        copies = {id(chunk): coordinator.speculation.set_aside(chunk.sequence.state, self.target_groups)
                  for chunk in chunks if chunk.num_draft_tokens}
        try:
            result = core.execute(chunks, hidden_states=True)
        except SanitizerError:
            raise
        except Exception as error:  # a failed forward ends its sequences, not the engine
            logger.exception("forward pass failed")
            for owner in copies.values():
                if owner is not None:
                    coordinator.speculation.end_set_aside(owner)
            return core.fail_chunks(chunks, f"{type(error).__name__}: {error}")
        step = result.step
        for chunk in step.chunks:
            if not chunk.num_draft_tokens:
                chunk.sequence.num_computed_tokens = chunk.start + chunk.num_new_tokens
        items, children = self._verify_items(result)
        verdicts = self.verifier(items) if items else []
        emitted = {id(item.sequence): self._until_finish(item.sequence, verdict)
                   for item, verdict in zip(items, verdicts)}
        for item in items:
            item.sequence.token_ids.extend(emitted[id(item.sequence)][0])
        for chunk, verdict in zip(result.sampling_chunks, self._chunk_verdicts(items, verdicts)):
            if chunk.num_draft_tokens:
                tokens, _, finished = emitted[id(chunk.sequence)]
                # A sequence that ends on an accepted draft (an end of sequence a grammar made
                # likely) books it uncomputed, as the target's own last token always is: an MTP
                # layer's state at a position needs the token after it, which never comes.
                self._roll_back(chunk, verdict, len(tokens) - finished, copies.pop(id(chunk)))
        self.proposer.run(self._draft_works(result, children, emitted))
        for chunk in step.chunks:
            # Only now is every group's state of the computed tokens written (the draft's too):
            # the prefix cache may take the pages (and a recurrent checkpoint slot).
            core.scheduler.on_computed(chunk, chunk.sequence.num_computed_tokens)
            core.collect_prompt_logprobs(chunk, result.prompt_logprobs.get(id(chunk)))
            if core.pd is not None:
                core.pd.after_computed(chunk)  # PD prefill: send the pages this chunk completed
        deltas = []
        for item in items:
            sequence = item.sequence
            tokens, logprobs, _ = emitted[id(sequence)]
            first = sequence.num_tokens - len(tokens)
            for offset, (token, entry) in enumerate(zip(tokens, logprobs)):
                deltas.append(core.token_delta(sequence, first + offset, token, entry))
        return deltas

    def _verify_items(self, result) -> tuple[list[VerifyItem], dict[int, list[Sequence]]]:
        """One item per sampling chunk (its drafts), and one per sibling forked from it."""
        items, children, row = [], {}, 0
        for chunk in result.sampling_chunks:
            sequence = chunk.sequence
            drafts = sequence.draft_token_ids[:chunk.num_draft_tokens]
            state = sequence.speculation
            items.append(VerifyItem(sequence, row, drafts, bool(drafts) and state is not None and state.drafts_drawn))
            forked = self.core.fork(sequence)
            for child in forked:
                child.speculation = state.fork() if state is not None else None
                items.append(VerifyItem(child, row, []))
            children[id(sequence)] = forked
            row += 1 + chunk.num_draft_tokens
        return items, children

    @staticmethod
    def _chunk_verdicts(items: list[VerifyItem], verdicts: list[Verdict]) -> list[Verdict]:
        """The verdicts of the sampling chunks' own sequences (forked siblings' left out)."""
        seen, result = set(), []
        for item, verdict in zip(items, verdicts):
            if item.row not in seen:
                seen.add(item.row)
                result.append(verdict)
        return result

    def _until_finish(self, sequence: Sequence, verdict: Verdict) -> tuple[list[int], list, bool]:
        """The verdict's tokens up to the first that ends the sequence; whether one does."""
        for index, token in enumerate(verdict.token_ids):
            reason, _ = self.core.finish_reason(sequence, token, sequence.num_output_tokens + index + 1)
            if reason is not None:
                return verdict.token_ids[:index + 1], verdict.logprobs[:index + 1], True
        return verdict.token_ids, verdict.logprobs, False

    def _roll_back(self, chunk, verdict: Verdict, num_emitted: int, owner: Optional[str]) -> None:
        """Roll every group back past the accepted drafts; the sequence has computed up to them,
        or (a group restored its state from before the step) up to the chunk's start."""
        coordinator = self.core.coordinator
        kept = min(verdict.num_accepted, num_emitted)
        num_valid = chunk.start + chunk.num_new_tokens + kept
        exact = coordinator.speculation.roll_back(chunk.sequence.state, owner, self.target_groups, num_valid=num_valid,
                                      num_written=chunk.start + chunk.num_query_tokens)
        if owner is not None:
            coordinator.speculation.end_set_aside(owner)
        chunk.sequence.num_computed_tokens = num_valid if exact else chunk.start
        self.metrics.record(chunk.num_draft_tokens, verdict.num_accepted)

    def _draft_works(self, result, children: dict[int, list[Sequence]], emitted) -> list[DraftWork]:
        """Every chunk's sequence (and forked sibling) catches up; those going on propose."""
        step = result.step
        works = []
        for index, chunk in enumerate(step.chunks):
            hidden = HiddenRows(step.query_starts[index], chunk.start)  # (rank 0's worker kept the step's)
            for sequence in [chunk.sequence] + children.get(id(chunk.sequence), []):
                outcome = emitted.get(id(sequence))
                goes_on = outcome is not None and not outcome[2] and not sequence.is_finished
                works.append(DraftWork(sequence, chunk.start, hidden, propose=goes_on, sampled=outcome is not None))
        return works

