"""State buffers re-laid page-major for kernel tests: views of one pool, as the planner makes
them with ``kv_cache_layout="page-major"`` (``tandem.kv.planner.page_major_views``)."""
from __future__ import annotations

import torch

from tandem.kv.planner import page_major_views

LAYOUTS = ("layer-major", "page-major")


def in_layout(layout: str, *buffers: torch.Tensor) -> list[torch.Tensor]:
    """``buffers`` (each ``[pages, ...]``, equal page counts) as they are (layer-major), or
    copied into strided views of one page-major pool with a 1-byte-per-page neighbour after
    them, so that every view's page stride exceeds its page."""
    if layout == "layer-major":
        return list(buffers)
    layouts = [(tuple(buffer.shape[1:]), buffer.dtype) for buffer in buffers] + [((1,), torch.uint8)]
    _, views, _ = page_major_views(buffers[0].shape[0], layouts, buffers[0].device)
    for view, buffer in zip(views, buffers):
        view.copy_(buffer)
        assert not view.is_contiguous() and torch.equal(view.view(torch.uint8), buffer.view(torch.uint8))
    return views[:-1]
