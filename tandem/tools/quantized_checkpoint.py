"""Rewrite a float checkpoint made by ``make_model`` in an FP8 format, as released FP8
checkpoints are laid out (for tests and demos; ``tandem make-model --quantize``):

- ``fp8``: every linear projection weight ``float8_e4m3fn`` with a float32 ``weight_scale_inv``
  per ``weight_block_size`` block (partial blocks at the edges), ``quantization_config:
  {quant_method: fp8, weight_block_size, activation_scheme: dynamic, modules_to_not_convert}``
  (DeepSeek-V3/V3.2, GLM-5, Qwen3 ``-FP8``);
- ``fp8-per-tensor``: the same without ``weight_block_size``: one scale per weight;
- ``compressed-tensors``: llm-compressor's FP8 (``float-quantized``): per output channel
  ``weight_scale [N, 1]``, dynamic per-token activations, ``ignore: [lm_head, ...]``.

Embeddings, the LM head, norms, MoE routers and the modules named in ``keep`` stay float.
"""
from __future__ import annotations

import json
import pathlib
from typing import Iterable, Optional

import torch

from tandem.quantization.fp8 import quantize_blocks, quantize_rows

FORMATS = ("fp8", "fp8-per-tensor", "compressed-tensors")
# Checkpoint modules never quantized (matched as whole dotted name parts): what released FP8
# checkpoints keep in 16 bits.
UNQUANTIZED_MODULES = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate", "shared_expert_gate")


def _module_of(name: str) -> Optional[str]:
    return name[:-len(".weight")] if name.endswith(".weight") else None


def _matches(module: str, patterns: Iterable[str]) -> bool:
    return any(f".{module}.".find(f".{pattern}.") >= 0 for pattern in patterns)


def _quantizes(name: str, tensor: torch.Tensor, keep: tuple[str, ...]) -> bool:
    module = _module_of(name)
    return (module is not None and tensor.dim() == 2 and tensor.is_floating_point() and "norm" not in
            module.rsplit(".", 1)[-1] and not _matches(module, UNQUANTIZED_MODULES + keep))


def _quantized_tensors(name: str, tensor: torch.Tensor, form: str, block: tuple[int, int]) -> dict:
    module = _module_of(name)
    if form == "compressed-tensors":
        weight, scale = quantize_rows(tensor)
        return {name: weight, f"{module}.weight_scale": scale}
    if form == "fp8-per-tensor":
        weight, scale = quantize_blocks(tensor, tuple(tensor.shape))
        return {name: weight, f"{module}.weight_scale_inv": scale.reshape(())}
    weight, scale = quantize_blocks(tensor, block)
    return {name: weight, f"{module}.weight_scale_inv": scale}


def quantization_section(form: str, block: tuple[int, int], keep: tuple[str, ...]) -> dict:
    """The ``quantization_config`` written to config.json for ``form``."""
    not_converted = list(UNQUANTIZED_MODULES + keep)
    if form == "compressed-tensors":
        scheme = {"targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                              "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                        "dynamic": True}}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": scheme}, "ignore": ["lm_head", *keep]}
    section = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": not_converted}
    if form == "fp8":
        section["weight_block_size"] = list(block)
    return section


def quantize_checkpoint(model_dir, form: str = "fp8", weight_block_size: tuple[int, int] = (128, 128),
                        keep: Iterable[str] = ()) -> pathlib.Path:
    """Rewrite ``model_dir``'s safetensors files (and index) in ``form`` and add its
    ``quantization_config`` to config.json. ``keep``: more module names to leave float."""
    from safetensors.torch import load_file, save_file

    if form not in FORMATS:
        raise ValueError(f"quantize: {form!r} is not a known format; known: {', '.join(FORMATS)}")
    path, keep, block = pathlib.Path(model_dir), tuple(keep), tuple(weight_block_size)
    weight_map = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors = {}
        for name, tensor in load_file(str(file)).items():
            tensors.update(_quantized_tensors(name, tensor, form, block) if _quantizes(name, tensor, keep)
                           else {name: tensor})
        save_file(tensors, str(file), metadata={"format": "pt"})
        weight_map.update({name: file.name for name in tensors})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        contents = json.loads(index.read_text())
        contents["weight_map"] = dict(sorted(weight_map.items()))
        index.write_text(json.dumps(contents, indent=2))
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = quantization_section(form, block, keep)
    config_file.write_text(json.dumps(config, indent=2))
    return path
