"""CUDA graphs under tensor parallelism, checked on a CPU (gloo): the graphs hold collectives,
so every rank must replay the same graph for each step. Without a GPU nothing is captured, but
with ``TANDEM_GRAPH_BUFFERS_ON_CPU=1`` every rank builds the graph runner's static buffers and
runs decode steps through them (the graph path's choices, copies and collectives; the forward
eager), rank 0's under the no-host-sync guard on the kernel paths. Also: a plan naming a graph
a worker lacks, or one the worker would not choose, fails with a clear error, and ranks that
disagree on the sizes to capture fail at start-up.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.parallel.graphs import capture_mixed_on_every_rank, same_on_every_rank
from tandem.parallel.group import join, open_store
from tandem.engine.ranks.plan import ForwardPlan, StepPlan
from tandem.worker.cuda_graphs import CudaGraphRunner
from tandem.worker.model_runner import STATIC_BUFFERS_ON_CPU
from tandem.worker.step_inputs import StepInputs
from tests.support.oracle import assert_matches
from tests.models.test_graph_safety import kernel_paths, no_host_sync
from tests.support.kernels import interpreter_scalar_loop_bounds  # noqa: F401  (autouse fixture)
from tests.models.test_tensor_parallel import ENGINE, GREEDY, MAX_TOKENS, SCENARIO_TOP_K, run_scenario

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_tp2_decode_steps_through_graph_buffers_on_every_rank(model_dirs, oracles, monkeypatch):
    """The TP scenario (mixed batches, prompt logprobs, a fork, a prefix hit; the overlapped
    loop: pending tokens broadcast into the static ids) with decode steps on the graph path:
    rank 0 names the graph in each plan and the worker replays its own (it raises if its choice
    differs), outputs equal transformers."""
    monkeypatch.setenv(STATIC_BUFFERS_ON_CPU, "1")
    # The worker's layers run on the CPU paths (rank 0's on the kernel paths, under the guard),
    # which read the per-chunk host lists a graph holds placeholders for (one token of context)
    # and write padding rows' slot -1: one page holds every sequence, and there is a graph per
    # batch size (no padding rows).
    llm = LLM(model=model_dirs["llama"], tensor_parallel_size=2, async_scheduling=True,
              cuda_graph_sizes=list(range(1, 9)), **dict(ENGINE, page_size=64))
    engine = llm.engine
    sent = []
    execute_step = engine.executor.execute_step

    def recording_execute_step(plan):
        sent.append((plan.inputs.num_decode == len(plan.inputs.chunks), plan.graph_size))
        return execute_step(plan)

    monkeypatch.setattr(engine.executor, "execute_step", recording_execute_step)
    runner = engine.runner
    forward = CudaGraphRunner._forward

    def guarded_forward(self, batch_size):
        with kernel_paths(runner), no_host_sync():
            return forward(self, batch_size)

    monkeypatch.setattr(CudaGraphRunner, "_forward", guarded_forward)
    graphs = runner.graphs  # (shutdown releases the runner's graphs)
    try:
        assert engine.executor.graph_sizes == list(range(1, 9)) == graphs.batch_sizes
        outputs, prompts = run_scenario(llm)
        engine.check_all_free()
        engine.check_health()  # the worker took every plan
    finally:
        engine.shutdown()
    # Decode steps of the first batch (3 sequences) and of the third prompt replay graphs; the
    # prefill and mixed steps run eagerly on every rank.
    assert {size for decode, size in sent if decode} == {3, 1}, sent
    assert all(size == 0 for decode, size in sent if not decode) and sum(not decode for decode, _ in sent) >= 3, sent
    assert graphs.num_replays == sum(1 for _, size in sent if size)
    assert runner.graphs is None  # released before the process group
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        reference = oracles["llama"].greedy(prompt, MAX_TOKENS)
        for index, sequence in enumerate(output.outputs):
            assert_matches(sequence, reference, top_k=SCENARIO_TOP_K[number],
                           context=f"TP=2 graph path prompt {number} sequence {index}")


def test_tp2_mixed_steps_through_mixed_graph_buffers_on_every_rank(model_dirs, oracles, monkeypatch):
    """The TP scenario's steps with a prompt chunk go through the mixed-step graphs' static
    buffers on every rank (the sizes agreed at start-up; the overlapped loop's pending tokens
    broadcast into the static ids before the first segment), the decode steps through the decode
    graphs': both ranks replay the same number of each, outputs equal transformers. With
    ``mixed_step_graphs=False`` every rank runs those steps eagerly."""
    monkeypatch.setenv(STATIC_BUFFERS_ON_CPU, "1")
    for mixed in (True, False):
        llm = LLM(model=model_dirs["llama"], tensor_parallel_size=2, async_scheduling=True,
                  cuda_graph_sizes=list(range(1, 9)), mixed_step_graph_sizes=(16, 32), mixed_step_graphs=mixed,
                  **dict(ENGINE, page_size=64))
        engine = llm.engine
        try:
            outputs, prompts = run_scenario(llm)
            replays = engine.executor.collective_rpc("graph_replays")
            engine.check_all_free()
            engine.check_health()
        finally:
            engine.shutdown()
        assert replays[0] == replays[1] and replays[0]["decode"] > 0, replays
        assert (replays[0]["mixed"] >= 3) if mixed else (replays[0]["mixed"] == 0), replays
        for number, (output, prompt) in enumerate(zip(outputs, prompts)):
            reference = oracles["llama"].greedy(prompt, MAX_TOKENS)
            for index, sequence in enumerate(output.outputs):
                assert_matches(sequence, reference, top_k=SCENARIO_TOP_K[number],
                               context=f"TP=2 mixed graphs {mixed} prompt {number} sequence {index}")


def test_enforce_eager_keeps_every_rank_eager(model_dirs, oracles, monkeypatch):
    monkeypatch.setenv(STATIC_BUFFERS_ON_CPU, "1")
    llm = LLM(model=model_dirs["llama"], tensor_parallel_size=2, enforce_eager=True, **ENGINE)
    sent = []
    execute_step = llm.engine.executor.execute_step
    monkeypatch.setattr(llm.engine.executor, "execute_step",
                        lambda plan: (sent.append(plan.graph_size), execute_step(plan))[1])
    prompt = list(range(3, 20))
    try:
        assert llm.engine.executor.graph_sizes == [] and llm.engine.runner.graphs is None
        output = llm.generate([prompt], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    assert sent and set(sent) == {0}, sent
    assert_matches(output.outputs[0], oracles["llama"].greedy(prompt, 3), context="TP=2 enforce_eager")


def decode_step(runner, rows: int) -> StepInputs:
    groups = runner.coordinator.num_groups
    return StepInputs([], rows, np.arange(5, 5 + rows), np.arange(10, 10 + rows), list(range(rows + 1)),
                      list(range(10, 10 + rows)), list(range(11, 11 + rows)),
                      [np.ones((rows, 1), dtype=np.int32)] * groups, [np.arange(rows)] * groups, list(range(rows)))


def through_plan(step: StepInputs, graph_size: int) -> ForwardPlan:
    """The step's forward plan as a worker receives it (msgpack both ways)."""
    import msgspec

    payload = msgspec.msgpack.encode(StepPlan.of_forward(ForwardPlan(step, [], True, graph_size), []))
    return msgspec.msgpack.Decoder(StepPlan).decode(payload).forward_plan()


