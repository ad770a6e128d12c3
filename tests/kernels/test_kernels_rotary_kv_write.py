"""The fused rotary + K/V write kernel (``tandem/kernels/rotary_kv_write.py``) against the two
kernels it replaces (``apply_rotary`` then ``write_kv``) and against its plain-PyTorch reference.

Against the two kernels it is bit for bit everywhere: the rotated query, every cache byte
(written slots and the poison left in the others). Against the reference it is bit for bit
where the arithmetic is float32 on both sides (float32 inputs, into float32 or FP8 caches; FP8
rounding is done in software where Triton interprets). Triton's interpreter rounds float32 ->
bfloat16 towards zero (a GPU rounds to nearest, as torch does), so on a CPU bfloat16 results
meet the reference within that rounding; ``-m gpu`` holds them to it bit for bit at
Llama-3.1-8B shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.kernels import rotary as rotary_kernels
from tandem.kernels.kv_write import write_kv, write_kv_reference
from tandem.kernels.rotary import apply_rotary, apply_rotary_reference
from tandem.kernels.rotary_kv_write import rotate_and_write_kv, rotate_and_write_kv_reference
from tandem.layers.rotary import RotaryEmbedding
from tests.support.kernels import interpreter_scalar_loop_bounds  # noqa: F401  (autouse fixture)
from tests.support.layouts import in_layout

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FP8 = torch.float8_e4m3fn
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)


@dataclass(frozen=True)
class Case:
    tokens: int
    query_heads: int
    key_heads: int
    head_dim: int
    rotary_dim: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    scale: float = 1.0  # of the inputs: 300 puts many FP8 keys and values beyond 448
    layout: str = "layer-major"
    num_pages: int = 4
    page_size: int = 4
    max_positions: int = 300


def make_inputs(case: Case, seed: int = 0):
    """query, key, value as strided views of one fused qkv tensor; positions; slots (distinct,
    every third token ``-1``); the rotary tables."""
    generator = torch.Generator().manual_seed(seed)
    widths = [case.query_heads * case.head_dim, case.key_heads * case.head_dim, case.key_heads * case.head_dim]
    fused = (torch.randn(case.tokens, sum(widths), generator=generator) * case.scale).to(DEVICE, case.dtype)
    query, key, value = fused.split(widths, dim=-1)
    query = query.reshape(case.tokens, case.query_heads, case.head_dim)
    key = key.reshape(case.tokens, case.key_heads, case.head_dim)
    value = value.reshape(case.tokens, case.key_heads, case.head_dim)
    positions = torch.randint(0, case.max_positions, (case.tokens,), generator=generator).to(DEVICE)
    slots = torch.randperm(case.num_pages * case.page_size, generator=generator)[:case.tokens]
    slots[torch.arange(case.tokens) % 3 == 1] = -1  # a CUDA graph's padding rows
    rotary = RotaryEmbedding(case.rotary_dim, LLAMA3_ROPE, case.max_positions).to(DEVICE)
    return query, key, value, positions, slots.to(DEVICE, torch.int32), rotary.cos_table, rotary.sin_table


def poisoned_caches(case: Case) -> list[torch.Tensor]:
    """A NaN-filled key and value cache, in ``case.layout`` (page-major: strided views of one pool)."""
    shape = (case.num_pages, case.page_size, case.key_heads, case.head_dim)
    caches = [torch.full(shape, float("nan"), device=DEVICE).to(case.cache_dtype) for _ in range(2)]
    return in_layout(case.layout, *caches)


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (NaN poison compares equal to itself)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(as_bits(actual), as_bits(expected))


def assert_near_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within a few steps of the dtype at the tensor's scale, NaN where the other is: the
    interpreter rounds bfloat16 towards zero, and on a GPU the kernels' bfloat16 rotation and
    torch's differ by a step at times (as ``apply_rotary``'s own GPU test allows); an FP8 cache
    may then hold the next e4m3 value."""
    step = 2 ** -3 if expected.dtype == FP8 else 3 * 2 ** -7
    actual, expected = actual.float(), expected.float()
    assert torch.equal(actual.isnan(), expected.isnan())
    actual, expected = actual.nan_to_num(0.0), expected.nan_to_num(0.0)
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=step, atol=step * scale)


