"""The Ray executor (``distributed_executor_backend="ray"``) on a two-node Ray cluster of this
machine (``ray.cluster_utils.Cluster``: a head raylet and one more, one cluster for the module).

The head has one CPU and the other node two: rank 0's bundle is pinned to the driver's node (the
head) and takes its CPU, so rank 1's bundle lands on the other node under every strategy, and
the ranks form their group across nodes on the address Ray gives (not loopback). Scenarios:

- TP=2 across the nodes equals TP=1 and transformers for llama, deepseek_v32 and qwen3_next
  (``test_tensor_parallel.run_scenario``: a mixed batch with chunked prefill, prompt logprobs, a
  fork, a prefix hit), with the sanitizer on in every rank; close leaves no actor and no
  placement group;
- an engine that joins the cluster itself (RAY_ADDRESS) gets its actor's log lines, and when
  the actor is killed mid-run the engine fails (no hang); close still removes the placement group
  and leaves the cluster;
- a rank whose build fails (its node lacks the model) fails the engine's start with its error;
- one rank starts nothing; bad options and a missing Ray are errors naming the option; the
  serve flags reach the config.

(A server's exit when its engine fails is the executors' common path: test_tensor_parallel.py's
``test_killed_rank_ends_the_server``.)
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import time
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from ray.util import placement_group_table  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.ranks.executor import InProcessExecutor  # noqa: E402
from tandem.engine.ranks.launcher import RankFailure  # noqa: E402
from tests.support.servers import process_alive  # noqa: E402
from tests.models.test_tensor_parallel import (ENGINE, GREEDY, check_collective_calls, check_scenario_outputs,  # noqa: E402
                                        run_scenario)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray")
NODE_MEMORY = dict(object_store_memory=80 * 2**20)


@pytest.fixture(scope="module")
def ray_cluster():
    """A head (the driver's node: rank 0's) with one CPU and a second node with two; this test
    process is the driver. Each node also declares two GPUs: Ray's accounting needs none
    (``test_gpu_bundles_leave_rank_zero_its_gpu``), and CPU bundles never ask for them."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, num_gpus=2, include_dashboard=False,
                                                                **NODE_MEMORY))
    try:
        cluster.add_node(num_cpus=2, num_gpus=2, **NODE_MEMORY)
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
    assert_processes_end(executor.worker_pids)


def assert_processes_end(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if process_alive(pid)], "actor processes left behind"


def test_one_rank_starts_nothing_and_bad_options_are_named(model_dirs, monkeypatch):
    """With one rank the engine runs in process whichever backend is named (no cluster joined);
    a strategy without Ray, an unknown backend, a GPU index Ray would overrule, a Ray client
    address and Ray missing are errors naming the option. The actors' environment carries the
    ranks' settings and no secret."""
    assert not ray.is_initialized()  # (this test runs before the module's cluster starts)
    llm = LLM(model=model_dirs["llama"], distributed_executor_backend="ray", **ENGINE)
    try:
        assert isinstance(llm.engine.executor, InProcessExecutor) and not ray.is_initialized()
    finally:
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="ray_placement_strategy: places Ray actors: needs "
                                         "distributed_executor_backend 'ray'"):
        EngineConfig(model=model_dirs["llama"], tensor_parallel_size=2, ray_placement_strategy="spread")
    with pytest.raises(ValueError, match="distributed_executor_backend: must be one of"):
        EngineConfig(model=model_dirs["llama"], distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="device: Ray assigns every rank's GPU"):
        EngineConfig(model=model_dirs["llama"], device="cuda:1", **RAY)
    from tandem.engine.ranks.ray_executor import forwarded_environment, import_ray, join_cluster

    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(ValueError, match="distributed_executor_backend: rank 0 runs in the engine process"):
        join_cluster(SimpleNamespace(is_initialized=lambda: False))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "ray" else find_spec(name, *rest))
    with pytest.raises(ValueError, match=r"distributed_executor_backend: 'ray' needs the ray package: pip install "
                                         r"\"tandem\[ray\]\" \(or --distributed-executor-backend mp"):
        EngineConfig(model=model_dirs["llama"], **RAY)
    monkeypatch.undo()
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TANDEM_PD_SECRET", "00" * 32)
    monkeypatch.setenv("TANDEM_API_KEY", "key")
    environment = forwarded_environment()  # what every actor gets: the ranks' settings, no secret
    assert environment["NCCL_NVLS_ENABLE"] == "0" and environment["TANDEM_SANITIZE"] == "1"
    assert "TANDEM_PD_SECRET" not in environment and "TANDEM_API_KEY" not in environment
    assert "CUDA_VISIBLE_DEVICES" not in environment and "PATH" not in environment
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of ray fails
    with pytest.raises(ValueError, match="--distributed-executor-backend mp"):
        import_ray()


@pytest.mark.parametrize("arch,strategy", [("llama", "pack"), ("deepseek_v32", "pack"), ("qwen3_next", "spread")])
def test_tp2_across_nodes_equals_tp1_and_transformers(arch, strategy, ray_cluster, model_dirs, oracles):
    options = dict(ENGINE, indexer_cache_dtype="float32") if arch == "deepseek_v32" else ENGINE
    single_llm = LLM(model=model_dirs[arch], **options)
    single, _ = run_scenario(single_llm)
    llm = LLM(model=model_dirs[arch], ray_placement_strategy=strategy, **RAY, **options)
    executor = llm.engine.executor
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


