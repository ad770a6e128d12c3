"""Turning engine deltas into user-facing ``RequestOutput``s: text, stop strings, logprobs.

Used by the offline ``LLM`` (in-process, right after ``EngineCore.step``) and by the server's
frontend (on deltas that arrived over ZMQ). Stop *strings* are checked here, not in the engine:
a sequence that a stop string ended is reported back so the caller can call
``EngineCore.finish_sequences`` and free its pages.
"""
from __future__ import annotations

from typing import Optional

from tandem.protocol import PositionLogprobs, RequestDelta
from tandem.frontend.detokenizer import IncrementalDetokenizer
from tandem.outputs import CompletionOutput, Logprob, PositionLogprobDict, RequestOutput
from tandem.sampling_params import SamplingParams

SequenceKey = tuple[str, int]


class TokenTextCache:
    """Decoded text of single token ids (for logprob entries), memoised per tokenizer."""

    def __init__(self, tokenizer, incremental_text: bool = True):
        self.tokenizer = tokenizer
        # False: callers read only finished outputs (the offline API), so a sequence without
        # stop strings is decoded once when it finishes instead of at every step.
        self.incremental_text = incremental_text
        self.texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            self.texts[token_id] = text
        return text

    def logprob_dict(self, position: PositionLogprobs) -> PositionLogprobDict:
        """vLLM shape: the chosen token first (with its true rank), then the top-k by rank."""
        result: PositionLogprobDict = {}
        chosen_id = position.token_ids[0]
        result[chosen_id] = Logprob(position.logprobs[0], position.rank, self.text(chosen_id))
        for rank, (token_id, logprob) in enumerate(zip(position.token_ids[1:], position.logprobs[1:]), start=1):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, self.text(token_id))
        return result


class SequenceState:
    """One of a request's ``n`` sequences, as the frontend sees it. Owned by its ``RequestState``.

    ``text`` holds all text detokenized so far (cut at a stop string once one is found);
    ``emitted_length`` is how much of it has been handed out in deltas. While a sequence runs,
    the last ``len(longest stop string) - 1`` characters are held back, so a stop string is never
    streamed in part.
    """

    def __init__(self, index: int, params: SamplingParams, detokenizer: Optional[IncrementalDetokenizer]):
        self.index = index
        self.params = params
        self.detokenizer = detokenizer
        self.text = ""
        self.emitted_length = 0
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[PositionLogprobDict]] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        self.hold_back = max((len(stop) for stop in params.stop), default=1) - 1
        # Per-step deltas, reset by ``RequestState.snapshot``.
        self.step_token_ids: list[int] = []
        self.changed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, delta: RequestDelta, token_texts: TokenTextCache) -> bool:
        """Fold one engine delta in; return True when a stop string ended a sequence that the
        engine still runs (the caller must then tell the engine to finish it)."""
        self.changed = True
        self.token_ids.extend(delta.new_token_ids)
        self.step_token_ids.extend(delta.new_token_ids)
        self._add_logprobs(delta.new_logprobs, token_texts)
        if self._add_text(delta):
            return delta.finish_reason is None
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
        return False

    def _add_logprobs(self, positions: Optional[list[PositionLogprobs]], token_texts: TokenTextCache) -> None:
        if self.logprobs is None or not positions:
            return
        for position in positions:
            self.logprobs.append(token_texts.logprob_dict(position))
            self.cumulative_logprob += position.logprobs[0]

    def _text_token_ids(self, delta: RequestDelta) -> list[int]:
        """The ids whose text is shown: a stop token id is hidden unless asked for (as vLLM)."""
        ids = delta.new_token_ids
        hides_stop_token = (delta.finish_reason == "stop" and delta.stop_reason is not None
                            and not self.params.include_stop_str_in_output)
        return ids[:-1] if hides_stop_token and ids and ids[-1] == delta.stop_reason else ids

    def _add_text(self, delta: RequestDelta) -> bool:
        if self.detokenizer is None:
            return False
        previous_length = len(self.text)
        self.text += self.detokenizer.add_tokens(self._text_token_ids(delta))
        if delta.finish_reason is not None:
            self.text += self.detokenizer.finish()
        return self._check_stop_strings(previous_length)

    def _check_stop_strings(self, previous_length: int) -> bool:
        """Search the new text (and the few characters before it) for a stop string."""
        if not self.params.stop:
            return False
        for stop in self.params.stop:
            search_from = max(0, previous_length - len(stop) + 1)
            position = self.text.find(stop, search_from)
            if position < 0:
                continue
            end = position + len(stop) if self.params.include_stop_str_in_output else position
            self.text = self.text[:end]
            self.finish_reason = "stop"
            self.stop_reason = stop
            return True
        return False

    def snapshot(self) -> CompletionOutput:
        """A self-contained copy of this sequence's output, with this step's deltas; resets them."""
        visible_length = len(self.text) if self.finished else max(self.emitted_length, len(self.text) - self.hold_back)
        output = CompletionOutput(
            index=self.index,
            text=self.text[:visible_length],
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            delta_text=self.text[self.emitted_length:visible_length],
            delta_token_ids=self.step_token_ids,
        )
        self.emitted_length = visible_length
        self.step_token_ids = []
        self.changed = False
        return output


