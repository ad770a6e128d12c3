"""The FP8 (``float8_e4m3fn``) number format: scales, quantizing and dequantizing.

Every scale here is a *dequantization* scale: ``real value = fp8 value * scale`` (what
checkpoints call ``weight_scale_inv`` in the block-scaled format and ``weight_scale`` in
compressed-tensors). Weight scales are held per output row and per input block,
``[N, ceil(K / block_k)]`` (the "row-block" layout): one column for per-tensor and per-channel
weights, one per 128 (or ``block_k``) input features for block-scaled ones. That layout stacks
and shards with the weight's rows at any boundary, so stacked q|k|v projections and
tensor-parallel shards need no block alignment of their row counts."""
from __future__ import annotations

import torch

from tandem.kernels.fp8_activation import FP8_DTYPE, FP8_MAX, MINIMUM_SCALE


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight [N, K]`` (FP8) times ``scale [ceil(N/bn), ceil(K/bk)]`` (block ``(bn, bk)``;
    the last block of each dimension may be partial), in float32."""
    rows, columns = weight.shape
    block_rows, block_columns = block
    expected = (-(-rows // block_rows), -(-columns // block_columns))
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scale has shape {tuple(scale.shape)}, expected {expected} for a "
                         f"{rows}x{columns} weight in {block_rows}x{block_columns} blocks")
    expanded = scale.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)[:, :columns]
    return weight.float() * expanded


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight [..., N, K]`` times a per-tensor (one value) or per-row (``[N]``/``[N, 1]``)
    scale, in float32."""
    scale = scale.float()
    return weight.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))


def row_block_scales(scale: torch.Tensor, shape: tuple[int, int], block) -> torch.Tensor:
    """A checkpoint scale in the row-block layout ``[N, ceil(K / block_k)]`` (float32): block
    scales repeated over their rows, per-tensor and per-channel scales as one column."""
    rows, columns = shape
    scale = scale.float()
    if block is None:
        return scale.reshape(-1, 1).expand(rows, 1).contiguous() if scale.numel() == 1 else scale.reshape(rows, 1)
    return scale.repeat_interleave(block[0], 0)[:rows].contiguous()


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row quantization of a float weight ``[N, K]``: ``(fp8 [N, K], scale [N, 1]
    float32)`` with ``scale = max|row| / 448`` (vLLM's and llm-compressor's rule)."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MINIMUM_SCALE)
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization of a float weight ``[N, K]`` in ``block = (bn, bk)`` blocks (partial
    at the edges): ``(fp8 [N, K], scale [ceil(N/bn), ceil(K/bk)] float32)``, each block's scale
    its ``max|w| / 448`` (DeepSeek's rule); on the weight's device."""
    rows, columns = weight.shape
    block_rows, block_columns = block
    padded_rows, padded_columns = -(-rows // block_rows) * block_rows, -(-columns // block_columns) * block_columns
    padded = torch.zeros(padded_rows, padded_columns, dtype=torch.float32, device=weight.device)
    padded[:rows, :columns] = weight.float()
    tiles = padded.view(padded_rows // block_rows, block_rows, padded_columns // block_columns, block_columns)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MINIMUM_SCALE)
    quantized = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(padded_rows, padded_columns)[:rows, :columns].contiguous(), scale
