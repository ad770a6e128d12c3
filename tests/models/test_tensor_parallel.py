"""Tensor parallelism on CPU (gloo over 127.0.0.1): TP=2 equals TP=1 and transformers for each
family it shards, bad sizes fail with an error naming tensor_parallel_size, and a dead rank
takes the server down (non-zero exit, no process left behind).

Each TP=2 engine runs one worker process; every scenario exercises the plan's parts: a mixed
batch with chunked prefill, prompt logprobs (their LM-head gathers), a fork (n=2: rank 0's page
copies replayed on the worker) and a prefix hit.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tests.support.oracle import assert_matches, assert_position
from tests.support.servers import ServerProcess, process_alive
from tandem.worker.rank_sampling import RankSampling
from tests.support.engines import GREEDY
from tests.support.state_checks import check_movers_touch_registry

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MAX_TOKENS = 5
SCENARIO_TOP_K = (5, 5, 1)  # the logprobs each of run_scenario's prompts reports (the last: its token's alone)
ENGINE = dict(page_size=16, max_total_tokens=512, max_num_batched_tokens=32, max_num_seqs=8)


def run_scenario(llm: LLM):
    """(outputs, prompts, n): a mixed batch (one prompt with prompt logprobs, one forked), then
    a prompt extending the first (a prefix hit) asking for no top logprob."""
    rng = random.Random(13)
    first, second = [rng.randrange(3, 500) for _ in range(40)], [rng.randrange(3, 500) for _ in range(11)]
    outputs = llm.generate([first, second], [SamplingParams(max_tokens=MAX_TOKENS, n=2, **GREEDY),
                                             SamplingParams(max_tokens=MAX_TOKENS, prompt_logprobs=3, **GREEDY)],
                           use_tqdm=False)
    third = first + [rng.randrange(3, 500) for _ in range(7)]
    # (its token's logprob alone: under tensor parallelism its steps gather no top candidates)
    outputs += llm.generate([third], SamplingParams(max_tokens=MAX_TOKENS, **dict(GREEDY, logprobs=0)), use_tqdm=False)
    return outputs, [first, second, third]


def check_shard_registry(single, sharded, replicated: bool) -> None:
    """Rank 0's registry lists the same buffers as one rank's, each holding its shard: fewer
    heads per page (KV heads, recurrent heads), or the same bytes where the state is replicated
    (MLA latents and the indexer)."""
    whole = {d.key: d.page_bytes for d in single.buffers()}
    shard = {d.key: d.page_bytes for d in sharded.buffers()}
    assert shard.keys() == whole.keys()
    if replicated:
        assert shard == whole
    else:
        assert all(shard[key] * 2 == whole[key] for key in whole), (shard, whole)


def check_collective_calls(single, sharded, replicated: bool) -> None:
    """The executors' ``collective_rpc``: every rank answers, in rank order; each rank's pools
    have the pages one rank alone has, and each holds its shard of the state's bytes (half, or
    all of a replicated state)."""
    from tandem.engine.ranks.executor import Executor, InProcessExecutor

    assert isinstance(sharded.executor, Executor) and sharded.executor.world_size == 2
    pages = [pool.num_pages for pool in sharded.coordinator.pools]
    assert sharded.executor.collective_rpc("pool_pages") == [pages, pages]
    local = InProcessExecutor(single.device)
    local.attach(single.coordinator, single.runner)
    assert local.collective_rpc("pool_pages") == [pages]  # the same pools (a fixed token count)
    (whole,) = local.collective_rpc("state_bytes")
    shards = sharded.executor.collective_rpc("state_bytes")
    assert shards == [whole if replicated else whole // 2] * 2, (shards, whole)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_next", "nemotron_h", "deepseek_v32", "qwen3_moe"])
def test_tp2_equals_tp1_and_transformers(arch, model_dirs, oracles, monkeypatch):
    options = dict(ENGINE, indexer_cache_dtype="float32") if arch == "deepseek_v32" else ENGINE
    if arch == "llama":  # the overlapped loop: rank 0 broadcasts tokens still pending on its device
        options = dict(options, async_scheduling=True)
    single_llm = LLM(model=model_dirs[arch], **options)
    single, _ = run_scenario(single_llm)
    llm = LLM(model=model_dirs[arch], tensor_parallel_size=2, **options)
    shard_choices = count_calls(monkeypatch, RankSampling, "greedy_from_choice")
    try:
        assert llm.engine.overlap == (arch == "llama")
        check_shard_registry(single_llm.engine.registry, llm.engine.registry, replicated=arch == "deepseek_v32")
        check_collective_calls(single_llm.engine, llm.engine, replicated=arch == "deepseek_v32")
        if arch == "llama":
            check_rank_roofline(single_llm.engine, llm.engine)
        outputs, prompts = run_scenario(llm)
        llm.engine.check_all_free()
    finally:
        llm.engine.shutdown()
    check_scenario_outputs(outputs, prompts, single, oracles[arch], f"{arch} TP=2")
    # every step samples greedy rows only: each chose per vocabulary shard (top logprobs or none)
    assert shard_choices[0] >= 2 * MAX_TOKENS, shard_choices


def count_calls(monkeypatch, owner, name: str) -> list[int]:
    """``[calls]`` of ``owner.name`` (a static method) from now on, counted in place."""
    calls, original = [0], getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(counted))
    return calls


def check_rank_roofline(single, sharded) -> None:
    """The benchmarks' rooflines (``benchmarks/common.py``'s ``ModelCost``) count one rank's work
    under tensor parallelism: its shard's weights, FLOPs, attention heads and K/V."""
    from benchmarks.common import ModelCost

    whole, shard = ModelCost.of_engine(single), ModelCost.of_engine(sharded)
    assert shard.attention_flops_per_pair == whole.attention_flops_per_pair / 2
    assert shard.state_bytes_per_token == whole.state_bytes_per_token / 2
    assert whole.weight_bytes / 2 < shard.weight_bytes < whole.weight_bytes  # (norms stay whole)
    assert whole.flops_per_token / 2 < shard.flops_per_token < whole.flops_per_token


