"""Token sampler run by the model runner after each forward pass.

Pipeline for one step, over a batch of ``B`` rows and a vocabulary of ``V`` tokens (the order
and the meaning of every parameter follow vLLM)::

    raw logits [B, V] ──┬──────────────────────────────────────────────► logprobs, ranks, top-k
                        │                                                 (raw distribution)
                        └─► penalties ─► grammar mask ─► banned ids ─┬─► greedy rows: argmax
                                                                     └─► sampled rows: temperature ─► top-k
                                                         ─► top-p ─► min-p ─► exponential race

Reproducibility contract: a row with its own ``torch.Generator`` gets a token that depends only
on its own logits and its own generator, never on the other rows or on the batch size. Rows
without a generator share one vectorised draw from the sampler's generator.

Ownership: the sampler never writes into the caller's logits; every step works on a float32
copy made at the start of ``Sampler.__call__``.

On CUDA, a step whose rows are all greedy, with no penalty, grammar mask, banned id or top
logprob, skips the pipeline: two small kernels (``tandem.kernels.greedy_choice``) read the logits
once for the argmax, its logprob and rank, and pack them for the host (``takes_greedy_kernels``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tandem.kernels.greedy_choice import greedy_choice
from tandem.sampling_params import SAMPLING_ROW_FIELDS, SamplingParams
from tandem.structured.bitmask import apply_bitmask
from tandem.worker.host_staging import to_device

PARAMETER_COLUMNS = SAMPLING_ROW_FIELDS

# Temperatures below this are treated as greedy (as in vLLM), so no row divides by ~0.
GREEDY_TEMPERATURE_EPSILON = 1e-5


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, one row per sequence being sampled.

    Built by the model runner each step (usually through ``build``); read-only for the sampler.
    ``generators[i]`` belongs to row ``i``'s request and is advanced by each sampled step;
    ``None`` means the sampler's shared generator.
    """

    temperature: torch.Tensor  # [B] float32; < GREEDY_TEMPERATURE_EPSILON means greedy
    top_p: torch.Tensor  # [B] float32; 1.0 = off
    top_k: torch.Tensor  # [B] int64; 0 = off
    min_p: torch.Tensor  # [B] float32; 0.0 = off
    presence_penalty: torch.Tensor  # [B] float32; 0.0 = off
    frequency_penalty: torch.Tensor  # [B] float32; 0.0 = off
    repetition_penalty: torch.Tensor  # [B] float32; 1.0 = off
    generators: list[Optional[torch.Generator]]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    banned_token_ids: list[list[int]]  # masked to -inf before any choice (min_tokens: EOS/stop)
    num_logprobs: int  # max number of top logprobs requested over the rows; 0 = none
    all_greedy: bool
    no_penalties: bool
    # Fast-path flags; the defaults are the safe choice (apply the step).
    no_top_k_top_p: bool = False
    no_min_p: bool = False
    # Structured outputs: [B, ceil(V / 32)] int32 on the device, bit t of row r set where token t
    # is allowed (tandem/structured/bitmask.py); None when no row is constrained.
    token_bitmask: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[Optional[torch.Generator]],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        banned_token_ids: Sequence[Sequence[int]],
        device: torch.device | str,
        table: Optional["ParameterTable"] = None,
        token_bitmask: Optional[torch.Tensor] = None,
    ) -> "SamplingMetadata":
        """Gather the rows' parameters into batch tensors on ``device`` (or take them from
        ``table``, made for these ``params``: see ``ParameterTables``).

        All sequences must have one entry per row, in the same order as the logits rows. The
        token-id lists are read, not copied: they must not change before the sampler has run.
        """
        lengths = {len(params), len(generators), len(prompt_token_ids),
                   len(output_token_ids), len(banned_token_ids)}
        if len(lengths) != 1:
            raise ValueError(f"sampling metadata: per-row inputs differ in length: {sorted(lengths)}")
        table = table or ParameterTable.of(params, device)
        return cls(
            temperature=table.temperature, top_p=table.top_p, top_k=table.top_k, min_p=table.min_p,
            presence_penalty=table.presence_penalty, frequency_penalty=table.frequency_penalty,
            repetition_penalty=table.repetition_penalty,
            generators=list(generators),
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            banned_token_ids=list(banned_token_ids),
            num_logprobs=table.num_logprobs, all_greedy=table.all_greedy, no_penalties=table.no_penalties,
            no_top_k_top_p=table.no_top_k_top_p, no_min_p=table.no_min_p, token_bitmask=token_bitmask,
        )


