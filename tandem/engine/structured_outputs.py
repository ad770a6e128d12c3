"""The engine's side of structured outputs: requests waiting for their grammar, the matchers,
the step's token bitmask, and the counters the server exports.

Owner: the engine core. A constrained request is admitted (to the scheduler, or to the PD
machinery) only once its grammar has compiled; until then it waits here, and running requests
keep stepping. Past ``structured_outputs_compile_timeout`` seconds it is rejected (the server
answers 400). The compiler pool, with its tokenizer info, is built on the first constrained
request, so engines that never see one never load it.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence as Sequences

import numpy as np
import torch

from tandem.protocol import StructuredOutputsStats
from tandem.sampling_params import StructuredOutputsParams
from tandem.scheduler.sequence import Sequence
from tandem.structured.bitmask import bitmask_words, fill_bitmask, fill_threads
from tandem.structured.batch_sync import BatchSync
from tandem.structured.bitmask_staging import BitmaskStaging
from tandem.structured.matcher import RequestGrammar
from tandem.structured.source import GrammarSource, check

logger = logging.getLogger(__name__)

# Idle engines wait this long for a compilation before looking at their sockets again.
COMPILE_POLL_SECONDS = 0.005


@dataclass
class _Waiting:
    sequence: Sequence
    admission: Any  # what the core needs to admit it (the request's transfer leg, or None)
    future: concurrent.futures.Future
    deadline: float


class StructuredOutputs:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 compile_timeout: float, device: torch.device, check_history: bool = False) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.compile_timeout = compile_timeout
        self.device = device
        # Sanitizer mode: each sync compares a matcher's whole history with its sequence's
        # output, not only its last token (``RequestGrammar.sync``).
        self.check_history = check_history
        self._pool = None
        self._batch_filler = None
        self._batch_sync = None
        self._staging = BitmaskStaging(bitmask_words(vocab_size), device)
        self._waiting: list[_Waiting] = []
        self.num_constrained_steps = 0  # steps that sampled at least one constrained row
        self.num_constrained_rows = 0

    @property
    def pool(self):
        if self._pool is None:
            import xgrammar

            from tandem.structured.compiler import GrammarCompilerPool

            self._pool = GrammarCompilerPool(self.tokenizer_path, self.vocab_size, self.eos_token_ids)
            self._batch_filler = xgrammar.BatchGrammarMatcher(fill_threads())  # a step's rows on several threads
            self._batch_sync = BatchSync(fill_threads())
        return self._pool

    # -- admission ------------------------------------------------------------------------------
    def compile(self, constraint: StructuredOutputsParams) -> concurrent.futures.Future:
        """Start (or find) the compilation; an invalid constraint raises ``ValueError`` naming
        ``structured_outputs``. A cached source was checked when it was first compiled: a hit
        skips the check (parsing a schema costs more than the rest of a hit). ``after_token_ids``
        outside the vocabulary raise ``ValueError`` naming it (they could never appear)."""
        after = constraint.after_token_ids or ()
        if any(token >= self.vocab_size for token in after):
            raise ValueError(f"structured_outputs.after_token_ids: token ids must be below the vocabulary size "
                             f"{self.vocab_size}, got {list(after)}")
        try:
            cached = self.pool.cached(GrammarSource.of(constraint))
        except ValueError:  # (not JSON: the check below names the field)
            cached = None
        return cached if cached is not None else self.pool.submit(check(constraint, "structured_outputs"))

    def attach(self, sequence: Sequence, future: concurrent.futures.Future) -> None:
        """Give ``sequence`` its matcher from a finished compilation (``ValueError`` if it failed)."""
        error = future.exception()
        if error is not None:
            raise ValueError(f"structured_outputs: the grammar failed to compile: {error}")
        sequence.grammar = RequestGrammar(future.result(), sequence.params.structured_outputs.after_token_ids or ())

    def wait(self, sequence: Sequence, admission: Any, future: concurrent.futures.Future) -> None:
        self._waiting.append(_Waiting(sequence, admission, future, time.monotonic() + self.compile_timeout))

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def compiled(self, block: bool = False) -> tuple[list[tuple[Sequence, Any]], list[tuple[Sequence, str]]]:
        """The waiting requests whose grammar is ready (with matchers), and those that failed or
        timed out (with the reason). ``block``: wait briefly for one compilation first."""
        if not self._waiting:
            return [], []
        if block:
            concurrent.futures.wait([entry.future for entry in self._waiting], timeout=COMPILE_POLL_SECONDS,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed, still = [], [], []
        now = time.monotonic()
        for entry in self._waiting:
            if entry.sequence.is_finished:  # aborted while it waited
                continue
            if entry.future.done():
                try:
                    self.attach(entry.sequence, entry.future)
                    ready.append((entry.sequence, entry.admission))
                except ValueError as error:
                    failed.append((entry.sequence, str(error)))
            elif now > entry.deadline:
                failed.append((entry.sequence, f"structured_outputs: the grammar did not compile within "
                                               f"{self.compile_timeout:g} s (--structured-outputs-compile-timeout)"))
            else:
                still.append(entry)
        self._waiting = still
        return ready, failed

    def forget(self, request_id: str) -> list[Sequence]:
        """Drop a request still waiting for its grammar (aborted); returns its sequence."""
        dropped = [entry.sequence for entry in self._waiting if entry.sequence.request_id == request_id]
        self._waiting = [entry for entry in self._waiting if entry.sequence.request_id != request_id]
        return dropped

    # -- steps --------------------------------------------------------------------------------
    def host_bitmask(self, sequences: Sequences[Sequence]) -> Optional[np.ndarray]:
        """A sampling step's bitmask on the host, for the sampling message (``bitmask``, no
        drafts): valid until the next bitmask is taken (the worker copies it when it samples)."""
        return self.bitmask(sequences, on_host=True)

    def bitmask(self, sequences: Sequences[Sequence], drafts: Optional[Sequences[Sequences[int]]] = None,
                count: bool = True, on_host: bool = False):
        """The device bitmask of one row per sequence (``None`` if no row is constrained, or,
        outside verification, none masks its next token: still thinking, or ended); with
        ``on_host``, the host rows as a numpy array instead (``host_bitmask``).

        Each matcher is first brought level with its sequence's output tokens. With ``drafts``
        (verification), row ``i`` is after ``drafts[i]`` on top of the output: the matcher
        accepts them for the mask and rolls back (a draft the grammar forbids leaves the rows
        after it unconstrained: verification rejects at that draft, so they are never used).
        ``count``: the step counts as a constrained step (a sampling or verification step; a
        draft's proposal is not).
        """
        grammars = [sequence.grammar if not sequence.is_finished else None for sequence in sequences]
        if all(grammar is None for grammar in grammars):
            return None
        if drafts is None:
            self._batch_sync.sync([(grammar, sequence.output_token_ids)
                                   for sequence, grammar in zip(sequences, grammars) if grammar is not None],
                                  self.check_history)
            if not any(grammar is not None and grammar.constrains_next for grammar in grammars):
                return None  # every constrained row is still thinking (or has ended): nothing to mask
            host = self._staging.take(len(sequences))
            fill_bitmask(grammars, host, self._batch_filler)
        else:
            host = self._staging.take(len(sequences))
            self._fill_draft_bitmask(host, sequences, grammars, drafts)
        if count:
            self.num_constrained_steps += 1
            self.num_constrained_rows += sum(grammar is not None for grammar in grammars)
        return host.numpy() if on_host else self._staging.to_device(host)

    def _fill_draft_bitmask(self, rows: torch.Tensor, sequences, grammars, drafts) -> None:
        for _, group in itertools.groupby(range(len(sequences)), key=lambda index: id(sequences[index])):
            indices = list(group)
            if grammars[indices[0]] is not None:
                self._fill_draft_rows(rows, indices, sequences[indices[0]], grammars[indices[0]], drafts)

    def _fill_draft_rows(self, rows: torch.Tensor, indices: list[int], sequence: Sequence, grammar: RequestGrammar,
                         drafts) -> None:
        """One sequence's consecutive rows, each after a longer prefix of its drafts; the
        matcher ends where it started (level with the output). A draft that ends the thinking
        constrains the rows after it; rows still in the thinking stay unconstrained."""
        grammar.sync(sequence.output_token_ids, self.check_history)
        accepted = 0
        try:
            for index in indices:
                draft = drafts[index]
                while accepted < len(draft) and grammar.try_accept(draft[accepted]):
                    accepted += 1
                if accepted < len(draft):
                    return  # a draft the grammar forbids: the rows after it stay unconstrained
                if grammar.constrains_next:
                    grammar.fill(rows, index)
        finally:
            grammar.rollback(accepted)

    def stats(self) -> Optional[StructuredOutputsStats]:
        if self._pool is None:
            return None
        compile_stats = self._pool.stats
        return StructuredOutputsStats(num_compiled=compile_stats.num_compiled,
                                      compile_seconds=compile_stats.compile_seconds,
                                      num_cache_hits=compile_stats.num_cache_hits,
                                      num_constrained_steps=self.num_constrained_steps,
                                      num_constrained_rows=self.num_constrained_rows,
                                      num_waiting=len(self._waiting))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._batch_sync.close()
