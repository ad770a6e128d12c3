"""One-shot all-reduce over peer buffers, alone or fused with the residual add and RMSNorm that
follow it, with no barrier: the data is its own signal.

Tensor parallelism sums each row-parallel projection's partial output over the ranks, and the
decoder layer then forms ``residual + sum`` and normalises it (``kernels/norm.py``). Every rank's
peer buffer (symmetric memory: mapped into every rank's address space; ``parallel/allreduce.py``
owns it) holds, per dtype, two *regions* of one *slot* per rank. A slot that holds nothing holds
the dtype's negative zero in every element (the *empty mark*). A call:

::

    each program p of each rank:   push: store its rows of ``partial`` into slot RANK of the
                                   call's region in every peer's buffer, any -0.0 stored as +0.0
                                   (a value no push can leave is what "not arrived yet" looks like)
                                   pull: for each peer, read its rows of slot PEER of the region
                                   in this rank's own buffer until no element is the empty mark,
                                   then store the mark back (the slot is empty again)
                                   sum (fp32, rank order, rounded once to dtype); fused:
                                   new_residual = sum + residual;  out = RMSNorm(new_residual)

No flag is set and no rank waits for another to finish reading: a rank may run one call ahead of
a peer, so consecutive calls alternate between the two regions (the *parity*, one counter per
dtype in the rank's signal pad, flipped by the last program of each call). A peer can push into a
region again only two calls later, which needs this rank's pushes of the call in between, which
it makes after its kernel of the earlier call has finished reading and emptying that region. So
every rank's calls must be the same sequence (as NCCL's), and the grids of one call equal on
every rank (they are: the same shapes). Program ``p`` handles rows ``p, p + P, ...`` on every
rank, so what a program pulls was pushed by the same program of each peer. Only ordinary loads
and stores cross NVLink (no multicast); the pulls are volatile loads, never a line cached by an
earlier call; the only atomics are local (the parity's flip).

The plain all-reduce (``one_shot_all_reduce``) is the same without the norm, over the flat
tensor cut into chunks of ``CHUNK`` elements instead of rows.

The kernels do not launch early (programmatic dependent launch, as the kernels around them do
in decode graphs of one or two tokens): joining that chain was timed at TP=2 batch 1 and gained
nothing (docs/allreduce.md).

``all_reduce_reference`` and ``reduce_add_norm_reference`` are the contracts in plain PyTorch (the
sum of the ranks' partials, rounded once to their dtype, then ``rms_norm_reference`` with the
residual); on two ranks the rounded sum equals NCCL's bit for bit (a zero sum is +0.0 whatever
the signs of the zeros summed, as in NCCL's).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from tandem.kernels.norm import rms_norm_reference
from tandem.kernels.triton_support import jit, tl, triton

# Programs per launch at most: a row each at decode batch sizes (the pulls from peers are
# latency-bound: more programs, more loads in flight).
MAX_PROGRAMS = 128
CHUNK = 2048  # elements a program sums per step of the plain all-reduce

# The dtypes the peer buffers hold, each in a section of its own (the empty mark differs), with
# the integer type of the same width the kernels move their bits as and that width's mark.
SECTIONS = {torch.bfloat16: (torch.int16, -(1 << 15)), torch.float32: (torch.int32, -(1 << 31))}


def peer_buffer_bytes(slot_bytes: int, world_size: int) -> int:
    """Bytes of a rank's peer buffer for messages of up to ``slot_bytes``: per dtype section,
    two regions of one slot per rank (slot ``r`` holds what rank ``r`` pushed; a rank's own slot
    stays empty: it sums its own input in place)."""
    return len(SECTIONS) * 2 * world_size * slot_bytes


def empty_peer_buffer(buffer: torch.Tensor, slot_bytes: int, world_size: int) -> None:
    """Fill a rank's whole peer buffer (uint8, ``peer_buffer_bytes`` long) with each section's
    empty mark: done once, before any peer pushes into it (every call leaves it so again)."""
    section_bytes = 2 * world_size * slot_bytes
    for index, (integer_type, mark) in enumerate(SECTIONS.values()):
        buffer[index * section_bytes:(index + 1) * section_bytes].view(integer_type).fill_(mark)


def section_of(dtype: torch.dtype) -> int:
    return list(SECTIONS).index(dtype)


@jit
def _buffer(buffer_pointers, rank, element_type: tl.constexpr):
    """Rank ``rank``'s peer buffer as a pointer to ``element_type``: allocations start at
    16-byte boundaries (and slots are whole 16-byte vectors), so rows move in 16-byte vectors."""
    return tl.multiple_of(tl.load(buffer_pointers + rank).to(tl.pointer_type(element_type)), 16)


@jit
def _region_slots(own_pad, SECTION: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """The first slot (counted over the whole buffer) of this call's region of ``SECTION``. A
    rank's signal pad holds two int32 per section: the parity (which region this call uses) at
    ``2 * SECTION``, the count of this call's programs finished at ``2 * SECTION + 1``."""
    parity = tl.load(own_pad + SECTION * 2, volatile=True)
    return (SECTION * 2 + parity) * WORLD_SIZE