@dataclass(frozen=True)
class ParameterTable:
    """The per-row parameters of one batch of ``SamplingParams`` as device tensors, and what
    holds for every row."""
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    num_logprobs: int
    all_greedy: bool
    no_penalties: bool
    no_top_k_top_p: bool
    no_min_p: bool
    any_min_tokens: bool  # some row bans ids until it has ``min_tokens`` outputs

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str) -> "ParameterTable":
        # One host-to-device copy for every per-row parameter (float64 holds them all exactly).
        table = to_device(torch.tensor([p.sampling_row for p in params],
                                       dtype=torch.float64).reshape(len(params), len(PARAMETER_COLUMNS)),
                          device)
        column = lambda name, dtype: table[:, PARAMETER_COLUMNS.index(name)].to(dtype)
        return cls(
            temperature=column("temperature", torch.float32),
            top_p=column("top_p", torch.float32),
            top_k=column("top_k", torch.int64),
            min_p=column("min_p", torch.float32),
            presence_penalty=column("presence_penalty", torch.float32),
            frequency_penalty=column("frequency_penalty", torch.float32),
            repetition_penalty=column("repetition_penalty", torch.float32),
            num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            all_greedy=all(p.temperature < GREEDY_TEMPERATURE_EPSILON for p in params),
            no_penalties=not any(p.uses_penalties for p in params),
            no_top_k_top_p=all(p.top_k <= 0 and p.top_p >= 1 for p in params),
            no_min_p=all(p.min_p <= 0 for p in params),
            any_min_tokens=any(p.min_tokens > 0 for p in params),
        )


class ParameterTables:
    """The ``ParameterTable`` of the last batch, reused while the rows' ``SamplingParams`` are
    the same (a decode batch keeps its rows step after step; the check compares the objects,
    identity first). Owned by the engine core; the tables it hands out are read-only."""

    def __init__(self) -> None:
        self._params: tuple[SamplingParams, ...] = ()
        self._device: Optional[torch.device] = None
        self._table: Optional[ParameterTable] = None

    def get(self, params: Sequence[SamplingParams], device: torch.device | str) -> ParameterTable:
        params, device = tuple(params), torch.device(device)
        if self._table is None or device != self._device or params != self._params:
            self._params, self._device, self._table = params, device, ParameterTable.of(params, device)
        return self._table


@dataclass
class SamplerOutput:
    """Chosen tokens of one step and their logprobs under the raw model distribution.

    The raw distribution is ``log_softmax`` of the logits as given to the sampler, before
    penalties, banned ids, temperature and truncation. ``top_*`` are ``None`` when no row
    asked for top logprobs.
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    ranks: torch.Tensor  # [B] int64, 1-based
    top_token_ids: Optional[torch.Tensor]  # [B, num_logprobs] int64, descending
    top_logprobs: Optional[torch.Tensor]  # [B, num_logprobs] float32
    # The first three as float64 columns ``[B, 3]`` where the step already packed them for the
    # host copy (the greedy kernels do); None: ``to_host_async`` packs them.
    packed: Optional[torch.Tensor] = None

    def to_host(self) -> "SamplerOutput":
        """The same output on the CPU (see ``to_host_async``), waited for."""
        return self.to_host_async().wait()

    def to_host_async(self, began: Optional["torch.cuda.Event"] = None) -> "HostSamplerOutput":
        """Start the one device-to-host copy of this output (float64 holds token ids, ranks
        and float32 logprobs exactly); ``wait()`` on the result gives it on the CPU. ``began``:
        a timing event recorded where the step that computed it began (``device_seconds``)."""
        if self.packed is not None and self.top_token_ids is None:
            packed = self.packed
        else:
            columns = [self.token_ids[:, None], self.logprobs[:, None], self.ranks[:, None]]
            if self.top_token_ids is not None:
                columns += [self.top_token_ids, self.top_logprobs]
            packed = torch.cat([column.double() for column in columns], dim=1)
        num_top = -1 if self.top_token_ids is None else self.top_token_ids.shape[1]
        if packed.device.type != "cuda":
            return HostSamplerOutput(packed.cpu(), num_top, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event(enable_timing=began is not None)
        copied.record()
        return HostSamplerOutput(host, num_top, copied, began)


@dataclass
class HostSamplerOutput:
    """A ``SamplerOutput`` on its way to the host: ``packed`` is valid once ``copied`` is done."""
    packed: torch.Tensor  # [B, 3 + 2 * num_top] float64 (pinned on CUDA machines)
    num_top: int  # -1: no top logprobs
    copied: Optional["torch.cuda.Event"]
    began: Optional["torch.cuda.Event"] = None  # a timing event where the step began

    def device_seconds(self) -> Optional[float]:
        """After ``wait``: the seconds the device spent from the step's beginning to this copy
        (its kernels, and any wait within the step for the host to launch them; not the time it
        queued behind the step before it). None off CUDA or without a beginning event."""
        if self.began is None or self.copied is None:
            return None
        return self.began.elapsed_time(self.copied) / 1e3

    def wait(self) -> SamplerOutput:
        if self.copied is not None:
            self.copied.synchronize()
        host, num_top = self.packed, self.num_top
        if num_top < 0:
            return SamplerOutput(host[:, 0].long(), host[:, 1].float(), host[:, 2].long(), None, None)
        return SamplerOutput(host[:, 0].long(), host[:, 1].float(), host[:, 2].long(),
                             host[:, 3:3 + num_top].long(), host[:, 3 + num_top:].float())


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Logprob and rank of ``token_ids`` under ``log_softmax(logits)``, plus the top ``num_top``.

    ``logits`` is ``[N, V]`` (any float dtype; computed in float32), ``token_ids`` is ``[N]``.
    The rank is 1 + the number of tokens with a strictly greater logit. With ``num_top == 0``
    no full log-softmax is materialised and the top tensors are ``None``.
    """
    logits = logits.float()
    normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen_logits = logits.gather(1, token_ids.long().unsqueeze(1))
    chosen_logprobs = (chosen_logits - normaliser).squeeze(1)
    ranks = (logits > chosen_logits).sum(dim=-1) + 1
    if num_top <= 0:
        return chosen_logprobs, ranks, None, None
    top_values, top_ids = logits.topk(min(num_top, logits.shape[-1]), dim=-1)
    return chosen_logprobs, ranks, top_ids, top_values - normaliser


