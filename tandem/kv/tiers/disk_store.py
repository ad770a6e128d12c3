"""The disk tier's page store: opaque page payloads in files, by key, under a layout fingerprint.

One file per page: ``<directory>/<fingerprint digest[:16]>/<key[:1] hex>/<key hex>.page``. A file
is a header — magic, format version, the full fingerprint digest, the key, the payload length,
a BLAKE2b-128 checksum of the payload — then the payload. Writes go to a temporary file in the
same directory, are flushed, then renamed over the final name (atomic on POSIX): a reader sees
a whole file or none. Every read checks the header and the checksum; a truncated, corrupt or
foreign file (another fingerprint or key) is counted by reason, logged once per reason, deleted
and treated as a miss — never served.

The store knows nothing of models: the tiers hand it payloads and keys. It keeps an index
(key → size) built by scanning its directory at start, and a size cap: least recently used
files go first (recency: the file's mtime, refreshed on every read). Writes run on a background
thread; the caller's payload tensor is private to the write (the tiers copy it out of the host
pool first). An unusable directory disables the store (``available`` False, a reason naming
``--disk-cache-dir``); repeated write failures (a full disk) disable writing, reads go on.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

MAGIC = b"TNDMPAGE"
VERSION = 1
# magic, version, fingerprint digest (16), key length, key (32, zero padded), payload length,
# payload checksum (16)
HEADER = struct.Struct("<8sI16sB32sQ16s")
MAX_KEY = 32
TEMP_SUFFIX = ".tmp"
WRITE_FAILURES_TO_DISABLE = 8


def layout_fingerprint(parts: Iterable[object]) -> str:
    """A stable digest of what makes a stored page meaningful (model identity, dtype, page
    size, the ordered buffer list): ``repr`` of each part, hashed."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(repr(part).encode())
        digest.update(b"\x00")
    return digest.hexdigest()


