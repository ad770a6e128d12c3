"""The DSA indexer's decode scoring kernel against its plain-PyTorch reference and against the
indexer's own math (``index_scores`` over the codec's gathered keys): through Triton's
interpreter on CPU with tiny shapes, and on a GPU (``-m gpu``) with DeepSeek-V3.2 indexer shapes
(64 heads, head dim 128, FP8 page-major keys).

Slots a row cannot see hold poison (NaN floats; the e4m3 NaN byte 0x7F in FP8 keys), so each
comparison also proves they are never loaded.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels.indexer_decode import index_decode_scores, index_decode_scores_reference  # noqa: E402
from tandem.layers.sparse_indexer import Float32IndexKeys, Fp8PageMajorIndexKeys, index_scores  # noqa: E402
from tests.support.layouts import LAYOUTS, in_layout  # noqa: E402
from tests.support.kernels import interpreter_scalar_loop_bounds  # noqa: E402,F401  (autouse fixture)

FP8_NAN_BYTE = 0x7F


def index_inputs(page_size, num_heads, head_dim, lengths, quantized, seed, device="cpu"):
    """``(codec, buffer, queries, weights, page_table, context_lengths)``: keys written through
    the indexer's codec at the visible slots of each row (pages in random order), poison elsewhere;
    ``queries`` as the codec's :meth:`queries` returns them."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_row = [math.ceil(length / page_size) for length in lengths]
    width = max(pages_per_row + [1]) + 1
    num_pages = 1 + sum(pages_per_row)
    order = (torch.randperm(num_pages - 1, generator=generator) + 1).tolist()
    page_table = torch.zeros(len(lengths), width, dtype=torch.int32)
    if quantized:
        codec = Fp8PageMajorIndexKeys(head_dim)
        buffer = torch.full((num_pages, page_size * (head_dim + 4)), FP8_NAN_BYTE, dtype=torch.uint8)
        buffer[:, page_size * head_dim:].view(torch.float32).fill_(float("nan"))
    else:
        codec = Float32IndexKeys()
        buffer = torch.full((num_pages, page_size, head_dim), float("nan"))
    used = 0
    for row, (length, count) in enumerate(zip(lengths, pages_per_row)):
        page_table[row, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
        positions = torch.arange(length)
        slots = page_table[row, positions // page_size].long() * page_size + positions % page_size
        keys = torch.randn(length, head_dim, generator=generator) * torch.rand(length, 1, generator=generator) * 4
        codec.write(buffer, slots, keys, page_size)
    queries = codec.queries(torch.randn(len(lengths), num_heads, head_dim, generator=generator))
    weights = torch.randn(len(lengths), num_heads, generator=generator) * num_heads ** -0.5
    context_lengths = torch.tensor(lengths, dtype=torch.int32)
    return (codec, buffer.to(device), queries.to(device), weights.to(device), page_table.to(device),
            context_lengths.to(device))


def layer_scores(codec, buffer, queries, weights, page_table, context_lengths, page_size, softmax_scale):
    """The indexer's plain-PyTorch decode math on the same rows (keys gathered by the codec)."""
    keys = codec.gather(buffer.cpu(), page_table.cpu().long(), page_size)
    visible = torch.arange(keys.shape[1])[None, :] < context_lengths.cpu()[:, None]
    keys = torch.where(visible[:, :, None], keys, 0)
    scores = index_scores(queries.cpu().float()[:, None], weights.cpu()[:, None], keys, softmax_scale)[:, 0]
    return scores.masked_fill(~visible, float("-inf"))


def kernel_scores(codec, buffer, queries, weights, page_table, context_lengths, page_size, softmax_scale,
                  layout="layer-major"):
    """The kernel and its reference on the buffer in ``layout`` (``tests/support/layouts.py``)."""
    buffer, = in_layout(layout, buffer)
    queries, keys, key_scales = codec.decode_operands(buffer, page_size, queries)
    operands = (queries, weights, keys, key_scales, page_table, context_lengths, softmax_scale)
    out = torch.full((page_table.shape[0], page_table.shape[1] * page_size), float("nan"), device=buffer.device)
    result = index_decode_scores(*operands, out=out)
    assert result is out
    expected = index_decode_scores_reference(*operands)
    return out, expected


def assert_scores_close(actual, expected, **tolerance):
    assert not actual.isnan().any(), "a score is NaN (unwritten or poisoned)"
    assert torch.equal(actual.isinf(), expected.isinf())
    tolerance = tolerance or dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **tolerance)


CASES = {
    # name: (page_size, heads, head_dim, context lengths, quantized)
    "float32-page-16": (16, 4, 32, [1, 16, 37, 0, 50], False),
    "fp8-page-16-two-head-blocks": (16, 20, 32, [1, 16, 37, 0, 50], True),
    "fp8-page-1": (1, 16, 32, [3, 0, 21], True),
    "float32-page-64-head-dim-24": (64, 16, 24, [65, 128, 0, 1], False),
    "fp8-page-4-head-dim-64": (4, 8, 64, [9, 33], True),
}


@pytest.mark.parametrize("case, layout", [(case, "layer-major") for case in CASES]
                         + [(case, "page-major") for case in ("float32-page-16", "fp8-page-16-two-head-blocks")])
def test_index_decode_scores_match_reference_and_layer(case, layout):
    page_size, num_heads, head_dim, lengths, quantized = CASES[case]
    inputs = index_inputs(page_size, num_heads, head_dim, lengths, quantized, seed=len(case))
    softmax_scale = head_dim ** -0.5
    out, expected = kernel_scores(*inputs, page_size, softmax_scale, layout)
    assert_scores_close(out, expected)
    assert_scores_close(out, layer_scores(*inputs, page_size, softmax_scale))
    assert out[torch.tensor(lengths) == 0].isneginf().all()


def test_index_decode_stale_read_propagates():
    codec, buffer, queries, weights, page_table, context_lengths = index_inputs(
        16, 4, 32, [20, 40], False, seed=7)
    buffer[page_table[1, 33 // 16], 33 % 16, 5] = float("nan")
    out = index_decode_scores(queries, weights, buffer, None, page_table, context_lengths, 0.2)
    assert out[1, 33].isnan() and not out[0].isnan().any() and not out[1, :33].isnan().any()


def test_index_decode_rejects_mismatched_shapes():
    codec, buffer, queries, weights, page_table, context_lengths = index_inputs(16, 4, 32, [3], False, seed=1)
    with pytest.raises(ValueError, match="index_decode_scores"):
        index_decode_scores(queries, weights[:, :3], buffer, None, page_table, context_lengths, 0.2)


# ----------------------------------------------------------------------------------------------
# GPU comparisons (DeepSeek-V3.2 indexer: 64 heads, head dim 128, FP8 page-major keys)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_index_decode_scores_match_reference(batch, quantized, layout):
    generator = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, 4097, (batch,), generator=generator).tolist()
    lengths[-1] = 0 if batch > 1 else 4096
    inputs = index_inputs(64, 64, 128, lengths, quantized, seed=batch, device="cuda")
    out, expected = kernel_scores(*inputs, 64, 128 ** -0.5, layout)
    # FP8: exact bf16 products, float32 sums in another order; float32: ieee products.
    assert_scores_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@requires_cuda
def test_gpu_index_decode_replays_in_a_cuda_graph():
    codec, buffer, queries_all, weights_all, page_table_all, lengths_all = index_inputs(
        64, 64, 128, [100, 2000, 0, 4096, 4000, 0, 1, 333], True, seed=2, device="cuda")
    operands_all = codec.decode_operands(buffer, 64, queries_all)
    queries, weights = operands_all[0][:4].clone(), weights_all[:4].clone()
    page_table, context_lengths = page_table_all[:4].clone(), lengths_all[:4].clone()
    out = torch.empty(4, page_table.shape[1] * 64, device="cuda")

    def step():
        index_decode_scores(queries, weights, operands_all[1], operands_all[2], page_table, context_lengths,
                            128 ** -0.5, out=out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rows in (slice(0, 4), slice(4, 8)):
        for target, source in ((queries, operands_all[0]), (weights, weights_all), (page_table, page_table_all),
                               (context_lengths, lengths_all)):
            target.copy_(source[rows])
        out.fill_(float("nan"))
        graph.replay()
        expected = index_decode_scores_reference(queries, weights, operands_all[1], operands_all[2], page_table,
                                                 context_lengths, 128 ** -0.5)
        assert_scores_close(out, expected, atol=1e-4, rtol=1e-4)
