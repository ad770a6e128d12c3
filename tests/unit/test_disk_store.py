"""The disk tier's page store: round trip, restart, damaged and foreign files never served,
unwritable directory, disk full, LRU capacity, concurrent writes, the write-delay hook, and the
page chain hash and layout fingerprint its caller keys pages by."""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time

import pytest
import torch

from tandem.kv.tiers import disk_store, page_io
from tandem.kv.tiers.disk_store import HEADER_SIZE, DiskStore
from tandem.kv.keys import chain_hash, layout_fingerprint

FP = layout_fingerprint(["tiny-llama", torch.float32, 16, [("kv", 0, (2, 4, 16, 8))]])
PAGE = 1000


def page(seed: int, n: int = PAGE) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def key(i: int) -> bytes:
    return chain_hash(b"", [i])


def store_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)


def written(store: DiskStore, pages: dict[bytes, torch.Tensor]) -> DiskStore:
    for k, p in pages.items():
        store.write_async(k, p)
    assert store.drain(timeout=10)
    assert sorted(store.poll()) == sorted((k, True) for k in pages)
    return store


def test_round_trip_restart_and_fingerprint_isolation(tmp_path):
    pages = {key(i): page(i) for i in range(4)}
    store = written(DiskStore(tmp_path, 1 << 20, FP), pages)
    for k, p in pages.items():
        assert torch.equal(torch.frombuffer(store.read(k), dtype=torch.uint8), p)
    out = torch.empty(PAGE, dtype=torch.uint8)
    assert store.read(key(0), out=out) and torch.equal(out, pages[key(0)])
    assert store.read(key(99)) is None and not store.read(key(99), out=out)
    done = []
    store.write_async(key(0), page(7), on_done=done.append).result(timeout=5)  # stored: not rewritten
    assert done == [True] and store.poll() == [(key(0), True)]
    s = store.stats
    assert (s.files, s.hits, s.misses, s.writes, s.writes_skipped) == (4, 5, 2, 4, 1)
    assert s.bytes == s.bytes_written == 4 * (HEADER_SIZE + 16 + PAGE)
    store.close()

    again = DiskStore(tmp_path, 1 << 20, FP)  # a restart finds every file
    assert again.stats.files == 4 and all(again.contains(k) for k in pages)
    for k, p in pages.items():
        assert torch.equal(torch.frombuffer(again.read(k), dtype=torch.uint8), p)
    other = DiskStore(tmp_path, 1 << 20, layout_fingerprint(["tiny-llama", torch.bfloat16, 16]))
    assert other.stats.files == 0 and other.read(key(0)) is None
    again.close(), other.close()


def _flip(offset):
    def damage(path, _):
        with open(path, "r+b") as f:
            f.seek(offset if offset >= 0 else os.path.getsize(path) + offset)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x01]))
    return damage


def _truncate(size):
    def damage(path, _):
        os.truncate(path, size if size >= 0 else os.path.getsize(path) + size)
    return damage


def _append(path, _):
    with open(path, "ab") as f:
        f.write(b"x")


def _copy_from_other_key(path, store):
    shutil.copy(store._path(key(1)), path)


def _copy_from_other_fingerprint(path, store):
    other = DiskStore(os.path.dirname(store.root), 1 << 20, FP + "-other")
    written(other, {key(0): page(0)}).close()
    shutil.copy(other._path(key(0)), path)


@pytest.mark.parametrize("damage,reason", [
    (_truncate(-10), "truncated"), (_truncate(0), "truncated"), (_truncate(HEADER_SIZE + 4), "truncated"),
    (_flip(-1), "checksum"), (_flip(HEADER_SIZE + 16), "checksum"),
    (_flip(0), "header"), (_flip(20), "header"), (_flip(HEADER_SIZE), "header"),
    (_append, "length"), (_copy_from_other_key, "foreign"), (_copy_from_other_fingerprint, "foreign"),
], ids=["truncated", "zero-length", "short-key", "last-byte", "first-payload-byte", "magic",
        "payload-length", "key-byte", "trailing-byte", "other-key", "other-fingerprint"])
