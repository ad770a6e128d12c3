"""The absorbed-latent MLA decode kernel and the per-token row writer against their plain-PyTorch
references: through Triton's interpreter on CPU with tiny shapes, and on a GPU (``-m gpu``) with
DeepSeek-V3 shapes (128 heads, kv_lora_rank 512, rope dim 64).

Every latent cache starts as NaN poison (docs/design.md I6) and only the slots a row may read are
filled (dense: its context; sparse: its selected positions), so each comparison also proves
that nothing else is loaded; ``out`` starts as NaN too, so every element must be written.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels.mla_decode import (  # noqa: E402
    mla_decode_attention, mla_decode_attention_reference, mla_decode_num_splits)
from tandem.kernels.token_write import write_token_rows, write_token_rows_reference  # noqa: E402
from tests.support.layouts import LAYOUTS, in_layout  # noqa: E402
from tests.support.kernels import BF16_TOLERANCE, assert_close, interpreter_scalar_loop_bounds  # noqa: E402,F401  (autouse fixture)



def selected_positions(lengths, topk_width, generator):
    """``[B, topk_width]`` int32: per row distinct positions below its length in random order,
    some entries -1 and some at or past the length (both skipped), for sparse attention."""
    rows = []
    for length in lengths:
        count = min(length, max(0, topk_width - 2))
        chosen = torch.randperm(max(length, 1), generator=generator)[:count].tolist() if length else []
        row = chosen + [-1] * (topk_width - count)
        if length and topk_width - count >= 2:
            row[-1] = length + 3  # past the context: skipped
        rows.append(row)
    indices = torch.tensor(rows, dtype=torch.int32).view(len(lengths), topk_width)
    permutation = torch.argsort(torch.rand(indices.shape, generator=generator), dim=1)
    return indices.gather(1, permutation)


def poisoned_latent_cache(page_size, lengths, width, dtype, generator, readable, device="cpu"):
    """``(latent_cache, page_table)``: a cache all NaN except the slots ``readable(row)`` lists
    for each row, on pages in random order; the page table pads with the null page 0."""
    pages_per_row = [math.ceil(length / page_size) for length in lengths]
    table_width = max(pages_per_row + [1]) + 1
    num_pages = 1 + sum(pages_per_row)
    order = torch.randperm(num_pages - 1, generator=generator) + 1
    page_table = torch.zeros(len(lengths), table_width, dtype=torch.int32)
    cache = torch.full((num_pages, page_size, width), float("nan"), dtype=dtype)
    used = 0
    for row, count in enumerate(pages_per_row):
        page_table[row, :count] = order[used:used + count]
        used += count
        positions = readable(row)
        pages, slots = page_table[row, positions // page_size].long(), positions % page_size
        cache[pages, slots] = torch.randn(len(positions), width, generator=generator).to(dtype)
    return cache.to(device), page_table.to(device)


def decode_inputs(page_size, num_heads, rank, rope_dim, lengths, topk_width, dtype, seed, device="cpu"):
    """``(q_latent, q_rope, latent_cache, page_table, context_lengths, topk_indices)``."""
    generator = torch.Generator().manual_seed(seed)
    topk_indices = None if topk_width is None else selected_positions(lengths, topk_width, generator)

    def readable(row):
        if topk_indices is None:
            return torch.arange(lengths[row])
        selected = topk_indices[row].long()
        return selected[(selected >= 0) & (selected < lengths[row])]

    cache, page_table = poisoned_latent_cache(page_size, lengths, rank + rope_dim, dtype, generator, readable, device)
    # Latent scores of a few units (peaked enough to exercise the softmax).
    q_latent = (torch.randn(len(lengths), num_heads, rank, generator=generator) * 2 / rank ** 0.25).to(device, dtype)
    q_rope = (torch.randn(len(lengths), num_heads, rope_dim, generator=generator)).to(device, dtype)
    context_lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
    if topk_indices is not None:
        topk_indices = topk_indices.to(device)
    return q_latent, q_rope, cache, page_table, context_lengths, topk_indices


def run_and_compare(inputs, scale, dtype, num_splits, layout="layer-major", **tolerance):
    """The kernel on the cache in ``layout`` (``tests/support/layouts.py``), the reference on it as made."""
    q_latent, q_rope, cache, page_table, context_lengths, topk_indices = inputs
    out = torch.full_like(q_latent, float("nan"))
    result = mla_decode_attention(q_latent, q_rope, *in_layout(layout, cache), page_table, context_lengths, scale,
                                  topk_indices=topk_indices, num_splits=num_splits, out=out)
    expected = mla_decode_attention_reference(q_latent, q_rope, cache, page_table, context_lengths, scale,
                                              topk_indices=topk_indices)
    assert result is out
    assert_close(out, expected, dtype, **tolerance)
    assert (out[context_lengths == 0] == 0).all()
    return out


# ----------------------------------------------------------------------------------------------
# Interpreted (CPU) comparisons

DECODE_CASES = {
    # name: (page_size, heads, rank, rope_dim, context lengths, num_splits, top-k width, dtype)
    "one-split": (16, 4, 32, 8, [1, 16, 37, 0, 50], 1, None, torch.float32),
    "three-splits": (16, 4, 32, 8, [1, 16, 37, 0, 50], 3, None, torch.float32),
    "two-head-blocks-rank-40": (4, 20, 40, 8, [9, 0, 23], 2, None, torch.float32),
    "page-1-many-splits": (1, 2, 16, 16, [2, 40], 64, None, torch.float32),
    "bf16-default-splits": (16, 8, 32, 8, [33, 1, 0, 80], None, None, torch.bfloat16),
    "fp16-page-64": (64, 4, 32, 8, [65, 128, 0, 1], 2, None, torch.float16),
    "sparse-one-split": (16, 4, 32, 8, [1, 16, 37, 0, 50], 1, 20, torch.float32),
    "sparse-splits-page-1": (1, 4, 32, 8, [3, 0, 60, 41], 3, 24, torch.float32),
    "sparse-bf16-wide": (16, 20, 32, 8, [100, 5, 0], None, 40, torch.bfloat16),
}


@pytest.mark.parametrize("case, layout", [(case, "layer-major") for case in DECODE_CASES]
                         + [(case, "page-major") for case in ("three-splits", "sparse-splits-page-1")])
def test_mla_decode_matches_reference(case, layout):
    page_size, num_heads, rank, rope_dim, lengths, num_splits, topk_width, dtype = DECODE_CASES[case]
    inputs = decode_inputs(page_size, num_heads, rank, rope_dim, lengths, topk_width, dtype, seed=len(case))
    run_and_compare(inputs, (rank + rope_dim) ** -0.5, dtype, num_splits, layout)


def test_sparse_rows_with_nothing_selected_are_zeros():
    q_latent, q_rope, cache, page_table, context_lengths, _ = decode_inputs(
        16, 4, 32, 8, [20, 30], None, torch.float32, seed=2)
    topk_indices = torch.tensor([[-1, -1, 25, -1], [3, 29, -1, 7]], dtype=torch.int32)  # 25 >= 20: skipped
    out = mla_decode_attention(q_latent, q_rope, cache, page_table, context_lengths, 0.1,
                               topk_indices=topk_indices, num_splits=2)
    assert (out[0] == 0).all()
    assert_close(out, mla_decode_attention_reference(q_latent, q_rope, cache, page_table, context_lengths, 0.1,
                                                     topk_indices=topk_indices), torch.float32)


def test_output_is_allocated_in_the_query_dtype():
    q_latent, q_rope, cache, page_table, context_lengths, _ = decode_inputs(
        16, 4, 32, 8, [3, 0], None, torch.bfloat16, seed=3)
    out = mla_decode_attention(q_latent, q_rope, cache, page_table, context_lengths, 0.2)
    assert out.dtype == torch.bfloat16 and out.shape == q_latent.shape
    assert_close(out, mla_decode_attention_reference(q_latent, q_rope, cache, page_table, context_lengths, 0.2),
                 torch.bfloat16)


@pytest.mark.parametrize("topk_width", [None, 12])
def test_stale_read_propagates(topk_width):
    """A NaN in a slot a row reads (a stale read) reaches that row's output, and only that row's."""
    q_latent, q_rope, cache, page_table, context_lengths, topk_indices = decode_inputs(
        16, 4, 32, 8, [20, 40, 9], topk_width, torch.float32, seed=5)
    position = 33 if topk_indices is None else int(topk_indices[1][topk_indices[1] >= 0][0])
    cache[page_table[1, position // 16], position % 16, 0] = float("nan")
    out = mla_decode_attention(q_latent, q_rope, cache, page_table, context_lengths, 0.1,
                               topk_indices=topk_indices, num_splits=2)
    assert out[1].isnan().all()
    assert not out[[0, 2]].isnan().any()


def test_num_splits_depends_on_shapes_only():
    assert mla_decode_num_splits(1, 128, 4096, "cpu") == 1


def test_rejects_mismatched_shapes():
    q_latent, q_rope, cache, page_table, context_lengths, _ = decode_inputs(
        16, 4, 32, 8, [3, 5], None, torch.float32, seed=4)
    with pytest.raises(ValueError, match="latent_cache"):
        mla_decode_attention(q_latent[..., :30], q_rope, cache, page_table, context_lengths, 0.1)
    with pytest.raises(ValueError, match="topk_indices"):
        mla_decode_attention(q_latent, q_rope, cache, page_table, context_lengths, 0.1,
                             topk_indices=torch.zeros(3, 4, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_write_token_rows_skips_padding_slots(dtype):
    generator = torch.Generator().manual_seed(6)
    page_size, width = 4, 24
    # A strided view into a larger buffer, as the indexer's page-major key region is.
    backing = torch.zeros(5, page_size, width + 8, dtype=dtype)
    cache, expected = backing[:, :, :width], backing.clone()[:, :, :width]
    slots = torch.tensor([5, -1, 0, 19, -1, 8], dtype=torch.int64)
    values = (torch.randn(6, width, generator=generator) * 50).to(dtype)
    write_token_rows(values, cache, slots)
    write_token_rows_reference(values, expected, slots)
    assert torch.equal(cache, expected)
    assert (backing[:, :, width:] == 0).all()
    assert torch.equal(cache[1, 1], values[0]) and torch.equal(cache[4, 3], values[3])


# ----------------------------------------------------------------------------------------------
# GPU comparisons (DeepSeek-V3: 128 heads, kv_lora_rank 512, rope dim 64)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: BF16_TOLERANCE}
HEADS, RANK, ROPE_DIM, PAGE_SIZE = 128, 512, 64, 64
GPU_SCALE = 192 ** -0.5


def gpu_lengths(batch, seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4097, (batch,), generator=generator).tolist()
    lengths[-1] = 0 if batch > 1 else 4096  # a padding row (or the longest context)
    return lengths


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 32, 128])
@pytest.mark.parametrize("topk_width", [None, 2048])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_mla_decode_matches_reference(batch, dtype, topk_width, layout):
    inputs = decode_inputs(PAGE_SIZE, HEADS, RANK, ROPE_DIM, gpu_lengths(batch, batch), topk_width, dtype,
                           seed=batch, device="cuda")
    run_and_compare(inputs, GPU_SCALE, dtype, None, layout, **GPU_TOLERANCE[dtype])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("topk_width", [None, 2048])
def test_gpu_mla_decode_replays_in_a_cuda_graph(topk_width):
    """Captured once, replayed with other queries, context lengths, page tables and selections:
    no host synchronisation, no data-dependent shapes."""
    lengths = [100, 2000, 0, 4096, 4000, 0, 1, 333]
    inputs = decode_inputs(PAGE_SIZE, HEADS, RANK, ROPE_DIM, lengths, topk_width, torch.bfloat16, seed=1,
                           device="cuda")
    q_latent_all, q_rope_all, cache, page_table_all, lengths_all, topk_all = inputs
    static = [tensor[:4].clone() if tensor is not None else None
              for tensor in (q_latent_all, q_rope_all, page_table_all, lengths_all, topk_all)]
    q_latent, q_rope, page_table, context_lengths, topk_indices = static
    out = torch.empty_like(q_latent)

    def step():
        mla_decode_attention(q_latent, q_rope, cache, page_table, context_lengths, GPU_SCALE,
                             topk_indices=topk_indices, num_splits=4, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rows in (slice(0, 4), slice(4, 8)):
        for target, source in zip(static, (q_latent_all, q_rope_all, page_table_all, lengths_all, topk_all)):
            if target is not None:
                target.copy_(source[rows])
        out.fill_(float("nan"))
        graph.replay()
        expected = mla_decode_attention_reference(q_latent, q_rope, cache, page_table, context_lengths, GPU_SCALE,
                                                  topk_indices=topk_indices)
        assert_close(out, expected, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# The layer's decode path (MLA + FP8 indexer) under a CUDA graph


class LayerState:
    """The two methods of ``StateAccessor`` a layer calls: buffers by layer, group by layer."""

    def __init__(self, buffers: dict, groups: dict) -> None:
        self.buffers, self.groups = buffers, groups

    def layer(self, layer_name):
        return self.buffers[layer_name]

    def group_of(self, layer_name):
        return self.groups[layer_name]


def mla_layer_setup(device, sparse, seed=0):
    """``(layer, context, fill)``: a tiny DeepSeek-V3.2 attention layer on ``device`` (FP8
    indexer when ``sparse``), a forward context over static decode metadata for 4 rows, and
    ``fill(lengths, table_rows)`` loading a step's values into the static tensors (length 0:
    a padding row, slot -1)."""
    from transformers import DeepseekV32Config

    from tandem.kv.spec import IndexerSpec
    from tandem.layers.attention_metadata import AttentionMetadata
    from tandem.layers.mla import LatentRotary, MLAAttention
    from tandem.layers.forward_context import ForwardContext

    torch.manual_seed(seed)
    config = DeepseekV32Config(hidden_size=64, num_attention_heads=8, kv_lora_rank=32, q_lora_rank=48,
                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=16,
                               index_head_dim=32, index_n_heads=16)
    layer = MLAAttention(config, "attention", torch.float32, LatentRotary(config, 512),
                         indexer="full" if sparse else None).to(device)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    page_size, num_pages, rows, width = 16, 40, 4, 8
    buffers = {"attention": {"latent": torch.randn(num_pages, page_size, 40, device=device)}}
    groups = {"attention": 0}
    if sparse:
        (layout,) = IndexerSpec(32, quantized=True).buffer_layouts()
        index_buffer = torch.zeros(num_pages, *layout.page_shape(page_size), dtype=torch.uint8, device=device)
        slots = torch.arange(num_pages * page_size, device=device)
        layer.indexer.keys.write(index_buffer, slots, torch.randn(len(slots), 32, device=device), page_size)
        buffers["attention.indexer"], groups["attention.indexer"] = {"index_key": index_buffer}, 0
    slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
    page_table = torch.zeros(rows, width, dtype=torch.int32, device=device)
    context_lengths = torch.zeros(rows, dtype=torch.int32, device=device)
    metadata = AttentionMetadata(
        page_size=page_size, slot_mapping=slot_mapping, page_table=page_table, context_lengths=context_lengths,
        query_starts=torch.arange(rows + 1, dtype=torch.int32, device=device), num_decode_tokens=rows,
        chunk_query_starts=list(range(rows + 1)), chunk_start_positions=[0] * rows,
        chunk_context_lengths=[1] * rows, zero_invalid=True)
    context = ForwardContext(LayerState(buffers, groups), [metadata], None)
    hidden = torch.zeros(rows, 64, device=device)
    positions = torch.zeros(rows, dtype=torch.long, device=device)

    def fill(lengths, table_rows):
        hidden.copy_(torch.randn(rows, 64, device=device))
        page_table.copy_(torch.tensor(table_rows, dtype=torch.int32))
        context_lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
        positions.copy_((context_lengths.long() - 1).clamp(min=0))
        last = positions // page_size
        slots = page_table.gather(1, last[:, None])[:, 0].long() * page_size + positions % page_size
        slot_mapping.copy_(torch.where(context_lengths > 0, slots, -1))

    return layer, context, hidden, positions, fill


STEPS = [  # (context lengths, page-table rows): distinct pages per row; row 2 then 3 is padding
    ([37, 5, 0, 120], [[1, 2, 3, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0], [0] * 8,
                       [5, 6, 7, 8, 9, 10, 11, 12]]),
    ([128, 17, 64, 0], [[13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 0, 0, 0, 0, 0, 0],
                        [23, 24, 25, 26, 0, 0, 0, 0], [0] * 8]),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "fp8-indexer"])
def test_gpu_mla_layer_decode_replays_in_a_cuda_graph(sparse):
    """``MLAAttention`` (kernel backend; with the FP8 indexer's decode top-k) captured once and
    replayed: the same outputs and cache contents as eager runs, padding rows write nothing."""
    layer, context, hidden, positions, fill = mla_layer_setup("cuda", sparse)
    buffers = context.state.buffers
    fill(*STEPS[0])
    with torch.inference_mode():
        layer(hidden, positions, context)  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, _ = layer(hidden, positions, context)
        for lengths, table_rows in STEPS:
            fill(lengths, table_rows)
            before = {name: {kind: t.clone() for kind, t in layer_buffers.items()}
                      for name, layer_buffers in buffers.items()}
            graph.replay()
            replayed = captured.clone()
            after = {name: {kind: t.clone() for kind, t in layer_buffers.items()}
                     for name, layer_buffers in buffers.items()}
            for name, layer_buffers in before.items():  # eager, from the same starting state
                for kind, tensor in layer_buffers.items():
                    buffers[name][kind].copy_(tensor)
            eager, _ = layer(hidden, positions, context)
            valid = torch.tensor(lengths, device="cuda") > 0
            torch.testing.assert_close(replayed[valid], eager[valid], atol=1e-4, rtol=1e-4)
            changed = (before["attention"]["latent"] != after["attention"]["latent"]).any(-1).flatten()
            written = context.attention_metadata[0].slot_mapping[valid]
            assert torch.equal(changed.nonzero()[:, 0].sort().values, written.sort().values)
            for name, layer_buffers in after.items():
                for kind, tensor in layer_buffers.items():
                    assert torch.equal(tensor, buffers[name][kind]), f"{name}.{kind} differs from eager"
