"""Triton where it is installed, and a stand-in where it is not.

CUDA builds of torch ship Triton; a CPU install without the dev extra does not, and there the
kernel modules must still import, because their plain-PyTorch references are the CPU path.
Kernel modules take ``jit``, ``triton`` and ``tl`` from here and start with
``from __future__ import annotations``, so that ``tl.constexpr`` annotations are never evaluated
without Triton. Without Triton, ``jit`` leaves a kernel a plain function that nothing launches.
"""
from __future__ import annotations

import functools
import os

import torch

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


# Programmatic dependent launch (Hopper and later): a kernel launched with ``launch_pdl=True``
# may start while the kernel before it on the stream is still running, once that one has called
# ``launch_dependents`` in all its programs (or finished), and must call ``wait_for_producer``
# before it reads anything the earlier kernel wrote: that wait returns once the earlier kernel
# has completed and its writes are visible. A producer's call is a no-op when what follows was
# launched without the flag. The weight-streaming products (``gemv.py``) use it to load their
# first weight tiles while the norm or activation that makes their input is still running.
if triton is not None:
    from triton.language.extra import cuda as _cuda_extra


@jit
def launch_dependents(ENABLED: tl.constexpr):
    """Let a kernel launched after this one with ``launch_pdl`` start now (``ENABLED``)."""
    if ENABLED:
        _cuda_extra.gdc_launch_dependents()


@jit
def wait_for_producer(ENABLED: tl.constexpr):
    """Wait until the kernel before this one has completed, its writes visible (``ENABLED``)."""
    if ENABLED:
        _cuda_extra.gdc_wait()


def dependent_launch(tensor) -> bool:
    """Whether kernels on ``tensor``'s device take part in programmatic dependent launch: a CUDA
    device of compute capability 9 or later, Triton compiling (not interpreting), and
    ``TANDEM_DISABLE_PDL`` unset (for A/B timing and as an escape hatch)."""
    if not tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TANDEM_DISABLE_PDL"):
        return False
    return _capability(tensor.device.index or 0) >= 9


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]
