"""Linear layers and checkpoint loading by name.

``StackedLinear`` computes several checkpoint projections (q/k/v, gate/up) as one matrix
product; each checkpoint tensor is copied into its row slice when loading. Under tensor
parallelism (``tandem/parallel``) each part keeps this rank's rows only (column parallel), and a
parameter marked with ``mark_sharded`` loads its rank's slice of the checkpoint tensor.

Every projection is a ``Linear`` (or a subclass): its product goes through ``linear_product``,
which a quantized layer's ``weight_method`` (set by ``tandem/quantization``) replaces, so model
code never knows whether a weight is FP8.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.gemv import gemv, gemv_serves
from tandem.parallel.shard import SINGLE, TensorShard


def mark_sharded(param: torch.Tensor, axis: int, shard: TensorShard, full_size) -> None:
    """``param`` holds rank ``shard.rank``'s consecutive slice along ``axis`` of a checkpoint
    tensor whose size there is ``full_size`` (the last rank's slice may be padded). A tuple of
    sizes names segments laid end to end there (q | k | v channels): the rank's slice of each,
    concatenated."""
    if shard.is_parallel:
        segments = tuple(full_size) if isinstance(full_size, (tuple, list)) else (full_size,)
        param.tensor_shard = (axis, shard.rank, shard.size, segments)


def shard_of(tensor: torch.Tensor, axis: int, rank: int, size: int, segments: tuple[int, ...]) -> torch.Tensor:
    """Rank ``rank``'s slice (of each segment) of a full checkpoint tensor along ``axis``; one
    segment that ``size`` does not divide is cut in ceil-sized slices (the last one short)."""
    if len(segments) == 1:
        rows = -(-segments[0] // size)
        start = min(rank * rows, segments[0])
        return tensor.narrow(axis, start, max(0, min(rows, segments[0] - start)))
    parts, offset = [], 0
    for full in segments:
        rows = full // size
        parts.append(tensor.narrow(axis, offset + rank * rows, rows))
        offset += full
    return torch.cat(parts, dim=axis)


def dense_product(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``hidden @ weight.T (+ bias)`` for a 16-bit or float32 weight: one or two tokens on CUDA
    (a batch-1 decode step; fixed per captured graph) take ``gemv``, which reads a 16-bit weight
    closer to the memory's rate than cuBLAS does there; everything else ``F.linear``."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if not gemv_serves(flat, weight):
        return F.linear(hidden, weight, bias)
    output = gemv(flat, weight)
    if bias is not None:
        output = output + bias
    return output.reshape(*hidden.shape[:-1], weight.shape[0])


def linear_product(module: nn.Linear, hidden: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
    """``hidden @ weight.T (+ bias)`` of ``module``, computed by its ``weight_method`` when its
    weight is quantized (``weight_method.apply(module, hidden, bias)``)."""
    bias = module.bias if with_bias else None
    method = getattr(module, "weight_method", None)
    if method is None:
        return dense_product(hidden, module.weight, bias)
    return method.apply(module, hidden, bias)


def gated_silu_product(module: nn.Linear, hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """``silu(gate) * up`` of a stacked ``[gate; up]`` projection without a bias, computed by the
    product's own kernel where that is ``gemv`` (CUDA, the one- and two-token decode steps of a
    16-bit weight, one token of an FP8 one: ``weight_method.gated_silu``): bit for bit the product
    followed by ``silu_and_mul``, one launch fewer. None where the product is another kernel."""
    if module.bias is not None or hidden.dim() != 2:
        return None
    method = getattr(module, "weight_method", None)
    if method is not None:
        gated = getattr(method, "gated_silu", None)
        return None if gated is None else gated(module, hidden)
    if not gemv_serves(hidden, module.weight):
        return None
    return gemv(hidden, module.weight, gated=True)


class Linear(nn.Linear):
    """A projection whose weight may be quantized. ``quantizable = False`` on an instance keeps
    it 16-bit whatever the checkpoint holds (a weight read as a matrix elsewhere, e.g. MLA's
    ``kv_b_proj``, which is dequantized once at load)."""

    quantizable = True
    weight_method = None  # set by tandem.quantization when the weight is FP8

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear_product(self, hidden)


class StackedLinear(Linear):
    """``parts`` are the checkpoint's full row counts; a rank of ``shard`` keeps its share of
    each part (column parallel: no collective, the output stays split by rank). A part named in
    ``replicas`` is held whole by groups of that many consecutive ranks (key/value heads fewer
    than the ranks): rank ``r`` keeps slice ``r // replicas`` of ``size // replicas``."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, shard: TensorShard = SINGLE,
                 replicas: Optional[dict[str, int]] = None) -> None:
        part_replicas = {name: (replicas or {}).get(name, 1) for name in parts}
        local = {name: shard.split(size * part_replicas[name], f"the rows of {name}") for name, size in parts.items()}
        super().__init__(in_features, sum(local.values()), bias=bias)
        self.part_replicas = part_replicas
        self.parts: dict[str, tuple[int, int]] = {}
        self.full_sizes = dict(parts)
        self.shard = shard
        offset = 0
        for name, size in local.items():
            self.parts[name] = (offset, size)
            offset += size

    def part_shard(self, part: str) -> Optional[tuple]:
        """``(axis, slice index, slices, segments)`` of checkpoint tensor ``part`` on this rank
        (``_Target``), or None when unsharded."""
        if not self.shard.is_parallel:
            return None
        copies = self.part_replicas[part]
        return (0, self.shard.rank // copies, self.shard.size // copies, (self.full_sizes[part],))


class _Target:
    """Where one checkpoint tensor lands: a parameter, or a row slice of a stacked one."""

    def __init__(self, param: torch.Tensor, offset: int = 0, rows: Optional[int] = None, shard=None) -> None:
        self.tensor = param.data if rows is None else param.data[offset:offset + rows]
        # (axis, rank, size, segments) of a sharded target, else None.
        self.shard = shard if shard is not None else getattr(param, "tensor_shard", None)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        target = self.tensor
        if self.shard is not None:
            axis, rank, size, segments = self.shard
            if tensor.dim() == target.dim() and tensor.shape[axis] == sum(segments):
                tensor = shard_of(tensor, axis, rank, size, segments)
                target = target.narrow(axis, 0, tensor.shape[axis])  # a padded slice: its rows only
        check_loadable(name, tensor, target)
        target.copy_(tensor)


def check_loadable(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    """Raise ValueError naming checkpoint tensor ``name`` when it cannot fill ``target``: another
    shape, or a float tensor for an FP8 parameter (which a copy would cast without its scale)."""
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    if target.dtype == torch.float8_e4m3fn and tensor.dtype != target.dtype:
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, but its parameter holds FP8 weights "
                         "(an FP8 layer takes float8_e4m3fn weights with their scales)")


def _stacked_targets(model: nn.Module) -> dict[str, tuple]:
    """Checkpoint name → (parameter name, row offset, rows, shard) for every stacked part."""
    targets = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, StackedLinear):
            continue
        parent = module_name.rsplit(".", 1)[0]
        for part, (offset, size) in module.parts.items():
            shard = module.part_shard(part)
            for kind in ("weight", "weight_scale", "bias"):
                if getattr(module, kind, None) is not None:
                    targets[f"{parent}.{part}.{kind}"] = (f"{module_name}.{kind}", offset, size, shard)
    return targets


def load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 skip: Callable[[str], bool] = lambda name: False) -> None:
    """Copy each checkpoint tensor into the parameter (or stacked slice) of the same name; a
    sharded parameter takes its rank's slice.

    Raises ValueError naming the tensor on an unknown name or a shape mismatch, and when any
    parameter (or slice) is left unloaded."""
    params = dict(model.named_parameters())
    stacked = _stacked_targets(model)
    expected = {name for name in params if not any(t[0] == name for t in stacked.values())}
    expected |= set(stacked)
    loaded = set()
    for name, tensor in weights:
        if name in stacked:
            param_name, offset, size, shard = stacked[name]
            target = _Target(params[param_name], offset, size, shard)
        elif name in params:
            target = _Target(params[name])
        elif skip(name):
            continue
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        target.load(name, tensor)
        loaded.add(name)
    missing = sorted(expected - loaded - {n for n in expected if skip(n)})
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
