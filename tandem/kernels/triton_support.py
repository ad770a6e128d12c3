"""Triton where it is installed, and a stand-in where it is not.

CUDA builds of torch ship Triton; a CPU install without the dev extra does not, and there the
kernel modules must still import, because their plain-PyTorch references are the CPU path.
Kernel modules take ``jit``, ``triton`` and ``tl`` from here and start with
``from __future__ import annotations``, so that ``tl.constexpr`` annotations are never evaluated
without Triton. Without Triton, ``jit`` leaves a kernel a plain function that nothing launches.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU install without the dev extra: only the references are used
    triton = None
    tl = None


def jit(function):
    """``triton.jit(function)`` where Triton is installed; ``function`` unchanged otherwise."""
    return function if triton is None else triton.jit(function)
