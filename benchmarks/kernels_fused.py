"""Fused elementwise kernels vs the unfused PyTorch ops they replace, at Llama-3.1-8B shapes.

For each kernel and T in {1, 32, 256, 4096} tokens: the kernel's time and the unfused ops'
time (for rotary+write_kv: the rotary and K/V write kernels it replaces, two launches; with the
q/k norms, Qwen3-8B's shapes: the two per-head norm launches and the rotary write, three)
(``triton.testing.do_bench``, median, microseconds), the speedup, and the kernel's
largest error relative to the reference's largest magnitude. bfloat16, CUDA only; under a
minute.

    python -m benchmarks.kernels_fused
    python -m benchmarks.kernels_fused --tokens 1 256
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch


from tandem.kernels.activation import silu_and_mul, silu_and_mul_reference
from tandem.kernels.kv_write import write_kv, write_kv_reference
from tandem.kernels.norm import HeadNorm, rms_norm, rms_norm_reference
from tandem.kernels.rotary import apply_rotary, apply_rotary_reference
from tandem.kernels.rotary_kv_write import rotate_and_write_kv, rotate_and_write_kv_reference
from tandem.layers.rotary import RotaryEmbedding

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)
PAGE_SIZE, NUM_PAGES = 16, 2048


def relative_error(actual, expected) -> float:
    """Largest |actual - expected| over the largest |expected|, over every output tensor."""
    actual = actual if isinstance(actual, (tuple, list)) else (actual,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    return max(float((a.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-30))
               for a, e in zip(actual, expected))


def norm_case(tokens: int, generator: torch.Generator) -> tuple[Callable, Callable]:
    x, residual = (torch.randn(tokens, HIDDEN, generator=generator).to("cuda", torch.bfloat16) for _ in range(2))
    weight = torch.randn(HIDDEN, generator=generator).to("cuda", torch.bfloat16)
    return (lambda: rms_norm(x, weight, 1e-5, residual=residual),
            lambda: rms_norm_reference(x, weight, 1e-5, residual=residual))


def head_norm_case(tokens: int, generator: torch.Generator) -> tuple[Callable, Callable]:
    fused = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    query = fused[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    weight = torch.randn(HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    return lambda: rms_norm(query, weight, 1e-6), lambda: rms_norm_reference(query, weight, 1e-6)


def rotary_case(tokens: int, generator: torch.Generator) -> tuple[Callable, Callable]:
    rotary = RotaryEmbedding(HEAD_DIM, LLAMA3_ROPE, 8192).to("cuda")
    fused = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    query = fused[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    key = fused[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 8192, (tokens,), generator=generator).to("cuda")
    tables = (rotary.cos_table, rotary.sin_table)
    return (lambda: apply_rotary(query, key, positions, *tables),
            lambda: apply_rotary_reference(query, key, positions, *tables))


def activation_case(tokens: int, generator: torch.Generator) -> tuple[Callable, Callable]:
    x = torch.randn(tokens, 2 * INTERMEDIATE, generator=generator).to("cuda", torch.bfloat16)
    return lambda: silu_and_mul(x), lambda: silu_and_mul_reference(x)


def kv_write_case(tokens: int, generator: torch.Generator) -> tuple[Callable, Callable, Callable]:
    """Error against ``write_kv_reference``; time against the engine's unfused write
    (``index_copy_`` of each of key and value into the flattened cache)."""
    key, value = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
                  for _ in range(2))
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, generator=generator)[:tokens].to("cuda")
    shape = (NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    caches = {role: [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
              for role in ("fused", "reference", "unfused")}

    def fused():
        write_kv(key, value, *caches["fused"], slots)
        return caches["fused"]

    def reference():
        write_kv_reference(key, value, *caches["reference"], slots)
        return caches["reference"]

    def unfused():
        for cache, source in zip(caches["unfused"], (key, value)):
            cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, source)
        return caches["unfused"]

    return fused, reference, unfused


def rotary_kv_write_inputs(tokens: int, generator: torch.Generator) -> tuple:
    """query, key, value (views of one qkv output), positions, slots, the rotary tables, and a
    maker of zeroed bfloat16 caches."""
    rotary = RotaryEmbedding(HEAD_DIM, LLAMA3_ROPE, 8192).to("cuda")
    fused_qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    query, key, value = fused_qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    query, key, value = (query.view(tokens, HEADS, HEAD_DIM), key.view(tokens, KV_HEADS, HEAD_DIM),
                         value.view(tokens, KV_HEADS, HEAD_DIM))
    positions = torch.randint(0, 8192, (tokens,), generator=generator).to("cuda")
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, generator=generator)[:tokens].to("cuda")
    shape = (NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    make_caches = lambda: [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    return query, key, value, positions, slots, (rotary.cos_table, rotary.sin_table), make_caches


def rotary_kv_write_case(tokens: int, generator: torch.Generator) -> tuple[Callable, Callable, Callable]:
    """The one launch that rotates and writes; error against its reference (query and caches),
    time against the two kernels it replaces (``apply_rotary`` then ``write_kv``)."""
    query, key, value, positions, slots, tables, make_caches = rotary_kv_write_inputs(tokens, generator)
    caches = {role: make_caches() for role in ("fused", "reference", "two kernels")}

    def fused():
        return (rotate_and_write_kv(query, key, value, positions, *tables, *caches["fused"], slots),
                *caches["fused"])

    def reference():
        return (rotate_and_write_kv_reference(query, key, value, positions, *tables, *caches["reference"], slots),
                *caches["reference"])

    def two_kernels():
        rotated_query, rotated_key = apply_rotary(query, key, positions, *tables)
        write_kv(rotated_key, value, *caches["two kernels"], slots)
        return rotated_query

    return fused, reference, two_kernels


def qk_norm_rotary_kv_write_case(tokens: int, generator: torch.Generator) -> tuple[Callable, Callable, Callable]:
    """Qwen3's q_norm/k_norm inside the launch that rotates and writes; error against its
    reference, time against the three launches it replaces (``rms_norm`` of the query, of the
    key, then the rotary write without norms)."""
    query, key, value, positions, slots, tables, make_caches = rotary_kv_write_inputs(tokens, generator)
    norms = {name: HeadNorm(torch.randn(HEAD_DIM, generator=generator).to("cuda", torch.bfloat16), 1e-6)
             for name in ("query_norm", "key_norm")}
    caches = {role: make_caches() for role in ("fused", "reference", "three kernels")}

    def fused():
        return (rotate_and_write_kv(query, key, value, positions, *tables, *caches["fused"], slots, **norms),
                *caches["fused"])

    def reference():
        return (rotate_and_write_kv_reference(query, key, value, positions, *tables, *caches["reference"], slots,
                                              **norms), *caches["reference"])

    def three_kernels():
        normed_query = rms_norm(query, norms["query_norm"].weight, 1e-6)
        normed_key = rms_norm(key, norms["key_norm"].weight, 1e-6)
        return rotate_and_write_kv(normed_query, normed_key, value, positions, *tables, *caches["three kernels"],
                                   slots)

    return fused, reference, three_kernels


CASES = {"rms_norm+residual [T,4096]": norm_case, "rms_norm per head [T,32,128]": head_norm_case,
         "rotary q[T,32,128] k[T,8,128]": rotary_case, "silu_and_mul [T,2*14336]": activation_case,
         "write_kv [T,8,128] x2": kv_write_case,
         "rotary+write_kv (vs the two)": rotary_kv_write_case,
         "q/k norm+rotary+write_kv (vs 3)": qk_norm_rotary_kv_write_case}


def measure(name: str, tokens: int) -> tuple[str, int, float, float, float]:
    """A case gives (fused, reference) or (fused, reference, unfused); unfused defaults to
    the reference, which is the unfused PyTorch ops."""
    from triton.testing import do_bench

    fused, reference, *unfused = CASES[name](tokens, torch.Generator().manual_seed(tokens))
    unfused = unfused[0] if unfused else reference
    error = relative_error(fused(), reference())
    fused_us = do_bench(fused, warmup=10, rep=40, return_mode="median") * 1e3
    unfused_us = do_bench(unfused, warmup=10, rep=40, return_mode="median") * 1e3
    return name, tokens, fused_us, unfused_us, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256, 4096])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_fused: needs a CUDA device")
    rows = [measure(name, tokens) for name in CASES for tokens in args.tokens]
    print(f"\n{torch.cuda.get_device_name()}, bfloat16; times are medians in microseconds")
    print(f"{'kernel':32} {'T':>5} {'fused':>9} {'unfused':>9} {'speedup':>8} {'rel err':>9}")
    for name, tokens, fused_us, unfused_us, error in rows:
        print(f"{name:32} {tokens:>5} {fused_us:>9.1f} {unfused_us:>9.1f} {unfused_us / fused_us:>7.2f}x {error:>9.1e}")


if __name__ == "__main__":
    main()
