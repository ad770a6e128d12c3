"""Rotary position embeddings with a precomputed cos/sin table.

Supported ``rope_type``s: ``default``, ``linear``, ``llama3`` (Llama-3.1 frequency scaling) and
``yarn`` (YaRN, as Qwen3 and Qwen3-MoE extend their context: blended frequencies, and cos/sin
scaled by the attention factor), each computed as transformers computes it.
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, base: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that rotate fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those above ``beta_fast`` kept, a linear ramp between;
    and the attention factor (``attention_factor``, else from ``mscale``/``mscale_all_dim``, else
    ``0.1 ln(factor) + 1``)."""
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if factor is None or original is None:
        raise ValueError("rope_parameters: yarn needs 'factor' and 'original_max_position_embeddings'")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    position_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp
    inv_freq = (1.0 / (factor * position_freqs)) * (1 - extrapolated) + (1.0 / position_freqs) * extrapolated
    return inv_freq, float(attention_factor)


def compute_rope(rope_parameters: dict, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim / 2], attention scaling of cos and sin)``."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default")) or "default"
    base = rope_parameters.get("rope_theta", 10000.0)
    inv_freq = _default_inv_freq(base, rotary_dim)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / rope_parameters["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_parameters), 1.0
    if rope_type == "yarn":
        return _yarn(rope_parameters, base, rotary_dim)
    raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not supported "
                     "(supported: default, linear, llama3, yarn)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope_parameters: Optional[dict], max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = compute_rope(dict(rope_parameters or {}), head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        table = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", table.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_table", table.sin() * attention_scaling, persistent=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor):
        """query ``[T, Hq, D]``, key ``[T, Hkv, D]``, positions ``[T]`` -> new rotated
        ``(query, key)``; heads wider than the table's ``rotary_dim`` keep their tail."""
        rotate = apply_rotary if query.is_cuda else apply_rotary_reference
        return rotate(query, key, positions, self.cos_table, self.sin_table)
