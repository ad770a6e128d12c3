"""Build tiny random-weight Hugging Face checkpoints with a locally trained tokenizer.

Every test and the demo server use models made here: nothing is ever downloaded. A model
directory holds ``config.json``, ``generation_config.json``, safetensors weights (one file,
or shards plus ``model.safetensors.index.json``) and the tokenizer files, so
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it.

Weights are re-initialised wider than the Hugging Face default so that next-token logits are
well separated (tests compare greedy tokens of two implementations in fp32) while greedy
continuations still vary.

To support another architecture, add one entry to :func:`architecture_table`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

END_OF_TEXT_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML; message content is rendered verbatim, any role name is accepted.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer rebuilds this one on load).
PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Byte-level BPE needs the 256 byte symbols, the special tokens and room for some merges.
MINIMUM_VOCAB_SIZE = 320

LLAMA3_ROPE_FACTOR = 8.0
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0

# Weight init (see _initialise_weights), chosen by measuring 64-token greedy rollouts from
# random prompts for every architecture, tied and untied, hidden 64 and 256: the fp32 logits
# have std ~3, the median top-1/top-2 gap is ~0.4-0.8 (under 1e-2 at ~1% of steps) and a
# rollout has ~20-60 distinct tokens. A gain of 2 lets the layers outweigh the embedding in
# the residual stream, so a tied output head does not just repeat the current token.
MATRIX_GAIN = 2.0
EMBEDDING_STD = 1.0
OUTPUT_HEAD_GAIN = 3.0
BIAS_STD = 0.5
NORM_WEIGHT_STD = 0.2

DEMO_MODEL_OPTIONS = types.MappingProxyType(
    {
        "arch": "llama",
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "intermediate_size": 512,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
        "seed": 0,
    }
)


@dataclasses.dataclass(frozen=True)
class ArchitectureSpec:
    """How to build one architecture with transformers' own classes.

    ``config_class`` and ``model_class`` are attribute names in the ``transformers``
    package (resolved lazily, so importing this module stays cheap). ``config_kwargs`` are
    passed to the config on top of the shared shape arguments. ``norm_weight_center`` is the
    value norm weights are drawn around (1 for ``x * w`` norms; 0 for ``x * (1 + w)`` norms).
    """

    config_class: str
    model_class: str
    config_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    norm_weight_center: float = 1.0
    # Write the multi-token-prediction module weights the config announces
    # (``num_nextn_predict_layers``), laid out as DeepSeek-V3 / GLM checkpoints do: see
    # :func:`_write_mtp_weights`. transformers builds no MTP module, so they are drawn here.
    mtp_weights: bool = False
    # Config arguments that follow from the shape arguments, overriding them (e.g. MLA: one
    # key/value head per query head, and ``head_dim`` is the rotary part of a head).
    shape_kwargs: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None


# Tiny MLA + MoE shapes shared by the DeepSeek-V3 family (8 routed experts, 2 per token).
_MLA_MOE_KWARGS = types.MappingProxyType(
    {
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 1,
    }
)


def _gemma3_shape_kwargs(shape: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3: rope parameters per layer type, and local/global layers alternating."""
    rope = dict(shape["rope_parameters"])
    local = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    layer_types = ["sliding_attention" if index % 2 == 0 else "full_attention"
                   for index in range(shape["num_layers"])]
    return {"rope_parameters": {"sliding_attention": local,
                                "full_attention": dict(rope, rope_theta=100 * rope["rope_theta"])},
            "layer_types": layer_types}


def _mla_shape_kwargs(shape: Mapping[str, Any]) -> dict[str, Any]:
    """MLA expands one latent into a key and a value per query head; rope covers ``head_dim``."""
    return {"num_key_value_heads": shape["num_heads"], "head_dim": _MLA_MOE_KWARGS["qk_rope_head_dim"]}


# DeepSeek sparse attention (lightning indexer); 16 heads keep all-zero (tied) scores rare.
_DSA_KWARGS = types.MappingProxyType({"index_topk": 16, "index_head_dim": 32, "index_n_heads": 16})


