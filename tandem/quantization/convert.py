"""Turning a model's linear layers into FP8 ones before its weights load.

A converted layer holds ``weight`` (``float8_e4m3fn [N, K]``, this rank's shard) and
``weight_scale`` (float32 ``[N, ceil(K / block_k)]``, the row-block layout of ``fp8.py``, one
column for per-tensor and per-channel scales), and its product runs through
``Fp8LinearMethod``. Both are parameters, so ``load_by_name`` fills them (stacked parts and
tensor-parallel shards included: the scale's rows shard with the weight's rows; its columns,
by block, with a row-parallel weight's input features). Layers that are not converted keep a
16-bit weight and take the dequantized checkpoint tensor.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tandem.layers.linear import Linear, StackedLinear
from tandem.layers.moe import FusedExperts
from tandem.quantization.config import QuantizationConfig
from tandem.quantization.fp8 import FP8_DTYPE
from tandem.quantization.input_links import link_quantized_inputs
from tandem.quantization.linear_method import Fp8LinearMethod


def _expert_parts(name: str, module: FusedExperts) -> tuple[str, ...]:
    parts = ("gate_proj", "up_proj", "down_proj") if module.gated else ("up_proj", "down_proj")
    return tuple(f"{name}.{expert}.{part}" for expert in range(module.num_experts) for part in parts)


def checkpoint_modules(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Module name → the checkpoint module names whose weights it holds, for every linear layer
    that may be quantized (a stacked layer holds several: ``qkv_proj`` ← q/k/v_proj) and every
    set of routed experts (``experts`` ← ``experts.{e}.{gate,up,down}_proj``)."""
    modules = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            modules[name] = _expert_parts(name, module)
            continue
        if not isinstance(module, Linear) or not module.quantizable:
            continue
        if isinstance(module, StackedLinear):
            parent = name.rsplit(".", 1)[0]
            modules[name] = tuple(f"{parent}.{part}" for part in module.parts)
        else:
            modules[name] = (name,)
    return modules


def plan_conversion(model: nn.Module, quantization: QuantizationConfig,
                    quantized_in_checkpoint: Optional[set[str]]) -> dict[str, tuple[str, ...]]:
    """The layers to convert (module name → its checkpoint module names): every quantizable
    linear layer none of whose parts is ignored and, for a quantized checkpoint, all of whose
    parts the checkpoint holds in FP8 (``quantized_in_checkpoint``; None: online or dummy
    weights, where every such layer is converted). Routed experts convert only from an FP8
    checkpoint (online quantization leaves them 16-bit)."""
    plan = {}
    modules = dict(model.named_modules())
    for name, parts in checkpoint_modules(model).items():
        if isinstance(modules[name], FusedExperts) and quantization.method == "fp8-online":
            continue
        if any(quantization.is_ignored(part) for part in parts):
            continue
        if quantized_in_checkpoint is not None and not all(part in quantized_in_checkpoint for part in parts):
            continue
        plan[name] = parts
    return plan


def _scale_shard(weight: torch.Tensor, block_columns: Optional[int], in_features: int):
    """The scale's ``tensor_shard`` (see ``mark_sharded``) from the weight's: rows shard alike;
    a row-parallel weight's input features shard by scale block."""
    shard = getattr(weight, "tensor_shard", None)
    if shard is None:
        return None
    axis, rank, size, segments = shard
    if axis == 0:
        return shard
    if block_columns is None:
        return None  # one scale per row: every rank holds all of them
    if in_features % block_columns:
        raise ValueError(f"tensor_parallel_size: {size} splits a row-parallel weight's {sum(segments)} input "
                         f"features into {in_features} per rank, not a multiple of the "
                         f"quantization_config.weight_block_size columns ({block_columns})")
    return (1, rank, size, (-(-sum(segments) // block_columns),))


def convert_linear(module: Linear, block_columns: Optional[int], device: torch.device) -> None:
    """Replace ``module``'s weight by an FP8 one of the same shape on ``device`` and add its
    scale (values arrive with the checkpoint)."""
    out_features, in_features = module.weight.shape
    weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                          requires_grad=False)
    columns = 1 if block_columns is None else -(-in_features // block_columns)
    scale = nn.Parameter(torch.ones(out_features, columns, dtype=torch.float32, device=device), requires_grad=False)
    shard = getattr(module.weight, "tensor_shard", None)
    if shard is not None:
        weight.tensor_shard = shard
    scale_shard = _scale_shard(module.weight, block_columns, in_features)
    if scale_shard is not None:
        scale.tensor_shard = scale_shard
    module.weight = weight
    module.weight_scale = scale
    module.weight_method = Fp8LinearMethod(block_columns)


def _release_weights(module: nn.Module) -> torch.device:
    """Move ``module``'s 16-bit weights to the meta device (shape, dtype and shard kept, memory
    freed) and return the device they were on."""
    names = module.fused_parameter_names if isinstance(module, FusedExperts) else ("weight",)
    device = getattr(module, names[0]).device
    for name in names:
        weight = getattr(module, name)
        placeholder = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)
        if hasattr(weight, "tensor_shard"):
            placeholder.tensor_shard = weight.tensor_shard
        setattr(module, name, placeholder)
    return device


def convert_model(model: nn.Module, quantization: QuantizationConfig, plan: dict[str, tuple[str, ...]]) -> None:
    """Convert every layer of ``plan`` (``plan_conversion``).

    Every 16-bit weight is released, and the allocator's cache emptied on CUDA, before the
    first FP8 weight is allocated: allocated one by one in between, the FP8 weights would land
    in the freed 16-bit weights' cached blocks and pin them (a 20 MiB segment held for a 4 MiB
    weight), so the memory planner, which reads the device's free memory, would see fewer
    bytes than FP8 saves. The peak is the 16-bit model, not 16-bit plus FP8.

    Then each norm or activation whose output only an FP8 layer reads is linked to it, so that
    on CUDA it writes that input already quantized (``link_quantized_inputs``)."""
    modules = dict(model.named_modules())
    devices = {name: _release_weights(modules[name]) for name in plan}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for name in plan:
        if isinstance(modules[name], FusedExperts):
            modules[name].to_fp8(quantization.block_columns, devices[name])
        else:
            convert_linear(modules[name], quantization.block_columns, devices[name])
    link_quantized_inputs(model)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are held (FP8 weights at one byte,
    their scales included; a tied tensor once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if tensor.device.type != "meta" and key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total
