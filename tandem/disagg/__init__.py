"""Prefill/decode disaggregation inside one engine: the prefill side and the decode side.

``EngineCore`` builds one side with ``create_pd`` when its config has a ``transfer`` section.
Both sides own a transfer backend with every registry buffer and the metadata rows registered,
and a control channel (``common.py``); each side's rules live in ``prefill.py`` and
``decode.py``, what they remember per room in ``transfers.py``, their counters in ``metrics.py``.

A request's two legs meet in a room (its 128-bit id)::

    prefill engine                                         decode engine
    ---------------                                        -------------
    request (max_tokens 1), computed        Hello/Reply    request held; link to the prefill
    at once (final pages computed before  <------------->  engine (handshake: layouts equal)
    the destination are held for it)        Destination    admitted when it can finish: pages
                                          <------------  for every group + a metadata row
    after each chunk: its final pages -----  page writes  ---> (whole pages, coalesced)
      (source pages held in flight: I2)
    first token sampled, writes drained:
      metadata row (token, logprobs, room) - row write + notification "done:<room>" -->
                                                           row copied out (I4), room checked,
    held delta released                                    commit: computed = prompt length,
                                                           first token appended, decodes on

Failure and abort travel both ways (``TransferFailed``/``Drained`` to the decode side,
``AbortTransfer`` to the prefill side).

Nothing here knows model families: pages come from the coordinator (``final_page_indices``,
answered by the managers) and bytes from the registry (``transfer/descriptors.py``).
"""
from __future__ import annotations

from tandem.disagg.common import PDSide
from tandem.disagg.decode import DecodeSide
from tandem.disagg.prefill import PrefillSide
from tandem.transfer.config import TransferConfig
from tandem.step_context import StepContext

__all__ = ["create_pd", "PDSide", "PrefillSide", "DecodeSide"]


def create_pd(core: StepContext, config: TransferConfig) -> PDSide:
    return (PrefillSide if config.role == "prefill" else DecodeSide)(core, config)