def test_damaged_file_is_a_counted_miss_and_deleted(tmp_path, damage, reason):
    store = written(DiskStore(tmp_path, 1 << 20, FP), {key(0): page(0), key(1): page(1)})
    path = store._path(key(0))
    damage(path, store)
    out = torch.empty(PAGE, dtype=torch.uint8)
    assert store.read(key(0), out=out) is False
    assert store.stats.rejected == {reason: 1} and not os.path.exists(path) and not store.contains(key(0))
    assert store.read(key(0)) is None and store.stats.misses == 2
    assert torch.equal(torch.frombuffer(store.read(key(1)), dtype=torch.uint8), page(1))  # others served
    store.close()


def test_restart_drops_short_files_and_stale_temp_files(tmp_path):
    store = written(DiskStore(tmp_path, 1 << 20, FP), {key(0): page(0), key(1): page(1)})
    store.close()
    os.truncate(store._path(key(1)), 0)
    shard = os.path.dirname(store._path(key(0)))
    stale, fresh = os.path.join(shard, ".a.1.1.tmp"), os.path.join(shard, ".b.1.2.tmp")
    for p in (stale, fresh):
        open(p, "wb").write(b"partial")
    os.utime(stale, (time.time() - 3600,) * 2)
    again = DiskStore(tmp_path, 1 << 20, FP)
    assert again.stats.rejected == {"stale_temp": 1, "truncated": 1}
    assert not os.path.exists(stale) and os.path.exists(fresh)  # a fresh one may be another writer's
    assert again.contains(key(0)) and not again.contains(key(1)) and again.stats.files == 1
    again.close()


def _assert_disabled(store: DiskStore):
    assert not store.available and "--disk-cache-dir" in store.disabled_reason
    assert not store.contains(key(0)) and store.read(key(0)) is None
    assert store.read(key(0), out=torch.empty(PAGE, dtype=torch.uint8)) is False
    done = []
    assert store.write_async(key(0), page(0), on_done=done.append).result(timeout=1) is False
    assert done == [False] and store.poll() == [(key(0), False)] and store.drain(timeout=1)
    store.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory_disables_the_store(tmp_path):
    os.chmod(tmp_path, 0o500)
    try:
        _assert_disabled(DiskStore(tmp_path / "cache", 1 << 20, FP))
        assert os.listdir(tmp_path) == []
    finally:
        os.chmod(tmp_path, 0o700)


