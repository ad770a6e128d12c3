"""Two-rank ``torch.distributed`` process groups between paired engines, one per (writer,
reader) pair, built without ``init_process_group`` (no global state: an engine may pair with
many peers, and tensor parallelism owns the default group).

Rendezvous: every agent hosts a ``TCPStore`` on its control host (``Rendezvous``) and names it
in its backend metadata, which travels in the authenticated handshake. A writer that loads a
reader's metadata connects to the reader's store, takes the next pair number and files
``pair/N = token:writer``; the reader's accept loop finds it, checks the token (a random value
only its metadata carried, so a process that merely reaches the port cannot pair) and both build
the pair's groups under the prefix ``N/``, the writer as rank 0 and the reader as rank 1::

    writer (rank 0)                               reader (rank 1), hosts the store
    store.add("pairs") -> N; set pair/N ------>   accept loop: check pair/N, token
    control group  (gloo, CPU: headers)  <----->  control group
    data group (NCCL on CUDA, gloo on CPU) <--->  data group

Owner: the backend (``nccl_backend.py``); each group is used by one thread of each side only.
"""
from __future__ import annotations

import datetime
import hmac
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as distributed

WRITER_RANK, READER_RANK = 0, 1


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass
class PairGroups:
    control: distributed.ProcessGroup  # gloo: headers (CPU tensors)
    data: distributed.ProcessGroup  # NCCL between GPUs, gloo between host memories
    on_device: bool

    def abort(self) -> None:
        """Tear the groups down; a thread blocked in one of their operations gets an error."""
        for group in (self.data, self.control):
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - already torn down
                pass


def _gloo(store, rank: int, host: str, timeout: float):
    options = distributed.ProcessGroupGloo._Options()
    options._timeout = timedelta(timeout)
    options._devices = [distributed.ProcessGroupGloo.create_device(hostname=host)]
    return distributed.ProcessGroupGloo(store, rank, 2, options)


def _nccl(store, rank: int, timeout: float):
    if not hasattr(distributed, "ProcessGroupNCCL"):
        raise RuntimeError("transfer_backend nccl: this torch build has no NCCL")
    options = distributed.ProcessGroupNCCL.Options()
    options._timeout = timedelta(timeout)
    return distributed.ProcessGroupNCCL(store, rank, 2, options)


def form_pair(store, rank: int, host: str, device: int, timeout: float) -> PairGroups:
    """Build a pair's groups (blocks until the other rank does the same, at most ``timeout``)."""
    control = _gloo(distributed.PrefixStore("control/", store), rank, host, timeout)
    if device >= 0:
        torch.cuda.set_device(device)
        data = _nccl(distributed.PrefixStore("data/", store), rank, timeout)
    else:
        data = _gloo(distributed.PrefixStore("data/", store), rank, host, timeout)
    return PairGroups(control, data, device >= 0)


class Rendezvous:
    """This agent's store, where writers file their pairs."""

    def __init__(self, host: str, token: str, timeout: float) -> None:
        self.host, self.token, self.timeout = host, token, timeout
        self.store = distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                          timeout=timedelta(timeout), use_libuv=True)
        self.port = self.store.port
        self.pending: set[int] = set()  # pair numbers taken whose pair was not filed yet
        self.next_number = 0

    def poll(self) -> list[tuple[str, distributed.Store]]:
        """Pairs filed since the last call, as (writer name, the pair's store prefix on a store
        client of its own). A pair filed with a wrong token raises PermissionError once."""
        taken = self.store.add("pairs", 0)
        self.pending.update(range(self.next_number, taken))
        self.next_number = max(self.next_number, taken)
        found = []
        for number in sorted(self.pending):
            key = f"pair/{number}"
            if not self.store.check([key]):
                continue
            self.pending.discard(number)
            token, _, writer = self.store.get(key).decode(errors="replace").partition(":")
            if not hmac.compare_digest(token.encode(), self.token.encode()):
                raise PermissionError(f"a pair was filed with a wrong token (writer {writer!r}); ignored")
            client = distributed.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(self.timeout),
                                          use_libuv=True)
            found.append((writer, distributed.PrefixStore(f"{number}/", client)))
        return found


def file_pair(host: str, port: int, token: str, writer: str, timeout: float) -> distributed.Store:
    """Writer side: connect to the reader's store and file a pair; returns the pair's prefix."""
    store = distributed.TCPStore(host, port, is_master=False, timeout=timedelta(timeout), use_libuv=True)
    number = store.add("pairs", 1) - 1
    store.set(f"pair/{number}", f"{token}:{writer}")
    return distributed.PrefixStore(f"{number}/", store)
