"""Paged attention kernels on a GPU: split-KV decode and prefill/extend, Llama-3.1-8B attention
(32 query heads, 8 kv heads, head_dim 128, page size 16), pages in random order.

For each shape it checks the kernel against its plain-PyTorch reference (relative error:
max |kernel - reference| / max |reference|), times it with ``triton.testing.do_bench``
(median; L2 flushed between runs) and with a CUDA-graph replay, and prints a table: time,
K+V bytes read, achieved GB/s, the ratio of that to a device-to-device copy measured here
(read + write bytes), and for prefill TFLOP/s (causal pairs only). The table is printed last.

    python -m benchmarks.kernels_attention                    # bfloat16
    python -m benchmarks.kernels_attention --dtype float16
    python -m benchmarks.kernels_attention --kv-cache-dtype fp8 --sweep   # also: decode launch options

``--pages in-order`` gives each sequence consecutive pages (as a fresh engine allocates a
prompt's; a decode step's new pages interleave across the batch) instead of pages in random order.

``--sweep`` times the decode kernel under other launch options (key block, warps, pipeline
stages, KV splits) at batch 256 x 1,500 keys, at 160 rows of 200 to 2,000 keys (the lengths of
a batch partway through the nano-vllm workload), at 64 rows of 128 to 384 keys (the
llama3-8b-b64 preset's decode) and at 48 and 16 rows of 600 to 2,000 keys (the nano-vllm
workload's last steps), each replayed from a CUDA graph, the default marked: what to try before
changing ``_decode_config`` or ``_splits_for``. Each replay reads a stack of distinct caches (512
MiB of K/V, at most 32 layers' worth) so that, as in an engine's step, the pages come from memory
and not from L2; the times are per layer. ``--sweep-only`` picks batches and skips
the table; ``--heads 16 4`` is one rank of the 8B shape under TP=2.

    python -m benchmarks.kernels_attention --sweep-only "64 x 128..384" --heads 16 4

``--sweep-prefill`` does the same for the prefill kernel at the table's prefill shapes (query
tokens a program, key block, warps, pipeline stages): what to try before changing
``_prefill_config``.

    python -m benchmarks.kernels_attention --sweep-prefill [--kv-cache-dtype fp8]
"""
from __future__ import annotations

import argparse
import math
import sys

import torch


