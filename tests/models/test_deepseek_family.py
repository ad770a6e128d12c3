"""DeepSeek-V3 (MLA + MoE), DeepSeek-V3.2 and GLM-5 (+ DSA sparse attention) against
transformers (fp32, CPU, unquantised indexer): greedy tokens equal and top-5 logprobs within
1e-4 in the engine-core scenarios; the FP8 indexer against the unquantised one; invariant I1
for each family; MoE routing, the FP8 page-major layout, MTP weights and dummy loading.

Prompts run up to 300 tokens against ``index_topk`` 16, so sparsity is live for most queries.
"""
from __future__ import annotations

import json
import math
import random
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.support.state_checks import HOST_TIER, check_movers_touch_registry
from tandem import LLM, SamplingParams
from tandem.kv.spec import IndexerSpec
from tandem.layers.sparse_indexer import (FP8_DTYPE, Fp8PageMajorIndexKeys, LightningIndexer,
                                          index_scores)
from tests.support.engines import GREEDY, check_outputs, make_llm, random_prompt
from tests.support.oracle import assert_matches

pytestmark = pytest.mark.usefixtures("single_torch_thread")

FAMILY = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
SPARSE = ("deepseek_v32", "glm_moe_dsa")
INDEX_TOPK = 16  # make_model's DSA configs
MAX_TOKENS = 10
# (MLA layers, layers with an indexer): GLM-5's middle layer reuses layer 0's top-k.
STATEFUL_LAYERS = {"deepseek_v3": (2, 0), "deepseek_v32": (2, 2), "glm_moe_dsa": (3, 2)}


def family_prompts() -> list[list[int]]:
    """1 and 12 tokens (dense: context <= index_topk), then 94, 184 and 300 tokens sharing a
    64-token prefix (prefix hits at page sizes 1, 16 and 64)."""
    rng = random.Random(11)
    shared = random_prompt(rng, 64)
    return [random_prompt(rng, 1), random_prompt(rng, 12)] + [shared + random_prompt(rng, n) for n in (30, 120, 236)]


PROMPTS = family_prompts()


# -- against transformers ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", FAMILY)
def test_mixed_batch_with_preemption(arch, model_dirs, oracles):
    # 400 tokens of pool for prompts of 1..300 tokens plus 10 new each (641 in all): preemption.
    llm = make_llm(model_dirs[arch], max_total_tokens=400, max_num_batched_tokens=128)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    check_outputs(outputs, PROMPTS, MAX_TOKENS, oracles[arch], arch)
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", FAMILY)
def test_chunked_prefill(arch, model_dirs, oracles):
    llm = make_llm(model_dirs[arch], max_num_batched_tokens=32)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    check_outputs(outputs, PROMPTS, MAX_TOKENS, oracles[arch], f"{arch} chunked")
    llm.engine.check_all_free()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("arch", FAMILY)
