"""The NCCL transfer backend's logic over gloo on 127.0.0.1 (the same code moves GPU memory
through NCCL): writes land byte for byte (merged runs, staged and direct segments, pages out of
order), notifications arrive after the bytes, failures end as ERROR and never hang, and a 1P1D
pair of engine cores decodes exactly as ``transformers`` with ``backend="nccl"`` (and, after
the handshake's warm-up write, with ``nixl``). The two-GPU
path (NCCL and NIXL, pipelined staging) is checked by
``test_transfer_ordering.py::test_the_notification_comes_after_every_page_and_the_row[gpu-...]``
(marked gpu)."""
import os
import threading
import time

os.environ["TANDEM_SANITIZE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.transfer.byte_views import Segment, plan_segments, widest_element  # noqa: E402
from tandem.transfer.backends import create_backend  # noqa: E402
from tandem.transfer.connector import WriteStatus  # noqa: E402
from tandem.transfer.descriptors import merge_adjacent, tensor_region  # noqa: E402
from tests.support.pd import GREEDY, PDPair  # noqa: E402

PAGE = 64  # bytes


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def finish(backend, handle, timeout: float = 20.0) -> WriteStatus:
    wait_until(lambda: backend.poll(handle) is not WriteStatus.PENDING, timeout)
    assert backend.release(handle)
    return handle.status


class Pair:
    """A writer and a reader backend in this process, each with one registered buffer (and, where
    given, ``extra`` regions: (writer's, reader's), registered before the pair forms)."""

    def __init__(self, device: str = "cpu", reader_device: str = "cpu", num_bytes: int = 64 * PAGE,
                 extra: tuple = ((), ()), **options):
        self.writer = create_backend("nccl", "writer", connect_timeout=5.0, timeout=5.0)
        self.writer.peer_copies = True  # (opt-in; read when the pair forms)
        self.reader = create_backend("nccl", "reader", connect_timeout=5.0, timeout=5.0)
        for backend in (self.writer, self.reader):
            for name, value in options.items():
                setattr(backend, name, value)
        generator = torch.Generator().manual_seed(0)
        self.source = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator).to(device)
        self.target = torch.zeros(num_bytes, dtype=torch.uint8, device=reader_device)
        self.writer.register([tensor_region(self.source), *extra[0]])
        self.reader.register([tensor_region(self.target), *extra[1]])
        self.peer = self.writer.add_peer(self.reader.local_metadata())

    def pages(self, pairs: list[tuple[int, int]], pages: int = 1) -> list[tuple[int, int, int]]:
        """(source page, destination page) -> descriptors of ``pages`` pages each."""
        return [(self.source.data_ptr() + s * PAGE, self.target.data_ptr() + d * PAGE, pages * PAGE)
                for s, d in pairs]

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


@pytest.fixture
def pair():
    pair = Pair(direct_bytes=4 * PAGE, staging_bytes=3 * PAGE)  # small: every kind of segment occurs
    yield pair
    pair.close()


def test_descriptors_merge_and_split_into_segments():
    assert merge_adjacent([(200, 20, 10), (100, 10, 5), (105, 15, 5), (110, 30, 5), (0, 0, 0)]) == \
        [(100, 10, 10), (110, 30, 5), (200, 20, 10)]
    assert plan_segments([1, 5, 1], direct_bytes=4, staging_bytes=3) == [  # few runs: each in place
        Segment(0, 1, 1, True), Segment(1, 2, 5, True), Segment(2, 3, 1, True)]
    assert plan_segments([1, 1, 5, 1, 1, 1, 1], direct_bytes=4, staging_bytes=3) == [
        Segment(0, 2, 2, False), Segment(2, 3, 5, True), Segment(3, 6, 3, False), Segment(6, 7, 1, False)]
    assert widest_element([8, 16], [24]) is torch.int64 and widest_element([8, 4], [4]) is torch.int32
    assert widest_element([3], [8]) is torch.uint8


