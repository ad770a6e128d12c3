"""Where tier copies run, and how their completion is observed.

On CUDA a ``TierStream`` is a side stream: work submitted to it first waits for everything the
compute stream has issued so far (the pages it reads were written there, the pages it writes
were poisoned there), and each submission ends with an event — its ``Ticket``. A reader on the
compute stream waits for a ticket with ``stream.wait_event`` (no host synchronisation); the
engine observes completion with ``event.query()`` and only then releases the pages the copy
held (I2).

On a CPU the work runs inline, in order. A test hook, ``delay_s`` (zero in production), makes
each submission run later on a worker thread instead (still in submission order), so tests can
hold a copy in flight and prove that readers wait for it (I3) and that its pages stay held (I2).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch


class Ticket:
    """The completion of one submission."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        """Block the host until the work has completed."""
        raise NotImplementedError

    def order_reader(self) -> None:
        """Make the current compute stream wait for the work (CUDA), or block until it is done."""
        self.wait()


class DoneTicket(Ticket):
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class FutureTicket(Ticket):
    def __init__(self, future: Future) -> None:
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


class EventTicket(Ticket):
    def __init__(self, event: "torch.cuda.Event") -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def order_reader(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class TierStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.delay_s = 0.0  # test hook: run each submission this much later, on a worker thread
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._last: Optional[Future] = None
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], None]) -> Ticket:
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                work()
                event = torch.cuda.Event(enable_timing=True)
                event.record(self._stream)
            return EventTicket(event)
        if self.delay_s <= 0 and (self._last is None or self._last.done()):
            work()
            return DoneTicket()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tier-copy")
        delay = self.delay_s

        def delayed() -> None:
            if delay > 0:
                time.sleep(delay)
            work()

        self._last = self._executor.submit(delayed)
        return FutureTicket(self._last)

    def record_start(self, event: "torch.cuda.Event") -> None:
        """Record ``event`` where the next submission starts (CUDA; for bandwidth figures)."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        event.record(self._stream)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        elif self._last is not None:
            self._last.result()

    def close(self) -> None:
        self.synchronize()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