def check_scenario_outputs(outputs, prompts, single, oracle, name: str) -> None:
    """``run_scenario``'s outputs of a sharded engine equal one rank's (``single``: greedy
    tokens, logprobs within 1e-4) and transformers' (tokens, top logprobs, prompt logprobs)."""
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        reference = oracle.greedy(prompt, MAX_TOKENS)
        assert len(output.outputs) == (2 if number == 0 else 1)
        for index, sequence in enumerate(output.outputs):
            context = f"{name} prompt {number} sequence {index}"
            assert_matches(sequence, reference, top_k=SCENARIO_TOP_K[number], context=context)
            single_sequence = single[number].outputs[index]
            assert list(sequence.token_ids) == list(single_sequence.token_ids), f"{context}: TP=1 differs"
            for entry, single_entry in zip(sequence.logprobs, single_sequence.logprobs):
                for token, logprob in entry.items():
                    assert abs(logprob.logprob - single_entry[token].logprob) <= 1e-4, context
    prompt_logprobs = oracle.prompt_logprobs(prompts[1])
    assert outputs[1].prompt_logprobs[0] is None
    for position in range(1, len(prompts[1])):
        assert_position(outputs[1].prompt_logprobs[position], prompt_logprobs[position - 1], 3,
                        f"{name} prompt position {position}")


TIER_ENGINE = dict(page_size=16, max_total_tokens=192, max_num_batched_tokens=64, max_num_seqs=16,
                   host_cache_size=0.05, preemption_mode="swap")
TIER_TOKENS = 20


def host_tier_scenario(llm: LLM):
    """(outputs, prompts) of a TP engine with a host tier (``TIER_ENGINE``): four prompts whose
    decodes outgrow the 12-page pool (swap preemption), then two again after a device flush
    (host hits)."""
    rng = random.Random(42)
    prompts = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(4)]
    params = SamplingParams(max_tokens=TIER_TOKENS, **GREEDY)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats().tiers
    assert stats.swaps["out"] > 0 and stats.swaps["in"] == stats.swaps["out"], stats.swaps
    llm.engine.tiers.drain()
    assert llm.engine.reset_prefix_cache() > 0  # the device copies go; the host keeps them
    outputs += llm.generate(prompts[1:3], params, use_tqdm=False)
    assert llm.engine.stats().tiers.host_hit_tokens > stats.host_hit_tokens
    assert outputs[-1].num_cached_tokens >= 32
    llm.engine.check_all_free()
    return outputs, prompts + prompts[1:3]


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_tp2_host_tier_and_swap(arch, model_dirs, oracles):
    """The host tier under TP=2: rank 0 keeps the books, every rank's tier worker applies each
    save and layer-wise load to its own host pages. Each rank holds half the heads, so a page the worker
    did not save or restore changes the outputs (or reads poison: the sanitizer fails the step)."""
    llm = LLM(model=model_dirs[arch], tensor_parallel_size=2, **TIER_ENGINE)
    try:
        outputs, prompts = host_tier_scenario(llm)
        check_movers_touch_registry(llm.engine)  # I1 on every rank: the movers their executors ran
    finally:
        llm.engine.shutdown()
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, TIER_TOKENS),
                       context=f"{arch} TP=2 host tier prompt {number}")