def flat_row_indices(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_index, token_id)`` pairs of ragged per-row token lists, ids ``>= vocab_size`` dropped."""
    lengths = torch.tensor([len(ids) for ids in rows], dtype=torch.int64)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    row_index = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    in_vocab = token_ids < vocab_size
    return to_device(row_index[in_vocab], device), to_device(token_ids[in_vocab], device)


def token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` float32 count of each token id in each row's list."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    row_index, token_ids = flat_row_indices(rows, vocab_size, device)
    counts.index_put_((row_index, token_ids), torch.ones_like(token_ids, dtype=torch.float32),
                      accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties in place (vLLM semantics).

    Repetition penalty: for tokens seen in the prompt or the output, positive logits are
    divided by it and the others multiplied. Then the frequency penalty times the token's
    count in the output, and the presence penalty once per token present in the output, are
    subtracted.
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(metadata.output_token_ids, vocab_size, logits.device)
    seen = token_counts(metadata.prompt_token_ids, vocab_size, logits.device) + output_counts > 0
    repetition = metadata.repetition_penalty.to(logits.device).unsqueeze(1)
    scale = torch.where(seen, repetition, torch.ones_like(repetition))
    logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
    logits -= metadata.frequency_penalty.to(logits.device).unsqueeze(1) * output_counts
    logits -= metadata.presence_penalty.to(logits.device).unsqueeze(1) * (output_counts > 0)
    return logits


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set each row's banned token ids to -inf in place."""
    if not any(banned_token_ids):
        return logits
    row_index, token_ids = flat_row_indices(banned_token_ids, logits.shape[-1], logits.device)
    if token_ids.numel():
        logits[row_index, token_ids] = float("-inf")
    return logits


