"""The sampling message: what rank 0's worker samples after a step's forward pass.

The engine core builds one ``SamplingPlan`` per sampling step from its books (which sequences
sample, the forks made at the end of a prompt, the grammars' state) and hands it to its executor
(``Executor.sample``); rank 0's worker samples it from the logits of the forward pass it ran last
(``Worker.sample``), with the sampler, the parameter tables and the per-sequence generators it
owns. The plan is host-only — token ids, parameters, keys, the grammar bitmask as a numpy array,
no tensors and no scheduler objects — and travels as msgpack (``encode`` / ``decode``).

The sampling is a separate message after the forward pass, not a part of it: with the overlapped
loop the engine core launches step N+1's forward pass before it reads step N's tokens back, and a
grammar row's mask needs those tokens (``EngineCore._launch`` completes step N between the two).

Generators: a row whose request has a seed draws from the generator of its sequence (``keys``),
made from ``seeds`` the first time the key appears; ``finished_keys`` names the sequences that
ended since the last plan, whose generators the worker drops after sampling this plan (as vLLM's
scheduler output carries its finished request ids). Keys are unique for the engine's lifetime (a
sequence's arrival order), so a request id used again never meets an old generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
import numpy as np

from tandem.engine.ranks.plan import Array
from tandem.sampling_params import SamplingParams


@dataclass
class SamplingPlan:
    """One step's sampled rows, in the order of the tokens the worker returns."""
    keys: list[int]  # each row's sequence key (its arrival order: unique for the engine's lifetime)
    params: list[SamplingParams]
    seeds: list[Optional[int]]  # each row's generator seed (None: the sampler's shared generator)
    # The logits row each sampled row reads (forks repeat their parent's); None: row i reads row i.
    logits_rows: Optional[list[int]] = None
    # Read only by the rows' penalties (empty lists when no row has any) and min_tokens (banned ids:
    # empty lists while no row is below its min_tokens).
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    banned_token_ids: list[list[int]] = field(default_factory=list)
    # [rows, ceil(V / 32)] int32, bit t of row r set where token t is allowed; None: no row masked.
    token_bitmask: Optional[np.ndarray] = None
    finished_keys: list[int] = field(default_factory=list)  # sequences ended since the last plan

    @property
    def num_rows(self) -> int:
        return len(self.keys)


def _encode_hook(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return Array.of(value)  # (the step plan's array codec: dtype, shape, bytes)
    raise NotImplementedError(f"sampling plan: cannot encode {type(value).__name__}")


def _decode_hook(kind: type, value: Any) -> Any:
    if kind is np.ndarray:
        return Array(*value).value()
    raise NotImplementedError(f"sampling plan: cannot decode {kind}")


def encode(plan: SamplingPlan) -> bytes:
    return msgspec.msgpack.encode(plan, enc_hook=_encode_hook)


def decode(payload: bytes) -> SamplingPlan:
    return msgspec.msgpack.decode(payload, type=SamplingPlan, dec_hook=_decode_hook)
