"""MLA absorbed-latent decode and DSA indexer scoring kernels at DeepSeek-V3/V3.2 shapes (GPU):
median time (``triton.testing.do_bench``) and bytes read per second.

    python -m benchmarks.kernels_mla
"""
from __future__ import annotations


import torch
import triton


from tandem.kernels.indexer_decode import index_decode_scores
from tandem.kernels.mla_decode import mla_decode_attention

HEADS, LATENT, ROPE, PAGE = 128, 512, 64, 64
INDEX_HEADS, INDEX_DIM = 64, 128


def main() -> None:
    device, dtype = "cuda", torch.bfloat16
    print(f"{'kernel':<18}{'batch':>6}{'context':>9}{'us':>10}{'GB/s':>8}")
    for batch, length in ((1, 4096), (32, 4096), (128, 2048)):
        pages = length // PAGE
        table = (torch.randperm(batch * pages, device=device, dtype=torch.int32) + 1).view(batch, pages)
        lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
        cache = torch.randn(batch * pages + 1, PAGE, LATENT + ROPE, device=device, dtype=dtype)
        query = torch.randn(batch, HEADS, LATENT, device=device, dtype=dtype)
        query_rope = torch.randn(batch, HEADS, ROPE, device=device, dtype=dtype)
        ms = triton.testing.do_bench(lambda: mla_decode_attention(query, query_rope, cache, table, lengths, 0.07),
                                     return_mode="median")
        print(f"{'MLA decode':<18}{batch:>6}{length:>9}{ms * 1e3:>10.1f}"
              f"{batch * length * (LATENT + ROPE) * 2 / ms / 1e6:>8.0f}")
        keys = torch.randn(batch * pages + 1, PAGE, INDEX_DIM, device=device).to(torch.float8_e4m3fn)
        scales = torch.rand(batch * pages + 1, PAGE, device=device)
        index_query = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=device, dtype=dtype)
        weights = torch.randn(batch, INDEX_HEADS, device=device)
        ms = triton.testing.do_bench(lambda: index_decode_scores(index_query, weights, keys, scales, table, lengths,
                                                                 0.088), return_mode="median")
        print(f"{'indexer scores':<18}{batch:>6}{length:>9}{ms * 1e3:>10.1f}"
              f"{batch * length * (INDEX_DIM + 4) / ms / 1e6:>8.0f}")


if __name__ == "__main__":
    main()
