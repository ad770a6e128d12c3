"""A reader's registered GPU memory opened in a writer's process (CUDA IPC), for the NCCL
backend's peer copies (``nccl_links.WriterLink``): a write becomes copies straight into the
reader's pages on the writer's own stream, the copy engines moving the bytes over NVLink.

At pairing the reader offers its registered regions (``offer_regions``): for each, the CUDA IPC
handle of the caching-allocator segment holding the region's storage (torch's
``UntypedStorage._share_cuda_``: the segment's handle, the storage's offset inside it, and a
reference counter), the storage's address and the region's own address and length, since a
registered region may be a view into a larger storage, itself inside a larger segment::

    segment (one cudaMalloc, one IPC handle)
    |---------------- storage ------------------------------------|
    ^ segment base  ^ storage (storage offset)  ^ region (region.address - storage address)

The writer opens each storage once (``open_peer_memory``: ``_new_shared_cuda`` in the writer's
own device context, once the reader's GPU, named by UUID, is found visible here) and keeps a
byte view per region, looked up by the reader's addresses, so a write's destinations are checked against, and can only ever land in,
the regions the reader offered. A writer in the reader's own process (tests, a 1P1D pair in one
process) uses the reader's addresses as they are: a process cannot open its own IPC handles.

Nothing here is pickled: an offer is a msgpack struct of integers and handle bytes, sent over
the pair's control connection, which only a writer that knew the reader's token (from the
authenticated PD handshake) could open.

Lifetimes. The mapping belongs to the writer's link thread: it is opened at pairing and released
(``PeerMemory.release``) when the link ends (unpairing, close, a failed pair), after the link's
stream finished every copy. The reader's pools live as long as its engine; should the reader free
a storage it offered while a writer still holds the mapping, torch's IPC bookkeeping keeps the
memory out of the allocator (the segment waits in torch's "limbo" until every mapping's reference
counter was released), so a late copy can never land in memory handed to another tensor. A writer
also stops copying as soon as it sees the reader's end of the control connection close.
"""
from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import torch

from tandem.transfer.byte_views import RegionViews, region_view
from tandem.transfer.descriptors import MemoryRegion

logger = logging.getLogger("tandem.transfer.nccl_backend")

# names this process in offers, so that a writer can tell it shares the reader's process
PROCESS_ID = uuid.uuid4().hex


class RegionShare(msgspec.Struct, frozen=True):
    """One offered region: where it lies in the reader's process (``address``, ``length``), its
    storage's address there, and the storage's ``_share_cuda_`` fields (empty handle: the writer
    shares the reader's process and uses ``address`` as it is)."""
    address: int
    length: int
    storage_address: int = 0
    handle: bytes = b""
    storage_bytes: int = 0
    storage_offset: int = 0
    counter_handle: bytes = b""
    counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False


class PeerOffer(msgspec.Struct, frozen=True):
    """The reader's answer to a writer asking for peer copies: its process, its GPU's UUID and
    every registered region; or, where it cannot share them, why (``reason``)."""
    process: str
    device_uuid: str
    regions: list[RegionShare] = []
    reason: str = ""

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, frame: bytes) -> "PeerOffer":
        return msgspec.msgpack.decode(frame, type=cls)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_of(uuid_text: str) -> int:
    """This process's index of the GPU with that UUID; RuntimeError when it is not visible here."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid_text:
            return index
    raise RuntimeError(f"the reader's GPU ({uuid_text}) is not visible to this process (CUDA_VISIBLE_DEVICES)")


def offer_regions(regions: list[MemoryRegion], device: int, writer_process: str) -> PeerOffer:
    """What the reader sends a writer of process ``writer_process`` that asked for peer copies.
    Any failure to share becomes the offer's ``reason`` (the pair then sends through NCCL)."""
    try:
        uuid_text = device_uuid(device)
        if writer_process == PROCESS_ID:
            return PeerOffer(PROCESS_ID, uuid_text, [RegionShare(region.address, region.length)
                                                     for region in regions])
        return PeerOffer(PROCESS_ID, uuid_text, [share_region(region) for region in regions])
    except Exception as error:  # noqa: BLE001 - reported to the writer, which falls back
        return PeerOffer(PROCESS_ID, "", [], f"the reader could not share its memory: {type(error).__name__}: {error}")


