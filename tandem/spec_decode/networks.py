"""The draft networks: a checkpoint's MTP layer, or a draft model of its own.

Each declares its state specs (``state_specs``), which the speculator registers into the
target's registry before the groups are formed: layers whose specs equal the target's share
its groups (and page tables), others form groups of their own. Either way every mover sees
them as ordinary state. A draft model's layer names get the prefix ``draft.`` in the registry;
its layers keep their own names and reach their buffers through a prefixed accessor.
"""
from __future__ import annotations

from typing import Optional

import torch

from tandem.kv.accessor import StateAccessor
from tandem.models.base import collect_state_specs
from tandem.layers.forward_context import ForwardContext


class PrefixedAccessor:
    """The state accessor as a draft model's layers see it (I3 holds: it is the same accessor)."""

    def __init__(self, accessor: StateAccessor, prefix: str) -> None:
        self._accessor = accessor
        self._prefix = prefix

    def layer(self, layer_name: str) -> dict[str, torch.Tensor]:
        return self._accessor.layer(self._prefix + layer_name)

    def group_of(self, layer_name: str) -> int:
        return self._accessor.group_of(self._prefix + layer_name)


class _Network:
    """What both networks share: their registered layer names, groups and forward context."""

    reads_next_token = False  # its state at a position depends on the token after it
    hidden_input = None  # (size, dtype) of the hidden state read beside each token, or None
    runs_on_every_rank = False  # tensor parallelism: sharded, so every rank runs its passes

    def __init__(self, specs: dict, module: torch.nn.Module) -> None:
        self._specs = specs
        self.module = module  # what runs: its layers say whether it is graph-safe
        self.groups: list[int] = []
        self._accessor = None
        self._runner = None
        self.graphs = None  # its CUDA graphs (worker/cuda_graphs.CudaGraphRunner), when captured

    def state_specs(self) -> dict:
        """``{registry layer name: spec}`` of the draft's state."""
        return dict(self._specs)

    @property
    def layer_names(self) -> list[str]:
        return list(self._specs)

    def bind(self, runner, registry) -> None:
        """After the registry is final and the model runner built."""
        self.groups = sorted({registry.group_of(name) for name in self._specs})
        self._accessor = self.accessor_for(runner.accessor)
        self._runner = runner

    def accessor_for(self, accessor: StateAccessor):
        return accessor

    def context(self, metadata: list) -> ForwardContext:
        return ForwardContext(self._accessor, metadata, self._runner.backend)


class DraftModelNetwork(_Network):
    PREFIX = "draft."

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__({self.PREFIX + name: spec for name, spec in model.state_specs().items()}, model)
        self.model = model

    def accessor_for(self, accessor: StateAccessor):
        return PrefixedAccessor(accessor, self.PREFIX)

    def forward(self, input_ids, hidden: Optional[torch.Tensor], positions, context) -> torch.Tensor:
        return self.model(input_ids, positions, context)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class MTPNetwork(_Network):
    """The target's first MTP module (``next_n_layers()[0]``), chained for every draft."""

    reads_next_token = True  # position p's state is computed from the token at p + 1

    def __init__(self, target: torch.nn.Module) -> None:
        layers = target.next_n_layers() if callable(getattr(target, "next_n_layers", None)) else []
        if not layers:
            raise ValueError(f"speculative_method: 'mtp' needs a checkpoint with next-n (MTP) layers "
                             f"(num_nextn_predict_layers); {type(target).__name__} has none here")
        self.layer = layers[0]
        self.target = target
        super().__init__(collect_state_specs(self.layer), self.layer)
        self.hidden_input = (self.layer.eh_proj.in_features // 2, self.layer.eh_proj.weight.dtype)
        # the target's shard: the module's decoder block is sharded too (its passes are planned)
        self.runs_on_every_rank = bool(getattr(getattr(target, "tensor_shard", None), "is_parallel", False))

    def forward(self, input_ids, hidden: Optional[torch.Tensor], positions, context) -> torch.Tensor:
        return self.layer.draft_forward(input_ids, hidden, positions, context)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer.compute_logits(hidden)

    def target_hidden(self, raw: torch.Tensor) -> torch.Tensor:
        """The target's output rows as the MTP layer reads them (after the final norm)."""
        return self.target.final_hidden(raw)
