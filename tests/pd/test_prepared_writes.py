"""Writes of whole blocks from descriptor lists prepared at pairing (``block_index.py``; NIXL's
``prep_xfer_dlist`` + ``make_prepped_xfer``): the indices a write maps to are exactly the blocks
it covers (against a block-by-block enumeration), anything that is not whole blocks of one run
is left to the described path, and through NIXL (host memory on this CPU; between two GPUs, marked
gpu) prepared writes land byte for byte with their notification after them, as described writes do."""
import os
import random
import time

os.environ["TANDEM_SANITIZE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.transfer.block_index import BlockIndex, BlockRuns, Blocks  # noqa: E402

RUNS = [BlockRuns(Blocks(10_000, 64, 64, 20), Blocks(500_000, 64, 64, 30)),  # dense blocks (page-major pages)
        BlockRuns(Blocks(1_000, 100, 40, 8), Blocks(900_000, 100, 40, 5)),  # strided blocks (layer-major)
        BlockRuns(Blocks(50_000, 48, 48, 4), Blocks(700_000, 48, 48, 6))]  # metadata rows


def enumerate_blocks(descriptor):
    """Block by block, which (local index, remote index) pairs a descriptor covers, or None."""
    source, destination, length = descriptor
    first_local = first_remote = 0
    firsts = []
    for run in RUNS:
        firsts.append((first_local, first_remote))
        first_local, first_remote = first_local + run.local.count, first_remote + run.remote.count
    for run, (local_base, remote_base) in zip(RUNS, firsts):
        local, remote = run.local, run.remote
        starts = [local.address + block * local.stride for block in range(local.count)]
        if source not in starts:
            continue
        pairs, offset = [], 0
        local_block = starts.index(source)
        while offset < length:
            remote_address = destination + offset
            if (remote_address - remote.address) % remote.stride or remote_address < remote.address:
                return None
            remote_block = (remote_address - remote.address) // remote.stride
            if local_block >= local.count or remote_block >= remote.count or length - offset < local.length:
                return None
            pairs.append((local_base + local_block, remote_base + remote_block))
            offset += local.stride if length - offset > local.length else local.length
            local_block += 1
        return pairs if offset == length else None
    return None


def test_whole_blocks_map_to_their_indices_and_anything_else_to_none():
    index = BlockIndex(RUNS)
    generator = random.Random(0)
    checked = {True: 0, False: 0}
    for _ in range(400):
        descriptors = []
        for _ in range(generator.randint(1, 4)):
            run = generator.choice(RUNS)
            count = generator.randint(1, 3)
            local_block = generator.randint(0, run.local.count - 1)
            remote_block = generator.randint(0, run.remote.count - 1)
            length = (count - 1) * run.local.stride + run.local.length + generator.choice([0, 0, 0, 1, -1])
            descriptors.append((run.local.address + local_block * run.local.stride + generator.choice([0, 0, 0, 8]),
                                run.remote.address + remote_block * run.remote.stride, length))
        expected = [enumerate_blocks(descriptor) for descriptor in descriptors]
        mapped = index.indices(descriptors)
        if any(pairs is None for pairs in expected):
            assert mapped is None, descriptors
        else:
            pairs = [pair for covered in expected for pair in covered]
            assert mapped is not None and list(zip(list(mapped[0]), list(mapped[1]))) == pairs
        # many descriptors go through numpy: the same answer
        many = index.many_indices(descriptors)
        assert (many is None) == (mapped is None)
        if many is not None:
            assert many[0].dtype == np.int32 and many[0].tolist() == list(mapped[0]) \
                and many[1].tolist() == list(mapped[1])
        checked[mapped is not None] += 1
    assert min(checked.values()) > 50  # both outcomes were exercised
    assert index.indices([]) is None and BlockIndex([]).indices([(1, 2, 3)]) is None
    with pytest.raises(ValueError, match="same stride"):
        BlockIndex([BlockRuns(Blocks(0, 64, 64, 1), Blocks(0, 128, 64, 1))])


BLOCK, ROW = 256, 96


TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize("devices", [("cpu", "cpu"), pytest.param(("cuda:0", "cuda:1"), marks=[
    pytest.mark.gpu, pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")])], ids=["cpu", "gpu"])
def test_nixl_writes_from_prepared_lists_land_before_their_notification(devices):
    pytest.importorskip("nixl", reason="NIXL is not installed")
    from tandem.transfer.backends import create_backend
    from tandem.transfer.connector import WriteStatus
    from tandem.transfer.descriptors import tensor_region

    writer, reader = create_backend("nixl", "prepared-writer"), create_backend("nixl", "prepared-reader")
    try:
        generator = torch.Generator().manual_seed(3)
        pages = torch.randint(0, 256, (32 * BLOCK,), dtype=torch.uint8, generator=generator).to(devices[0])
        rows = torch.randint(0, 256, (4 * ROW,), dtype=torch.uint8, generator=generator).to(devices[0])
        target_pages = torch.zeros(48 * BLOCK, dtype=torch.uint8, device=devices[1])
        target_rows = torch.zeros(6 * ROW, dtype=torch.uint8, device=devices[1])
        local_device, remote_device = (pages.device.index, target_pages.device.index) if pages.is_cuda else (-1, -1)
        if pages.is_cuda:
            torch.cuda.synchronize(devices[0])  # (sources final when posted)
        writer.register([tensor_region(pages), tensor_region(rows)])
        reader.register([tensor_region(target_pages), tensor_region(target_rows)])
        peer = writer.add_peer(reader.local_metadata())
        writer.prepare(peer, [BlockRuns(Blocks(pages.data_ptr(), BLOCK, BLOCK, 32),
                                        Blocks(target_pages.data_ptr(), BLOCK, BLOCK, 48)),
                              BlockRuns(Blocks(rows.data_ptr(), ROW, ROW, 4),
                                        Blocks(target_rows.data_ptr(), ROW, ROW, 6))], local_device, remote_device)

        def page_run(source: int, destination: int, count: int):
            return (pages.data_ptr() + source * BLOCK, target_pages.data_ptr() + destination * BLOCK, count * BLOCK)

        writes = [[page_run(0, 40, 5), page_run(9, 2, 1), page_run(20, 10, 3),
                   (rows.data_ptr() + 2 * ROW, target_rows.data_ptr() + 5 * ROW, ROW)],  # whole blocks: prepared
                  [(pages.data_ptr() + 7, target_pages.data_ptr() + 30 * BLOCK, 100)]]  # a part of one: described
        for number, descriptors in enumerate(writes):
            prepared_before = writer.prepared_writes
            handle = writer.write(peer, descriptors, notification=f"n{number}".encode(), local_device=local_device,
                                  remote_device=remote_device)
            deadline, seen = time.monotonic() + 20, []
            while not seen:
                assert time.monotonic() < deadline
                writer.poll(handle)  # (NIXL sends the notification from the poll that finds the bytes landed)
                seen = reader.notifications()
            assert seen == [("prepared-writer", f"n{number}".encode())]
            for source, destination, length in descriptors:  # landed by the time the notification came
                target = target_pages if target_pages.data_ptr() <= destination < target_pages.data_ptr() + \
                    target_pages.numel() else target_rows
                origin = pages if pages.data_ptr() <= source < pages.data_ptr() + pages.numel() else rows
                begin, start = destination - target.data_ptr(), source - origin.data_ptr()
                assert torch.equal(target[begin:begin + length].cpu(), origin[start:start + length].cpu())
            while writer.poll(handle) is WriteStatus.PENDING:
                assert time.monotonic() < deadline
            assert handle.status is WriteStatus.DONE and writer.release(handle)
            assert writer.prepared_writes == prepared_before + (1 if number == 0 else 0)
    finally:
        writer.close()
        reader.close()