def run_all_three(case: Case, seed: int = 0):
    """The fused kernel, the two kernels and the reference on the same inputs: ``(inputs,
    {name: (query_out, key_cache, value_cache)})``. Inputs are checked to be left untouched."""
    inputs = make_inputs(case, seed)
    query, key, value, positions, slots, cos_table, sin_table = inputs
    before = [tensor.clone() for tensor in (query, key, value)]
    results = {}
    caches = poisoned_caches(case)
    results["fused"] = (rotate_and_write_kv(query, key, value, positions, cos_table, sin_table, *caches, slots),
                        *caches)
    caches = poisoned_caches(case)
    query_out, key_out = apply_rotary(query, key, positions, cos_table, sin_table)
    write_kv(key_out, value, *caches, slots)
    results["two kernels"] = (query_out, *caches)
    caches = poisoned_caches(case)
    results["reference"] = (rotate_and_write_kv_reference(query, key, value, positions, cos_table, sin_table,
                                                          *caches, slots), *caches)
    for tensor, original in zip((query, key, value), before):
        assert_same_bits(tensor, original)
    return inputs, results


def check_fused(case: Case, exact_reference: bool) -> tuple:
    inputs, results = run_all_three(case)
    slots = inputs[4]
    fused = results["fused"]
    for actual, expected in zip(fused, results["two kernels"]):
        assert_same_bits(actual, expected)
    for actual, expected in zip(fused, results["reference"]):
        if exact_reference:
            assert_same_bits(actual, expected)
        else:
            assert_near_reference(actual, expected)
    # The padding rows' slots stay poisoned, every written slot holds numbers (FP8: saturated).
    written = int((slots >= 0).sum())
    for cache in fused[1:]:
        nan_rows = cache.float().isnan().flatten(2).all(-1)
        assert int(nan_rows.sum()) == case.num_pages * case.page_size - written
        assert int(cache.float().isnan().sum()) == nan_rows.sum() * case.key_heads * case.head_dim
    return inputs, fused


# (tokens, query heads, key heads, head_dim, rotary_dim): GQA head counts that are not powers of
# two, and partial rotary (a tail passed through, and cast for the cache).
GQA = (7, 6, 3, 32, 32)
PARTIAL = (5, 5, 1, 24, 12)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8], ids=["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("shape", [GQA, PARTIAL], ids=["gqa", "partial"])
def test_float32_matches_both_bit_for_bit(shape, cache_dtype):
    """float32 into float32, bfloat16 (one plain cast) and FP8 caches (values beyond 448)."""
    # The interpreter's float32 -> bfloat16 cast of the bfloat16 cache is its own (see above).
    check_fused(Case(*shape, torch.float32, cache_dtype, scale=300.0 if cache_dtype == FP8 else 1.0),
                exact_reference=cache_dtype != torch.bfloat16)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bfloat16", "fp8"])
@pytest.mark.parametrize("shape", [GQA, PARTIAL], ids=["gqa", "partial"])
def test_bfloat16_matches_the_two_kernels_bit_for_bit(shape, cache_dtype):
    check_fused(Case(*shape, torch.bfloat16, cache_dtype, scale=300.0 if cache_dtype == FP8 else 1.0),
                exact_reference=False)


def test_fp8_cache_saturates_keys_and_values():
    """Keys (after rotation) and values beyond 448 are stored as +-448, never NaN."""
    (query, key, value, positions, slots, *_), (_, key_cache, value_cache) = check_fused(
        Case(*GQA, torch.float32, FP8, scale=300.0), exact_reference=True)
    kept = slots.long() >= 0
    stored_values = value_cache.flatten(0, 1)[slots.long()[kept]].float()
    assert (value[kept].abs() > 448).any() and (stored_values.abs() == 448).any()
    assert (stored_values.abs()[value[kept].abs() >= 448] == 448).all()
    stored_keys = key_cache.flatten(0, 1)[slots.long()[kept]].float()
    assert not stored_keys.isnan().any() and (stored_keys.abs() == 448).any()


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, FP8), (torch.bfloat16, torch.bfloat16)],
                         ids=["float32-fp8", "bfloat16"])
def test_page_major_cache_views(dtype, cache_dtype):
    """Caches as strided views of one page-major pool (``tests/support/layouts.py``)."""
    check_fused(Case(*GQA, dtype, cache_dtype, scale=300.0 if cache_dtype == FP8 else 1.0, layout="page-major"),
                exact_reference=dtype == torch.float32)


