"""All-reduce latency on one host's GPUs: the peer paths (``tandem/parallel/allreduce.py``) against
NCCL, from 8 KiB to 64 MiB, eagerly and replayed from a CUDA graph; and the fused reduce +
residual add + RMSNorm against the all-reduce followed by the fused add+norm kernel.

Each rank is a spawned process joining the groups as the engine's ranks do (NVLink multicast
off). For every message size (bf16 rows of the Llama-3.1-8B hidden size, 4,096: 8 KiB a row):

- ``one-shot``: the Triton kernel (store into every peer's buffer, sum what the peers stored into
  this rank's own as it arrives; no barrier);
- ``torch 1-shot``: the input copied into the (two-shot) peer buffer, then torch's
  ``one_shot_all_reduce_out`` (its barriers: compare-and-swaps at system scope);
- ``two-shot``: the input copied into the peer buffer, then torch's ``two_shot_all_reduce_out``;
- ``nccl``: ``ProcessGroupNCCL.allreduce``.

Times are rank 0's, microseconds per call: CUDA events around ``--iterations`` back-to-back
calls (eager), or around a replayed graph holding as many (graph), median of ``--trials``. The
table ends with the limits it would choose (the environment variables to set), from the graph
times, since decode steps replay graphs.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 python -m benchmarks.allreduce
    python -m benchmarks.allreduce --ranks 4 --json allreduce.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch


os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

KIB, MIB = 1 << 10, 1 << 20
HIDDEN = 4096
DTYPE = torch.bfloat16
ROW_BYTES = HIDDEN * 2
ALGORITHMS = ("one-shot", "torch 1-shot", "two-shot", "nccl")
FUSED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def sizes_between(smallest: int, largest: int) -> list[int]:
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sizes


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="GPUs, one rank each (default: %(default)s)")
    parser.add_argument("--min-bytes", type=int, default=8 * KIB)
    parser.add_argument("--max-bytes", type=int, default=64 * MIB)
    parser.add_argument("--iterations", type=int, default=20, help="calls per timing (default: %(default)s)")
    parser.add_argument("--trials", type=int, default=5, help="timings per cell, median kept (default: %(default)s)")
    parser.add_argument("--json", default=None, help="also write the measurements to this file")
    arguments = parser.parse_args(argv)
    if arguments.min_bytes < ROW_BYTES or arguments.min_bytes % ROW_BYTES:
        parser.error(f"--min-bytes: must be a positive multiple of {ROW_BYTES} (one bf16 row of {HIDDEN})")
    return arguments


# --- what each rank runs --------------------------------------------------------------------

def operations(shard, groups):
    """name -> f(tensor) summing ``tensor`` over the ranks in place by that algorithm."""
    from tandem.kernels.one_shot_allreduce import one_shot_all_reduce

    peer = shard.peer

    def ours(tensor):
        return one_shot_all_reduce(tensor, buffer_pointers=peer.one_shot.buffer_pointers,
                                   signal_pointers=peer.one_shot.signal_pointers, rank=shard.rank,
                                   world_size=shard.size, slot_bytes=peer.slot_bytes)

    def torch_one_shot(tensor):  # staged in the two-shot buffer: torch's kernels own that one's signal pad
        staged = peer.two_shot.view(tensor)
        staged.copy_(tensor)
        return torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", peer.group_name, tensor)

    def two_shot(tensor):
        staged = peer.two_shot.view(tensor)
        staged.copy_(tensor)
        return torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", peer.group_name, tensor)

    def nccl(tensor):
        groups.tensor.allreduce([tensor]).wait()
        return tensor

    return {"one-shot": ours, "torch 1-shot": torch_one_shot, "two-shot": two_shot, "nccl": nccl}


def time_eager(function, iterations: int, device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        function()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1000 / iterations


def time_graph(function, iterations: int, device) -> float:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        function()  # warm-up: compiles outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iterations):
            function()
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1000 / iterations


def measure(function, arguments, device, groups) -> dict:
    """{"eager": µs, "graph": µs}, each the median of ``--trials``; the ranks start each
    timing together (a control-group barrier)."""
    result = {}
    for mode, timer in (("eager", time_eager), ("graph", time_graph)):
        function()
        torch.cuda.synchronize(device)
        samples = []
        for _ in range(arguments.trials):
            groups.control.allreduce([torch.zeros(1)]).wait()
            samples.append(timer(function, arguments.iterations, device))
        result[mode] = statistics.median(samples)
    return result


def rank_main(rank: int, arguments, ports, results) -> None:
    from tandem.kernels.norm import rms_norm
    from tandem.parallel.group import join, open_store

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    size = arguments.ranks
    # Peer buffers big enough for every size measured (the engine's defaults are far smaller).
    os.environ.update({"TANDEM_ALLREDUCE_ONE_SHOT_MAX_BYTES": str(arguments.max_bytes),
                       "TANDEM_ALLREDUCE_TWO_SHOT_MAX_BYTES": str(arguments.max_bytes + 16),
                       "TANDEM_ALLREDUCE_FUSED_MAX_BYTES": str(max(FUSED_ROWS) * ROW_BYTES)})
    if rank == 0:
        store, port = open_store(size)
        for _ in range(size - 1):
            ports.put(port)
        groups = join(0, size, device, store=store)
    else:
        groups = join(rank, size, device, port=ports.get(timeout=120))
    shard = groups.shard
    if shard.peer is None:
        raise SystemExit("the peer all-reduce did not start (see the log): nothing to compare")
    shard.create_communicator(device)
    table = {"sizes": {}, "fused": {}}
    paths = operations(shard, groups)
    for message in sizes_between(arguments.min_bytes, arguments.max_bytes):
        tensor = torch.randn(message // ROW_BYTES, HIDDEN, device=device).to(DTYPE) * 1e-3
        row = {}
        for name, function in paths.items():
            if name in ("two-shot", "torch 1-shot") and shard.peer.two_shot is None:
                continue
            row[name] = measure(lambda: function(tensor), arguments, device, groups)
        table["sizes"][message] = row
    weight = torch.ones(HIDDEN, dtype=DTYPE, device=device)
    for rows in FUSED_ROWS:
        partial = torch.randn(rows, HIDDEN, device=device).to(DTYPE) * 1e-3
        residual = torch.randn(rows, HIDDEN, device=device).to(DTYPE)
        best = paths["one-shot"] if rows * ROW_BYTES <= arguments.max_bytes else paths["nccl"]
        table["fused"][rows] = {
            "fused": measure(lambda: shard.reduce_add_norm(partial, residual, weight, 1e-5), arguments, device, groups),
            "one-shot + norm": measure(lambda: rms_norm(best(partial), weight, 1e-5, residual=residual),
                                       arguments, device, groups),
            "nccl + norm": measure(lambda: rms_norm(paths["nccl"](partial), weight, 1e-5, residual=residual),
                                   arguments, device, groups)}
    if rank == 0:
        results.put(table)


def rank_entry(rank: int, arguments, ports, results, errors) -> None:
    try:
        rank_main(rank, arguments, ports, results)
    except BaseException:  # noqa: BLE001 - reported by the parent
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


# --- the report -----------------------------------------------------------------------------

def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def leading_run(sizes: list[int], winners: dict, names: tuple[str, ...]) -> int:
    """The largest size of the leading run of sizes whose winner is in ``names`` (0: none)."""
    limit = 0
    for size in sizes:
        if winners[size] not in names:
            break
        limit = size
    return limit


def choose_limits(table: dict) -> dict:
    """The environment the measured crossovers give, from graph times: one-shot up to the end
    of its leading run of wins, then two-shot while it beats NCCL, and the fused kernel while it
    beats the best unfused pair."""
    sizes = sorted(table["sizes"])
    winners, two_shot_winners = {}, {}
    for size, row in table["sizes"].items():
        engine_paths = [name for name in row if name != "torch 1-shot"]  # the engine does not run torch's 1-shot
        winners[size] = min(engine_paths, key=lambda name: row[name]["graph"])
        two_shot_winners[size] = min([name for name in engine_paths if name != "one-shot"],
                                     key=lambda name: row[name]["graph"])
    one_shot = leading_run(sizes, winners, ("one-shot",))
    rest = [size for size in sizes if size > one_shot]
    two_shot = max(one_shot, leading_run(rest, two_shot_winners, ("two-shot",)))
    fused_rows = 0
    for rows, row in sorted(table["fused"].items()):
        if row["fused"]["graph"] > min(row["one-shot + norm"]["graph"], row["nccl + norm"]["graph"]):
            break
        fused_rows = rows
    return {"TANDEM_ALLREDUCE_ONE_SHOT_MAX_BYTES": one_shot, "TANDEM_ALLREDUCE_TWO_SHOT_MAX_BYTES": two_shot,
            "TANDEM_ALLREDUCE_FUSED_MAX_BYTES": fused_rows * ROW_BYTES}


def print_report(table: dict, arguments) -> None:
    device = torch.cuda.get_device_name(0)
    print(f"all-reduce, {arguments.ranks} x {device}, bf16 rows of {HIDDEN}; µs per call, rank 0, "
          f"median of {arguments.trials} x {arguments.iterations} calls")
    for mode in ("eager", "graph"):
        print(f"\n{mode}:")
        print(f"{'size':>8} {'rows':>6} " + " ".join(f"{name:>13}" for name in ALGORITHMS) + "   fastest")
        for size, row in sorted(table["sizes"].items()):
            cells = " ".join(f"{row[name][mode]:13.1f}" if name in row else f"{'-':>13}" for name in ALGORITHMS)
            fastest = min(row, key=lambda name: row[name][mode])
            speedup = row["nccl"][mode] / row[fastest][mode]
            print(f"{human(size):>8} {size // ROW_BYTES:>6} {cells}   {fastest} ({speedup:.2f}x NCCL)")
    print("\nreduce + residual add + RMSNorm (graph, µs):")
    print(f"{'rows':>6} {'fused':>10} {'1-shot+norm':>12} {'nccl+norm':>10}")
    for rows, row in sorted(table["fused"].items()):
        print(f"{rows:>6} {row['fused']['graph']:10.1f} {row['one-shot + norm']['graph']:12.1f} "
              f"{row['nccl + norm']['graph']:10.1f}")
    print("\nlimits these measurements choose (set them in the environment of `tandem serve`):")
    for name, value in choose_limits(table).items():
        print(f"  {name}={value}  ({human(value) if value else 'off'})")


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    if torch.cuda.device_count() < arguments.ranks:
        raise SystemExit(f"--ranks {arguments.ranks}: only {torch.cuda.device_count()} CUDA devices")
    context = torch.multiprocessing.get_context("spawn")
    ports, results, errors = context.Queue(), context.Queue(), context.Queue()
    ranks = [context.Process(target=rank_entry, args=(rank, arguments, ports, results, errors))
             for rank in range(arguments.ranks)]
    for process in ranks:
        process.start()
    table = None
    while table is None and any(process.is_alive() for process in ranks) and errors.empty():
        try:
            table = results.get(timeout=5)
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting while the ranks run
            pass
    for process in ranks:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    if table is None:
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        raise SystemExit("the ranks failed:\n" + "\n".join(failures))
    print_report(table, arguments)
    if arguments.json:
        Path(arguments.json).write_text(json.dumps({"limits": choose_limits(table), **table}, indent=1))


if __name__ == "__main__":
    main()
