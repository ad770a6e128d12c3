"""Markers in generated text (``<tool_call>``, ``</think>``): what streaming parsers hold back."""
from __future__ import annotations


def partial_marker_start(text: str, marker: str) -> int:
    """Where a trailing prefix of ``marker`` begins in ``text`` (``len(text)`` when none does): the
    text from there may turn out to be the marker, so a streaming parser holds it back."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)
