"""Which quantized formats load, read from ``config.json``'s ``quantization_config`` and the
``quantization`` engine option (``--quantization``), and nothing else: a format not listed here
refuses at start, naming the field, rather than loading wrong.

Formats (``QuantizationConfig.method``):

- ``"fp8"``: ``quant_method: "fp8"`` (DeepSeek-V3/V3.2, GLM-5, Qwen3 ``-FP8``): FP8 weights
  with float32 ``weight_scale_inv`` per ``weight_block_size`` block, or one per tensor without
  it; activations quantized dynamically. ``modules_to_not_convert`` stay 16-bit.
- ``"compressed-tensors"``: llm-compressor's FP8 (``format: float-quantized``): FP8 weights
  with ``weight_scale`` per tensor or per output channel, dynamic per-token (or per-tensor)
  activations. ``ignore`` names modules left 16-bit (``re:`` prefixes a regular expression).
- ``"fp8-online"``: ``quantization="fp8"`` on an unquantized checkpoint: each linear weight
  quantized per output channel at load (as vLLM's ``--quantization fp8``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from tandem.config import QUANTIZATION_CHOICES

SUPPORTED_CHECKPOINT_FORMATS = ("fp8 (block-scaled weight_block_size, or per-tensor)",
                                "compressed-tensors (FP8 weights per tensor or per channel)")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "fp8", "compressed-tensors" or "fp8-online"
    # "block" (weight_block), "tensor" (one scale per weight) or "channel" (one per output row)
    weight_strategy: str
    weight_block: Optional[tuple[int, int]] = None  # (rows, columns) of a scale block
    ignored: tuple[str, ...] = ()  # modules kept 16-bit (names, dotted parts, or "re:" patterns)
    scale_suffix: str = "weight_scale_inv"  # the checkpoint tensor holding each weight's scale

    @property
    def block_columns(self) -> Optional[int]:
        """Input features per weight scale column (None: one column for the whole row)."""
        return self.weight_block[1] if self.weight_block is not None else None

    def describe(self) -> str:
        """A stable one-line name: part of the PD handshake and the disk-tier fingerprint."""
        block = f"-{self.weight_block[0]}x{self.weight_block[1]}" if self.weight_block else ""
        return f"{self.method}:{self.weight_strategy}{block}"

    def is_ignored(self, module_name: str) -> bool:
        """Whether checkpoint module ``module_name`` (e.g. ``model.layers.0.self_attn.q_proj``)
        stays unquantized."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return True
            elif f".{module_name}.".find(f".{pattern}.") >= 0:
                return True
        return False


def describe(quantization: Optional[QuantizationConfig]) -> str:
    return "none" if quantization is None else quantization.describe()


def _unsupported(method) -> ValueError:
    return ValueError(f"quantization_config.quant_method: {method!r} is not supported; tandem loads "
                      f"{' and '.join(SUPPORTED_CHECKPOINT_FORMATS)} checkpoints, and quantizes a "
                      f"bf16/fp32 checkpoint to FP8 at load with quantization='fp8' (--quantization fp8)")


def _fp8_config(section: dict) -> QuantizationConfig:
    scheme = section.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme: {scheme!r} is not supported (only 'dynamic')")
    ignored = tuple(section.get("modules_to_not_convert") or ())
    block = section.get("weight_block_size")
    if block is None:
        return QuantizationConfig("fp8", "tensor", None, ignored)
    if len(block) != 2 or not all(isinstance(size, int) and size > 0 for size in block):
        raise ValueError(f"quantization_config.weight_block_size: must be two positive integers, got {block!r}")
    return QuantizationConfig("fp8", "block", (int(block[0]), int(block[1])), ignored)


def _compressed_tensors_config(section: dict) -> QuantizationConfig:
    form = section.get("format", "float-quantized")
    if form not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format: {form!r} is not supported for compressed-tensors "
                         "(FP8 'float-quantized' only)")
    groups = section.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: one FP8 group is supported, got {len(groups)}")
    (name, group), = groups.items()
    weights = group.get("weights") or {}
    field = f"quantization_config.config_groups.{name}"
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ValueError(f"{field}.weights: only 8-bit float weights are supported, got "
                         f"num_bits={weights.get('num_bits')!r} type={weights.get('type')!r}")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or weights.get("dynamic"):
        raise ValueError(f"{field}.weights.strategy: {strategy!r} is not supported (static 'tensor' or 'channel')")
    activations = group.get("input_activations")
    if activations is not None and not (activations.get("dynamic") and activations.get("num_bits") == 8
                                        and activations.get("type") == "float"):
        raise ValueError(f"{field}.input_activations: only dynamic 8-bit float activations are supported")
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise ValueError(f"{field}.targets: only ['Linear'] is supported, got {targets!r}")
    return QuantizationConfig("compressed-tensors", strategy, None, tuple(section.get("ignore") or ()),
                              scale_suffix="weight_scale")


def quantization_config_of(hf_config, requested: Optional[str]) -> Optional[QuantizationConfig]:
    """The model's quantization from its ``quantization_config`` and the ``quantization``
    engine option; None for unquantized weights. Raises ValueError naming the field for anything
    that is not supported."""
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization: must be one of {QUANTIZATION_CHOICES} or None, got {requested!r}")
    section = getattr(hf_config, "quantization_config", None)
    if section is not None and not isinstance(section, dict):
        section = section.to_dict() if hasattr(section, "to_dict") else dict(vars(section))
    if not section:
        if requested == "fp8":
            return QuantizationConfig("fp8-online", "channel", None, ("lm_head",))
        return None
    method = section.get("quant_method")
    if method == "fp8":
        return _fp8_config(section)
    if method == "compressed-tensors":
        if requested is not None:
            raise ValueError(f"quantization: {requested!r} does not match the checkpoint's "
                             "quantization_config.quant_method 'compressed-tensors' (leave it unset: the "
                             "checkpoint's FP8 weights load as they are)")
        return _compressed_tensors_config(section)
    raise _unsupported(method)