def share_region(region: MemoryRegion) -> RegionShare:
    if region.tensor is None:
        raise ValueError(f"the region at {region.address:#x} was registered without its tensor")
    storage = region.tensor.untyped_storage()
    (_, handle, storage_bytes, storage_offset, counter_handle, counter_offset, event_handle,
     event_sync_required) = storage._share_cuda_()
    return RegionShare(region.address, region.length, storage.data_ptr(), bytes(handle), int(storage_bytes),
                       int(storage_offset), bytes(counter_handle or b""), int(counter_offset or 0),
                       bytes(event_handle or b""), bool(event_sync_required))


@dataclass(eq=False)
class PeerMemory:
    """The reader's regions as this process addresses them. Owner: one writer link's thread
    (opened at pairing, ``release``d when the link ends)."""
    device: int  # the device the views are on in this process (the writer's; the reader's in its own process)
    views: RegionViews = field(default_factory=RegionViews)
    storages: list = field(default_factory=list)  # the opened IPC storages: the mapping lives while they do

    def view(self, address: int, length: int) -> torch.Tensor:
        """The reader's bytes ``address`` .. ``address + length`` (reader addresses), as a byte
        tensor on ``device``; ValueError unless they lie inside one offered region."""
        return self.views.view(address, length)

    def release(self) -> None:
        """Drop the mapping (the caller made sure no copy into it is still running)."""
        self.views = RegionViews()
        self.storages.clear()


def open_peer_memory(offer: PeerOffer, device: int) -> PeerMemory:
    """Open every offered region for copies from this process's ``device`` (RuntimeError saying
    why not: the caller falls back to NCCL). Another process's memory is opened in ``device``'s
    own context (CUDA IPC with peer access enabled lazily, as NCCL and UCX map a peer's buffers):
    no context is made on the reader's GPU, and a copy into it is a device copy on ``device``
    that the copy engine carries over NVLink. In the reader's own process its addresses are used
    on its device as they are. Whatever was opened before a failure is released, and the
    counters of what was not opened are given back."""
    if offer.reason:
        raise RuntimeError(offer.reason)
    reader_device = local_device_of(offer.device_uuid)
    same_process = offer.process == PROCESS_ID
    memory = PeerMemory(reader_device if same_process else device)
    try:
        for share in offer.regions:
            memory.views.add_view(MemoryRegion(share.address, share.length, memory.device),
                                  open_region(share, memory))
    except Exception as error:
        opened = len(memory.storages)  # (each opened storage gives its counter back when released)
        memory.release()
        release_counters([] if same_process else offer.regions[opened:])
        raise RuntimeError(f"CUDA IPC could not open the reader's memory: {type(error).__name__}: {error}") from error
    return memory


def open_region(share: RegionShare, memory: PeerMemory) -> torch.Tensor:
    """A byte view of one offered region in this process (its storage kept in ``memory``)."""
    if not share.handle:  # the reader's own process: its addresses are valid here
        return region_view(MemoryRegion(share.address, share.length, memory.device))
    storage = torch.UntypedStorage._new_shared_cuda(
        memory.device, share.handle, share.storage_bytes, share.storage_offset, share.counter_handle,
        share.counter_offset, share.event_handle, share.event_sync_required)
    memory.storages.append(storage)
    offset = share.address - share.storage_address
    if offset < 0 or offset + share.length > share.storage_bytes:
        raise ValueError(f"the region at {share.address:#x} lies outside its storage")
    # a view of the opened storage itself (torch sees it on ``memory.device``, where it was opened):
    # not through its address, whose device CUDA would report as the reader's GPU
    view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{memory.device}")
    return view.set_(storage, offset, (share.length,))


def release_counters(shares: list[RegionShare]) -> None:
    """Give back the reference counters of offered regions that were never opened (so that the
    reader's torch does not keep their memory in limbo once freed)."""
    for share in shares:
        if share.counter_handle:
            try:
                torch.UntypedStorage._release_ipc_counter_cuda(share.counter_handle, share.counter_offset)
            except Exception:  # noqa: BLE001 - best effort: the memory then waits for the reader's exit
                logger.debug("transfer (nccl): releasing an IPC counter failed", exc_info=True)


def peer_copies_wanted(option: Optional[bool]) -> bool:
    """Whether a writer between GPUs asks its readers for peer copies: ``option`` when given,
    else $TANDEM_NCCL_PEER_COPIES ("0": NCCL send/receive instead). Default yes: on 2 x H200 a
    2,048-token 8B PD write took 1.03 ms by peer copies against 1.73 ms by send/receive."""
    if option is not None:
        return option
    return os.environ.get("TANDEM_NCCL_PEER_COPIES", "1") != "0"