def architecture_table() -> Mapping[str, ArchitectureSpec]:
    """Return the read-only table from architecture name to its :class:`ArchitectureSpec`."""
    return types.MappingProxyType(
        {
            "llama": ArchitectureSpec(
                "LlamaConfig",
                "LlamaForCausalLM",
                {"attention_bias": False, "mlp_bias": False},
            ),
            "qwen2": ArchitectureSpec(
                "Qwen2Config",
                "Qwen2ForCausalLM",
                {"use_sliding_window": False},
            ),
            "qwen3": ArchitectureSpec(
                "Qwen3Config",
                "Qwen3ForCausalLM",
                {"attention_bias": False, "use_sliding_window": False},
            ),
            # Local (sliding window 24, rope base ``rope_theta``) and global (base 100x, with the
            # requested scaling) layers alternate from layer 0; non-default attention scale and
            # final logit soft-cap.
            "gemma3": ArchitectureSpec(
                "Gemma3TextConfig",
                "Gemma3ForCausalLM",
                {
                    "sliding_window": 24,
                    "query_pre_attn_scalar": 24,
                    "final_logit_softcapping": 30.0,
                },
                norm_weight_center=0.0,
                shape_kwargs=_gemma3_shape_kwargs,
            ),
            # Gated DeltaNet and gated full attention alternate from layer 0 (DeltaNet first);
            # layer 0 has a dense MLP, the others MoE (4 experts, 2 per token) + shared expert.
            "qwen3_next": ArchitectureSpec(
                "Qwen3NextConfig",
                "Qwen3NextForCausalLM",
                {
                    "full_attention_interval": 2,
                    "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4,
                    "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16,
                    "linear_conv_kernel_dim": 4,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 32,
                    "mlp_only_layers": [0],
                },
                norm_weight_center=0.0,
            ),
            # Blocks cycle Mamba-2, attention, MLP, MoE (4 experts, 2 per token) from layer 0.
            "nemotron_h": ArchitectureSpec(
                "NemotronHConfig",
                "NemotronHForCausalLM",
                {
                    "mamba_num_heads": 4,
                    "mamba_head_dim": 16,
                    "ssm_state_size": 16,
                    "n_groups": 2,
                    "conv_kernel": 4,
                    "chunk_size": 32,
                    "n_routed_experts": 4,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "moe_shared_expert_intermediate_size": 32,
                },
                shape_kwargs=lambda shape: {"layers_block_type": [
                    ("linear_attention", "full_attention", "mlp", "moe")[index % 4]
                    for index in range(shape["num_layers"])]},
            ),
            # MLA + MoE (grouped top-k over 2 groups, one shared expert, layer 0 dense).
            "deepseek_v3": ArchitectureSpec(
                "DeepseekV3Config",
                "DeepseekV3ForCausalLM",
                {**_MLA_MOE_KWARGS, "q_lora_rank": None, "n_group": 2, "topk_group": 1},
                mtp_weights=True,
                shape_kwargs=_mla_shape_kwargs,
            ),
            # MLA + MoE + DSA: the indexer keeps the top 16 tokens, so prompts past 16 are sparse.
            "deepseek_v32": ArchitectureSpec(
                "DeepseekV32Config",
                "DeepseekV32ForCausalLM",
                {**_MLA_MOE_KWARGS, **_DSA_KWARGS, "n_group": 2, "topk_group": 1},
                mtp_weights=True,
                shape_kwargs=_mla_shape_kwargs,
            ),
            # GLM-5: as DeepSeek-V3.2 with interleaved indexer rope, one expert group, and
            # cross-layer top-k sharing (indexer on layers 0, 2, 4, ...; the others reuse it).
            "glm_moe_dsa": ArchitectureSpec(
                "GlmMoeDsaConfig",
                "GlmMoeDsaForCausalLM",
                {**_MLA_MOE_KWARGS, **_DSA_KWARGS, "n_group": 1, "topk_group": 1,
                 "index_topk_freq": 2, "index_skip_topk_offset": 1},
                mtp_weights=True,
                shape_kwargs=_mla_shape_kwargs,
            ),
        }
    )


