"""Copying pages between two paged byte arrays: a device pool and a host tier's blocks.

Both sides are 2-D byte arrays, one row per page; a copy moves ``width`` bytes of each listed
row, from column ``source_offset`` of source row ``source_pages[i]`` to column
``destination_offset`` of destination row ``destination_pages[i]``:

    destination[destination_pages[i], destination_offset : +width]
        = source[source_pages[i], source_offset : +width]            for every i

A host tier's page block holds every buffer of one state group, one after another (page
first), so one buffer's slice of it is a column range of the block; the device pool's row is
one buffer's page. On CUDA the kernel reads or writes pinned host memory directly (unified
addressing): a layer's pages move in one launch, whatever their number, without staging.
``copy_pages_reference`` is the plain-PyTorch definition, used on CPU.
"""
from __future__ import annotations

import torch

from tandem.kernels.triton_support import jit, tl, triton

WORDS_PER_PROGRAM = 2048


@jit
def _page_copy_kernel(source_ptr, destination_ptr, source_pages_ptr, destination_pages_ptr,
                      source_stride, destination_stride, source_offset, destination_offset, width,
                      BLOCK: tl.constexpr):
    """Program ``(i, block)`` copies words ``block * BLOCK ..`` of the i-th listed page."""
    index = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    source_page = tl.load(source_pages_ptr + index).to(tl.int64)
    destination_page = tl.load(destination_pages_ptr + index).to(tl.int64)
    values = tl.load(source_ptr + source_page * source_stride + source_offset + columns, mask=mask)
    tl.store(destination_ptr + destination_page * destination_stride + destination_offset + columns,
             values, mask=mask)


def _word_dtype(*byte_counts: int) -> torch.dtype:
    return torch.int32 if all(count % 4 == 0 for count in byte_counts) else torch.uint8


def _check(source: torch.Tensor, destination: torch.Tensor, source_pages: torch.Tensor,
           destination_pages: torch.Tensor, source_offset: int, destination_offset: int, width: int) -> None:
    if source.dim() != 2 or destination.dim() != 2 or source.dtype != torch.uint8 or destination.dtype != torch.uint8:
        raise ValueError(f"copy_pages: source {tuple(source.shape)} {source.dtype} and destination "
                         f"{tuple(destination.shape)} {destination.dtype} must be 2-D uint8 [pages, bytes]")
    if source_pages.shape != destination_pages.shape or source_pages.dim() != 1:
        raise ValueError(f"copy_pages: page lists {tuple(source_pages.shape)} and "
                         f"{tuple(destination_pages.shape)} must be 1-D of one length")
    if source_offset + width > source.shape[1] or destination_offset + width > destination.shape[1]:
        raise ValueError(f"copy_pages: {width} bytes at {source_offset}/{destination_offset} exceed rows of "
                         f"{source.shape[1]}/{destination.shape[1]} bytes")
    if source.stride(1) != 1 or destination.stride(1) != 1:
        raise ValueError("copy_pages: rows must be contiguous")


def copy_pages_reference(source: torch.Tensor, destination: torch.Tensor, source_pages: torch.Tensor,
                         destination_pages: torch.Tensor, source_offset: int, destination_offset: int,
                         width: int) -> None:
    """The definition (plain PyTorch; the page lists on the source's and destination's devices
    as needed)."""
    _check(source, destination, source_pages, destination_pages, source_offset, destination_offset, width)
    rows = source.index_select(0, source_pages.to(source.device))[:, source_offset:source_offset + width]
    index = destination_pages.to(destination.device)
    destination[:, destination_offset:destination_offset + width].index_copy_(0, index, rows.to(destination.device))


def copy_pages(source: torch.Tensor, destination: torch.Tensor, source_pages: torch.Tensor,
               destination_pages: torch.Tensor, source_offset: int, destination_offset: int,
               width: int) -> None:
    """The kernel (page lists on the launching device; host arrays must be pinned on CUDA)."""
    _check(source, destination, source_pages, destination_pages, source_offset, destination_offset, width)
    count = source_pages.shape[0]
    if count == 0 or width == 0:
        return
    word = _word_dtype(source.stride(0), destination.stride(0), source_offset, destination_offset, width,
                       source.storage_offset(), destination.storage_offset())
    size = torch.tensor([], dtype=word).element_size()
    source_words = source.view(word) if word != torch.uint8 else source
    destination_words = destination.view(word) if word != torch.uint8 else destination
    words = width // size
    grid = (count, triton.cdiv(words, WORDS_PER_PROGRAM))
    _page_copy_kernel[grid](source_words, destination_words, source_pages, destination_pages,
                            source_words.stride(0), destination_words.stride(0),
                            source_offset // size, destination_offset // size, words,
                            BLOCK=WORDS_PER_PROGRAM)
