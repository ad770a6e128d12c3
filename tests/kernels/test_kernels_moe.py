"""The fused MoE kernel (``tandem/kernels/fused_moe.py``) against its reference, the per-expert
loop: interpreted on CPU with tiny shapes that pad expert runs and cross tile boundaries, and on
a GPU (``-m gpu``) at DeepSeek-V3 shapes and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.fused_moe import (align_assignments, assignment_capacity, fused_moe,
                                      fused_moe_reference)
from tandem.layers.moe import FusedExperts
from tests.support.kernels import assert_close, interpreter_scalar_loop_bounds  # noqa: F401  (autouse fixture)

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def moe_inputs(tokens, num_experts, top_k, hidden_size, intermediate, activation, dtype, seed, device="cpu"):
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = 2 * intermediate if activation == "silu" else intermediate

    def random(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    hidden = random(tokens, hidden_size)
    w1 = random(num_experts, rows, hidden_size, scale=hidden_size ** -0.5)
    w2 = random(num_experts, hidden_size, intermediate, scale=intermediate ** -0.5)
    expert_ids = torch.rand(tokens, num_experts, generator=generator, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=generator, device=device)
    return hidden, w1, w2, weights, expert_ids


def assert_matches_reference(actual, expected):
    """``assert_close`` in the output's dtype; in bfloat16 the absolute tolerance scales with the
    output's magnitude (the reference adds bfloat16-rounded rows; the kernel adds in float32)."""
    assert actual.dtype == expected.dtype
    if expected.dtype == torch.float32:
        assert_close(actual, expected)
    else:
        scale = max(1.0, float(expected.abs().max()))
        assert_close(actual, expected, rtol=2e-2, atol=2e-2 * scale)


