"""Process-group setup for tensor parallelism.

Rank 0 opens a TCP store on a port of ``host`` (``open_store``; loopback unless the ranks span
hosts, as on a Ray cluster) before it starts the workers; every rank then joins the same groups
(``join``), each on its own ``address``:

- the control group (gloo): rank 0's step plans; it waits without a deadline, since
  a server may sit idle for hours between steps (a dead peer still fails it at once: its
  sockets close);
- the tensor group: the layers' collectives (NCCL on CUDA; on CPU the control group itself);
- on CUDA, unless turned off, the peer all-reduce (``allreduce.py``: symmetric-memory buffers
  for the small sums of decode, NCCL above).

Groups are backend objects held by whoever joined them (no ``torch.distributed`` default
group, no global state), so several engines may live in one process.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.parallel.allreduce import NO_MULTICAST, make_peer_all_reduce
from tandem.parallel.shard import TensorShard

LOOPBACK = "127.0.0.1"
STORE_TIMEOUT = datetime.timedelta(seconds=300)  # how long ranks may take to join
CONTROL_TIMEOUT = datetime.timedelta(days=365)  # an idle server waits on the control group
TENSOR_TIMEOUT = datetime.timedelta(minutes=10)  # one collective of a forward pass


@dataclass
class ParallelGroups:
    """One rank's membership. Owner: the rank that joined; ``store`` must outlive the groups."""
    rank: int
    size: int
    store: Any
    control: Any
    tensor: Any
    peer: Any = None  # allreduce.PeerAllReduce (its buffers live as long as these groups), or None

    @property
    def shard(self) -> TensorShard:
        return TensorShard(self.rank, self.size, self.tensor, self.peer)


def open_store(size: int, host: str = LOOPBACK):
    """Rank 0's store on a free port of ``host`` (an address of this machine): ``(store, port)``."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False,
                          master_listen_fd=listener.detach(), use_libuv=False)
    return store, port


def _gloo(store, prefix: str, rank: int, size: int, timeout: datetime.timedelta, address: str):
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


def join(rank: int, size: int, device: torch.device, store=None, port: int = 0, store_host: str = LOOPBACK,
         address: str = LOOPBACK, custom_all_reduce: bool = True) -> ParallelGroups:
    """Join rank ``rank`` of ``size`` (workers pass rank 0's ``store_host`` and ``port``; rank 0
    its ``store``). ``address`` is this rank's own, where the others reach its gloo sockets (an
    address of this machine the other ranks can route to). On CUDA the caller has made
    ``device`` current. ``custom_all_reduce``: the peer all-reduce for small messages (every rank
    must pass the same; False: NCCL for every sum)."""
    if store is None:
        store = dist.TCPStore(store_host, port, size, False, timeout=STORE_TIMEOUT)
    control = _gloo(store, "control", rank, size, CONTROL_TIMEOUT, address)
    if device.type == "cuda":
        # Collectives captured in CUDA graphs (parallel/graphs.py): the group keeps its tensors
        # alive with the work instead of recording them on its stream (``recordStream`` inside
        # a capture breaks it); read when the group is made.
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
        # NVLink multicast (NVLS) stays off: read by NCCL when its communicator is made, and by
        # symmetric memory when a buffer is (allreduce.py).
        for name, value in NO_MULTICAST.items():
            os.environ.setdefault(name, value)
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TENSOR_TIMEOUT
        tensor = dist.ProcessGroupNCCL(dist.PrefixStore("tensor", store), rank, size, options)
    else:
        tensor = control
    peer = None
    if custom_all_reduce and device.type == "cuda":
        peer = make_peer_all_reduce(control, store, rank, size, device, tensor)
    return ParallelGroups(rank, size, store, control, tensor, peer)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:(base + rank)`` on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


