"""The token bitmask of a step: one row per sampled row, bit ``t`` of row ``r`` set when token
``t`` is allowed there (xgrammar's layout: ``[rows, ceil(vocab / 32)]`` int32).

Filled on the host from the rows' matchers (unconstrained rows allow every token), copied to
the device with the step's other sampling inputs, applied to the logits there by one kernel
(``apply_bitmask``): nothing waits for the device.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from tandem.structured.matcher import RequestGrammar


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(grammars: Sequence[Optional[RequestGrammar]], bitmask: torch.Tensor,
                 batch_filler=None) -> None:
    """Write the tokens each constrained row allows next into ``bitmask[row]`` (a host tensor of
    one row per grammar, every row allowing every token beforehand). A row whose matcher has
    terminated keeps allowing every token: its sequence has finished and the token is
    discarded; so does a row still in its thinking (``RequestGrammar.in_thinking``).
    ``batch_filler`` (an ``xgrammar.BatchGrammarMatcher``) fills several rows on its threads,
    without the interpreter lock."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None and grammar.constrains_next]
    if batch_filler is not None and len(rows) > 1:
        batch_filler.batch_fill_next_token_bitmask([grammars[row].matcher for row in rows], bitmask, rows)
    else:
        for row in rows:
            grammars[row].fill(bitmask, row)


# Past this many threads a step's rows (64 or so) are split too finely to gain more.
MAX_FILL_THREADS = 16


def fill_threads() -> int:
    """Threads for filling a step's rows: every core this process may use, up to
    ``MAX_FILL_THREADS`` (the engine's own thread only waits for them meanwhile). Counted from the
    process's CPU affinity and its cgroup's CPU quota, not from the machine's cores: a container
    given 16 cores of a 200-core host that started 100 threads would spend its quota in a few
    milliseconds and be stalled for the rest of the period."""
    return max(1, min(available_cores(), MAX_FILL_THREADS))


def available_cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this platform)
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota is not None else cores


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Whole cores of this process's CPU quota (cgroup v2 ``cpu.max``, or v1's CFS quota and
    period), rounded up; ``None`` when there is no quota or no cgroup file to read."""
    try:
        with open(os.path.join(root, "cpu.max")) as file:
            quota, period = file.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as file:
                quota = file.read().strip()
            with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as file:
                period = file.read().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or not quota.lstrip("-").isdigit() or not period.isdigit() or int(period) <= 0:
        return None
    return max(1, -(-int(quota) // int(period)))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place (``bitmask`` on the logits' device).
    CUDA: xgrammar's kernel; elsewhere the plain-PyTorch reference."""
    if logits.device.type == "cuda":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        return logits
    return apply_bitmask_reference(logits, bitmask)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: unpack the bits to ``[rows, vocab]`` booleans and mask."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:  # logits wider than the mask: ids past it are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return logits.masked_fill_(~allowed, float("-inf"))