CACHE_DTYPE = None  # the pages' dtype when it is not the queries' (--kv-cache-dtype fp8)
PAGES_IN_ORDER = False  # each sequence's pages consecutive (--pages in-order), as a fresh engine allocates a prompt's
NUM_QUERY_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DECODE_SHAPES = [(1, 128), (1, 1024), (1, 8192), (32, 1024), (256, 1500)]  # (batch, context length)
PREFILL_SHAPES = {  # name: chunks of (query length, context length)
    "1x512 fresh": [(512, 512)],
    "8x512 fresh": [(512, 512)] * 8,
    "512 on 4096 prefix": [(512, 4608)],
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the pages' dtype: auto (as the queries) or fp8 (e4m3)")
    parser.add_argument("--pages", default="random", choices=["random", "in-order"],
                        help="each sequence's pages in random order (default) or consecutive, as a fresh engine "
                             "allocates a prompt's pages")
    parser.add_argument("--sweep", action="store_true", help="also time the decode kernel's launch options")
    parser.add_argument("--sweep-only", nargs="+", choices=list(SWEEP_BATCHES), default=None, metavar="BATCH",
                        help=f"sweep these batches only (of: {', '.join(SWEEP_BATCHES)}); implies --sweep")
    parser.add_argument("--sweep-prefill", action="store_true",
                        help="only the prefill kernel's launch options at the prefill shapes (no table)")
    parser.add_argument("--heads", nargs=2, type=int, default=None, metavar=("QUERY", "KV"),
                        help="query and key/value heads (default: 32 8, Llama-3.1-8B; 16 4 is one rank of its TP=2)")
    return parser.parse_args()


def random_paged_cache(context_lengths, dtype, generator):
    """Random key and value caches holding each sequence on pages in random order, or in order
    (``PAGES_IN_ORDER``; page 0 is the null page). Returns ``(key_cache, value_cache,
    page_table)`` on the GPU."""
    pages_per_row = [math.ceil(length / PAGE_SIZE) for length in context_lengths]
    num_pages = 1 + sum(pages_per_row)
    order = (torch.arange(num_pages - 1) if PAGES_IN_ORDER else torch.randperm(num_pages - 1, generator=generator))
    order = (order + 1).to(torch.int32)
    page_table = torch.zeros(len(context_lengths), max(pages_per_row), dtype=torch.int32)
    used = 0
    for row, count in enumerate(pages_per_row):
        page_table[row, :count] = order[used:used + count]
        used += count
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device="cuda").to(CACHE_DTYPE or dtype)
    value_cache = torch.randn(shape, device="cuda").to(CACHE_DTYPE or dtype)
    return key_cache, value_cache, page_table.cuda()


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, read and write bytes counted."""
    from triton.testing import do_bench

    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    destination = torch.empty_like(source)
    milliseconds = do_bench(lambda: destination.copy_(source), return_mode="median")
    return 2 * source.numel() / (milliseconds * 1e-3)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def time_microseconds(function) -> tuple[float, float]:
    """``(do_bench median, CUDA-graph replay median)`` in microseconds."""
    from triton.testing import do_bench, do_bench_cudagraph

    function()
    plain = do_bench(function, return_mode="median") * 1e3
    graph = do_bench_cudagraph(function, return_mode="median") * 1e3
    return plain, graph


def kv_bytes(num_keys: int, dtype) -> int:
    return 2 * num_keys * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=CACHE_DTYPE or dtype).element_size()


def decode_row(batch, context_length, dtype, generator):
    from tandem.kernels.paged_attention import (default_decode_splits, paged_decode_attention,
                                                paged_decode_attention_reference)

    lengths = [context_length] * batch
    key_cache, value_cache, page_table = random_paged_cache(lengths, dtype, generator)
    query = torch.randn(batch, NUM_QUERY_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    context_lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    scale = HEAD_DIM ** -0.5

    def run():
        paged_decode_attention(query, key_cache, value_cache, page_table, context_lengths, scale, out=out)

    run()
    error = relative_error(out, paged_decode_attention_reference(query, key_cache, value_cache, page_table,
                                                                 context_lengths, scale))
    plain, graph = time_microseconds(run)
    splits = default_decode_splits(query, key_cache, page_table)
    return dict(name=f"decode B={batch} ctx={context_length} splits={splits}", error=error, plain=plain,
                graph=graph, bytes=kv_bytes(batch * context_length, dtype), flops=None)


def prefill_case(chunks, dtype, generator) -> dict:
    """Queries and paged keys for ``chunks`` of (query length, context length): the keyword
    arguments of ``paged_prefill_attention`` (and of its reference), ``out`` aside."""
    key_cache, value_cache, page_table = random_paged_cache([length for _, length in chunks], dtype, generator)
    query_lengths = [queries for queries, _ in chunks]
    return dict(query=torch.randn(sum(query_lengths), NUM_QUERY_HEADS, HEAD_DIM, device="cuda", dtype=dtype),
                key_cache=key_cache, value_cache=value_cache, page_table=page_table,
                query_starts=torch.tensor([0] + query_lengths, device="cuda").cumsum(0).to(torch.int32),
                context_lengths=torch.tensor([length for _, length in chunks], dtype=torch.int32, device="cuda"),
                scale=HEAD_DIM ** -0.5, max_query_len=max(query_lengths))


def prefill_flops(chunks) -> int:
    """Causal (query, key) pairs: query i of a chunk of q ending at context c sees c - q + i + 1 keys."""
    pairs = sum(queries * (length - queries) + queries * (queries + 1) // 2 for queries, length in chunks)
    return 4 * pairs * NUM_QUERY_HEADS * HEAD_DIM


def prefill_row(name, chunks, dtype, generator):
    from tandem.kernels.paged_attention import paged_prefill_attention, paged_prefill_attention_reference

    case = prefill_case(chunks, dtype, generator)
    out = torch.empty_like(case["query"])

    def run():
        paged_prefill_attention(**case, out=out)

    run()
    error = relative_error(out, paged_prefill_attention_reference(**case))
    plain, graph = time_microseconds(run)
    return dict(name=f"prefill {name}", error=error, plain=plain, graph=graph,
                bytes=kv_bytes(sum(length for _, length in chunks), dtype), flops=prefill_flops(chunks))


SWEEP_BATCHES = {"256 x 1500": [1500] * 256, "160 x 200..2000": [200 + (1800 * row) // 159 for row in range(160)],
                 # the llama3-8b-b64 preset's decode: 64 rows of 128-token prompts, 256 tokens out
                 "64 x 128..384": [128 + (256 * row) // 63 for row in range(64)],
                 # the nano-vllm workload's last steps: a few dozen rows of long sequences
                 "48 x 600..2000": [600 + (1400 * row) // 47 for row in range(48)],
                 "16 x 600..2000": [600 + (1400 * row) // 15 for row in range(16)]}
SWEEP_BYTES = 512 << 20  # K/V the sweep's replays read each time (ten times an H100's L2), in distinct caches
MAX_SWEEP_LAYERS = 32


def time_launch_options(attribute: str, options, run, out, expected) -> list:
    """``run`` (writing ``out``) under each ``(config, extra)`` of ``options``, with
    ``tandem.kernels.paged_attention``'s ``attribute`` (a launch configuration function)
    returning ``config``; ``run(extra)`` gets the rest (the decode sweep's splits). CUDA-graph
    medians: ``[(microseconds, config, extra, relative error)]``; an option the GPU cannot hold
    (shared memory) is reported and skipped."""
    from triton.testing import do_bench_cudagraph

    import tandem.kernels.paged_attention as attention

    default = getattr(attention, attribute)
    results = []
    for config, extra in options:
        setattr(attention, attribute, lambda *shape, config=config: config)
        try:
            run(extra)
            error = relative_error(out, expected)
            microseconds = do_bench_cudagraph(lambda: run(extra), return_mode="median") * 1e3
        except Exception as failure:  # noqa: BLE001 - an option the GPU cannot hold (shared memory)
            print(f"   {config} {extra}: {type(failure).__name__}")
            continue
        finally:
            setattr(attention, attribute, default)
        results.append((microseconds, config, extra, error))
    return results


def fastest_and_default(results, default) -> list:
    """The twelve fastest of ``time_launch_options``' results, then the ``default`` option's
    ``(config, extra)`` row, each with whether it is the default."""
    marked = [row for row in results if (row[1], row[2]) == default]
    return [(row, (row[1], row[2]) == default) for row in sorted(results, key=lambda row: row[0])[:12] + marked]


def decode_sweep(dtype, generator, copy_bytes_per_second, only=None) -> None:
    """The decode kernel at ``SWEEP_BATCHES`` under each launch option (``_decode_config``
    replaced for the call), CUDA-graph medians, fastest first; the default marked."""
    import itertools

    import tandem.kernels.paged_attention as attention

    for name, lengths in SWEEP_BATCHES.items():
        if only and name not in only:
            continue
        moved = kv_bytes(sum(lengths), dtype)
        # A layer's K/V of these batches fits in L2: replaying one cache would time L2 reads,
        # where the engine reads each layer's pages from memory after the products in between
        # have evicted them. So each replay reads distinct caches (one per layer) in turn.
        layers = max(1, min(MAX_SWEEP_LAYERS, -(-SWEEP_BYTES // moved)))
        caches = [random_paged_cache(lengths, dtype, generator) for _ in range(layers)]
        key_cache, value_cache, page_table = caches[0]
        query = torch.randn(len(lengths), NUM_QUERY_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        context_lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        out = torch.empty_like(query)
        expected = attention.paged_decode_attention_reference(query, key_cache, value_cache, page_table,
                                                               context_lengths, HEAD_DIM ** -0.5)
        default_splits = attention.default_decode_splits(query, key_cache, page_table)
        default = attention._decode_config(HEAD_DIM, query.device, len(lengths) * NUM_KV_HEADS * default_splits,
                                           key_cache.element_size() == 1)

        def run(splits):  # every layer's cache, the first last (its output is the one checked)
            for layer_keys, layer_values, layer_table in caches[1:] + caches[:1]:
                attention.paged_decode_attention(query, layer_keys, layer_values, layer_table, context_lengths,
                                                 HEAD_DIM ** -0.5, num_splits=splits, out=out)

        options = [(dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages), splits)
                   for block_n, warps, stages, splits
                   in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3), (1, 2, 4, 8))]
        results = [(microseconds / layers, *rest)
                   for microseconds, *rest in time_launch_options("_decode_config", options, run, out, expected)]
        print(f"\ndecode sweep {name}, pages {CACHE_DTYPE or dtype}: {moved / 1e6:.0f} MB of K+V a layer, "
              f"{layers} layers' caches read in turn (times per layer)")
        print(f"{'us':>8} {'of copy':>8} {'BLOCK_N':>8} {'warps':>6} {'stages':>7} {'splits':>7} {'rel err':>8}")
        ranked = fastest_and_default(results, (default, default_splits))
        for (microseconds, config, splits, error), is_default in ranked:
            print(f"{microseconds:>8.1f} {moved / (microseconds * 1e-6) / copy_bytes_per_second:>8.2f} "
                  f"{config['BLOCK_N']:>8} {config['num_warps']:>6} {config['num_stages']:>7} {splits:>7} "
                  f"{error:>8.1e}" + ("   (default)" if is_default else ""))


def prefill_sweep(dtype, generator) -> None:
    """The prefill kernel at ``PREFILL_SHAPES`` under each launch option (``_prefill_config``
    replaced for the call: query tokens a program, key block, warps, pipeline stages),
    CUDA-graph medians, fastest first; the default marked."""
    import itertools

    import tandem.kernels.paged_attention as attention

    group_size = NUM_QUERY_HEADS // NUM_KV_HEADS
    for name, chunks in PREFILL_SHAPES.items():
        case = prefill_case(chunks, dtype, generator)
        out = torch.empty_like(case["query"])
        expected = attention.paged_prefill_attention_reference(**case)
        default = attention._prefill_config(group_size, HEAD_DIM, case["query"].device)
        block_g = default["BLOCK_G"]

        def run(_):
            attention.paged_prefill_attention(**case, out=out)

        options = [(dict(BLOCK_M=rows // block_g, BLOCK_G=block_g, BLOCK_N=block_n, num_warps=warps,
                         num_stages=stages), None)
                   for rows, block_n, warps, stages in itertools.product((32, 64, 128, 256), (32, 64, 128), (4, 8),
                                                                         (1, 2, 3))
                   if rows >= block_g]
        results = time_launch_options("_prefill_config", options, run, out, expected)
        flops = prefill_flops(chunks)
        print(f"\nprefill sweep {name}, pages {CACHE_DTYPE or dtype}: {flops / 1e9:.1f} GFLOP (causal pairs)")
        print(f"{'us':>8} {'TFLOP/s':>8} {'tokens':>7} {'BLOCK_N':>8} {'warps':>6} {'stages':>7} {'rel err':>8}")
        for (microseconds, config, _, error), is_default in fastest_and_default(results, (default, None)):
            print(f"{microseconds:>8.1f} {flops / (microseconds * 1e-6) / 1e12:>8.1f} {config['BLOCK_M']:>7} "
                  f"{config['BLOCK_N']:>8} {config['num_warps']:>6} {config['num_stages']:>7} {error:>8.1e}"
                  + ("   (default)" if is_default else ""))


def print_table(rows, copy_bytes_per_second, dtype, device_name):
    print(f"\npaged attention, {dtype}, pages {CACHE_DTYPE or dtype}, Hq={NUM_QUERY_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} "
          f"page={PAGE_SIZE}, {device_name}; device copy {copy_bytes_per_second / 1e9:.0f} GB/s (read+write)")
    header = (f"{'shape':<40} {'rel err':>8} {'median us':>10} {'graph us':>9} {'K+V MB':>8} "
              f"{'GB/s':>7} {'of copy':>8} {'TFLOP/s':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        bytes_per_second = row["bytes"] / (row["plain"] * 1e-6)
        tflops = "" if row["flops"] is None else f"{row['flops'] / (row['plain'] * 1e-6) / 1e12:.1f}"
        print(f"{row['name']:<40} {row['error']:>8.1e} {row['plain']:>10.1f} {row['graph']:>9.1f} "
              f"{row['bytes'] / 1e6:>8.1f} {bytes_per_second / 1e9:>7.0f} "
              f"{bytes_per_second / copy_bytes_per_second:>8.2f} {tflops:>8}")


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    global CACHE_DTYPE, PAGES_IN_ORDER
    CACHE_DTYPE = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
    PAGES_IN_ORDER = args.pages == "in-order"
    generator = torch.Generator().manual_seed(0)
    global NUM_QUERY_HEADS, NUM_KV_HEADS
    if args.heads:
        NUM_QUERY_HEADS, NUM_KV_HEADS = args.heads
    copy_bytes_per_second = copy_bandwidth()
    if args.sweep_only:  # the launch options alone
        decode_sweep(dtype, generator, copy_bytes_per_second, args.sweep_only)
        return
    if args.sweep_prefill:
        prefill_sweep(dtype, generator)
        return
    rows = [decode_row(batch, length, dtype, generator) for batch, length in DECODE_SHAPES]
    rows += [prefill_row(name, chunks, dtype, generator) for name, chunks in PREFILL_SHAPES.items()]
    print_table(rows, copy_bytes_per_second, args.dtype, torch.cuda.get_device_name())
    if args.sweep:
        decode_sweep(dtype, generator, copy_bytes_per_second)


if __name__ == "__main__":
    main()
