"""Settings of prefill/decode disaggregation (one frozen dataclass, filled by the CLI).

Defaults (documented in ``tandem serve --help`` and the README):

    heartbeat_interval   1 s    each side says it is alive this often, per peer
    peer_timeout        10 s    a peer silent this long is dead: its transfers fail, and the
                                destination pages it could still write are released (poisoned)
    connect_timeout     10 s    decode: how long a prefill server may take to answer the handshake
    bootstrap_timeout  300 s    prefill: how long a request may wait for its destination pages
                                (the decode server holds requests back while its pool is full)
    transfer_timeout   120 s    from the destination pages being sent until the commit
    drain_timeout       10 s    prefill: how long a posted write may stay unfinished after its
                                transfer failed before it is cancelled
    progress_thread     off     NIXL's progress thread (spins a core); needed only where UCX
                                emulates one-sided writes, e.g. TCP between hosts
    secret_file         none    the deployment secret authenticating control messages
                                (``secret.py``: also $TANDEM_PD_SECRET; on loopback, generated)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Optional

from tandem.transfer.secret import explicit_secret_given, is_loopback_address, missing_secret_message, resolve_secret
from tandem.validation import require

ROLE_CHOICES = ("colocated", "prefill", "decode")
BACKEND_CHOICES = ("nixl", "nccl")
FAILURE_PROBABILITY_VARIABLE = "TANDEM_TEST_TRANSFER_FAILURE_PROB"
FAILURE_SEED_VARIABLE = "TANDEM_TEST_TRANSFER_FAILURE_SEED"


def failure_probability_from_environment() -> float:
    """Tests inject transfer failures at random: ``TANDEM_TEST_TRANSFER_FAILURE_PROB=0.3`` fails
    each write with that probability (drawn from a generator seeded by
    ``TANDEM_TEST_TRANSFER_FAILURE_SEED``, default 0, so a test's sequence of writes fails alike
    on every run)."""
    value = os.environ.get(FAILURE_PROBABILITY_VARIABLE, "")
    return float(value) if value else 0.0


def failure_seed_from_environment() -> int:
    return int(os.environ.get(FAILURE_SEED_VARIABLE, "0") or 0)


@dataclass(frozen=True)
class TransferConfig:
    role: str  # "prefill" or "decode"
    backend: str = "nixl"
    # The control channel's address (ZMQ): "tcp://HOST:PORT"; port 0 picks a free port.
    bootstrap_address: str = "tcp://127.0.0.1:0"
    heartbeat_interval: float = 1.0
    peer_timeout: float = 10.0
    connect_timeout: float = 10.0
    bootstrap_timeout: float = 300.0
    transfer_timeout: float = 120.0
    drain_timeout: float = 10.0
    failure_probability: Optional[float] = None  # None: from TANDEM_TEST_TRANSFER_FAILURE_PROB
    progress_thread: bool = False  # the backend's own progress thread (see nixl_backend.py)
    secret_file: Optional[str] = None  # --pd-secret-file
    secret: Optional[bytes] = field(default=None, repr=False)  # the secret itself (wins over the file)

    def __post_init__(self) -> None:
        require(self.role in ("prefill", "decode"), "role", f"must be prefill or decode, got {self.role!r}")
        require(self.backend in BACKEND_CHOICES, "transfer_backend",
              f"must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        require(self.bootstrap_address.startswith("tcp://"), "pd_address",
              f"must look like tcp://HOST:PORT, got {self.bootstrap_address!r}")
        for name in ("heartbeat_interval", "peer_timeout", "connect_timeout", "bootstrap_timeout",
                     "transfer_timeout", "drain_timeout"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(self.peer_timeout > self.heartbeat_interval, "peer_timeout",
              f"must exceed heartbeat_interval ({self.heartbeat_interval}), got {self.peer_timeout}")
        if not explicit_secret_given(self.secret, self.secret_file) and not is_loopback_address(self.bootstrap_address):
            raise ValueError(missing_secret_message(self.bootstrap_address))

    def control_secret(self) -> bytes:
        """The deployment secret (``secret.py``); ValueError naming the flag when there is none."""
        return resolve_secret(self.secret, self.secret_file, self.bootstrap_address)

    def with_secret(self) -> "TransferConfig":
        """This config with its secret read now (the CLI checks it before the engine starts)."""
        return replace(self, secret=self.control_secret())

    @property
    def injected_failure_probability(self) -> float:
        if self.failure_probability is not None:
            return self.failure_probability
        return failure_probability_from_environment()
