"""Triton paged attention (split-KV decode, GQA-packed prefill/extend) against its plain-PyTorch
references: through Triton's interpreter on CPU with tiny shapes, and on a GPU (``-m gpu``)
with Llama-3.1-8B attention shapes.

Every cache starts as NaN poison (docs/design.md I6) and only the slots a query may see are filled,
so each comparison also proves that invisible slots (past a sequence's length, before its
window, null pages) never reach the output; ``out`` starts as NaN too, so every element must
be written.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels import paged_attention as attention  # noqa: E402
from tandem.kernels.paged_attention import (  # noqa: E402
    decode_num_splits, paged_decode_attention, paged_decode_attention_reference, paged_prefill_attention,
    paged_prefill_attention_reference)
from tests.support.kernels import BF16_TOLERANCE, assert_close, interpreter_scalar_loop_bounds  # noqa: E402,F401  (autouse fixture)
from tests.support.layouts import LAYOUTS, in_layout  # noqa: E402

NUM_KV_HEADS = 2


def poisoned_paged_cache(page_size, spans, num_kv_heads, head_dim, dtype, generator, device="cpu"):
    """Key and value caches all NaN except the visible slots ``[first_visible, length)`` of each
    sequence in ``spans``, on pages in random order; page-table entries of pages wholly before
    a sequence's visible slots, and past its last page, are the null page 0.

    Returns ``(key_cache, value_cache, page_table)``."""
    pages_per_row = [math.ceil(length / page_size) for _, length in spans]
    width = max(pages_per_row + [1]) + 1
    num_pages = 1 + sum(pages_per_row)
    order = torch.randperm(num_pages - 1, generator=generator) + 1
    page_table = torch.zeros(len(spans), width, dtype=torch.int32)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    seed = int(torch.randint(1 << 30, (1,), generator=generator))
    device_generator = torch.Generator(device=device).manual_seed(seed)  # random values made on the device
    used = 0
    for row, ((first_visible, length), num_row_pages) in enumerate(zip(spans, pages_per_row)):
        page_table[row, :num_row_pages] = order[used:used + num_row_pages]
        page_table[row, :first_visible // page_size] = 0
        used += num_row_pages
        positions = torch.arange(first_visible, length)
        pages, slots = page_table[row, positions // page_size].long(), positions % page_size
        for cache in (key_cache, value_cache):
            values = torch.randn(len(positions), num_kv_heads, head_dim, generator=device_generator, device=device)
            cache[pages.to(device), slots.to(device)] = values.to(dtype)
    return key_cache, value_cache, page_table.to(device)


def random_query(shape, dtype, generator, device="cpu"):
    """Queries with scores of a few units (peaked enough to exercise the softmax)."""
    return (2 * torch.randn(shape, generator=generator)).to(device=device, dtype=dtype)


def decode_inputs(page_size, group_size, head_dim, lengths, window, dtype, seed, device="cpu",
                  num_kv_heads=NUM_KV_HEADS, cache_dtype=None):
    """``(query, key_cache, value_cache, page_table, context_lengths)`` for one decode step;
    the caches in ``cache_dtype`` (default: the query's)."""
    generator = torch.Generator().manual_seed(seed)
    spans = [(0 if window is None else max(0, length - window), length) for length in lengths]
    key_cache, value_cache, page_table = poisoned_paged_cache(page_size, spans, num_kv_heads, head_dim,
                                                              cache_dtype or dtype, generator, device)
    query = random_query((len(lengths), num_kv_heads * group_size, head_dim), dtype, generator, device)
    context_lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, page_table, context_lengths


def prefill_inputs(page_size, group_size, head_dim, chunks, window, dtype, seed, device="cpu",
                   num_kv_heads=NUM_KV_HEADS, cache_dtype=None):
    """``(query, key_cache, value_cache, page_table, query_starts, context_lengths)`` for chunks
    of ``(query_length, context_length)``; the caches in ``cache_dtype`` (default: the query's)."""
    generator = torch.Generator().manual_seed(seed)
    spans = [(0 if window is None else max(0, length - queries - window + 1), length) for queries, length in chunks]
    key_cache, value_cache, page_table = poisoned_paged_cache(page_size, spans, num_kv_heads, head_dim,
                                                              cache_dtype or dtype, generator, device)
    query_lengths = [queries for queries, _ in chunks]
    query = random_query((sum(query_lengths), num_kv_heads * group_size, head_dim), dtype, generator, device)
    query_starts = torch.tensor([0] + query_lengths, device=device).cumsum(0).to(torch.int32)
    context_lengths = torch.tensor([length for _, length in chunks], dtype=torch.int32, device=device)
    return query, key_cache, value_cache, page_table, query_starts, context_lengths


# ----------------------------------------------------------------------------------------------
# Interpreted (CPU) comparisons

DECODE_CASES = {
    # name: (page_size, group_size, head_dim, context lengths, num_splits, window, softcap, dtype)
    "one-split": (16, 2, 32, [1, 16, 37, 0, 50], 1, None, None, torch.float32),
    "three-splits-softcap": (16, 2, 32, [1, 16, 37, 0, 50], 3, None, 10.0, torch.float32),
    "page-1-window": (1, 4, 16, [1, 5, 0, 23], 3, 6, None, torch.float32),
    "splits-beyond-pages": (64, 1, 32, [64, 0, 100, 3], 8, 40, 5.0, torch.float32),
    "bf16-default-splits": (16, 4, 32, [33, 1, 0, 80], None, 20, 30.0, torch.bfloat16),
    "head-dim-40": (16, 2, 40, [7, 48], 2, None, None, torch.float32),
    "page-4-fp16": (4, 2, 16, [1, 4, 8, 0, 13], 2, None, None, torch.float16),
    "page-64-bf16-window-softcap": (64, 4, 32, [65, 128, 0, 1], 3, 70, 20.0, torch.bfloat16),
    "page-1-many-splits": (1, 1, 16, [2, 40], 64, None, None, torch.float32),
}


# page-major: the kernels read strided views of a pool (``tests/support/layouts.py``), the reference the
# contiguous caches
PAGE_MAJOR_DECODE_CASES = ("three-splits-softcap", "page-64-bf16-window-softcap")
PAGE_MAJOR_PREFILL_CASES = ("fresh-and-cached-prefix", "page-1-window-softcap")


@pytest.mark.parametrize("case, layout", [(case, "layer-major") for case in DECODE_CASES]
                         + [(case, "page-major") for case in PAGE_MAJOR_DECODE_CASES])
def test_decode_matches_reference(case, layout):
    page_size, group_size, head_dim, lengths, num_splits, window, softcap, dtype = DECODE_CASES[case]
    query, key_cache, value_cache, page_table, context_lengths = decode_inputs(
        page_size, group_size, head_dim, lengths, window, dtype, seed=len(case))
    scale = head_dim ** -0.5
    options = dict(window=window, softcap=softcap, num_splits=num_splits)
    out = torch.full_like(query, float("nan"))
    result = paged_decode_attention(query, *in_layout(layout, key_cache, value_cache), page_table, context_lengths,
                                    scale, out=out, **options)
    expected = paged_decode_attention_reference(query, key_cache, value_cache, page_table, context_lengths,
                                                scale, **options)
    assert result is out
    assert_close(out, expected, dtype)
    padding = context_lengths == 0
    assert (out[padding] == 0).all()


PREFILL_CASES = {
    # name: (page_size, group_size, head_dim, chunks of (query_length, context_length), window, softcap, dtype)
    "fresh-and-cached-prefix": (16, 2, 32, [(5, 5), (1, 20), (40, 70)], None, None, torch.float32),
    "page-1-window-softcap": (1, 4, 16, [(9, 9), (17, 30)], 7, 10.0, torch.float32),
    "page-64-window-bf16": (64, 1, 32, [(33, 100), (3, 3)], 20, None, torch.bfloat16),
    "head-dim-40": (16, 2, 40, [(20, 20), (1, 1)], None, None, torch.float32),
    "empty-chunk-fp16-softcap": (4, 2, 16, [(5, 5), (0, 0), (3, 40)], None, 5.0, torch.float16),
    "page-multiples-window": (16, 4, 32, [(32, 32), (16, 48)], 16, None, torch.float32),
    "bf16-fresh-blocks-softcap": (16, 2, 32, [(50, 50)], None, 30.0, torch.bfloat16),
}


@pytest.mark.parametrize("case, layout", [(case, "layer-major") for case in PREFILL_CASES]
                         + [(case, "page-major") for case in PAGE_MAJOR_PREFILL_CASES])
def test_prefill_matches_reference(case, layout):
    page_size, group_size, head_dim, chunks, window, softcap, dtype = PREFILL_CASES[case]
    query, key_cache, value_cache, page_table, query_starts, context_lengths = prefill_inputs(
        page_size, group_size, head_dim, chunks, window, dtype, seed=len(case))
    scale = head_dim ** -0.5
    options = dict(max_query_len=max(queries for queries, _ in chunks), window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    result = paged_prefill_attention(query, *in_layout(layout, key_cache, value_cache), page_table, query_starts,
                                     context_lengths, scale, out=out, **options)
    expected = paged_prefill_attention_reference(query, key_cache, value_cache, page_table, query_starts,
                                                 context_lengths, scale, **options)
    assert result is out
    assert_close(out, expected, dtype)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype, layout", [(torch.float32, "layer-major"), (torch.bfloat16, "layer-major"),
                                           (torch.bfloat16, "page-major")])
