"""All-reduce for the small messages of decode: one-shot and two-shot over peer buffers, NCCL
above; chosen by size per call, behind ``TensorShard.all_reduce`` and ``reduce_add_norm``.

At decode sizes (8 KiB at batch 1, 512 KiB at batch 64 for a 4,096-wide bf16 hidden state)
NCCL's ring spends most of its ~10 µs on latency. Over NVLink a rank can instead read its
peers' memory directly:

- **one-shot** (``kernels/one_shot_allreduce.py``, Triton): each rank stores its input into a
  slot of every peer's buffer and sums what the peers stored into its own, waiting on the data
  itself (an empty slot holds negative zeros, which no push leaves), with no barrier; the same
  kernel can add the residual and take the RMSNorm that follow (``reduce_add_norm``);
- **two-shot** (torch's ``symm_mem.two_shot_all_reduce_out``): each rank reduces one slice of
  the message (reduce-scatter), then gathers the others' slices (all-gather): 2/N of the bytes
  cross the links per rank instead of N-1 times the message;
- **NCCL** for larger messages, dtypes the peer kernels do not sum, or unaligned sizes.

The peer buffers are torch symmetric memory (``torch.distributed._symmetric_memory``), allocated
once at group join and never resized, so a captured CUDA graph keeps addresses that stay
valid; every one-shot call leaves the slots it used empty and its state (the parity of the
region the next call uses) in device memory, and torch's two-shot leaves its signal slots at
zero, so a replay is correct. NVLink multicast
stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NCCL_NVLS_ENABLE=0``,
``NVSHMEM_DISABLE_NVLS=1``; a handle that came back with a multicast address is refused).

Every rank must choose the same algorithm for the same call: ``choose_algorithm`` is a pure
function of the message and of ``AllReduceLimits``, which every rank reads from the environment
and checks equal over the control group at join.

One symmetric-memory group per process: torch's rendezvous keeps per-process state across groups,
and a process that rendezvoused with one group (an engine since shut down) and then joins a new
group with fresh processes waits forever (seen on two H200s: a second TP=2 engine in one Python
process hung in its first rendezvous). So a join where any rank has already made a
symmetric-memory group in its process takes NCCL for every message, decided alike on every rank
before any rendezvous. A server runs one engine per process and is unaffected.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import astuple, dataclass, fields, replace
from typing import Mapping, Optional

import torch

logger = logging.getLogger("tandem.parallel")

ONE_SHOT, TWO_SHOT, NCCL = "one_shot", "two_shot", "nccl"
ALGORITHMS = (ONE_SHOT, TWO_SHOT, NCCL)
PEER_DTYPES = (torch.bfloat16, torch.float32)  # what both peer kernels sum (torch's two-shot: these two)
TWO_SHOT_WORLD_SIZES = (2, 4, 8)  # torch's two-shot kernel is built for these
MAX_PEER_WORLD_SIZE = 8
ALIGNMENT = 16  # bytes: message sizes and offsets the peer kernels move in 16-byte vectors

KIB, MIB = 1 << 10, 1 << 20

# The environment that must keep NVLink multicast off (set where the peer buffers are made,
# before any symmetric allocation or NCCL communicator reads it).
# Set once this process has made a symmetric-memory group (see the module docstring): a fact
# about the process, which torch's own per-process state makes true for its whole life.
_PROCESS_HAS_SYMMETRIC_MEMORY = False

NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class AllReduceLimits:
    """Where each algorithm stops (message bytes, inclusive); each from the environment variable
    named in ``ENVIRONMENT``, else ``defaults_for`` the group's size; 0 turns a path off."""
    one_shot_max_bytes: int = 512 * KIB
    two_shot_max_bytes: int = 8 * MIB
    # reduce + residual add + RMSNorm in one one-shot kernel up to this size (above: the
    # all-reduce chosen by size, then the fused add+norm kernel).
    fused_max_bytes: int = 512 * KIB

    ENVIRONMENT = {"one_shot_max_bytes": "TANDEM_ALLREDUCE_ONE_SHOT_MAX_BYTES",
                   "two_shot_max_bytes": "TANDEM_ALLREDUCE_TWO_SHOT_MAX_BYTES",
                   "fused_max_bytes": "TANDEM_ALLREDUCE_FUSED_MAX_BYTES"}

    @classmethod
    def defaults_for(cls, world_size: int) -> "AllReduceLimits":
        """The defaults for ``world_size`` ranks. On two, one-shot beats two-shot and NCCL up to
        16 MiB and the fused kernel beats the pair up to 2 MiB (``benchmarks/allreduce.py`` on two
        GPUs joined by NVLink, docs/allreduce.md), so one-shot takes messages up to 4 MiB (its
        buffer holds 16 slots of that: 64 MiB a rank) and the fused kernel up to 2 MiB. Two-shot
        takes the rest up to 32 MiB, where it is as fast as NCCL on the GPU and costs the host
        less: a prefill chunk's messages (thousands of rows) go through it from eager forward
        passes, whose launches bound a TP=2 prefill step (1.6% more throughput at batch 64 on
        2 x H200). With more ranks a one-shot rank stores its message into every peer: on four
        (4 x H200 joined by NVLink) one-shot beats two-shot up to 1 MiB, two-shot beats NCCL up to
        16 MiB and the fused kernel beats the pair up to 512 KiB, so those are the limits there.
        Other sizes keep one-shot and the fused kernel to 512 KiB and two-shot to 8 MiB (unmeasured
        there: set the variables from the benchmark)."""
        if world_size == 2:
            return cls(one_shot_max_bytes=4 * MIB, two_shot_max_bytes=32 * MIB, fused_max_bytes=2 * MIB)
        if world_size == 4:
            return cls(one_shot_max_bytes=MIB, two_shot_max_bytes=16 * MIB, fused_max_bytes=512 * KIB)
        return cls()

    @classmethod
    def from_environment(cls, environment: Optional[Mapping[str, str]] = None,
                         world_size: Optional[int] = None) -> "AllReduceLimits":
        """The limits set in ``environment`` (default ``os.environ``), ``defaults_for(world_size)``
        elsewhere (no size: the class's own); a value that is not a non-negative integer raises
        ValueError naming its variable."""
        environment = os.environ if environment is None else environment
        values = {}
        for field in fields(cls):
            name = cls.ENVIRONMENT[field.name]
            text = environment.get(name)
            if text is None or text == "":
                continue
            try:
                values[field.name] = int(text)
            except ValueError:
                raise ValueError(f"{name}: must be a number of bytes, got {text!r}") from None
            if values[field.name] < 0:
                raise ValueError(f"{name}: must be >= 0, got {text!r}")
        defaults = cls() if world_size is None else cls.defaults_for(world_size)
        return replace(defaults, **values)

    @property
    def one_shot_bytes(self) -> int:
        """Bytes of the one-shot (and fused) peer buffer."""
        return _aligned(max(self.one_shot_max_bytes, self.fused_max_bytes))

    @property
    def two_shot_bytes(self) -> int:
        """Bytes of the two-shot peer buffer (0: none)."""
        return _aligned(self.two_shot_max_bytes) if self.two_shot_max_bytes > self.one_shot_max_bytes else 0


