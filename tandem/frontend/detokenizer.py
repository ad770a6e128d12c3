"""Incremental detokenization: token ids arrive a few at a time, text leaves as it becomes final.

Byte-level BPE tokens may hold part of a UTF-8 character; a partial character decodes to
U+FFFD. The detokenizer decodes a short window of ids twice (the part already emitted and the
whole window) and emits the difference only once it no longer ends in U+FFFD, so a half
character is never emitted. ``finish`` flushes whatever is left, even an incomplete character,
so the concatenated deltas equal the decoding of all ids.
"""
from __future__ import annotations

# How many prompt tokens of context to decode in front of the first generated token: enough for
# tokenizers (SentencePiece) whose decoding of a token depends on the token before it.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text deltas. Owned by one output-processor sequence.

    ``prefix_offset``..``read_offset`` is the window already emitted (kept as context);
    ``read_offset``.. is what has not been emitted yet::

        ids:  [ ... prompt context ... | generated ids ......................... ]
                  ^prefix_offset            ^read_offset (emitted up to here)    ^len(ids)
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 deferred: bool = False):
        self.tokenizer = tokenizer
        # Deferred: ``add_tokens`` only collects ids and ``finish`` decodes them all at once
        # (the same text, for callers that need none before the end).
        self.deferred = deferred
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.token_ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append ids; return the text that became final (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        return "" if self.deferred else self._emit(flush=False)

    def finish(self) -> str:
        """Return everything not yet emitted, even an incomplete trailing character."""
        return self._emit(flush=True)

    def _emit(self, flush: bool) -> str:
        if self.read_offset >= len(self.token_ids):
            return ""
        emitted_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(window_text) <= len(emitted_text) and not flush:
            return ""
        if window_text.endswith(REPLACEMENT_CHARACTER) and not flush:
            return ""
        delta = window_text[len(emitted_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta
