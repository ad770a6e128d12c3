"""Prefill affinity: send a conversation's next turn to the prefill server that served its
prefix, whose prefix cache (device and host tiers) still holds it — the shared store serves it
anywhere, but more slowly.

The router does not tokenize, so a conversation is known by the start of its request: the
first ``PROMPT_CHARS`` characters of a text prompt, the first ``PROMPT_TOKENS`` ids of a
token-id prompt, or the chat messages up to the first user message (a system prompt and it).
A first turn shorter than that window is remembered under all of itself, so a later turn's
lookup also tries its start cut shorter. The map keeps the last prefill server per key, least recently used keys dropped past
``MAX_KEYS``. A remembered server that is unhealthy or gone is passed over.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Optional

PROMPT_CHARS = 64
PROMPT_TOKENS = 16
MAX_KEYS = 100_000


def conversation_keys(body: dict) -> list[bytes]:
    """Digests naming the conversation a request continues, most specific first (none: no single
    prompt). A prompt's start is also tried cut shorter: a first turn shorter than the window
    was remembered under all of itself."""
    if "messages" in body:
        key = conversation_key(body)
        return [key] if key is not None else []
    start = _prompt_start(body)
    if not start:
        return []
    return [_digest(body, start[:length]) for length in range(len(start), 0, -1)]


def conversation_key(body: dict) -> Optional[bytes]:
    """The digest a request's conversation is remembered under, or None (no single prompt)."""
    if "messages" in body:
        start = _first_user_turn(body["messages"]) if isinstance(body["messages"], list) else None
    else:
        start = _prompt_start(body)
    return _digest(body, start) if start else None


def _digest(body: dict, start) -> bytes:
    text = json.dumps([body.get("model"), start], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _prompt_start(body: dict):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        return prompt[:PROMPT_CHARS]
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
        return prompt[:PROMPT_TOKENS]
    return None


def _first_user_turn(messages: list) -> list:
    """The messages up to and including the first user message (a system prompt, then it)."""
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return messages[:index + 1]
    return messages[:1]


class PrefillAffinity:
    """Conversation key -> the URL of the prefill server that served it last."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._last: OrderedDict[bytes, str] = OrderedDict()

    def remembered(self, keys: list[bytes]) -> Optional[str]:
        """The server remembered under the first of ``keys`` that is known."""
        for key in keys:
            if key in self._last:
                self._last.move_to_end(key)
                return self._last[key]
        return None

    def remember(self, key: Optional[bytes], url: str) -> None:
        if key is None:
            return
        self._last[key] = url
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
