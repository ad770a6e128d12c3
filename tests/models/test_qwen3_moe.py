"""Qwen3-MoE (Qwen3 attention, softmax-routed experts) against transformers (fp32, CPU): greedy
tokens equal and top-5 logprobs within 1e-4 with chunked prefill, preemption by recompute,
prefix hits and several page sizes; the sparse-layer options (``norm_topk_prob`` false,
``decoder_sparse_step``, ``mlp_only_layers``) on a second model; the MoE block against
transformers' with and without renormalised weights, through the per-expert loop and the fused
kernel; invariant I1; and the made model's greedy choices (no near-ties, transformers' cached
and uncached paths agree).

Also here: preemption by swap and host-tier hits. PD, tier hits and the tier mover (I1),
speculation with a draft model, TP=2 and CUDA-graph safety run qwen3_moe in their own files'
parametrizations (``ARCH_OPTIONS`` and the family lists there).
"""
from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.layers.moe import FusedExperts, SoftmaxMoE, load_with_experts
from tests.support.engines import GREEDY, check_outputs, make_llm, random_prompt
from tests.support.oracle import LOGPROB_TOLERANCE, Oracle, assert_matches
from tests.support.state_checks import check_movers_touch_registry

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ARCH = "qwen3_moe"
MAX_TOKENS = 12


def workload() -> tuple[list[list[int]], list[list[int]]]:
    """A first batch of 1..300 tokens (two sharing a 64-token prefix), then two prompts that
    extend the shared prefix (prefix hits)."""
    rng = random.Random(21)
    shared = random_prompt(rng, 64)
    first = [random_prompt(rng, 1), shared + random_prompt(rng, 30), random_prompt(rng, 17),
             random_prompt(rng, 300), shared + random_prompt(rng, 120)]
    return first, [shared + random_prompt(rng, 9), shared + random_prompt(rng, 77)]


FIRST, SECOND = workload()


def run_and_check(model_dir: str, oracle, context: str, **options) -> LLM:
    """Both batches through one engine, every output against ``oracle``; the engine's pages are
    all free afterwards. Returns the engine (for its stats)."""
    llm = make_llm(model_dir, **options)
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    outputs = llm.generate(FIRST, params, use_tqdm=False) + llm.generate(SECOND, params, use_tqdm=False)
    check_outputs(outputs, FIRST + SECOND, MAX_TOKENS, oracle, context)
    assert all(output.num_cached_tokens >= 64 for output in outputs[len(FIRST):]), \
        [output.num_cached_tokens for output in outputs]
    llm.engine.check_all_free()
    return llm


# -- against transformers ------------------------------------------------------------------------

def test_chunked_prefill_preemption_and_prefix_hits(model_dirs, oracles):
    # 384 tokens of pool for 5 prompts of 1..300 tokens plus 12 new each, 32-token chunks:
    # preemption (recompute) is forced while prompts are still being chunked.
    llm = run_and_check(model_dirs[ARCH], oracles[ARCH], "chunked, preempted", max_total_tokens=384,
                        max_num_batched_tokens=32)
    assert llm.engine.stats().num_preemptions > 0