def _aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def peer_eligible(tensor: torch.Tensor) -> bool:
    """Whether the peer kernels can take ``tensor`` at all: a dtype they sum, dense, its start
    and size multiples of 16 bytes."""
    size = tensor.numel() * tensor.element_size()
    return (tensor.dtype in PEER_DTYPES and tensor.is_contiguous() and size % ALIGNMENT == 0
            and (tensor.storage_offset() * tensor.element_size()) % ALIGNMENT == 0)


def choose_algorithm(size: int, eligible: bool, world_size: int, limits: AllReduceLimits) -> str:
    """The algorithm for a message of ``size`` bytes (``eligible``: ``peer_eligible``) among
    ``world_size`` ranks: the first of one-shot, two-shot, NCCL whose limit holds it."""
    if not eligible or size == 0 or world_size > MAX_PEER_WORLD_SIZE:
        return NCCL
    if size <= limits.one_shot_max_bytes:
        return ONE_SHOT
    if size <= limits.two_shot_max_bytes and world_size in TWO_SHOT_WORLD_SIZES:
        return TWO_SHOT
    return NCCL


def fuses(size: int, eligible: bool, world_size: int, limits: AllReduceLimits) -> bool:
    """Whether ``reduce_add_norm`` of a ``size``-byte message runs as one fused kernel."""
    return eligible and 0 < size <= limits.fused_max_bytes and world_size <= MAX_PEER_WORLD_SIZE