def test_plan_naming_a_graph_the_worker_lacks_or_would_not_choose_fails(model_dirs):
    worker = LLM(model=model_dirs["llama"], **ENGINE).engine.worker
    runner = worker.runner
    plan = through_plan(decode_step(runner, 3), 4)
    step, size = plan.inputs, plan.graph_size
    assert size == 4 and plan.inputs_from_root
    with pytest.raises(RuntimeError, match="rank 0 replays its CUDA graph of 4 rows, but this rank has graphs of no rows"):
        worker.execute(plan)
    runner.graphs = CudaGraphRunner(runner, [1, 2], max_width=8)
    with pytest.raises(RuntimeError, match=r"graph of 4 rows, but this rank has graphs of \[1, 2\] rows"):
        worker.execute(plan)
    runner.graphs = CudaGraphRunner(runner, [2, 4, 8], max_width=8)
    assert runner.planned_graph_step(step, 4).num_tokens == 3
    with pytest.raises(RuntimeError, match="step of 3 tokens, but this rank would replay its graph of 4 rows"):
        runner.planned_graph_step(step, 8)
    prefill = StepInputs([], 0, step.input_ids, step.positions, [0, 3], [0], [3], step.page_tables,
                         step.slot_mappings, [2])
    with pytest.raises(RuntimeError, match="step of 3 tokens, but this rank would run it eagerly"):
        runner.planned_graph_step(prefill, 4)


