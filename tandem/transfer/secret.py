"""The PD deployment secret: where it comes from, and when one must be given.

Every engine of a PD deployment holds the same secret; the control channel authenticates each
message with it (``frames.py``). In order of precedence:

    1. ``TransferConfig.secret`` (bytes; the offline API and tests)
    2. ``--pd-secret-file PATH`` (``TransferConfig.secret_file``): the file's bytes, trailing
       whitespace stripped
    3. ``$TANDEM_PD_SECRET``: the variable's value (UTF-8)
    4. only when the control address is loopback: this user's generated secret,
       ``$TANDEM_CACHE_DIR/pd_secret`` (default ``~/.cache/tandem/pd_secret``), created on first
       use with 32 random bytes and mode 0600. Every engine this user starts on this host shares
       it, so a loopback deployment needs no setup, and other users' processes, which can reach
       a loopback port but cannot read the file, cannot authenticate.

A control address that is not loopback (``0.0.0.0``, a host's own address) has no default: the
server refuses to start until one of 1-3 is given. A secret must have at least 16 bytes.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import pathlib
import secrets
import socket
import stat
import tempfile
from typing import Optional
from urllib.parse import urlsplit

from tandem.cache_dir import cache_root

logger = logging.getLogger("tandem.pd")

SECRET_VARIABLE = "TANDEM_PD_SECRET"
GENERATED_SECRET_NAME = "pd_secret"
MIN_SECRET_BYTES = 16
GENERATED_SECRET_BYTES = 32


def is_loopback_address(address: str) -> bool:
    """True when every address ``tcp://HOST:PORT`` binds or reaches is a loopback one (127.0.0.0/8,
    ::1, or a name that resolves only to those). ``0.0.0.0``, ``*`` and unresolvable names: False."""
    host = urlsplit(address).hostname or ""
    if host in ("", "*", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(resolved) and all(ipaddress.ip_address(item.split("%")[0]).is_loopback for item in resolved)


def read_secret_file(path: str) -> bytes:
    """The secret in ``path`` (trailing whitespace stripped); warns when others may read it."""
    file = pathlib.Path(path)
    try:
        mode = file.stat().st_mode
        data = file.read_bytes().rstrip()
    except OSError as error:
        raise ValueError(f"pd_secret_file: cannot read {path!r}: {error.strerror or error}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("PD secret file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777)
    return check_secret(data, f"pd_secret_file: {path!r}")


def check_secret(secret: bytes, origin: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{origin}: a PD secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)} "
                         f"(make one with: head -c 32 /dev/urandom | base64 > FILE)")
    return secret


def generated_secret_path() -> pathlib.Path:
    return cache_root() / GENERATED_SECRET_NAME


def local_secret(path: Optional[pathlib.Path] = None) -> bytes:
    """This user's generated loopback secret, created (atomically, mode 0600) on first use."""
    path = path or generated_secret_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, staging = tempfile.mkstemp(prefix=".pd_secret-", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(secrets.token_hex(GENERATED_SECRET_BYTES).encode())
            try:
                os.link(staging, path)  # fails if another engine created it first: use theirs
                logger.info("PD: generated this user's loopback secret in %s", path)
            except FileExistsError:
                pass
        finally:
            os.unlink(staging)
    return read_secret_file(str(path))


def explicit_secret_given(secret: Optional[bytes], secret_file: Optional[str]) -> bool:
    return secret is not None or secret_file is not None or bool(os.environ.get(SECRET_VARIABLE))


def resolve_secret(secret: Optional[bytes], secret_file: Optional[str], address: str) -> bytes:
    """The secret by the precedence above; ValueError naming ``--pd-secret-file`` if there is none."""
    if secret is not None:
        return check_secret(bytes(secret), "secret")
    if secret_file is not None:
        return read_secret_file(secret_file)
    from_environment = os.environ.get(SECRET_VARIABLE)
    if from_environment:
        return check_secret(from_environment.encode(), f"${SECRET_VARIABLE}")
    if not is_loopback_address(address):
        raise ValueError(missing_secret_message(address))
    return local_secret()


def missing_secret_message(address: str) -> str:
    return (f"pd_secret_file: the PD control address {address} is not loopback, so every engine of the "
            f"deployment must share a secret: give --pd-secret-file PATH (or set ${SECRET_VARIABLE}) on every "
            f"prefill and decode server")