MAX_CACHED_VIEWS = 64


class PeerBuffers:
    """One symmetric-memory allocation of ``size`` bytes on every rank, rendezvoused over the
    group named ``group_name``; the device tensors of every rank's buffer and signal-pad
    addresses, for the Triton kernels. Owner: ``PeerAllReduce``; freed with it."""

    def __init__(self, size: int, device: torch.device, group_name: str, prepare=None) -> None:
        import torch.distributed._symmetric_memory as symmetric_memory

        self.tensor = symmetric_memory.empty(size, dtype=torch.uint8, device=device)
        if prepare is not None:  # before the rendezvous: no peer can see the buffer yet
            prepare(self.tensor)
            torch.cuda.synchronize(device)
        self.handle = symmetric_memory.rendezvous(self.tensor, group_name)
        if getattr(self.handle, "multicast_ptr", 0):
            raise RuntimeError("symmetric memory came back with an NVLink multicast address; "
                               "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 must be set before it is made")
        self.buffer_pointers = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.signal_pointers = torch.tensor(self.handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        # The views handed out, by dtype and shape: an eager step all-reduces one shape two
        # times a layer, and making the view (a slice, two views) took 3% of a TP=2 rank's host
        # time in eager prefill-phase steps (py-spy, 2 x H200), where a lookup costs a tenth.
        self.views: dict[tuple[torch.dtype, torch.Size], torch.Tensor] = {}

    def view(self, like: torch.Tensor) -> torch.Tensor:
        """The buffer's first bytes as a tensor of ``like``'s shape and dtype."""
        key = (like.dtype, like.shape)
        view = self.views.get(key)
        if view is None:
            if len(self.views) >= MAX_CACHED_VIEWS:  # (every step's token count is a shape: keep a few)
                self.views.clear()
            size = like.numel() * like.element_size()
            view = self.views[key] = self.tensor[:size].view(like.dtype).view(like.shape)
        return view


class PeerAllReduce:
    """This rank's one-shot / two-shot all-reduce over peer buffers (``make_peer_all_reduce``
    builds it at group join). Owner: the rank's ``ParallelGroups``; the buffers live as long as
    it. Every method returns None where the message goes to NCCL instead."""

    def __init__(self, rank: int, world_size: int, device: torch.device, limits: AllReduceLimits,
                 group_name: str, process_group=None) -> None:
        self.rank, self.world_size, self.device, self.limits = rank, world_size, device, limits
        self.group_name = group_name
        # The process group registered under ``group_name`` (``_register_group``): torch's
        # registry holds it weakly and its operators resolve it by name at every call.
        self.process_group = process_group
        self.one_shot, self.slot_bytes = None, limits.one_shot_bytes
        if self.slot_bytes:
            from tandem.kernels.one_shot_allreduce import empty_peer_buffer, peer_buffer_bytes

            self.one_shot = PeerBuffers(peer_buffer_bytes(self.slot_bytes, world_size), device, group_name,
                                        lambda buffer: empty_peer_buffer(buffer, self.slot_bytes, world_size))
        two_shot = limits.two_shot_bytes and world_size in TWO_SHOT_WORLD_SIZES
        self.two_shot = PeerBuffers(limits.two_shot_bytes, device, group_name) if two_shot else None

    def algorithm(self, tensor: torch.Tensor) -> str:
        return choose_algorithm(tensor.numel() * tensor.element_size(), peer_eligible(tensor), self.world_size,
                                self.limits)

    def all_reduce(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The sum over ranks of ``tensor``, in place; None: NCCL's to do."""
        algorithm = self.algorithm(tensor)
        if algorithm == ONE_SHOT:
            from tandem.kernels.one_shot_allreduce import one_shot_all_reduce

            return one_shot_all_reduce(tensor, buffer_pointers=self.one_shot.buffer_pointers,
                                       signal_pointers=self.one_shot.signal_pointers, rank=self.rank,
                                       world_size=self.world_size, slot_bytes=self.slot_bytes)
        if algorithm == TWO_SHOT:
            # The input must sit in the peer buffer; the copy finishes (stream order) before the
            # kernel's first barrier, which every rank passes only once all have copied.
            staged = self.two_shot.view(tensor)
            staged.copy_(tensor)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, tensor)
            return tensor
        return None

    def reduce_add_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        **norm_options) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(norm(sum + residual), sum + residual)`` in one kernel; None where the message is
        not fused (the caller all-reduces, then adds and normalises)."""
        size = partial.numel() * partial.element_size()
        if residual.dtype != partial.dtype or not fuses(size, peer_eligible(partial), self.world_size, self.limits):
            return None
        from tandem.kernels.one_shot_allreduce import one_shot_reduce_add_norm

        return one_shot_reduce_add_norm(partial, residual, weight, eps, buffer_pointers=self.one_shot.buffer_pointers,
                                        signal_pointers=self.one_shot.signal_pointers, rank=self.rank,
                                        world_size=self.world_size, slot_bytes=self.slot_bytes, **norm_options)


def make_peer_all_reduce(control, store, rank: int, size: int, device: torch.device,
                         tensor_backend=None) -> Optional[PeerAllReduce]:
    """This rank's ``PeerAllReduce``, or None on every rank (NCCL for everything) where it cannot
    work: a CPU, one rank, more than 8, ranks on different hosts, or symmetric memory failing on
    any rank. Collective over ``control``: every rank calls it, and all decide alike."""
    from tandem.parallel.graphs import same_on_every_rank
    from tandem.parallel.control import exchange

    if device.type != "cuda" or size < 2 or size > MAX_PEER_WORLD_SIZE:
        return None
    limits = AllReduceLimits.from_environment(world_size=size)
    same_on_every_rank(control, list(astuple(limits)), "the all-reduce limits (TANDEM_ALLREDUCE_*)")
    hosts = exchange(control, socket.gethostname().encode())
    if len(set(hosts)) > 1:
        logger.info("peer all-reduce off: the ranks are on %d hosts", len(set(hosts)))
        return None
    global _PROCESS_HAS_SYMMETRIC_MEMORY
    earlier = [bool(part) for part in exchange(control, b"1" if _PROCESS_HAS_SYMMETRIC_MEMORY else b"")]
    if any(earlier):
        logger.warning("peer all-reduce off (NCCL for every message): rank(s) %s already made a symmetric-memory "
                       "group in their process (an earlier engine), and torch's rendezvous cannot make a second "
                       "one there", [index for index, used in enumerate(earlier) if used])
        return None
    _PROCESS_HAS_SYMMETRIC_MEMORY = True
    # One name for the symmetric-memory group, chosen by rank 0, unique per join.
    group_name = "tandem-tp-" + exchange(control, uuid.uuid4().hex.encode() if rank == 0 else b"")[0].decode()
    peer, failure = None, ""
    try:
        process_group = _register_group(group_name, store, rank, size, tensor_backend)
        peer = PeerAllReduce(rank, size, device, limits, group_name, process_group)
    except Exception as error:  # noqa: BLE001 - reported, and every rank falls back alike
        failure = f"{type(error).__name__}: {error}"
    failures = [part.decode() for part in exchange(control, failure.encode())]
    if any(failures):
        logger.warning("peer all-reduce off (NCCL for every message): %s", "; ".join(f for f in failures if f))
        return None
    logger.info("tensor-parallel rank %d: one-shot all-reduce up to %d bytes (fused with add+norm up to %d), "
                "two-shot up to %d, NCCL above", rank, limits.one_shot_max_bytes, limits.fused_max_bytes,
                limits.two_shot_max_bytes if peer.two_shot is not None else limits.one_shot_max_bytes)
    return peer


def _register_group(group_name: str, store, rank: int, size: int, tensor_backend=None):
    """Make ``group_name`` mean our ranks to torch's symmetric memory: its store, rank and size
    (``set_group_info``), and a process group registered under that name, which its
    rendezvous and operators resolve by name (our groups are backend objects outside
    ``torch.distributed``'s registry: the registered group wraps the tensor group's NCCL
    backend). Returns that group (None without a backend); the caller keeps it alive."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

    group_store = dist.PrefixStore(f"symmetric-memory/{group_name}", store)
    _SymmetricMemory.set_group_info(group_name, rank, size, group_store)
    if tensor_backend is None:
        return None
    group = dist.ProcessGroup(group_store, rank, size)
    backend_type = dist.ProcessGroup.BackendType.NCCL
    group._register_backend(torch.device("cuda"), backend_type, tensor_backend)
    group._set_default_backend(backend_type)
    group._set_group_name(group_name)
    _register_process_group(group_name, group)
    return group
