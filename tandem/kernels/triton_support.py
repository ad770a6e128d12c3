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


def jit(function=None, **options):
    """``triton.jit(function, **options)`` where Triton is installed; ``function`` unchanged
    otherwise. Also a decorator factory: ``@jit(do_not_specialize=[...])``.

    Triton compiles a kernel once per specialisation of its arguments (an integer equal to 1 or
    divisible by 16, a pointer aligned to 16 bytes). An argument that changes from step to step
    (a token count, a page-table width, a view that starts at row ``num_decode_tokens``) would
    make a step that meets a new combination stall on a compile of a second or so: kernels
    name such arguments in ``do_not_specialize`` / ``do_not_specialize_on_alignment``."""
    if function is None:
        return lambda inner: jit(inner, **options)
    return function if triton is None else triton.jit(function, **options)
