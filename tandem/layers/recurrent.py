"""Recurrent-state layers: plain-PyTorch reference recurrences and the slot plumbing.

Kernels (the math of the Hugging Face torch paths, one sequence per scan, batched steps):

- ``causal_conv1d_scan`` / ``causal_conv1d_step``: the depthwise causal convolution in front of
  the recurrence, carrying the last ``kernel - 1`` inputs as the conv state;
- ``chunk_gated_delta_rule`` / ``gated_delta_rule_step``: gated DeltaNet (Qwen3-Next), chunked
  scan for prefill chunks and the single-token update for decode;
- ``mamba2_chunk_scan`` / ``mamba2_step``: the Mamba-2 SSD (NemotronH), likewise.

``RecurrentSlots.run`` drives them over a step's batch: every chunk that starts a sequence or
has several tokens is scanned on its own, from zeros or from its slot; single-token chunks of
running sequences go through the batched step. The state is read from and written back to the
sequence's working slot through the accessor (I3); where the sequence holds a checkpoint slot
and the chunk crosses a page boundary, the state at the last boundary crossed is written there
too (a prefix-cache checkpoint, see ``kv/managers/recurrent.py``)::

    chunk:      start ........ b ...... end        b = the last multiple of page_size <= end
    scan:       [start, b) -> state_b -> [b, end)  state_b also goes to the checkpoint slot
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

from tandem.kv.spec import RecurrentSpec

if TYPE_CHECKING:
    from tandem.worker.forward_context import ForwardContext

WORKING_COLUMN, CHECKPOINT_COLUMN = 0, 1


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


# -- slot plumbing -------------------------------------------------------------------------------------
ScanFn = Callable[[torch.Tensor, tuple, Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
StepFn = Callable[[torch.Tensor, tuple, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Scan:
    query_start: int
    query_end: int
    slot: int
    fresh: bool
    checkpoint_slot: int  # 0: none
    checkpoint_offset: int  # tokens of the chunk before the checkpoint boundary (0: none)


def _plan(metadata) -> tuple[list[int], list[int], list[int], list[_Scan]]:
    """Split a step's chunks into the batched single-token path and per-chunk scans."""
    rows = metadata.page_table[:, :CHECKPOINT_COLUMN + 1].tolist()
    step_tokens, step_slots, step_checkpoints, scans = [], [], [], []
    page_size = metadata.page_size
    for index, start in enumerate(metadata.chunk_start_positions):
        query_start, query_end = metadata.chunk_query_starts[index:index + 2]
        length = query_end - query_start
        slot = rows[index][WORKING_COLUMN]
        checkpoint = rows[index][CHECKPOINT_COLUMN] if len(rows[index]) > CHECKPOINT_COLUMN else 0
        boundary = (start + length) // page_size * page_size
        offset = boundary - start if checkpoint and boundary > start else 0
        if length == 1 and start > 0:
            step_tokens.append(query_start)
            step_slots.append(slot)
            step_checkpoints.append(checkpoint if offset else 0)
        else:
            scans.append(_Scan(query_start, query_end, slot, start == 0, checkpoint if offset else 0, offset))
    return step_tokens, step_slots, step_checkpoints, scans