@jit
def _push(words, offsets, mask, buffer_pointers, first_slot, slot_elements,
          RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, MARK: tl.constexpr):
    """Store ``words`` (a tensor's bits) at ``offsets`` of slot RANK in every peer's region."""
    words = tl.where(words == MARK, tl.zeros_like(words), words)  # -0.0 travels as +0.0
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            peer_buffer = _buffer(buffer_pointers, peer, words.dtype)
            slot = peer_buffer + (first_slot + RANK).to(tl.int64) * slot_elements
            tl.store(slot + offsets, words, mask=mask)


@jit
def _pull(slot, mask, MARK: tl.constexpr):
    """The words a peer pushed at ``slot`` (masked lanes: 0), waited for until none is the empty
    mark; the slot is left empty again."""
    words = tl.load(slot, mask=mask, other=0, volatile=True)
    while tl.max((words == MARK).to(tl.int32), axis=0) > 0:
        words = tl.load(slot, mask=mask, other=0, volatile=True)
    tl.store(slot, tl.full(words.shape, MARK, words.dtype), mask=mask)
    return words


@jit
def _sum_over_ranks(own_words, offsets, mask, own_buffer, first_slot, slot_elements, dtype: tl.constexpr,
                    RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, MARK: tl.constexpr):
    """fp32 sum in rank order of this rank's words and every peer's pushed ones at ``offsets``."""
    total = tl.zeros(own_words.shape, dtype=tl.float32)
    for peer in tl.static_range(WORLD_SIZE):
        if peer == RANK:
            words = own_words
        else:
            words = _pull(own_buffer + (first_slot + peer).to(tl.int64) * slot_elements + offsets, mask, MARK)
        total += words.to(dtype, bitcast=True).to(tl.float32)
    return total


