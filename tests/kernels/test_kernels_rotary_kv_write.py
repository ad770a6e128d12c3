"""The fused rotary + K/V write kernel (``tandem/kernels/rotary_kv_write.py``) against the two
kernels it replaces (``apply_rotary`` then ``write_kv``) and against its plain-PyTorch reference.

Against the two kernels it is bit for bit everywhere: the rotated query, every cache byte
(written slots and the poison left in the others). Against the reference it is bit for bit
where the arithmetic is float32 on both sides (float32 inputs, into float32 or FP8 caches; FP8
rounding is done in software where Triton interprets). Triton's interpreter rounds float32 ->
bfloat16 towards zero (a GPU rounds to nearest, as torch does), so on a CPU bfloat16 results
meet the reference within that rounding; ``-m gpu`` holds them to it bit for bit at
Llama-3.1-8B shapes.

Given the per-head query/key norms (Qwen3's, Gemma-3's), the kernel is held to the norm kernel
(``rms_norm``) then itself without them: within two steps of the dtype at a head's scale, nearly
every element bit for bit (only the order of the float32 sum of squares differs); float32 within
1e-6 of the reference too. A wrong weight, eps or offset fails that comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.kernels import rotary as rotary_kernels
from tandem.kernels.kv_write import write_kv, write_kv_reference
from tandem.kernels.norm import HeadNorm, rms_norm, rms_norm_reference
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


def compare_with_reference(fused, reference, exact_comparison) -> None:
    """Each of the fused kernel's outputs against the reference's: by ``exact_comparison`` where
    the reference is exact (float32, or a GPU's rounding), else near it (``assert_near_reference``)."""
    for actual, expected in zip(fused, reference):
        (exact_comparison or assert_near_reference)(actual, expected)


def check_fused(case: Case, exact_reference: bool) -> tuple:
    inputs, results = run_all_three(case)
    slots = inputs[4]
    fused = results["fused"]
    for actual, expected in zip(fused, results["two kernels"]):
        assert_same_bits(actual, expected)
    compare_with_reference(fused, results["reference"], assert_same_bits if exact_reference else None)
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


@pytest.mark.parametrize("flavour", [None, "key only"], ids=["no norms", "key norm only"])
def test_strided_views_reach_the_launch_uncopied(monkeypatch, flavour):
    """Query, key and value as views of one fused qkv output (rows strided) go to the launch as
    they are, with or without norms: nothing of the step's tensors is copied on the way (a norm
    left out must not turn its stand-in, the query or key itself, into a copy)."""
    case = Case(*GQA, torch.float32, torch.float32)
    query, key, value, positions, slots, cos_table, sin_table = make_inputs(case)
    assert not query.is_contiguous() and not key.is_contiguous()
    norms = make_norms(case, flavour) if flavour else {}
    original, copied = torch.Tensor.contiguous, []

    def contiguous(tensor, *args, **kwargs):
        result = original(tensor, *args, **kwargs)
        if result.data_ptr() != tensor.data_ptr():
            copied.append(tuple(tensor.shape))
        return result

    monkeypatch.setattr(torch.Tensor, "contiguous", contiguous)
    rotate_and_write_kv(query, key, value, positions, cos_table, sin_table, *poisoned_caches(case), slots, **norms)
    assert copied == []


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


# --- with the query/key norms (Qwen3's q_norm/k_norm, Gemma-3's) ---------------------------

# The norms' conventions (``kernels/norm.py``): Qwen3's rounds the normalised head before the
# weight, Gemma-3's scales by (1 + weight) in float32. "key only": a query without a norm beside
# a normalised key.
NORM_FLAVOURS = {"qwen3": dict(weight_offset=0.0, cast_before_weight=True),
                 "gemma3": dict(weight_offset=1.0, cast_before_weight=False),
                 "key only": dict(weight_offset=0.0, cast_before_weight=True)}
# A step of each dtype at the scale of a head; float32: the 1e-6 the order of a sum moves it.
STEP = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, FP8: 2 ** -3}
MANTISSA_BITS = {torch.bfloat16: 7, FP8: 3}


