"""Part 1 of ``pd_gpu.py``: the bandwidth of PD's page write between two processes (prefill
and decode devices), per backend, against a plain torch device-to-device copy of the same bytes
timed in the same process. Each process holds the model's real state registry and pools (dummy
weights); the prefill process writes one prompt's pages exactly as the PD path does
(``WritePlanner``, made once per peer as at the handshake: every registry buffer, page runs
coalesced, one write per run and group with page-major pools; the metadata row beside them and
the completion notification in the same write), from the first token known to completion, the
page runs planned before (as the engine plans them beside the last chunk's forward pass). See ``MODES_HELP``
for the rows that say where a write's time goes; the ``sends`` column is the coalesced plan's
count per write (NIXL: descriptors posted; NCCL: point-to-point sends, in one group when more
than one).
"""
from __future__ import annotations

import multiprocessing
import os
import statistics
import time
import traceback

QUEUE_SECONDS = 240
# the NCCL backend forced onto NCCL send/receive between GPUs (the "nccl" rows copy into the
# reader's memory over CUDA IPC): measured beside it, with the same reader
SEND_RECEIVE = "nccl-sendrecv"


def backend_kind(name: str) -> str:
    """The transfer backend a measured name runs (``SEND_RECEIVE`` is the NCCL backend)."""
    return "nccl" if name == SEND_RECEIVE else name


def bandwidth_backends(backends: list[str], device: str) -> list[str]:
    """The backends part 1 measures: those asked for, and NCCL's send/receive path beside its peer
    copies where the legs are GPUs (in host memory both are gloo)."""
    if "nccl" in backends and device.startswith("cuda"):
        return [*backends, SEND_RECEIVE]
    return list(backends)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float = 1e9) -> float:
        return max(0.0, min(cap, self.end - time.monotonic()))


# -- part 1: bandwidth --------------------------------------------------------------------------------------


def metadata_beside_pages(buffer_class, backend: str, device: str):
    """Metadata rows where PD keeps them: beside the pages (so the last write carries both), for
    every backend."""
    return buffer_class(4, device=device)


def decode_worker(arguments: dict, to_prefill, from_prefill) -> None:
    """The decode process: the model's pools on the decode device; for each backend, register
    them (and a scratch buffer the size of the prompt's pages, the target of the one-descriptor
    write), hand the prefill process what it needs, and answer each completion notification."""
    import torch
    from benchmarks.pd import allocate_pages, answer_notifications, build_state

    from tandem.disagg.pd_ranks import page_counts
    from tandem.transfer.backends import create_backend
    from tandem.transfer.descriptors import buffer_addresses, buffer_regions, tensor_region
    from tandem.transfer.metadata import MetadataBuffer

    try:
        core = build_state(arguments["model"], arguments["page_size"], arguments["tokens"], arguments["decode_device"],
                           arguments["dtype"], arguments["kv_cache_layout"])
        tables = allocate_pages(core, "bench#d", arguments["tokens"], False, seed=2)
        regions = buffer_regions(core.registry)
        metadata_of = {name: metadata_beside_pages(MetadataBuffer, name, arguments["decode_device"])
                       for name in arguments["backends"]}
        scratch = torch.zeros(prompt_bytes(core, tables), dtype=torch.uint8, device=arguments["decode_device"])
    except Exception:  # noqa: BLE001
        to_prefill.put(("error", traceback.format_exc()))
        return
    for name in arguments["backends"]:
        try:
            backend = create_backend(backend_kind(name), f"bench-decode-{name}-{os.getpid()}")
            metadata = metadata_of[name]
            backend.register(regions + [tensor_region(metadata.tensor), tensor_region(scratch)])
            to_prefill.put(("ready", backend.local_metadata(), buffer_addresses(core.registry), regions[0].device,
                            metadata.address(0), tables, scratch.data_ptr(), page_counts(core.registry),
                            [metadata.address(0), metadata.row_bytes, metadata.num_rows]))
        except Exception:  # noqa: BLE001
            to_prefill.put(("error", traceback.format_exc()))
            continue
        # without pause: NIXL completes a notified write only once the reader progressed (the
        # notification's receipt), so the reader's polling would count as transfer time
        answer_notifications(backend, from_prefill, to_prefill, "next", interval=0)
        backend.close()


def prompt_bytes(core, tables: list[list[int]]) -> int:
    """Bytes of the prompt's pages in every registry buffer (what the PD write moves)."""
    from tandem.transfer.descriptors import plan_page_writes

    return plan_page_writes(core.registry, [0] * len(list(core.registry.buffers())),
                            [list(zip(table, table)) for table in tables]).num_bytes


