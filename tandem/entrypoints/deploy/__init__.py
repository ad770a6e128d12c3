"""``tandem deploy``: prefill/decode (or colocated) replicas on a Ray cluster, placed, found and
replaced by Ray, behind one router.

``ray_cluster.py``: joining Ray (an optional extra, imported only here); ``replica.py``: the
actor owning one replica's ``tandem serve``; ``placement.py``: its placement group and actor;
``registry.py``: the named registry actor, and the router's membership source reading it;
``supervisor.py``: placing, admitting, replacing, scaling and draining replicas;
``autoscale.py``: when a role grows or shrinks; ``serve_flags.py``: serve's flags passed on;
``cli.py``: the commands. Docs: docs/deploy.md.
"""
from tandem.entrypoints.deploy.cli import add_deploy_parser

__all__ = ["add_deploy_parser"]
