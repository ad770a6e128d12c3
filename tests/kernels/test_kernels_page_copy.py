"""The page-copy kernel (``tandem/kernels/page_copy.py``) against its plain-PyTorch reference.

On CPU it runs through Triton's interpreter on tiny arrays; ``-m gpu`` copies between a device
pool and a pinned host array in both directions (the kernel addresses host memory directly),
at the Llama-3.1-8B page shape, and checks the tier mover's per-layer loads on the device.
"""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.page_copy import copy_pages, copy_pages_reference

CUDA = torch.cuda.is_available()


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(test))


def arrays(rows: int, width: int, seed: int, device="cpu", pin=False):
    generator = torch.Generator().manual_seed(seed)
    array = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=generator)
    if pin:
        array = array.pin_memory()
    return array.to(device) if device != "cpu" else array


# (source width, destination width, source offset, destination offset, bytes): word-aligned
# (int32 words) and not (bytes).
SHAPES = [(64, 160, 0, 96, 64), (48, 48, 8, 4, 40), (37, 90, 3, 50, 31)]


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape):
    source_width, destination_width, source_offset, destination_offset, width = shape
    source = arrays(9, source_width, 1)
    expected = arrays(7, destination_width, 2)
    actual = expected.clone()
    source_pages = torch.tensor([4, 0, 8, 2], dtype=torch.long)
    destination_pages = torch.tensor([1, 6, 3, 0], dtype=torch.long)
    copy_pages_reference(source, expected, source_pages, destination_pages, source_offset, destination_offset, width)
    copy_pages(source, actual, source_pages, destination_pages, source_offset, destination_offset, width)
    assert torch.equal(actual, expected)
    # Rows not listed and columns outside the range are untouched.
    untouched = arrays(7, destination_width, 2)
    assert torch.equal(actual[[2, 4, 5]], untouched[[2, 4, 5]])


def test_kernel_copies_page_major_rows_to_host_blocks_and_back():
    """A page-major buffer's pages are a column range of its group's pool (rows ``block`` bytes
    apart, ``BufferDescriptor.page_rows``): saved into a host block's columns and loaded back."""
    from tests.support.layouts import in_layout

    buffer, = in_layout("page-major", arrays(9, 40, 5).view(torch.int32))
    rows = buffer.view(torch.uint8)
    assert rows.stride(0) > rows.shape[1]
    host, expected = arrays(7, 96, 6), arrays(7, 96, 6)
    device_pages, host_pages = torch.tensor([3, 8, 1]), torch.tensor([2, 5, 6])
    copy_pages_reference(rows, expected, device_pages, host_pages, 0, 48, 40)
    copy_pages(rows, host, device_pages, host_pages, 0, 48, 40)
    assert torch.equal(host, expected)
    loaded = torch.zeros_like(rows)
    copy_pages(host, loaded, host_pages, device_pages, 48, 0, 40)
    assert torch.equal(loaded[device_pages], rows[device_pages]) and not loaded[[0, 2]].any()


def test_reference_rejects_bad_ranges():
    source, destination = arrays(4, 16, 1), arrays(4, 16, 2)
    pages = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="exceed"):
        copy_pages_reference(source, destination, pages, pages, 8, 0, 12)
    with pytest.raises(ValueError, match="1-D of one length"):
        copy_pages_reference(source, destination, pages, pages[:1], 0, 0, 4)


@gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_kernel_between_device_and_pinned_host(direction):
    # One Llama-3.1-8B layer's key page (16 tokens x 8 heads x 128 x bf16 = 32 KiB) into a host
    # block of key and value at offset 32 KiB; 300 pages.
    page, block = 32 << 10, 64 << 10
    device_pool = arrays(512, page, 3, device="cuda")
    host = arrays(400, block, 4, pin=True)
    device_pages = torch.randperm(511)[:300] + 1
    host_pages = torch.randperm(399)[:300] + 1
    if direction == "d2h":
        expected = host.clone()
        copy_pages_reference(device_pool, expected, device_pages, host_pages, 0, page, page)
        copy_pages(device_pool, host, device_pages.cuda(), host_pages.cuda(), 0, page, page)
        torch.cuda.synchronize()
        assert torch.equal(host, expected)
    else:
        expected = device_pool.clone()
        copy_pages_reference(host, expected, host_pages, device_pages, page, 0, page)
        copy_pages(host, device_pool, host_pages.cuda(), device_pages.cuda(), page, 0, page)
        torch.cuda.synchronize()
        assert torch.equal(device_pool, expected)