def device_copy_seconds(num_bytes: int, source_device: str, destination_device: str, rounds: int) -> float:
    """Median seconds of one plain torch copy of ``num_bytes`` between the two devices."""
    import torch

    source = torch.ones(num_bytes, dtype=torch.uint8, device=source_device)
    destination = torch.empty(num_bytes, dtype=torch.uint8, device=destination_device)

    def synchronize() -> None:
        for device in {source.device, destination.device}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    times = []
    for _ in range(rounds + 1):
        synchronize()
        started = time.perf_counter()
        destination.copy_(source, non_blocking=True)
        synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


# what part 1 measures per backend: label suffix -> how the bytes go (see MODES_HELP)
MODES = {"": "pd", "row staged": "pd, row staged", "2 writes": "two writes", "pages": "pages",
         "pages+row": "pages and row", "pages+notif": "pages and notification", "pages x4": "pages in four writes",
         "1 desc": "one descriptor"}
MODES_HELP = """rows of part 1, per backend (nccl between GPUs: peer copies over CUDA IPC; nccl-sendrecv: the
same backend on NCCL send/receive, its default until peer copies are measured):
  BACKEND         the PD write as the engine does it: plan the page runs and fill the metadata row
                  (its first token copied in on the device) before the clock, as the engine does when
                  it launches the step that samples the first token; ONE write of the runs and the
                  row, with the completion notification; wait; the decode process saw it
  BACKEND row staged  the same with the row filled on the clock, once the first token is known (the
                  engine's way for requests asking logprobs, or with a draft model's hidden state)
  BACKEND 2 writes  the same as two writes (the engine's way before): the page runs, wait; the row
                  with the notification, wait
  BACKEND pages   the page write alone (planned, posted, waited for): no row, no notification
  BACKEND pages+row  the pages and the metadata row as one write, no notification
  BACKEND pages+notif  the pages with the completion notification, no row (with "pages" and
                  "pages+row": what the row and the notification each add to the PD write)
  BACKEND pages x4  the same runs as four writes posted at once, then waited for (does having
                  several requests in flight help?)
  BACKEND 1 desc  the same bytes as ONE descriptor between two scratch buffers (what the link gives
                  a single large write of this backend; no planning, no notification)
  nixl described  the PD write with NIXL's lists prepared at pairing dropped: every write described
                  afresh (initialize_xfer), as before they were prepared
  nccl-sendrecv D/S  the PD write with the NCCL backend's segmenting set to DIRECT/STAGING MiB (runs of
                  >= DIRECT MiB sent in place, shorter ones gathered into pipelined STAGING MiB sends;
                  a write of at most four runs, every page-major one, goes in place whatever they are)
columns: descs = descriptors after merging those that continue on both sides; sends = what the
backend posts for them per write (NIXL: descriptors; NCCL peer copies: copies; NCCL send/receive:
sends, one group when several);
PD ms = what the engine leaves on the last write's path, from the moment the first token is known
until the write is DONE (its MiB over it: PD GB/s): posting, waiting (and staging the metadata
row, in "row staged"). The page runs are planned and the row filled before the clock starts, as
the engine does when the last chunk is launched, beside its forward pass: prepare ms (not in PD
ms). stage ms = filling the metadata row on the clock and queueing its copy to the device (the
write waits for that copy: on the device with the NCCL backend, on the host before posting with
NIXL); post ms = the backend's write() calls (NCCL
peer copies: the copies are posted in it); wait ms = polling until DONE (post and wait summed
over a row's writes); row ms = the separate metadata-row write alone (post + wait), where there
is one.
The lines printed while measuring add, for NCCL, the writer's steps (ms, summed over a row's
writes): queued (write() call to its copies or sends being taken up: the link's thread for
send/receive; with peer copies, in write() itself), header (control frame sent; none with peer
copies), posting (every gather/send, or every copy and its event, posted), draining
(send/receive: host waits for the sends, in host memory only; peer copies: until a look at the
copies' event found it complete), ack (send/receive: the reader's acknowledgement, its receives
and scatters done; peer copies: the frame carrying the notification sent); for NIXL, NIXL's own
telemetry of the row's writes: post (inside postXferReq), transfer (post to completion seen by a
poll)"""


