"""Device functions the attention kernels share (paged attention, MLA decode, the DSA
indexer): dot-product operands, scores in log2 units, loading keys and values from pages, and a
split-KV program's output. See ``paged_attention.py`` for the layouts and the FP8 contract."""
from __future__ import annotations

from tandem.kernels.triton_support import jit, tl

MINIMUM_DOT_SIZE = 16  # tl.dot needs every tile dimension >= 16


@jit
def _tanh(x):
    """tanh from exp2, valid for every finite x (no libdevice, so it also runs interpreted)."""
    magnitude = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    result = (1.0 - magnitude) / (1.0 + magnitude)
    return tl.where(x < 0, -result, result)


@jit
def _dot_operand(values, input_dtype: tl.constexpr, UPCAST_DOTS: tl.constexpr):
    """``values`` rounded to the input dtype for ``tl.dot``. With ``UPCAST_DOTS`` (interpreted
    16-bit runs: the interpreter cannot multiply bfloat16) they are widened to fp32 afterwards,
    which gives the same products as the tensor cores' 16-bit inputs with fp32 accumulation."""
    values = values.to(input_dtype)
    if UPCAST_DOTS:
        values = values.to(tl.float32)
    return values


@jit
def _attention_operand(values, input_dtype: tl.constexpr, UPCAST_DOTS: tl.constexpr, FP16_DOTS: tl.constexpr):
    """``values`` as a dot product's input: float16 with ``FP16_DOTS`` (FP8 pages, 16-bit
    query), else as :func:`_dot_operand` makes them."""
    if FP16_DOTS:
        values = _dot_operand(values, tl.float16, UPCAST_DOTS)
    else:
        values = _dot_operand(values, input_dtype, UPCAST_DOTS)
    return values


@jit
def _fp16_range(query, FP16_DOTS: tl.constexpr):
    """The query clamped to float16's range (±65504) when the dots run in float16."""
    if FP16_DOTS:
        query = tl.minimum(tl.maximum(query.to(tl.float32), -65504.0), 65504.0)
    return query


@jit
def _scores_log2(query, keys_transposed, scale, softcap,
                 HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scaled (and soft-capped) scores ``query @ keys``, in log2 units for exp2."""
    log2_e = 1.4426950408889634
    scores = tl.dot(query, keys_transposed, input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        scores = softcap * _tanh(scores * (scale / softcap))
        scores = scores * log2_e
    else:
        scores = scores * (scale * log2_e)
    return scores


@jit
def _load_keys_values(key_cache_ptr, value_cache_ptr, page_table_row_ptr, positions, key_mask,
                      kv_head, dims, dim_mask,
                      stride_key_page, stride_key_slot, stride_key_head, stride_key_dim,
                      stride_value_page, stride_value_slot, stride_value_head, stride_value_dim,
                      PAGE_SIZE: tl.constexpr):
    """Keys (transposed, ``[BLOCK_D, BLOCK_N]``) and values (``[BLOCK_N, BLOCK_D]``) at
    ``positions``; slots outside ``key_mask`` are not read and come back as zeros."""
    pages = tl.load(page_table_row_ptr + positions // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
    slots = positions % PAGE_SIZE
    key_offsets = pages * stride_key_page + slots * stride_key_slot + kv_head * stride_key_head
    value_offsets = pages * stride_value_page + slots * stride_value_slot + kv_head * stride_value_head
    keys_transposed = tl.load(key_cache_ptr + key_offsets[None, :] + dims[:, None] * stride_key_dim,
                              mask=key_mask[None, :] & dim_mask[:, None], other=0.0)
    values = tl.load(value_cache_ptr + value_offsets[:, None] + dims[None, :] * stride_value_dim,
                     mask=key_mask[:, None] & dim_mask[None, :], other=0.0)
    return keys_transposed, values


@jit
def _accumulate_block(scores, values, running_max, running_sum, accumulator, input_dtype: tl.constexpr,
                      UPCAST_DOTS: tl.constexpr, FP16_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      MAY_SEE_NOTHING: tl.constexpr):
    """One key block of the online softmax: the running maximum (log2 units), sum and weighted
    values after the block's ``scores`` (masked keys at -inf) and ``values``. ``MAY_SEE_NOTHING``:
    a row may see no key of the block, nor any before it; its exponents are kept finite."""
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    base = new_max
    if MAY_SEE_NOTHING:
        base = tl.where(new_max == float("-inf"), 0.0, new_max)
    probabilities = tl.exp2(scores - base[:, None])
    correction = tl.exp2(running_max - base)
    running_sum = running_sum * correction + tl.sum(probabilities, 1)
    accumulator = accumulator * correction[:, None] + tl.dot(
        _attention_operand(probabilities, input_dtype, UPCAST_DOTS, FP16_DOTS),
        _attention_operand(values, input_dtype, UPCAST_DOTS, FP16_DOTS), input_precision=DOT_PRECISION)
    return new_max, running_sum, accumulator


@jit
def _store_split_output(accumulator, running_max, running_sum, row, split, heads, head_mask, dims, dim_mask,
                        out_ptr, stride_out_row, stride_out_head, stride_out_dim, partial_out_ptr, partial_lse_ptr,
                        stride_partial_row, stride_partial_head, stride_partial_split,
                        BLOCK_D: tl.constexpr, WRITE_FINAL: tl.constexpr):
    """End of a split-KV program (decode, MLA decode): the normalised output straight into
    ``out`` when there is one split, else the split's output and log-sum-exp (base 2; -inf for
    a split with no visible key) for the combine kernel."""
    empty = running_sum == 0.0
    output = accumulator / tl.where(empty, 1.0, running_sum)[:, None]
    if WRITE_FINAL:
        tl.store(out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + dims[None, :] * stride_out_dim,
                 output.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])
    else:
        partial_offsets = row * stride_partial_row + heads * stride_partial_head + split * stride_partial_split
        tl.store(partial_out_ptr + partial_offsets[:, None] * BLOCK_D + dims[None, :], output,
                 mask=head_mask[:, None])
        log_sum = tl.where(empty, float("-inf"), running_max + tl.log2(tl.where(empty, 1.0, running_sum)))
        tl.store(partial_lse_ptr + partial_offsets, log_sum, mask=head_mask)