@pytest.mark.parametrize("num_splits, window, softcap", [(1, None, None), (3, 20, 30.0)])
def test_decode_fp8_cache_matches_reference(dtype, layout, num_splits, window, softcap):
    """FP8 pages are upcast exactly in the kernel: the same result as the reference's float32
    reading of the same pages."""
    query, key_cache, value_cache, page_table, context_lengths = decode_inputs(
        16, 4, 32, [33, 1, 0, 80], window, dtype, seed=11, cache_dtype=FP8)
    options = dict(window=window, softcap=softcap, num_splits=num_splits)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, *in_layout(layout, key_cache, value_cache), page_table, context_lengths,
                           32 ** -0.5, out=out, **options)
    expected = paged_decode_attention_reference(query, key_cache, value_cache, page_table, context_lengths,
                                                32 ** -0.5, **options)
    assert_close(out, expected, dtype)
    assert (out[context_lengths == 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(None, None), (7, 10.0)])
def test_prefill_fp8_cache_matches_reference(dtype, window, softcap):
    chunks = [(5, 5), (1, 20), (40, 70)]
    query, key_cache, value_cache, page_table, query_starts, context_lengths = prefill_inputs(
        16, 2, 32, chunks, window, dtype, seed=12, cache_dtype=FP8)
    options = dict(max_query_len=40, window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, key_cache, value_cache, page_table, query_starts, context_lengths,
                            32 ** -0.5, out=out, **options)
    expected = paged_prefill_attention_reference(query, key_cache, value_cache, page_table, query_starts,
                                                 context_lengths, 32 ** -0.5, **options)
    assert_close(out, expected, dtype)


