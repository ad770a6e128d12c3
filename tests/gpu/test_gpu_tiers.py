"""GPU checks of the state tiers (``pytest -m gpu``): every family on CUDA in float32 with a
pinned host tier — a host hit after the device cache was flushed, and swap preemption forced by
a small pool, with CUDA graphs where the family allows — against the oracle (logprobs within
1e-3: GPU reduction order differs); and a delayed per-layer restore on the device stream."""
from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tests.gpu.test_gpu import FAMILIES
from tests.models.test_tiers import make_llm
from tests.support.engines import GREEDY, check_outputs, prompts_for

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def gpu_tolerance(monkeypatch):
    import tests.support.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)


@pytest.mark.parametrize("layout", ["layer-major", "page-major"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_host_hit_and_swap(arch, layout, model_dirs, oracles):
    """Page-major: the page-copy kernel reads and writes strided device rows, a group's buffers
    in one copy where they continue on both sides."""
    llm = make_llm(model_dirs[arch], device="cuda", dtype="float32", max_total_tokens=384,
                   max_num_batched_tokens=128, max_num_seqs=8, host_cache_size=0.05, kv_cache_layout=layout)
    tiers = llm.engine.tiers
    assert tiers.local.host.arrays[0].is_pinned()
    shared = prompts_for(31, (9, 30), shared=70)
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = llm.generate(shared[:1], params)
    tiers.drain()
    llm.engine.reset_prefix_cache()
    second = llm.generate(shared[1:], params)
    assert llm.engine.stats().tiers.host_hit_tokens >= 64
    check_outputs(first + second, shared, 6, oracles[arch], f"{arch} cuda host hit")
    crowd = prompts_for(32, (150, 17, 64, 129, 3, 90, 40, 111))
    outputs = llm.generate(crowd, SamplingParams(max_tokens=20, **GREEDY))
    stats = llm.engine.stats().tiers
    assert stats.swaps["out"] > 0 and stats.swaps["in"] == stats.swaps["out"], stats.swaps
    check_outputs(outputs, crowd, 20, oracles[arch], f"{arch} cuda swap")
    assert llm.engine.tiers.local.mover.use_kernel  # the kernel addressed pinned host memory
    llm.engine.check_all_free()
