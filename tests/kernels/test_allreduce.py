"""The peer all-reduce on a CPU (``tandem/parallel/allreduce.py``, ``kernels/one_shot_allreduce.py``):

- which algorithm a message takes (one-shot, two-shot, NCCL) and the limits read from the
  environment, bad values named;
- the plain-PyTorch contract of the fused reduce + residual add + RMSNorm equals the unfused ops;
- the Triton one-shot kernels themselves, through Triton's interpreter, as two forked processes
  whose "peer buffers" are shared memory mapped at each process's own addresses (as symmetric
  memory maps them), called twice with new inputs: the sums equal the reference, and every
  signal slot is back at zero after each call (what a replayed CUDA graph relies on);
- the norm's ``reduce_over`` and the row-parallel projection's ``reduce=False`` route a sum
  through the shard: the fused result where the peer path gives one, else sum then norm.

The collectives over real GPUs and CUDA graphs are tests/gpu/test_allreduce_gpu.py (``-m gpu``).
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from tandem.kernels.norm import rms_norm_reference
from tandem.kernels.one_shot_allreduce import all_reduce_reference, reduce_add_norm_reference
from tandem.parallel.allreduce import (NCCL, ONE_SHOT, TWO_SHOT, AllReduceLimits, choose_algorithm, fuses,
                                       peer_eligible)

KIB, MIB = 1 << 10, 1 << 20
LIMITS = AllReduceLimits(one_shot_max_bytes=64 * KIB, two_shot_max_bytes=4 * MIB, fused_max_bytes=32 * KIB)


@pytest.mark.parametrize("size,world_size,expected", [
    (8 * KIB, 2, ONE_SHOT), (64 * KIB, 2, ONE_SHOT), (64 * KIB + 16, 2, TWO_SHOT), (4 * MIB, 4, TWO_SHOT),
    (4 * MIB + 16, 2, NCCL), (64 * MIB, 2, NCCL),
    (128 * KIB, 3, NCCL),  # torch's two-shot kernel has no 3-rank build
    (8 * KIB, 16, NCCL),  # more ranks than one NVLink domain's peer kernels take
    (0, 2, NCCL)])
def test_choose_algorithm_by_size(size, world_size, expected):
    assert choose_algorithm(size, True, world_size, LIMITS) == expected
    assert choose_algorithm(size, False, world_size, LIMITS) == NCCL


def test_what_the_peer_kernels_take():
    assert peer_eligible(torch.zeros(4, 4096, dtype=torch.bfloat16))
    assert peer_eligible(torch.zeros(3, 64, dtype=torch.float32))
    assert not peer_eligible(torch.zeros(4, 4096, dtype=torch.float16))  # no fp16 two-shot
    assert not peer_eligible(torch.zeros(4, 4096, dtype=torch.bfloat16)[:, :100])  # not dense
    assert not peer_eligible(torch.zeros(3, dtype=torch.bfloat16))  # 6 bytes: not 16-byte vectors
    assert not peer_eligible(torch.zeros(40, dtype=torch.bfloat16)[4:])  # starts 8 bytes in
    assert fuses(32 * KIB, True, 2, LIMITS) and not fuses(32 * KIB + 16, True, 2, LIMITS)
    assert not fuses(8 * KIB, True, 2, AllReduceLimits(fused_max_bytes=0))


def test_peer_buffer_views_are_the_buffer_and_kept_per_shape():
    """A two-shot all-reduce stages its input in a view of the peer buffer: the buffer's first
    bytes in the input's dtype and shape, the same view again for the same shape (no slicing per
    call), a bounded number kept."""
    from tandem.parallel.allreduce import MAX_CACHED_VIEWS, PeerBuffers

    buffers = PeerBuffers.__new__(PeerBuffers)  # (no symmetric memory on a CPU: the buffer alone)
    buffers.tensor, buffers.views = torch.zeros(4096, dtype=torch.uint8), {}
    like = torch.ones(4, 8, dtype=torch.bfloat16)
    view = buffers.view(like)
    assert view.shape == like.shape and view.dtype == like.dtype and view.data_ptr() == buffers.tensor.data_ptr()
    view.copy_(like)
    assert torch.equal(buffers.tensor[:64].view(torch.bfloat16).view(4, 8), like)
    assert buffers.view(torch.empty(4, 8, dtype=torch.bfloat16)) is view
    assert buffers.view(torch.empty(2, 8, dtype=torch.bfloat16)) is not view
    assert buffers.view(torch.empty(4, 8, dtype=torch.float32)).dtype == torch.float32
    for rows in range(1, MAX_CACHED_VIEWS + 2):
        assert buffers.view(torch.empty(rows, 4, dtype=torch.float16)).shape == (rows, 4)
    assert len(buffers.views) <= MAX_CACHED_VIEWS


def test_limits_from_the_environment():
    assert AllReduceLimits.from_environment({}) == AllReduceLimits()
    assert AllReduceLimits.from_environment({}, world_size=8) == AllReduceLimits()
    assert AllReduceLimits.from_environment({}, world_size=4) == AllReduceLimits(
        one_shot_max_bytes=MIB, two_shot_max_bytes=16 * MIB, fused_max_bytes=512 * KIB)
    two_ranks = AllReduceLimits.from_environment({"TANDEM_ALLREDUCE_FUSED_MAX_BYTES": "65536"}, world_size=2)
    assert two_ranks == AllReduceLimits(one_shot_max_bytes=4 * MIB, two_shot_max_bytes=32 * MIB,
                                       fused_max_bytes=64 * KIB)
    limits = AllReduceLimits.from_environment({"TANDEM_ALLREDUCE_ONE_SHOT_MAX_BYTES": "0",
                                               "TANDEM_ALLREDUCE_TWO_SHOT_MAX_BYTES": "1048576",
                                               "TANDEM_ALLREDUCE_FUSED_MAX_BYTES": ""})
    assert limits == AllReduceLimits(one_shot_max_bytes=0, two_shot_max_bytes=MIB)
    assert choose_algorithm(8 * KIB, True, 2, limits) == TWO_SHOT
    assert limits.two_shot_bytes == MIB and limits.one_shot_bytes == AllReduceLimits().fused_max_bytes
    for value in ("512k", "-1"):
        with pytest.raises(ValueError, match="TANDEM_ALLREDUCE_TWO_SHOT_MAX_BYTES"):
            AllReduceLimits.from_environment({"TANDEM_ALLREDUCE_TWO_SHOT_MAX_BYTES": value})


def partials_of(world_size: int, shape, dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(world_size)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_reference_equals_the_unfused_ops(dtype):
    """All-reduce (the sum NCCL forms: on two ranks one rounding of a + b), then the residual
    add and RMSNorm as the decoder layer runs them (``RMSNorm(hidden, residual)``)."""
    partials = partials_of(2, (5, 40), dtype, seed=3)
    residual, weight = partials_of(1, (5, 40), dtype, seed=4)[0], torch.rand(40).to(dtype) + 0.5
    summed = partials[0] + partials[1]
    assert torch.equal(all_reduce_reference(partials), summed)
    expected = rms_norm_reference(summed, weight, 1e-6, residual=residual)
    actual = reduce_add_norm_reference(partials, residual, weight, 1e-6)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert torch.equal(actual[1], summed + residual)


# --- the Triton kernels through the interpreter, two ranks as two forked processes ----------

WORLD_SIZE = 2
ROWS, DIM = 3, 40  # DIM not a power of two: the column mask
PLAIN_NUMEL = 2500  # two chunks of the plain kernel's 2,048


SLOT_BYTES = PLAIN_NUMEL * 4


def _rank_main(rank: int, buffers, pads, inputs, outputs, between_calls) -> None:
    """One rank: two calls of each kernel, in float32 then in bf16 (the plain one); the pointers
    are this process's addresses of the shared buffers (each process maps them at its own). Its
    buffer and parity are read once every rank has finished the call and before any starts the
    next."""
    from tandem.kernels.one_shot_allreduce import (empty_peer_buffer, one_shot_all_reduce, one_shot_reduce_add_norm,
                                                   section_of)

    torch.set_num_threads(1)  # a forked child: no thread pool of the parent's to wait on
    buffer_pointers = torch.tensor([buffer.data_ptr() for buffer in buffers], dtype=torch.int64)
    signal_pointers = torch.tensor([pad.data_ptr() for pad in pads], dtype=torch.int64)
    peers = dict(buffer_pointers=buffer_pointers, signal_pointers=signal_pointers, rank=rank, world_size=WORLD_SIZE,
                 slot_bytes=SLOT_BYTES)
    empty = torch.zeros_like(buffers[rank])
    empty_peer_buffer(empty, SLOT_BYTES, WORLD_SIZE)
    for call in range(2):
        partial, residual, weight, plain = (tensor[call] for tensor in inputs[rank])
        out, new_residual = one_shot_reduce_add_norm(partial, residual, weight, 1e-6, **peers)
        outputs[rank][0][call].copy_(out)
        outputs[rank][1][call].copy_(new_residual)
        outputs[rank][2][call].copy_(one_shot_all_reduce(plain.clone(), **peers))
        outputs[rank][4][call].copy_(one_shot_all_reduce(plain[:BF16_NUMEL].to(torch.bfloat16), **peers).float())
        between_calls.wait()
        outputs[rank][3][call, 0] = float(torch.equal(buffers[rank], empty))
        outputs[rank][3][call, 1] = float(pads[rank][2 * section_of(torch.float32)])  # float32's parity
        outputs[rank][3][call, 2] = float(pads[rank][2 * section_of(torch.bfloat16)])  # bf16's parity
        between_calls.wait()


BF16_NUMEL = 1000


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs the kernels only without a GPU")
def test_one_shot_kernels_between_two_processes():
    from tandem.kernels.one_shot_allreduce import empty_peer_buffer, peer_buffer_bytes

    shared = lambda *shape: torch.zeros(*shape).share_memory_()  # noqa: E731
    buffers = [torch.zeros(peer_buffer_bytes(SLOT_BYTES, WORLD_SIZE), dtype=torch.uint8).share_memory_()
               for _ in range(WORLD_SIZE)]
    for buffer in buffers:
        empty_peer_buffer(buffer, SLOT_BYTES, WORLD_SIZE)
    pads = [torch.zeros(512, dtype=torch.int32).share_memory_() for _ in range(WORLD_SIZE)]
    generator = torch.Generator().manual_seed(11)
    weight = torch.rand(DIM, generator=generator) + 0.5
    residual = torch.randn(2, ROWS, DIM, generator=generator)
    inputs = [(torch.randn(2, ROWS, DIM, generator=generator), residual, weight.expand(2, DIM).contiguous(),
               torch.randn(2, PLAIN_NUMEL, generator=generator)) for _ in range(WORLD_SIZE)]
    for rank in range(WORLD_SIZE):  # negative zeros (the empty mark's bits) travel as zeros
        inputs[rank][0][:, 0, :5] = -0.0
        inputs[rank][3][:, :7] = -0.0
    outputs = [(shared(2, ROWS, DIM), shared(2, ROWS, DIM), shared(2, PLAIN_NUMEL), shared(2, 3),
                shared(2, BF16_NUMEL)) for _ in range(WORLD_SIZE)]
    context = multiprocessing.get_context("fork")
    between_calls = context.Barrier(WORLD_SIZE, timeout=120)
    ranks = [context.Process(target=_rank_main, args=(rank, buffers, pads, inputs, outputs, between_calls))
             for rank in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    stuck = [process.pid for process in ranks if process.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert not stuck and all(process.exitcode == 0 for process in ranks), "a rank failed or waited forever"
    for call in range(2):
        partials = [inputs[rank][0][call] for rank in range(WORLD_SIZE)]
        out, new_residual = reduce_add_norm_reference(partials, residual[call], weight, 1e-6)
        plain = all_reduce_reference([inputs[rank][3][call] for rank in range(WORLD_SIZE)])
        plain_bf16 = all_reduce_reference([inputs[rank][3][call, :BF16_NUMEL].to(torch.bfloat16)
                                           for rank in range(WORLD_SIZE)]).float()
        for rank in range(WORLD_SIZE):
            context_text = f"rank {rank} call {call}"
            torch.testing.assert_close(outputs[rank][0][call], out, rtol=1e-6, atol=1e-6, msg=context_text)
            torch.testing.assert_close(outputs[rank][1][call], new_residual, rtol=0, atol=0, msg=context_text)
            torch.testing.assert_close(outputs[rank][2][call], plain, rtol=0, atol=0, msg=context_text)
            # (the interpreter rounds float32 to bf16 toward zero, the GPU to nearest: within a step)
            torch.testing.assert_close(outputs[rank][4][call], plain_bf16, rtol=2 ** -7, atol=1e-6, msg=context_text)
            empty, float_parity, bf16_parity = outputs[rank][3][call].tolist()
            assert empty == 1.0, f"{context_text}: a slot was left holding data"
            # float32: two calls per round (parity back where it was); bf16: one (it alternates)
            assert (float_parity, bf16_parity) == (0.0, float((call + 1) % 2)), context_text


# --- the layers route a deferred sum through the shard ---------------------------------------

class SumWithPeer:
    """A stand-in tensor group of two ranks: the other rank's part is a fixed tensor."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other, self.calls = other, 0

    def allreduce(self, tensors):
        self.calls += 1
        tensors[0].add_(self.other)
        return self

    def wait(self) -> None:
        pass


