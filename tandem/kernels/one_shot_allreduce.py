"""One-shot all-reduce over peer buffers, alone or fused with the residual add and RMSNorm that
follow it.

Tensor parallelism sums each row-parallel projection's partial output over the ranks, and the
decoder layer then forms ``residual + sum`` and normalises it (``kernels/norm.py``). Here one
kernel sums over peer buffers (symmetric memory: every rank's buffer is mapped into every rank's
address space; ``parallel/allreduce.py`` owns them), and the fused kernel does all three:

::

    each program p of each rank:   copy its rows of ``partial`` into this rank's buffer
                                   barrier with program p of every rank   (signal pad slots)
                                   sum its rows over every rank's buffer (fp32), round to dtype
                                   new_residual = sum + residual;  out = RMSNorm(new_residual)
                                   barrier again: no rank overwrites a buffer a peer still reads

Program ``p`` handles rows ``p, p + P, p + 2P, ...`` on every rank, so a program only waits for
the same program of its peers. The barrier leaves every signal slot at zero (a send sets 0 → 1,
the receiver takes it back 1 → 0), so a replayed CUDA graph finds the pad as capture left it.
No NVLink multicast is used: peers are read with ordinary loads.

The plain all-reduce (``one_shot_all_reduce``) is the same without the norm, over the flat
tensor cut into chunks of ``CHUNK`` elements instead of rows.

``all_reduce_reference`` and ``reduce_add_norm_reference`` are the contracts in plain PyTorch (the sum of the ranks' partials,
rounded once to their dtype, then ``rms_norm_reference`` with the residual); on two ranks the
rounded sum equals NCCL's bit for bit.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from tandem.kernels.norm import rms_norm_reference
from tandem.kernels.triton_support import jit, tl, triton

# Programs per launch at most: enough for a row each at decode batch sizes (the reads from
# peers are latency-bound: more programs, more reads in flight), and each program uses
# ``world_size`` signal slots (int32) of the pad, of which torch's smallest (2,048 bytes) has 512.
MAX_PROGRAMS = 128
SIGNAL_SLOTS = 512


def max_programs(world_size: int) -> int:
    return min(MAX_PROGRAMS, SIGNAL_SLOTS // world_size)
CHUNK = 2048  # elements a program sums per step of the plain all-reduce


@jit
def _barrier(signal_pointers, slot, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Program ``slot`` meets program ``slot`` of every rank. Writes of this program before the
    call are visible to the peers' same program after it (release/acquire at system scope; the
    CTA barriers order the other threads' accesses around the one thread doing the atomics)."""
    tl.debug_barrier()
    for peer in tl.static_range(WORLD_SIZE):
        peer_pad = tl.load(signal_pointers + peer).to(tl.pointer_type(tl.int32))
        while tl.atomic_cas(peer_pad + slot * WORLD_SIZE + RANK, 0, 1, sem="release", scope="sys") != 0:
            pass
    own_pad = tl.load(signal_pointers + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD_SIZE):
        while tl.atomic_cas(own_pad + slot * WORLD_SIZE + peer, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@jit(do_not_specialize=["num_rows", "programs"])  # the step's token count
def _reduce_add_norm_kernel(partial_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
                            buffer_pointers, signal_pointers, num_rows, programs, dim, eps, weight_offset,
                            RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
                            CAST_BEFORE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Rows of ``dim`` elements, all tensors dense ``[num_rows, dim]``; the peer buffers hold at
    least ``num_rows * dim`` elements of ``partial``'s dtype. ``programs``: the grid's size;
    program ``p`` takes rows ``p, p + programs, ...``."""
    program = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    column_mask = columns < dim
    dtype = partial_ptr.dtype.element_ty
    # Buffers start at allocation boundaries: 16-byte aligned, so rows move in 16-byte vectors.
    own_buffer = tl.multiple_of(tl.load(buffer_pointers + RANK).to(tl.pointer_type(dtype)), 16)
    row = program
    while row < num_rows:  # (while, not range: bounds from arguments; the same loop on GPU)
        offsets = row.to(tl.int64) * dim + columns
        tl.store(own_buffer + offsets, tl.load(partial_ptr + offsets, mask=column_mask), mask=column_mask)
        row += programs
    _barrier(signal_pointers, program, RANK, WORLD_SIZE)
    scale = tl.load(weight_ptr + columns, mask=column_mask, other=0.0).to(tl.float32) + weight_offset
    row = program
    while row < num_rows:
        offsets = row.to(tl.int64) * dim + columns
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for peer in tl.static_range(WORLD_SIZE):
            buffer = tl.multiple_of(tl.load(buffer_pointers + peer).to(tl.pointer_type(dtype)), 16)
            # Volatile: read from the owner every time, never a line cached by an earlier call.
            total += tl.load(buffer + offsets, mask=column_mask, other=0.0, volatile=True).to(tl.float32)
        residual = tl.load(residual_ptr + offsets, mask=column_mask, other=0.0)
        x = (total.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(new_residual_ptr + offsets, x, mask=column_mask)
        hidden = x.to(tl.float32)
        variance = tl.sum(hidden * hidden, axis=0) / dim
        hidden = hidden * tl.math.rsqrt(variance + eps)
        if CAST_BEFORE_WEIGHT:
            hidden = hidden.to(dtype).to(tl.float32)
        tl.store(out_ptr + offsets, (hidden * scale).to(dtype), mask=column_mask)
        row += programs
    _barrier(signal_pointers, program, RANK, WORLD_SIZE)


@jit(do_not_specialize=["num_vectors", "programs"])
def _all_reduce_kernel(input_ptr, out_ptr, buffer_pointers, signal_pointers, num_vectors, programs,
                       RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, VECTOR: tl.constexpr, BLOCK: tl.constexpr):
    """The sum over ranks of ``input`` (``num_vectors * VECTOR`` elements, dense; ``VECTOR``
    elements make 16 bytes, so the masks are uniform over each vector and loads stay 16 bytes
    wide) into ``out`` (may be ``input``: each element is read before it is written, by the same
    thread). ``programs``: the grid's size; program ``p`` takes chunks ``p, p + programs, ...``
    of ``BLOCK``."""
    program = tl.program_id(0)
    numel = num_vectors * VECTOR
    dtype = input_ptr.dtype.element_ty
    own_buffer = tl.multiple_of(tl.load(buffer_pointers + RANK).to(tl.pointer_type(dtype)), 16)
    num_chunks = tl.cdiv(numel, BLOCK)
    chunk = program
    while chunk < num_chunks:
        offsets = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        tl.store(own_buffer + offsets, tl.load(input_ptr + offsets, mask=mask), mask=mask)
        chunk += programs
    _barrier(signal_pointers, program, RANK, WORLD_SIZE)
    chunk = program
    while chunk < num_chunks:
        offsets = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for peer in tl.static_range(WORLD_SIZE):
            buffer = tl.multiple_of(tl.load(buffer_pointers + peer).to(tl.pointer_type(dtype)), 16)
            total += tl.load(buffer + offsets, mask=mask, other=0.0, volatile=True).to(tl.float32)
        tl.store(out_ptr + offsets, total.to(dtype), mask=mask)
        chunk += programs
    _barrier(signal_pointers, program, RANK, WORLD_SIZE)


def one_shot_all_reduce(tensor: torch.Tensor, *, buffer_pointers: torch.Tensor, signal_pointers: torch.Tensor,
                        rank: int, world_size: int) -> torch.Tensor:
    """The sum over ranks of ``tensor`` (contiguous, a whole number of 16-byte vectors), written
    into ``tensor`` and returned. Arguments and calling rules as ``one_shot_reduce_add_norm``."""
    numel = tensor.numel()
    vector = 16 // tensor.element_size()
    if numel % vector:
        raise ValueError(f"one_shot_all_reduce: {numel} elements of {tensor.dtype} are not whole 16-byte vectors")
    if numel:
        programs = max(1, min(triton.cdiv(numel, CHUNK), max_programs(world_size)))
        _all_reduce_kernel[(programs,)](tensor, tensor, buffer_pointers, signal_pointers, numel // vector, programs,
                                        RANK=rank, WORLD_SIZE=world_size, VECTOR=vector, BLOCK=CHUNK, num_warps=8)
    return tensor


def launch_shape(num_rows: int, dim: int, world_size: int) -> tuple[int, int, int]:
    """(programs, column block, warps) for ``num_rows`` rows of ``dim`` elements."""
    block = triton.next_power_of_2(dim)
    return max(1, min(num_rows, max_programs(world_size))), block, min(16, max(1, block // 512))


def one_shot_reduce_add_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                             buffer_pointers: torch.Tensor, signal_pointers: torch.Tensor, rank: int,
                             world_size: int, weight_offset: float = 0.0,
                             cast_before_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, new_residual)``: ``rms_norm(sum over ranks of partial, residual=residual)``.

    Every rank calls it with equal shapes, in the same order relative to its other collectives.
    ``buffer_pointers`` / ``signal_pointers``: int64 device tensors of every rank's peer-buffer
    and signal-pad addresses (rank order); the caller checked the buffers hold ``partial``.
    No host synchronisation: capturable in a CUDA graph."""
    rows = partial.reshape(-1, partial.shape[-1]).contiguous()
    residual_rows = residual.reshape(rows.shape).contiguous()
    out = torch.empty(partial.shape, dtype=partial.dtype, device=partial.device)
    new_residual = torch.empty_like(out)
    num_rows, dim = rows.shape
    if num_rows:
        programs, block, num_warps = launch_shape(num_rows, dim, world_size)
        _reduce_add_norm_kernel[(programs,)](
            rows, residual_rows, weight, out, new_residual, buffer_pointers, signal_pointers,
            num_rows, programs, dim, eps, weight_offset, RANK=rank, WORLD_SIZE=world_size,
            CAST_BEFORE_WEIGHT=cast_before_weight, BLOCK=block, num_warps=num_warps)
    return out, new_residual


def all_reduce_reference(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every rank's ``partial`` summed in float32 and rounded once to their dtype."""
    return torch.stack([partial.float() for partial in partials]).sum(0).to(partials[0].dtype)


def reduce_add_norm_reference(partials: Sequence[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, *, weight_offset: float = 0.0, cast_before_weight: bool = True,
                              summed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract in plain PyTorch: every rank's ``partial`` summed in float32 and rounded once
    to their dtype (or ``summed``, that sum already formed), then ``rms_norm_reference`` with
    ``residual``."""
    if summed is None:
        summed = all_reduce_reference(partials)
    return rms_norm_reference(summed, weight, eps, residual=residual, weight_offset=weight_offset,
                              cast_before_weight=cast_before_weight)
