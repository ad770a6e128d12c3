"""The transfer backends by name: what ``--transfer-backend`` (``TransferConfig.backend``)
chooses. Each backend implements ``connector.TransferBackend``; it is imported only when
chosen (NIXL's bindings are optional)."""
from __future__ import annotations

import random
from typing import Optional

from tandem.transfer.connector import TransferBackend


def create_backend(name: str, agent_name: str, *, failure_probability: float = 0.0,
                   seed: Optional[int] = None, progress_thread: bool = False, host: str = "127.0.0.1",
                   connect_timeout: float = 30.0, timeout: float = 120.0, telemetry: bool = False) -> TransferBackend:
    """``host``: the address peers reach this engine at (the NCCL backend's rendezvous; NIXL's
    UCX error handling, ``nixl_backend.ucx_error_handling``);
    ``connect_timeout``/``timeout``: pairing and per-write limits of the NCCL backend;
    ``telemetry``: NIXL times each write itself (benchmarks)."""
    if name == "nixl":
        from tandem.transfer.nixl_backend import NixlBackend

        backend: TransferBackend = NixlBackend(agent_name, progress_thread=progress_thread, telemetry=telemetry,
                                               host=host)
    elif name == "nccl":
        from tandem.transfer.nccl_backend import NcclBackend

        backend = NcclBackend(agent_name, host=host, connect_timeout=connect_timeout, timeout=timeout)
    else:
        raise ValueError(f"transfer_backend: unknown backend {name!r}")
    backend.failure_probability = failure_probability
    backend._random = random.Random(seed)
    return backend