def test_outputs_are_allocated_in_the_query_dtype():
    query, key_cache, value_cache, page_table, context_lengths = decode_inputs(
        16, 2, 16, [3, 0], None, torch.bfloat16, seed=3)
    out = paged_decode_attention(query, key_cache, value_cache, page_table, context_lengths, 0.25)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    assert_close(out, paged_decode_attention_reference(query, key_cache, value_cache, page_table,
                                                       context_lengths, 0.25), torch.bfloat16)
    query, key_cache, value_cache, page_table, query_starts, context_lengths = prefill_inputs(
        16, 2, 16, [(3, 3), (2, 9)], None, torch.float32, seed=3)
    options = dict(max_query_len=40)  # any bound at least the longest chunk
    out = paged_prefill_attention(query, key_cache, value_cache, page_table, query_starts, context_lengths, 0.25,
                                  **options)
    assert out.dtype == torch.float32 and out.shape == query.shape
    assert_close(out, paged_prefill_attention_reference(query, key_cache, value_cache, page_table, query_starts,
                                                        context_lengths, 0.25, **options), torch.float32)


def test_decode_stale_read_propagates():
    """A NaN in a visible slot (a stale read) reaches that row's output, and only that row's."""
    query, key_cache, value_cache, page_table, context_lengths = decode_inputs(
        16, 2, 16, [20, 40, 9], None, torch.float32, seed=5)
    page, slot = page_table[1, 33 // 16], 33 % 16
    value_cache[page, slot] = float("nan")
    out = paged_decode_attention(query, key_cache, value_cache, page_table, context_lengths, 0.25, num_splits=2)
    assert out[1].isnan().all()
    assert not out[[0, 2]].isnan().any()


def test_prefill_stale_read_propagates():
    query, key_cache, value_cache, page_table, query_starts, context_lengths = prefill_inputs(
        16, 2, 16, [(6, 6), (4, 30)], None, torch.float32, seed=6)
    key_cache[page_table[1, 0], 3] = float("nan")  # position 3 of chunk 1: seen by all its queries
    out = paged_prefill_attention(query, key_cache, value_cache, page_table, query_starts, context_lengths, 0.25,
                                  max_query_len=6)
    assert out[6:].isnan().all()
    assert not out[:6].isnan().any()


def test_decode_num_splits_depends_on_shapes_only():
    assert decode_num_splits(1, 8, 512, "cpu") == 1
    assert attention._splits_for(256, 8, 512, num_processors=132) == 1
    assert attention._splits_for(1, 8, 512, num_processors=132) == 33
    assert attention._splits_for(1, 8, 4, num_processors=132) == 4  # capped by the pages
    assert attention._splits_for(1, 1, 4096, num_processors=132) == attention.MAXIMUM_DECODE_SPLITS


# ----------------------------------------------------------------------------------------------
# GPU comparisons (Llama-3.1-8B attention: 32 query heads, 8 kv heads, head_dim 128)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: BF16_TOLERANCE}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("window, softcap", [(None, None), (1000, 30.0)])
@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["cache-as-query", "cache-fp8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_decode_matches_reference(batch, dtype, window, softcap, cache_dtype, layout):
    generator = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, 4097, (batch,), generator=generator).tolist()
    lengths[-1] = 0 if batch > 1 else 4096  # a padding row (or the longest context)
    query, key_cache, value_cache, page_table, context_lengths = decode_inputs(
        16, 4, 128, lengths, window, dtype, seed=batch, device="cuda", num_kv_heads=8, cache_dtype=cache_dtype)
    options = dict(window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, *in_layout(layout, key_cache, value_cache), page_table, context_lengths,
                           128 ** -0.5, out=out, **options)
    expected = paged_decode_attention_reference(query, key_cache, value_cache, page_table, context_lengths,
                                                128 ** -0.5, **options)
    assert_close(out, expected, dtype, **GPU_TOLERANCE[dtype])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window, softcap", [(None, None), (700, 30.0)])
@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["cache-as-query", "cache-fp8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_prefill_matches_reference(dtype, window, softcap, cache_dtype, layout):
    chunks = [(512, 512), (1, 3000), (300, 4096), (77, 77), (1000, 1500)]
    query, key_cache, value_cache, page_table, query_starts, context_lengths = prefill_inputs(
        16, 4, 128, chunks, window, dtype, seed=7, device="cuda", num_kv_heads=8, cache_dtype=cache_dtype)
    options = dict(max_query_len=1000, window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, *in_layout(layout, key_cache, value_cache), page_table, query_starts,
                            context_lengths, 128 ** -0.5, out=out, **options)
    expected = paged_prefill_attention_reference(query, key_cache, value_cache, page_table, query_starts,
                                                 context_lengths, 128 ** -0.5, **options)
    assert_close(out, expected, dtype, **GPU_TOLERANCE[dtype])


@pytest.mark.gpu
@requires_cuda
def test_gpu_decode_replays_in_a_cuda_graph():
    """Captured once, replayed with other queries, context lengths and page tables: no host
    synchronisation, no data-dependent shapes."""
    query_all, key_cache, value_cache, page_table_all, lengths_all = decode_inputs(
        16, 4, 128, [100, 2000, 0, 4096, 4000, 0, 1, 333], None, torch.bfloat16, seed=1, device="cuda",
        num_kv_heads=8)
    query, page_table, context_lengths = query_all[:4].clone(), page_table_all[:4].clone(), lengths_all[:4].clone()
    out = torch.empty_like(query)

    def step():
        paged_decode_attention(query, key_cache, value_cache, page_table, context_lengths, 128 ** -0.5,
                               num_splits=4, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rows in (slice(0, 4), slice(4, 8)):
        query.copy_(query_all[rows])
        page_table.copy_(page_table_all[rows])
        context_lengths.copy_(lengths_all[rows])
        out.fill_(float("nan"))
        graph.replay()
        expected = paged_decode_attention_reference(query, key_cache, value_cache, page_table, context_lengths,
                                                    128 ** -0.5)
        assert_close(out, expected, torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows, num_splits", [(3, 2), (256, 1)], ids=["split", "one-warp-launch"])
def test_gpu_fp8_stale_read_propagates(rows, num_splits):
    """FP8 poison (0x7F, NaN in e4m3) in a visible slot reaches that row's output on the GPU
    (Triton's interpreter reads 0x7F as 480, so this runs on CUDA only), under the four-warp
    launch and under the one-warp launch that many programs take."""
    lengths = ([20, 40, 9] * 86)[:rows]
    query, key_cache, value_cache, page_table, context_lengths = decode_inputs(
        16, 4, 128, lengths, None, torch.bfloat16, seed=5, device="cuda", num_kv_heads=8, cache_dtype=FP8)
    warps = attention._decode_config(128, query.device, rows * 8 * num_splits, True)["num_warps"]
    assert warps == (1 if rows == 256 else 4)
    value_cache[page_table[1, 33 // 16], 33 % 16].view(torch.uint8).fill_(0x7F)
    out = paged_decode_attention(query, key_cache, value_cache, page_table, context_lengths, 0.1,
                                 num_splits=num_splits)
    assert out[1].isnan().all()
    assert not out[[0, 2]].isnan().any() and not out[3:].isnan().any()


@pytest.mark.gpu
@requires_cuda
def test_gpu_step_varying_views_compile_once():
    """An eager step's attention views start at row ``num_decode_tokens`` of the step's tables and
    its page table's width follows the longest sequence: neither may make Triton compile the
    kernels again (a compile stalls the step for about a second). The calls below meet every
    alignment of those views and several widths; each kernel keeps one compiled variant."""
    chunks = [(1, 40), (1, 70), (1, 33), (1, 90), (1, 17), (24, 60), (9, 9), (31, 120)]
    query, key_cache, value_cache, page_table, query_starts, context_lengths = prefill_inputs(
        16, 4, 128, chunks, None, torch.bfloat16, seed=9, device="cuda", num_kv_heads=8)

    def variants(kernel) -> int:
        return sum(len(entry[0]) for entry in kernel.device_caches.values())

    before = (variants(attention._prefill_kernel), variants(attention._decode_split_kernel))
    for num_decode in range(5):
        for width in (page_table.shape[1], page_table.shape[1] - 1 if num_decode % 2 else page_table.shape[1] + 3):
            table = torch.zeros(len(chunks), width, dtype=torch.int32, device="cuda")
            shared = min(width, page_table.shape[1])
            table[:, :shared] = page_table[:, :shared]
            rows = slice(num_decode, None)  # (the table is one wider than the longest sequence's pages)
            prefill_chunks = chunks[num_decode:]
            starts = query_starts[num_decode:]
            out = torch.full_like(query, float("nan"))
            paged_prefill_attention(query, key_cache, value_cache, table[rows], starts, context_lengths[rows],
                                    128 ** -0.5, max_query_len=max(q for q, _ in prefill_chunks), out=out)
            expected = paged_prefill_attention_reference(query, key_cache, value_cache, table[rows], starts,
                                                         context_lengths[rows], 128 ** -0.5,
                                                         max_query_len=max(q for q, _ in prefill_chunks))
            covered = slice(int(starts[0]), int(starts[-1]))
            assert_close(out[covered], expected[covered], torch.bfloat16)
            if num_decode:
                decoded = paged_decode_attention(query[:num_decode], key_cache, value_cache, table[:num_decode],
                                                 context_lengths[:num_decode], 128 ** -0.5, num_splits=2)
                assert_close(decoded, paged_decode_attention_reference(
                    query[:num_decode], key_cache, value_cache, table[:num_decode], context_lengths[:num_decode],
                    128 ** -0.5), torch.bfloat16)
    after = (variants(attention._prefill_kernel), variants(attention._decode_split_kernel))
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1, (before, after)