def test_only_registered_memory_can_be_a_destination():
    from tandem.transfer.byte_views import RegionViews

    first, second = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    views = RegionViews()
    views.add(tensor_region(second))
    views.add(tensor_region(first))
    views.check([first.data_ptr(), first.data_ptr() + 60, second.data_ptr()], [64, 4, 32])
    for address, length in [(first.data_ptr() + 1, 64), (second.data_ptr() - 1, 2), (second.data_ptr() + 32, 1)]:
        if first.data_ptr() <= address and address + length <= first.data_ptr() + 64:
            continue  # (the two allocations may lie back to back)
        with pytest.raises(ValueError, match="outside the registered memory"):
            views.check([first.data_ptr(), address], [8, length])
        with pytest.raises(ValueError, match="outside the registered memory"):
            views.view(address, length)


def test_pages_land_byte_for_byte_and_the_notification_follows(pair):
    # out of order, some adjacent (merged), a long run (sent in place), scattered single pages (staged)
    pairs = [(9, 2), (3, 40), (4, 41), (5, 42), (20, 7), (21, 30), (0, 63)]
    descriptors = pair.pages(pairs) + pair.pages([(50, 10)], pages=6)
    handle = pair.writer.write(pair.peer, descriptors, notification=b"done:1")
    assert finish(pair.writer, handle) is WriteStatus.DONE, handle.error
    notes = []
    wait_until(lambda: notes.extend(pair.reader.notifications()) or notes)
    assert notes == [("writer", b"done:1")]
    expected = torch.zeros_like(pair.target)
    for source, destination in pairs + [(50 + i, 10 + i) for i in range(6)]:
        expected[destination * PAGE:(destination + 1) * PAGE] = pair.source[source * PAGE:(source + 1) * PAGE]
    assert torch.equal(pair.target, expected)
    # a second write on the warm pair, then a notification-only write
    second = pair.writer.write(pair.peer, pair.pages([(33, 33)]))
    third = pair.writer.write(pair.peer, [], notification=b"done:2")
    assert finish(pair.writer, second) is WriteStatus.DONE and finish(pair.writer, third) is WriteStatus.DONE
    wait_until(lambda: notes.extend(pair.reader.notifications()) or len(notes) == 2)
    assert notes[1] == ("writer", b"done:2")
    assert torch.equal(pair.target[33 * PAGE:34 * PAGE], pair.source[33 * PAGE:34 * PAGE])


TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
def test_a_page_major_write_goes_as_one_group_between_gpus():
    """Between two GPUs: a write of a long run and a row (the last write of a page-major
    transfer: two sends in one NCCL group), then one with staged segments in the same batch
    (gathered before the group, scattered after), land byte for byte before the notification."""
    pair = Pair("cuda:0", "cuda:1", num_bytes=64 * PAGE, direct_bytes=4 * PAGE, staging_bytes=3 * PAGE,
                peer_copies=False)  # (between GPUs the pair would otherwise copy: forced to NCCL)
    try:
        torch.cuda.synchronize("cuda:0")  # sources final when posted
        writes = [pair.pages([(8, 16)], pages=40) + pair.pages([(60, 62)]),  # 2 runs: each in place
                  pair.pages([(0, 0), (2, 3), (5, 7), (9, 11), (13, 60)]) + pair.pages([(20, 30)], pages=8)]
        for number, descriptors in enumerate(writes):
            pair.target.zero_()
            torch.cuda.synchronize("cuda:1")
            handle = pair.writer.write(pair.peer, descriptors, notification=f"done:{number}".encode(),
                                       local_device=0, remote_device=1)
            notes = []
            wait_until(lambda: notes.extend(pair.reader.notifications()) or notes)
            expected = torch.zeros_like(pair.target)
            for source, destination, length in descriptors:
                begin, end = destination - pair.target.data_ptr(), destination - pair.target.data_ptr() + length
                expected[begin:end] = pair.source[source - pair.source.data_ptr():][:length].to("cuda:1")
            assert notes == [("writer", f"done:{number}".encode())] and torch.equal(pair.target, expected)
            assert finish(pair.writer, handle) is WriteStatus.DONE, handle.error
        assert pair.writer.writers[pair.peer].copies is None and pair.writer.writers[pair.peer].group is not None
    finally:
        pair.close()