def store_files(directory) -> list:
    return sorted(path for path in directory.rglob("*") if path.is_file() and path.suffix != ".tmp")


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                reason="needs two CUDA devices")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=TWO_GPUS)])
def test_tp2_disk_tier_keeps_a_store_per_rank(device, model_dirs, oracles, tmp_path, monkeypatch):
    """Each rank writes its shard of a page to its own store; a fresh engine on the directory
    hits both (read off the engine loop on each rank). A page one rank's store lacks is a miss
    on every rank: the ranks agree on how far the chain goes, and the rest is computed."""
    import tests.support.oracle as oracle_module

    if device == "cuda":
        monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)  # GPU reduction order differs
    directory = tmp_path / "disk"
    options = dict(ENGINE, max_num_batched_tokens=64, disk_cache_dir=str(directory), device=device, dtype="float32")
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(50)]
    earlier = [shared + [rng.randrange(3, 500) for _ in range(9)]]
    later = [shared + [rng.randrange(3, 500) for _ in range(12)]]
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)

    keys = []  # the store keys of the shared tokens' pages, in chain order

    def run(prompts):
        llm = LLM(model=model_dirs["llama"], tensor_parallel_size=2, **options)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            keys[:] = [node.hash for node in llm.engine.coordinator.prefix_cache.match(shared, 3)]
            stats = llm.engine.stats().tiers
            llm.engine.check_all_free()
        finally:
            llm.engine.shutdown()  # queued store writes finish first, on every rank
        for number, (output, prompt) in enumerate(zip(outputs, prompts)):
            assert_matches(output.outputs[0], oracles["llama"].greedy(prompt, MAX_TOKENS),
                           context=f"TP=2 disk tier prompt {number}")
        return stats

    run(earlier)
    ranks = [directory / "tp2-rank0", directory / "tp2-rank1"]
    written = [store_files(rank) for rank in ranks]
    assert len(written[0]) == len(written[1]) >= 3, written  # the 3 full pages of the first prompt
    assert run(later).disk_hit_tokens == 48  # the shared 50 tokens' 3 full pages, on both ranks
    # the worker's store loses the chain's second page: only the first is a hit
    assert len(keys) == 3
    second = [path for path in written[1] if path.name.startswith(keys[1].hex())]
    assert len(second) == 1, (written[1], keys)
    second[0].unlink()
    assert run(later).disk_hit_tokens == 16


@pytest.fixture(scope="module")
def rejecting_draft(tmp_path_factory, tokenizer_dir):
    """A tiny random llama sharing the test models' tokenizer: its guesses are almost never right."""
    from tandem.tools.make_model import make_model

    return str(make_model("llama", tmp_path_factory.mktemp("rejecting_draft"), seed=5, hidden_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, intermediate_size=64, tokenizer_dir=tokenizer_dir))


@pytest.mark.parametrize("arch,draft", [("llama", "same"), ("qwen3_next", "rejecting")])
def test_tp2_speculative_decoding_with_a_draft_model(arch, draft, model_dirs, oracles, rejecting_draft):
    """A draft model under TP=2 runs on rank 0 alone; verification is a step like any other (the
    plan carries its rows), and rollbacks' page copies (a hybrid's recurrent slots) are replayed
    on the worker. An identical draft is always accepted; a random one almost never (rollback)."""
    draft_dir = model_dirs[arch] if draft == "same" else rejecting_draft
    llm = LLM(model=model_dirs[arch], tensor_parallel_size=2, speculative_model=draft_dir, num_speculative_tokens=3,
              **ENGINE)
    try:
        outputs, prompts = run_scenario(llm)
        stats = llm.engine.speculator.stats()
        llm.engine.check_all_free()
    finally:
        llm.engine.shutdown()
    assert stats.num_draft_tokens > 0
    if draft == "same":
        assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 2, stats
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        reference = oracles[arch].greedy(prompt, MAX_TOKENS)
        for index, sequence in enumerate(output.outputs):
            assert_matches(sequence, reference, top_k=SCENARIO_TOP_K[number],
                           context=f"{arch} TP=2 {draft} draft prompt {number} sequence {index}")


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_tp2_speculative_decoding_with_mtp(arch, model_dirs, oracles):
    """The checkpoint's MTP module under TP=2 is sharded as the target is (MLA heads, experts):
    every rank runs each draft pass (a DRAFT plan; rank 0 broadcasts the hidden inputs). Its
    proposals equal TP=1's at every point both made one, and the outputs equal transformers'."""
    from tests.support.speculation import differing_proposals, record_proposals

    options = dict(ENGINE, speculative_method="mtp", num_speculative_tokens=2,
                   **(dict(indexer_cache_dtype="float32") if arch == "deepseek_v32" else {}))
    runs = {}
    for size in (1, 2):
        llm = LLM(model=model_dirs[arch], tensor_parallel_size=size, **options)
        try:
            proposals = record_proposals(llm.engine)
            outputs, prompts = run_scenario(llm)
            stats = llm.engine.speculator.stats()
            llm.engine.check_all_free()
        finally:
            llm.engine.shutdown()
        runs[size] = outputs, proposals, stats
    outputs, proposals, stats = runs[2]
    expected = runs[1][1]
    assert stats.num_draft_tokens > 0 and len(set(proposals) & set(expected)) >= 0.8 * len(expected)
    assert not differing_proposals(proposals, expected), differing_proposals(proposals, expected)[:5]
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        reference = oracles[arch].greedy(prompt, MAX_TOKENS)
        for index, sequence in enumerate(output.outputs):
            assert_matches(sequence, reference, top_k=SCENARIO_TOP_K[number],
                           context=f"{arch} TP=2 MTP prompt {number} sequence {index}")


