"""The shared page store's interface: what the tiers ask of a backend, and how one is opened.

A store maps a page key (the chain hash of the page's tokens under its ancestors, so a decode
server's generated pages extend the chain of the prompt's pages exactly) to an opaque payload
written under one layout fingerprint. Every prefill and decode server of a deployment that
opens the same location shares it: a page one server wrote is a hit on every other.

Contract (every backend):
- ``write_async(key, payload, on_done)`` completes exactly once (``poll`` yields ``(key, ok)``,
  ``on_done(ok)`` runs), whatever happens; a reader never sees a partly written page, also when
  the writer dies midway; the caller keeps the payload unchanged until completion.
- ``read(key)`` returns the whole payload, verified (checksum, key, fingerprint), or None; a
  damaged or foreign page is a miss, never data. ``last_read_origin`` names the role of the
  server that wrote the latest page read.
- ``contains(key)`` sees pages other processes wrote.

Backends: ``file`` (``disk_store.DiskStore``: one checksummed file per page, written to a
temporary name and renamed into place) is the default: a local directory, or a shared
filesystem mounted on every server.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Protocol

import torch


class PageStore(Protocol):
    available: bool
    disabled_reason: Optional[str]
    last_read_origin: str

    def contains(self, key: bytes) -> bool: ...

    def read(self, key: bytes, out: Optional[torch.Tensor] = None): ...

    def write_async(self, key: bytes, payload: torch.Tensor,
                    on_done: Optional[Callable[[bool], None]] = None): ...

    def poll(self) -> list[tuple[bytes, bool]]: ...

    def drain(self, timeout: Optional[float] = None) -> bool: ...

    def close(self, cancel_pending: bool = False) -> None: ...

    @property
    def writes_in_flight(self) -> int: ...

    @property
    def stats(self): ...


def open_store(location: str | os.PathLike, capacity_bytes: int, fingerprint: str, *,
               origin: str = "unknown") -> PageStore:
    """The store at ``location``: a directory (``file://`` prefix optional) for the file backend."""
    from tandem.kv.tiers.disk_store import DiskStore

    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"disk_cache_dir: {text!r}: only the file backend (a directory, or file://DIR) exists")
    return DiskStore(text.removeprefix("file://"), capacity_bytes, fingerprint, origin=origin)