def takes_greedy_kernels(logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
    """Whether a step's choice is the raw logits' argmax with nothing else asked for (every row
    greedy; no penalty, grammar mask, banned id or top logprob): on CUDA two small kernels
    (``tandem.kernels.greedy_choice``) then give the tokens, logprobs and ranks."""
    return (logits.is_cuda and metadata.all_greedy and metadata.no_penalties and metadata.token_bitmask is None
            and metadata.num_logprobs == 0 and not any(metadata.banned_token_ids) and logits.stride(-1) == 1)


def takes_greedy_choice(params: SamplingParams) -> bool:
    """Whether a row's token is, whatever step it samples in, the raw logits' greedy choice with
    nothing changing the logits (greedy; no penalty, grammar or min_tokens' banned ids; top
    logprobs of the raw logits may be asked). The engine core plans a tensor-parallel step of
    such rows to gather no logits (``parallel/vocab_choice.py``)."""
    return (params.temperature < GREEDY_TEMPERATURE_EPSILON and not params.uses_penalties
            and params.min_tokens == 0 and params.structured_outputs is None)


def greedy_mask(temperature: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: which rows take the argmax instead of sampling."""
    return temperature < GREEDY_TEMPERATURE_EPSILON


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each sampled row by its temperature in place; greedy rows are left unchanged."""
    temperature = temperature.to(logits.device)
    divisor = torch.where(greedy_mask(temperature), torch.ones_like(temperature), temperature)
    return logits.div_(divisor.unsqueeze(1))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf, in place, the tokens outside each row's top-k, then outside its top-p.

    Top-k keeps every token whose logit is at least the k-th largest (ties kept); ``k <= 0``
    or ``k >= V`` is off. Top-p then works on the renormalised top-k distribution and keeps the
    smallest prefix of tokens, by descending probability, whose mass reaches ``p``: a token is
    kept when the mass strictly before it is below ``p``, so the top token is always kept.
    ``p >= 1`` is off.
    """
    vocab_size = logits.shape[-1]
    top_k = top_k.to(logits.device)
    top_p = top_p.to(logits.device)
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > vocab_size), torch.full_like(top_k, vocab_size), top_k)
    kth_largest = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside_top_p = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop_sorted = outside_top_p | (sorted_logits == float("-inf"))
    drop = torch.empty_like(drop_sorted).scatter_(1, sorted_index, drop_sorted)
    return logits.masked_fill_(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf, in place, tokens whose probability is below ``min_p`` × the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(logits.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


class Sampler:
    """Chooses one token per row from a step's logits (see the module docstring).

    Owns one shared ``torch.Generator`` on ``device`` for rows without their own generator:
    seeded from ``seed`` when given, otherwise from fresh entropy.
    """

    def __init__(self, seed: Optional[int] = None, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample ``[B]`` tokens from ``[B, V]`` logits; the caller's logits are never modified."""
        if logits.dim() != 2 or logits.shape[0] != metadata.batch_size:
            raise ValueError(f"sampler: logits of shape {tuple(logits.shape)} do not match "
                             f"{metadata.batch_size} rows of sampling metadata")
        if takes_greedy_kernels(logits, metadata):
            choice = greedy_choice(logits)
            return SamplerOutput(choice.token_ids, choice.logprobs, choice.ranks, None, None, packed=choice.packed)
        raw_logits = logits.float()
        processed = self.process_logits(raw_logits.clone(), metadata)
        token_ids = processed.argmax(dim=-1)
        if not metadata.all_greedy:
            sampled = self.sample(processed, metadata)
            greedy_rows = greedy_mask(metadata.temperature.to(logits.device))
            token_ids = torch.where(greedy_rows, token_ids, sampled)
        chosen, ranks, top_ids, top_logprobs = compute_logprobs(raw_logits, token_ids, metadata.num_logprobs)
        return SamplerOutput(token_ids, chosen, ranks, top_ids, top_logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Penalties, the grammar's mask, then banned ids, in place on a float32 copy; what greedy
        rows take the argmax of."""
        if not metadata.no_penalties:
            apply_penalties(logits, metadata)
        if metadata.token_bitmask is not None:
            apply_bitmask(logits, metadata.token_bitmask)
        return apply_banned_tokens(logits, metadata.banned_token_ids)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then an exponential race; in place on ``logits``.

        Returns ``[B]`` tokens; values in greedy rows are meaningless (the caller overrides them).
        """
        probs = self.probabilities(logits, metadata)
        return probs.div_(self.exponential_noise(probs, metadata.generators)).argmax(dim=-1)

    @staticmethod
    def probabilities(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution sampled rows draw from: temperature, top-k, top-p, min-p, softmax
        (in place on ``logits``, as processed by ``process_logits``)."""
        apply_temperature(logits, metadata.temperature)
        if not metadata.no_top_k_top_p:
            apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if not metadata.no_min_p:
            apply_min_p(logits, metadata.min_p)
        return logits.softmax(dim=-1)

    def draw(self, probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
        """``[B]`` tokens drawn from each row of ``probs`` (an exponential race; see
        ``exponential_noise``)."""
        return (probs / self.exponential_noise(probs, generators)).argmax(dim=-1)

    def exponential_noise(
        self, probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]
    ) -> torch.Tensor:
        """``[B, V]`` Exp(1) draws: argmax(probs / noise) is a sample from each row's ``probs``.

        A row with its own generator draws ``V`` values from it alone; the other rows share one
        vectorised draw from the sampler's generator. Every row draws, greedy rows of a mixed
        batch included, which keeps the draw loop free of device syncs. Draws are clamped away
        from zero so no masked token (probability 0) can win through 0 / 0.
        """
        vocab_size = probs.shape[-1]
        noise = torch.empty_like(probs)
        shared_rows = [row for row, generator in enumerate(generators) if generator is None]
        if shared_rows:
            shared = torch.empty(len(shared_rows), vocab_size, device=probs.device)
            shared.exponential_(generator=self.generator)
            noise[to_device(shared_rows, probs.device, torch.long)] = shared
        for row, generator in enumerate(generators):
            if generator is not None:
                draw = torch.empty(vocab_size, device=probs.device)
                noise[row] = draw.exponential_(generator=generator)
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