def test_bad_tensor_parallel_size_is_named(model_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size: must be an integer >= 1"):
        EngineConfig(model=model_dirs["llama"], tensor_parallel_size=0)
    # The tiny NemotronH has 4 Mamba-2 heads in 2 groups: a rank cannot hold half a group.
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 does not divide n_groups \(2\)"):
        LLM(model=model_dirs["nemotron_h"], tensor_parallel_size=4, **ENGINE)
    # The tiny llama has 4 query heads and 2 key/value heads.
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide num_attention_heads \(4\)"):
        LLM(model=model_dirs["llama"], tensor_parallel_size=3, **ENGINE)


def test_fewer_key_value_heads_than_ranks(model_dirs, oracles, tmp_path):
    """With more ranks than key/value heads each head is replicated on ``size // heads`` ranks
    (rank r holds head r // replicas, the one its query heads read): Qwen3-MoE's 2 key/value
    heads on 4 ranks equal transformers, each rank's pages holding one head. Ranks that are not a
    multiple of the heads are refused, naming num_key_value_heads."""
    from tandem.tools.make_model import make_model

    arch = "qwen3_moe"
    llm = LLM(model=model_dirs[arch], tensor_parallel_size=4, **ENGINE)
    try:
        heads = {d.tensor.shape[-2] for d in llm.engine.registry.buffers()}
        assert heads == {1}, heads
        outputs, prompts = run_scenario(llm)
        llm.engine.check_all_free()
    finally:
        llm.engine.shutdown()
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        for index, sequence in enumerate(output.outputs):
            assert_matches(sequence, oracles[arch].greedy(prompt, MAX_TOKENS), top_k=SCENARIO_TOP_K[number],
                           context=f"{arch} TP=4 prompt {number} sequence {index}")
    six_heads = make_model("llama", tmp_path / "six_heads", hidden_size=48, num_heads=6, num_kv_heads=2,
                           tokenizer_dir=model_dirs["llama"], weights=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide num_key_value_heads \(2\)"):
        LLM(model=str(six_heads), tensor_parallel_size=3, load_format="dummy", **ENGINE)


def test_pd_handshake_compares_tensor_parallel_size():
    from tandem.disagg.common import model_dimensions
    from tandem.transfer.messages import StateLayout, first_difference

    def layout(size: int) -> StateLayout:
        core = SimpleNamespace(model_info=SimpleNamespace(vocab_size=512, hidden_size=64), speculator=None,
                               registry=SimpleNamespace(groups=[]), config=SimpleNamespace(tensor_parallel_size=size))
        return StateLayout(architecture="LlamaForCausalLM", model=model_dimensions(core), page_size=16,
                           num_groups=0, buffers=[], metadata_row_bytes=0)

    assert first_difference(layout(2), layout(2)) is None
    assert first_difference(layout(1), layout(2), "the prefill server", "the decode server") == \
        "model.tensor_parallel_size: the prefill server has 1, the decode server has 2"


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        result = subprocess.run(["pgrep", "-P", str(frontier.pop())], capture_output=True, text=True)
        children = [int(child) for child in result.stdout.split()]
        found += children
        frontier += children
    return found


def is_worker(pid: int) -> bool:
    try:
        return b"tandem.engine.ranks.worker" in open(f"/proc/{pid}/cmdline", "rb").read()
    except FileNotFoundError:
        return False


def test_killed_rank_ends_the_server(model_dirs, tmp_path):
    server = ServerProcess(["--model", model_dirs["llama"], "--tensor-parallel-size", "2", "--max-total-tokens", "512",
                            "--max-num-seqs", "4"], tmp_path / "server.log").start()
    try:
        processes = descendants(server.process.pid)
        workers = [pid for pid in processes if is_worker(pid)]
        assert len(workers) == 1, f"one worker rank, got {workers} among {processes}"
        started = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        status = server.process.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        server.kill()
    assert status != 0, server.log()
    assert "tensor_parallel_size: rank 1" in server.log()
    # A few seconds on a quiet machine; beside another test worker on two cores it took 10.7 s.
    # A hang would reach the 30 s wait above.
    assert took < 20, f"the server took {took:.1f} s to go down"
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in processes if process_alive(pid)], "processes left behind"
