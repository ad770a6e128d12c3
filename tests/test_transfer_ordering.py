"""I7 on the wire: a write's completion notification means every byte of that write landed, for
each backend (NIXL over shared memory, NCCL over gloo, on this CPU). The PD prefill side relies on
it: the last write of a transfer carries the last chunk's pages, the metadata row and the
notification together, and is posted only once every earlier write of the transfer is done."""
import os
import time

os.environ["TANDEM_SANITIZE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.transfer.connector import WriteStatus, create_backend  # noqa: E402
from tandem.transfer.descriptors import tensor_region  # noqa: E402
from tests.pd_helpers import GREEDY, PDPair  # noqa: E402

PAGE = 256  # bytes
ROW = 96


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_the_notification_comes_after_every_page_and_the_row(backend):
    """Scattered pages and a row in one write: the moment the reader sees the notification, the
    pages and the row are all in place (checked then, before the writer is asked again)."""
    options = dict(connect_timeout=5.0, timeout=5.0) if backend == "nccl" else {}
    writer, reader = create_backend(backend, "writer", **options), create_backend(backend, "reader", **options)
    try:
        generator = torch.Generator().manual_seed(1)
        pages = torch.randint(0, 256, (32 * PAGE,), dtype=torch.uint8, generator=generator)
        row = torch.randint(0, 256, (ROW,), dtype=torch.uint8, generator=generator)
        target_pages, target_row = torch.zeros_like(pages), torch.zeros_like(row)
        writer.register([tensor_region(pages), tensor_region(row)])
        reader.register([tensor_region(target_pages), tensor_region(target_row)])
        peer = writer.add_peer(reader.local_metadata())
        pairs = [(3, 30), (4, 31), (9, 0), (17, 5), (25, 12)]
        descriptors = [(pages.data_ptr() + s * PAGE, target_pages.data_ptr() + d * PAGE, PAGE) for s, d in pairs]
        descriptors.append((row.data_ptr(), target_row.data_ptr(), ROW))
        expected = torch.zeros_like(pages)
        for source, destination in pairs:
            expected[destination * PAGE:(destination + 1) * PAGE] = pages[source * PAGE:(source + 1) * PAGE]
        for attempt in range(2):  # the first write on a new pair sets up its connections
            target_pages.zero_()
            target_row.zero_()
            handle = writer.write(peer, descriptors, notification=f"done:{attempt}".encode())
            deadline, seen = time.monotonic() + 20, []
            while not seen:
                assert time.monotonic() < deadline, "no notification"
                writer.poll(handle)  # NIXL sends the notification from the poll that finds the bytes landed
                seen = reader.notifications()
                if seen:  # I7: everything landed by now
                    assert seen == [("writer", f"done:{attempt}".encode())]
                    assert torch.equal(target_pages, expected) and torch.equal(target_row, row)
                time.sleep(0.0005)
            while writer.poll(handle) is WriteStatus.PENDING:
                assert time.monotonic() < deadline
            assert handle.status is WriteStatus.DONE and writer.release(handle)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("backend", ["nixl", "nccl"])
def test_the_last_write_carries_the_last_pages_the_row_and_the_notification(backend, model_dirs, oracles):
    """A prompt over two prefill chunks: the first chunk's pages go alone; the second chunk's
    pages, the metadata row and the notification go as one write, posted after the first one
    is done; the decode engine continues exactly."""
    from tests.test_pd_engine import LONG_PROMPT, SMALL

    pair = PDPair(model_dirs["llama"], transfer=dict(backend=backend), **SMALL)
    side = pair.prefill.pd
    post, writes = side.backend.write, []

    def spy(peer, descriptors, **options):
        if descriptors and descriptors[0][0] == side.scratch.data_ptr():
            return post(peer, descriptors, **options)  # the handshake's warm-up write
        earlier = [handle.status for _, _, handle, _ in writes]
        handle = post(peer, descriptors, **options)
        writes.append((list(descriptors), options.get("notification", b""), handle, earlier))
        return handle

    side.backend.write = spy
    try:
        pair.submit("long", LONG_PROMPT)
        pair.run_until(lambda: pair.finished("long"))
        pair.assert_matches("long", oracles["llama"].greedy(LONG_PROMPT, GREEDY.max_tokens))
        assert [bool(notification) for _, notification, _, _ in writes] == [False] * (len(writes) - 1) + [True]
        assert len(writes) >= 2
        last, _, _, earlier = writes[-1]
        rows = side.metadata
        in_rows = [d for d in last if rows.address(0) <= d[0] < rows.address(0) + rows.num_rows * rows.row_bytes]
        assert len(in_rows) == 1 and in_rows[0][2] == rows.row_bytes
        assert len(last) > 1  # the second chunk's pages travel with the row
        assert all(status is WriteStatus.DONE for status in earlier)  # posted once every earlier write was done
        pair.settle()
        pair.assert_all_free()
    finally:
        side.backend.write = post
        pair.close()
