"""The event loop the HTTP processes (``tandem serve``, ``tandem router``) run on: uvloop where it
is installed (a loop in C: less per-request overhead on every hop), else asyncio's own."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


def run(main: Awaitable[T]) -> T:
    """``asyncio.run(main)`` on uvloop when it can be imported."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
