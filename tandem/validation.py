"""Input validation shared by every options type: errors name the field first, so callers (the
server's 400s, the CLI) can point at it."""
from __future__ import annotations


def require(ok: bool, field: str, message: str) -> None:
    """Raise ``ValueError("field: message")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{field}: {message}")
