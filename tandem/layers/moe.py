"""Mixture-of-experts layers: DeepSeek-V3 / GLM-5 routing and Qwen3 softmax routing.

DeepSeek routing (``TopKRouter``), as the reference implementations compute it, in float32:

    scores  = sigmoid(hidden @ gate.weight.T)                       [T, E]
    choice  = scores + e_score_correction_bias                      (bias steers the choice only)
    groups  = sum of the 2 best ``choice`` values in each of ``n_group`` expert groups
    keep the ``topk_group`` best groups, then the ``top_k`` best experts among them (by choice)
    weights = scores of those experts, divided by their sum when ``norm_topk_prob``,
              times ``routed_scaling_factor``

Qwen3 routing (``SoftmaxTopKRouter``; Qwen3-MoE, Qwen3-Next)::

    probs   = softmax(hidden @ gate.weight.T) in float32                [T, E]
    weights, experts = the ``top_k`` largest probs
    weights divided by their sum when ``norm_topk_prob``, then rounded to the model dtype

``MoE`` adds the shared experts (one dense MLP of ``n_shared_experts * moe_intermediate_size``)
to the weighted routed experts. Experts are stored fused (``FusedExperts``: ``gate_up_proj
[E, 2I, H]`` or, not gated, ``up_proj [E, I, H]``, and ``down_proj [E, H, I]``; Qwen3-Next and
NemotronH use them too); checkpoints name them per expert (``experts.{e}.gate_proj.weight``),
which :func:`load_with_experts` maps into the fused tensors. On CUDA the routed experts run in
one fused Triton kernel (``kernels/fused_moe.py``), capturable in a CUDA graph.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.fused_moe import ACTIVATIONS, dequantize_experts, fused_moe, fused_moe_reference
from tandem.layers.linear import check_loadable, load_by_name, mark_sharded, shard_of
from tandem.layers.mlp import GatedMLP  # noqa: F401  (re-exported for the MoE families)
from tandem.parallel.shard import SINGLE, TensorShard


class TopKRouter(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.num_groups = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts ({self.num_experts}) is not a multiple of n_group "
                             f"({self.num_groups})")
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        # Kept in float32 whatever the model dtype (a checkpoint tensor; never trained here).
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``[T, H]`` → (weights ``[T, k]`` float32, expert ids ``[T, k]``)."""
        logits = F.linear(hidden.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        tokens = choice.shape[0]
        group_scores = choice.view(tokens, self.num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_ids = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
        per_group = self.num_experts // self.num_groups
        expert_mask = group_mask.unsqueeze(-1).expand(tokens, self.num_groups, per_group).reshape(tokens, -1)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        expert_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE / Qwen3-Next routing (see the module docstring). Replicated under tensor
    parallelism: every rank routes every token to the same experts."""

    def __init__(self, num_experts: int, top_k: int, norm_topk_prob: bool, hidden_size: int) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: must be in 1..num_experts ({num_experts}), got {top_k}")
        self.top_k = top_k
        self.norm_topk_prob = bool(norm_topk_prob)
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``[T, H]`` → (weights ``[T, k]`` in hidden's dtype, expert ids ``[T, k]``)."""
        logits = F.linear(hidden, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), expert_ids


class FusedExperts(nn.Module):
    """The routed experts, stacked: gated (``activation="silu"``: ``gate_up_proj [E, 2I, H]``,
    the gate rows then the up rows) or not (``"relu2"``: ``up_proj [E, I, H]``), and
    ``down_proj [E, H, I]``.

    On CUDA (``use_kernel`` None) every expert runs in the fused kernel
    (``kernels/fused_moe.py``: no host synchronisation, capturable in a CUDA graph); elsewhere
    the per-expert loop, the kernel's reference, adding in ``accumulate_dtype`` (the input's
    dtype unless given). ``use_kernel`` True or False forces one of the two.

    Under tensor parallelism each rank holds every expert's share of the intermediate size
    (gate/up rows, down columns) and the partial outputs are summed over the ranks."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 accumulate_dtype: Optional[torch.dtype] = None, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"experts: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.num_experts = num_experts
        self.shard = shard
        full_intermediate = intermediate_size
        intermediate_size = shard.split(intermediate_size, "moe_intermediate_size")
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.accumulate_dtype = accumulate_dtype
        self.use_kernel: Optional[bool] = None
        if activation == "silu":
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        w1 = self.gate_up_proj if activation == "silu" else self.up_proj
        mark_sharded(w1, 1, shard, (full_intermediate,) * (2 if activation == "silu" else 1))
        mark_sharded(self.down_proj, 2, shard, full_intermediate)
        # FP8 experts (to_fp8): inputs per scale column of w1 and of down_proj; None: 16-bit.
        self.scale_groups: Optional[tuple[int, int]] = None

    def to_fp8(self, block_columns: Optional[int], device: Optional[torch.device] = None) -> None:
        """Hold the experts as FP8 on ``device`` (default: the 16-bit weights') with float32
        scales per row and ``block_columns`` inputs (``<name>_weight_scale [E, rows,
        ceil(inputs / block_columns)]``; None: one scale per row), filled by the checkpoint's
        per-expert tensors. The kernel dequantizes each tile."""
        groups = []
        for name in self.fused_parameter_names:
            weight = getattr(self, name)
            experts, rows, columns = weight.shape
            group = columns if block_columns is None else block_columns
            target = weight.device if device is None else device
            fp8 = nn.Parameter(torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=target),
                               requires_grad=False)
            scale = nn.Parameter(torch.ones(experts, rows, -(-columns // group), dtype=torch.float32,
                                            device=target), requires_grad=False)
            shard = getattr(weight, "tensor_shard", None)
            if shard is not None:
                fp8.tensor_shard = shard
                scale_shard = self._scale_shard(shard, columns, block_columns)
                if scale_shard is not None:
                    scale.tensor_shard = scale_shard
            setattr(self, name, fp8)
            setattr(self, f"{name}_weight_scale", scale)
            groups.append(group)
        self.scale_groups = tuple(groups)

    @staticmethod
    def _scale_shard(shard, columns: int, block_columns: Optional[int]):
        axis, rank, size, segments = shard
        if axis != 2:
            return shard  # rows: the scales' rows shard as the weight's
        if block_columns is None:
            return None
        if columns % block_columns:
            raise ValueError(f"tensor_parallel_size: {size} leaves {columns} expert inputs per rank, not a multiple "
                             f"of the quantization_config.weight_block_size columns ({block_columns})")
        return (2, rank, size, (-(-sum(segments) // block_columns),))

    @property
    def gated(self) -> bool:
        return self.activation == "silu"

    @property
    def fused_parameter_names(self) -> tuple[str, ...]:
        names = ("gate_up_proj" if self.gated else "up_proj", "down_proj")
        return names if self.scale_groups is None else names + tuple(f"{name}_weight_scale" for name in names)

    def _fp8_forward(self, hidden, w1, expert_ids, weights, use_kernel: bool) -> torch.Tensor:
        w1_name = "gate_up_proj" if self.gated else "up_proj"
        w1_scale, w2_scale = getattr(self, f"{w1_name}_weight_scale"), self.down_proj_weight_scale
        if use_kernel:
            return fused_moe(hidden, w1, self.down_proj, weights, expert_ids, self.activation,
                             w1_scale=w1_scale, w2_scale=w2_scale, scale_groups=self.scale_groups)
        w1 = dequantize_experts(w1, w1_scale, self.scale_groups[0], hidden.dtype)
        w2 = dequantize_experts(self.down_proj, w2_scale, self.scale_groups[1], hidden.dtype)
        return fused_moe_reference(hidden, w1, w2, weights, expert_ids, self.activation,
                                   accumulate_dtype=self.accumulate_dtype)

    def forward(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        w1 = self.gate_up_proj if self.gated else self.up_proj
        use_kernel = hidden.is_cuda if self.use_kernel is None else self.use_kernel
        if self.scale_groups is not None:
            output = self._fp8_forward(hidden, w1, expert_ids, weights, use_kernel)
        elif use_kernel:
            output = fused_moe(hidden, w1, self.down_proj, weights, expert_ids, self.activation)
        else:
            output = fused_moe_reference(hidden, w1, self.down_proj, weights, expert_ids, self.activation,
                                         accumulate_dtype=self.accumulate_dtype)
        return self.shard.all_reduce(output)

    def expert_shard(self, part: str, tensor: torch.Tensor, kind: str = "weight") -> torch.Tensor:
        """This rank's slice of checkpoint tensor ``experts.{e}.{part}.{kind}`` (gate/up rows,
        down columns; a down scale's columns by block, or whole when it has one per row)."""
        if not self.shard.is_parallel:
            return tensor
        axis = 1 if part == "down_proj" else 0
        if kind == "weight_scale" and axis == 1 and tensor.shape[1] == 1:
            return tensor
        return shard_of(tensor, axis, self.shard.rank, self.shard.size, (tensor.shape[axis],))

    def expert_slice(self, expert: int, part: str, kind: str = "weight") -> torch.Tensor:
        """The fused-parameter slice that checkpoint tensor ``experts.{expert}.{part}.{kind}``
        fills (``kind``: ``weight``, or ``weight_scale`` of FP8 experts)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (n_routed_experts {self.num_experts})")
        if kind == "weight_scale" and self.scale_groups is None:
            raise ValueError(f"expert tensor {part}.weight_scale: these experts are not FP8")
        suffix = "" if kind == "weight" else "_weight_scale"
        size = self.intermediate_size
        if self.gated:
            slices = {"gate_proj": lambda: getattr(self, "gate_up_proj" + suffix).data[expert, :size],
                      "up_proj": lambda: getattr(self, "gate_up_proj" + suffix).data[expert, size:]}
        else:
            slices = {"up_proj": lambda: getattr(self, "up_proj" + suffix).data[expert]}
        slices["down_proj"] = lambda: getattr(self, "down_proj" + suffix).data[expert]
        if part not in slices:
            raise ValueError(f"expert tensor {part!r} does not exist in {self.activation} experts")
        return slices[part]()

    @property
    def num_expert_tensors(self) -> int:
        """Per-expert checkpoint tensors: a weight per part (and its scale, FP8 experts)."""
        return (3 if self.gated else 2) * self.num_experts * (1 if self.scale_groups is None else 2)


class MoE(nn.Module):
    """Routed experts plus shared experts (DeepSeek-V3, DeepSeek-V3.2, GLM-5)."""

    def __init__(self, config, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = FusedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                    shard=shard)
        num_shared = getattr(config, "n_shared_experts", 0) or 0
        self.shared_experts = (GatedMLP(config.hidden_size, config.moe_intermediate_size * num_shared, shard=shard)
                               if num_shared else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(hidden)
        output = self.experts(hidden, expert_ids, weights)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden)
        return output


class SoftmaxMoE(nn.Module):
    """Routed experts without shared experts, softmax-routed (Qwen3-MoE's sparse block):
    ``gate`` (``SoftmaxTopKRouter``) and ``experts`` (``FusedExperts``), named as the checkpoint
    names them (``mlp.gate.weight``, ``mlp.experts.{e}.gate_proj.weight`` ...)."""

    def __init__(self, config, shard: TensorShard = SINGLE) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(config.num_experts, config.num_experts_per_tok, config.norm_topk_prob,
                                      config.hidden_size)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                    shard=shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(hidden)
        return self.experts(hidden, expert_ids, weights)


_PER_EXPERT = re.compile(r"^(?P<module>(?:.+\.)?experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)"
                         r"\.(?P<kind>weight|weight_scale)$")


def load_with_experts(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                      skip: Callable[[str], bool] = lambda name: False) -> None:
    """``load_by_name`` that also maps per-expert checkpoint tensors into ``FusedExperts``.

    Each ``FusedExperts`` must be covered either by its fused tensors (``experts.gate_up_proj``,
    ``experts.down_proj``) or by all ``3 * num_experts`` per-expert tensors; raises ValueError
    naming what is missing otherwise."""
    experts = {name: module for name, module in model.named_modules() if isinstance(module, FusedExperts)}
    seen: dict[str, set[tuple[int, str, str]]] = {name: set() for name in experts}
    fused_names = {f"{name}.{param}": name for name, module in experts.items()
                   for param in module.fused_parameter_names}
    fused_seen: set[str] = set()

    def stream():
        for name, tensor in weights:
            match = _PER_EXPERT.match(name)
            if match and match.group("module") in experts:
                module_name, expert, part = match.group("module"), int(match.group("expert")), match.group("part")
                kind = match.group("kind")
                target = experts[module_name].expert_slice(expert, part, kind)
                tensor = experts[module_name].expert_shard(part, tensor, kind)
                check_loadable(name, tensor, target)
                target.copy_(tensor)
                seen[module_name].add((expert, part, kind))
                continue
            if name in fused_names:
                fused_seen.add(name)
            yield name, tensor

    load_by_name(model, stream(), skip=lambda name: name in fused_names or skip(name))
    for name, module in experts.items():
        first = f"{name}.{module.fused_parameter_names[0]}"
        fused_complete = all(f"{name}.{param}" in fused_seen for param in module.fused_parameter_names)
        expected = module.num_expert_tensors
        if not fused_complete and len(seen[name]) != expected and not skip(first):
            raise ValueError(f"checkpoint is missing expert tensors of {name!r}: "
                             f"{expected - len(seen[name])} of {expected}")
