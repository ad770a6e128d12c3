"""What a model's forward pass needs besides token ids and positions."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.kv.accessor import StateAccessor
from tandem.layers.attention import AttentionBackend
from tandem.layers.attention_metadata import AttentionMetadata


@dataclass
class ForwardContext:
    state: StateAccessor
    attention_metadata: list[AttentionMetadata]  # indexed by state group
    attention_backend: AttentionBackend
