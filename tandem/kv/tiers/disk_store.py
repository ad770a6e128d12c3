"""The disk tier's page store: opaque page payloads in files, keyed by bytes, LRU-capped.

The store knows nothing about models or state kinds. Its caller keys pages by ``chain_hash``
(a hash chain of page tokens) and names the layout by ``layout_fingerprint`` (model, dtype,
page size, ordered buffer list); a file from another layout or key is never served.

Layout: ``directory/<16 hex of the fingerprint digest>/<first 2 hex of key>/<key hex>.page``.
One file per page, little-endian::

    offset  size  field
         0     8  magic  b"TNDMPAGE"
         8     2  format version (1)
        10     2  key length K (1..64)
        12     4  origin: who wrote the page (0 unknown, 1 prefill, 2 decode, 3 colocated)
        16     8  payload length P
        24    32  fingerprint digest (blake2b-256 of the fingerprint string)
        56     4  payload crc32
        60     4  header crc32 over bytes [0, 60) and the key
        64     K  key
      64+K     P  payload

Writes are atomic: a temporary file (``.<key hex>.<pid>.<n>.tmp``) in the same directory,
header and payload written, then ``os.replace``: a reader sees no file or a whole one, never a
part, and a writer killed midway leaves only a temporary file (removed by the next scan once it
is older than ``STALE_TEMP_AGE_S``).

Sharing: several processes (prefill and decode servers of one deployment) may name the same
directory. Each keeps its own index; a key missing from it is looked up in the directory
(another process may have written it), and a file deleted by another process's eviction is a
miss. Two processes writing one key write the same page (same tokens, same layout): the later
``os.replace`` wins, whole. No fsync: a file torn by a power cut is
caught by its checksums and treated as a miss, which is all a cache needs (``fsync=True``
makes the store durable at a cost). Checksum: crc32 (zlib) — about 5x blake2b's speed here
(~3 vs ~0.6 GB/s on one core) and it releases the GIL on large buffers; it guards against
accidental damage (torn writes, bit rot, truncation). Files from another model or layout
are caught by the fingerprint digest and key in the header, not by the checksum.

Completion (I2): every ``write_async`` call yields exactly one ``(key, ok)`` in ``poll()``
and one ``on_done(ok)`` call (from a writer thread), also when the store is disabled, the
key is already stored, or the write is a duplicate of one in flight — so a caller holding a
host page with an in-flight reference always learns when to release it.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from tandem.kv.tiers.page_io import (HEADER_SIZE, MAGIC, ORIGINS, Rejected as _Rejected,
                                     check_payload_tensor as _check_payload_tensor, page_header, read_page,
                                     write_all as _write_all)

logger = logging.getLogger(__name__)

MAX_KEY_LEN = 64  # its hex is the file name (names are at most 255 bytes)
_PAGE_RE = re.compile(r"^([0-9a-f]{2,128})\.page$")
STALE_TEMP_AGE_S = 60.0   # a younger temp file may be another process's write in flight
MAX_CONSECUTIVE_WRITE_FAILURES = 8
_LOG_EVERY_S = 60.0


@dataclass
class DiskStoreStats:
    files: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0              # files written
    write_failures: int = 0      # OSError while writing (disk full, ...)
    writes_skipped: int = 0      # not written: already stored, duplicate, too large, disabled
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> files deleted
    hits_by_origin: dict[str, int] = field(default_factory=dict)  # who wrote the pages read


class DiskStore:
    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fingerprint: str, *,
                 writer_threads: int = 1, fsync: bool = False,
                 stale_temp_age_s: float = STALE_TEMP_AGE_S, origin: str = "unknown") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes (--disk-cache-size) must be positive, got {capacity_bytes}")
        if writer_threads < 1:
            raise ValueError(f"writer_threads must be at least 1, got {writer_threads}")
        if origin not in ORIGINS:
            raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
        self.origin = origin
        self.fingerprint = fingerprint
        self.digest = hashlib.blake2b(fingerprint.encode(), digest_size=32).digest()
        self.root = os.path.join(os.fspath(directory), self.digest.hex()[:16])
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.available = False
        self.disabled_reason: Optional[str] = None
        self.writes_enabled = False
        self.write_disabled_reason: Optional[str] = None
        self.write_delay_s = 0.0                           # test hook: delay each write
        self.write_gate: Optional[threading.Event] = None  # test hook: writes wait for it
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._bytes = 0
        self._reserved = 0
        self._pending: dict[bytes, Future] = {}
        self._outstanding = 0
        self._done: deque[tuple[bytes, bool]] = deque()
        self._evicted: deque[bytes] = deque()
        self._stats = DiskStoreStats()
        self._consecutive_failures = 0
        self._last_log: dict[str, float] = {}
        self._tmp_counter = 0
        self.last_read_origin = "unknown"  # who wrote the latest page read (a reader's single thread)
        self._accepting = True   # False once close() begins
        self._closing = False    # True: queued writes complete as not written
        self._executor: Optional[ThreadPoolExecutor] = None
        try:
            os.makedirs(self.root, exist_ok=True)
            probe = os.path.join(self.root, f".probe.{os.getpid()}.tmp")
            with open(probe, "wb") as f:
                f.write(MAGIC)
            os.unlink(probe)
            self._scan(stale_temp_age_s)
        except OSError as e:
            self.disabled_reason = (f"disk cache disabled: --disk-cache-dir {os.fspath(directory)!r} "
                                    f"is not a writable directory ({e.strerror or e})")
            logger.warning("%s; serving without the disk tier", self.disabled_reason)
            return
        self.available = self.writes_enabled = True
        self._executor = ThreadPoolExecutor(writer_threads, thread_name_prefix="tandem-disk-writer")
        with self._lock:
            self._evict_locked(0)  # the cap may have shrunk since the last run
            self._evicted.clear()  # nothing the caller knew of

    # -- index ---------------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.root, name[:2], name + ".page")

    def _scan(self, stale_temp_age_s: float) -> None:
        found = []
        now = time.time()
        for shard in os.scandir(self.root):
            if not shard.is_dir(follow_symlinks=False):
                if shard.name.endswith(".tmp") and now - shard.stat().st_mtime >= stale_temp_age_s:
                    self._reject_path(shard.path, "stale_temp", "left by an interrupted start")
                continue
            for entry in os.scandir(shard.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.endswith(".tmp"):
                    if now - st.st_mtime >= stale_temp_age_s:
                        self._reject_path(entry.path, "stale_temp", "left by an interrupted write")
                    continue
                match = _PAGE_RE.match(entry.name)
                if match is None or len(match.group(1)) % 2 or match.group(1)[:2] != shard.name:
                    continue  # not ours: left alone
                if st.st_size < HEADER_SIZE:
                    self._reject_path(entry.path, "truncated", f"{st.st_size} bytes")
                    continue
                found.append((st.st_mtime, bytes.fromhex(match.group(1)), st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored: in this process's index, or written by another process
        sharing the directory (then indexed here from now on)."""
        with self._lock:
            if key in self._index:
                return True
            if not self.available:
                return False
        try:
            size = os.stat(self._path(key)).st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._bytes += size
        return True

    def __len__(self) -> int:
        return len(self._index)

    def _evict_locked(self, need: int) -> None:
        """Drop least-recently-used files until ``need`` more bytes fit under the cap."""
        while self._index and self._bytes + self._reserved + need > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._stats.evictions += 1
            self._evicted.append(key)
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as e:
                self._log("evict", f"could not delete {self._path(key)}: {e}")

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def discard(self, key: bytes) -> bool:
        """Delete ``key``'s file if stored; True if it was."""
        if not self.available or not self.contains(key):
            return False
        try:
            os.unlink(self._path(key))
        except OSError:
            pass
        self._forget(key)
        return True

    def poll_evicted(self) -> list[bytes]:
        """Keys evicted (capacity) since the last call, so the caller can drop disk residency."""
        with self._lock:
            out = list(self._evicted)
            self._evicted.clear()
        return out

    # -- rejection and logging -------------------------------------------------------------

    def _log(self, reason: str, message: str, count: int = 1) -> None:
        """Log at most once a minute per reason, with how many so far."""
        now = time.monotonic()
        if now - self._last_log.get(reason, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_log[reason] = now
            logger.warning("disk cache (%s, %d so far): %s", reason, count, message)

    def _reject_path(self, path: str, reason: str, detail: str) -> None:
        with self._lock:
            count = self._stats.rejected[reason] = self._stats.rejected.get(reason, 0) + 1
        self._log(reason, f"deleted {path}: {detail}", count)
        try:
            os.unlink(path)
        except OSError:
            pass

    # -- reads -----------------------------------------------------------------------------

    def read_entry(self, key: bytes) -> Optional[tuple[memoryview, str]]:
        """The payload stored under ``key`` and who wrote it, or None on a miss. Safe from any
        thread (the prefix prefetch reads here)."""
        return self._read(key, None, with_origin=True)

    def read(self, key: bytes, out: Optional[torch.Tensor] = None):
        """The payload stored under ``key`` (a writable memoryview), or None on a miss. With
        ``out`` (a contiguous uint8 CPU tensor of the payload's length) the payload is read
        straight into it and the result is True/False; on False ``out`` holds garbage."""
        return self._read(key, out)

    def _read(self, key: bytes, out: Optional[torch.Tensor], with_origin: bool = False):
        if out is not None:
            _check_payload_tensor(out, "out")
        if not self.available or not self.contains(key):
            with self._lock:
                self._stats.misses += 1
            return None if out is None else False
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                result = read_page(f, key, self.digest, out)
        except FileNotFoundError:  # deleted behind our back (another process, an operator)
            self._forget(key)
            result = None
        except OSError as e:
            result = _Rejected("unreadable", str(e))
        if isinstance(result, _Rejected):
            self._reject_path(path, result.reason, result.detail)
            self._forget(key)  # after the unlink: no write of this key starts before it
            result = None
        with self._lock:
            if result is None:
                self._stats.misses += 1
            else:
                result, origin = result
                self._stats.hits += 1
                self._stats.bytes_read += result.nbytes
                if key in self._index:
                    self._index.move_to_end(key)
                self._stats.hits_by_origin[origin] = self._stats.hits_by_origin.get(origin, 0) + 1
                self.last_read_origin = origin
                if with_origin:
                    result = (result, origin)
        if result is not None:
            try:
                os.utime(path)  # recency survives a restart (the scan orders by mtime)
            except OSError:
                pass
        if out is not None:
            return result is not None
        return result

    # -- writes ----------------------------------------------------------------------------

    def write_async(self, key: bytes, payload: torch.Tensor,
                    on_done: Optional[Callable[[bool], None]] = None) -> Future:
        """Store ``payload`` (a contiguous uint8 CPU tensor the caller keeps alive and unchanged
        until completion) under ``key`` in the background. The future's result and ``on_done``'s
        argument: True if the key is stored (written now or already there), else False."""
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_LEN:
            raise ValueError(f"key must be 1..{MAX_KEY_LEN} bytes, got {key!r:.80}")
        _check_payload_tensor(payload, "payload")
        fut: Future = Future()
        with self._lock:
            self._outstanding += 1
            primary = self._pending.get(key)
            if primary is None and self.writes_enabled and self._accepting and key not in self._index:
                self._pending[key] = fut
                self._executor.submit(self._write_job, key, payload, fut, on_done)
                return fut
            self._stats.writes_skipped += 1
            stored = key in self._index
        if primary is not None:  # same key in flight: complete with it
            primary.add_done_callback(lambda p: self._complete(key, p.result(), fut, on_done))
        else:
            self._complete(key, stored, fut, on_done)
        return fut

    def _write_job(self, key: bytes, payload: torch.Tensor, fut: Future,
                   on_done: Optional[Callable[[bool], None]]) -> None:
        ok = False
        try:
            if self.write_gate is not None:
                self.write_gate.wait()
            if self.write_delay_s > 0:
                time.sleep(self.write_delay_s)
            ok = self._write(key, payload)
        except Exception as e:  # a bug, not an I/O error: still complete the write
            logger.exception("disk cache write of %s failed: %s", key.hex(), e)
        finally:
            with self._lock:
                self._pending.pop(key, None)
            self._complete(key, ok, fut, on_done)

    def _write(self, key: bytes, payload: torch.Tensor) -> bool:
        data = memoryview(payload.view(-1).numpy()).cast("B")
        size = HEADER_SIZE + len(key) + len(data)
        with self._lock:
            if self._closing or not self.writes_enabled or size > self.capacity_bytes:
                self._stats.writes_skipped += 1
                if size > self.capacity_bytes:
                    self._log("too_large", f"{size}-byte page exceeds the cap of {self.capacity_bytes} "
                              "bytes (--disk-cache-size): not written", self._stats.writes_skipped)
                return False
            self._evict_locked(size)
            self._reserved += size
            self._tmp_counter += 1
            tmp_name = f".{key.hex()}.{os.getpid()}.{self._tmp_counter}.tmp"
        path = self._path(key)
        tmp = os.path.join(os.path.dirname(path), tmp_name)
        try:
            header = page_header(key, data, self.origin, self.digest)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "xb", buffering=0) as f:
                _write_all(f, header)
                _write_all(f, data)
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._write_failed(path, e)
            return False
        finally:
            with self._lock:
                self._reserved -= size
        with self._lock:
            self._index[key] = size
            self._bytes += size
            self._stats.writes += 1
            self._stats.bytes_written += size
            self._consecutive_failures = 0
        return True

    def _write_failed(self, path: str, e: OSError) -> None:
        with self._lock:
            self._stats.write_failures += 1
            self._consecutive_failures += 1
            give_up = self._consecutive_failures >= MAX_CONSECUTIVE_WRITE_FAILURES and self.writes_enabled
            if give_up:
                self.writes_enabled = False
        what = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        self._log("write_failed", f"could not write {path}: {what}", self._stats.write_failures)
        if give_up:
            self.write_disabled_reason = (
                f"disk cache writes disabled after {MAX_CONSECUTIVE_WRITE_FAILURES} failed writes in a "
                f"row under --disk-cache-dir {self.root!r} (last: {what}); stored pages are still read")
            logger.warning("%s", self.write_disabled_reason)

    def _complete(self, key: bytes, ok: bool, fut: Future,
                  on_done: Optional[Callable[[bool], None]]) -> None:
        with self._lock:
            self._done.append((key, ok))
        if on_done is not None:
            try:
                on_done(ok)
            except Exception:
                logger.exception("disk cache on_done callback for %s raised", key.hex())
        fut.set_result(ok)
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    def poll(self) -> list[tuple[bytes, bool]]:
        """Writes completed since the last call, as (key, ok); never blocks."""
        with self._lock:
            out = list(self._done)
            self._done.clear()
        return out

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every write handed in so far has completed; False if ``timeout`` ran out."""
        with self._lock:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self, cancel_pending: bool = False) -> None:
        """Finish queued writes (or, with ``cancel_pending``, complete them as not written) and
        stop the writer threads. Later calls are misses and no-ops."""
        with self._lock:
            self._accepting = False
            self._closing = self._closing or cancel_pending
        if self._executor is not None:
            if cancel_pending and self.write_gate is not None:
                self.write_gate.set()
            self._executor.shutdown(wait=True)
        with self._lock:
            self._closing = True
            self.writes_enabled = False
            if self.available:
                self.available = False
                self.disabled_reason = "disk cache closed"

    @property
    def stats(self) -> DiskStoreStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats, files=len(self._index), bytes=self._bytes,
                           rejected=dict(self._stats.rejected), hits_by_origin=dict(self._stats.hits_by_origin))

    @property
    def writes_in_flight(self) -> int:
        """Writes handed in and not yet completed."""
        with self._lock:
            return self._outstanding