class FusingPeer:
    """A stand-in peer path: fuses every message, summing with a fixed other part."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other, self.fused = other, 0

    def all_reduce(self, tensor):
        return None

    def reduce_add_norm(self, partial, residual, weight, eps):
        self.fused += 1
        return reduce_add_norm_reference([partial, self.other], residual, weight, eps)


def test_norm_sums_a_partial_over_the_shard():
    from tandem.layers.norm import RMSNorm
    from tandem.parallel.layers import RowParallelLinear
    from tandem.parallel.shard import TensorShard

    mine, other, residual = partials_of(3, (4, 32), torch.float32, seed=5)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = torch.rand(32) + 0.5
    expected = rms_norm_reference(mine + other, norm.weight, 1e-6, residual=residual)

    group = SumWithPeer(other)
    unfused = norm(mine.clone(), residual, reduce_over=TensorShard(0, 2, group))
    assert group.calls == 1 and all(torch.equal(a, e) for a, e in zip(unfused, expected))

    peer, group = FusingPeer(other), SumWithPeer(other)
    fused = norm(mine.clone(), residual, reduce_over=TensorShard(0, 2, group, peer))
    assert (peer.fused, group.calls) == (1, 0) and all(torch.equal(a, e) for a, e in zip(fused, expected))

    projection = RowParallelLinear(64, 32, bias=True, shard=TensorShard(0, 2, group))
    with pytest.raises(ValueError, match="bias"):
        projection(torch.zeros(1, 32), reduce=False)


def test_kernels_compile_for_h100_without_barriers():
    """Checked without a GPU (``tests/support/triton_aot.py``): both kernels compile for sm_90;
    no atomic reaches past this GPU (no barrier: the data is the signal; the parity's flip is a
    local atomic), the pulls are 16-byte volatile loads (never a line an earlier call left in
    this SM's cache) and the pushes 16-byte stores."""
    from tests.support.triton_aot import compile_request, ptx_for_h100

    pointers = {"buffer_pointers": "*i64", "signal_pointers": "*i64"}
    bits = dict(SECTION=0, MARK=-(1 << 15))
    requests = [
        compile_request(
            "tandem.kernels.one_shot_allreduce", "_reduce_add_norm_kernel",
            {"partial_ptr": "*i16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
             "new_residual_ptr": "*bf16", **pointers, "num_rows": "i32", "programs": "i32", "dim": "i32",
             "slot_elements": "i32", "eps": "fp32", "weight_offset": "fp32"},
            dict(RANK=1, WORLD_SIZE=2, CAST_BEFORE_WEIGHT=True, BLOCK=4096, **bits), warps=8, stages=1,
            unaligned=("num_rows", "programs")),
        compile_request(
            "tandem.kernels.one_shot_allreduce", "_all_reduce_kernel",
            {"input_ptr": "*i16", "out_ptr": "*bf16", **pointers, "num_vectors": "i32", "programs": "i32",
             "slot_elements": "i32"}, dict(RANK=0, WORLD_SIZE=2, VECTOR=8, BLOCK=2048, **bits),
            warps=8, stages=1, unaligned=("num_vectors", "programs"))]
    for ptx in ptx_for_h100(requests):
        atomics = [line.strip() for line in ptx.splitlines() if "atom." in line]
        assert atomics and not any(".sys." in line for line in atomics), atomics
        assert "ld.volatile.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
        assert "griddepcontrol" not in ptx


def test_benchmark_chooses_limits_from_graph_times():
    """``benchmarks/allreduce.py``'s choice: one-shot while it wins outright, then two-shot
    while it beats NCCL (torch's own one-shot is reported, never chosen), the fused kernel while
    it beats both unfused pairs."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "allreduce.py"
    spec = importlib.util.spec_from_file_location("allreduce_benchmark", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)

    def row(one_shot, torch_one_shot, two_shot, nccl):
        times = {"one-shot": one_shot, "torch 1-shot": torch_one_shot, "two-shot": two_shot, "nccl": nccl}
        return {name: {"eager": 2 * value, "graph": value} for name, value in times.items()}

    def fused(fused_time, one_shot_norm, nccl_norm):
        times = {"fused": fused_time, "one-shot + norm": one_shot_norm, "nccl + norm": nccl_norm}
        return {name: {"eager": value, "graph": value} for name, value in times.items()}

    table = {"sizes": {8 * KIB: row(3, 2, 5, 9), 16 * KIB: row(4, 4, 5, 9), 32 * KIB: row(7, 1, 5, 9),
                       64 * KIB: row(12, 1, 10, 14), 128 * KIB: row(30, 1, 20, 14), 256 * KIB: row(40, 1, 10, 30)},
             "fused": {1: fused(3, 5, 12), 2: fused(4, 5, 12), 4: fused(9, 5, 12)}}
    assert benchmark.choose_limits(table) == {"TANDEM_ALLREDUCE_ONE_SHOT_MAX_BYTES": 16 * KIB,
                                              "TANDEM_ALLREDUCE_TWO_SHOT_MAX_BYTES": 64 * KIB,
                                              "TANDEM_ALLREDUCE_FUSED_MAX_BYTES": 2 * 8 * KIB}


def test_the_flag_reaches_the_engine_config():
    from tandem.config import EngineConfig
    from tandem.entrypoints.cli import build_parser, engine_config

    arguments = build_parser().parse_args(["serve", "--tensor-parallel-size", "2", "--disable-custom-all-reduce"])
    assert engine_config(arguments, "model-dir").disable_custom_all_reduce
    assert not engine_config(build_parser().parse_args(["serve"]), "model-dir").disable_custom_all_reduce
    assert not EngineConfig(model="model-dir").disable_custom_all_reduce