def make_norms(case: Case, flavour: str = "qwen3", seed: int = 3) -> dict:
    """``query_norm``/``key_norm`` of ``flavour``: weights of ``case.dtype`` around
    ``case.scale`` (the normalised heads are about 1: an FP8 cache then sees values beyond
    448), different per column and per norm."""
    generator = torch.Generator().manual_seed(seed)
    options = NORM_FLAVOURS[flavour]
    norms = {}
    for name in ("query_norm", "key_norm"):
        weight = case.scale * (1.0 + 0.5 * torch.randn(case.head_dim, generator=generator))
        weight = (weight - options["weight_offset"]).to(DEVICE, case.dtype)
        norms[name] = HeadNorm(weight, 1e-6, **options)
    if flavour == "key only":
        norms["query_norm"] = None
    return norms


def normalized(tensor: torch.Tensor, norm, kernel) -> torch.Tensor:
    """``tensor`` through ``kernel`` (``rms_norm`` or ``rms_norm_reference``) with ``norm``'s
    parameters; unchanged without a norm."""
    if norm is None:
        return tensor
    return kernel(tensor, norm.weight, norm.eps, weight_offset=norm.weight_offset,
                  cast_before_weight=norm.cast_before_weight)


def run_with_norms(case: Case, norms: dict, seed: int = 0, at_position_zero: bool = False):
    """The fused kernel given ``norms``; the norm kernel then the fused kernel without them (the
    launches it replaces); the reference given them; and the references composed by hand.
    ``(inputs, {name: (query_out, key_cache, value_cache)})``; inputs checked untouched.
    ``at_position_zero``: every token at position 0, where the rotation is the identity (cos 1,
    sin 0), so the outputs are the normalised heads themselves."""
    inputs = make_inputs(case, seed)
    if at_position_zero:
        inputs = inputs[:3] + (torch.zeros_like(inputs[3]),) + inputs[4:]
    query, key, value, positions, slots, cos_table, sin_table = inputs
    before = [tensor.clone() for tensor in (query, key, value)]
    results = {}
    caches = poisoned_caches(case)
    results["fused"] = (rotate_and_write_kv(query, key, value, positions, cos_table, sin_table, *caches, slots,
                                            **norms), *caches)
    caches = poisoned_caches(case)
    results["norm kernel, then fused"] = (
        rotate_and_write_kv(normalized(query, norms["query_norm"], rms_norm),
                            normalized(key, norms["key_norm"], rms_norm), value, positions, cos_table, sin_table,
                            *caches, slots), *caches)
    caches = poisoned_caches(case)
    results["reference"] = (rotate_and_write_kv_reference(query, key, value, positions, cos_table, sin_table,
                                                          *caches, slots, **norms), *caches)
    caches = poisoned_caches(case)
    results["references composed"] = (
        rotate_and_write_kv_reference(normalized(query, norms["query_norm"], rms_norm_reference),
                                      normalized(key, norms["key_norm"], rms_norm_reference), value, positions,
                                      cos_table, sin_table, *caches, slots), *caches)
    for tensor, original in zip((query, key, value), before):
        assert_same_bits(tensor, original)
    return inputs, results


