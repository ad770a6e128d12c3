"""Build tiny random-weight Hugging Face checkpoints with a locally trained tokenizer.

Every test and the demo server use models made here: nothing is ever downloaded. A model
directory holds ``config.json``, ``generation_config.json``, safetensors weights (one file,
or shards plus ``model.safetensors.index.json``) and the tokenizer files, so
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it.

Weights are re-initialised wider than the Hugging Face default so that next-token logits are
well separated (tests compare greedy tokens of two implementations in fp32) while greedy
continuations still vary.

To support another architecture, add one entry to :func:`architecture_table`. The tokenizer is
made in ``tokenizer_maker.py``, the weights' wide init and MTP modules' weights in ``made_weights.py``, the cached demo model
in ``demo_model.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import sys
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tandem.tools.made_weights import initialise_weights, write_mtp_weights
from tandem.tools.quantized_checkpoint import FORMATS, quantization_section, quantize_checkpoint
from tandem.tools.tokenizer_maker import MINIMUM_VOCAB_SIZE, prepare_tokenizer, special_token_ids

logger = logging.getLogger(__name__)

LLAMA3_ROPE_FACTOR = 8.0
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0

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
    # ``made_weights.write_mtp_weights``. transformers builds no MTP module, so they are drawn there.
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
            # Qwen3 attention with softmax-routed experts (8, 2 per token, weights renormalised);
            # every layer sparse except layer 1 (``mlp_only_layers``), which keeps a dense MLP.
            "qwen3_moe": ArchitectureSpec(
                "Qwen3MoeConfig",
                "Qwen3MoeForCausalLM",
                {
                    "attention_bias": False,
                    "use_sliding_window": False,
                    "num_experts": 8,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "norm_topk_prob": True,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [1],
                },
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
    config_overrides: Mapping[str, Any] | None = None,
    quantize: str | None = None,
    weight_block_size: tuple[int, int] = (128, 128),
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
    ``config_overrides`` are config arguments set last, over the architecture's tiny defaults
    (e.g. a released MoE's expert count and sizes for a benchmark shape).
    ``quantize`` rewrites the weights in an FP8 format (``quantized_checkpoint.FORMATS``:
    ``"fp8"`` block-scaled in ``weight_block_size`` blocks, ``"fp8-per-tensor"``,
    ``"compressed-tensors"`` per channel). Returns ``out_dir`` as a path.

    The config's ``eos_token_id``/``pad_token_id``/``bos_token_id`` equal the tokenizer's
    (bos is None) and every tokenizer id is below ``vocab_size``.
    """
    spec = _lookup_architecture(arch)
    _validate_shape(hidden_size, num_heads, num_kv_heads, head_dim, vocab_size)
    out_path = pathlib.Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("building %s model (hidden %d, %d layers) in %s", arch, hidden_size, num_layers, out_path)
    tokenizer = prepare_tokenizer(out_path, vocab_size, max_position_embeddings, tokenizer_dir)
    token_ids = special_token_ids(tokenizer)
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
        overrides=config_overrides or {},
    )
    if not weights:
        config.architectures = [spec.model_class]
        config.save_pretrained(out_path)
        _write_generation_config(out_path, token_ids)
        if quantize is not None:
            _add_quantization_config(out_path, quantize, weight_block_size)
        return out_path
    model = _build_model(spec, config, seed=seed, init_std=init_std)
    _save_model(model, out_path, max_shard_size)
    if spec.mtp_weights:
        write_mtp_weights(out_path, config, seed=seed, norm_center=spec.norm_weight_center)
    if quantize is not None:
        quantize_checkpoint(out_path, quantize, weight_block_size)
    _write_generation_config(out_path, token_ids)
    logger.info("built %s model in %s (%.1f s)", arch, out_path, time.perf_counter() - started)
    return out_path


def _add_quantization_config(out_path: pathlib.Path, form: str, block: tuple[int, int]) -> None:
    """A config-only directory (``weights=False``) announcing FP8 weights: ``--load-format
    dummy`` then makes random FP8 weights in that format."""
    import json

    config_file = out_path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = quantization_section(form, tuple(block), ())
    config_file.write_text(json.dumps(config, indent=2))


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


def _build_config(spec: ArchitectureSpec, *, token_ids: Mapping[str, int | None], overrides: Mapping[str, Any],
                  **shape: Any):
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
    arguments.update(overrides)
    return config_class(**arguments)


def _build_model(spec: ArchitectureSpec, config, *, seed: int, init_std: float | None):
    """Return the float32 model of ``config`` with seeded, widened random weights (eval mode)."""
    import transformers

    model_class = getattr(transformers, spec.model_class)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    initialise_weights(model, generator, init_std=init_std, norm_center=spec.norm_weight_center)
    return model.eval()


def _save_model(model, out_path: pathlib.Path, max_shard_size: int | str | None) -> None:
    """Save weights and config; transformers 5 always writes safetensors."""
    if max_shard_size is None:
        model.save_pretrained(out_path)
    else:
        model.save_pretrained(out_path, max_shard_size=max_shard_size)


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
    add("--quantize", choices=FORMATS, default=None,
        help="write FP8 weights: fp8 (block-scaled float32 weight_scale_inv, as DeepSeek/GLM/Qwen ship), "
             "fp8-per-tensor, or compressed-tensors (per-channel weight_scale) (default: float32)")
    add("--weight-block-size", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLUMNS"),
        help="block of one scale for --quantize fp8 (default: 128 128)")
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
        quantize=arguments.quantize,
        weight_block_size=tuple(arguments.weight_block_size),
    )
    print(out_path)
    return 0
