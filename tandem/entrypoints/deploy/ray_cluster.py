"""Joining the Ray cluster a deployment runs on. Ray is an optional extra (``pip install
"tandem[ray]"``): it is imported here, and only by the deploy commands, with a clear error when
it is missing.

``RAY_ADDRESS`` (or ``--ray-address``) names an existing cluster (``ray start --head`` prints
it); without one, ``tandem deploy`` starts a local Ray of its own and shuts it down when it
exits. Where the cluster uses Ray's token authentication (a local Ray does by default), every
process joining by address needs ``RAY_AUTH_MODE=token`` and the token (``~/.ray/auth_token``). Every deployment's actors live in the Ray namespace ``tandem``; a deployment's registry is
the named actor ``tandem-deploy-NAME``.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

NAMESPACE = "tandem"
REGISTRY_PREFIX = "tandem-deploy-"
logger = logging.getLogger("tandem.deploy")


class DeployError(RuntimeError):
    """The deployment cannot be made or reached (no Ray, no registry, a replica that cannot start)."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise DeployError("tandem deploy needs Ray: pip install \"tandem[ray]\" (ray==2.60.0)") from None
    return ray


def registry_name(deployment: str) -> str:
    return REGISTRY_PREFIX + deployment


def connect(address: Optional[str], start_local: bool) -> bool:
    """Join the cluster at ``address`` (default ``$RAY_ADDRESS``); without one, start a local Ray
    when ``start_local`` (``tandem deploy``) or fail (``tandem deploy status``). True when a local
    Ray was started here (the caller shuts it down)."""
    ray = import_ray()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None and not start_local:
        raise DeployError("no Ray cluster to read: give --ray-address (or set RAY_ADDRESS) to the cluster of the "
                          "deployment (ray start --head prints it)")
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 **({} if address else {"include_dashboard": False}))
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise DeployError(f"cannot join the Ray cluster at {address}: {error}") from None
    if address is None:
        logger.warning("started a local Ray at %s; it stops with this deployment (to read it: RAY_AUTH_MODE=token "
                       "RAY_ADDRESS=%s tandem deploy status)", ray.get_runtime_context().gcs_address,
                       ray.get_runtime_context().gcs_address)
    return address is None


def registry_handle(deployment: str):
    """The registry actor of a running deployment; DeployError naming the deployment if none."""
    ray = import_ray()
    try:
        return ray.get_actor(registry_name(deployment), namespace=NAMESPACE)
    except ValueError:
        raise DeployError(f"no deployment named {deployment!r} on this Ray cluster (no actor "
                          f"{registry_name(deployment)!r} in namespace {NAMESPACE!r})") from None
