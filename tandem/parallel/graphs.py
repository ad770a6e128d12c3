"""CUDA graphs under tensor parallelism: every rank captures the same decode graphs (and the same
mixed-step graphs, where they apply: ``capture_mixed_on_every_rank``).

The graphs hold the layers' collectives (the row-parallel all-reduces, the embedding's
all-reduce, the LM head's all-gather: NCCL kernels captured by ``ProcessGroupNCCL`` on the
capture stream; PyTorch keeps such work off its watchdog while a capture is under way and waits
for enqueued work before one starts). Nothing crosses the ranks while capturing, but every
replay on one rank must meet the same replay on the others, so:

- every rank captures the same sizes in the same order at start-up (the eager warm-up passes
  between captures hold collectives too): the sizes are checked equal over the control group
  before capturing, and the captured ones after;
- for each step the engine core's planner decides graph or eager (``worker/graph_choice.py``, a pure
  function of the step's inputs, the pending loads and what rank 0's worker captured) and names the graph in the step plan; a worker checks that it has that graph
  and would choose the same (``ModelRunner.planned_graph_step``) and raises otherwise, instead
  of waiting forever on a collective no other rank runs.

The collectives stay those of ``torch.distributed``'s NCCL group: ``ProcessGroupNCCL`` captures
them once its communicator exists (one eager all-reduce before the first capture makes it) and
when it does not ``recordStream`` its tensors inside the capture (``TORCH_NCCL_AVOID_RECORD_STREAMS``,
set where the group is made); the logits gather uses one output buffer, so no copy-back runs on
the group's stream. That is simpler than a communicator of our own for the graphs (a separate
NCCL communicator driven directly, as some engines keep), which would only pay where the group
refuses capture. The input ids rank 0 broadcasts (tokens pending on its device) go eagerly,
between the static-buffer copies and the replay, on every rank alike.
"""
from __future__ import annotations

import logging

import torch

from tandem.parallel.control import smallest

logger = logging.getLogger("tandem.parallel")


def _extreme(control, values: torch.Tensor, op_name: str) -> torch.Tensor:
    import torch.distributed as dist

    options = dist.AllreduceOptions()
    options.reduceOp = getattr(dist.ReduceOp, op_name)
    values = values.clone()
    control.allreduce([values], options).wait()
    return values


def same_on_every_rank(control, values: list[int], what: str) -> None:
    """Raises ValueError on every rank unless every rank holds the same ``values``."""
    length = torch.tensor([len(values)], dtype=torch.int64)
    width = int(_extreme(control, length, "MAX").item())
    padded = torch.full((width + 1,), -1, dtype=torch.int64)
    padded[0] = len(values)
    padded[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    if not torch.equal(_extreme(control, padded, "MIN"), _extreme(control, padded, "MAX")):
        raise ValueError(f"tensor_parallel_size: the ranks disagree on {what} (rank {control.rank()} has {values})")


def capture_on_every_rank(runner, groups, batch_sizes: list[int], max_model_len: int,
                          max_num_batched_tokens: int) -> list[int]:
    """Capture ``runner``'s decode graphs on this rank, in step with the others (every rank
    calls this at start-up with its own runner). Returns the sizes captured (empty: eager)."""
    same_on_every_rank(groups.control, list(batch_sizes), "the CUDA graph sizes to capture")
    sizes = runner.capture_graphs(batch_sizes, max_model_len, max_num_batched_tokens)
    captured = sorted(runner.graphs.graphs) if runner.graphs is not None else []
    same_on_every_rank(groups.control, sizes + [0] + captured, "the CUDA graph sizes captured")
    logger.info("tensor-parallel rank %d of %d: decode steps replay CUDA graphs of %s rows%s", groups.rank,
                groups.size, sizes or "no", "" if captured == sizes else " (static buffers only: nothing captured)")
    return sizes


def every_rank_agrees(control, value: bool) -> bool:
    """Whether ``value`` is true on every rank (a collective every rank makes)."""
    return smallest(control, int(value)) == 1


def capture_mixed_on_every_rank(runner, groups, token_sizes: list[int]) -> list[int]:
    """Capture ``runner``'s mixed-step graphs (``worker/mixed_graphs.py``) on this rank, in step
    with the others: the same sizes everywhere, every rank capturing or none, and after each
    size an agreement that every rank captured it (a failure anywhere leaves all eager). The
    step's token count, which every rank's plan carries, then chooses the same graph on every
    rank. Returns the sizes captured (empty: steps with a prompt chunk run eagerly)."""
    same_on_every_rank(groups.control, list(token_sizes), "the mixed-step CUDA graph sizes to capture")
    if not every_rank_agrees(groups.control, runner.wants_mixed_graphs(token_sizes)):
        return []
    sizes = runner.capture_mixed_graphs(token_sizes, agree=lambda ok: every_rank_agrees(groups.control, ok))
    logger.info("tensor-parallel rank %d of %d: steps with a prompt chunk replay mixed-step graphs of %s tokens",
                groups.rank, groups.size, sizes or "no")
    return sizes
