"""What every causal LM shares: state declaration, the forward entry and the logits head.

A layer that keeps per-request state exposes ``state_specs() -> {layer_name: spec}``;
``CausalLM.state_specs`` collects them from every submodule, so a model never lists its state
by hand and a new state type needs no change here.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.parallel.shard import SINGLE, TensorShard


def collect_state_specs(root: nn.Module) -> dict:
    """``{layer_name: spec}`` of every submodule of ``root`` that keeps state."""
    specs: dict = {}
    for module in root.modules():
        if module is not root and callable(getattr(module, "state_specs", None)):
            specs.update(module.state_specs())
    return specs


class CausalLM(nn.Module):
    """Subclasses set ``self.model`` (with ``forward(input_ids, positions, context)``, and a
    final norm named by ``final_norm_name``) and ``self.lm_head``."""

    final_norm_name = "norm"
    tensor_shard: TensorShard = SINGLE  # this rank's place under tensor parallelism (set by sharded models)

    def state_specs(self) -> dict:
        return collect_state_specs(self)

    def forward(self, input_ids, positions, context):
        return self.model(input_ids, positions, context)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(getattr(self.model, self.final_norm_name)(hidden))