def test_ranks_that_disagree_on_graph_sizes_fail_at_start_up():
    store, port = open_store(2)
    errors: list = [None, None]

    def rank(number: int, sizes: list[int]) -> None:
        groups = join(number, 2, torch.device("cpu"), store=store if number == 0 else None, port=port)
        same_on_every_rank(groups.control, [1, 2, 4], "agreed sizes")
        try:
            same_on_every_rank(groups.control, sizes, "the CUDA graph sizes to capture")
        except ValueError as error:
            errors[number] = str(error)

    threads = [threading.Thread(target=rank, args=(0, [1, 2, 4, 8])), threading.Thread(target=rank, args=(1, [1, 2, 4]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors[0] == "tensor_parallel_size: the ranks disagree on the CUDA graph sizes to capture (rank 0 has [1, 2, 4, 8])"
    assert errors[1] is not None and "rank 1 has [1, 2, 4]" in errors[1]


def test_tp2_speculation_with_host_loads_keeps_the_ranks_on_one_graph(model_dirs, monkeypatch):
    """A draft on rank 0 and host-tier loads: a load registers every layer of its groups, the
    draft's too, which only rank 0 ever reads. Both ranks must still choose alike between a graph
    and an eager pass (a graph waits for none of its layers' loads; it is refused while any of the
    layers it reads has one pending) and the worker must not keep the draft layers' loads forever.
    (Outputs are not compared here: without a GPU the static buffers' placeholder lists give each
    row one token of context; the eager CPU tests and the two-GPU test check them.)"""
    monkeypatch.setenv(STATIC_BUFFERS_ON_CPU, "1")
    llm = LLM(model=model_dirs["llama"], tensor_parallel_size=2, speculative_model=model_dirs["llama"],
              num_speculative_tokens=2, cuda_graph_sizes=list(range(1, 25)), host_cache_size=0.05,
              **dict(ENGINE, page_size=64))
    engine = llm.engine
    sent = []
    execute_step = engine.executor.execute_step

    def recording_execute_step(plan):
        sent.append(plan.graph_size)
        return execute_step(plan)

    monkeypatch.setattr(engine.executor, "execute_step", recording_execute_step)
    prompt = [(5 * i + 7) % 500 + 3 for i in range(70)]
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    try:
        first = llm.generate([prompt], params, use_tqdm=False)
        engine.tiers.drain()
        assert engine.reset_prefix_cache() > 0  # the host keeps the prompt's pages
        sent.clear()
        again = llm.generate([prompt, prompt[:40] + [9, 9, 9]], params, use_tqdm=False)
        assert engine.stats().tiers.host_hit_tokens >= 64
        engine.check_all_free()
        engine.check_health()  # the worker took every plan (it raises on a graph it would not choose)
    finally:
        engine.shutdown()
    assert any(sent), f"no verification step replayed a graph after the host loads: {sent}"
    assert sent[0] == 0, sent  # the step that loaded from the host ran eagerly on both ranks
    assert len(first[0].outputs[0].token_ids) == len(again[0].outputs[0].token_ids) == MAX_TOKENS


class _MixedCaptureRank:
    """A rank's runner as ``capture_mixed_on_every_rank`` drives it: ``MixedStepGraphs.capture``'s
    own loop over the sizes (largest first, the agreement after each) with each size's capture
    faked, failing at ``fails_at`` tokens; ``capture_mixed_graphs`` falls back to eager on any
    error, as ``ModelRunner``'s does."""

    def __init__(self, wants: bool, fails_at: int = 0) -> None:
        self.wants, self.fails_at, self.captured_sizes, self.agreements = wants, fails_at, [], 0
        self.device = torch.device("cpu")

    def wants_mixed_graphs(self, token_sizes):
        return self.wants

    def capture_mixed_graphs(self, token_sizes, agree=None):
        from tandem.worker.mixed_graphs import MixedStepGraphs

        graphs = MixedStepGraphs.__new__(MixedStepGraphs)
        graphs.token_sizes, graphs.sizes, graphs.runner = sorted(token_sizes), {}, self

        def capture_one(size):
            if size == self.fails_at:
                raise RuntimeError(f"operation not permitted when stream is capturing ({size} tokens)")
            self.captured_sizes.append(size)
            return SimpleNamespace(calls=[])

        def counting(ok):
            self.agreements += 1
            return agree(ok)

        graphs._capture = capture_one
        try:
            graphs.capture(counting)
        except RuntimeError:
            return []
        return graphs.token_sizes


@pytest.mark.parametrize("case", ["all capture", "rank 1 fails at 32 tokens", "rank 1 not opted in"])
def test_mixed_graph_capture_is_all_ranks_or_none(case, monkeypatch):
    """``capture_mixed_on_every_rank`` over two gloo ranks: every rank captures every size, or all
    stop at the size one rank failed (after the same agreements: none goes on to a warm-up pass the
    other will not join) and run eagerly; a rank not opted in keeps every rank from capturing."""
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    sizes = [8, 16, 32, 64]
    runners = [_MixedCaptureRank(True),
               _MixedCaptureRank(case != "rank 1 not opted in", fails_at=32 if "fails" in case else 0)]
    store, port = open_store(2)
    results: list = [None, None]

    def rank(number: int) -> None:
        groups = join(number, 2, torch.device("cpu"), store=store if number == 0 else None, port=port)
        results[number] = capture_mixed_on_every_rank(runners[number], groups, sizes)

    threads = [threading.Thread(target=rank, args=(number,)) for number in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    if case == "all capture":
        assert results == [sizes, sizes] and [runner.captured_sizes for runner in runners] == [[64, 32, 16, 8]] * 2
    elif "fails" in case:  # both stopped after 64 and the failed 32: two agreements each
        assert results == [[], []] and [runner.agreements for runner in runners] == [2, 2]
        assert [runner.captured_sizes for runner in runners] == [[64, 32], [64]]
    else:
        assert results == [[], []] and all(runner.captured_sizes == [] for runner in runners)
