"""Triton where it is installed, and a stand-in where it is not.

CUDA builds of torch ship Triton; a CPU install without the dev extra does not, and there the
kernel modules must still import, because their plain-PyTorch references are the CPU path.
Kernel modules take ``jit``, ``triton`` and ``tl`` from here and start with
``from __future__ import annotations``, so that ``tl.constexpr`` annotations are never evaluated
without Triton. Without Triton, ``jit`` leaves a kernel a plain function that nothing launches.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Optional

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
# before it reads or writes anything another kernel of the step touches: that wait returns once
# the earlier kernel has completed (and so, transitively, every kernel before it) and its writes
# are visible. Before the wait a kernel may read only what no kernel writes (weights, tables).
# A producer's call is a no-op when what follows was launched without the flag. A batch-1
# decode step is a chain of ~12 small kernels a layer, all Triton: launched this way, each one's
# launch and prologue (and a product's first weight tiles, ``gemv.py``) overlap the kernel before
# it. Kernels launch this way only inside ``early_launch(True)`` (the capture of a decode graph of
# at most ``DEPENDENT_LAUNCH_MAX_TOKENS`` tokens, ``tandem/worker/cuda_graphs.py``) and over at most
# that many tokens, where every grid is small: a primary with many programs to place would
# otherwise share its SMs with waiting ones.
DEPENDENT_LAUNCH_MAX_TOKENS = 2
_launch_mode = threading.local()
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


@contextlib.contextmanager
def early_launch(enabled: bool, device: Optional[torch.device] = None):
    """Within: kernels of at most ``DEPENDENT_LAUNCH_MAX_TOKENS`` tokens launch early
    (``dependent_launch``) where ``enabled``, the device (default: the current one) is of compute
    capability 9 or later, Triton compiles (not interprets) and ``TANDEM_DISABLE_PDL`` is unset
    (for A/B timing and as an escape hatch). Per thread; restored on exit."""
    previous = getattr(_launch_mode, "early", False)
    _launch_mode.early = enabled and early_launch_supported(device)
    try:
        yield
    finally:
        _launch_mode.early = previous


def early_launch_supported(device: Optional[torch.device] = None) -> bool:
    if (triton is None or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TANDEM_DISABLE_PDL")
            or not _triton_launches_early()):
        return False
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _capability(index) >= 9


def dependent_launch(tensor, tokens: int) -> bool:
    """Whether a kernel over ``tokens`` tokens of ``tensor`` launches early: inside
    ``early_launch(True)``, on CUDA, at most ``DEPENDENT_LAUNCH_MAX_TOKENS`` tokens."""
    return getattr(_launch_mode, "early", False) and tokens <= DEPENDENT_LAUNCH_MAX_TOKENS and tensor.is_cuda


def early_launch_arguments(tensor, tokens: int, allowed: bool = True) -> dict:
    """A kernel's ``PDL`` constexpr and, where it launches early (``dependent_launch`` and
    ``allowed``), the ``launch_pdl`` launch option: spread into its launch."""
    if allowed and dependent_launch(tensor, tokens):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.lru_cache(maxsize=None)
def _triton_launches_early() -> bool:
    """Whether the installed Triton takes ``launch_pdl`` (3.3 and later) and has the grid
    dependency instructions."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(_cuda_extra, "gdc_wait")


@functools.lru_cache(maxsize=None)
def device_multiprocessors(device_index: int) -> int:
    """The SMs of CUDA device ``device_index`` (asked once: the launch configurations ask every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(tensor: torch.Tensor) -> int:
    """The SMs of ``tensor``'s GPU (off CUDA, an H100's 132: the tiles the interpreter runs)."""
    return device_multiprocessors(tensor.device.index or 0) if tensor.is_cuda else 132


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]
