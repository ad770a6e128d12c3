"""The weights of a made checkpoint: the wide random init every parameter gets
(:func:`initialise_weights`), and DeepSeek-style MTP (next-n) modules, which transformers does not
build, drawn the same way and laid out as released checkpoints lay them out
(:func:`write_mtp_weights`).
"""

from __future__ import annotations

import json
import logging
import math
import pathlib

import torch

logger = logging.getLogger("tandem.tools.make_model")

# Weight init (see initialise_weights), chosen by measuring 64-token greedy rollouts from
# random prompts for every architecture, tied and untied, hidden 64 and 256: the fp32 logits
# have std ~3, the median top-1/top-2 gap is ~0.4-0.8 (under 1e-2 at ~1% of steps) and a
# rollout has ~20-60 distinct tokens. A gain of 2 lets the layers outweigh the embedding in
# the residual stream, so a tied output head does not just repeat the current token.
MATRIX_GAIN = 2.0
EMBEDDING_STD = 1.0
OUTPUT_HEAD_GAIN = 3.0
BIAS_STD = 0.5
NORM_WEIGHT_STD = 0.2


@torch.no_grad()
def initialise_weights(
    model: torch.nn.Module, generator: torch.Generator, *, init_std: float | None, norm_center: float
) -> None:
    """Overwrite every parameter with a wide random init, in ``named_parameters`` order.

    Untied input embedding ~ N(0, EMBEDDING_STD); the output head, tied or not, ~ N(0,
    OUTPUT_HEAD_GAIN / sqrt(hidden)) so logits have std ~OUTPUT_HEAD_GAIN; other weight matrices ~
    N(0, MATRIX_GAIN / sqrt(fan_in)) or N(0, init_std); biases ~ N(0, BIAS_STD); 1-D (norm)
    weights ~ N(norm_center, NORM_WEIGHT_STD). Tied parameters appear once and are drawn once.
    """
    stds = matrix_stds(model, init_std)
    for name, parameter in model.named_parameters():
        matrix_std = stds.get(id(parameter), MATRIX_GAIN / math.sqrt(parameter.shape[-1]))
        parameter.copy_(draw(name, parameter.shape, generator, norm_center, matrix_std))


def draw(name: str, shape, generator: torch.Generator, norm_center: float, matrix_std: float) -> torch.Tensor:
    """One tensor of the wide init: a bias ~ N(0, BIAS_STD), a 1-D (norm) weight ~ N(norm_center,
    NORM_WEIGHT_STD), a matrix ~ N(0, matrix_std)."""
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("bias"):
        return noise * BIAS_STD
    if len(shape) == 1:
        return norm_center + noise * NORM_WEIGHT_STD
    return noise * matrix_std


def matrix_stds(model: torch.nn.Module, init_std: float | None) -> dict[int, float]:
    """Map ``id(parameter)`` to its std for the embeddings and the output head.

    With ``init_std`` set, every weight matrix uses it. Otherwise the input embedding, the output
    head get their own stds, the output head's winning when the two are tied (see
    :func:`initialise_weights`).
    """
    if init_std is not None:
        return {id(parameter): init_std for parameter in model.parameters() if parameter.dim() >= 2}
    input_weight = model.get_input_embeddings().weight
    output_weight = model.get_output_embeddings().weight
    stds = {id(input_weight): EMBEDDING_STD}
    stds[id(output_weight)] = OUTPUT_HEAD_GAIN / math.sqrt(output_weight.shape[-1])
    return stds

MTP_FILE_NAME = "model-mtp.safetensors"


def write_mtp_weights(out_path: pathlib.Path, config, *, seed: int, norm_center: float) -> None:
    """Write ``num_nextn_predict_layers`` MTP modules as DeepSeek-V3 checkpoints lay them out.

    Module ``k`` is ``model.layers.{num_hidden_layers + k}``: a decoder block shaped like the
    last decoder layer (its tensors' names and shapes, as saved) plus ``enorm``, ``hnorm``,
    ``eh_proj``, ``embed_tokens`` and ``shared_head.{norm,head}``. Values follow the wide init of
    :func:`initialise_weights`. They go to their own file, added to the shard index when there
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
            matrix_std = {"embed_tokens.weight": EMBEDDING_STD,
                          "shared_head.head.weight": OUTPUT_HEAD_GAIN / math.sqrt(hidden)}.get(
                name, MATRIX_GAIN / math.sqrt(shape[-1]))
            tensors[prefix + name] = draw(name, shape, generator, norm_center, matrix_std).contiguous()
    save_file(tensors, str(out_path / MTP_FILE_NAME), metadata={"format": "pt"})
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"].update({name: MTP_FILE_NAME for name in tensors})
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