def expected_target(pair: Pair, descriptors) -> torch.Tensor:
    """What ``pair.target`` holds after ``descriptors`` were written into a zeroed target."""
    expected = torch.zeros_like(pair.target)
    for source, destination, length in descriptors:
        begin = destination - pair.target.data_ptr()
        expected[begin:begin + length] = pair.source[source - pair.source.data_ptr():][:length].to(expected.device)
    return expected


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
def test_peer_copies_land_before_their_notifications_with_many_writes_in_flight():
    """Between two GPUs a pair copies into the reader's memory (here the reader's own process: its
    addresses are used as they are). Eight writes posted at once, each of its own pages and each
    notified: when the reader sees a write's notification its pages are in place; every write is
    DONE; a notification-only write follows the others; a write outside the reader's memory fails
    before anything is copied, and ends the pair."""
    pair = Pair("cuda:0", "cuda:1", num_bytes=64 * PAGE)
    try:
        torch.cuda.synchronize("cuda:0")
        writes = [pair.pages([(8 * k, 8 * k + 1), (8 * k + 1, 8 * k + 2)])
                  + pair.pages([(8 * k + 4, 8 * k + 5)], pages=2) for k in range(8)]
        handles = [pair.writer.write(pair.peer, descriptors, notification=f"w{k}".encode(), local_device=0,
                                     remote_device=1) for k, descriptors in enumerate(writes)]
        seen, checked = [], set()
        wait_until(lambda: pair.writer.writers[pair.peer].copies is not None or pair.writer.writers[pair.peer].error)
        assert pair.writer.writers[pair.peer].copies is not None, pair.writer.writers[pair.peer].error

        def check_arrivals() -> bool:
            for handle in handles:  # (a write's notification leaves from a poll that finds it landed)
                pair.writer.poll(handle)
            for _, note in pair.reader.notifications():
                seen.append(note)
                k = int(note[1:])
                for source, destination, length in writes[k]:  # this write's bytes landed by now
                    begin = destination - pair.target.data_ptr()
                    assert torch.equal(pair.target[begin:begin + length].cpu(),
                                       pair.source[source - pair.source.data_ptr():][:length].cpu())
                checked.add(k)
            return len(checked) == len(writes)

        wait_until(check_arrivals)
        assert seen == [f"w{k}".encode() for k in range(8)]  # in the order posted
        assert all(finish(pair.writer, handle) is WriteStatus.DONE for handle in handles)
        assert torch.equal(pair.target, expected_target(pair, [d for descriptors in writes for d in descriptors]))
        last = pair.writer.write(pair.peer, [], notification=b"only")
        assert finish(pair.writer, last) is WriteStatus.DONE
        wait_until(lambda: pair.reader.notifications() == [("writer", b"only")])
        before = pair.target.clone()
        outside = [(pair.source.data_ptr(), pair.target.data_ptr() + pair.target.numel() - PAGE, 2 * PAGE)]
        bad = pair.writer.write(pair.peer, pair.pages([(0, 0)]) + outside, notification=b"bad")
        assert finish(pair.writer, bad) is WriteStatus.ERROR and "outside" in bad.error
        later = pair.writer.write(pair.peer, pair.pages([(1, 1)]))
        assert finish(pair.writer, later) is WriteStatus.ERROR
        torch.cuda.synchronize("cuda:1")
        assert torch.equal(pair.target, before) and pair.reader.notifications() == []
    finally:
        pair.close()


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
def test_a_row_staged_on_its_own_stream_lands_with_the_pages_before_the_notification():
    """The last write's row is staged without a host wait (``MetadataBuffer.stage``: its copy to
    the device queued behind a long kernel on the rows' stream here) and passed as ``ready``: the
    peer copies wait for it on the device, so the row that lands is the staged one, with the
    pages, before the notification."""
    from tandem.transfer.metadata import MetadataBuffer, MetadataRow
    from tandem.transfer.messages import new_room

    rows, target_rows = MetadataBuffer(2, device="cuda:0"), MetadataBuffer(2, device="cuda:1")
    pair = Pair("cuda:0", "cuda:1", num_bytes=64 * PAGE,
                extra=([tensor_region(rows.tensor)], [tensor_region(target_rows.tensor)]))
    try:
        torch.cuda.synchronize("cuda:0")
        for attempt in range(2):  # (the first write waits for the pair to form)
            room = new_room()
            with torch.cuda.stream(rows._stream):
                torch.cuda._sleep(50_000_000)  # the row's copy queues behind this (tens of ms)
            staged = rows.stage(1, MetadataRow(room=room, first_token=7 + attempt, logprob_token_ids=(7,),
                                               logprobs=(-0.25,), rank=1))
            assert staged is not None and not staged.query()
            descriptors = pair.pages([(2, 9)], pages=8) + [(rows.address(1), target_rows.address(0), rows.row_bytes)]
            handle = pair.writer.write(pair.peer, descriptors, notification=room.encode(), ready=staged,
                                       local_device=0, remote_device=1)
            notes = []
            wait_until(lambda: pair.writer.poll(handle) is not WriteStatus.PENDING
                       and bool(notes.extend(pair.reader.notifications()) or notes))
            assert handle.status is WriteStatus.DONE, handle.error
            assert notes == [("writer", room.encode())]
            landed = target_rows.read(0)
            assert (landed.room, landed.first_token, landed.logprobs) == (room, 7 + attempt, (-0.25,))
            assert torch.equal(pair.target[9 * PAGE:17 * PAGE].cpu(), pair.source[2 * PAGE:10 * PAGE].cpu())
            assert finish(pair.writer, handle) is WriteStatus.DONE
    finally:
        pair.close()


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
def test_peer_copies_to_a_closed_reader_fail_at_once():
    pair = Pair("cuda:0", "cuda:1", num_bytes=64 * PAGE)
    try:
        torch.cuda.synchronize("cuda:0")
        assert finish(pair.writer, pair.writer.write(pair.peer, pair.pages([(1, 1)]))) is WriteStatus.DONE
        assert pair.writer.writers[pair.peer].copies is not None
        pair.reader.close()
        time.sleep(0.05)  # (the reader's end of the connection is closed by now)
        started = time.monotonic()
        handle = pair.writer.write(pair.peer, pair.pages([(2, 2)]), notification=b"x")
        assert finish(pair.writer, handle) is WriteStatus.ERROR and handle.error
        assert time.monotonic() - started < 2.0
    finally:
        pair.close()


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
def test_a_reader_that_cannot_share_its_memory_is_written_through_nccl(monkeypatch, caplog):
    """Where the reader's memory cannot be opened, the pair says why once and sends through NCCL."""
    from tandem.transfer import nccl_links
    from tandem.transfer.peer_memory import PROCESS_ID, PeerOffer

    monkeypatch.setattr(nccl_links, "offer_regions", lambda *_: PeerOffer(PROCESS_ID, "", [], "cannot share here"))
    with caplog.at_level("WARNING", logger="tandem.transfer.nccl_backend"):
        pair = Pair("cuda:0", "cuda:1", num_bytes=64 * PAGE)
        try:
            torch.cuda.synchronize("cuda:0")
            descriptors = pair.pages([(3, 5)], pages=4)
            handle = pair.writer.write(pair.peer, descriptors, notification=b"n", local_device=0, remote_device=1)
            assert finish(pair.writer, handle) is WriteStatus.DONE, handle.error
            wait_until(lambda: pair.reader.notifications() == [("writer", b"n")])
            assert torch.equal(pair.target, expected_target(pair, descriptors))
            link = pair.writer.writers[pair.peer]
            assert link.copies is None and link.group is not None
        finally:
            pair.close()
    assert [r.getMessage() for r in caplog.records if "cannot share here" in r.getMessage()]


