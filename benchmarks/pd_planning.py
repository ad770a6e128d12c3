"""The host-side steps of a PD write, timed alone: planning a prompt's page runs, filling the
metadata row, and posting the write to NIXL (no model, no second process: the state registry of a
model shape, its pools on ``--device``, and two NIXL agents of this process).

    python -m benchmarks.pd_planning                          # Llama-3.1-8B's K/V, 2,048 tokens, CPU
    python -m benchmarks.pd_planning --device cuda:0          # the row written to device memory

Rows (median microseconds over ``--rounds``): ``plan`` (``WritePlanner.plan`` of the whole prompt:
the benchmark's worst case; the engine plans each chunk as its pages become final), ``plan chunk``
(one ``--chunk-tokens`` chunk), ``row`` (``MetadataBuffer.write``: on a GPU, until the row is on
the device), ``row staged`` (``MetadataBuffer.stage``, as the engine's last write does it: on a
GPU, the row's copy queued and not waited for), ``merge`` (``merge_adjacent`` of the last write's runs and row), ``nixl post``
(``NixlBackend.write`` of a chunk's run of blocks and a metadata row, described afresh or from the
lists prepared at pairing, ``block_index.py``; blocks of 64 bytes, so that the post's own cost
shows: see ``nixl_post_microseconds``), ``nccl post`` / ``nccl posted`` / ``nccl landed`` (the NCCL
backend's ``write`` call; until its copies or sends were issued; until it was DONE: see
``nccl_post_microseconds``).

What the engine leaves on the last write's path, once the prompt's first token is known:
``row staged`` + the backend's post (its pages were planned, and merged, when the last chunk was
launched: ``plan chunk`` + ``merge`` run beside the forward pass).
"""
from __future__ import annotations

import argparse
import statistics
import time

SHAPES = {"llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128),
          "qwen3-0.6b": dict(num_layers=28, num_kv_heads=8, head_dim=128)}


def build_registry(shape: str, page_size: int, tokens: int, device: str):
    """A page-major registry of ``shape``'s full-attention K/V (bf16) with room for two prompts."""
    import torch

    from tandem.kv.planner import allocate_buffers, plan_pools
    from tandem.kv.registry import StateRegistry
    from tandem.kv.spec import FullAttentionSpec

    options = SHAPES[shape]
    registry = StateRegistry()
    spec = FullAttentionSpec(num_kv_heads=options["num_kv_heads"], head_dim=options["head_dim"], dtype=torch.bfloat16)
    for layer in range(options["num_layers"]):
        registry.register(f"layers.{layer}", spec)
    registry.finalize()
    plan = plan_pools(registry, page_size, max_total_tokens=2 * tokens + 4 * page_size, memory_budget_bytes=None,
                      max_num_seqs=4, layout="page-major")
    allocate_buffers(registry, plan, torch.device(device), "page-major")
    return registry


def median_microseconds(step, rounds: int) -> float:
    for _ in range(min(rounds, 50)):
        step()
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        step()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def staged_row_microseconds(rows, row, rounds: int) -> float:
    """``MetadataBuffer.stage`` alone: the row filled and its copy to the device queued, not waited
    for (each copy waited for afterwards, untimed: the engine's row was copied long before)."""
    samples = []
    for round_number in range(rounds + 10):
        started = time.perf_counter()
        staged = rows.stage(0, row)
        samples.append(time.perf_counter() - started)
        if staged is not None:
            staged.synchronize()
    return statistics.median(samples[10:]) * 1e6


def nixl_post_microseconds(block_count: int, blocks_per_write: int, rounds: int, prepared: bool) -> float:
    """``NixlBackend.write`` alone (each write waited for afterwards, untimed), host memory to host
    memory, of one run of ``blocks_per_write`` blocks and a metadata row, as a PD page write's
    last write is: blocks of 64 bytes (NIXL's shared memory copies while posting: real pages'
    bytes would hide what describing the write costs); ``prepared``: from descriptor lists
    prepared once (as at a PD handshake), else described afresh."""
    import torch

    from tandem.transfer.backends import create_backend
    from tandem.transfer.block_index import BlockRuns, Blocks
    from tandem.transfer.connector import WriteStatus
    from tandem.transfer.descriptors import tensor_region

    block = 64
    pages = torch.zeros(block_count * block, dtype=torch.uint8)
    target = torch.zeros(block_count * block, dtype=torch.uint8)
    rows, target_rows = torch.zeros(4 * block, dtype=torch.uint8), torch.zeros(4 * block, dtype=torch.uint8)
    writer, reader = create_backend("nixl", "plan-writer"), create_backend("nixl", "plan-reader")
    try:
        writer.register([tensor_region(pages), tensor_region(rows)])
        reader.register([tensor_region(target), tensor_region(target_rows)])
        peer = writer.add_peer(reader.local_metadata())
        if prepared:
            writer.prepare(peer, [BlockRuns(Blocks(pages.data_ptr(), block, block, block_count),
                                            Blocks(target.data_ptr(), block, block, block_count)),
                                  BlockRuns(Blocks(rows.data_ptr(), block, block, 4),
                                            Blocks(target_rows.data_ptr(), block, block, 4))])
        descriptors = [(pages.data_ptr() + 3 * block, target.data_ptr() + 7 * block, blocks_per_write * block),
                       (rows.data_ptr(), target_rows.data_ptr() + block, block)]
        samples = []
        for round_number in range(rounds + 10):
            started = time.perf_counter()
            handle = writer.write(peer, descriptors, notification=b"done")
            posted = time.perf_counter() - started
            while writer.poll(handle) is WriteStatus.PENDING:
                reader.notifications()
            if handle.status is not WriteStatus.DONE:
                raise RuntimeError(f"NIXL write failed: {handle.error}")
            writer.release(handle)
            reader.notifications()
            if round_number >= 10:
                samples.append(posted)
        if prepared and writer.prepared_writes != rounds + 10:
            raise RuntimeError("the writes did not come from the prepared lists")
        return statistics.median(samples) * 1e6
    finally:
        writer.close()
        reader.close()