def architecture_names() -> list[str]:
    """Return the architecture names :func:`make_model` accepts, sorted."""
    return sorted(architecture_table())


# --------------------------------------------------------------------------------------
# Model


def make_model(
    arch: str,
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    rope_scaling: str | None = None,
    rope_theta: float = 10000.0,
    init_std: float | None = None,
    seed: int = 0,
    max_shard_size: int | str | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    weights: bool = True,
) -> pathlib.Path:
    """Write a random-weight float32 checkpoint of ``arch`` plus a tokenizer to ``out_dir``.

    The result is a function of the arguments only (same arguments, same files' contents).
    ``head_dim`` defaults to ``hidden_size // num_heads``. ``rope_scaling="llama3"`` sets
    Llama-3.1 style rope parameters with ``original_max_position_embeddings`` a quarter of
    ``max_position_embeddings``. ``init_std`` replaces the fan-in scaled init of weight
    matrices with a fixed standard deviation. ``max_shard_size`` (e.g. ``"200KB"``) shards
    the weights and writes ``model.safetensors.index.json``. ``tokenizer_dir`` copies the
    tokenizer files from a directory made by this function (with the same ``vocab_size``)
    instead of training one. ``weights=False`` writes the config and tokenizer only, for
    ``--load-format dummy`` (random weights made on the device at load time; large shapes).
    Returns ``out_dir`` as a path.

    The config's ``eos_token_id``/``pad_token_id``/``bos_token_id`` equal the tokenizer's
    (bos is None) and every tokenizer id is below ``vocab_size``.
    """
    spec = _lookup_architecture(arch)
    _validate_shape(hidden_size, num_heads, num_kv_heads, head_dim, vocab_size)
    out_path = pathlib.Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("building %s model (hidden %d, %d layers) in %s", arch, hidden_size, num_layers, out_path)
    tokenizer = _prepare_tokenizer(out_path, vocab_size, max_position_embeddings, tokenizer_dir)
    token_ids = _special_token_ids(tokenizer)
    config = _build_config(
        spec,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=_rope_parameters(rope_scaling, rope_theta, max_position_embeddings),
        token_ids=token_ids,
    )
    if not weights:
        config.architectures = [spec.model_class]
        config.save_pretrained(out_path)
        _write_generation_config(out_path, token_ids)
        return out_path
    model = _build_model(spec, config, seed=seed, init_std=init_std)
    _save_model(model, out_path, max_shard_size)
    if spec.mtp_weights:
        _write_mtp_weights(out_path, config, seed=seed, norm_center=spec.norm_weight_center)
    _write_generation_config(out_path, token_ids)
    logger.info("built %s model in %s (%.1f s)", arch, out_path, time.perf_counter() - started)
    return out_path


def _lookup_architecture(arch: str) -> ArchitectureSpec:
    """Return the spec of ``arch``; raise ValueError naming the known ones otherwise."""
    table = architecture_table()
    if arch not in table:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(sorted(table))}")
    return table[arch]


def _validate_shape(
    hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None, vocab_size: int
) -> None:
    """Raise ValueError for shapes the architectures cannot take."""
    if head_dim is None and hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if vocab_size < MINIMUM_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MINIMUM_VOCAB_SIZE}, got {vocab_size}")


