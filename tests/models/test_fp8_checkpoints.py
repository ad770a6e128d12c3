"""FP8 checkpoints (``tandem/quantization``) against transformers loading the same files (fp32,
CPU): greedy tokens equal and top-5 logprobs within 1e-4, on a mixed batch with chunked prefill
and a prefix-cache hit, per family.

- Block-scaled ``quant_method: fp8`` (``make_model(quantize="fp8")``, 128x128 blocks over tiny
  dimensions: every block is partial): transformers dequantizes it on a CPU. Its dequantization
  infers the block from ``weight rows / scale rows``, which is wrong as soon as a dimension
  holds more than one block and ends in a partial one (192 rows in 128-row blocks read as two
  96-row blocks) and raises when it does not divide. For those checkpoints (qwen3_next's
  192-row ``in_proj_qkvz``; deepseek_v3 in 16x16 blocks, with 40-row ``kv_a_proj_with_mqa``)
  the oracle is transformers on a float32 checkpoint holding the weights dequantized block by
  block here.
- compressed-tensors per channel: transformers (through ``compressed-tensors``) dequantizes the
  weights and also quantizes each linear layer's input per token, as the format prescribes: it
  is the oracle of tandem's FP8 products (``quantized_compute="fp8"``, the PyTorch references on
  a CPU); with its activation quantization switched off, of the dequantized weights.
- Online ``quantization="fp8"``: transformers on a checkpoint of the per-channel
  quantize-dequantize of the original weights.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.support.models import ARCH_OPTIONS
from tests.support.oracle import Oracle, assert_matches
from tests.support.engines import GREEDY

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MAX_TOKENS = 6
# llama keeps one ordinary projection 16-bit through modules_to_not_convert.
KEPT_MODULE = "model.layers.1.mlp.down_proj"


def make_quantized(arch, directory, tokenizer_dir, form="fp8", block=(128, 128), keep=()):
    from tandem.tools.make_model import make_model
    from tandem.tools.quantized_checkpoint import quantize_checkpoint

    path = make_model(arch, directory, seed=1, tokenizer_dir=tokenizer_dir, **ARCH_OPTIONS.get(arch, {}))
    return str(quantize_checkpoint(path, form, block, keep))


def checkpoint_tensors(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def dequantized_copy(model_dir, out_dir, block) -> str:
    """A float32 checkpoint of ``model_dir``'s FP8 weights, each block multiplied by its scale
    in a plain loop (independent of tandem's dequantization)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    for file in sorted(Path(out_dir).glob("*.safetensors")):
        tensors = load_file(str(file))
        for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
            scale, weight_name = tensors.pop(name), name.removesuffix("_scale_inv")
            weight = tensors[weight_name].float()
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j]
            tensors[weight_name] = weight
        save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((Path(out_dir) / "config.json").read_text())
    del config["quantization_config"]
    (Path(out_dir) / "config.json").write_text(json.dumps(config))
    return str(out_dir)


