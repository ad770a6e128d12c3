"""Decode steps as CUDA graphs replay them, checked on a CPU: the graph runner's forward over its
static buffers (padding rows included) with every layer on its kernel path (Triton interpreted),
run eagerly under a guard that fails on any host synchronisation or data-dependent shape (the
other steps run on the CPU paths). The outputs must still equal the oracle, so the static-buffer
path is exact as well as capturable.

A host synchronisation inside a captured forward is an error on a GPU (or silently bakes one
step's values into the graph); this guard finds it without one.
"""
from __future__ import annotations

import contextlib
import random
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem import LLM, SamplingParams
from tandem.layers.attention import TritonAttentionBackend
from tandem.layers.mla import MLAAttention, TritonMLABackend
from tandem.layers.moe import FusedExperts
from tandem.engine.ranks.build import _prepare_verification
from tandem.worker.cuda_graphs import CudaGraphRunner, model_is_graph_safe
from tests.support.oracle import assert_matches
from tests.support.speculation import differing_proposals, record_proposals
from tests.support.kernels import interpreter_scalar_loop_bounds  # noqa: F401  (autouse fixture)
from tests.support.engines import GREEDY


# Operators whose result the host must wait for, or whose output shape depends on tensor values.
SYNCING_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten._unique2", "aten.unique_dim",
               "aten.unique_consecutive", "aten.masked_select", "aten.bincount", "aten.is_nonzero",
               "aten.equal", "aten.lift_fresh", "aten.histc"}


class HostSyncError(AssertionError):
    pass


class _HostSyncGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        kwargs = kwargs or {}
        if name in SYNCING_OPS:
            raise HostSyncError(f"{func} in a graph-captured forward")
        if name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
                isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                for index in (args[1] if len(args) > 1 else ()) or ()):
            raise HostSyncError(f"{func} with a boolean mask (data-dependent shape) in a graph-captured forward")
        if name == "aten.repeat_interleave" and isinstance(args[0], torch.Tensor) and args[0].dim() and \
                kwargs.get("output_size") is None and len(args) == 1:
            raise HostSyncError(f"{func} without output_size in a graph-captured forward")
        return func(*args, **kwargs)


def _refuse(name):
    def refuse(*args, **kwargs):
        raise HostSyncError(f"Tensor.{name}() in a graph-captured forward")
    return refuse


@contextlib.contextmanager
def no_host_sync():
    """Fails on ``.item()``, ``.tolist()``, ``.numpy()``, ``bool(tensor)``, ``nonzero``,
    ``unique``, boolean-mask indexing and tensors made from host data."""
    with contextlib.ExitStack() as stack:
        for name in ("tolist", "numpy", "item"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, _refuse(name)))
        stack.enter_context(_HostSyncGuard())
        yield


def test_guard_catches_host_synchronisation():
    tensor = torch.arange(6)
    offenders = [lambda: tensor.tolist(), lambda: tensor[0].item(), lambda: bool(tensor.sum() > 3),
                 lambda: tensor[tensor > 2], lambda: torch.unique(tensor), lambda: torch.where(tensor > 2),
                 lambda: torch.tensor([1, 2]), lambda: tensor.repeat_interleave(tensor)]
    for offender in offenders:
        with pytest.raises(HostSyncError), no_host_sync():
            offender()
    with no_host_sync():  # shape-static tensor code passes
        torch.where(tensor > 2, tensor, -1).cumsum(0).index_select(0, tensor[:2])


@contextlib.contextmanager
def kernel_paths(runner, *extra_models):
    """Every layer (of the runner's model and of ``extra_models``) on its CUDA path (kernels
    interpreted on the CPU) for the duration."""
    switches = [(runner, "backend", TritonAttentionBackend())]
    for module in [module for model in (runner.model, *extra_models) for module in model.modules()]:
        if isinstance(module, MLAAttention):
            switches.append((module, "backend", TritonMLABackend()))
        if isinstance(module, FusedExperts):
            switches.append((module, "use_kernel", True))
        if getattr(module, "slots", None) is not None:
            switches.append((module.slots, "use_kernels", True))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in switches]
    for owner, name, value in switches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