def _rope_parameters(rope_scaling: str | None, rope_theta: float, max_position_embeddings: int) -> dict:
    """Return transformers' ``rope_parameters`` dict for the requested scaling."""
    if rope_scaling is None:
        return {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling == "llama3":
        return {
            "rope_type": "llama3",
            "rope_theta": rope_theta,
            "factor": LLAMA3_ROPE_FACTOR,
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
            "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": max(1, max_position_embeddings // 4),
        }
    raise ValueError(f"unknown rope_scaling {rope_scaling!r}; known: llama3")


def _build_config(spec: ArchitectureSpec, *, token_ids: Mapping[str, int | None], **shape: Any):
    """Instantiate the architecture's transformers config from the shared shape arguments."""
    import transformers

    config_class = getattr(transformers, spec.config_class)
    arguments = dict(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_position_embeddings"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        rope_parameters=shape["rope_parameters"],
        eos_token_id=token_ids["eos_token_id"],
        pad_token_id=token_ids["pad_token_id"],
        bos_token_id=token_ids["bos_token_id"],
        dtype="float32",
    )
    arguments.update(spec.config_kwargs)
    if spec.shape_kwargs is not None:
        arguments.update(spec.shape_kwargs(shape))
    return config_class(**arguments)


def _build_model(spec: ArchitectureSpec, config, *, seed: int, init_std: float | None):
    """Return the float32 model of ``config`` with seeded, widened random weights (eval mode)."""
    import transformers

    model_class = getattr(transformers, spec.model_class)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    _initialise_weights(model, generator, init_std=init_std, norm_center=spec.norm_weight_center)
    return model.eval()


@torch.no_grad()
def _initialise_weights(
    model: torch.nn.Module, generator: torch.Generator, *, init_std: float | None, norm_center: float
) -> None:
    """Overwrite every parameter with a wide random init, in ``named_parameters`` order.

    Untied input embedding ~ N(0, EMBEDDING_STD); the output head, tied or not, ~ N(0,
    OUTPUT_HEAD_GAIN / sqrt(hidden)) so logits have std ~OUTPUT_HEAD_GAIN; other weight matrices ~
    N(0, MATRIX_GAIN / sqrt(fan_in)) or N(0, init_std); biases ~ N(0, BIAS_STD); 1-D (norm)
    weights ~ N(norm_center, NORM_WEIGHT_STD). Tied parameters appear once and are drawn once.
    """
    stds = _matrix_stds(model, init_std)
    for name, parameter in model.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
        if name.endswith("bias"):
            value = noise * BIAS_STD
        elif parameter.dim() == 1:
            value = norm_center + noise * NORM_WEIGHT_STD
        else:
            value = noise * stds.get(id(parameter), MATRIX_GAIN / math.sqrt(parameter.shape[-1]))
        parameter.copy_(value)


def _matrix_stds(model: torch.nn.Module, init_std: float | None) -> dict[int, float]:
    """Map ``id(parameter)`` to its std for the embeddings and the output head.

    With ``init_std`` set, every weight matrix uses it. Otherwise the input embedding, the output
    head get their own stds, the output head's winning when the two are tied (see
    :func:`_initialise_weights`).
    """
    if init_std is not None:
        return {id(parameter): init_std for parameter in model.parameters() if parameter.dim() >= 2}
    input_weight = model.get_input_embeddings().weight
    output_weight = model.get_output_embeddings().weight
    stds = {id(input_weight): EMBEDDING_STD}
    stds[id(output_weight)] = OUTPUT_HEAD_GAIN / math.sqrt(output_weight.shape[-1])
    return stds


def _save_model(model, out_path: pathlib.Path, max_shard_size: int | str | None) -> None:
    """Save weights and config; transformers 5 always writes safetensors."""
    if max_shard_size is None:
        model.save_pretrained(out_path)
    else:
        model.save_pretrained(out_path, max_shard_size=max_shard_size)


MTP_FILE_NAME = "model-mtp.safetensors"


def _write_mtp_weights(out_path: pathlib.Path, config, *, seed: int, norm_center: float) -> None:
    """Write ``num_nextn_predict_layers`` MTP modules as DeepSeek-V3 checkpoints lay them out.

    Module ``k`` is ``model.layers.{num_hidden_layers + k}``: a decoder block shaped like the
    last decoder layer (its tensors' names and shapes, as saved) plus ``enorm``, ``hnorm``,
    ``eh_proj``, ``embed_tokens`` and ``shared_head.{norm,head}``. Values follow the wide init of
    :func:`_initialise_weights`. They go to their own file, added to the shard index when there
    is one (as released checkpoints list them).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if num_mtp <= 0:
        return
    num_layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    index_path = out_path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index_path.read_text())["weight_map"].values())) if index_path.is_file() \
        else ["model.safetensors"]
    # The block is an MoE decoder layer: the last MoE layer's tensors, plus attention tensors
    # any layer has (a GLM-5 layer that reuses another's top-k has no indexer; an MTP block
    # runs its own). A model with no MoE layer gets no MTP weights.
    attention_shapes: dict[str, tuple[int, ...]] = {}
    layer_shapes: dict[int, dict[str, tuple[int, ...]]] = {}
    for name in files:
        with safe_open(str(out_path / name), framework="pt") as handle:
            for key in handle.keys():
                parts = key.split(".", 3)
                if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
                    continue
                shape = tuple(handle.get_slice(key).get_shape())
                if parts[3].startswith("self_attn."):
                    attention_shapes[parts[3]] = shape
                layer_shapes.setdefault(int(parts[2]), {})[parts[3]] = shape
    moe_layers = [index for index, shapes in layer_shapes.items() if "mlp.gate.weight" in shapes]
    if not moe_layers:
        logger.info("no MoE layer to shape the MTP block on: no MTP weights written")
        return
    block_shapes = dict(layer_shapes[max(moe_layers)])
    block_shapes.update(attention_shapes)
    generator = torch.Generator().manual_seed(seed + 7919)
    tensors: dict[str, torch.Tensor] = {}
    for module in range(num_mtp):
        prefix = f"model.layers.{num_layers + module}."
        shapes = dict(block_shapes)
        shapes.update({"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
                       "embed_tokens.weight": (vocab, hidden), "shared_head.norm.weight": (hidden,),
                       "shared_head.head.weight": (vocab, hidden)})
        for name, shape in sorted(shapes.items()):
            noise = torch.randn(shape, generator=generator, dtype=torch.float32)
            if name.endswith("bias"):
                value = noise * BIAS_STD
            elif len(shape) == 1:
                value = norm_center + noise * NORM_WEIGHT_STD
            elif name == "embed_tokens.weight":
                value = noise * EMBEDDING_STD
            elif name == "shared_head.head.weight":
                value = noise * (OUTPUT_HEAD_GAIN / math.sqrt(hidden))
            else:
                value = noise * (MATRIX_GAIN / math.sqrt(shape[-1]))
            tensors[prefix + name] = value.contiguous()
    save_file(tensors, str(out_path / MTP_FILE_NAME), metadata={"format": "pt"})
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"].update({name: MTP_FILE_NAME for name in tensors})
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_generation_config(out_path: pathlib.Path, token_ids: Mapping[str, int | None]) -> None:
    """Write ``generation_config.json``: greedy by default, stopping at end-of-text or im_end."""
    import transformers

    generation_config = transformers.GenerationConfig(
        eos_token_id=[token_ids["eos_token_id"], token_ids["im_end_token_id"]],
        pad_token_id=token_ids["pad_token_id"],
        bos_token_id=token_ids["bos_token_id"],
    )
    generation_config.save_pretrained(out_path)


# --------------------------------------------------------------------------------------
# Tokenizer


def _prepare_tokenizer(
    out_path: pathlib.Path,
    vocab_size: int,
    max_position_embeddings: int,
    tokenizer_dir: str | os.PathLike | None,
):
    """Train (or copy from ``tokenizer_dir``) the tokenizer into ``out_path`` and return it loaded."""
    import transformers

    if tokenizer_dir is None:
        train_tokenizer(vocab_size, max_position_embeddings).save_pretrained(out_path)
    else:
        _copy_tokenizer_files(pathlib.Path(tokenizer_dir), out_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_path)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size {vocab_size}")
    return tokenizer


def _copy_tokenizer_files(source: pathlib.Path, destination: pathlib.Path) -> None:
    """Copy the tokenizer files of a model directory made by :func:`make_model`."""
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {source}")
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    for name in names:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)
    logger.info("copied the tokenizer from %s", source)


def _special_token_ids(tokenizer) -> dict[str, int | None]:
    """Return the ids the config and generation config must carry."""
    return {
        "eos_token_id": tokenizer.convert_tokens_to_ids(END_OF_TEXT_TOKEN),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "bos_token_id": None,
        "im_end_token_id": tokenizer.convert_tokens_to_ids(IM_END_TOKEN),
    }


def train_tokenizer(vocab_size: int, model_max_length: int = 4096):
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens on :func:`training_corpus`.

    The corpus fills vocabularies up to about 2,000 tokens; a larger ``vocab_size`` leaves the
    top ids unused by the tokenizer (the model still has rows for them).

    Deterministic. Special tokens take ids 0..3 in the order of ``SPECIAL_TOKENS``; the eos
    token is ``<|endoftext|>``, the pad token ``<|pad|>``, there is no bos token, and the
    ChatML ``chat_template`` is attached. Returns a ``PreTrainedTokenizerFast``.

    The normalizer and pre-tokenizer are exactly those transformers' ``Qwen2Tokenizer``
    rebuilds (NFC, Qwen's split regex, byte-level), so whichever class ``AutoTokenizer``
    picks for the model type encodes the same ids as ``tokenizer.json`` read directly.
    """
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def training_corpus(num_lines: int = 8000, seed: int = 1234) -> Iterator[str]:
    """Yield a deterministic English-like, numeric and code-like corpus of ``num_lines`` lines."""
    generator = random.Random(seed)
    makers = (_sentence, _sentence, _sentence, _named_sentence, _numbers_line, _code_line, _dialogue_line)
    for _ in range(num_lines):
        yield generator.choice(makers)(generator)


_SUBJECTS = (
    "the cat", "a small dog", "my friend", "the teacher", "our team", "the server", "a model", "she", "he",
    "they", "the old man", "every student", "the young woman", "a farmer", "the pilot", "your brother",
    "the committee", "a quiet child", "the engineer", "some people", "the doctor", "this program",
)
_VERBS = (
    "sees", "likes", "reads", "writes", "builds", "finds", "moves", "answers", "sends", "keeps", "opens",
    "counts", "carries", "paints", "remembers", "follows", "explains", "measures", "repairs", "watches",
    "cleans", "borrows", "describes", "collects", "compares", "visits", "loads", "schedules", "returns",
)
_ADJECTIVES = (
    "red", "new", "old", "long", "short", "bright", "dark", "heavy", "light", "quiet", "famous", "simple",
    "strange", "careful", "green", "empty", "warm", "cold", "tiny", "large", "broken", "useful", "hidden",
)
_NOUNS = (
    "book", "letter", "river", "bread", "answer", "house", "car", "token", "garden", "story", "cache",
    "apple", "window", "mountain", "table", "message", "machine", "bridge", "picture", "question", "road",
    "forest", "kitchen", "number", "request", "village", "engine", "pencil", "island", "market", "school",
)
_ENDINGS = (
    "today", "in the morning", "at night", "with care", "very quickly", "again", "before lunch",
    "after the rain", "near the station", "every day", "during the winter", "on the weekend",
    "without a word", "for a long time", "once more", "by the window", "at the end of the week",
)
_SYLLABLES = (
    "ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "an", "is", "qu", "bre", "nix", "ol", "ta", "zu",
    "ber", "chi", "el", "fon", "gra", "hu", "jo", "lin", "mar", "ne", "pi", "ros", "sto", "ul", "wen", "ya",
)
_PUNCTUATION = (".", ".", ".", "!", "?", ";", ",", "...", ":")
_IDENTIFIERS = (
    "value", "count", "items", "result", "index", "total", "name", "buffer", "request", "token", "offset",
    "length", "config", "batch", "state", "output", "prompt", "block", "size", "cursor",
)
_CODE_TEMPLATES = (
    "def {a}({b}):\n    return {b} + {n}",
    "for {a} in range({n}):\n    {b}.append({a})",
    "if {a} > {n}:\n    print(\"{b}\", {a})",
    "{a} = [{n}, {m}, {n} * {m}]",
    "class {A}:\n    def __init__(self, {b}):\n        self.{b} = {b}",
    "{{\"{a}\": {n}, \"{b}\": [{m}, {n}]}}",
    "while {a} < {n}: {a} += 1  # {b}",
    "{a}_{b} = {a}.get(\"{b}\", {m}) or []",
    "assert len({a}) == {n}, f\"bad {b}: {{{a}}}\"",
    "return {{\"{a}\": {a}, \"{b}\": {b}[{n}:{m}]}}",
)


def _noun_phrase(generator: random.Random) -> str:
    """Return a noun phrase such as ``the heavy bridge``."""
    article = generator.choice(("the", "a", "my", "this", "some", "every", "our"))
    if generator.random() < 0.5:
        return f"{article} {generator.choice(_ADJECTIVES)} {generator.choice(_NOUNS)}"
    return f"{article} {generator.choice(_NOUNS)}"


def _sentence(generator: random.Random) -> str:
    """Return one English-like sentence."""
    words = [generator.choice(_SUBJECTS), generator.choice(_VERBS), _noun_phrase(generator)]
    if generator.random() < 0.6:
        words.append(generator.choice(_ENDINGS))
    text = " ".join(words) + generator.choice(_PUNCTUATION)
    return text[0].upper() + text[1:] if generator.random() < 0.7 else text


def _made_up_name(generator: random.Random) -> str:
    """Return a capitalised made-up name of two or three syllables."""
    name = "".join(generator.choice(_SYLLABLES) for _ in range(generator.randint(2, 3)))
    return name.capitalize()


def _named_sentence(generator: random.Random) -> str:
    """Return a sentence about made-up people and places."""
    return (
        f"{_made_up_name(generator)} {generator.choice(_VERBS)} {_noun_phrase(generator)} "
        f"in {_made_up_name(generator)}{generator.choice(_PUNCTUATION)}"
    )


def _numbers_line(generator: random.Random) -> str:
    """Return a line of integers, decimals and arithmetic."""
    first, second = generator.randint(0, 9999), generator.randint(0, 999)
    return (
        f"{first} + {second} = {first + second}, {generator.random():.3f} and "
        f"{generator.randint(1, 12)}/{generator.randint(1, 31)}/{generator.randint(1990, 2030)}"
    )


def _code_line(generator: random.Random) -> str:
    """Return a small code-like snippet."""
    first, second = generator.sample(_IDENTIFIERS, 2)
    template = generator.choice(_CODE_TEMPLATES)
    numbers = {"n": generator.randint(0, 99), "m": generator.randint(0, 99)}
    return template.format(a=first, b=second, A=first.title(), **numbers)


def _dialogue_line(generator: random.Random) -> str:
    """Return a quoted exchange with mixed punctuation."""
    return f"\"{_sentence(generator)}\" asked {_made_up_name(generator)} - \"{_sentence(generator)}\""


# --------------------------------------------------------------------------------------
# Demo model


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the directory of the built-in demo model, building it on first use.

    The directory lives in ``cache_dir``, else ``$TANDEM_CACHE_DIR``, else
    ``~/.cache/tandem``, under a name that hashes the builder and the demo options.
    Safe against concurrent builders: each builds in its own temporary directory and renames
    it into place atomically; a builder that loses the race discards its copy.
    """
    root = _cache_root(cache_dir)
    final = root / _demo_model_name()
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=root))
    try:
        options = dict(DEMO_MODEL_OPTIONS)
        make_model(options.pop("arch"), staging, **options)
        staging.chmod(0o755)  # mkdtemp makes it private to this user
        _publish(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _cache_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """Resolve the cache directory from the argument, ``$TANDEM_CACHE_DIR`` or the home cache."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir)
    from_environment = os.environ.get("TANDEM_CACHE_DIR")
    if from_environment:
        return pathlib.Path(from_environment)
    return pathlib.Path.home() / ".cache" / "tandem"


def _demo_model_name() -> str:
    """Return ``demo-<arch>-<hash>``.

    The hash covers the demo options, this module's source and the transformers and tokenizers
    versions, so any change to how models are built gives a new directory.
    """
    import tokenizers
    import transformers

    digest = hashlib.sha256()
    digest.update(json.dumps(dict(DEMO_MODEL_OPTIONS), sort_keys=True).encode())
    digest.update(pathlib.Path(__file__).read_bytes())
    digest.update(f"{transformers.__version__} {tokenizers.__version__}".encode())
    return f"demo-{DEMO_MODEL_OPTIONS['arch']}-{digest.hexdigest()[:12]}"


def _publish(staging: pathlib.Path, final: pathlib.Path) -> None:
    """Atomically rename ``staging`` to ``final``; if another builder won, keep theirs."""
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
        logger.info("demo model already built by another process: %s", final)


# --------------------------------------------------------------------------------------
# Command line


def add_cli_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``make-model`` subcommand on an argparse ``subparsers`` object.

    The parsed namespace has ``func`` set to :func:`run_cli`. Returns the subparser.
    """
    parser = subparsers.add_parser(
        "make-model",
        help="build a tiny random-weight model with a locally trained tokenizer",
        description="Build a tiny random-weight Hugging Face checkpoint with a locally trained tokenizer.",
    )
    add = parser.add_argument
    add("--arch", choices=architecture_names(), default="llama", help="model architecture (default: %(default)s)")
    add("--out", required=True, help="output directory (created if missing)")
    add("--hidden-size", type=int, default=64, help="hidden size (default: %(default)s)")
    add("--num-layers", type=int, default=2, help="number of decoder layers (default: %(default)s)")
    add("--num-heads", type=int, default=4, help="number of attention heads (default: %(default)s)")
    add("--num-kv-heads", type=int, default=2, help="number of key/value heads (default: %(default)s)")
    add("--head-dim", type=int, default=None, help="per-head dimension (default: hidden size / heads)")
    add("--intermediate-size", type=int, default=128, help="MLP intermediate size (default: %(default)s)")
    add("--vocab-size", type=int, default=512, help=f"vocabulary size, >= {MINIMUM_VOCAB_SIZE} (default: %(default)s)")
    add("--max-position-embeddings", type=int, default=4096, help="maximum context length (default: %(default)s)")
    add("--tie-word-embeddings", action="store_true", help="share the input embedding with the output head")
    add("--rope-scaling", choices=["llama3"], default=None, help="rope scaling scheme (default: none)")
    add("--seed", type=int, default=0, help="random seed for the weights (default: %(default)s)")
    add("--max-shard-size", default=None, help="shard the weights, e.g. 200KB (default: one file)")
    parser.set_defaults(func=run_cli)
    return parser


def run_cli(arguments: argparse.Namespace) -> int:
    """Run :func:`make_model` from parsed ``make-model`` arguments; return 0.

    Progress goes to stderr; stdout gets only the output directory, on one line.
    """
    print(f"building a {arguments.arch} model in {arguments.out} ...", file=sys.stderr, flush=True)
    out_path = make_model(
        arguments.arch,
        arguments.out,
        hidden_size=arguments.hidden_size,
        num_layers=arguments.num_layers,
        num_heads=arguments.num_heads,
        num_kv_heads=arguments.num_kv_heads,
        head_dim=arguments.head_dim,
        intermediate_size=arguments.intermediate_size,
        vocab_size=arguments.vocab_size,
        max_position_embeddings=arguments.max_position_embeddings,
        tie_word_embeddings=arguments.tie_word_embeddings,
        rope_scaling=arguments.rope_scaling,
        seed=arguments.seed,
        max_shard_size=arguments.max_shard_size,
    )
    print(out_path)
    return 0
