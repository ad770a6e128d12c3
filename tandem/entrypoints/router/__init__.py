"""``tandem router``: one OpenAI-compatible endpoint in front of prefill and decode servers, or
of colocated servers (``--server``: load balancing, each request whole to one server).

A router fronts the servers of one model. ``backends.py``: which servers there are, the pools
they form, and each one's health (probes, failures, readmission); ``routing.py``: choosing a
healthy pair (or server) and dispatching (retrying once a server cannot be reached or is busy);
``legs.py``: the two legs of one request, relayed and cancelled together; ``single_leg.py``: a
request on one colocated server, relayed; ``http.py``: the
client towards the servers (kept-alive connections); ``app.py``: the HTTP routes; ``cli.py``:
the command.
"""
from tandem.entrypoints.router.backends import Backend, BackendMonitor, ModelPool, RouterSetupError
from tandem.entrypoints.router.cli import add_router_parser, run_router
from tandem.entrypoints.router.routing import Router

__all__ = ["Backend", "BackendMonitor", "ModelPool", "Router", "RouterSetupError", "add_router_parser", "run_router"]
