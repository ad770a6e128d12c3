"""I7 on the wire: a write's completion notification means every byte of that write landed, for
each backend (NIXL over shared memory, NCCL over gloo, on this CPU). The PD prefill side relies on
it: the last write of a transfer carries the last chunk's pages, the metadata row and the
notification together, and is posted only once every earlier write of the transfer is done."""
import os
import time

os.environ["TANDEM_SANITIZE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.transfer.backends import create_backend  # noqa: E402
from tandem.transfer.connector import WriteStatus  # noqa: E402
from tandem.transfer.descriptors import tensor_region  # noqa: E402
from tests.support.pd import GREEDY, PDPair  # noqa: E402

PAGE = 256  # bytes (64 pages, so staged segments cycle through the NCCL backend's slots)
ROW = 96


TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def on_gpus(backend: str):
    return pytest.param(backend, ("cuda:0", "cuda:1"), marks=[pytest.mark.gpu, pytest.mark.skipif(
        not TWO_GPUS, reason="needs two CUDA devices")], id=f"{backend}-gpu")


@pytest.mark.parametrize("backend,devices", [
    pytest.param("nixl", ("cpu", "cpu"), id="nixl-cpu"), pytest.param("nccl", ("cpu", "cpu"), id="nccl-cpu"),
    on_gpus("nixl"), on_gpus("nccl"), on_gpus("nccl-sendrecv")])
def test_the_notification_comes_after_every_page_and_the_row(backend, devices):
    """Scattered pages (and one long run) and a row in one write: the moment the reader sees the
    notification, the pages and the row are all in place (checked then, before the writer is
    asked again). NCCL's segmenting is set small, so staged segments cycle through the staging
    slots many times (the pipelined gather/scatter) and the long run goes in place. Between GPUs
    "nccl" copies into the reader's memory; "nccl-sendrecv" is forced onto NCCL's sends."""
    if backend == "nixl" and devices[0] != "cpu":  # (a GPU image may lack NIXL's CUDA build; CI's CPU run needs it)
        pytest.importorskip("nixl", reason="NIXL's CUDA build is not installed")
    name = backend.split("-")[0]
    options = dict(connect_timeout=5.0, timeout=5.0) if name == "nccl" else {}
    writer, reader = create_backend(name, "writer", **options), create_backend(name, "reader", **options)
    if name == "nccl":
        writer.direct_bytes, writer.staging_bytes = 4 * PAGE, 2 * PAGE
        writer.peer_copies = backend == "nccl"
    try:
        generator = torch.Generator().manual_seed(1)
        pages = torch.randint(0, 256, (64 * PAGE,), dtype=torch.uint8, generator=generator).to(devices[0])
        row = torch.randint(0, 256, (ROW,), dtype=torch.uint8, generator=generator).to(devices[0])
        target_pages = torch.zeros(pages.shape, dtype=torch.uint8, device=devices[1])
        target_row = torch.zeros(row.shape, dtype=torch.uint8, device=devices[1])
        writer.register([tensor_region(pages), tensor_region(row)])
        reader.register([tensor_region(target_pages), tensor_region(target_row)])
        peer = writer.add_peer(reader.local_metadata())
        pairs = [(3, 30), (4, 31), (9, 0), (17, 5), *((20 + 2 * i, 33 + 3 * i) for i in range(9)), (50, 6)]
        descriptors = [(pages.data_ptr() + s * PAGE, target_pages.data_ptr() + d * PAGE, PAGE) for s, d in pairs]
        descriptors.append((pages.data_ptr() + 56 * PAGE, target_pages.data_ptr() + 7 * PAGE, 6 * PAGE))  # in place
        descriptors.append((row.data_ptr(), target_row.data_ptr(), ROW))
        expected = torch.zeros_like(target_pages)
        for source, destination, count in [(s, d, 1) for s, d in pairs] + [(56, 7, 6)]:
            expected[destination * PAGE:(destination + count) * PAGE] = pages[source * PAGE:(source + count) * PAGE]
        devices_of = {"local_device": pages.device.index if pages.is_cuda else -1,
                      "remote_device": target_pages.device.index if target_pages.is_cuda else -1}
        for attempt in range(2):  # the first write on a new pair sets up its connections
            target_pages.zero_()
            target_row.zero_()
            for device in {torch.device(name) for name in devices if name.startswith("cuda")}:
                torch.cuda.synchronize(device)  # sources final when posted (no backend waits on this stream)
            handle = writer.write(peer, descriptors, notification=f"done:{attempt}".encode(), **devices_of)
            deadline, seen = time.monotonic() + 20, []
            while not seen:
                assert time.monotonic() < deadline, "no notification"
                writer.poll(handle)  # NIXL sends the notification from the poll that finds the bytes landed
                seen = reader.notifications()
                if seen:  # I7: everything landed by now
                    assert seen == [("writer", f"done:{attempt}".encode())]
                    assert torch.equal(target_pages, expected) and torch.equal(target_row, row.to(devices[1]))
                time.sleep(0.0005)
            while writer.poll(handle) is WriteStatus.PENDING:
                assert time.monotonic() < deadline
            assert handle.status is WriteStatus.DONE, handle.error
            assert writer.release(handle)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_the_last_write_carries_the_last_pages_the_row_and_the_notification(backend, model_dirs, oracles,
                                                                             monkeypatch):
    """A prompt over two prefill chunks: the first chunk's pages go alone; the second chunk's
    pages, the metadata row and the notification go as one write, posted after the first one
    is done; the decode engine continues exactly. The last pages were planned when their chunk
    was launched: once the first token is known nothing is planned, and the last write is
    exactly the held plan and the row."""
    from tandem.transfer.descriptors import WritePlanner
    from tests.pd.test_pd_engine import LONG_PROMPT, SMALL

    pair = PDPair(model_dirs["llama"], transfer=dict(backend=backend), **SMALL)
    side = pair.prefill.pd
    post, writes = side.agent.backend.write, []
    plans, plan = [], WritePlanner.plan
    monkeypatch.setattr(WritePlanner, "plan", lambda planner, pairs: plans.append(pairs) or plan(planner, pairs))
    post_last, last_path = side.post_last, {}

    def post_last_spy(transfer):
        held = side.agent.writes.get(transfer.writes[0].key) if transfer.writes else None
        held, planned = (list(held.descriptors) if held else []), len(plans)
        post_last(transfer)
        if transfer.metadata_write is not None and not last_path:
            last_path.update(held=held, plans=len(plans) - planned)

    side.post_last = post_last_spy

    def spy(peer, descriptors, **options):
        if descriptors and descriptors[0][0] == side.scratch.data_ptr():
            return post(peer, descriptors, **options)  # the handshake's warm-up write
        earlier = [handle.status for _, _, handle, _ in writes]
        handle = post(peer, descriptors, **options)
        writes.append((list(descriptors), options.get("notification", b""), handle, earlier))
        return handle

    side.agent.backend.write = spy
    # one rank: its worker's agent carries the PD side's operations, one outcome per write
    assert side.agent is pair.prefill.worker.transfers and side.ranks.num_ranks == 1
    record, outcomes = side.ranks.record, []
    side.ranks.record = lambda rank, resolved: (outcomes.extend((rank, o.key) for o in resolved),
                                                record(rank, resolved))
    try:
        # the destination first (the prefill engine would otherwise compute both chunks before
        # it comes, and write them at once): the first chunk's pages then stream on their own
        pair.submit_destination_first("long", LONG_PROMPT)
        waits = []  # the prefill engine's pause between steps while the last write is in flight

        def finished() -> bool:
            if any(transfer.metadata_write is not None for transfer in side.transfers.values()):
                waits.append(side.idle_wait_milliseconds())
            return pair.finished("long")

        pair.run_until(finished)
        assert waits and (waits[0] == 0) == (backend == "nixl")  # NIXL notifies from the writer's poll: no pause
        pair.assert_matches("long", oracles["llama"].greedy(LONG_PROMPT, GREEDY.max_tokens))
        assert [bool(notification) for _, notification, _, _ in writes] == [False] * (len(writes) - 1) + [True]
        assert len(writes) >= 2
        last, _, _, earlier = writes[-1]
        rows = side.metadata
        in_rows = [d for d in last if rows.address(0) <= d[0] < rows.address(0) + rows.num_rows * rows.row_bytes]
        assert len(in_rows) == 1 and in_rows[0][2] == rows.row_bytes
        assert rows.tensor.device == next(side.registry.buffers()).tensor.device  # beside the pages
        assert len(last) > 1  # the second chunk's pages travel with the row
        assert last_path == {"held": last[:-1], "plans": 0} and last[-1] == in_rows[0]  # planned before
        assert all(status is WriteStatus.DONE for status in earlier)  # posted once every earlier write was done
        if backend == "nixl":  # every page write and the last one came from the lists prepared at the handshake
            assert side.agent.backend.prepared_writes == len(writes)
        pair.settle()
        pair.assert_all_free()
        writes_resolved = [key for _, key in outcomes if not key.startswith("warm-up:") and key not in side.peers]
        assert {rank for rank, _ in outcomes} == {0} and len(writes_resolved) == len(set(writes_resolved)) == len(writes)
        assert not side.ranks.outcomes and not side.ranks.expected and not side.agent.writes
    finally:
        side.ranks.record = record
        side.agent.backend.write = post
        pair.close()


def test_nixl_error_handling_is_none_on_one_host_and_peer_between_hosts(monkeypatch):
    """UCX's error handling decides NIXL's transports: "none" where the engines talk over
    loopback (a notified write completes as soon as its bytes landed), NIXL's default ("peer",
    given as "") for an address other hosts reach; the environment overrides both."""
    from tandem.transfer.nixl_backend import ucx_error_handling

    monkeypatch.delenv("TANDEM_NIXL_UCX_ERROR_HANDLING", raising=False)
    assert [ucx_error_handling(host) for host in ("127.0.0.1", "127.0.1.1", "localhost", "::1")] == ["none"] * 4
    assert ucx_error_handling("10.1.2.3") == ""
    monkeypatch.setenv("TANDEM_NIXL_UCX_ERROR_HANDLING", "peer")
    assert ucx_error_handling("127.0.0.1") == "peer"
