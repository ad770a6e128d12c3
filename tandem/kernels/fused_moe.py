"""Fused mixture-of-experts in Triton: every routed (token, expert) pair of a step in two grouped
matrix-product launches, with its plain-PyTorch reference (the per-expert loop).

Operands: ``hidden [T, H]``; ``w1 [E, N1, H]`` (gated, ``"silu"``: ``N1 = 2I``, the gate rows
then the up rows as ``gate_up_proj`` stacks them; not gated, ``"relu2"``: ``N1 = I``,
``up_proj``); ``w2 [E, H, I]`` (``down_proj``); routing ``weights [T, k]`` and ``expert_ids
[T, k]`` (a token picks an expert at most once)::

    out[t] = sum_j weights[t, j] * w2[e] . act(w1[e] . hidden[t])        e = expert_ids[t, j]
    act:   silu(gate) * up  ("silu")   |   relu(x)^2  ("relu2")

Assignment ``a = t * k + j`` is one (token, expert) pair. ``align_assignments`` sorts them by
expert and pads each expert's run to whole blocks of ``BLOCK_M`` rows::

    sorted ids:  | e0: a a a a pad pad | e1: a pad pad pad | e3: a a a a a a a pad | ... | unused
    blocks:      |      block 0        |      block 1      |      blocks 2, 3       |     | exit
                 0                                                        num_padded    capacity

``capacity = T*k + min(E, T*k) * (BLOCK_M - 1)``, rounded up to ``BLOCK_M``, depends on shapes
only: the launch grids are static and the sort runs on the device (no host synchronisation,
capturable in a CUDA graph). Blocks at or past ``num_padded`` (a device scalar) return at
once; padding entries (id ``T*k``) are neither read nor written.

Rounding, as the unfused layers do it: ``w1 . hidden`` and ``w2 . act`` are accumulated in
float32 and rounded to the input dtype; the activation is computed by the gated-activation
kernel (``"silu"``) or in PyTorch (``"relu2"``); each expert's output times its weight, and the
sum over a token's experts, are float32, rounded to the input dtype at the end. The reference
adds in ``accumulate_dtype`` (the input dtype unless given) in expert order, so in float32 the
two differ only in the order of additions.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tandem.kernels.paged_attention import MINIMUM_DOT_SIZE, _dot_precision, _upcast_dots
from tandem.kernels.triton_support import jit, tl, triton

ACTIVATIONS = ("silu", "relu2")


# ----------------------------------------------------------------------------------------------
# Kernel


@jit(do_not_specialize=["num_assignments"])  # the step's token count x top-k
def _grouped_matmul_kernel(
        a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
        num_assignments,
        stride_a_row, stride_a_col, stride_b_expert, stride_b_row, stride_b_col,
        stride_c_row, stride_c_col, b_scale_ptr, stride_scale_expert, stride_scale_row,
        N: tl.constexpr, K: tl.constexpr, A_ROWS_PER_ROW: tl.constexpr, MULTIPLY_WEIGHTS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr, SCALE_GROUP: tl.constexpr):
    """Program ``(block, column block)``: for the block's assignments ``a`` (one expert ``e``),
    ``c[a, cols] = a_matrix[a // A_ROWS_PER_ROW] . b[e, cols]^T`` rounded to ``a``'s dtype (times
    ``weights[a]`` in float32 with ``MULTIPLY_WEIGHTS``), stored in ``c``'s dtype. ``SCALE_GROUP``
    > 0: ``b`` is FP8, each value times ``b_scale[e, row, depth // SCALE_GROUP]`` (float32) and
    rounded to ``a``'s dtype before the product (FP8 weights, 16-bit products)."""
    block = tl.program_id(0)
    column_block = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if block * BLOCK_M >= num_padded:
        return
    assignments = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = assignments < num_assignments
    a_rows = (assignments // A_ROWS_PER_ROW).to(tl.int64)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    column_mask = columns < N
    input_dtype = a_ptr.dtype.element_ty
    a_block_ptr = a_ptr + a_rows[:, None] * stride_a_row
    b_block_ptr = b_ptr + expert * stride_b_expert + columns[None, :].to(tl.int64) * stride_b_row
    accumulator = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SCALE_GROUP > 0:
        scale_rows = b_scale_ptr + expert * stride_scale_expert + columns.to(tl.int64) * stride_scale_row
    for start in range(0, K, BLOCK_K):
        depth = start + tl.arange(0, BLOCK_K)
        depth_mask = depth < K
        a = tl.load(a_block_ptr + depth[None, :] * stride_a_col, mask=row_mask[:, None] & depth_mask[None, :],
                    other=0.0)
        b = tl.load(b_block_ptr + depth[:, None] * stride_b_col, mask=depth_mask[:, None] & column_mask[None, :],
                    other=0.0)
        if SCALE_GROUP > 0:
            # The step lies within one scale column (the launch makes BLOCK_K divide SCALE_GROUP,
            # or SCALE_GROUP >= K): one scale per weight row, not one per element.
            scales = tl.load(scale_rows + start // SCALE_GROUP, mask=column_mask, other=0.0)
            b = (b.to(tl.float32) * scales[None, :]).to(input_dtype)
        if UPCAST_DOTS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        accumulator = tl.dot(a, b, accumulator, input_precision=DOT_PRECISION)
    result = accumulator.to(input_dtype)
    if MULTIPLY_WEIGHTS:
        weights = tl.load(weights_ptr + assignments, mask=row_mask, other=0.0)
        result = result.to(tl.float32) * weights[:, None]
    c_offsets = assignments.to(tl.int64)[:, None] * stride_c_row + columns[None, :] * stride_c_col
    tl.store(c_ptr + c_offsets, result.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & column_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Sorting assignments by expert (plain PyTorch on the device; shapes depend on shapes only)


def assignment_capacity(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded, sorted assignment list: each expert hit pads at most ``block_m - 1``."""
    padded = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-padded // block_m) * block_m


# Up to this many assignments (a decode step's tokens x top-k) the alignment is one Triton launch
# (``_align_kernel``: its ordering work grows with the count squared over a chunk), above it a
# dozen PyTorch operations (a sort). At decode a MoE layer spent ~27 us in those operations on an
# H100, ~1.3 ms of Qwen3-30B-A3B's 48 layers.
ALIGN_KERNEL_MAX_ASSIGNMENTS = 2048


@jit(do_not_specialize=["count", "capacity"])
def _align_kernel(expert_ids, sorted_ids, block_experts, num_padded, next_slot, count, capacity,
                  NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  FILL: tl.constexpr):
    """``align_assignments`` in one program: count each expert's assignments, pad the counts to
    ``BLOCK_M`` and sum them into run starts, fill ``sorted_ids`` with the padding id, then place
    the assignments chunk by chunk (an assignment's slot: its expert's next free slot, plus the
    assignments of the same expert before it in its chunk), and name each block's expert.
    ``next_slot [NUM_EXPERTS]`` int32 is scratch; ``EXPERTS``: ``NUM_EXPERTS`` rounded up to a
    power of two. The phases share memory through ``next_slot`` and ``sorted_ids``, hence the
    barriers."""
    experts = tl.arange(0, EXPERTS)
    expert_mask = experts < NUM_EXPERTS
    lanes = tl.arange(0, CHUNK)
    per_expert = tl.zeros([EXPERTS], tl.int32)
    for start in range(0, count, CHUNK):
        ids = tl.load(expert_ids + start + lanes, mask=start + lanes < count, other=EXPERTS)
        per_expert += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (per_expert + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    slots = ends - padded
    tl.store(num_padded, tl.sum(padded, axis=0))
    fill = tl.arange(0, FILL)
    for start in range(0, capacity, FILL):
        tl.store(sorted_ids + start + fill, tl.zeros([FILL], tl.int32) + count, mask=start + fill < capacity)
    tl.store(next_slot + experts, slots, mask=expert_mask)
    tl.debug_barrier()
    for start in range(0, count, CHUNK):
        valid = start + lanes < count
        ids = tl.load(expert_ids + start + lanes, mask=valid, other=EXPERTS)
        earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        base = tl.load(next_slot + ids, mask=valid, other=0)
        tl.store(sorted_ids + base + rank, start + lanes, mask=valid)
        slots += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.debug_barrier()  # every lane has read its base before the next slots replace them
        tl.store(next_slot + experts, slots, mask=expert_mask)
        tl.debug_barrier()
    for start in range(0, capacity // BLOCK_M, CHUNK):
        blocks = start + lanes
        before = tl.sum(((ends[None, :] <= (blocks * BLOCK_M)[:, None]) & expert_mask[None, :]).to(tl.int32), axis=1)
        tl.store(block_experts + blocks, tl.minimum(before, NUM_EXPERTS - 1), mask=blocks < capacity // BLOCK_M)


def _align_with_kernel(flat: torch.Tensor, num_experts: int, block_m: int,
                       capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = flat.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    next_slot = torch.empty(num_experts, dtype=torch.int32, device=device)
    experts = triton.next_power_of_2(num_experts)
    chunk = max(16, min(128, 8192 // experts))  # the [chunk, experts] comparisons stay in registers
    _align_kernel[(1,)](flat.to(torch.int32), sorted_ids, block_experts, num_padded, next_slot, flat.numel(), capacity,
                        NUM_EXPERTS=num_experts, EXPERTS=experts, BLOCK_M=block_m, CHUNK=chunk, FILL=1024,
                        num_warps=4)
    return sorted_ids, block_experts, num_padded


def align_assignments(expert_ids: torch.Tensor, num_experts: int,
                      block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``expert_ids [T, k]`` → ``(sorted_ids [capacity] int32, block_experts [capacity / block_m]
    int32, num_padded [1] int32)`` as drawn in the module docstring. Within an expert,
    assignments keep their order. No host synchronisation. On CUDA, up to
    ``ALIGN_KERNEL_MAX_ASSIGNMENTS``, one Triton launch; otherwise ``align_assignments_reference``."""
    flat = expert_ids.reshape(-1)
    if flat.is_cuda and 0 < flat.numel() <= ALIGN_KERNEL_MAX_ASSIGNMENTS:
        return _align_with_kernel(flat, num_experts, block_m, assignment_capacity(flat.numel(), num_experts, block_m))
    return align_assignments_reference(expert_ids, num_experts, block_m)


def align_assignments_reference(expert_ids: torch.Tensor, num_experts: int,
                                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align_assignments`` in PyTorch operations (a stable sort by expert)."""
    flat = expert_ids.reshape(-1).long()
    count, device = flat.numel(), flat.device
    capacity = assignment_capacity(count, num_experts, block_m)
    per_expert = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (per_expert + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat.index_select(0, order)
    first_of_expert = per_expert.cumsum(0) - per_expert
    destination = ((padded_ends - padded).index_select(0, sorted_experts) + torch.arange(count, device=device)
                   - first_of_expert.index_select(0, sorted_experts))
    sorted_ids = torch.full((capacity,), count, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, destination, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_experts.to(torch.int32), padded_ends[-1:].to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Launch


def _config(num_assignments: int, num_experts: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes by the mean rows per expert (a decode step: few; a prefill: many). Interpreted
    (CPU) runs use the smallest row blocks (so tiny test shapes pad and cross blocks) and wide
    column and depth tiles (the interpreter's cost is per program and per loop step)."""
    if device.type != "cuda":
        return dict(BLOCK_M=MINIMUM_DOT_SIZE, BLOCK_N=64, BLOCK_K=64, num_warps=1)
    rows_per_expert = num_assignments / num_experts
    wide = dtype == torch.float32  # fp32 tiles take twice the shared memory
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64 if wide else 128, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32 if wide else 64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32 if wide else 64, num_warps=8, num_stages=3)


def _depth_within_group(block_k: int, scale_group: int) -> int:
    """The largest depth tile <= ``block_k`` that divides ``scale_group`` (so each loop step of
    the kernel reads one scale column); scale groups are powers of two >= 16 times an integer."""
    while block_k > MINIMUM_DOT_SIZE and scale_group % block_k:
        block_k //= 2
    if scale_group % block_k:
        raise ValueError(f"fused_moe: FP8 scale group {scale_group} is not a multiple of {block_k}")
    return block_k


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alignment: tuple, config: dict,
                    a_rows_per_row: int, weights: Optional[torch.Tensor], b_scale: Optional[torch.Tensor] = None,
                    scale_group: int = 0) -> None:
    sorted_ids, block_experts, num_padded = alignment
    n, k = b.shape[1], b.shape[2]
    if b_scale is not None and scale_group < k:
        config = dict(config, BLOCK_K=_depth_within_group(config["BLOCK_K"], scale_group))
    grid = (block_experts.shape[0], triton.cdiv(n, config["BLOCK_N"]))
    scale = b_scale if b_scale is not None else out
    _grouped_matmul_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_ids, block_experts, num_padded,
        out.shape[0], a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), scale, scale.stride(0) if b_scale is not None else 0,
        scale.stride(1) if b_scale is not None else 0,
        N=n, K=k, A_ROWS_PER_ROW=a_rows_per_row, MULTIPLY_WEIGHTS=weights is not None,
        DOT_PRECISION=_dot_precision(a.dtype), UPCAST_DOTS=_upcast_dots(a),
        SCALE_GROUP=scale_group if b_scale is not None else 0, **config)


def _check(hidden, w1, w2, weights, expert_ids, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {ACTIVATIONS}, got {activation!r}")
    num_experts, intermediate = w2.shape[0], w2.shape[2]
    expected_w1 = (num_experts, 2 * intermediate if activation == "silu" else intermediate, hidden.shape[1])
    if tuple(w1.shape) != expected_w1 or w2.shape[1] != hidden.shape[1]:
        raise ValueError(f"fused_moe: w1 {tuple(w1.shape)} / w2 {tuple(w2.shape)} do not fit hidden "
                         f"{tuple(hidden.shape)} with activation {activation!r}")
    if weights.shape != expert_ids.shape or expert_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"fused_moe: weights {tuple(weights.shape)} and expert_ids {tuple(expert_ids.shape)} "
                         f"must both be [tokens={hidden.shape[0]}, top_k]")


def fused_moe(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              expert_ids: torch.Tensor, activation: str = "silu", w1_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, scale_groups: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The Triton kernels (see the module docstring): ``[T, H]`` in ``hidden``'s dtype.

    FP8 experts: ``w1``/``w2`` float8_e4m3fn with float32 ``w1_scale [E, N1, ceil(H / g1)]`` and
    ``w2_scale [E, H, ceil(I / g2)]`` (one scale per row and ``(g1, g2) = scale_groups`` inputs;
    ``g = H`` or ``I``: per row), each tile dequantized in the kernel (FP8 weight reads, 16-bit
    products)."""
    _check(hidden, w1, w2, weights, expert_ids, activation)
    tokens, top_k = expert_ids.shape
    out = torch.empty_like(hidden)
    if tokens == 0:
        return out
    num_assignments = tokens * top_k
    config = _config(num_assignments, w1.shape[0], hidden.dtype, hidden.device)
    alignment = align_assignments(expert_ids, w1.shape[0], config["BLOCK_M"])
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    projected = hidden.new_empty((num_assignments, w1.shape[1]))
    _grouped_matmul(hidden, w1, projected, alignment, config, top_k, None, w1_scale, scale_groups[0])
    if activation == "silu":
        from tandem.kernels.activation import silu_and_mul

        activated = silu_and_mul(projected)
    else:
        activated = torch.square(F.relu(projected))
    weighted = torch.empty((num_assignments, w2.shape[1]), dtype=torch.float32, device=hidden.device)
    _grouped_matmul(activated, w2, weighted, alignment, config, 1, weights.reshape(-1).float(), w2_scale,
                    scale_groups[1])
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 experts ``[E, N, K]`` times their scales ``[E, N, ceil(K / group)]``, in ``dtype``."""
    expanded = scale.float().repeat_interleave(group, dim=-1)[..., :weight.shape[-1]]
    return (weight.float() * expanded).to(dtype)


def fused_moe_reference(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        expert_ids: torch.Tensor, activation: str = "silu",
                        accumulate_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Plain-PyTorch :func:`fused_moe`, the layers' CPU path: the tokens of each expert hit,
    gathered, through the expert's matrices, weighted and added in expert order in
    ``accumulate_dtype`` (``hidden``'s dtype unless given). Synchronises with the host (the
    experts hit are read back), so it is not capturable."""
    _check(hidden, w1, w2, weights, expert_ids, activation)
    output = torch.zeros_like(hidden, dtype=accumulate_dtype or hidden.dtype)
    for expert in torch.unique(expert_ids).tolist():
        token_index, slot = torch.where(expert_ids == expert)
        projected = F.linear(hidden[token_index], w1[expert])
        if activation == "silu":
            gate, up = projected.chunk(2, dim=-1)
            activated = F.silu(gate) * up
        else:
            activated = torch.square(F.relu(projected))
        expert_out = F.linear(activated, w2[expert]) * weights[token_index, slot, None]
        output.index_add_(0, token_index, expert_out.to(output.dtype))
    return output.to(hidden.dtype)
