"""Loading a Hugging Face model directory: config, weights (single or sharded safetensors, or
random ``dummy`` weights of the configured shape), and the facts the engine needs."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from tandem.models.registry import model_class_for
from tandem.parallel.shard import SINGLE, TensorShard
from tandem.quantization.checkpoint import checkpoint_tensors, quantized_modules
from tandem.quantization.config import QuantizationConfig, describe, quantization_config_of
from tandem.quantization.convert import convert_model, plan_conversion, weight_bytes
from tandem.quantization.fp8 import FP8_DTYPE

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    hidden_size: int
    quantization: str = "none"  # QuantizationConfig.describe(): part of the PD handshake
    weight_bytes: int = 0  # the model's parameters as held on the device (FP8 weights at a byte)


def load_config(model_dir: str):
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model_dir!r} is not a model directory (no config.json)")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def resolve_dtype(dtype: str, config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = DTYPES.get(configured)
    return torch.bfloat16 if configured in (None, torch.float32) else configured


def eos_token_ids(model_dir: str, config) -> tuple[int, ...]:
    ids: list[int] = []

    def add(value) -> None:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))

    add(getattr(config, "eos_token_id", None))
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    return tuple(ids)


def _safetensors_files(model_dir: str) -> list[str]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no safetensors files in {model_dir!r} (use load_format='dummy' "
                         "for random weights)")
    return files


def checkpoint_tensor_names(model_dir: str) -> list[str]:
    """Every tensor name in the checkpoint (headers only; no tensor is read)."""
    from safetensors import safe_open

    names: list[str] = []
    for name in _safetensors_files(model_dir):
        with safe_open(str(Path(model_dir) / name), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    path = Path(model_dir)
    for name in _safetensors_files(model_dir):
        with safe_open(str(path / name), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def initialize_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights of the configured shape (normal, std 0.02; norms at the model's
    ``dummy_norm_weight``: 1, or 0 for ``x * (1 + w)`` norms). FP8 weights: standard normal
    values with every scale 0.02 (the same spread)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    norm_weight = getattr(model, "dummy_norm_weight", 1.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype == FP8_DTYPE:
                param.copy_(torch.empty(param.shape, device=device).normal_(0.0, 1.0, generator=generator))
            elif name.endswith("weight_scale"):
                param.fill_(0.02)
            elif "norm" in name:
                param.fill_(norm_weight)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _model_class(config, model_dir: str, tensor_shard: TensorShard):
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture is None:
        raise ValueError(f"model: config.json in {model_dir!r} names no architectures")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("model: sliding-window attention is not supported for this architecture yet")
    model_class = model_class_for(architecture)
    if tensor_shard.is_parallel and "tensor_shard" not in getattr(model_class, "engine_options", ()):
        raise ValueError(f"tensor_parallel_size: {tensor_shard.size} is not supported for {architecture} yet "
                         "(use tensor_parallel_size=1)")
    return architecture, model_class


def _model_len(config, max_model_len: Optional[int]) -> int:
    configured_len = getattr(config, "max_position_embeddings", None) or 4096
    if max_model_len is not None and max_model_len > configured_len:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's "
                         f"max_position_embeddings ({configured_len})")
    return max_model_len or configured_len


def _construct(model_class, config, torch_dtype: torch.dtype, model_len: int, device: torch.device, **options):
    """The model's modules on ``device``, parameters uninitialised. Engine options a class names
    in ``engine_options`` are passed to its constructor."""
    previous_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch_dtype)
        with torch.device(device):
            return model_class(config, torch_dtype, model_len,
                               **{name: options[name] for name in getattr(model_class, "engine_options", ())})
    finally:
        torch.set_default_dtype(previous_dtype)


def check_tensor_parallel(model_dir: str, size: int, *, max_model_len: Optional[int],
                          indexer_cache_dtype: str = "fp8", quantization: Optional[str] = None) -> None:
    """Raise the error a rank would raise building its shard (an unsupported family or
    quantization, a size that does not divide the heads or a row-parallel weight's scale
    blocks) before any rank process starts: the model is built on the meta device (no memory,
    no weights)."""
    config = load_config(model_dir)
    shard = TensorShard(0, size, None)
    _, model_class = _model_class(config, model_dir, shard)
    quantized = quantization_config_of(config, quantization)
    try:
        model = _construct(model_class, config, torch.float32, _model_len(config, max_model_len),
                           torch.device("meta"), indexer_cache_dtype=indexer_cache_dtype, tensor_shard=shard)
        if quantized is not None:
            convert_model(model, quantized, plan_conversion(model, quantized, None))
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - a constructor that cannot run on meta: the ranks will tell
        pass


def model_state_specs(model_dir: str, *, dtype: str, device: torch.device, max_model_len: Optional[int],
                      indexer_cache_dtype: str = "fp8") -> dict:
    """The state specs ``build_model`` 's model would declare on ``device``, from a build on the
    meta device (no memory, no weights): what a rank that does not run a model registers for it."""
    config = load_config(model_dir)
    _, model_class = _model_class(config, model_dir, SINGLE)
    model = _construct(model_class, config, resolve_dtype(dtype, config, device), _model_len(config, max_model_len),
                       torch.device("meta"), indexer_cache_dtype=indexer_cache_dtype, tensor_shard=SINGLE)
    return model.state_specs()


def _prepare_quantized(model, quantization: QuantizationConfig, model_dir: str, load_format: str,
                       fp8_compute: bool) -> tuple[set[str], set[str]]:
    """Convert the linear layers that compute in FP8 (``fp8_compute``) and return the
    checkpoint module names whose weights arrive as FP8 (``keep_fp8``) and, for online
    quantization, those quantized at load (``online``)."""
    in_checkpoint = None  # dummy weights: every layer that may be FP8 is
    if load_format != "dummy":
        names = checkpoint_tensor_names(model_dir)
        # online: the layers whose weights the checkpoint holds under their own names (not, e.g.,
        # multi-token-prediction layers loaded under other names, which stay 16-bit)
        in_checkpoint = (quantized_modules(names, quantization) if quantization.method != "fp8-online" else
                         {name[:-len(".weight")] for name in names if name.endswith(".weight")})
    plan = plan_conversion(model, quantization, in_checkpoint)
    parts = {part for names in plan.values() for part in names}
    if fp8_compute:
        convert_model(model, quantization, plan)
    return (parts if fp8_compute else set()), (parts if quantization.method == "fp8-online" else set())


def build_model(model_dir: str, *, dtype: str, load_format: str, device: torch.device,
                max_model_len: Optional[int], seed: int, indexer_cache_dtype: str = "fp8",
                tensor_shard: TensorShard = SINGLE, quantization: Optional[str] = None,
                fp8_compute: Optional[bool] = None):
    """Returns ``(model, config, ModelInfo)``; the model is on ``device`` in eval mode.

    Engine options a model class names in its ``engine_options`` class attribute are passed to
    its constructor as keyword arguments (e.g. ``indexer_cache_dtype`` for DSA models); a class
    that shards under tensor parallelism names ``tensor_shard`` (this rank's place in the group).

    Quantized weights (``tandem/quantization``: the checkpoint's ``quantization_config``, or
    ``quantization="fp8"`` for online FP8): with ``fp8_compute`` (default: on CUDA) the linear
    layers keep FP8 weights and compute FP8 products; otherwise (CPU) every weight is
    dequantized at load, so a CPU run computes exactly what the checkpoint means."""
    config = load_config(model_dir)
    architecture, model_class = _model_class(config, model_dir, tensor_shard)
    quantized = quantization_config_of(config, quantization)
    if quantized is None and fp8_compute is not None:
        raise ValueError(f"quantized_compute: {'fp8' if fp8_compute else 'dequantized'!r} applies to quantized "
                         "weights, and this model has none (quantization='fp8' quantizes it at load)")
    torch_dtype = resolve_dtype(dtype, config, device)
    model_len = _model_len(config, max_model_len)
    model = _construct(model_class, config, torch_dtype, model_len, device,
                       indexer_cache_dtype=indexer_cache_dtype, tensor_shard=tensor_shard)
    keep_fp8, online = set(), set()
    if quantized is not None:
        fp8_compute = device.type == "cuda" if fp8_compute is None else fp8_compute
        keep_fp8, online = _prepare_quantized(model, quantized, model_dir, load_format, fp8_compute)
    if load_format == "dummy":
        initialize_dummy(model, seed)
    else:
        model.load_weights(checkpoint_tensors(iterate_safetensors(model_dir), quantized, keep_fp8, online))
    model.eval()
    if device.type == "cuda":
        # The memory planner reads the device's free memory: what loading allocated and freed
        # (dummy FP8 values drawn in float32, dequantized or converted tensors) must not stay
        # in the allocator's cache, counted as used.
        torch.cuda.empty_cache()
    info = ModelInfo(architecture=architecture, vocab_size=config.vocab_size, max_model_len=model_len,
                     eos_token_ids=eos_token_ids(model_dir, config), dtype=torch_dtype,
                     hidden_size=config.hidden_size,
                     quantization=describe(quantized) + ("" if quantized is None else
                                                         "/fp8" if fp8_compute else "/dequantized"),
                     weight_bytes=weight_bytes(model))
    logger.info("model weights: %.3f GiB (quantization %s)", info.weight_bytes / 2**30, info.quantization)
    return model, config, info