def _checksum(payload: memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass
class DiskStats:
    files: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_failures: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class DiskStore:
    def __init__(self, directory, capacity_bytes: int, fingerprint: str, *, writer_threads: int = 1) -> None:
        self.capacity_bytes = capacity_bytes
        self.fingerprint = bytes.fromhex(fingerprint)[:16].ljust(16, b"\x00") if _is_hex(fingerprint) \
            else hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
        self.root = Path(directory) / self.fingerprint.hex()
        self.write_delay_s = 0.0  # test hook: hold each write in flight this long
        self.stats = DiskStats()
        self.available = True
        self.disabled_reason: Optional[str] = None
        self.writes_enabled = True
        self._index: "OrderedDict[bytes, int]" = OrderedDict()  # key -> size, least recent first
        self._pending: dict[bytes, Future] = {}
        self._completed: list[tuple[bytes, bool]] = []
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._executor = ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix="disk-tier")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe{os.getpid()}{TEMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            self._disable(f"--disk-cache-dir {directory}: not a writable directory ({error})")
            return
        self._scan()

    # -- state -------------------------------------------------------------------------------
    def _disable(self, reason: str) -> None:
        self.available = False
        self.disabled_reason = reason
        logger.warning("disk tier disabled: %s", reason)

    def _path(self, key: bytes) -> Path:
        return self.root / key[:1].hex() / f"{key.hex()}.page"

    def _scan(self) -> None:
        entries = []
        for path in self.root.glob("*/*"):
            if path.name.endswith(TEMP_SUFFIX):
                path.unlink(missing_ok=True)  # a write that never finished
                continue
            if not path.name.endswith(".page"):
                continue
            try:
                key = bytes.fromhex(path.name[:-len(".page")])
                stat = path.stat()
            except (ValueError, OSError):
                continue
            entries.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
        self._recount()
        self._enforce_capacity()

    def _recount(self) -> None:
        self.stats.files = len(self._index)
        self.stats.bytes = sum(self._index.values())

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    # -- reads ---------------------------------------------------------------------------------
    def _reject(self, key: bytes, path: Path, reason: str) -> None:
        with self._lock:
            self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
            self._index.pop(key, None)
            self._recount()
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("disk tier: rejected %s (%s): deleted, treated as a miss", path, reason)
        try:
            path.unlink()
        except OSError:
            pass

    def read(self, key: bytes) -> Optional[bytes]:
        """The payload stored under ``key``, checked; None on a miss or a rejected file."""
        if not self.available or not self.contains(key):
            self.stats.misses += 1
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self._reject(key, path, "unreadable")
            return None
        if len(data) < HEADER.size:
            self._reject(key, path, "truncated")
            return None
        magic, version, fingerprint, key_length, stored_key, length, checksum = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            self._reject(key, path, "format")
            return None
        if fingerprint != self.fingerprint or stored_key[:key_length] != key:
            self._reject(key, path, "foreign")
            return None
        payload = memoryview(data)[HEADER.size:]
        if len(payload) != length:
            self._reject(key, path, "truncated")
            return None
        if _checksum(payload) != checksum:
            self._reject(key, path, "checksum")
            return None
        now = time.time()
        try:
            os.utime(path, (now, now))
        except OSError:
            pass
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        self.stats.hits += 1
        self.stats.bytes_read += length
        return bytes(payload)

    # -- writes ----------------------------------------------------------------------------------
    def write_async(self, key: bytes, payload: torch.Tensor,
                    on_done: Optional[Callable[[bool], None]] = None) -> Optional[Future]:
        """Store ``payload`` (a contiguous uint8 CPU tensor the caller does not change) under
        ``key`` on the writer thread. Keys present or being written are skipped (None)."""
        if len(key) > MAX_KEY:
            raise ValueError(f"disk store: keys are at most {MAX_KEY} bytes")
        if not self.available or not self.writes_enabled:
            return None
        with self._lock:
            if key in self._index or key in self._pending:
                return None
            future = self._executor.submit(self._write, key, payload)
            self._pending[key] = future

        def finished(done: Future) -> None:
            ok = not done.cancelled() and done.exception() is None and done.result()
            with self._lock:
                self._pending.pop(key, None)
                self._completed.append((key, ok))
            if on_done is not None:
                on_done(ok)

        future.add_done_callback(finished)
        return future

    def _write(self, key: bytes, payload: torch.Tensor) -> bool:
        if self.write_delay_s > 0:
            time.sleep(self.write_delay_s)
        body = memoryview(payload.contiguous().numpy()).cast("B")
        header = HEADER.pack(MAGIC, VERSION, self.fingerprint, len(key), key.ljust(MAX_KEY, b"\x00"),
                             len(body), _checksum(body))
        path = self._path(key)
        temporary = path.with_name(f"{path.name}.{threading.get_ident()}{TEMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                handle.write(header)
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except OSError as error:
            try:
                temporary.unlink()
            except OSError:
                pass
            self._write_failed(error)
            return False
        size = HEADER.size + len(body)
        with self._lock:
            self._index[key] = size
            self._index.move_to_end(key)
            self.stats.writes += 1
            self.stats.bytes_written += size
            self._recount()
        self._enforce_capacity()
        return True

    def _write_failed(self, error: OSError) -> None:
        with self._lock:
            self.stats.write_failures += 1
            failures = self.stats.write_failures
        reason = "disk full" if error.errno == errno.ENOSPC else str(error)
        if "write" not in self._logged:
            self._logged.add("write")
            logger.warning("disk tier: a page write failed (%s); the page stays out of the disk tier", reason)
        if failures >= WRITE_FAILURES_TO_DISABLE and self.writes_enabled:
            self.writes_enabled = False
            logger.warning("disk tier: %d page writes failed; no more writes (reads go on)", failures)

    def _enforce_capacity(self) -> None:
        victims = []
        with self._lock:
            total = sum(self._index.values())
            while total > self.capacity_bytes and self._index:
                key, size = self._index.popitem(last=False)
                total -= size
                victims.append(key)
                self.stats.evictions += 1
            self._recount()
        for key in victims:
            try:
                self._path(key).unlink()
            except OSError:
                pass

    def poll(self) -> list[tuple[bytes, bool]]:
        """Writes completed since the last poll: (key, stored)."""
        with self._lock:
            completed, self._completed = self._completed, []
        return completed

    def drain(self, timeout: Optional[float] = None) -> None:
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            future.exception(timeout=timeout)

    def close(self) -> None:
        self.drain()
        self._executor.shutdown(wait=True)


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
        return len(text) >= 32
    except ValueError:
        return False