def prompts_with_shared_prefix(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    return [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (9, 1, 30, 5)]


def run_and_compare(model_dir, oracle, context, **options):
    """Three prompts as one mixed batch in 24-token chunks, then a fourth sharing their 40-token
    prefix (a prefix-cache hit); every output against the oracle."""
    prompts = prompts_with_shared_prefix(7)
    settings = dict(page_size=8, max_total_tokens=1024, max_num_batched_tokens=24, indexer_cache_dtype="float32")
    llm = LLM(model=model_dir, **{**settings, **options})
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    outputs = llm.generate(prompts[:3], params) + llm.generate(prompts[3:], params)
    assert outputs[3].num_cached_tokens >= 32, outputs[3].num_cached_tokens
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert_matches(output.outputs[0], oracle.greedy(prompt, MAX_TOKENS), context=f"{context} prompt {number}")
    llm.engine.check_all_free()
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v32", "glm_moe_dsa", "qwen3_moe"])
def test_block_scaled_checkpoint_equals_transformers(arch, tmp_path, tokenizer_dir):
    keep = (KEPT_MODULE,) if arch == "llama" else ()
    model_dir = make_quantized(arch, tmp_path / arch, tokenizer_dir, keep=keep)
    tensors = checkpoint_tensors(model_dir)
    assert sum(t.dtype == torch.float8_e4m3fn for t in tensors.values()) >= 8
    assert all(tensors[n].dtype == torch.float32 for n in tensors if n.endswith("weight_scale_inv"))
    if keep:
        assert tensors[KEPT_MODULE + ".weight"].dtype == torch.float32
    llm = run_and_compare(model_dir, Oracle(model_dir), arch)
    assert llm.engine.model_info.quantization == "fp8:block-128x128/dequantized"


def test_per_tensor_checkpoint_equals_transformers(tmp_path, tokenizer_dir):
    model_dir = make_quantized("llama", tmp_path / "llama", tokenizer_dir, form="fp8-per-tensor")
    assert checkpoint_tensors(model_dir)["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == ()
    llm = run_and_compare(model_dir, Oracle(model_dir), "per-tensor")
    assert llm.engine.model_info.quantization == "fp8:tensor/dequantized"


@pytest.mark.parametrize("arch, block", [("qwen3_next", (128, 128)), ("deepseek_v3", (16, 16))])
def test_multi_block_partial_edges_equal_transformers_on_dequantized_weights(arch, block, tmp_path, tokenizer_dir):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    model_dir = make_quantized(arch, tmp_path / arch, tokenizer_dir, block=block)
    tensors = checkpoint_tensors(model_dir)
    # A dimension of several blocks ending in a partial one, which transformers misreads.
    name = {"qwen3_next": "model.layers.0.linear_attn.in_proj_qkvz",
            "deepseek_v3": "model.layers.0.self_attn.kv_a_proj_with_mqa"}[arch]
    weight, scale = tensors[name + ".weight"], tensors[name + ".weight_scale_inv"]
    assert weight.shape[0] % block[0] and scale.shape[0] >= 2
    reference_dir = dequantized_copy(model_dir, tmp_path / "dequantized", block)
    expected = checkpoint_tensors(reference_dir)[name + ".weight"]
    try:
        misread = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)
        assert not torch.equal(misread, expected)
    except ValueError as error:
        assert "not divisible by scale grid" in str(error)
    run_and_compare(model_dir, Oracle(reference_dir), arch)


def test_ignoring_the_scales_fails_the_comparison(tmp_path, tokenizer_dir):
    from safetensors.torch import load_file, save_file

    model_dir = make_quantized("llama", tmp_path / "llama", tokenizer_dir)
    oracle = Oracle(model_dir)
    unscaled = tmp_path / "unscaled"
    shutil.copytree(model_dir, unscaled)
    for file in unscaled.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({n: torch.ones_like(t) if n.endswith("weight_scale_inv") else t for n, t in tensors.items()},
                  str(file), metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="tokens differ|logprob"):
        run_and_compare(str(unscaled), oracle, "scales ignored")


def without_activation_quantization(oracle: Oracle) -> Oracle:
    for module in oracle.model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_enabled = False
    return oracle


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compressed_tensors_per_channel_equals_transformers(arch, tmp_path, tokenizer_dir):
    model_dir = make_quantized(arch, tmp_path / arch, tokenizer_dir, form="compressed-tensors")
    tensors = checkpoint_tensors(model_dir)
    scale = tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.shape == (tensors["model.layers.0.mlp.down_proj.weight"].shape[0], 1)
    llm = run_and_compare(model_dir, Oracle(model_dir), f"{arch} fp8 products", quantized_compute="fp8")
    assert llm.engine.model_info.quantization == "compressed-tensors:channel/fp8"
    projection = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert projection.weight.dtype == torch.float8_e4m3fn and projection.weight_scale.shape == (128, 1)
    assert llm.engine.model.lm_head.weight.dtype == torch.float32
    if arch == "llama":
        run_and_compare(model_dir, without_activation_quantization(Oracle(model_dir)), f"{arch} dequantized")


def per_channel_quantize_dequantize(weight: torch.Tensor) -> torch.Tensor:
    scale = weight.abs().amax(dim=1, keepdim=True) / 448.0
    return (weight / scale).to(torch.float8_e4m3fn).float() * scale


def test_online_fp8_is_per_channel_quantize_dequantize(tmp_path, model_dirs):
    from safetensors.torch import load_file, save_file

    original = model_dirs["llama"]
    tensors = checkpoint_tensors(original)
    projections = [n for n in tensors if n.endswith("_proj.weight")]
    expected = {n: per_channel_quantize_dequantize(tensors[n]) if n in projections else tensors[n] for n in tensors}
    llm = LLM(model=original, quantization="fp8", max_total_tokens=256)
    assert llm.engine.model_info.quantization == "fp8-online:channel/dequantized"
    layer = llm.engine.model.model.layers[0]
    q_rows = tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight[:q_rows],
                               expected["model.layers.0.self_attn.q_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.down_proj.weight, expected["model.layers.0.mlp.down_proj.weight"],
                               rtol=0, atol=0)
    assert not torch.equal(layer.mlp.down_proj.weight, tensors["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(llm.engine.model.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(llm.engine.model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    reference = tmp_path / "quantize_dequantize"
    shutil.copytree(original, reference)
    (file,) = reference.glob("*.safetensors")
    save_file(expected, str(file), metadata={"format": "pt"})
    del llm
    run_and_compare(original, Oracle(str(reference)), "online fp8", quantization="fp8")


def test_fp8_layers_hold_fp8_weights_and_honour_modules_to_not_convert(tmp_path, tokenizer_dir):
    from tandem.models.loader import build_model

    model_dir = make_quantized("llama", tmp_path / "llama", tokenizer_dir, keep=(KEPT_MODULE,))
    options = dict(dtype="float32", load_format="auto", device=torch.device("cpu"), max_model_len=256, seed=0)
    fp8, _, fp8_info = build_model(model_dir, fp8_compute=True, **options)
    dequantized, _, info = build_model(model_dir, **options)
    layers = fp8.model.layers
    assert layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert layers[0].mlp.down_proj.weight_scale.shape == (64, 1)  # 128 inputs: one 128-column block
    assert layers[1].mlp.down_proj.weight.dtype == torch.float32  # modules_to_not_convert
    assert layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert fp8.lm_head.weight.dtype == torch.float32 and fp8.model.embed_tokens.weight.dtype == torch.float32
    assert fp8_info.weight_bytes < info.weight_bytes
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    exact = dequantized.model.layers[0].mlp.gate_up_proj(hidden)
    approximate = layers[0].mlp.gate_up_proj(hidden)
    # FP8 activations: 3 mantissa bits, a relative error of at most 2^-4 per product term.
    assert 0 < (approximate - exact).abs().max() <= 0.1 * exact.abs().max()


def test_fp8_experts_load_with_their_scales(tmp_path, tokenizer_dir):
    """DeepSeek-V3.2's routed experts stay FP8 (per-expert weights and block scales fill the
    stacked parameters); on a CPU they compute through the dequantizing reference, so the layer
    equals the dequantized model's exactly."""
    from tandem.models.loader import build_model

    model_dir = make_quantized("deepseek_v32", tmp_path / "deepseek_v32", tokenizer_dir, block=(16, 16))
    options = dict(dtype="float32", load_format="auto", device=torch.device("cpu"), max_model_len=256, seed=0)
    fp8, _, _ = build_model(model_dir, fp8_compute=True, **options)
    dequantized, _, _ = build_model(model_dir, **options)
    experts, reference = fp8.model.layers[1].mlp.experts, dequantized.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.scale_groups == (16, 16)
    assert experts.gate_up_proj_weight_scale.shape == (8, 64, 4) and experts.down_proj_weight_scale.shape == (8, 64, 2)
    assert fp8.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32  # dequantized at load
    generator = torch.Generator().manual_seed(3)
    hidden, expert_ids = torch.randn(6, 64, generator=generator), torch.randint(0, 8, (6, 2), generator=generator)
    routing = torch.rand(6, 2, generator=generator)
    assert torch.equal(experts(hidden, expert_ids, routing), reference(hidden, expert_ids, routing))


@pytest.mark.parametrize("method", ["awq", "gptq", "mxfp4", "bitsandbytes"])
def test_other_quantization_methods_refuse_at_start(method, tmp_path, model_dirs):
    model_dir = tmp_path / method
    shutil.copytree(model_dirs["llama"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^quantization_config.quant_method: '{method}' is not supported; "
                                         r"tandem loads fp8 .* and compressed-tensors"):
        LLM(model=str(model_dir), max_total_tokens=256)


def test_bad_quantization_options_name_the_field(model_dirs):
    from tandem.entrypoints.cli import build_parser, engine_config

    arguments = build_parser().parse_args(["serve", "--quantization", "fp8", "--quantized-compute", "fp8"])
    config = engine_config(arguments, "/m")
    assert (config.quantization, config.quantized_compute) == ("fp8", "fp8")
    with pytest.raises(ValueError, match="^quantization:"):
        LLM(model=model_dirs["llama"], quantization="int8")
    with pytest.raises(ValueError, match="^quantized_compute:"):
        LLM(model=model_dirs["llama"], quantized_compute="int8")
    with pytest.raises(ValueError, match="^quantized_compute: 'fp8' applies to quantized weights"):
        LLM(model=model_dirs["llama"], quantized_compute="fp8", max_total_tokens=256)
    from types import SimpleNamespace

    from tandem.quantization import quantization_config_of
    from tandem.tools.quantized_checkpoint import quantization_section

    compressed = SimpleNamespace(quantization_config=quantization_section("compressed-tensors", (128, 128), ()))
    with pytest.raises(ValueError, match="^quantization: 'fp8' does not match the checkpoint's quantization_config"):
        quantization_config_of(compressed, "fp8")
    block = SimpleNamespace(quantization_config=quantization_section("fp8", (128, 128), ()))
    assert quantization_config_of(block, "fp8").describe() == "fp8:block-128x128"  # already FP8: agrees


def test_fp8_and_unquantized_engines_never_share_disk_pages(tmp_path, model_dirs):
    directory = str(tmp_path / "disk")
    prompt = list(range(3, 70))
    params = SamplingParams(max_tokens=2, **GREEDY)
    settings = dict(page_size=16, max_total_tokens=512, host_cache_size=0.01, disk_cache_dir=directory)

    def disk_hits(**options) -> int:
        llm = LLM(model=model_dirs["llama"], **settings, **options)
        llm.generate([prompt], params)
        hits = llm.engine.stats().tiers.disk_hit_tokens
        llm.engine.check_all_free()
        llm.engine.shutdown()
        return hits

    assert disk_hits() == 0
    assert disk_hits(quantization="fp8") == 0
    assert disk_hits() >= 48  # the first engine's pages are there for an engine like it


def test_tensor_parallel_fp8_weights_shard_with_their_scales(tmp_path, tokenizer_dir):
    """16x16 blocks, FP8 products (per 1x16 activation group, so a rank's share of a row-parallel
    input quantizes as the whole does): TP=2 equals TP=1. Column-parallel scales shard by row,
    row-parallel ones by block column."""
    model_dir = make_quantized("llama", tmp_path / "llama", tokenizer_dir, block=(16, 16))
    prompts = prompts_with_shared_prefix(11)[:2]
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    options = dict(page_size=16, max_total_tokens=512, max_num_batched_tokens=32, quantized_compute="fp8")
    single = LLM(model=model_dir, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model_dir, tensor_parallel_size=2, **options)
    try:
        attention = llm.engine.model.model.layers[0].self_attn
        assert attention.o_proj.weight.shape == (64, 32) and attention.o_proj.weight_scale.shape == (64, 2)
        assert attention.qkv_proj.weight_scale.shape == (64, 4)  # (q 64 + k 32 + v 32) / 2 rows
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_all_free()
    finally:
        llm.engine.shutdown()
    for output, expected in zip(outputs, single):
        sequence, single_sequence = output.outputs[0], expected.outputs[0]
        assert list(sequence.token_ids) == list(single_sequence.token_ids)
        for entry, single_entry in zip(sequence.logprobs, single_sequence.logprobs):
            for token, logprob in entry.items():
                assert abs(logprob.logprob - single_entry[token].logprob) <= 1e-4


def test_a_float_tensor_never_fills_an_fp8_weight():
    """A layer the checkpoint announces as FP8 takes FP8 weights only: a float one would be cast
    without its scale."""
    from tandem.layers.linear import check_loadable

    with pytest.raises(ValueError, match="^checkpoint tensor 'w' is torch.float32, but its parameter holds FP8"):
        check_loadable("w", torch.ones(2, 3), torch.empty(2, 3, dtype=torch.float8_e4m3fn))


def test_an_fp8_weight_without_its_scale_is_named(tmp_path, tokenizer_dir):
    from safetensors.torch import load_file, save_file

    model_dir = make_quantized("llama", tmp_path / "llama", tokenizer_dir)
    (file,) = Path(model_dir).glob("*.safetensors")
    tensors = load_file(str(file))
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="^checkpoint tensor 'model.layers.0.mlp.up_proj.weight' is FP8 but the "
                                         "checkpoint has no 'model.layers.0.mlp.up_proj.weight_scale_inv'"):
        LLM(model=model_dir, max_total_tokens=256)