CASES = {
    # name: (tokens, experts, top_k, hidden, intermediate, activation, dtype)
    "one-token": (1, 8, 2, 64, 32, "silu", torch.float32),
    "odd-shapes-crossing-tiles": (7, 5, 3, 80, 40, "silu", torch.float32),
    "many-tokens-per-expert": (33, 4, 2, 48, 24, "silu", torch.float32),
    "top-1": (9, 6, 1, 32, 16, "silu", torch.float32),
    "relu2": (11, 8, 2, 72, 48, "relu2", torch.float32),
    "bf16": (6, 8, 2, 64, 32, "silu", torch.bfloat16),
    "relu2-bf16": (5, 4, 2, 64, 80, "relu2", torch.bfloat16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_moe_matches_reference(case):
    tokens, experts, top_k, hidden_size, intermediate, activation, dtype = CASES[case]
    inputs = moe_inputs(tokens, experts, top_k, hidden_size, intermediate, activation, dtype, seed=len(case))
    assert_matches_reference(fused_moe(*inputs, activation=activation), fused_moe_reference(*inputs, activation=activation))


def test_fused_moe_reads_strided_hidden_and_empty_batches():
    hidden, w1, w2, weights, expert_ids = moe_inputs(5, 4, 2, 32, 16, "silu", torch.float32, seed=1)
    wide = torch.cat([hidden, torch.full_like(hidden, float("nan"))], dim=1)
    assert_matches_reference(fused_moe(wide[:, :32], w1, w2, weights, expert_ids),
                 fused_moe_reference(hidden, w1, w2, weights, expert_ids))
    assert fused_moe(hidden[:0], w1, w2, weights[:0], expert_ids[:0]).shape == (0, 32)


def test_fused_moe_rejects_mismatched_shapes():
    hidden, w1, w2, weights, expert_ids = moe_inputs(3, 4, 2, 32, 16, "silu", torch.float32, seed=2)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(hidden, w1, w2, weights, expert_ids, activation="gelu")
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(hidden, w1, w2, weights, expert_ids, activation="relu2")
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(hidden, w1, w2, weights[:, :1], expert_ids)


@pytest.mark.parametrize("tokens,experts,top_k,block", [(3, 4, 2, 4), (1, 16, 4, 16), (50, 8, 3, 16), (20, 64, 1, 8)])
def test_alignment_sorts_and_pads_every_assignment_once(tokens, experts, top_k, block):
    expert_ids = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(tokens)).topk(top_k).indices
    sorted_ids, block_experts, num_padded = align_assignments(expert_ids, experts, block)
    count = tokens * top_k
    assert sorted_ids.shape == (assignment_capacity(count, experts, block),)
    assert block_experts.shape == (sorted_ids.shape[0] // block,)
    flat = expert_ids.reshape(-1)
    per_expert = torch.bincount(flat, minlength=experts)
    padded = (per_expert + block - 1) // block * block
    assert int(num_padded) == int(padded.sum()) <= sorted_ids.shape[0]
    used = sorted_ids[:int(num_padded)]
    assert sorted(used[used < count].tolist()) == list(range(count))  # each assignment once
    assert (sorted_ids[int(num_padded):] == count).all()
    start = 0
    for expert in range(experts):  # runs in expert order, assignments in order, padded to blocks
        run = sorted_ids[start:start + int(padded[expert])]
        assert run[:int(per_expert[expert])].tolist() == (flat == expert).nonzero().flatten().tolist()
        assert (run[int(per_expert[expert]):] == count).all()
        assert (block_experts[start // block:(start + int(padded[expert])) // block] == expert).all()
        start += int(padded[expert])


@pytest.mark.parametrize("activation,accumulate", [("silu", None), ("relu2", torch.float32)])
def test_experts_layer_kernel_and_loop_agree(activation, accumulate):
    """``FusedExperts`` on its kernel path and on the loop (the CPU path) give the same rows."""
    torch.manual_seed(0)
    layer = FusedExperts(6, 48, 24, activation=activation, accumulate_dtype=accumulate)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    hidden = torch.randn(9, 48)
    expert_ids = torch.rand(9, 6).topk(2).indices
    weights = torch.rand(9, 2)
    layer.use_kernel = True
    kernel = layer(hidden, expert_ids, weights)
    layer.use_kernel = False
    assert_matches_reference(kernel, layer(hidden, expert_ids, weights))


# ----------------------------------------------------------------------------------------------
# GPU


GPU_CASES = {  # (tokens, experts, top_k, hidden, intermediate): DeepSeek-V3's widths, and its
    # 256 experts at smaller widths (decode: few rows per expert; prefill: many)
    "decode-1": (1, 64, 8, 7168, 2048), "decode-256": (256, 64, 8, 7168, 2048),
    "decode-256-of-256-experts": (256, 256, 8, 1024, 512), "prefill-4096": (4096, 256, 8, 1024, 512)}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_fused_moe_matches_reference(case):
    inputs = moe_inputs(*GPU_CASES[case], "silu", torch.bfloat16, seed=3, device="cuda")
    assert_matches_reference(fused_moe(*inputs), fused_moe_reference(*inputs, accumulate_dtype=torch.float32))


@pytest.mark.gpu
@requires_cuda
def test_gpu_fused_moe_float32_is_exact():
    inputs = moe_inputs(40, 16, 4, 256, 128, "relu2", torch.float32, seed=4, device="cuda")
    assert_matches_reference(fused_moe(*inputs, activation="relu2"), fused_moe_reference(*inputs, activation="relu2"))


@pytest.mark.gpu
@requires_cuda
def test_gpu_fused_moe_replays_in_a_cuda_graph():
    """Captured once; each replay routes differently (the sort and the padding follow)."""
    hidden, w1, w2, weights, expert_ids = moe_inputs(32, 64, 6, 512, 256, "silu", torch.bfloat16, seed=5, device="cuda")
    out = torch.empty_like(hidden)

    def step():
        out.copy_(fused_moe(hidden, w1, w2, weights, expert_ids))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        expert_ids.copy_(torch.rand(32, 64, generator=generator, device="cuda").topk(6).indices)
        weights.copy_(torch.rand(32, 6, generator=generator, device="cuda"))
        hidden.copy_(torch.randn(32, 512, generator=generator, device="cuda").to(hidden.dtype))
        out.fill_(float("nan"))
        graph.replay()
        assert_matches_reference(out, fused_moe_reference(hidden, w1, w2, weights, expert_ids, accumulate_dtype=torch.float32))


@pytest.mark.parametrize("tokens,experts,top_k,block", [(3, 4, 2, 16), (50, 8, 3, 16), (9, 128, 8, 16),
                                                        (40, 256, 8, 32), (1, 6, 1, 16)])
def test_alignment_kernel_equals_the_sort(tokens, experts, top_k, block):
    """The one-launch alignment (interpreted here) gives exactly the sort's three outputs: chunks
    crossed (tokens x top-k > the chunk), experts not a power of two, padding past the runs."""
    from tandem.kernels.fused_moe import _align_with_kernel, align_assignments_reference

    expert_ids = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(tokens)).topk(top_k).indices
    expected = align_assignments_reference(expert_ids, experts, block)
    actual = _align_with_kernel(expert_ids.reshape(-1), experts, block, expected[0].shape[0])
    for left, right in zip(actual, expected):
        assert torch.equal(left, right.to(left.dtype))
