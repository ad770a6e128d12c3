"""Recurrent-state layers: plain-PyTorch reference recurrences (the math of the Hugging Face
torch paths, one sequence per scan, batched steps); ``recurrent_slots.py`` drives them over a
step's batch and the layers' state slots:

- ``causal_conv1d_scan`` / ``causal_conv1d_step``: the depthwise causal convolution in front of
  the recurrence, carrying the last ``kernel - 1`` inputs as the conv state;
- ``chunk_gated_delta_rule`` / ``gated_delta_rule_step``: gated DeltaNet (Qwen3-Next), chunked
  scan for prefill chunks and the single-token update for decode;
- ``mamba2_chunk_scan`` / ``mamba2_step``: the Mamba-2 SSD (NemotronH), likewise.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


# -- convolution -------------------------------------------------------------------------------
def causal_conv1d_scan(inputs: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs [T, C]``, ``state [C, K-1]`` (the inputs before them; zeros when fresh), ``weight
    [C, K]``. Returns the SiLU-activated outputs ``[T, C]`` and the input history ``[C, K-1+T]``,
    whose columns ``t .. t+K-2`` are the conv state after ``t`` of the tokens."""
    history = torch.cat([state.to(weight.dtype), inputs.transpose(0, 1).to(weight.dtype)], dim=-1)
    out = F.conv1d(history.unsqueeze(0), weight.unsqueeze(1), bias, groups=history.shape[0])
    return F.silu(out[0]).transpose(0, 1).to(inputs.dtype), history


def causal_conv1d_step(inputs: torch.Tensor, states: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs [B, C]``, ``states [B, C, K-1]`` → (activated outputs ``[B, C]``, new states)."""
    history = torch.cat([states.to(weight.dtype), inputs.unsqueeze(-1).to(weight.dtype)], dim=-1)
    out = (history * weight.unsqueeze(0)).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out).to(inputs.dtype), history[..., 1:]


# -- gated DeltaNet ------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _expand_heads(query, key, num_value_heads):
    if key.shape[-2] != num_value_heads:
        repeat = num_value_heads // key.shape[-2]
        query = query.repeat_interleave(repeat, dim=-2)
        key = key.repeat_interleave(repeat, dim=-2)
    return query, key


def chunk_gated_delta_rule(query, key, value, decay, beta, initial_state: Optional[torch.Tensor],
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``query/key [T, Hk, Dk]``, ``value [T, Hv, Dv]``, ``decay`` (log space, <= 0)
    and ``beta`` ``[T, Hv]``, ``initial_state [Hv, Dk, Dv]`` or None (zeros). q and k are
    L2-normalised here. Returns ``(output [T, Hv, Dv], final state [Hv, Dk, Dv] float32)``."""
    dtype = query.dtype
    length = key.shape[0]
    num_heads, value_dim = value.shape[-2:]
    query, key = _expand_heads(query, key, num_heads)
    query, key, value, beta, decay = [x.transpose(0, 1).float() for x in (query, key, value, beta, decay)]
    query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=-1)
    pairwise = (cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    if initial_state is None:
        state = new_values.new_zeros((num_heads, key.shape[-1], value_dim))
    else:
        state = initial_state.to(new_values)
    output = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for index in range(new_values.shape[1]):
        v_new = new_values[:, index] - k_cumdecay[:, index] @ state
        output[:, index] = query[:, index] @ state + intra[:, index] @ v_new
        state = state * chunk_decay[:, index] + key[:, index].transpose(-1, -2) @ v_new
    output = output.reshape(num_heads, -1, value_dim)[:, :length]
    return output.transpose(0, 1).to(dtype), state


def gated_delta_rule_step(query, key, value, decay, beta, state: torch.Tensor):
    """A batch of single tokens: ``query/key [B, Hk, Dk]``, ``value [B, Hv, Dv]``, ``decay/beta
    [B, Hv]``, ``state [B, Hv, Dk, Dv]``. Returns ``(output [B, Hv, Dv], new state float32)``."""
    dtype = query.dtype
    query, key = _expand_heads(query, key, value.shape[-2])
    query, key, value, beta, decay = [x.float() for x in (query, key, value, beta, decay)]
    query, key = l2norm(query), l2norm(key)
    query = query / (query.shape[-1] ** 0.5)
    state = state.float() * decay.exp()[..., None, None]
    memory = (state * key.unsqueeze(-1)).sum(dim=-2)
    delta = (value - memory) * beta.unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
    output = (state * query.unsqueeze(-1)).sum(dim=-2)
    return output.to(dtype), state


# -- Mamba-2 -----------------------------------------------------------------------------------------
def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``j <= i``, ``-inf`` above the diagonal."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    below = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~below, 0)
    sums = torch.cumsum(x, dim=-2)
    on_or_below = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=0)
    return sums.masked_fill(~on_or_below, -torch.inf)