class RecurrentSlots:
    """The state front of one recurrent layer: declares its spec and runs the recurrence over
    a step's batch, reading and writing the layer's slots (``conv``, ``ssm``) through the
    accessor."""

    def __init__(self, layer_name: str, spec: RecurrentSpec, conv: torch.nn.Conv1d) -> None:
        self.layer_name = layer_name
        self.state_spec = spec
        self._conv = conv  # the layer's depthwise conv (weight [C, 1, K]); not owned here

    @property
    def _conv_weight(self) -> torch.Tensor:
        return self._conv.weight.squeeze(1)

    @property
    def _conv_bias(self) -> Optional[torch.Tensor]:
        return self._conv.bias

    def run(self, conv_inputs: torch.Tensor, extras: tuple, context: "ForwardContext",
            scan: ScanFn, step: StepFn) -> torch.Tensor:
        """``conv_inputs [T, C]`` go through the causal conv; ``scan(conv_out, extras, state)``
        and ``step(conv_out, extras, states)`` run the recurrence on the conv outputs (``extras``:
        per-token tensors, sliced alike). Returns the recurrence outputs, token-major."""
        buffers = context.state.layer(self.layer_name)
        conv_buffer, ssm_buffer = buffers["conv"], buffers["ssm"]
        metadata = context.attention_metadata[context.state.group_of(self.layer_name)]
        step_tokens, step_slots, step_checkpoints, scans = _plan(metadata)
        outputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (token indices, rows)
        if step_tokens:
            outputs.append(self._step(conv_inputs, extras, step_tokens, step_slots, step_checkpoints,
                                      conv_buffer, ssm_buffer, step))
        for chunk in scans:
            outputs.append(self._scan(conv_inputs, extras, chunk, conv_buffer, ssm_buffer, scan))
        first = outputs[0][1]
        dtype = first.dtype
        for _, rows in outputs:
            dtype = torch.promote_types(dtype, rows.dtype)
        result = first.new_empty((conv_inputs.shape[0], *first.shape[1:]), dtype=dtype)
        for tokens, rows in outputs:
            result[tokens] = rows.to(dtype)
        return result

    def _step(self, conv_inputs, extras, tokens, slots, checkpoints, conv_buffer, ssm_buffer, step):
        device = conv_inputs.device
        token_index = torch.tensor(tokens, dtype=torch.long, device=device)
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        conv_out, conv_state = causal_conv1d_step(conv_inputs[token_index], conv_buffer[slot_index],
                                                  self._conv_weight, self._conv_bias)
        rows, ssm_state = step(conv_out, tuple(x[token_index] for x in extras), ssm_buffer[slot_index])
        conv_buffer.index_copy_(0, slot_index, conv_state.to(conv_buffer.dtype))
        ssm_buffer.index_copy_(0, slot_index, ssm_state.to(ssm_buffer.dtype))
        kept = [row for row, checkpoint in enumerate(checkpoints) if checkpoint]
        if kept:
            rows_index = torch.tensor(kept, dtype=torch.long, device=device)
            checkpoint_index = torch.tensor([checkpoints[row] for row in kept], dtype=torch.long, device=device)
            conv_buffer.index_copy_(0, checkpoint_index, conv_state[rows_index].to(conv_buffer.dtype))
            ssm_buffer.index_copy_(0, checkpoint_index, ssm_state[rows_index].to(ssm_buffer.dtype))
        return token_index, rows

    def _scan(self, conv_inputs, extras, chunk: _Scan, conv_buffer, ssm_buffer, scan):
        begin, end = chunk.query_start, chunk.query_end
        if chunk.fresh:
            conv_state = conv_buffer.new_zeros(conv_buffer.shape[1:])
            ssm_state = None
        else:
            conv_state, ssm_state = conv_buffer[chunk.slot], ssm_buffer[chunk.slot]
        conv_out, history = causal_conv1d_scan(conv_inputs[begin:end], conv_state,
                                               self._conv_weight, self._conv_bias)
        window = history.shape[-1] - (end - begin)
        pieces = []
        split = chunk.checkpoint_offset
        for piece_start, piece_end in ((0, split), (split, end - begin)):
            if piece_end <= piece_start:
                continue
            rows, ssm_state = scan(conv_out[piece_start:piece_end],
                                   tuple(x[begin + piece_start:begin + piece_end] for x in extras), ssm_state)
            pieces.append(rows)
            if piece_end == split:
                self._write(conv_buffer, ssm_buffer, chunk.checkpoint_slot,
                            history[:, split:split + window], ssm_state)
        self._write(conv_buffer, ssm_buffer, chunk.slot, history[:, history.shape[-1] - window:], ssm_state)
        rows = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return torch.arange(begin, end, device=conv_inputs.device), rows

    @staticmethod
    def _write(conv_buffer, ssm_buffer, slot: int, conv_state, ssm_state) -> None:
        conv_buffer[slot].copy_(conv_state)
        ssm_buffer[slot].copy_(ssm_state)
