"""The NIXL transfer backend: one NIXL agent (UCX) per engine, one-sided WRITEs with a
notification. Works on host memory (DRAM) as on GPU memory (VRAM); on a CPU-only host the UCX
transports are shared memory and TCP on loopback, so CI exercises the real path.

NIXL reports a remote agent's name as bytes from ``add_remote_agent`` but keys notifications by
str; this class speaks str throughout. A write's notification leaves from the writer's poll
(``check_xfer_state``) that finds all its descriptors landed (UCX: after a flush of the
endpoint), so it always follows the bytes, and the writer must keep polling until DONE.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from tandem.transfer.block_index import MAX_PREPARED_BLOCKS, BlockIndex
from tandem.transfer.connector import TransferBackend, WriteHandle, WriteStatus
from tandem.transfer.descriptors import MemoryRegion, merge_adjacent

logger = logging.getLogger(__name__)


def load_nixl():
    """NIXL's agent classes: through the ``nixl`` package (it picks the build for the CUDA found),
    else straight from an installed build."""
    import importlib

    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = importlib.import_module(module)
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise RuntimeError("transfer_backend: NIXL is not installed; install the build for this CUDA major "
                       "(pip install nixl-cu12 or nixl-cu13, then pip install --no-deps nixl; "
                       "scripts/setup.sh does it), or use --transfer-backend nccl")


LOOPBACK_HOSTS = ("localhost", "::1")


def ucx_error_handling(host: str) -> str:
    """UCX's error handling for this engine's agent: $TANDEM_NIXL_UCX_ERROR_HANDLING when set
    ("none" or "peer"; the same on every engine), else "none" where the engines talk over
    loopback (one host) and NIXL's default ("peer", returned as "") otherwise. It decides UCX's
    transports. Measured on a CPU host: under "peer" a notified write completes only once the
    reader has progressed (its notification waited for up to a few of the decode engine's
    polls), under "none" as soon as its bytes landed; a dead peer's writes fail under both
    (NIXL_ERR_REMOTE_DISCONNECT). Between hosts "peer" stays: there it is what turns a lost
    peer into failed writes."""
    chosen = os.environ.get("TANDEM_NIXL_UCX_ERROR_HANDLING", "")
    if chosen:
        return chosen
    return "none" if host.startswith("127.") or host in LOOPBACK_HOSTS else ""


FEW_DESCRIPTORS = 16  # a write of at most this many descriptors hands NIXL tuples (no numpy arrays)


def _as_str(name) -> str:
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


class NixlBackend(TransferBackend):
    name = "nixl"
    notifies_on_poll = True

    def __init__(self, agent_name: str, progress_thread: bool = False, telemetry: bool = False,
                 host: str = "127.0.0.1") -> None:
        """``telemetry``: NIXL times each write itself (``write_telemetry``; diagnostics);
        ``host``: where peers reach this engine's control channel (``ucx_error_handling``)."""
        nixl_agent, nixl_agent_config = load_nixl()
        logging.getLogger("nixl").setLevel(logging.WARNING)
        self._name = agent_name
        # NIXL's progress thread polls with no pause (a core spinning per engine), so by default
        # the engine drives progress itself: the writer polls its writes, the receiver polls its
        # notifications every millisecond while it expects writes. That suffices where writes are
        # one-sided (shared memory, RDMA, NVLink; the receiver progresses only to set up the
        # connection). Where UCX emulates them (TCP between hosts), turn the thread on.
        options = dict(capture_telemetry=True) if telemetry else {}
        error_handling = ucx_error_handling(host)
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=progress_thread,
                                                              backends=[] if error_handling else ["UCX"], **options))
        if error_handling:
            self.agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling})
        self._registered = []
        # per peer: its descriptor lists prepared at pairing (``prepare``): local, remote, index
        self._prepared: dict[str, tuple] = {}
        self.prepared_writes = 0  # writes posted from the prepared lists (diagnostics, tests)

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, regions: list[MemoryRegion]) -> None:
        by_type: dict[str, list[tuple[int, int, int, str]]] = {}
        for region in regions:
            by_type.setdefault(region.memory_type, []).append(
                (region.address, region.length, max(region.device, 0), ""))
        for memory_type, descriptors in by_type.items():
            self._registered.append(self.agent.register_memory(descriptors, memory_type))

    def local_metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        return _as_str(self.agent.add_remote_agent(metadata))

    def remove_peer(self, peer: str) -> None:
        self._release_prepared(peer)
        try:
            self.agent.remove_remote_agent(peer)
        except Exception:  # noqa: BLE001 - already gone
            logger.debug("removing NIXL peer %s failed", peer, exc_info=True)

    def prepare(self, peer: str, runs: list, local_device: int = -1, remote_device: int = -1) -> None:
        """Describe every block writes to ``peer`` move to NIXL once (``prep_xfer_dlist``, both
        sides): a write of whole blocks is then a request made from indices into them
        (``make_prepped_xfer``; NIXL merges consecutive blocks back into one transfer), without
        NIXL checking fresh descriptor lists against the registered memory at every write. Where
        NIXL cannot prepare them (or they are too many), writes describe themselves as before."""
        self._release_prepared(peer)
        if not runs or sum(run.local.count for run in runs) > MAX_PREPARED_BLOCKS \
                or sum(run.remote.count for run in runs) > MAX_PREPARED_BLOCKS:
            return
        local_id, remote_id = max(local_device, 0), max(remote_device, 0)
        try:
            index = BlockIndex(runs)
            local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.concatenate(
                [run.local.rows(local_id) for run in runs]), "DRAM" if local_device < 0 else "VRAM")
            remote = self.agent.prep_xfer_dlist(peer, np.concatenate(
                [run.remote.rows(remote_id) for run in runs]), "DRAM" if remote_device < 0 else "VRAM")
        except Exception as error:  # noqa: BLE001 - the writes go the unprepared way
            logger.info("NIXL could not prepare the descriptor lists for %s (%s); writes describe themselves",
                        peer, error)
            return
        self._prepared[peer] = (local, remote, index)

    def _release_prepared(self, peer: str) -> None:
        prepared = self._prepared.pop(peer, None)
        for handle in prepared[:2] if prepared else ():
            try:
                self.agent.release_dlist_handle(handle)
            except Exception:  # noqa: BLE001 - already gone with the agent
                logger.debug("releasing a prepared NIXL list failed", exc_info=True)

    def _descriptor_list(self, rows, device: int):
        """(address, length, device id) rows: a list of tuples or an N x 3 array."""
        memory_type = "DRAM" if device < 0 else "VRAM"
        return self.agent.get_xfer_descs(rows, memory_type)

    def _post(self, handle: WriteHandle, peer: str, descriptors, local_device: int, remote_device: int,
              notification: bytes) -> None:
        native = self._prepared_write(peer, descriptors, notification)
        if native is None:
            native = self._described_write(peer, descriptors, local_device, remote_device, notification)
        handle.native = native
        state = self.agent.transfer(native)
        if state == "ERR":
            handle.status, handle.error = WriteStatus.ERROR, "NIXL could not post the write"
        elif state == "DONE":
            handle.status = WriteStatus.DONE

    def _prepared_write(self, peer: str, descriptors, notification: bytes):
        """A NIXL request from the prepared lists, or None where the descriptors are not whole
        prepared blocks (or this NIXL refuses the request: the lists are then dropped, said once)."""
        prepared = self._prepared.get(peer)
        indices = prepared[2].indices(descriptors) if prepared is not None else None
        if indices is None:
            return None
        try:
            native = self.agent.make_prepped_xfer("WRITE", prepared[0], indices[0], prepared[1], indices[1],
                                                  notification)
        except Exception as error:  # noqa: BLE001
            logger.warning("NIXL refused a request from prepared lists (%s); writes to %s describe themselves",
                           error, peer)
            self._release_prepared(peer)
            return None
        self.prepared_writes += 1
        return native

    def _described_write(self, peer: str, descriptors, local_device: int, remote_device: int, notification: bytes):
        """A NIXL request for ``descriptors`` described afresh (not whole prepared blocks)."""
        # merged runs: NIXL pays per descriptor (one 256 MiB write ran at the link's rate between
        # two GPUs, the same bytes as 256 writes of 1 MiB at half of it)
        merged = merge_adjacent(descriptors)
        local_id, remote_id = max(local_device, 0), max(remote_device, 0)
        if 0 < len(merged) <= FEW_DESCRIPTORS:  # (a page-major write: a run per group, and the row)
            local = [(source, length, local_id) for source, _, length in merged]
            remote = [(destination, length, remote_id) for _, destination, length in merged]
        else:
            array = np.asarray(merged, dtype=np.uint64).reshape(-1, 3)
            local = np.stack([array[:, 0], array[:, 2], np.full(len(array), local_id, np.uint64)], axis=1)
            remote = np.stack([array[:, 1], array[:, 2], np.full(len(array), remote_id, np.uint64)], axis=1)
        return self.agent.initialize_xfer("WRITE", self._descriptor_list(local, local_device),
                                          self._descriptor_list(remote, remote_device), peer, notification)

    def write_telemetry(self, handle: WriteHandle) -> dict:
        """NIXL's own timing of a finished, not yet released write (agent made with ``telemetry``):
        seconds spent posting it and until it completed, and its descriptors after NIXL merged them."""
        record = self.agent.get_xfer_telemetry(handle.native)
        return {"post": record.postDuration * 1e-6, "transfer": record.xferDuration * 1e-6,
                "descriptors": record.descCount}

    def _check(self, handle: WriteHandle) -> WriteStatus:
        state = self.agent.check_xfer_state(handle.native)
        return {"DONE": WriteStatus.DONE, "PROC": WriteStatus.PENDING}.get(state, WriteStatus.ERROR)

    def _release(self, handle: WriteHandle) -> bool:
        try:
            self.agent.release_xfer_handle(handle.native)
        except Exception:  # noqa: BLE001 - NIXL could not cancel an active write
            logger.warning("NIXL could not release a write to %s (still active)", handle.peer)
            return False
        return True

    def notifications(self) -> list[tuple[str, bytes]]:
        received = []
        for peer, messages in self.agent.get_new_notifs().items():
            received.extend((_as_str(peer), bytes(message)) for message in messages)
        return received

    def close(self) -> None:
        for peer in list(self._prepared):
            self._release_prepared(peer)
        for registered in self._registered:
            try:
                self.agent.deregister_memory(registered)
            except Exception:  # noqa: BLE001
                pass
        self._registered = []
