"""A rank's place in a tensor-parallel group and the collectives sharded layers call.

Owner: the engine (rank 0) or the worker builds one per process and hands it to the model's
constructor; layers keep a reference and never change it. ``SINGLE`` is the one-rank shard
(no collectives run; every layer computes as if unsharded).

On CUDA the sums go, by size, to the peer all-reduce (``parallel/allreduce.py``: one-shot and
two-shot over symmetric memory, for the small messages of decode) or to the NCCL group; on a
CPU to gloo. Every rank makes the same choice for the same call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class TensorShard:
    rank: int = 0
    size: int = 1
    group: Optional[Any] = None  # a torch.distributed backend (ProcessGroupGloo / ProcessGroupNCCL)
    peer: Optional[Any] = None  # a parallel.allreduce.PeerAllReduce, or None: ``group`` sums everything

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, rows, ...); raises naming tensor_parallel_size
        when it does not divide evenly."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size: {self.size} does not divide {what} ({total})")
        return total // self.size

    def replicas(self, total: int) -> int:
        """How many ranks hold each of ``total`` heads: 1 where the ranks split them, ``size //
        total`` where there are fewer heads than ranks and ``total`` divides ``size`` (rank ``r``
        then holds head ``r // replicas``, the one its share of query heads reads under grouped-
        query attention). Otherwise 1, and ``split`` names the size that does not divide."""
        if total >= self.size or self.size % total:
            return 1
        return self.size // total

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (returned for chaining)."""
        if self.is_parallel and (self.peer is None or self.peer.all_reduce(tensor) is None):
            self.group.allreduce([tensor]).wait()
        return tensor

    def reduce_add_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(rms_norm(sum + residual), sum + residual)`` with ``sum`` the sum of ``partial`` over
        the ranks (Llama's norm convention), as one kernel where the peer path fuses a message of
        this size; None otherwise: the caller sums (``all_reduce``), then adds and normalises."""
        if not self.is_parallel or self.peer is None:
            return None
        return self.peer.reduce_add_norm(partial, residual, weight, eps)

    def create_communicator(self, device: torch.device) -> None:
        """One eager all-reduce through the group itself (never the peer path), so that NCCL
        makes its communicator now, outside any CUDA graph capture; every rank calls it."""
        if self.is_parallel:
            self.group.allreduce([torch.zeros(1, device=device)]).wait()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (equal shapes), concatenated along the last dimension in rank
        order."""
        if not self.is_parallel:
            return tensor
        tensor = tensor.contiguous()
        # One output buffer (rank-major), not a list: NCCL gathers straight into it, with no
        # copy-back on its stream afterwards (simpler inside a captured CUDA graph).
        gathered = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        self.group._allgather_base(gathered, tensor).wait()
        return torch.cat(gathered.view(self.size, *tensor.shape).unbind(0), dim=-1)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self.is_parallel:
            self.group.broadcast(tensor, root).wait()
        return tensor


SINGLE = TensorShard()
