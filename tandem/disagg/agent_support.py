"""What every rank's transfer agent needs, rank 0's (``common.py``) and a worker's
(``pd_ranks.py``) alike: the warm-up scratch each side registers, and the fence a write of
freshly computed pages waits on."""
from __future__ import annotations

import torch

WARM_UP_BYTES = 64
WARM_UP_BYTE = 0x5A  # what the prefill side's scratch holds (the decode side's: zeros)


def compute_done_event(device: int):
    """A CUDA event recorded on ``device``'s current stream (where the forward pass runs), so a
    transfer of the pages it computes starts only after they are written; None in host memory."""
    if device < 0:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