class RequestState:
    """Everything the frontend tracks for one request. Owned by the ``OutputProcessor``."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, deferred_text: bool = False):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.sequences = [
            SequenceState(index, params, self._make_detokenizer(tokenizer, params, deferred_text))
            for index in range(params.n)]
        self.prompt_logprobs: Optional[list[Optional[PositionLogprobDict]]] = None
        self.num_cached_tokens = 0
        self.error: Optional[str] = None

    def _make_detokenizer(self, tokenizer, params: SamplingParams,
                          deferred: bool) -> Optional[IncrementalDetokenizer]:
        if not params.detokenize or tokenizer is None:
            return None
        return IncrementalDetokenizer(tokenizer, self.prompt_token_ids, params.skip_special_tokens, deferred)

    @property
    def finished(self) -> bool:
        return all(sequence.finished for sequence in self.sequences)

    def apply(self, delta: RequestDelta, token_texts: TokenTextCache) -> bool:
        """Fold one delta in; True when a stop string ended that sequence in this delta."""
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None if position is None else token_texts.logprob_dict(position)
                                    for position in delta.prompt_logprobs]
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        stopped_by_string = self.sequences[delta.index].apply(delta, token_texts)
        if delta.finish_reason == "error":
            self._fail(delta.error or "engine error")
        return stopped_by_string

    def _fail(self, error: str) -> None:
        """An engine error ends the whole request: every sequence finishes with "error"."""
        self.error = error
        for sequence in self.sequences:
            if not sequence.finished:
                sequence.finish_reason = "error"
                sequence.changed = True

    def snapshot(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[sequence.snapshot() for sequence in self.sequences],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )


class OutputProcessor:
    """Folds ``RequestDelta``s into cumulative ``RequestOutput``s.

    Owns one ``RequestState`` per live request, from ``add_request`` until the request finishes
    (all ``n`` sequences) or is aborted. Deltas for unknown requests or for sequences already
    finished (e.g. ended by a stop string while the engine ran ahead) are ignored.
    """

    def __init__(self, tokenizer, incremental_text: bool = True):
        self.tokenizer = tokenizer
        # False: callers read only finished outputs (the offline API), so a sequence without
        # stop strings is decoded once when it finishes instead of at every step.
        self.incremental_text = incremental_text
        self.token_texts = TokenTextCache(tokenizer)
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer,
                                                 deferred_text=not self.incremental_text and not params.stop)

    def process(self, deltas: list[RequestDelta],
                finished_only: bool = False) -> tuple[list[RequestOutput], list[SequenceKey]]:
        """Apply one step's deltas.

        Returns the outputs of the requests that changed (in first-seen order; with
        ``finished_only``, of those that finished) and the ``(request_id, index)`` sequences
        that a stop string ended, for ``finish_sequences``.
        """
        changed: dict[str, RequestState] = {}
        stopped: list[SequenceKey] = []
        for delta in deltas:
            state = self.requests.get(delta.request_id)
            if state is None or not 0 <= delta.index < len(state.sequences):
                continue
            if state.sequences[delta.index].finished:
                continue
            if state.apply(delta, self.token_texts):
                stopped.append((delta.request_id, delta.index))
            changed[delta.request_id] = state
        outputs = [state.snapshot() for state in changed.values() if state.finished or not finished_only]
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        return outputs, stopped

    def abort(self, request_id: str) -> None:
        """Forget a request (the caller aborts it in the engine). Unknown ids are ignored."""
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_unfinished(self) -> int:
        return len(self.requests)