def test_page_sizes_and_prefix_hits(arch, page_size, model_dirs, oracles):
    llm = make_llm(model_dirs[arch], page_size=page_size, max_num_batched_tokens=96)
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    first = llm.generate(PROMPTS[2:3], params, use_tqdm=False)
    rest = llm.generate(PROMPTS[:2] + PROMPTS[3:], params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert [output.num_cached_tokens >= 64 for output in rest] == [False, False, True, True], \
        [output.num_cached_tokens for output in rest]
    check_outputs(first + rest, PROMPTS[2:3] + PROMPTS[:2] + PROMPTS[3:], MAX_TOKENS, oracles[arch], f"{arch} page {page_size}")
    llm.engine.check_all_free()


def test_yarn_rope_matches_transformers(model_dirs, tmp_path):
    """Released DeepSeek checkpoints use YaRN: scaled rotary frequencies, the cos/sin attention
    factor, and the softmax scale times mscale(factor, mscale_all_dim)^2."""
    from tests.support.oracle import Oracle

    model_dir = tmp_path / "yarn"
    shutil.copytree(model_dirs["deepseek_v32"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": config["max_position_embeddings"] // 4,
                                 "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    prompt = PROMPTS[3]
    llm = make_llm(str(model_dir))
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY), use_tqdm=False)
    oracle = Oracle(str(model_dir))
    assert oracle.model.model.rotary_emb.attention_scaling != 1.0
    assert_matches(output.outputs[0], oracle.greedy(prompt, MAX_TOKENS), context="yarn")
    llm.engine.check_all_free()


# -- FP8 indexer against the unquantised one ----------------------------------------------------

E4M3_RELATIVE_ERROR = 2.0 ** -4  # 3 mantissa bits, round to nearest: half a step of 2^-3
E4M3_SUBNORMAL_ERROR = 2.0 ** -10  # half the subnormal step 2^-9 (values below 2^-6), times the scale


def elementwise_error_bound(rotated: torch.Tensor) -> torch.Tensor:
    """A priori bound on ``|x_i - dequant(quant(x))_i|``: the scale is a power of two at least
    ``amax / 448``, so nothing saturates, and e4m3 rounds within 2^-4 relative (normals) or
    2^-10 times the scale (subnormals)."""
    amax = rotated.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return E4M3_RELATIVE_ERROR * rotated.abs() + E4M3_SUBNORMAL_ERROR * scale


def test_fp8_index_cache_is_page_major_keys_then_scales():
    head_dim, page_size, num_pages = 32, 16, 4
    (layout,) = IndexerSpec(head_dim, quantized=True).buffer_layouts()
    assert layout.dtype == torch.uint8 and not layout.per_token
    assert layout.page_shape(page_size) == (page_size * (head_dim + 4),)
    assert IndexerSpec(head_dim, quantized=True).page_bytes(page_size) == page_size * head_dim + page_size * 4
    codec = Fp8PageMajorIndexKeys(head_dim)
    buffer = torch.zeros(num_pages, *layout.page_shape(page_size), dtype=torch.uint8)
    keys = torch.randn(40, head_dim) * 3
    slots = torch.arange(page_size, page_size + 40)  # pages 1, 2, 3 (page 0 is the null page)
    codec.write(buffer, slots, keys, page_size)
    assert not buffer[0].any()
    page = buffer[2]  # tokens 16..31: their 16 keys, then their 16 scales
    stored_keys = page[:page_size * head_dim].view(FP8_DTYPE).view(page_size, head_dim).float()
    stored_scales = page[page_size * head_dim:].clone().view(torch.float32)
    assert torch.equal(stored_scales, torch.exp2(torch.round(torch.log2(stored_scales))))  # powers of two
    assert torch.equal(stored_keys * stored_scales[:, None], codec.gather(buffer, torch.tensor([2]), page_size))
    rotated = keys @ codec.hadamard
    error = (codec.gather(buffer, torch.tensor([1, 2, 3]), page_size)[:40] - rotated).abs()
    assert (error <= elementwise_error_bound(rotated)).all()


def test_fp8_index_scores_within_the_e4m3_bound():
    """Every FP8 index score is within its a priori error bound of the exact one, and on
    random scores the top-16 of 300 sets mostly agree.

    Bound: ``|q.k - q^.k^| <= sum_i (dq_i |k_i| + |q^_i| dk_i)`` (elementwise bounds above; the
    Hadamard rotation is orthonormal, so rotated products equal the unrotated ones), relu is
    1-Lipschitz, so ``|I - I^| <= sum_h |w_h| * c * that``. It is a worst case (all rounding
    errors aligned); real errors are random-signed, about sqrt(head_dim) times smaller, which
    is why the top-k sets still overlap >= 0.9 on average here (measured 0.96)."""
    torch.manual_seed(0)
    heads, head_dim, length, queries, page_size = 16, 32, 300, 64, 16
    softmax_scale = head_dim ** -0.5
    codec = Fp8PageMajorIndexKeys(head_dim)
    q = torch.randn(queries, heads, head_dim)
    k = torch.randn(length, head_dim) * torch.rand(length, 1) * 4
    w = torch.randn(queries, heads)
    buffer = torch.zeros(length // page_size + 2, page_size * (head_dim + 4), dtype=torch.uint8)
    codec.write(buffer, torch.arange(length) + page_size, k, page_size)
    k_hat = codec.gather(buffer, torch.arange(1, length // page_size + 2), page_size)[:length]
    q_hat = codec.queries(q)
    q_rot, k_rot = q @ codec.hadamard, k @ codec.hadamard
    delta_q, delta_k = elementwise_error_bound(q_rot), elementwise_error_bound(k_rot)
    assert ((q_hat - q_rot).abs() <= delta_q).all() and ((k_hat - k_rot).abs() <= delta_k).all()
    product_error = delta_q @ k_rot.abs().T + q_hat.abs() @ delta_k.T  # [S, H, L]
    bound = (w.abs()[:, :, None] * softmax_scale * product_error).sum(1)
    exact = index_scores(q[None], w[None], k[None], softmax_scale)[0]
    fp8 = index_scores(q_hat[None], w[None], k_hat[None], softmax_scale)[0]
    assert ((fp8 - exact).abs() <= bound + 1e-4).all()
    exact_top = exact.topk(INDEX_TOPK, dim=-1).indices
    fp8_top = fp8.topk(INDEX_TOPK, dim=-1).indices
    overlaps = [len(set(a) & set(b)) / INDEX_TOPK for a, b in zip(exact_top.tolist(), fp8_top.tolist())]
    assert sum(overlaps) / len(overlaps) >= 0.9, overlaps


def selections_and_prompt_logprobs(model_dir, prompts, mode):
    """Prompt logprobs and, per indexer layer, the prefill selections of every query."""
    llm = make_llm(model_dir, indexer_cache_dtype=mode)
    selections = defaultdict(list)
    for name, module in llm.engine.model.named_modules():
        if isinstance(module, LightningIndexer):
            module.register_forward_hook(lambda _m, _i, out, name=name: selections[name].extend(out.prefills))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY), use_tqdm=False)
    llm.engine.check_all_free()
    return selections, outputs


# Measured on these models (top-k overlap at the first indexer layer, mean / min; mean logprob
# drift past index_topk): deepseek_v32 0.966 / 0.81, 1.4 nats; glm_moe_dsa 0.965 / 0.81, 1.7 nats.
FIRST_LAYER_MEAN_OVERLAP = 0.9
FIRST_LAYER_MIN_OVERLAP = 0.75
MEAN_LOGPROB_DRIFT = 2.5


@pytest.mark.parametrize("arch", SPARSE)
def test_fp8_indexer_drift_against_unquantised(arch, model_dirs):
    """FP8 vs float32 indexer cache on the same prompts (teacher-forced, prompt logprobs).

    - Top-k overlap at the first indexer layer (its inputs are identical in both modes, so only
      quantisation acts): mean >= 0.9 and every query >= 0.75 (at most 4 of 16 swapped). Reason:
      e4m3 keeps 3 mantissa bits (2^-4 relative rounding), random-signed over a 32-term dot
      product, so an index score moves by about a percent of its scale; only tokens that close
      to the k-th score can change sides, about one per query among 100-300 candidates
      (15/16 = 0.94). A wrong scale or layout selects near-randomly (overlap ~16/L) and fails.
    - Logprob drift: none (<= 1e-5) while a position's context fits in index_topk (both modes
      select every token, and the FP8 cache only ever changes the selection). Past that, mean
      drift <= 2.5 nats: a regression guard, not a quality figure. In these random-weight
      models attention is peaky and unrelated to the untrained indexer, so one swapped token
      can move a logprob by several nats, and later layers amplify it (their indexers see
      perturbed inputs: overlap falls to ~0.5-0.8 there). A trained indexer selects what
      attention weighs, so marginal swaps carry little attention mass.
    """
    rng = random.Random(8)
    prompts = [random_prompt(rng, 100), random_prompt(rng, 300)]
    exact_selections, exact_outputs = selections_and_prompt_logprobs(model_dirs[arch], prompts, "float32")
    fp8_selections, fp8_outputs = selections_and_prompt_logprobs(model_dirs[arch], prompts, "fp8")
    first_layer = min(exact_selections, key=lambda name: int(re.search(r"layers\.(\d+)", name).group(1)))
    overlaps = []
    for exact, fp8 in zip(exact_selections[first_layer], fp8_selections[first_layer]):
        live = exact.sum(-1) == INDEX_TOPK
        live &= torch.arange(exact.shape[1] - exact.shape[0], exact.shape[1]) >= INDEX_TOPK  # sparse queries
        overlaps.append(((exact & fp8).sum(-1).float() / INDEX_TOPK)[live])
    overlaps = torch.cat(overlaps)
    assert overlaps.numel() > 300  # sparsity is live
    assert overlaps.mean().item() >= FIRST_LAYER_MEAN_OVERLAP, overlaps.mean().item()
    assert overlaps.min().item() >= FIRST_LAYER_MIN_OVERLAP, overlaps.min().item()
    drifts, dense_drifts = [], []
    for exact, fp8 in zip(exact_outputs, fp8_outputs):
        for position, (expected, got) in enumerate(zip(exact.prompt_logprobs[1:], fp8.prompt_logprobs[1:]), 1):
            token = next(iter(expected))
            drift = abs(expected[token].logprob - got[token].logprob)
            (dense_drifts if position <= INDEX_TOPK else drifts).append(drift)
    assert max(dense_drifts) <= 1e-5, max(dense_drifts)
    assert sum(drifts) / len(drifts) <= MEAN_LOGPROB_DRIFT, sum(drifts) / len(drifts)


# -- invariant I1 -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", FAMILY)
def test_movers_touch_exactly_the_registry_buffers(arch, model_dirs):
    llm = LLM(model=model_dirs[arch], page_size=8, max_total_tokens=512, **HOST_TIER)  # FP8 indexer (default)
    engine = llm.engine
    registry_keys = {d.key for d in engine.registry.buffers()}
    kinds = defaultdict(set)
    for descriptor in engine.registry.buffers():
        kinds[descriptor.kind].add(descriptor.group_id)
    num_mla, num_indexer = STATEFUL_LAYERS[arch]
    assert sum(1 for d in engine.registry.buffers() if d.kind == "latent") == num_mla
    assert sum(1 for d in engine.registry.buffers() if d.kind == "index_key") == num_indexer
    assert len(registry_keys) == num_mla + num_indexer
    if num_indexer:  # the indexer cache is its own group
        assert len(engine.registry.groups) == 2 and kinds["latent"].isdisjoint(kinds["index_key"])
    check_movers_touch_registry(engine, require_nonzero=True)


# -- loading ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", FAMILY)
def test_dummy_weights(arch, model_dirs):
    llm = LLM(model=model_dirs[arch], load_format="dummy", page_size=16, max_total_tokens=1024)
    (output,) = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4
    llm.engine.check_all_free()


@pytest.mark.parametrize("arch", FAMILY)
def test_mtp_weights_load_and_are_kept(arch, model_dirs, tmp_path):
    from safetensors.torch import load_file

    from tandem.models.loader import build_model

    def build(model_dir):
        model, config, _ = build_model(str(model_dir), dtype="float32", load_format="auto",
                                       device=torch.device("cpu"), max_model_len=None, seed=0)
        return model, config

    model, config = build(model_dirs[arch])
    prefix = f"model.layers.{config.num_hidden_layers}."
    checkpoint = load_file(str(Path(model_dirs[arch]) / "model-mtp.safetensors"))
    assert checkpoint and all(name.startswith(prefix) for name in checkpoint)
    (mtp,) = model.model.mtp_layers
    assert torch.equal(mtp.eh_proj.weight, checkpoint[prefix + "eh_proj.weight"])
    assert torch.equal(mtp.shared_head.head.weight, checkpoint[prefix + "shared_head.head.weight"])
    size = mtp.mlp.experts.intermediate_size
    assert torch.equal(mtp.mlp.experts.gate_up_proj[3, size:], checkpoint[prefix + "mlp.experts.3.up_proj.weight"])
    assert (mtp.self_attn.indexer is not None) == (arch in SPARSE)
    assert not any(name.startswith(prefix) for name in model.state_specs())  # no state until it runs
    # A checkpoint without MTP weights loads as well (the modules are dropped).
    stripped = tmp_path / "no_mtp"
    shutil.copytree(model_dirs[arch], stripped)
    (stripped / "model-mtp.safetensors").unlink()
    model, _ = build(stripped)
    assert len(model.model.mtp_layers) == 0


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("config_name", ["DeepseekV3Config", "GlmMoeDsaConfig"])
def test_moe_matches_transformers(config_name, norm_topk_prob):
    """Grouped top-k routing with a non-zero correction bias, routed scaling and shared experts,
    loaded from per-expert checkpoint names, against transformers' MoE block."""
    import transformers

    from tandem.layers.moe import MoE, load_with_experts

    groups = dict(n_group=4, topk_group=2) if config_name == "DeepseekV3Config" else dict(n_group=1, topk_group=1)
    config = getattr(transformers, config_name)(
        hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
        routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob, **groups)
    module_name = "DeepseekV3MoE" if config_name == "DeepseekV3Config" else "GlmMoeDsaMoE"
    module_path = "deepseek_v3.modeling_deepseek_v3" if config_name == "DeepseekV3Config" \
        else "glm_moe_dsa.modeling_glm_moe_dsa"
    reference_class = getattr(__import__(f"transformers.models.{module_path}", fromlist=[module_name]), module_name)
    torch.manual_seed(0)
    reference = reference_class(config).eval()
    with torch.no_grad():
        for tensor in reference.state_dict().values():
            tensor.copy_(torch.randn_like(tensor) * (0.3 if tensor.dim() == 1 else 1 / math.sqrt(tensor.shape[-1])))
    state = reference.state_dict()
    size = config.moe_intermediate_size
    per_expert = []
    for name, tensor in state.items():
        if name == "experts.gate_up_proj":
            for expert in range(tensor.shape[0]):
                per_expert += [(f"experts.{expert}.gate_proj.weight", tensor[expert, :size]),
                               (f"experts.{expert}.up_proj.weight", tensor[expert, size:])]
        elif name == "experts.down_proj":
            per_expert += [(f"experts.{expert}.down_proj.weight", tensor[expert]) for expert in range(tensor.shape[0])]
        else:
            per_expert.append((name, tensor))
    ours = MoE(config)
    load_with_experts(ours, per_expert)
    hidden = torch.randn(64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(hidden), reference(hidden[None])[0], rtol=1e-5, atol=1e-5)


def test_no_state_kind_switch_outside_managers_and_registry():
    """Variation by spec, not by type switches: only kv/managers/ and the registry may tell
    state kinds apart (no isinstance / type() tests on specs, no manager_kind comparisons)."""
    import tandem
    from tandem.kv import spec as spec_module

    spec_names = sorted(name for name, value in vars(spec_module).items()
                        if isinstance(value, type) and issubclass(value, spec_module.StateSpec))
    names = "|".join(spec_names)
    switch = re.compile(rf"isinstance\([^)]*\b({names})\b|type\([^)]*\)\s*(==|is|in)\s*\(?\s*({names})\b|"
                        rf"manager_kind\s*(==|!=|in)")
    root = Path(tandem.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("kv/managers/") or relative in ("kv/registry.py", "kv/spec.py"):
            continue
        offenders += [f"{relative}: {match.group(0)}" for match in switch.finditer(path.read_text())]
    assert not offenders, offenders