def test_gpu_bundles_leave_rank_zero_its_gpu(ray_cluster):
    """GPU placement, on the nodes' declared GPUs: bundle 0 is on the driver's node and its GPU
    (asked of a task in the bundle) is rank 0's; rank 1 takes the driver node's other GPU, rank
    2 one of the other node's; each actor sees its node's group GPUs and uses its own."""
    from tandem.engine.ranks.ray_executor import StartedOnCluster, _release, place_ranks
    from tandem.engine.ranks.ray_placement import local_gpu_index, rank_devices

    started = StartedOnCluster(owns_ray=False)
    try:
        places = place_ranks(ray, 3, "cuda", "pack", started)
    finally:
        _release(ray, started)
    driver = ray.get_runtime_context().get_node_id()
    assert [place.node_id == driver for place in places] == [True, True, False]
    assert all(len(place.gpu_ids) == 1 for place in places)
    assert places[0].gpu_ids != places[1].gpu_ids  # no actor on rank 0's GPU
    head = sorted(places[0].gpu_ids + places[1].gpu_ids)
    other = places[2].gpu_ids[0]
    assert rank_devices(places) == [(",".join(head), head.index(places[0].gpu_ids[0])),
                                    (",".join(head), head.index(places[1].gpu_ids[0])), (other, 0)]
    assert local_gpu_index(places[0].gpu_ids[0], None) == int(places[0].gpu_ids[0])
    assert local_gpu_index("3", "2,3") == 1
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=2 hides"):
        local_gpu_index("3", "2")
    assert placement_group_table(started.placement.group)["state"] == "REMOVED"
    assert_processes_end([place.pid for place in places[1:]])


def test_killed_actor_ends_the_engine(ray_cluster, model_dirs, monkeypatch, caplog, capfd):
    """The engine joins the cluster itself (RAY_ADDRESS; this process had left it) and its
    actor's log lines reach this process. Rank 1's actor is then killed between two steps of a
    running request: the engine fails (the request ends with an error, or the step raises), every
    later step and health check raises ``RankFailure`` naming the rank, and close still removes
    the placement group and leaves the cluster it joined."""
    caplog.set_level(logging.INFO)  # (the ranks log at the engine's level: their start-up lines)
    ray.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    try:
        llm = LLM(model=model_dirs["llama"], **RAY, **ENGINE)
        executor = llm.engine.executor
        assert executor.started.owns_ray and ray.is_initialized()
        try:
            check_killed_actor_fails(llm)
            assert_eventually_printed(capfd, "rank1 tandem.parallel: tensor-parallel rank 1 of 2 ready on cpu")
        finally:
            llm.engine.shutdown()
        assert not ray.is_initialized()  # it left the cluster it had joined
    finally:
        if not ray.is_initialized():
            ray.init(address=ray_cluster.address, include_dashboard=False, log_to_driver=True)
    assert placement_group_table(executor.placement.group)["state"] == "REMOVED"
    assert_processes_end(executor.worker_pids)


def test_a_rank_that_cannot_build_fails_the_start_naming_it(ray_cluster, model_dirs, monkeypatch):
    """Rank 1's node lacks the model directory: the engine's start fails at once (its own
    build's collectives break when the watcher ends the actor) with rank 1's own error, and the
    placement group is removed."""
    import tandem.engine.ranks.ray_executor as ray_executor
    from tests.support.ray_actors import MISSING_MODEL, RankWithoutTheModel

    monkeypatch.setattr(ray_executor, "TensorParallelRank", RankWithoutTheModel)
    before = set(placement_group_table())
    started = time.monotonic()
    with pytest.raises(RankFailure, match=f"tensor_parallel_size: rank 1 .* failed \\(ValueError: model: "
                                          f"'{MISSING_MODEL}' is not a model directory"):
        LLM(model=model_dirs["llama"], **RAY, **ENGINE)
    assert time.monotonic() - started < 60
    added = {key: group for key, group in placement_group_table().items() if key not in before}
    assert len(added) == 1 and all(group["state"] == "REMOVED" for group in added.values()), added


def check_killed_actor_fails(llm) -> None:
    executor = llm.engine.executor
    execute, steps = executor.execute_step, []

    def execute_after_the_third_step_kills(*arguments, **keywords):
        steps.append(len(steps))
        if len(steps) == 3:
            ray.kill(executor.actors[0])
            ray.wait(executor._runs, timeout=30)  # its run call ends with the actor
        return execute(*arguments, **keywords)

    executor.execute_step = execute_after_the_third_step_kills
    started = time.monotonic()
    try:
        outputs = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)
        assert outputs[0].outputs[0].finish_reason == "error", outputs[0].outputs[0]
    except RankFailure as failure:
        assert "rank 1" in str(failure)
    assert len(steps) == 3, "the engine went on stepping after the rank died"
    with pytest.raises(RankFailure, match="tensor_parallel_size: rank 1 .*died"):
        llm.engine.check_health()
    assert time.monotonic() - started < 30, "the engine took too long to notice the dead rank"


def assert_eventually_printed(capfd, text: str, timeout: float = 20.0) -> None:
    """``text`` reaches this process's output within ``timeout`` (Ray forwards actors' logs)."""
    printed, deadline = "", time.monotonic() + timeout
    while text not in printed and time.monotonic() < deadline:
        time.sleep(0.2)
        captured = capfd.readouterr()
        printed += captured.out + captured.err
    assert text in printed, printed[-3000:]


def test_serve_flags_choose_the_ray_executor():
    from tandem.entrypoints.cli import build_parser, engine_config

    arguments = build_parser().parse_args(["serve", "--model", "DIR", "--tensor-parallel-size", "2",
                                           "--distributed-executor-backend", "ray",
                                           "--ray-placement-strategy", "spread"])
    config = engine_config(arguments, "DIR")
    assert (config.distributed_executor_backend, config.ray_placement_strategy) == ("ray", "spread")
    default = engine_config(build_parser().parse_args(["serve", "--model", "DIR"]), "DIR")
    assert (default.distributed_executor_backend, default.ray_placement_strategy) == ("mp", "pack")
