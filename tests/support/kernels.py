"""What kernel tests share: Triton's interpreter made to run our kernels on a CPU, and the
comparison of a kernel's output with its plain-PyTorch reference."""
from __future__ import annotations

import os

import pytest
import torch

FP32_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
BF16_TOLERANCE = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True, scope="module")
def interpreter_scalar_loop_bounds():
    """Triton's interpreter holds scalars as one-element arrays and turns them into ``range``
    bounds with ``int(array)``, which NumPy >= 2.4 refuses for arrays of one dimension: make
    that conversion take the element (interpreted runs only). A module opts in by importing it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        yield


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 **tolerance) -> None:
    """``actual`` (a kernel's output) equals ``expected`` (its reference) within ``tolerance``,
    by default the one for ``dtype`` (else ``expected``'s): 1e-5 for float32, 2e-2 for lower
    precisions. Outputs start as NaN, so a NaN left in ``actual`` is an element the kernel never
    wrote (or read from a poisoned page), never a rounding difference."""
    assert not actual.isnan().any(), "an output element is NaN (unwritten or poisoned)"
    dtype = dtype or expected.dtype
    tolerance = tolerance or (FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE)
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance)


def quantized_weight(rows: int, features: int, group, seed: int, device: str = "cpu"):
    """A random FP8 weight ``[rows, features]`` and its row-block scales (``group=None``: one
    scale per row; else ``group x group`` blocks, partial at the edges)."""
    from tandem.quantization.fp8 import quantize_blocks, quantize_rows, row_block_scales

    weight = torch.randn(rows, features, generator=torch.Generator().manual_seed(seed)) * 0.05
    if group is None:
        quantized, scale = quantize_rows(weight)
    else:
        quantized, blocks = quantize_blocks(weight, (group, group))
        scale = row_block_scales(blocks, (rows, features), (group, group))
    return quantized.to(device), scale.to(device)