def measure_backend(name: str, core, sources: list[list[int]], metadata, message, rounds: int, deadline: Deadline,
                    to_prefill, from_prefill, variants: tuple = ()) -> dict[str, dict]:
    """Each of ``MODES`` on one pair, median of ``rounds`` after a warm one, timed from the first
    token known (the pages planned already) until every write of it is DONE (the bytes landed:
    ``one_round``); a notified write must then
    be seen by the decode process. ``variants`` (NCCL: (direct MiB, staging MiB) pairs) are the PD
    write again with the writer's segmenting changed (it travels in each write's header)."""
    import torch

    from tandem.transfer.byte_views import plan_segments
    from tandem.transfer.backends import create_backend
    from tandem.transfer.connector import WriteStatus
    from tandem.transfer.descriptors import WritePlanner, buffer_regions, merge_adjacent, tensor_region
    from tandem.transfer.messages import done_notification, new_room
    from tandem.transfer.metadata import MetadataRow

    from tandem.disagg.pd_ranks import block_runs
    from tandem.transfer.messages import RankAgent

    (_, peer_metadata, remote_addresses, remote_device, remote_rows, remote_tables, remote_scratch, remote_pages,
     remote_row_geometry) = message
    backend = create_backend(backend_kind(name), f"bench-prefill-{name}-{os.getpid()}", telemetry=True)
    if backend_kind(name) == "nccl":
        backend.peer_copies = name != SEND_RECEIVE  # (read when the pair forms: add_peer below)
    try:
        regions = buffer_regions(core.registry)
        pairs = [list(zip(source, target)) for source, target in zip(sources, remote_tables)]
        planner = WritePlanner(core.registry, remote_addresses)  # as the prefill side makes it at the handshake
        scratch = torch.ones(planner.plan(pairs).num_bytes, dtype=torch.uint8, device=sources_device(core))
        backend.register(regions + [tensor_region(metadata.tensor), tensor_region(scratch)])
        peer = backend.add_peer(peer_metadata)
        local_device = regions[0].device
        # as at a PD handshake (``RankTransfers.add_peer``): NIXL prepares the page blocks and rows
        remote_agent = RankAgent(peer_metadata, remote_addresses, remote_device, 0, remote_pages, remote_row_geometry)
        local_rows = [metadata.address(0), metadata.row_bytes, metadata.num_rows]
        first_token = torch.ones(1, dtype=torch.int64, device=metadata.tensor.device)  # (the sampler's output)
        backend.prepare(peer, block_runs(core.registry, planner, remote_agent, local_rows), local_device, remote_device)

        def wait(handle, times: dict) -> None:
            while backend.poll(handle) is WriteStatus.PENDING:
                if not deadline.left():
                    raise TimeoutError("deadline passed while a write was pending")
                time.sleep(0)  # let the backend's threads have the interpreter (the NCCL backend's do the work)
            if handle.status is not WriteStatus.DONE:
                raise RuntimeError(f"write failed: {handle.error}")
            if hasattr(backend, "write_telemetry"):
                try:
                    for key, value in backend.write_telemetry(handle).items():
                        times[f"nixl {key}"] = times.get(f"nixl {key}", 0) + value
                except Exception:  # noqa: BLE001 - a NIXL without telemetry: the row goes without
                    pass
            backend.release(handle)

        def timed_write(descriptors, times: dict, notification: bytes = b"", ready=None) -> float:
            started = time.perf_counter()
            handle = backend.write(peer, descriptors, local_device=local_device, remote_device=remote_device,
                                   notification=notification, ready=ready)
            posted = time.perf_counter()
            wait(handle, times)
            times["post"] += posted - started
            times["wait"] += time.perf_counter() - posted
            marks = getattr(handle.native, "timings", None)  # the NCCL link thread's own clock marks
            if marks and "acknowledged" in marks:
                points = [started, marks["taken"], marks["header"], marks["posted"], marks["drained"],
                          marks["acknowledged"]]
                for key, begin, end in zip(THREAD_STEPS, points, points[1:]):
                    times[key] = times.get(key, 0.0) + end - begin
            return time.perf_counter() - started

        def sends(merged: list) -> int:
            """What the backend posts for a write of ``merged`` descriptors (NIXL: descriptors; NCCL
            between GPUs: one copy per run; NCCL send/receive: its segments)."""
            if name != SEND_RECEIVE and not (name == "nccl" and local_device < 0):
                return len(merged)
            return len(plan_segments([length for _, _, length in merged], backend.direct_bytes,
                                     backend.staging_bytes))

        def one_round(mode: str) -> dict:
            """One write of ``mode``. The clock starts where the engine's last write starts: the
            first token is known. The page runs are planned and the metadata row filled before it
            (``prepare``: the engine does both when the last chunk is launched, beside its forward
            pass, the row's first token copied in on the device after the sampler); in "pd, row
            staged" the row is filled on the clock (``stage``), as for a request asking logprobs.
            The row's copies are waited for by the write itself (``ready``: on the device by NCCL,
            on the host by NIXL)."""
            times = {"prepare": 0.0, "stage": 0.0, "post": 0.0, "wait": 0.0, "row": 0.0}
            prepared_before = getattr(backend, "prepared_writes", 0)
            preparing = time.perf_counter()
            if mode == "one descriptor":
                descriptors = [(scratch.data_ptr(), remote_scratch, scratch.numel())]
            else:
                descriptors = planner.plan(pairs).descriptors
                times["prepare"] = time.perf_counter() - preparing
            notified = mode in ("pd", "pd, row staged", "two writes", "pages and notification")
            with_row = mode in ("pd", "pd, row staged", "two writes", "pages and row")
            room, staged, pages = new_room(), None, descriptors
            row = (metadata.address(0), remote_rows, metadata.row_bytes)
            if with_row and mode != "pd, row staged":
                filling = time.perf_counter()
                staged = metadata.prepare(0, MetadataRow(room=room, first_token=0), first_token)
                times["prepare"] += time.perf_counter() - filling
            started = time.perf_counter()
            if mode == "pd, row staged":
                staged = metadata.stage(0, MetadataRow(room=room, first_token=1))
                times["stage"] = time.perf_counter() - started
            if mode in ("pd", "pd, row staged", "pages and row"):
                descriptors = descriptors + [row]
            if mode == "two writes":
                timed_write(descriptors, times)
                times["row"] = timed_write([row], times, done_notification(room), staged)
            elif mode == "pages in four writes":
                quarter = -(-len(descriptors) // 4)
                posting = time.perf_counter()
                handles = [backend.write(peer, descriptors[first:first + quarter], local_device=local_device,
                                         remote_device=remote_device) for first in range(0, len(descriptors), quarter)]
                posted_at = time.perf_counter()
                for handle in handles:
                    wait(handle, times)
                times["post"], times["wait"] = posted_at - posting, time.perf_counter() - posted_at
            else:
                timed_write(descriptors, times, done_notification(room) if notified else b"", staged)
            seconds = time.perf_counter() - started  # both backends report DONE once the bytes landed
            prepared = getattr(backend, "prepared_writes", 0) - prepared_before
            if notified:
                from_prefill.put("go")
                if to_prefill.get(timeout=deadline.left(60)) != "seen":
                    raise RuntimeError("the decode process did not see the notification")
            merged = merge_adjacent(descriptors)  # (counted off the clock)
            count, num_bytes, posted = len(merged), sum(length for _, _, length in descriptors), sends(merged)
            if mode == "two writes":
                count, num_bytes, posted = count + 1, num_bytes + metadata.row_bytes, posted + 1
            elif mode == "pages in four writes":
                posted = sum(sends(merge_adjacent(pages[first:first + quarter]))
                             for first in range(0, len(pages), quarter))
            return {"seconds": seconds, "bytes": num_bytes, "descriptors": count, "sends": posted,
                    "prepared": prepared, **times}

        measured = {}
        runs = [(f"{name} {suffix}".strip(), mode, None) for suffix, mode in MODES.items()]
        runs += [(f"{name} {d:g}/{s:g}", "pd", (d, s)) for d, s in variants]
        if name == "nixl":  # last: the PD write with NIXL's prepared lists dropped (described afresh, as before)
            runs.append(("nixl described", "pd", "described"))
        for label, mode, segmenting in runs:
            if segmenting == "described":
                backend.prepare(peer, [])  # (drops the lists prepared at pairing)
            elif segmenting is not None:
                backend.direct_bytes, backend.staging_bytes = int(segmenting[0] * 2**20), int(segmenting[1] * 2**20)
            try:
                one_round(mode)  # the first write (connection set up at pairing, staging allocated)
                results = [one_round(mode) for _ in range(rounds)]
                measured[label] = {key: statistics.median(r[key] for r in results) for key in results[0]}
                # (every round moves the same bytes; a median of an even count would be a float)
                measured[label].update(bytes=results[0]["bytes"], descriptors=results[0]["descriptors"],
                                       sends=results[0]["sends"], prepared=results[0]["prepared"])
            except Exception as error:  # noqa: BLE001 - a mode that fails ends the pair
                measured[label] = {"error": f"{type(error).__name__}: {error}"}
                break
        return measured
    finally:
        backend.close()


def sources_device(core) -> str:
    """Where the prefill process's pools are (the scratch source of the one-descriptor write)."""
    return str(next(core.registry.buffers()).tensor.device)


def run_bandwidth(arguments, deadline: Deadline) -> dict[str, dict]:
    """backend -> {seconds, bytes, descriptors, copy_seconds} or {error}."""
    from benchmarks.pd import allocate_pages, build_state

    from tandem.transfer.metadata import MetadataBuffer

    context = multiprocessing.get_context("spawn")
    to_prefill, from_prefill = context.Queue(), context.Queue()
    names = bandwidth_backends(arguments.backends, arguments.prefill_device)
    worker_arguments = dict(model=arguments.model, page_size=arguments.page_size, tokens=arguments.input_len,
                            decode_device=arguments.decode_device, dtype=arguments.dtype,
                            backends=names, kv_cache_layout=arguments.kv_cache_layout)
    worker = context.Process(target=decode_worker, args=(worker_arguments, to_prefill, from_prefill), daemon=True)
    worker.start()
    results: dict[str, dict] = {}
    core = None
    try:
        core = build_state(arguments.model, arguments.page_size, arguments.input_len, arguments.prefill_device,
                           arguments.dtype, arguments.kv_cache_layout)
        sources = allocate_pages(core, "bench#p", arguments.input_len, False, seed=1)
        metadata_of = {name: metadata_beside_pages(MetadataBuffer, name, arguments.prefill_device)
                       for name in names}
        for name in names:
            metadata = metadata_of[name]
            try:
                message = to_prefill.get(timeout=deadline.left(QUEUE_SECONDS))
                if message[0] == "error":
                    raise RuntimeError(f"decode process: {message[1].strip().splitlines()[-1]}")
                variants = arguments.nccl_variants if name == (SEND_RECEIVE if SEND_RECEIVE in names else "nccl") else ()
                measured = measure_backend(name, core, sources, metadata, message, arguments.rounds, deadline,
                                           to_prefill, from_prefill, variants)
                for label, result in measured.items():
                    if "error" not in result:
                        result["copy_seconds"] = device_copy_seconds(result["bytes"], arguments.prefill_device,
                                                                     arguments.decode_device, arguments.rounds)
                    results[label] = result
            except Exception as error:  # noqa: BLE001 - report it, go on with the next backend
                results[name] = {"error": f"{type(error).__name__}: {error}"}
                traceback.print_exc()
            finally:
                from_prefill.put("next")
            for label in [label for label in results if label.split()[0] == name]:
                print(f"   bandwidth {label}: {describe_bandwidth(results[label])}", flush=True)
    except Exception as error:  # noqa: BLE001
        for name in names:
            results.setdefault(name, {"error": f"{type(error).__name__}: {error}"})
        traceback.print_exc()
    finally:
        worker.join(min(30, deadline.left(30)))
        if worker.is_alive():
            worker.kill()
        if core is not None:
            core.shutdown()
    return results


def free_device_memory() -> None:
    """Give part 1's engine memory back before the servers start on the same GPUs."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


THREAD_STEPS = ("queued", "header", "posting", "draining", "ack")  # the NCCL writer thread's steps
TIMED_STEPS = ("prepare", "stage", "post", "wait", "row")  # the steps of a measured row (MODES_HELP)


def describe_bandwidth(result: dict) -> str:
    if "error" in result:
        return f"failed: {result['error']}"
    rate, copy_rate = result["bytes"] / result["seconds"] / 1e9, result["bytes"] / result["copy_seconds"] / 1e9
    split = ", ".join(f"{key} {result[key] * 1e3:.3f}" for key in TIMED_STEPS if result.get(key))
    if result.get("prepared"):
        split += f"; {result['prepared']:g} of its writes from NIXL's prepared lists"
    if "nixl post" in result:
        split += (f"; NIXL's own: post {result['nixl post'] * 1e3:.3f}, transfer {result['nixl transfer'] * 1e3:.3f}"
                  f" ({result['nixl descriptors']:g} descriptors after its merging)")
    if any(key in result for key in THREAD_STEPS):
        split += "; NCCL writer thread: " + ", ".join(f"{key} {result.get(key, 0) * 1e3:.3f}" for key in THREAD_STEPS)
    return (f"{result['bytes'] / 2**20:.1f} MiB in {result['descriptors']} descriptors ({result['sends']} sends), "
            f"{result['seconds'] * 1e3:.3f} ms"
            f" = {rate:.1f} GB/s; torch copy {copy_rate:.1f} GB/s; fraction {rate / copy_rate:.2f} (ms: {split})")