TARGET_OFFSET = 4096 + 64  # the reader's target is a view this far into a larger tensor


def read_in_another_process(device: str, num_bytes: int, to_writer, from_writer) -> None:
    """The reader of ``test_peer_copies_open_the_readers_memory_over_cuda_ipc``, in its own process:
    registers a view into a larger tensor (its storage, inside a caching-allocator segment, is
    shared over CUDA IPC), then checks each notified write's bytes against the seeded source."""
    try:
        reader = create_backend("nccl", "reader", connect_timeout=10.0, timeout=10.0)
        whole = torch.zeros(num_bytes + 2 * TARGET_OFFSET, dtype=torch.uint8, device=device)
        target = whole[TARGET_OFFSET:TARGET_OFFSET + num_bytes]
        reader.register([tensor_region(target)])
        to_writer.put((reader.local_metadata(), target.data_ptr()))
        source = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        while True:
            command = from_writer.get(timeout=60)
            if command == "stop":
                break
            descriptors = command
            deadline = time.monotonic() + 20
            notes = []
            while not notes and time.monotonic() < deadline:
                notes = reader.notifications()
                time.sleep(0.001)
            expected = torch.zeros(num_bytes, dtype=torch.uint8)
            for source_offset, destination_offset, length in descriptors:
                expected[destination_offset:destination_offset + length] = source[source_offset:source_offset + length]
            untouched = bool((whole[:TARGET_OFFSET] == 0).all() and (whole[TARGET_OFFSET + num_bytes:] == 0).all())
            equal = torch.equal(target.cpu(), expected)
            whole.zero_()
            torch.cuda.synchronize(device)  # (zeroed before the writer hears back and writes again)
            to_writer.put((notes, equal, untouched))
        reader.close()
    except Exception as error:  # noqa: BLE001
        to_writer.put(("error", repr(error)))


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
def test_peer_copies_open_the_readers_memory_over_cuda_ipc():
    """A reader in another process (its target a view into a larger tensor): the writer opens its
    memory over CUDA IPC, and writes land byte for byte, exactly where the descriptors say, before
    the notification; once the reader's process is gone, a write fails at once."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    to_writer, from_writer = context.Queue(), context.Queue()
    num_bytes = 64 * PAGE
    child = context.Process(target=read_in_another_process, args=("cuda:1", num_bytes, to_writer, from_writer),
                            daemon=True)
    child.start()
    writer = create_backend("nccl", "writer", connect_timeout=10.0, timeout=10.0)
    writer.peer_copies = True
    try:
        message = to_writer.get(timeout=120)
        assert message[0] != "error", message
        metadata, target_address = message
        source = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(0)).to("cuda:0")
        writer.register([tensor_region(source)])
        peer = writer.add_peer(metadata)
        torch.cuda.synchronize("cuda:0")
        scattered = [(3 * PAGE, 40 * PAGE, 5 * PAGE), (9 * PAGE, 2 * PAGE, PAGE), (63 * PAGE, 63 * PAGE, PAGE)]
        for offsets in ([(0, 0, num_bytes)], scattered):
            from_writer.put(offsets)
            descriptors = [(source.data_ptr() + s, target_address + d, n) for s, d, n in offsets]
            handle = writer.write(peer, descriptors, notification=b"landed", local_device=0, remote_device=1)
            assert finish(writer, handle) is WriteStatus.DONE, handle.error
            notes, equal, untouched = to_writer.get(timeout=60)
            assert notes == [("writer", b"landed")] and equal and untouched
        link = writer.writers[peer]
        assert link.copies is not None and link.copies.memory.storages  # opened over IPC, not the same process
        from_writer.put("stop")
        child.join(30)
        handle = writer.write(peer, [(source.data_ptr(), target_address, PAGE)], notification=b"late")
        assert finish(writer, handle) is WriteStatus.ERROR
    finally:
        writer.close()
        if child.is_alive():
            child.kill()


def test_an_offer_that_cannot_be_made_says_why_and_a_closed_reader_is_seen_before_copying():
    """The pieces of peer copies that need no GPU: a reader that cannot share its memory sends the
    reason (msgpack, no pickle), which opening raises (the writer then falls back to NCCL); the
    writer's look at the control connection passes while the reader is there, and fails once
    it closed (or sent what it never sends)."""
    import socket

    from tandem.transfer.peer_copies import ensure_open
    from tandem.transfer.peer_memory import PROCESS_ID, PeerOffer, offer_regions, open_peer_memory

    region = tensor_region(torch.zeros(8, dtype=torch.uint8))  # (host memory: never shareable over CUDA IPC)
    offer = PeerOffer.decode(offer_regions([region], 0, "another process").encode())
    assert offer.reason.startswith("the reader could not share its memory") and not offer.regions
    assert offer.process == PROCESS_ID
    with pytest.raises(RuntimeError, match="could not share"):
        open_peer_memory(offer, 0)
    writer_end, reader_end = socket.socketpair()
    try:
        ensure_open(writer_end)  # the reader is there and silent
        reader_end.sendall(b"x")
        with pytest.raises(RuntimeError, match="unexpected data"):
            ensure_open(writer_end)
        writer_end.recv(1)
        reader_end.close()
        with pytest.raises(ConnectionResetError):
            ensure_open(writer_end)
    finally:
        writer_end.close()


def test_injected_failure_is_an_error_and_nothing_moves():
    writer = create_backend("nccl", "w", failure_probability=1.0, seed=0)
    try:
        handle = writer.write("nobody", [(1, 2, 3)])
        assert handle.status is WriteStatus.ERROR and handle.error == "injected transfer failure"
        assert writer.release(handle)
    finally:
        writer.close()


def test_a_write_outside_registered_memory_fails_and_does_not_hang(pair):
    outside = [(pair.source.data_ptr(), pair.target.data_ptr() + pair.target.numel(), PAGE)]
    handle = pair.writer.write(pair.peer, outside, notification=b"x")
    assert finish(pair.writer, handle) is WriteStatus.ERROR
    later = pair.writer.write(pair.peer, pair.pages([(0, 0)]))
    assert later.status is WriteStatus.ERROR  # the pair is torn down
    assert pair.reader.notifications() == []


def test_a_gone_peer_fails_the_write_instead_of_hanging(pair):
    assert finish(pair.writer, pair.writer.write(pair.peer, pair.pages([(1, 1)]))) is WriteStatus.DONE
    pair.reader.close()
    started = time.monotonic()
    handle = pair.writer.write(pair.peer, pair.pages([(2, 2)]))
    assert finish(pair.writer, handle) is WriteStatus.ERROR and handle.error
    assert time.monotonic() - started < 5.0


def test_a_peer_that_never_pairs_fails_the_queued_write():
    reader = create_backend("nccl", "reader", connect_timeout=0.5)
    metadata = reader.local_metadata()
    reader.close()
    reader.rendezvous.store = None  # the reader's store is gone
    writer = create_backend("nccl", "writer", connect_timeout=0.5)
    try:
        peer = writer.add_peer(metadata)
        source = torch.ones(PAGE, dtype=torch.uint8)
        writer.register([tensor_region(source)])
        handle = writer.write(peer, [(source.data_ptr(), 0, PAGE)])
        assert finish(writer, handle, timeout=30) is WriteStatus.ERROR
    finally:
        writer.close()


@pytest.mark.parametrize("backend", ["nccl", "nixl"])
def test_pd_pair_decodes_exactly_after_a_warm_up(backend, model_dirs, oracles):
    """1P1D (``backend="nccl"`` runs over gloo on this CPU): the handshake's warm-up write landed
    in the decode engine's scratch; chunked prefill, the decode engine's tokens and logprobs
    equal ``transformers``; every page and row is free afterwards."""
    from tandem.disagg.agent_support import WARM_UP_BYTE
    from tests.pd.test_pd_engine import LONG_PROMPT, SHORT_PROMPT, SMALL

    pair = PDPair(model_dirs["llama"], transfer=dict(backend=backend), **SMALL)
    try:
        assert not pair.decode.pd.scratch.any()
        prompts = {"long": LONG_PROMPT, "short": SHORT_PROMPT}
        for request_id, prompt in prompts.items():
            pair.submit(request_id, prompt)
        pair.run_until(lambda: all(pair.finished(r) for r in prompts))
        assert bool((pair.decode.pd.scratch == WARM_UP_BYTE).all())
        for request_id, prompt in prompts.items():
            pair.assert_matches(request_id, oracles["llama"].greedy(prompt, GREEDY.max_tokens))
        assert pair.prefill.pd.touched == {d.key for d in pair.prefill.registry.buffers()}  # I1
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


COPY_SECONDS = 0.01  # how long HostPeerCopies' copies take


class HostEvent:
    """A write's event for ``HostPeerCopies``: complete ``COPY_SECONDS`` after posting; waiting
    on it (the link's thread) also waits for ``gate``."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate, self.done_at = gate, time.monotonic() + COPY_SECONDS

    def synchronize(self) -> None:
        self.gate.wait()
        time.sleep(max(self.done_at - time.monotonic(), 0))


class HostPeerCopies:
    """``PeerCopies`` between host memories, so that a CPU runs the writer link's peer-copy logic:
    a write's bytes move only when a look at its event finds it complete (``COPY_SECONDS`` after
    posting), so a notification sent any earlier would reach the reader before its bytes."""

    def __init__(self, reader, gate: threading.Event) -> None:
        self.reader, self.gate, self.released = reader, gate, False

    def start(self, item, sources, connection) -> None:
        from tandem.transfer.peer_copies import ensure_open

        ensure_open(connection)
        item.runs = [(self.reader.views.view(destination, length), sources.view(source, length))
                     for source, destination, length in item.descriptors]
        item.event = HostEvent(self.gate)
        item.timings["posted"] = time.perf_counter()

    def landed(self, item) -> bool:
        if time.monotonic() < item.event.done_at:
            return False
        for target, source in item.runs:
            target.copy_(source)
        return True

    def quiesce(self) -> bool:
        return True

    def release(self) -> None:
        self.released = True


def test_peer_copies_are_posted_in_write_and_completed_by_polls_or_the_links_thread(monkeypatch):
    """The writer link's peer-copy path without a GPU (``HostPeerCopies``): writes posted before
    the pair formed go first, in order, then later writes are posted in ``write`` itself; a
    write completes (its notification leaves) once its copies landed, in a poll of it or, while
    nobody polls, from the link's thread, and the reader never sees a notification before the
    bytes; a reader that closed fails the next write at once and every later one; closing
    releases the mapping."""
    from tandem.transfer.nccl_links import ReaderLink, WriterLink
    from tandem.transfer.pair_group import send_frame
    from tandem.transfer.peer_copies import CHOOSE_COPIES

    made, formed, watched = [], threading.Event(), threading.Event()

    def choose_copies(link):
        formed.wait(10)  # (the pair forms only once the first writes were queued)
        send_frame(link.connection, CHOOSE_COPIES)
        made.append(HostPeerCopies(pair.reader, watched))
        return made[-1]

    monkeypatch.setattr(WriterLink, "choose_data_plane", choose_copies)
    monkeypatch.setattr(ReaderLink, "device", property(lambda link: 0))  # (a reader on a GPU answers the choice)
    pair = Pair()
    try:
        writes = [pair.pages([(2 * k, 40 + 3 * k)], pages=2) for k in range(6)]
        seen = []

        def arrivals(handles, count: int) -> bool:
            for handle in handles:
                pair.writer.poll(handle)
            for _, note in pair.reader.notifications():
                seen.append(note)
                for source, destination, length in writes[int(note[1:])]:  # its bytes landed first
                    begin = destination - pair.target.data_ptr()
                    assert torch.equal(pair.target[begin:begin + length],
                                       pair.source[source - pair.source.data_ptr():][:length])
            return len(seen) == count

        handles = [pair.writer.write(pair.peer, writes[k], notification=f"w{k}".encode()) for k in range(3)]
        link = pair.writer.writers[pair.peer]
        assert link.queue.qsize() == 3 and not link.direct
        formed.set()
        wait_until(lambda: link.direct)
        assert pair.writer.notifies_on_poll
        handles += [pair.writer.write(pair.peer, writes[k], notification=f"w{k}".encode()) for k in (3, 4)]
        assert all(handle.native.started for handle in handles)  # (the later ones: in ``write`` itself)
        wait_until(lambda: arrivals(handles, 5))  # the link's thread is held: these polls completed them
        watched.set()
        unpolled = pair.writer.write(pair.peer, writes[5], notification=b"w5")
        wait_until(lambda: arrivals([], 6))  # nobody polls it: the link's thread completed it
        assert unpolled.native.status is WriteStatus.DONE
        assert seen == [f"w{k}".encode() for k in range(6)]
        assert all(finish(pair.writer, handle) is WriteStatus.DONE for handle in handles + [unpolled])
        pair.reader.close()
        time.sleep(0.05)  # (the reader's end of the connection is closed by now)
        failed = pair.writer.write(pair.peer, writes[0], notification=b"late")
        later = pair.writer.write(pair.peer, writes[1])
        assert failed.status is WriteStatus.ERROR and "closed" in failed.error and later.status is WriteStatus.ERROR
        wait_until(lambda: made[0].released)
    finally:
        pair.close()