@jit
def _finish(own_pad, programs, SECTION: tl.constexpr):
    """The last program of the call to get here flips the section's parity for the next call
    (stream order makes it visible there) and resets the count."""
    finished = tl.atomic_add(own_pad + SECTION * 2 + 1, 1, sem="acq_rel", scope="gpu")
    if finished == programs - 1:
        tl.atomic_xchg(own_pad + SECTION * 2 + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xor(own_pad + SECTION * 2, 1, sem="release", scope="gpu")


@jit(do_not_specialize=["num_rows", "programs"])  # the step's token count
def _reduce_add_norm_kernel(partial_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
                            buffer_pointers, signal_pointers, num_rows, programs, dim, slot_elements, eps,
                            weight_offset, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, SECTION: tl.constexpr,
                            MARK: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Rows of ``dim`` elements, all tensors dense ``[num_rows, dim]``; ``partial_ptr``: the
    partial's bits (the integer type of its width); a slot holds ``slot_elements`` >=
    ``num_rows * dim``. ``programs``: the grid's size; program ``p`` takes rows ``p, p +
    programs, ...``."""
    program = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    column_mask = columns < dim
    dtype = out_ptr.dtype.element_ty
    own_pad = tl.load(signal_pointers + RANK).to(tl.pointer_type(tl.int32))
    first_slot = _region_slots(own_pad, SECTION, WORLD_SIZE)
    row = program
    while row < num_rows:  # (while, not range: bounds from arguments; the same loop on GPU)
        offsets = row.to(tl.int64) * dim + columns
        words = tl.load(partial_ptr + offsets, mask=column_mask, other=0)
        _push(words, offsets, column_mask, buffer_pointers, first_slot, slot_elements, RANK, WORLD_SIZE, MARK)
        row += programs
    own_buffer = _buffer(buffer_pointers, RANK, partial_ptr.dtype.element_ty)
    scale = tl.load(weight_ptr + columns, mask=column_mask, other=0.0).to(tl.float32) + weight_offset
    row = program
    while row < num_rows:
        offsets = row.to(tl.int64) * dim + columns
        own_words = tl.load(partial_ptr + offsets, mask=column_mask, other=0)
        total = _sum_over_ranks(own_words, offsets, column_mask, own_buffer, first_slot, slot_elements, dtype,
                                RANK, WORLD_SIZE, MARK)
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
    _finish(own_pad, programs, SECTION)


@jit(do_not_specialize=["num_vectors", "programs"])
def _all_reduce_kernel(input_ptr, out_ptr, buffer_pointers, signal_pointers, num_vectors, programs, slot_elements,
                       RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, SECTION: tl.constexpr, MARK: tl.constexpr,
                       VECTOR: tl.constexpr, BLOCK: tl.constexpr):
    """The sum over ranks of ``input`` (``num_vectors * VECTOR`` elements, dense, as the integer
    type of their width; ``VECTOR`` elements make 16 bytes, so the masks are uniform over each
    vector and accesses stay 16 bytes wide) into ``out`` (may be ``input``'s memory: a program
    reads each chunk of it before writing that chunk). ``programs``: the grid's size; program
    ``p`` takes chunks ``p, p + programs, ...`` of ``BLOCK``."""
    program = tl.program_id(0)
    numel = num_vectors * VECTOR
    dtype = out_ptr.dtype.element_ty
    own_pad = tl.load(signal_pointers + RANK).to(tl.pointer_type(tl.int32))
    first_slot = _region_slots(own_pad, SECTION, WORLD_SIZE)
    num_chunks = tl.cdiv(numel, BLOCK)
    chunk = program
    while chunk < num_chunks:
        offsets = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        words = tl.load(input_ptr + offsets, mask=mask, other=0)
        _push(words, offsets, mask, buffer_pointers, first_slot, slot_elements, RANK, WORLD_SIZE, MARK)
        chunk += programs
    own_buffer = _buffer(buffer_pointers, RANK, input_ptr.dtype.element_ty)
    chunk = program
    while chunk < num_chunks:
        offsets = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        own_words = tl.load(input_ptr + offsets, mask=mask, other=0)
        total = _sum_over_ranks(own_words, offsets, mask, own_buffer, first_slot, slot_elements, dtype,
                                RANK, WORLD_SIZE, MARK)
        tl.store(out_ptr + offsets, total.to(dtype), mask=mask)
        chunk += programs
    _finish(own_pad, programs, SECTION)


def _bits(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``tensor``'s bits as the integer type of its width, its section and empty mark."""
    integer_type, mark = SECTIONS[tensor.dtype]
    return tensor.view(integer_type), section_of(tensor.dtype), mark


def one_shot_all_reduce(tensor: torch.Tensor, *, buffer_pointers: torch.Tensor, signal_pointers: torch.Tensor,
                        rank: int, world_size: int, slot_bytes: int) -> torch.Tensor:
    """The sum over ranks of ``tensor`` (contiguous, a dtype of ``SECTIONS``, a whole number of
    16-byte vectors, at most ``slot_bytes``), written into ``tensor`` and returned. Arguments
    and calling rules as ``one_shot_reduce_add_norm``."""
    numel = tensor.numel()
    vector = 16 // tensor.element_size()
    if numel % vector:
        raise ValueError(f"one_shot_all_reduce: {numel} elements of {tensor.dtype} are not whole 16-byte vectors")
    if numel:
        bits, section, mark = _bits(tensor)
        programs = max(1, min(triton.cdiv(numel, CHUNK), MAX_PROGRAMS))
        _all_reduce_kernel[(programs,)](bits, tensor, buffer_pointers, signal_pointers, numel // vector, programs,
                                        slot_bytes // tensor.element_size(), RANK=rank, WORLD_SIZE=world_size,
                                        SECTION=section, MARK=mark, VECTOR=vector, BLOCK=CHUNK, num_warps=8)
    return tensor


def launch_shape(num_rows: int, dim: int) -> tuple[int, int, int]:
    """(programs, column block, warps) for ``num_rows`` rows of ``dim`` elements."""
    block = triton.next_power_of_2(dim)
    return max(1, min(num_rows, MAX_PROGRAMS)), block, min(16, max(1, block // 512))


def one_shot_reduce_add_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                             buffer_pointers: torch.Tensor, signal_pointers: torch.Tensor, rank: int,
                             world_size: int, slot_bytes: int, weight_offset: float = 0.0,
                             cast_before_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, new_residual)``: ``rms_norm(sum over ranks of partial, residual=residual)``.

    Every rank calls it (and ``one_shot_all_reduce``) in the same sequence, with equal shapes.
    ``buffer_pointers`` / ``signal_pointers``: int64 device tensors of every rank's peer-buffer
    and signal-pad addresses (rank order); the buffers are ``peer_buffer_bytes(slot_bytes,
    world_size)`` long, emptied once by ``empty_peer_buffer`` before first use, and the caller
    checked that ``partial`` fits a slot. No host synchronisation: capturable in a CUDA graph."""
    rows = partial.reshape(-1, partial.shape[-1]).contiguous()
    residual_rows = residual.reshape(rows.shape).contiguous()
    out = torch.empty(partial.shape, dtype=partial.dtype, device=partial.device)
    new_residual = torch.empty_like(out)
    num_rows, dim = rows.shape
    if num_rows:
        bits, section, mark = _bits(rows)
        programs, block, num_warps = launch_shape(num_rows, dim)
        _reduce_add_norm_kernel[(programs,)](
            bits, residual_rows, weight, out, new_residual, buffer_pointers, signal_pointers,
            num_rows, programs, dim, slot_bytes // partial.element_size(), eps, weight_offset, RANK=rank,
            WORLD_SIZE=world_size, SECTION=section, MARK=mark, CAST_BEFORE_WEIGHT=cast_before_weight,
            BLOCK=block, num_warps=num_warps)
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
