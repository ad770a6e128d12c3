"""The Ray executor (``distributed_executor_backend="ray"``) on a two-node Ray cluster of this
machine (``ray.cluster_utils.Cluster``: a head raylet and one more, one cluster for the module).

The head has one CPU and the other node two: rank 0's bundle is pinned to the driver's node (the
head) and takes its CPU, so rank 1's bundle lands on the other node under every strategy, and
the ranks form their group across nodes on the address Ray gives (not loopback). Scenarios:

- TP=2 across the nodes equals TP=1 and transformers for llama, deepseek_v32 and qwen3_next
  (``test_tensor_parallel.run_scenario``: a mixed batch with chunked prefill, prompt logprobs, a
  fork, a prefix hit), with the sanitizer on in every rank; close leaves no actor and no
  placement group;
- an actor killed mid-run ends the engine (no hang), and close still releases everything;
- ``tandem serve --distributed-executor-backend ray`` joins the cluster at RAY_ADDRESS, its
  actor's log reaches the server's, its completion equals transformers', and the server goes
  down when its actor's process dies.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from ray.util import placement_group_table  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.ranks.launcher import RankFailure  # noqa: E402
from tests.server_helpers import ServerProcess, process_alive  # noqa: E402
from tests.test_tensor_parallel import (ENGINE, GREEDY, MAX_TOKENS, check_collective_calls,  # noqa: E402
                                        check_scenario_outputs, run_scenario)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray")
NODE_MEMORY = dict(object_store_memory=80 * 2**20)


@pytest.fixture(scope="module")
def ray_cluster():
    """A head (the driver's node: rank 0's) with one CPU and a second node with two; this test
    process is the driver."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False, **NODE_MEMORY))
    try:
        cluster.add_node(num_cpus=2, **NODE_MEMORY)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=True)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def check_released(executor) -> None:
    """After close: the placement group removed, every actor dead, its process gone."""
    assert placement_group_table(executor.placement.group)["state"] == "REMOVED"
    for actor in executor.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.describe.remote(), timeout=30)
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in executor.worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in executor.worker_pids if process_alive(pid)], "actor processes left behind"


@pytest.mark.parametrize("arch,strategy", [("llama", "pack"), ("deepseek_v32", "pack"), ("qwen3_next", "spread")])
def test_tp2_across_nodes_equals_tp1_and_transformers(arch, strategy, ray_cluster, model_dirs, oracles):
    options = dict(ENGINE, indexer_cache_dtype="float32") if arch == "deepseek_v32" else ENGINE
    single_llm = LLM(model=model_dirs[arch], **options)
    single, _ = run_scenario(single_llm)
    llm = LLM(model=model_dirs[arch], ray_placement_strategy=strategy, **RAY, **options)
    executor = llm.engine.parallel
    try:
        places = executor.places
        assert places[0].node_id == ray.get_runtime_context().get_node_id()  # the engine core's node
        assert places[1].node_id != places[0].node_id, "the two ranks share a node"
        assert executor.placement.strategy == strategy.upper()
        assert executor.groups.store.host == places[0].address != "127.0.0.1"  # the address Ray gives
        assert executor.collective_rpc("sanitizer_on") == [True, True]
        check_collective_calls(single_llm.engine, llm.engine, replicated=arch == "deepseek_v32")
        outputs, prompts = run_scenario(llm)
        llm.engine.check_all_free()
    finally:
        llm.engine.shutdown()
    check_released(executor)
    assert ray.is_initialized()  # the executor left the cluster this process had joined alone
    check_scenario_outputs(outputs, prompts, single, oracles[arch], f"{arch} TP=2 on Ray ({strategy})")