def assert_within_a_step(actual: torch.Tensor, expected: torch.Tensor, steps: float = 1.0,
                         equal_share: float = 0.0) -> None:
    """Every element within ``steps`` steps of ``expected``'s dtype at the scale of its head
    (the rotation mixes a head's two halves, so a normalised element a step off moves its
    partner's result by that much), NaN exactly where ``expected`` is; and, below float32 (where
    a sum in another order moves a whole head's last bits), at least ``equal_share`` of the
    elements bit for bit equal."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.float().isnan(), expected.float().isnan())
    actual_values, expected_values = actual.float().nan_to_num(0.0), expected.float().nan_to_num(0.0)
    head_scale = expected_values.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    difference = (actual_values - expected_values).abs()
    worst = float((difference / head_scale).max())
    assert worst <= steps * STEP[expected.dtype], f"{worst / STEP[expected.dtype]:.2f} steps off"
    if expected.dtype != torch.float32:
        share = float(torch.eq(as_bits(actual), as_bits(expected)).float().mean())
        assert share >= equal_share, f"only {share:.3f} of the elements equal"


def assert_each_within_two_steps(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Each element (16-bit or FP8) at most two steps of its dtype from ``expected``'s, the step
    at the larger of the two magnitudes; NaN exactly where ``expected`` is. Two: where the
    float32 sums of squares differ in their last bit, the normalised value may round a step
    apart, and that step times the weight (a mantissa below 2) rounds to at most two of the
    product's (seen on an H100-class GPU: 2.00)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual_values, expected_values = actual.float(), expected.float()
    assert torch.equal(actual_values.isnan(), expected_values.isnan())
    actual_values, expected_values = actual_values.nan_to_num(0.0), expected_values.nan_to_num(0.0)
    magnitude = torch.maximum(actual_values.abs(), expected_values.abs()).clamp_min(2 ** -6)
    step = 2.0 ** (torch.floor(torch.log2(magnitude)) - MANTISSA_BITS[expected.dtype])
    worst = float(((actual_values - expected_values).abs() / step).max())
    assert worst <= 2.0, f"{worst:.2f} steps off"


def check_fused_with_norms(case: Case, flavour: str = "qwen3", exact_reference: bool = True,
                           at_position_zero: bool = False) -> tuple:
    """The fused kernel near the norm kernel then the fused kernel, nearly all elements bit for
    bit (only the order of the sum of squares differs): within two steps at a head's scale (a
    normalised element a step off moves its rotated pair by up to a step of the head, the
    rounding of the rotation's products by up to one more); at position 0 (no rotation) each
    element within two steps of its own (``assert_each_within_two_steps``). Near the reference
    (float32: to 1e-6; bfloat16 on the interpreter: ``assert_near_reference``); the reference bit
    for bit the references composed;
    padding slots left poisoned."""
    norms = make_norms(case, flavour)
    inputs, results = run_with_norms(case, norms, at_position_zero=at_position_zero)
    fused = results["fused"]
    for actual, expected in zip(fused, results["norm kernel, then fused"]):
        assert_within_a_step(actual, expected, steps=2.0, equal_share=0.9)
        if at_position_zero and expected.dtype != torch.float32:
            assert_each_within_two_steps(actual, expected)
    compare_with_reference(fused, results["reference"], assert_within_a_step if exact_reference else None)
    for actual, expected in zip(results["reference"], results["references composed"]):
        assert_same_bits(actual, expected)
    slots = inputs[4]
    for cache in fused[1:]:
        nan_rows = cache.float().isnan().flatten(2).all(-1)
        assert int(nan_rows.sum()) == case.num_pages * case.page_size - int((slots >= 0).sum())
    return inputs, norms, fused


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8], ids=["float32", "fp8"])
@pytest.mark.parametrize("shape", [GQA, PARTIAL], ids=["gqa", "partial"])
def test_norms_float32_match_the_reference_and_the_norm_kernel(shape, cache_dtype):
    """float32: within 1e-6 (at a head's scale) of the reference and of ``rms_norm`` then the
    fused kernel; GQA, and partial rotary (the tail is normalised, not rotated). The FP8 cache
    takes keys and values beyond 448 (saturated)."""
    case = Case(*shape, torch.float32, cache_dtype, scale=300.0 if cache_dtype == FP8 else 1.0)
    (*_, slots, _, _), _, (_, key_cache, _) = check_fused_with_norms(case)
    if cache_dtype == FP8:
        stored_keys = key_cache.flatten(0, 1)[slots.long()[slots >= 0]].float()
        assert not stored_keys.isnan().any() and (stored_keys.abs() == 448).any()


@pytest.mark.parametrize("flavour", ["qwen3", "gemma3", "key only"])
@pytest.mark.parametrize("cache_dtype,shape", [(torch.bfloat16, GQA), (FP8, PARTIAL)], ids=["bfloat16-gqa",
                                                                                              "fp8-partial"])
def test_norms_bfloat16_near_the_norm_kernel(cache_dtype, shape, flavour):
    """bfloat16, both conventions, and a key norm without a query norm: within two bfloat16 (FP8:
    e4m3) steps at a head's scale of ``rms_norm`` then the fused kernel, and near the reference."""
    case = Case(*shape, torch.bfloat16, cache_dtype, scale=300.0 if cache_dtype == FP8 else 1.0)
    check_fused_with_norms(case, flavour, exact_reference=False)


@pytest.mark.parametrize("cache_dtype,shape", [(torch.bfloat16, GQA), (FP8, PARTIAL)], ids=["bfloat16-gqa",
                                                                                              "fp8-partial"])
def test_norms_at_position_zero_are_the_norm_kernel_within_two_steps(cache_dtype, shape):
    """At position 0 the rotation is the identity: the query and keys are the normalised heads,
    each element within two bfloat16 (FP8: e4m3) steps of ``rms_norm``'s."""
    case = Case(*shape, torch.bfloat16, cache_dtype, scale=300.0 if cache_dtype == FP8 else 1.0)
    check_fused_with_norms(case, exact_reference=False, at_position_zero=True)


def test_norms_over_several_head_blocks(monkeypatch):
    """Small tiles: each program normalises its own two heads of the query and key heads."""
    monkeypatch.setattr(rotary_kernels, "ELEMENTS_PER_PROGRAM", 64)  # 2 heads of head_dim 32 a program
    check_fused_with_norms(Case(3, 7, 3, 32, 32, torch.float32, torch.float32))


# What a wrong norm changes: which outputs move by more than a step.
WRONG_NORMS = {"query weight": ("query",), "key weight": ("key",), "key eps": ("key",), "key offset": ("key",)}


@pytest.mark.parametrize("wrong", list(WRONG_NORMS))
def test_a_wrong_norm_is_caught(wrong):
    """The comparison sees the norms: given one wrong weight element (in the tail), a wrong
    eps, or a weight offset, the fused kernel's query or keys are more than a step away from
    ``rms_norm`` then the fused kernel with the right norms; the rest stays within a step and
    the values bit for bit."""
    case = Case(*PARTIAL, torch.float32, torch.float32)
    norms = make_norms(case)
    inputs, results = run_with_norms(case, norms)
    name = "query_norm" if wrong == "query weight" else "key_norm"
    if wrong == "key eps":
        changed = norms[name]._replace(eps=1.0)
    elif wrong == "key offset":
        changed = norms[name]._replace(weight_offset=1.0)
    else:
        weight = norms[name].weight.clone()
        weight[case.rotary_dim] += 0.25  # the tail's first column
        changed = norms[name]._replace(weight=weight)
    query, key, value, positions, slots, cos_table, sin_table = inputs
    caches = poisoned_caches(case)
    query_out = rotate_and_write_kv(query, key, value, positions, cos_table, sin_table, *caches, slots,
                                    **{**norms, name: changed})
    actual = dict(zip(("query", "key", "value"), (query_out, *caches)))
    expected = dict(zip(("query", "key", "value"), results["norm kernel, then fused"]))
    for kind in ("query", "key"):
        if kind in WRONG_NORMS[wrong]:
            with pytest.raises(AssertionError, match="steps off"):
                assert_within_a_step(actual[kind], expected[kind])
        else:
            assert_within_a_step(actual[kind], expected[kind])
    assert_same_bits(actual["value"], expected["value"])


def test_bad_norms_name_the_argument():
    case = Case(*GQA, torch.float32, torch.float32)
    query, key, value, positions, slots, cos_table, sin_table = make_inputs(case)
    caches = poisoned_caches(case)
    norms = make_norms(case)
    with pytest.raises(ValueError, match=r"rotate_and_write_kv: key_norm weight \(31,\)"):
        rotate_and_write_kv(query, key, value, positions, cos_table, sin_table, *caches, slots,
                            query_norm=norms["query_norm"], key_norm=norms["key_norm"]._replace(
                                weight=norms["key_norm"].weight[:31]))
    with pytest.raises(TypeError, match="rotate_and_write_kv: query_norm must be a HeadNorm"):
        rotate_and_write_kv(query, key, value, positions, cos_table, sin_table, *caches, slots,
                            query_norm=(norms["query_norm"].weight, 1e-6))
    with pytest.raises(ValueError, match=r"rotate_and_write_kv_reference: query_norm weight \(31,\)"):
        rotate_and_write_kv_reference(query, key, value, positions, cos_table, sin_table, *caches, slots,
                                      query_norm=norms["query_norm"]._replace(weight=norms["query_norm"].weight[1:]))
    assert caches[0].isnan().all() and caches[1].isnan().all()


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


# Qwen3-8B's attention has Llama-3.1-8B's head shapes, with q_norm/k_norm.
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 2, 256, 4096])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bfloat16", "fp8"])
@pytest.mark.parametrize("at_position_zero", [False, True], ids=["rotated", "position-0"])
def test_norms_match_the_norm_kernel_on_cuda(cache_dtype, tokens, at_position_zero):
    """bfloat16 at Qwen3-8B shapes (32 query heads, 8 key/value heads of 128, q_norm/k_norm),
    into bfloat16 and FP8 caches: near ``rms_norm`` then the fused kernel (nearly every element
    bit for bit; at position 0, unrotated, each element within two steps), near the reference."""
    num_pages = -(-tokens // 16) + 1
    check_fused_with_norms(Case(tokens, 32, 8, 128, 128, torch.bfloat16, cache_dtype,
                                scale=300.0 if cache_dtype == FP8 else 1.0, num_pages=num_pages, page_size=16,
                                max_positions=8192), exact_reference=False, at_position_zero=at_position_zero)