def nccl_post_microseconds(device: str, block_count: int, blocks_per_write: int, rounds: int) -> dict[str, float]:
    """The NCCL backend's part of a PD last write (a run of ``blocks_per_write`` 64-byte blocks and a
    metadata row, with a notification), writer and reader in this process on ``device`` (host
    memory: gloo send/receive; a GPU: peer copies, the reader's memory used as it is): ``nccl
    post`` is the ``write`` call; ``nccl posted`` from that call until the write's copies (sends)
    were issued, the link's own clock mark; ``nccl landed`` until the write is DONE (its copies
    completed and the notification sent; sends: acknowledged)."""
    import torch

    from tandem.transfer.backends import create_backend
    from tandem.transfer.connector import WriteStatus
    from tandem.transfer.descriptors import tensor_region

    block = 64
    pages = torch.zeros(block_count * block, dtype=torch.uint8, device=device)
    target = torch.zeros(block_count * block, dtype=torch.uint8, device=device)
    rows, target_rows = (torch.zeros(4 * block, dtype=torch.uint8, device=device) for _ in range(2))
    writer, reader = create_backend("nccl", "plan-writer"), create_backend("nccl", "plan-reader")
    samples: dict[str, list[float]] = {"nccl post": [], "nccl posted": [], "nccl landed": []}
    try:
        writer.register([tensor_region(pages), tensor_region(rows)])
        reader.register([tensor_region(target), tensor_region(target_rows)])
        peer = writer.add_peer(reader.local_metadata())
        descriptors = [(pages.data_ptr() + 3 * block, target.data_ptr() + 7 * block, blocks_per_write * block),
                       (rows.data_ptr(), target_rows.data_ptr() + block, block)]
        for round_number in range(rounds + 10):
            started = time.perf_counter()
            handle = writer.write(peer, descriptors, notification=b"done")
            returned = time.perf_counter()
            while writer.poll(handle) is WriteStatus.PENDING:
                time.sleep(0)
            landed = time.perf_counter()
            if handle.status is not WriteStatus.DONE:
                raise RuntimeError(f"NCCL write failed: {handle.error}")
            marks = handle.native.timings
            writer.release(handle)
            while not reader.notifications():
                time.sleep(0)
            if round_number >= 10:
                samples["nccl post"].append(returned - started)
                samples["nccl posted"].append(marks["posted"] - started)
                samples["nccl landed"].append(landed - started)
        return {name: statistics.median(values) * 1e6 for name, values in samples.items()}
    finally:
        writer.close()
        reader.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--skip-nixl", action="store_true")
    parser.add_argument("--skip-nccl", action="store_true")
    arguments = parser.parse_args(argv)

    from tandem.transfer.descriptors import WritePlanner, buffer_addresses, merge_adjacent
    from tandem.transfer.messages import new_room
    from tandem.transfer.metadata import MetadataBuffer, MetadataRow

    registry = build_registry(arguments.shape, arguments.page_size, arguments.tokens, arguments.device)
    pages = arguments.tokens // arguments.page_size
    half = pages + 2  # the destination pages: the pool's second half (a different run on each side)
    remote = buffer_addresses(registry)
    planner = WritePlanner(registry, remote)
    prompt = [[(1 + page, half + page) for page in range(pages)]]
    chunk = [prompt[0][-(arguments.chunk_tokens // arguments.page_size):]]
    rows = MetadataBuffer(4, device=arguments.device)
    room = new_room()
    row = MetadataRow(room=room, first_token=1, logprob_token_ids=(1,), logprobs=(-0.5,), rank=1)
    last = planner.plan(chunk).descriptors + [(rows.address(0), rows.address(1), rows.row_bytes)]
    measured = {
        "plan": median_microseconds(lambda: planner.plan(prompt), arguments.rounds),
        "plan chunk": median_microseconds(lambda: planner.plan(chunk), arguments.rounds),
        "row": median_microseconds(lambda: rows.write(0, row), arguments.rounds),
        "row staged": staged_row_microseconds(rows, row, arguments.rounds),
        "merge": median_microseconds(lambda: merge_adjacent(last), arguments.rounds),
    }
    if not arguments.skip_nixl and arguments.device == "cpu":
        rounds, blocks = min(arguments.rounds, 300), arguments.chunk_tokens // arguments.page_size
        for prepared in (False, True):
            name = f"nixl post {'prepared' if prepared else 'described'}"
            measured[name] = nixl_post_microseconds(2 * pages + 8, blocks, rounds, prepared)
    if not arguments.skip_nccl:
        rounds, blocks = min(arguments.rounds, 300), arguments.chunk_tokens // arguments.page_size
        measured.update(nccl_post_microseconds(arguments.device, 2 * pages + 8, blocks, rounds))
    size = planner.plan(prompt).num_bytes
    print(f"{arguments.shape}, {arguments.tokens} tokens ({pages} pages, {size / 2**20:.0f} MiB), "
          f"chunk {arguments.chunk_tokens}, {arguments.device}:")
    for name, microseconds in measured.items():
        print(f"  {name:<21} {microseconds:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