def test_several_head_blocks_per_kind(monkeypatch):
    """Small tiles: queries, keys and values each span several programs, the last one partial."""
    monkeypatch.setattr(rotary_kernels, "ELEMENTS_PER_PROGRAM", 64)  # 2 heads of head_dim 32 a program
    check_fused(Case(3, 7, 3, 32, 32, torch.float32, FP8, scale=300.0), exact_reference=True)


def test_bad_shapes_name_the_kernel_and_empty_batches_launch_nothing():
    query, key, value, positions, slots, cos_table, sin_table = make_inputs(Case(*GQA, torch.float32, torch.float32))
    caches = poisoned_caches(Case(*GQA, torch.float32, torch.float32))
    with pytest.raises(ValueError, match="rotate_and_write_kv: key/value"):
        rotate_and_write_kv(query, key, value[:, :1], positions, cos_table, sin_table, *caches, slots)
    with pytest.raises(ValueError, match="rotate_and_write_kv: positions"):
        rotate_and_write_kv(query, key, value, positions[:2], cos_table, sin_table, *caches, slots)
    with pytest.raises(ValueError, match="rotate_and_write_kv: rotary_dim"):
        rotate_and_write_kv(query, key, value, positions, cos_table[:, :31], sin_table, *caches, slots)
    empty = rotate_and_write_kv(query[:0], key[:0], value[:0], positions[:0], cos_table, sin_table, *caches,
                                slots[:0])
    assert empty.shape == (0, 6, 32) and caches[0].isnan().all() and caches[1].isnan().all()


def test_reference_is_rotary_then_write_kv_references():
    """The reference is, bit for bit, the two references it is made of."""
    case = Case(*PARTIAL, torch.bfloat16, FP8, scale=300.0)
    query, key, value, positions, slots, cos_table, sin_table = make_inputs(case)
    caches, expected_caches = poisoned_caches(case), poisoned_caches(case)
    query_out = rotate_and_write_kv_reference(query, key, value, positions, cos_table, sin_table, *caches, slots)
    expected_query, expected_key = apply_rotary_reference(query, key, positions, cos_table, sin_table)
    write_kv_reference(expected_key, value, *expected_caches, slots)
    assert_same_bits(query_out, expected_query)
    for actual, expected in zip(caches, expected_caches):
        assert_same_bits(actual, expected)


# --- GPU: Llama-3.1-8B shapes --------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["layer-major", "page-major"])
@pytest.mark.parametrize("tokens", [1, 2, 256, 4096])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bfloat16", "fp8"])
def test_fused_matches_the_two_kernels_on_cuda(cache_dtype, tokens, layout):
    """bfloat16 at 8B shapes (32 query heads, 8 key/value heads of 128), into bfloat16 and FP8
    caches: bit for bit against the two kernels, near the reference. Pages enough for every
    token; every third slot -1."""
    num_pages = -(-tokens // 16) + 1
    check_fused(Case(tokens, 32, 8, 128, 128, torch.bfloat16, cache_dtype, scale=300.0 if cache_dtype == FP8 else 1.0,
                     layout=layout, num_pages=num_pages, page_size=16, max_positions=8192), exact_reference=False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_fused_replays_from_a_cuda_graph():
    """Captured at 8B shapes with an FP8 cache, replayed on new inputs in the same buffers:
    the same query and caches as the two kernels run eagerly on them."""
    case = Case(2, 32, 8, 128, 128, torch.bfloat16, FP8, scale=300.0, num_pages=4, page_size=16, max_positions=8192)
    query, key, value, positions, slots, cos_table, sin_table = make_inputs(case, seed=1)
    caches = poisoned_caches(case)

    def step():
        return rotate_and_write_kv(query, key, value, positions, cos_table, sin_table, *caches, slots)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new = make_inputs(case, seed=2)
    for target, source in zip((query, key, value, positions, slots), new):
        target.copy_(source)
    expected_caches = poisoned_caches(case)
    for cache, poison in zip(caches, expected_caches):
        cache.copy_(poison)
    graph.replay()
    expected_query, expected_key = apply_rotary(query, key, positions, cos_table, sin_table)
    write_kv(expected_key, value, *expected_caches, slots)
    assert_same_bits(captured, expected_query)
    for actual, expected in zip(caches, expected_caches):
        assert_same_bits(actual, expected)