# The MoE, MLA/DSA and recurrent families, and two dense ones (sliding window and softcap: gemma3).
FAMILIES = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "nemotron_h", "qwen3_moe", "llama",
            "gemma3"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_graph_decode_is_capturable_and_exact(arch, model_dirs, oracles, monkeypatch):
    """Three requests of staggered lengths in graph buckets of 2 and 4: padding rows, rows and
    page-table columns left stale by a finished request (the longest goes first), page
    boundaries crossed in decode (recurrent checkpoints)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (30, 6, 13)]
    lengths = [3, 9, 6]
    llm = LLM(model=model_dirs[arch], page_size=8, max_total_tokens=512, max_num_seqs=4,
              indexer_cache_dtype="float32", enable_prefix_caching=True)
    runner = llm.engine.runner
    assert model_is_graph_safe(runner.model)
    runner.graphs = CudaGraphRunner(runner, [2, 4], max_width=8)
    llm.engine.planner.graphs = runner.graph_choice()  # (what the worker says at start-up)
    replays = []
    forward = CudaGraphRunner._forward

    def guarded_forward(self, batch_size):
        replays.append(batch_size)
        with kernel_paths(runner), no_host_sync():
            return forward(self, batch_size)

    monkeypatch.setattr(CudaGraphRunner, "_forward", guarded_forward)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths], use_tqdm=False)
    assert 4 in replays and 2 in replays
    for output, prompt, length in zip(outputs, prompts, lengths):
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, length), context=arch)
    llm.engine.check_all_free()


# A draft model (llama, an identical draft: drafts are accepted, so catch-ups span several
# tokens) and an MTP layer (deepseek_v32: MLA latents and DSA indexer keys in the draft's state).
SPECULATION = {"llama": dict(num_speculative_tokens=3), "deepseek_v32": dict(speculative_method="mtp",
                                                                             num_speculative_tokens=2)}


@pytest.mark.parametrize("arch", sorted(SPECULATION))
def test_speculation_graphs_are_capturable_and_exact(arch, model_dirs, oracles, monkeypatch):
    """Speculative decoding's graph replays — verification (a known token and its drafts per
    sequence as single-token rows of the target's graphs) and the draft's passes (chain steps
    and catch-ups, in the draft's own graphs) — under the guard, on the kernel paths, exact."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (13, 6, 9)]
    lengths = [4, 8, 5]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in lengths]
    speculation = dict(SPECULATION[arch])
    mtp = "speculative_method" in speculation
    if not mtp:
        speculation["speculative_model"] = model_dirs[arch]
    options = dict(model=model_dirs[arch], page_size=8, max_total_tokens=512, max_num_seqs=4,
                   indexer_cache_dtype="float32", enable_prefix_caching=True, **speculation)
    if mtp:  # a random MTP layer's drafts are rejected: they must be those of an eager run
        eager = LLM(**options)
        expected = record_proposals(eager.engine)
        eager.generate(prompts, params, use_tqdm=False)
    llm = LLM(**options)
    engine = llm.engine
    proposals = record_proposals(engine)
    runner, speculator = engine.runner, engine.speculator
    runner.graphs = CudaGraphRunner(runner, [2, 4, 8, 16], max_width=8)
    # What the build does for an engine that has graphs: verification as single-token rows.
    _prepare_verification(runner, engine.coordinator, engine.registry, sorted(runner.graph_layers))
    engine.worker.capture_draft_graphs()
    engine.planner.graphs = runner.graph_choice()  # (what the worker says at start-up)
    network = speculator.network
    assert runner.verify_as_decode_rows and network.graphs is not None
    replays = {"target": [], "draft": []}
    forward = CudaGraphRunner._forward

    def guarded_forward(self, batch_size):
        replays["draft" if self.network is network else "target"].append(batch_size)
        with kernel_paths(runner, network.module), no_host_sync():
            return forward(self, batch_size)

    monkeypatch.setattr(CudaGraphRunner, "_forward", guarded_forward)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = engine.stats().speculation
    # Verifications of three sequences with drafts: more rows than sequences.
    assert max(replays["target"]) > 4 and replays["draft"], replays
    if mtp:
        assert len(proposals) > 10 and not differing_proposals(proposals, expected)
    else:  # an identical draft's are accepted: its catch-ups span several tokens
        assert stats.num_accepted_tokens >= stats.num_draft_tokens - 1, stats
        assert max(replays["draft"]) > 4, replays
    for output, prompt, length in zip(outputs, prompts, lengths):
        assert_matches(output.outputs[0], oracles[arch].greedy(prompt, length), context=f"{arch} speculating")
    engine.check_all_free()
