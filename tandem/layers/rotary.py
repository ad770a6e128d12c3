"""Rotary position embeddings with a precomputed cos/sin table.

Supported ``rope_type``s: ``default``, ``linear``, ``llama3`` (Llama-3.1 frequency scaling).
The table is indexed by absolute position, so chunked prefill and decode read the same rows.
On CUDA one kernel rotates queries and keys (``tandem.kernels.rotary``); elsewhere its
plain-PyTorch reference does, bit for bit as ``x * cos + rotate_half(x) * sin``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from tandem.kernels.rotary import apply_rotary, apply_rotary_reference


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(rope_parameters: dict, rotary_dim: int) -> torch.Tensor:
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default")) or "default"
    inv_freq = _default_inv_freq(rope_parameters.get("rope_theta", 10000.0), rotary_dim)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_parameters["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_parameters)
    raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not supported "
                     "(supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope_parameters: Optional[dict], max_positions: int) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(dict(rope_parameters or {}), head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        table = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", table.cos(), persistent=False)
        self.register_buffer("sin_table", table.sin(), persistent=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor):
        """query ``[T, Hq, D]``, key ``[T, Hkv, D]``, positions ``[T]`` -> new rotated
        ``(query, key)``; heads wider than the table's ``rotary_dim`` keep their tail."""
        rotate = apply_rotary if query.is_cuda else apply_rotary_reference
        return rotate(query, key, positions, self.cos_table, self.sin_table)
