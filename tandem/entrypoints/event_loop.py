"""What the HTTP processes (``tandem serve``, ``tandem router``) run on: uvloop where it is
installed (a loop in C: less per-request overhead on every hop), else asyncio's own; and a
uvicorn server whose SIGINT/SIGTERM starts a bounded drain and lets the process exit 0."""
from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Awaitable, TypeVar

import uvicorn

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

T = TypeVar("T")


def run(main: Awaitable[T]) -> T:
    """``asyncio.run(main)`` on uvloop when it can be imported."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class DrainingServer(uvicorn.Server):
    """uvicorn, but a signal only starts the graceful shutdown (at most the config's
    ``timeout_graceful_shutdown``); it is not re-raised afterwards, so the process can clean up
    and exit with status 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
