"""The peer all-reduce on two GPUs (``pytest -m gpu``; NVLink multicast off): every path equals
NCCL, eagerly and replayed from a CUDA graph, and a TP=2 engine on it equals TP=1.

The two ranks are spawned processes joining the groups as the engine's ranks do
(``parallel/group.py``: one store, gloo control, NCCL tensor group, the peer all-reduce). Each
rank runs the checks and reports failures through a queue; on two ranks the peer sums are one
rounding of ``a + b`` as NCCL's are, so they are compared bit for bit.

Latency against NCCL is ``benchmarks/allreduce.py``.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

KIB, MIB = 1 << 10, 1 << 20
HIDDEN = 4096  # Llama-3.1-8B's hidden size: a decode step's message is rows x 8 KiB in bf16
# (message bytes, algorithm under two ranks' default limits: one-shot to 4 MiB, two-shot to 32 MiB)
SIZES = [(8 * KIB, "one_shot"), (64 * KIB, "one_shot"), (512 * KIB, "one_shot"), (4 * MIB, "one_shot"),
         (6 * MIB, "two_shot"), (32 * MIB, "two_shot"), (48 * MIB, "nccl")]


def run_ranks(check, *args) -> None:
    """``check(shard, groups, device, *args)`` on two spawned ranks; fails with their errors."""
    context = torch.multiprocessing.get_context("spawn")
    ports, errors = context.Queue(), context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, ports, errors, check, args)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)
    alive = [process for process in ranks if process.is_alive()]
    for process in alive:
        process.kill()
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    assert not alive, f"a rank did not finish: {reports}"
    assert not reports and all(process.exitcode == 0 for process in ranks), "\n".join(reports)


def _rank(rank: int, ports, errors, check, args) -> None:
    from tandem.parallel.group import join, open_store

    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        if rank == 0:
            store, port = open_store(2)
            ports.put(port)
            groups = join(0, 2, device, store=store)
        else:
            groups = join(1, 2, device, port=ports.get(timeout=120))
        assert groups.peer is not None, "the peer all-reduce did not start"
        groups.shard.create_communicator(device)
        check(groups.shard, groups, device, *args)
        torch.cuda.synchronize(device)
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def nccl_sum(groups, tensor: torch.Tensor) -> torch.Tensor:
    expected = tensor.clone()
    groups.tensor.allreduce([expected]).wait()
    return expected


def random_on(device, shape, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=generator, device=device).to(dtype)


def _check_sizes(shard, groups, device) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for size, algorithm in SIZES:
            tensor = random_on(device, (size // dtype.itemsize,), dtype, seed=size + shard.rank)
            assert shard.peer.algorithm(tensor) == algorithm, (size, dtype)
            expected = nccl_sum(groups, tensor)
            actual = shard.all_reduce(tensor.clone())
            assert torch.equal(actual, expected), f"{algorithm} {size} bytes {dtype}"
    # Many calls back to back (no host sync between): a rank may run a call ahead; the regions alternate.
    tensors = [random_on(device, (rows, HIDDEN), torch.bfloat16, seed=rows * 7 + shard.rank) for rows in range(1, 65)]
    expected = [nccl_sum(groups, tensor) for tensor in tensors]
    actual = [shard.all_reduce(tensor.clone()) for tensor in tensors]
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    # fp16 and odd sizes go to NCCL.
    for tensor in (random_on(device, (4, HIDDEN), torch.float16, 1), random_on(device, (3,), torch.bfloat16, 2)):
        assert shard.peer.algorithm(tensor) == "nccl"
        assert torch.equal(shard.all_reduce(tensor.clone()), nccl_sum(groups, tensor))


def test_peer_all_reduce_equals_nccl():
    run_ranks(_check_sizes)


def unfused(groups, partial, residual, weight):
    from tandem.kernels.norm import rms_norm

    return rms_norm(nccl_sum(groups, partial), weight, 1e-5, residual=residual)


def _check_fused(shard, groups, device) -> None:
    weight = random_on(device, (HIDDEN,), torch.bfloat16, 5) * 0.1 + 1
    for rows in (1, 7, 64, 100, 300):  # 300 rows: 2.4 MiB, past the fused limit: sum, then add+norm
        partial = random_on(device, (rows, HIDDEN), torch.bfloat16, rows + shard.rank)
        residual = random_on(device, (rows, HIDDEN), torch.bfloat16, rows + 10)  # equal on both ranks
        fused = shard.reduce_add_norm(partial, residual, weight, 1e-5)
        assert (fused is None) == (rows == 300), rows
        if fused is None:
            continue
        out, new_residual = unfused(groups, partial, residual, weight)
        assert torch.equal(fused[1], new_residual), rows
        torch.testing.assert_close(fused[0], out, rtol=2 ** -7, atol=2 ** -7, msg=f"{rows} rows")


def test_fused_reduce_add_norm_equals_nccl_then_add_norm():
    run_ranks(_check_fused)


def _check_graph(shard, groups, device) -> None:
    """One graph holding a one-shot, a two-shot, an NCCL sum and a fused reduce+add+norm,
    replayed with new inputs each time (each call must leave the peer buffers as it found them)."""
    shapes = {"one_shot": (16, HIDDEN), "two_shot": (768, HIDDEN), "nccl": (6144, HIDDEN)}  # bf16: 128 KiB, 6, 48 MiB
    static = {name: torch.zeros(shape, dtype=torch.bfloat16, device=device) for name, shape in shapes.items()}
    partial = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device=device)
    residual = torch.zeros_like(partial)
    weight = random_on(device, (HIDDEN,), torch.bfloat16, 9) * 0.1 + 1
    assert [shard.peer.algorithm(static[name]) for name in shapes] == list(shapes)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up: compiles the kernels outside the capture
        for name in shapes:
            shard.all_reduce(static[name].clone())
        shard.reduce_add_norm(partial.clone(), residual, weight, 1e-5)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = {name: shard.all_reduce(tensor) for name, tensor in static.items()}
        fused = shard.reduce_add_norm(partial, residual, weight, 1e-5)
    for replay in range(5):
        inputs = {name: random_on(device, shape, torch.bfloat16, 100 * replay + shard.rank)
                  for name, shape in shapes.items()}
        new_partial = random_on(device, partial.shape, torch.bfloat16, 200 + replay + shard.rank)
        new_residual = random_on(device, partial.shape, torch.bfloat16, 300 + replay)
        for name, tensor in inputs.items():
            static[name].copy_(tensor)
        partial.copy_(new_partial)
        residual.copy_(new_residual)
        graph.replay()
        for name, tensor in inputs.items():
            assert torch.equal(results[name], nccl_sum(groups, tensor)), f"replay {replay} {name}"
        out, summed = unfused(groups, new_partial, new_residual, weight)
        assert torch.equal(fused[1], summed), f"replay {replay} fused residual"
        torch.testing.assert_close(fused[0], out, rtol=2 ** -7, atol=2 ** -7, msg=f"replay {replay} fused norm")


def test_peer_all_reduce_inside_a_cuda_graph():
    run_ranks(_check_graph)


def _engine_outputs(model: str, options: dict, prompts, max_tokens: int) -> dict:
    """One engine in this (fresh) process: its greedy tokens, top logprobs, decode replays and
    whether its ranks took the peer all-reduce (one symmetric-memory group per process:
    ``parallel/allreduce.py``, so every engine of the test runs in a process of its own)."""
    llm = LLM(model=model, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
        results = llm.generate(prompts, params, use_tqdm=False)
        graphs = llm.engine.runner.graphs
        llm.engine.check_all_free()
        return {"tokens": [list(result.outputs[0].token_ids) for result in results],
                "logprobs": [[{token: entry.logprob for token, entry in position.items()}
                              for position in result.outputs[0].logprobs] for result in results],
                "replays": graphs.num_replays if graphs is not None else 0,
                "peer": llm.engine.executor.shard.peer is not None}
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_tp2_engine_on_the_peer_path_equals_tp1(enforce_eager, model_dirs):
    """Llama (its layers leave the attention and MLP sums to the next norm: the fused kernel),
    float32: greedy tokens equal TP=1's and TP=2's on NCCL alone, logprobs within GPU reduction
    noise; decode steps replay graphs holding the peer kernels. Each engine runs in a spawned
    process of its own (a process makes one symmetric-memory group)."""
    from concurrent.futures import ProcessPoolExecutor

    prompts = [[5, 17, 301, 42, 9, 77, 12], list(range(3, 60)), [400, 2, 88]]
    options = dict(device="cuda", dtype="float32", page_size=16, max_total_tokens=1024, max_num_batched_tokens=128,
                   max_num_seqs=8, enforce_eager=enforce_eager)
    outputs = {}
    for name, extra in (("tp1", dict()), ("nccl", dict(tensor_parallel_size=2, disable_custom_all_reduce=True)),
                        ("peer", dict(tensor_parallel_size=2))):
        with ProcessPoolExecutor(1, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
            outputs[name] = pool.submit(_engine_outputs, model_dirs["llama"], {**options, **extra}, prompts,
                                        12).result(timeout=600)
        if name != "tp1":
            assert outputs[name]["peer"] == (name == "peer"), name
        if not enforce_eager:
            assert outputs[name]["replays"] >= 6, f"{name}: decode steps ran eagerly"
    for number in range(len(prompts)):
        tokens = {name: result["tokens"][number] for name, result in outputs.items()}
        assert tokens["peer"] == tokens["tp1"] == tokens["nccl"], (number, tokens)
        for entry, reference in zip(outputs["peer"]["logprobs"][number], outputs["tp1"]["logprobs"][number]):
            for token, logprob in entry.items():
                assert abs(logprob - reference[token]) <= 1e-3, number