def test_killed_actor_ends_the_engine(ray_cluster, model_dirs):
    """Rank 1's actor is killed between two steps of a running request: the engine fails (the
    request ends with an error or the step raises), every later step and health check raises
    ``RankFailure`` naming the rank, and close still releases the placement group."""
    llm = LLM(model=model_dirs["llama"], **RAY, **ENGINE)
    executor = llm.engine.parallel
    execute, steps = llm.engine.runner.execute, []

    def execute_after_the_third_step_kills(*arguments, **keywords):
        steps.append(len(steps))
        if len(steps) == 3:
            ray.kill(executor.actors[0])
            ray.wait(executor._runs, timeout=30)  # its run call ends with the actor
        return execute(*arguments, **keywords)

    llm.engine.runner.execute = execute_after_the_third_step_kills
    started = time.monotonic()
    try:
        try:
            outputs = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)
            assert outputs[0].outputs[0].finish_reason == "error", outputs[0].outputs[0]
        except RankFailure as failure:
            assert "rank 1" in str(failure)
        with pytest.raises(RankFailure, match="tensor_parallel_size: rank 1 .*died"):
            llm.engine.check_health()
        assert time.monotonic() - started < 30, "the engine took too long to notice the dead rank"
    finally:
        llm.engine.shutdown()
    check_released(executor)


def test_one_rank_starts_nothing_and_bad_options_are_named(model_dirs, monkeypatch):
    """With one rank the engine runs in process whichever backend is named (no cluster joined);
    a strategy without Ray, an unknown backend and Ray missing are errors naming the option."""
    llm = LLM(model=model_dirs["llama"], distributed_executor_backend="ray", **ENGINE)
    try:
        assert llm.engine.parallel is None
    finally:
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="ray_placement_strategy: places Ray actors: needs "
                                         "distributed_executor_backend 'ray'"):
        EngineConfig(model=model_dirs["llama"], tensor_parallel_size=2, ray_placement_strategy="spread")
    with pytest.raises(ValueError, match="distributed_executor_backend: must be one of"):
        EngineConfig(model=model_dirs["llama"], distributed_executor_backend="slurm")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "ray" else find_spec(name, *rest))
    with pytest.raises(ValueError, match=r"distributed_executor_backend: 'ray' needs the ray package: pip install "
                                         r"\"tandem\[ray\]\" \(or --distributed-executor-backend mp"):
        EngineConfig(model=model_dirs["llama"], **RAY)
    monkeypatch.undo()
    from tandem.engine.ranks.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # an import of ray fails
    with pytest.raises(ValueError, match="--distributed-executor-backend mp"):
        import_ray()


def test_server_on_ray_serves_and_ends_with_its_actor(ray_cluster, model_dirs, oracles, tmp_path):
    """``tandem serve`` joins the cluster at RAY_ADDRESS; the actor's log reaches the server's
    (Ray forwards it to the driver); its greedy completion equals transformers'; when the actor's
    process dies the server exits non-zero naming the rank, and its placement group is gone."""
    import httpx

    before = set(placement_group_table())
    server = ServerProcess(["--model", model_dirs["llama"], "--tensor-parallel-size", "2",
                            "--distributed-executor-backend", "ray", "--max-total-tokens", "512",
                            "--max-num-seqs", "4", "--log-level", "info"], tmp_path / "server.log",
                           environment={"RAY_ADDRESS": ray_cluster.address}).start(timeout=180)
    try:
        prompt = [5, 6, 7, 8, 9, 10, 11]
        answer = httpx.post(server.base_url + "/v1/completions", timeout=60,
                            json=dict(model=model_dirs["llama"], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      ignore_eos=True, return_token_ids=True)).json()
        assert "tensor-parallel rank 1 of 2 ready" in server.log()  # the actor's own log line
        (pid,) = re.findall(r"rank 1 on \S+ node \w+ pid (\d+)", server.log())
        started = time.monotonic()
        os.kill(int(pid), signal.SIGKILL)
        status = server.process.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        server.kill()
    log = server.log()
    assert status != 0, log
    assert "tensor_parallel_size: rank 1" in log
    assert took < 20, f"the server took {took:.1f} s to go down"
    assert answer["choices"][0]["token_ids"] == oracles["llama"].greedy(prompt, MAX_TOKENS).token_ids, answer
    placement_groups = placement_group_table()
    deadline = time.monotonic() + 30
    while any(placement_groups[key]["state"] != "REMOVED" for key in set(placement_groups) - before) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
        placement_groups = placement_group_table()
    added = set(placement_groups) - before
    assert len(added) == 1 and all(placement_groups[key]["state"] == "REMOVED" for key in added), placement_groups
