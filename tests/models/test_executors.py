"""The executor interface on one rank (the multiprocess one is exercised by every TP=2 test,
its ``collective_rpc`` in tests/models/test_tensor_parallel.py): the in-process executor runs each
step on rank 0's worker, agrees with itself, answers the named rank calls here and refuses any
other name. Under TP=2, a failure of rank 0's worker inside a step the other rank started stops
that rank (the executor's job, not the model runner's)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.ranks.launcher import RankFailure
from tandem.engine.ranks.executor import RANK_CALLS, Executor, InProcessExecutor
from tandem.engine.ranks.launcher import MultiprocessExecutor
from tandem.kv.coordinator import StateCoordinator
from tandem.kv.planner import allocate_buffers, plan_pools
from tandem.kv.registry import StateRegistry
from tandem.kv.spec import FullAttentionSpec
from tests.models.test_tensor_parallel import ENGINE, GREEDY


def test_in_process_executor(model_dirs):
    assert issubclass(MultiprocessExecutor, Executor) and issubclass(InProcessExecutor, Executor)
    with pytest.raises(ValueError, match="tensor_parallel_size: the in-process executor runs 1 rank, not 2"):
        InProcessExecutor.start(EngineConfig(model=model_dirs["llama"], tensor_parallel_size=2), torch.device("cpu"))
    executor = InProcessExecutor.start(EngineConfig(model=model_dirs["llama"]), torch.device("cpu"))
    registry = StateRegistry()
    registry.register("attention", FullAttentionSpec(num_kv_heads=2, head_dim=4, dtype=torch.float32))
    registry.finalize()
    plan = executor.agree_on_pages(plan_pools(registry, 4, max_total_tokens=32, memory_budget_bytes=None))
    assert plan.num_pages == 9 and executor.agree_on_count(7) == 7
    allocate_buffers(registry, plan, torch.device("cpu"))
    coordinator = StateCoordinator(registry, plan, enable_prefix_caching=False, sanitize=True)
    with pytest.raises(RuntimeError, match="not attached"):
        executor.collective_rpc("pool_pages")
    executor.attach(coordinator, runner=None)
    assert executor.collective_rpc("pool_pages") == [[9]]
    # a page of 4 tokens holds a key and a value of 2 heads x 4 floats per token
    assert executor.collective_rpc("state_bytes") == [9 * 4 * 2 * 2 * 4 * 4]
    with pytest.raises(ValueError, match=r"collective_rpc: unknown rank call 'shutdown_host'"):
        executor.collective_rpc("shutdown_host")
    assert "shutdown_host" not in RANK_CALLS
    executor.attach_worker(SimpleNamespace(execute=lambda plan: ("ran", plan)))
    assert executor.execute_step("plan") == ("ran", "plan")  # rank 0's worker, in process
    executor.check()
    executor.close()


def test_rank_zero_forward_failure_stops_the_other_ranks(model_dirs):
    """Rank 0's worker raises in the second step, after the executor sent the plan: the worker
    process (waiting in that step's collectives) is stopped, the step's request ends with the
    error, and the engine reports the failed group from then on. The worker process started with
    its idle OpenMP threads asleep (its environment: it loads torch before anything could set it)."""
    llm = LLM(model=model_dirs["llama"], tensor_parallel_size=2, **ENGINE)
    engine, calls = llm.engine, []
    (worker,) = engine.executor.workers
    with open(f"/proc/{worker.pid}/environ", "rb") as environ:
        started_with = dict(entry.split(b"=", 1) for entry in environ.read().split(b"\0") if b"=" in entry)
    assert started_with[b"OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE").encode()
    run = engine.worker.runner.run

    def run_failing_the_second_step(*arguments, **keywords):
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return run(*arguments, **keywords)

    engine.worker.runner.run = run_failing_the_second_step
    try:
        (output,) = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
        assert output.outputs[0].finish_reason == "error", output.outputs[0]
        assert len(calls) == 2
        with pytest.raises(RankFailure, match=r"rank 0's forward pass failed \(RuntimeError: injected failure\)"):
            engine.check_health()
        assert all(process.poll() is not None for process in engine.executor.workers)
    finally:
        engine.shutdown()
