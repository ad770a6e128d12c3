"""Steps with a prompt chunk through the mixed-step graphs' static buffers (``worker/mixed_graphs.py``),
checked on a CPU: nothing is captured, but the forward runs over the padded static inputs with
every stateful layer called as a replay calls it (its arguments trimmed to the step's tokens, the
step's forward context, its output copied into a static tensor), the rest on the kernel paths
under the guard that fails on a host synchronisation (what a capture would refuse or bake in).
Outputs must equal the oracle on mixed batches, chunked prefill and a prefix hit."""
from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.worker.cuda_graphs import CudaGraphRunner
from tandem.worker.mixed_graphs import BoundaryCall, default_mixed_graph_sizes, mixed_graphs_apply
from tests.models.test_graph_safety import kernel_paths, no_host_sync
from tests.support.engines import GREEDY
from tests.support.kernels import interpreter_scalar_loop_bounds  # noqa: F401  (autouse fixture)
from tests.support.oracle import assert_matches

SIZES = [8, 16, 32]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_mixed_steps_through_the_static_buffers_are_exact(arch, model_dirs, oracles, monkeypatch):
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(24)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (45, 7, 20)] + [shared + [11, 12, 13]]
    lengths = [5, 12, 8, 6]
    llm = LLM(model=model_dirs[arch], page_size=8, max_total_tokens=512, max_num_seqs=4, max_num_batched_tokens=32,
              enable_prefix_caching=True)
    llm.generate([shared + [7]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)  # the prefix to hit
    runner = llm.engine.runner
    assert mixed_graphs_apply(runner.model)
    assert runner.capture_mixed_graphs(SIZES) == []  # nothing without decode graphs (eager everywhere)
    runner.graphs = CudaGraphRunner(runner, [2, 4], max_width=16)
    llm.engine.planner.graphs = runner.graph_choice()
    assert runner.capture_mixed_graphs(SIZES) == SIZES
    mixed = runner.mixed_graphs
    calls, replays = [], []
    run = BoundaryCall.run

    def unguarded_run(self, size, count, context):
        calls.append((size, count))
        with guard.suspended():
            return run(self, size, count, context)

    replay, forward = type(mixed).replay, type(runner.model).forward
    replaying = []

    def recording_replay(self, input_ids, positions, context, feed=None, broadcast_inputs=False):
        replays.append(len(input_ids))
        replaying.append(True)
        try:
            return replay(self, input_ids, positions, context, feed, broadcast_inputs)
        finally:
            replaying.pop()

    def guarded_forward(self, *args, **kwargs):  # the model's forward as a replay runs it: guarded
        if not replaying:
            return forward(self, *args, **kwargs)
        with kernel_paths(runner), guard:
            return forward(self, *args, **kwargs)

    decode_forward = CudaGraphRunner._forward

    def guarded_decode_forward(self, batch_size):  # (as test_graph_safety runs decode graphs)
        with kernel_paths(runner), no_host_sync():
            return decode_forward(self, batch_size)

    guard = Guard()
    monkeypatch.setattr(CudaGraphRunner, "_forward", guarded_decode_forward)
    monkeypatch.setattr(BoundaryCall, "run", unguarded_run)
    monkeypatch.setattr(type(mixed), "replay", recording_replay)
    monkeypatch.setattr(type(runner.model), "forward", guarded_forward)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths], use_tqdm=False)
    for number, (output, prompt, length) in enumerate(zip(outputs, prompts, lengths)):
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, length), context=f"{arch} prompt {number}")
    llm.engine.check_all_free()
    assert replays and mixed.num_replays == len(replays) and max(replays) <= 32
    assert any(count not in SIZES for count in replays)  # padded steps
    layers = sum(1 for module in runner.model.modules() if getattr(module, "mixed_graph_boundary", False))
    assert len(calls) == layers * len(replays)
    assert all(size == min(s for s in SIZES if s >= count) for size, count in calls)
    assert default_mixed_graph_sizes(2048)[-2:] == [896, 1024] and default_mixed_graph_sizes(150)[-2:] == [128, 150]
    assert default_mixed_graph_sizes(16384, tensor_parallel=True)[-3:] == [2048, 3072, 4096]
    assert default_mixed_graph_sizes(2048, tensor_parallel=True)[-3:] == [1024, 1536, 2048]


class Guard:
    """``no_host_sync`` that a stateful layer's eager call may step out of."""

    def __enter__(self):
        self.stack = no_host_sync()
        self.stack.__enter__()
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)

    def suspended(self):
        guard = self

        class Suspended:
            def __enter__(self):
                guard.stack.__exit__(None, None, None)

            def __exit__(self, *exc):
                guard.stack = no_host_sync()
                guard.stack.__enter__()

        return Suspended()


def test_models_with_other_stateful_layers_stay_eager(model_dirs):
    llm = LLM(model=model_dirs["qwen3_next"], page_size=8, max_total_tokens=512, max_num_seqs=4)
    runner = llm.engine.runner
    assert not mixed_graphs_apply(runner.model)
    runner.graphs = CudaGraphRunner(runner, [2], max_width=16)
    assert runner.capture_mixed_graphs(SIZES) == [] and runner.mixed_graphs is None
    torch.manual_seed(0)


def test_a_non_owning_view_reads_the_same_memory_and_does_not_hold_it():
    from tandem.worker.mixed_graphs import non_owning

    base = torch.arange(24, dtype=torch.float32)
    view = base[2:].view(2, 11)[:, 1:7]  # an offset, strided view
    borrowed = non_owning(view)
    assert borrowed.shape == view.shape and borrowed.stride() == view.stride()
    assert borrowed.data_ptr() == view.data_ptr() and torch.equal(borrowed, view)
    base[3] = -1.0  # the same memory: a write through the owner shows
    assert borrowed[0, 0].item() == -1.0
    handle = base.untyped_storage()._weak_ref()
    del base, view  # the owner's references gone: the memory is freed although the view still exists
    assert torch.UntypedStorage._expired(handle)
    torch.UntypedStorage._free_weak_ref(handle)
    owner = torch.arange(8.0)
    handle, kept = owner.untyped_storage()._weak_ref(), owner[1:]
    del owner  # (an ordinary view does keep it)
    assert not torch.UntypedStorage._expired(handle) and kept.sum().item() == 28.0
    torch.UntypedStorage._free_weak_ref(handle)