def test_swap_preemption_and_host_hits(model_dirs, oracles):
    """Preemption by swap (every page to the host tier and back), then host hits after the
    device cache is flushed."""
    llm = run_and_check(model_dirs[ARCH], oracles[ARCH], "swapped", max_total_tokens=384, max_num_batched_tokens=64,
                        preemption_mode="swap", host_cache_size=0.05)
    tiers = llm.engine.stats().tiers
    assert tiers.swaps["out"] > 0 and tiers.swaps["in"] == tiers.swaps["out"], tiers.swaps
    llm.engine.tiers.drain()
    llm.engine.reset_prefix_cache()  # the device copies (those the small pool kept) go; the host keeps them
    (again,) = llm.generate(SECOND[:1], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    assert llm.engine.stats().tiers.host_hit_tokens > tiers.host_hit_tokens and again.num_cached_tokens >= 64
    assert_matches(again.outputs[0], oracles[ARCH].greedy(SECOND[0], MAX_TOKENS), context="host hit")
    llm.engine.check_all_free()


@pytest.mark.parametrize("page_size", [1, 64])
def test_page_sizes(page_size, model_dirs, oracles):
    run_and_check(model_dirs[ARCH], oracles[ARCH], f"page {page_size}", page_size=page_size,
                  max_num_batched_tokens=96)


@pytest.fixture(scope="module")
def sparse_options_model(model_dirs, tmp_path_factory):
    """The test model's shape with the other settings of each sparse-layer option: weights not
    renormalised, every second layer sparse (``decoder_sparse_step`` 2: layer 1 of 0..2), no
    ``mlp_only_layers``. Fresh weights (the layers' kinds differ), drawn as make-model draws them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.tools.made_weights import initialise_weights

    directory = tmp_path_factory.mktemp("qwen3_moe_sparse_options")
    shutil.copytree(model_dirs[ARCH], directory, dirs_exist_ok=True)
    config = AutoConfig.from_pretrained(directory)
    config.norm_topk_prob, config.decoder_sparse_step, config.mlp_only_layers = False, 2, []
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    initialise_weights(model, torch.Generator().manual_seed(3), init_std=None, norm_center=1.0)
    model.save_pretrained(directory)
    assert not json.loads((directory / "config.json").read_text())["norm_topk_prob"]
    return str(directory)


def sparse_layers(llm: LLM) -> list[int]:
    return [index for index, layer in enumerate(llm.engine.model.model.layers) if isinstance(layer.mlp, SoftmaxMoE)]


def test_sparse_layer_options_match_transformers(model_dirs, oracles, sparse_options_model):
    """Both models: tandem's sparse layers are transformers' (``Qwen3MoeSparseMoeBlock``), and
    the second model's outputs equal transformers' (chunked prefill, preemption, prefix hits)."""
    oracle = Oracle(sparse_options_model)
    llm = run_and_check(sparse_options_model, oracle, "sparse options", max_total_tokens=384,
                        max_num_batched_tokens=32)
    assert llm.engine.stats().num_preemptions > 0
    default = LLM(model=model_dirs[ARCH], page_size=16, max_total_tokens=256)
    for engine, reference in ((llm, oracle), (default, oracles[ARCH])):
        expected = [index for index, layer in enumerate(reference.model.model.layers)
                    if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"]
        assert sparse_layers(engine) == expected
    assert sparse_layers(llm) == [1] and sparse_layers(default) == [0, 2]


def test_yarn_rope_matches_transformers(model_dirs, tmp_path):
    """YaRN as Qwen3-MoE model cards extend the context (factor 4 over the original length):
    blended rotary frequencies and cos/sin scaled by the attention factor."""
    directory = tmp_path / "yarn"
    shutil.copytree(model_dirs[ARCH], directory)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": config["max_position_embeddings"] // 4}
    (directory / "config.json").write_text(json.dumps(config))
    oracle = Oracle(str(directory))
    assert oracle.model.model.rotary_emb.attention_scaling > 1.1
    llm = LLM(model=str(directory), page_size=16, max_total_tokens=1024, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    outputs = llm.generate(FIRST[2:4], params, use_tqdm=False)
    for number, (output, prompt) in enumerate(zip(outputs, FIRST[2:4])):
        assert_matches(output.outputs[0], oracle.greedy(prompt, MAX_TOKENS), context=f"yarn prompt {number}")
    llm.engine.check_all_free()


def test_made_model_greedy_choices_do_not_tie(model_dirs, oracles):
    """Greedy rollouts of transformers' cached path (``generate``) equal its uncached forward
    pass over the whole sequence, and the best two logprobs are never near a tie."""
    oracle = oracles[ARCH]
    gaps = []
    for prompt in FIRST:
        reference = oracle.greedy(prompt, MAX_TOKENS)
        with torch.inference_mode():
            logits = oracle.model(torch.tensor([prompt + reference.token_ids])).logits[0].float()
        uncached = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
        assert uncached.argmax(-1).tolist() == reference.token_ids
        assert (uncached - torch.stack(reference.logprobs)).abs().max().item() <= LOGPROB_TOLERANCE
        gaps += [(top[0] - top[1]).item() for top in uncached.topk(2, dim=-1).values]
    assert min(gaps) > 100 * LOGPROB_TOLERANCE, min(gaps)
    assert len({token for prompt in FIRST for token in oracle.greedy(prompt, MAX_TOKENS).token_ids}) >= 20


# -- the MoE block ---------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_matches_transformers(norm_topk_prob):
    """``SoftmaxMoE`` loaded from per-expert checkpoint names against transformers'
    ``Qwen3MoeSparseMoeBlock``: the per-expert loop, and the fused kernel (Triton's interpreter
    on a CPU)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    reference = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for tensor in reference.state_dict().values():
            tensor.copy_(torch.randn_like(tensor) / math.sqrt(tensor.shape[-1]))
    size = config.moe_intermediate_size
    checkpoint = [("gate.weight", reference.gate.weight)]
    for expert in range(config.num_experts):
        checkpoint += [(f"experts.{expert}.gate_proj.weight", reference.experts.gate_up_proj[expert, :size]),
                       (f"experts.{expert}.up_proj.weight", reference.experts.gate_up_proj[expert, size:]),
                       (f"experts.{expert}.down_proj.weight", reference.experts.down_proj[expert])]
    ours = SoftmaxMoE(config)
    load_with_experts(ours, checkpoint)
    hidden = torch.randn(24, 64)
    with torch.no_grad():
        expected = reference(hidden[None])[0]
        weights, _ = ours.gate(hidden)
        sums = weights.sum(-1)
        assert torch.allclose(sums, torch.ones_like(sums)) == norm_topk_prob
        torch.testing.assert_close(ours(hidden), expected, rtol=1e-5, atol=1e-5)
        ours.experts.use_kernel = True
        torch.testing.assert_close(ours(hidden), expected, rtol=1e-5, atol=1e-5)


def test_bad_configs_are_refused_naming_the_field(model_dirs, tmp_path):
    for field, value in (("hidden_act", "gelu"), ("num_experts_per_tok", 9)):
        directory = tmp_path / field
        shutil.copytree(model_dirs[ARCH], directory)
        config = json.loads((directory / "config.json").read_text())
        config[field] = value
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=field):
            LLM(model=str(directory), page_size=16, max_total_tokens=256)


# -- invariant I1 --------------------------------------------------------------------------------

def test_movers_touch_exactly_the_registry_buffers(model_dirs):
    llm = LLM(model=model_dirs[ARCH], page_size=8, max_total_tokens=512, host_cache_size=0.01)
    engine = llm.engine
    assert len({d.key for d in engine.registry.buffers()}) == 2 * engine.hf_config.num_hidden_layers  # K and V
    assert sum(isinstance(module, FusedExperts) for module in engine.model.modules()) == 2
    check_movers_touch_registry(engine, require_nonzero=True)
