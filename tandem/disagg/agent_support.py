"""What every rank's transfer agent needs, rank 0's (``common.py``) and a worker's
(``pd_ranks.py``) alike: the warm-up scratch each side registers, and the fence a write of
freshly computed pages waits on."""
from __future__ import annotations

import torch

WARM_UP_BYTES = 64
WARM_UP_BYTE = 0x5A  # what the prefill side's scratch holds (the decode side's: zeros)


def warm_up_scratch(role: str, device: int) -> torch.Tensor:
    """The bytes each new pair's warm-up write moves (prefill side: WARM_UP_BYTE; decode side:
    zeros), filled before anything can read them: no backend orders a write's reads after the
    engine's stream (``connector.TransferBackend.write``)."""
    memory = "cpu" if device < 0 else f"cuda:{device}"
    scratch = torch.full((WARM_UP_BYTES,), WARM_UP_BYTE if role == "prefill" else 0, dtype=torch.uint8, device=memory)
    if device >= 0:
        torch.cuda.synchronize(device)
    return scratch


def compute_done_event(device: int):
    """A CUDA event recorded on ``device``'s current stream (where the forward pass runs), so a
    transfer of the pages it computes starts only after they are written; None in host memory."""
    if device < 0:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
