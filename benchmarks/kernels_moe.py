"""Fused MoE kernel against the per-expert loop (its reference) at Qwen3-30B-A3B and DeepSeek-V3
expert shapes (GPU, bfloat16): median time (``triton.testing.do_bench``) and the expert weight
bytes read per second (each expert hit is read once).

    python -m benchmarks.kernels_moe
"""
from __future__ import annotations


import torch
import triton


from tandem.kernels.fused_moe import fused_moe, fused_moe_reference

SHAPES = {  # name: (experts, top_k, hidden, intermediate per expert)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
}


def main() -> None:
    device, dtype = "cuda", torch.bfloat16
    print(f"{'shape':<16}{'tokens':>7}{'fused us':>10}{'loop us':>10}{'speed-up':>9}{'GB/s':>8}")
    for name, (experts, top_k, hidden_size, intermediate) in SHAPES.items():
        w1 = torch.randn(experts, 2 * intermediate, hidden_size, device=device, dtype=dtype) * hidden_size ** -0.5
        w2 = torch.randn(experts, hidden_size, intermediate, device=device, dtype=dtype) * intermediate ** -0.5
        expert_bytes = (w1[0].numel() + w2[0].numel()) * w1.element_size()
        for tokens in (1, 32, 256, 4096):
            hidden = torch.randn(tokens, hidden_size, device=device, dtype=dtype)
            expert_ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
            weights = torch.rand(tokens, top_k, device=device)
            fused = triton.testing.do_bench(lambda: fused_moe(hidden, w1, w2, weights, expert_ids),
                                            return_mode="median")
            loop = triton.testing.do_bench(lambda: fused_moe_reference(hidden, w1, w2, weights, expert_ids),
                                           return_mode="median")
            hit = torch.unique(expert_ids).numel()
            print(f"{name:<16}{tokens:>7}{fused * 1e3:>10.1f}{loop * 1e3:>10.1f}{loop / fused:>9.1f}"
                  f"{hit * expert_bytes / fused / 1e6:>8.0f}")
        del w1, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