def mamba2_chunk_scan(hidden, dt, A, B, C, D, dt_bias, initial_state: Optional[torch.Tensor],
                      chunk_size: int, dt_limit: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: ``hidden [T, H, P]``, ``dt [T, H]`` (before bias and softplus), ``A [H]``
    (negative), ``B/C [T, G, N]``, ``D/dt_bias [H]``, ``initial_state [H, P, N]`` or None.
    Returns ``(output [T, H, P] float32, final state [H, P, N] float32)``."""
    length, num_heads, _ = hidden.shape
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    hidden = hidden.float()
    groups = B.shape[1]
    B = B.float().repeat_interleave(num_heads // groups, dim=1)
    C = C.float().repeat_interleave(num_heads // groups, dim=1)
    pad = (chunk_size - length % chunk_size) % chunk_size
    residual = D[:, None] * F.pad(hidden, (0, 0, 0, 0, 0, pad))
    hidden = hidden * dt[..., None].float()
    A = A.to(hidden.dtype) * dt.float()

    def chunked(x):
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        return x.reshape(-1, chunk_size, *x.shape[1:])

    hidden, A, B, C = (chunked(x) for x in (hidden, A, B, C))  # [c, l, h, ...]
    A = A.permute(2, 0, 1)  # [h, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segment_sum(A))  # [h, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B)
    Y_diag = torch.einsum("clsh,cshp->clhp", scores * L.permute(1, 2, 3, 0), hidden)
    decay_states = torch.exp(A_cumsum[:, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(1, 2, 0)[..., None]
    states = torch.einsum("clhn,clhp->chpn", B_decay, hidden)
    previous = (initial_state[None].to(dtype=states.dtype) if initial_state is not None
                else torch.zeros_like(states[:1]))
    states = torch.cat([previous, states], dim=0)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, -1], (1, 0)))).permute(2, 1, 0)
    new_states = torch.einsum("zch,zhpn->chpn", decay_chunk, states)
    states, final_state = new_states[:-1], new_states[-1]
    C_times_states = torch.einsum("clhn,chpn->clhp", C, states)
    Y_off = C_times_states * torch.exp(A_cumsum).permute(1, 2, 0)[..., None]
    output = (Y_diag + Y_off).reshape(-1, num_heads, hidden.shape[-1]) + residual
    return output[:length], final_state


def mamba2_step(hidden, dt, A, B, C, D, dt_bias, state: torch.Tensor):
    """A batch of single tokens: ``hidden [Bt, H, P]``, ``dt [Bt, H]``, ``B/C [Bt, G, N]``,
    ``state [Bt, H, P, N]``. Returns ``(output [Bt, H, P], new state float32)``. As the reference
    single-step update, ``dt`` is not clamped to the time-step limit."""
    batch, num_heads, head_dim = hidden.shape
    groups, state_size = B.shape[1:]
    dt = dt[..., None].expand(-1, -1, head_dim) + dt_bias[:, None].to(dt.dtype)
    dt = F.softplus(dt)[..., None]
    dA = torch.exp(dt.float() * A.float()[:, None, None])
    B = B.reshape(batch, groups, 1, state_size).expand(batch, groups, num_heads // groups, state_size)
    B = B.reshape(batch, num_heads, 1, state_size)
    new_state = state.float() * dA + dt * B * hidden[..., None]
    C = C.reshape(batch, groups, 1, state_size).expand(batch, groups, num_heads // groups, state_size)
    C = C.reshape(batch * num_heads, state_size, 1)
    output = torch.bmm(new_state.to(C.dtype).view(batch * num_heads, head_dim, state_size), C)
    output = output.view(batch, num_heads, head_dim) + hidden * D[:, None]
    return output.to(hidden.dtype), new_state