def test_directory_under_a_regular_file_disables_the_store(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    _assert_disabled(DiskStore(tmp_path / "file" / "cache", 1 << 20, FP))


def test_disk_full_fails_the_write_cleanly_then_disables_writes(tmp_path, monkeypatch):
    store = written(DiskStore(tmp_path, 1 << 20, FP), {key(0): page(0)})
    real_write_all = disk_store._write_all

    def full(f, data):  # half the bytes land, then the disk is full
        real_write_all(f, memoryview(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store, "_write_all", full)
    assert store.write_async(key(1), page(1)).result(timeout=5) is False
    assert store.poll() == [(key(1), False)] and store.stats.write_failures == 1
    assert store_files(tmp_path) == [store._path(key(0))]  # the temp file is gone
    assert not store.contains(key(1)) and store.read(key(1)) is None
    for i in range(2, 2 + disk_store.MAX_CONSECUTIVE_WRITE_FAILURES):
        store.write_async(key(i), page(i))
    assert store.drain(timeout=10) and not store.writes_enabled
    assert "--disk-cache-dir" in store.write_disabled_reason
    monkeypatch.setattr(disk_store, "_write_all", real_write_all)
    assert store.write_async(key(50), page(50)).result(timeout=5) is False  # writes stay off
    assert torch.equal(torch.frombuffer(store.read(key(0)), dtype=torch.uint8), page(0))  # reads go on
    assert store_files(tmp_path) == [store._path(key(0))]
    store.close()


def test_capacity_evicts_least_recently_used(tmp_path):
    file_size = HEADER_SIZE + 16 + PAGE
    store = DiskStore(tmp_path, 3 * file_size, FP)
    for i in range(3):
        written(store, {key(i): page(i)})
    assert store.read(key(0)) is not None  # key(0) is now the most recent
    written(store, {key(3): page(3)})
    assert store.poll_evicted() == [key(1)] and not os.path.exists(store._path(key(1)))
    assert [store.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert store.stats.evictions == 1 and store.stats.bytes == 3 * file_size
    assert store.write_async(key(9), page(9, 4 * PAGE)).result(timeout=5) is False  # over the cap
    assert store.stats.files == 3 and store.stats.write_failures == 0
    store.close()
    for age, i in enumerate([3, 0, 2]):  # recency survives a restart through mtimes
        os.utime(store._path(key(i)), (time.time() - 100 * age,) * 2)
    smaller = DiskStore(tmp_path, 2 * file_size, FP)
    assert [smaller.contains(key(i)) for i in (0, 2, 3)] == [True, False, True]
    smaller.close()


def test_concurrent_writes_and_duplicates_in_flight(tmp_path):
    store = DiskStore(tmp_path, 1 << 22, FP, writer_threads=4)
    store.write_gate = threading.Event()
    pages = {key(i): page(i) for i in range(48)}
    for k, p in pages.items():
        store.write_async(k, p)
    dup = store.write_async(key(0), pages[key(0)])  # same key while the first is in flight
    assert not dup.done() and store.poll() == []
    store.write_gate.set()
    assert store.drain(timeout=10) and dup.result() is True
    done = store.poll()
    assert len(done) == 49 and all(ok for _, ok in done) and {k for k, _ in done} == set(pages)
    assert store.stats.writes == 48 and store.stats.writes_skipped == 1
    for k, p in pages.items():
        assert torch.equal(torch.frombuffer(store.read(k), dtype=torch.uint8), p)
    store.close()


def test_write_delay_holds_a_write_in_flight(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, FP)
    store.write_delay_s = 0.2
    start = time.monotonic()
    fut = store.write_async(key(0), page(0))
    assert store.poll() == [] and not fut.done()
    assert not store.contains(key(0)) and store.read(key(0)) is None  # nothing visible yet
    assert not store.drain(timeout=0.05)
    assert store.drain(timeout=5) and time.monotonic() - start >= 0.2
    assert store.poll() == [(key(0), True)] and store.contains(key(0))
    store.close()


def test_chain_hash_and_layout_fingerprint():
    root = chain_hash(b"", [1, 2, 3])
    assert len(root) == 16 and root == chain_hash(b"", (1, 2, 3)) == chain_hash(b"", torch.tensor([1, 2, 3]))
    variants = {root, chain_hash(b"", [1, 2, 4]), chain_hash(b"", [1, 2]), chain_hash(root, [1, 2, 3]),
                chain_hash(chain_hash(b"", [9]), [1, 2, 3]), chain_hash(b"", [1, 2, 3], extra=b"lora1")}
    assert len(variants) == 6
    assert FP == layout_fingerprint(["tiny-llama", torch.float32, 16, [("kv", 0, (2, 4, 16, 8))]])
    assert FP != layout_fingerprint(["tiny-llama", torch.float32, 32, [("kv", 0, (2, 4, 16, 8))]])
    assert list({0, 8}) != list({8, 0})  # iteration order follows insertion here...
    assert layout_fingerprint([{0, 8}, {"a": 1, "b": 2}]) == layout_fingerprint([{8, 0}, {"b": 2, "a": 1}])
    with pytest.raises(TypeError, match="stable repr"):
        layout_fingerprint([object()])


def test_close_completes_queued_writes_as_not_written(tmp_path):
    store = DiskStore(tmp_path, 1 << 20, FP)
    store.write_gate = threading.Event()
    futures = [store.write_async(key(i), page(i)) for i in range(3)]
    store.close(cancel_pending=True)  # every write still completes: its caller releases its page
    assert [f.result(timeout=1) for f in futures] == [False] * 3
    assert sorted(store.poll()) == sorted((key(i), False) for i in range(3))
    assert store.write_async(key(5), page(5)).result(timeout=1) is False and store.read(key(0)) is None
    assert store_files(tmp_path) == []


def test_unreadable_file_is_a_counted_miss_and_deleted(tmp_path, monkeypatch):
    store = written(DiskStore(tmp_path, 1 << 20, FP), {key(0): page(0)})

    def failing(f, n):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(page_io, "read_exact", failing)  # (the page file reader)
    assert store.read(key(0)) is None and store.stats.rejected == {"unreadable": 1}
    assert store_files(tmp_path) == [] and not store.contains(key(0))
    store.close()
