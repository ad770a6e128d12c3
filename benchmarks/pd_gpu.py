"""PD over GPU memory between two GPUs of one host: prefill on cuda:0, decode on cuda:1, for
each transfer backend (NIXL with VRAM registered; NCCL through torch.distributed).

Part 1, bandwidth: two processes, each with the model's real state registry and pools (dummy
weights) on its GPU. The prefill process writes one prompt's pages exactly as the PD path does
(``plan_page_writes``: every registry buffer, page runs coalesced; the metadata row beside
them and the completion notification in the same write), from planning to completion, and compares it with a plain torch
device-to-device copy of the same bytes between the two GPUs, timed in the same process.

Part 2, serving: a colocated server on cuda:0 and, per backend, ``tandem serve --role prefill``
on cuda:0 + ``--role decode`` on cuda:1 + ``tandem router``, all started at once. Greedy outputs
of the prompt through each PD pair must equal the colocated server's; TTFT (streamed, median)
of PD minus colocated is what disaggregation adds.

Goals (issue 13): bandwidth >= 0.85 of the device-to-device copy; TTFT added <= 5 ms, for a
2,048-token Llama-3.1-8B-shape prompt (256 MiB of KV in bf16). Everything runs under one
deadline (``--deadline``, default 420 s); a backend that fails is reported as such and the
others still run; the table prints whatever was measured.

    python benchmarks/pd_gpu.py                                       # 2 GPUs: llama3-8b, bf16
    python benchmarks/pd_gpu.py --device one-gpu                      # 1 GPU: PD's own TTFT steps, NIXL
    python benchmarks/pd_gpu.py --device cpu --shape micro --input-len 64 --rounds 3   # check on a CPU

On a CPU both "devices" are host memory (NCCL runs over gloo, NIXL over shared memory): the
figures mean nothing there; the steps are the same. Part 1 prints, besides the PD write, rows
that tell where its time goes (the page write alone, the same bytes as one descriptor, and the
split into planning, posting and waiting): see ``MODES_HELP``. Keep both GPUs visible to every process
(no CUDA_VISIBLE_DEVICES split): NCCL and UCX use NVLink between processes only when each sees
both devices.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY_ROOT))
sys.path.insert(0, str(REPOSITORY_ROOT / "benchmarks"))

BACKENDS = ("nixl", "nccl")
QUEUE_SECONDS = 240


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
    from pd import allocate_pages, answer_notifications, build_state

    from tandem.transfer.connector import create_backend
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
            backend = create_backend(name, f"bench-decode-{name}-{os.getpid()}")
            metadata = metadata_of[name]
            backend.register(regions + [tensor_region(metadata.tensor), tensor_region(scratch)])
            to_prefill.put(("ready", backend.local_metadata(), buffer_addresses(core.registry), regions[0].device,
                            metadata.address(0), tables, scratch.data_ptr()))
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
MODES = {"": "pd", "2 writes": "two writes", "pages": "pages", "pages x4": "pages in four writes",
         "1 desc": "one descriptor"}
MODES_HELP = """rows of part 1, per backend:
  BACKEND         the PD write as the engine does it: plan the page runs; ONE write of the runs and
                  the metadata row, with the completion notification; wait; the decode process saw it
  BACKEND 2 writes  the same as two writes (the engine's way before): the page runs, wait; the row
                  with the notification, wait
  BACKEND pages   the page write alone (planned, posted, waited for): no row, no notification
  BACKEND pages x4  the same runs as four writes posted at once, then waited for (does having
                  several requests in flight help?)
  BACKEND 1 desc  the same bytes as ONE descriptor between two scratch buffers (what the link gives
                  a single large write of this backend; no planning, no notification)
  nccl D/S        the PD write with the NCCL backend's segmenting set to DIRECT/STAGING MiB (runs of
                  >= DIRECT MiB sent in place, shorter ones gathered into pipelined STAGING MiB sends)
columns: PD ms = the whole row (its MiB over it: PD GB/s); plan ms = plan_page_writes and filling
the metadata row; post ms = the backend's write() calls; wait ms = polling until DONE (post and
wait summed over a row's writes); row ms = the separate metadata-row write alone (post + wait),
where there is one.
The lines printed while measuring add, for NCCL, the writer thread's steps (ms, summed over a
row's writes): queued (write() call to the thread taking it), header (control frame sent),
posting (every gather/send posted), draining (host waits for the sends), ack (the reader's
acknowledgement: its receives and scatters done); for NIXL, NIXL's own telemetry of the
row's writes: post (inside postXferReq), transfer (post to completion seen by a poll)"""


def measure_backend(name: str, core, sources: list[list[int]], metadata, message, rounds: int, deadline: Deadline,
                    to_prefill, from_prefill, variants: tuple = ()) -> dict[str, dict]:
    """Each of ``MODES`` on one pair, median of ``rounds`` after a warm one, timed from planning
    (or posting) until every write of it is DONE (the bytes landed); a notified write must then
    be seen by the decode process. ``variants`` (NCCL: (direct MiB, staging MiB) pairs) are the PD
    write again with the writer's segmenting changed (it travels in each write's header)."""
    import torch

    from tandem.transfer.connector import WriteStatus, create_backend
    from tandem.transfer.descriptors import buffer_regions, merge_adjacent, plan_page_writes, tensor_region
    from tandem.transfer.messages import done_notification, new_room
    from tandem.transfer.metadata import MetadataRow

    _, peer_metadata, remote_addresses, remote_device, remote_rows, remote_tables, remote_scratch = message
    backend = create_backend(name, f"bench-prefill-{name}-{os.getpid()}", telemetry=True)
    try:
        regions = buffer_regions(core.registry)
        pairs = [list(zip(source, target)) for source, target in zip(sources, remote_tables)]
        scratch = torch.ones(plan_page_writes(core.registry, remote_addresses, pairs).num_bytes, dtype=torch.uint8,
                             device=sources_device(core))
        backend.register(regions + [tensor_region(metadata.tensor), tensor_region(scratch)])
        peer = backend.add_peer(peer_metadata)
        local_device = regions[0].device

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

        def timed_write(descriptors, times: dict, notification: bytes = b"") -> float:
            started = time.perf_counter()
            handle = backend.write(peer, descriptors, local_device=local_device, remote_device=remote_device,
                                   notification=notification)
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

        def one_round(mode: str) -> dict:
            times = {"plan": 0.0, "post": 0.0, "wait": 0.0, "row": 0.0}
            started = time.perf_counter()
            if mode == "one descriptor":
                descriptors = [(scratch.data_ptr(), remote_scratch, scratch.numel())]
            else:
                descriptors = plan_page_writes(core.registry, remote_addresses, pairs).descriptors
            notified = mode in ("pd", "two writes")
            if notified:
                room = new_room()
                metadata.write(0, MetadataRow(room=room, first_token=1))
                row = (metadata.address(0), remote_rows, metadata.row_bytes)
            if mode != "one descriptor":
                times["plan"] = time.perf_counter() - started
            if mode == "pd":
                descriptors = descriptors + [row]
            count, num_bytes = len(merge_adjacent(descriptors)), sum(length for _, _, length in descriptors)
            if mode == "two writes":
                timed_write(descriptors, times)
                times["row"] = timed_write([row], times, done_notification(room))
                count, num_bytes = count + 1, num_bytes + metadata.row_bytes
            elif mode == "pages in four writes":
                quarter = -(-len(descriptors) // 4)
                posting = time.perf_counter()
                handles = [backend.write(peer, descriptors[first:first + quarter], local_device=local_device,
                                         remote_device=remote_device) for first in range(0, len(descriptors), quarter)]
                posted = time.perf_counter()
                for handle in handles:
                    wait(handle, times)
                times["post"], times["wait"] = posted - posting, time.perf_counter() - posted
            else:
                timed_write(descriptors, times, done_notification(room) if notified else b"")
            seconds = time.perf_counter() - started  # both backends report DONE once the bytes landed
            if notified:
                from_prefill.put("go")
                if to_prefill.get(timeout=deadline.left(60)) != "seen":
                    raise RuntimeError("the decode process did not see the notification")
            return {"seconds": seconds, "bytes": num_bytes, "descriptors": count, **times}

        measured = {}
        runs = [(f"{name} {suffix}".strip(), mode, None) for suffix, mode in MODES.items()]
        runs += [(f"{name} {d:g}/{s:g}", "pd", (d, s)) for d, s in variants]
        for label, mode, segmenting in runs:
            if segmenting is not None:
                backend.direct_bytes, backend.staging_bytes = int(segmenting[0] * 2**20), int(segmenting[1] * 2**20)
            try:
                one_round(mode)  # the first write (connection set up at pairing, staging allocated)
                results = [one_round(mode) for _ in range(rounds)]
                measured[label] = {key: statistics.median(r[key] for r in results) for key in results[0]}
                # (every round moves the same bytes; a median of an even count would be a float)
                measured[label].update(bytes=results[0]["bytes"], descriptors=results[0]["descriptors"])
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
    from pd import allocate_pages, build_state

    from tandem.transfer.metadata import MetadataBuffer

    context = multiprocessing.get_context("spawn")
    to_prefill, from_prefill = context.Queue(), context.Queue()
    worker_arguments = dict(model=arguments.model, page_size=arguments.page_size, tokens=arguments.input_len,
                            decode_device=arguments.decode_device, dtype=arguments.dtype,
                            backends=list(arguments.backends), kv_cache_layout=arguments.kv_cache_layout)
    worker = context.Process(target=decode_worker, args=(worker_arguments, to_prefill, from_prefill), daemon=True)
    worker.start()
    results: dict[str, dict] = {}
    core = None
    try:
        core = build_state(arguments.model, arguments.page_size, arguments.input_len, arguments.prefill_device,
                           arguments.dtype, arguments.kv_cache_layout)
        sources = allocate_pages(core, "bench#p", arguments.input_len, False, seed=1)
        metadata_of = {name: metadata_beside_pages(MetadataBuffer, name, arguments.prefill_device)
                       for name in arguments.backends}
        for name in arguments.backends:
            metadata = metadata_of[name]
            try:
                message = to_prefill.get(timeout=deadline.left(QUEUE_SECONDS))
                if message[0] == "error":
                    raise RuntimeError(f"decode process: {message[1].strip().splitlines()[-1]}")
                variants = arguments.nccl_variants if name == "nccl" else ()
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
        for name in arguments.backends:
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


def describe_bandwidth(result: dict) -> str:
    if "error" in result:
        return f"failed: {result['error']}"
    rate, copy_rate = result["bytes"] / result["seconds"] / 1e9, result["bytes"] / result["copy_seconds"] / 1e9
    split = ", ".join(f"{key} {result[key] * 1e3:.3f}" for key in ("plan", "post", "wait", "row") if result.get(key))
    if "nixl post" in result:
        split += (f"; NIXL's own: post {result['nixl post'] * 1e3:.3f}, transfer {result['nixl transfer'] * 1e3:.3f}"
                  f" ({result['nixl descriptors']:g} descriptors after its merging)")
    if any(key in result for key in THREAD_STEPS):
        split += "; NCCL writer thread: " + ", ".join(f"{key} {result.get(key, 0) * 1e3:.3f}" for key in THREAD_STEPS)
    return (f"{result['bytes'] / 2**20:.1f} MiB in {result['descriptors']} descriptors, {result['seconds'] * 1e3:.3f} ms"
            f" = {rate:.1f} GB/s; torch copy {copy_rate:.1f} GB/s; fraction {rate / copy_rate:.2f} (ms: {split})")


# -- part 2: serving ----------------------------------------------------------------------------------------


def server_flags(arguments, device: str) -> list[str]:
    flags = ["serve", "--model", arguments.model, "--served-model-name", "bench", "--device", device,
             "--page-size", str(arguments.page_size), "--max-num-seqs", "4",
             "--max-num-batched-tokens", str(arguments.max_num_batched_tokens), "--no-enable-prefix-caching",
             "--max-total-tokens", str(4 * arguments.input_len + 1024), "--dtype", arguments.dtype]
    if arguments.load_format != "auto":
        flags += ["--load-format", arguments.load_format]
    if device.startswith("cuda"):
        flags += ["--cuda-graph-sizes", "1", "2", "4"]
    return flags


def complete(url: str, prompt: list[int], output_len: int) -> list[int]:
    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice.get("token_ids") or choice["text"]


# server-side histograms whose means say where TTFT goes: the API server's own TTFT (arrival to
# first token out) and PD's phases (tandem/disagg/metrics.py)
TIMING_HISTOGRAMS = ("time_to_first_token_seconds", "pd_phase_seconds", "router_time_to_first_token_seconds")


def timing_sums(urls: dict[str, str]) -> dict[str, float]:
    """``server name{labels}_sum|_count`` -> value, for ``TIMING_HISTOGRAMS`` of each server."""
    import httpx

    values = {}
    for server, url in urls.items():
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{")[0].split(" ")[0].removeprefix("tandem:")
            if any(name in (f"{histogram}_sum", f"{histogram}_count") for histogram in TIMING_HISTOGRAMS):
                values[f"{server} {line.rsplit(' ', 1)[0].removeprefix('tandem:')}"] = float(line.split()[-1])
    return values


def timing_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds of each histogram over the requests between the two snapshots."""
    means = {}
    for key, total in after.items():
        if "_sum" not in key:
            continue
        count = after.get(key.replace("_sum", "_count"), 0) - before.get(key.replace("_sum", "_count"), 0)
        if count > 0:
            label = key.replace("_seconds_sum", "").replace("router_time_to_first_token", "first event") \
                .replace("time_to_first_token", "server TTFT")
            means[label] = (total - before.get(key, 0.0)) / count
    return means


def measure_setup(url: str, prompts: list[list[int]], output_len: int, servers: dict[str, str]) -> dict:
    import serve

    outputs = complete(url, prompts[0], output_len)
    before = timing_sums(servers)
    level = asyncio.run(serve.run_level(url, "bench", prompts[1:], output_len, 1, None))
    done = level.completed
    if not done:
        failures = [record.error for record in level.records]
        raise RuntimeError(f"no streamed request finished: {failures[:1]}")
    return {"outputs": outputs, "ttft": statistics.median(record.ttft for record in done),
            "client ttft mean": statistics.mean(record.ttft for record in done),
            "timings": timing_means(before, timing_sums(servers))}


def run_serving(arguments, deadline: Deadline) -> dict[str, dict]:
    """setup (colocated, nixl, nccl) -> {outputs, ttft, transfers} or {error}."""
    import serve
    from pd import Cluster, pd_metrics

    cluster = Cluster(Path(arguments.log_directory))
    results: dict[str, dict] = {}
    launched: dict[str, tuple] = {}
    try:
        launched["colocated"] = cluster.launch("colocated", server_flags(arguments, arguments.prefill_device))
        for name in arguments.backends:  # every server starts at once: their start-ups overlap
            layout = ["--kv-cache-layout", arguments.kv_cache_layout]
            prefill = cluster.launch(f"prefill-{name}", [*server_flags(arguments, arguments.prefill_device),
                                                         "--role", "prefill", "--transfer-backend", name, *layout])
            decode = cluster.launch(f"decode-{name}", [*server_flags(arguments, arguments.decode_device),
                                                       "--role", "decode", "--transfer-backend", name, *layout])
            launched[name] = (prefill, decode)
        vocab = serve.vocab_size_of(arguments.model)
        prompts = serve.make_prompts(arguments.requests + 1, arguments.input_len, vocab, arguments.seed)
        for name, servers in launched.items():
            try:
                if name == "colocated":
                    url, process = servers
                    cluster.wait(url, process, timeout=deadline.left(600))
                    timed = {"colocated": url}
                else:
                    (prefill_url, prefill), (decode_url, decode) = servers
                    cluster.wait(prefill_url, prefill, timeout=deadline.left(600))
                    cluster.wait(decode_url, decode, timeout=deadline.left(600))
                    url, router = cluster.launch(f"router-{name}", ["router", "--prefill", prefill_url,
                                                                    "--decode", decode_url])
                    cluster.wait(url, router, "/v1/models", timeout=deadline.left(120))
                    timed = {"prefill": prefill_url, "decode": decode_url, "router": url}
                results[name] = measure_setup(url, prompts, arguments.output_len, timed)
                if name != "colocated":
                    results[name]["transfers"] = pd_metrics(prefill_url)
            except Exception as error:  # noqa: BLE001
                results[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"   serving {name}: {results[name].get('error') or 'TTFT %.2f ms' % (results[name]['ttft'] * 1e3)}",
                  flush=True)
    except Exception as error:  # noqa: BLE001 - a server could not even be launched
        for name in ("colocated", *arguments.backends):
            results.setdefault(name, {"error": f"{type(error).__name__}: {error}"})
        traceback.print_exc()
    finally:
        cluster.stop()
    return results


# -- report -------------------------------------------------------------------------------------------------------


def print_table(arguments, bandwidth: dict, serving: dict) -> None:
    colocated = serving.get("colocated", {})
    print(f"\n== PD over GPU memory: {arguments.shape or arguments.model}, {arguments.input_len}-token prompt, "
          f"prefill {arguments.prefill_device} -> decode {arguments.decode_device}, {arguments.kv_cache_layout} ==")
    if "error" in colocated:
        print(f"colocated server failed: {colocated['error']}")
    columns = {"backend": 14, "MiB": 7, "descs": 5, "PD ms": 7, "plan ms": 7, "post ms": 7, "wait ms": 7,
               "row ms": 6, "PD GB/s": 8, "copy GB/s": 9, "fraction": 8, "TTFT ms": 8, "added ms": 8, "outputs": 8}
    header = " ".join(f"{title:>{width}}" for title, width in columns.items())
    print(header)
    print("-" * len(header))
    for name in [*arguments.backends, *(label for label in bandwidth if label not in arguments.backends)]:
        cells = dict.fromkeys(list(columns)[1:], "-")
        measured = bandwidth.get(name, {"error": "not run"})
        if "error" not in measured:
            rate = measured["bytes"] / measured["seconds"] / 1e9
            copy_rate = measured["bytes"] / measured["copy_seconds"] / 1e9
            cells.update({"MiB": f"{measured['bytes'] / 2**20:.1f}", "descs": str(measured["descriptors"]),
                          "PD ms": f"{measured['seconds'] * 1e3:.3f}", "PD GB/s": f"{rate:.1f}",
                          "copy GB/s": f"{copy_rate:.1f}", "fraction": f"{rate / copy_rate:.2f}"})
            for key in ("plan", "post", "wait", "row"):
                if measured.get(key):
                    cells[f"{key} ms"] = f"{measured[key] * 1e3:.3f}"
        served = serving.get(name, {"error": "not run"})
        if "error" not in served:
            cells["TTFT ms"] = f"{served['ttft'] * 1e3:.2f}"
            if "ttft" in colocated:
                cells["added ms"] = f"{(served['ttft'] - colocated['ttft']) * 1e3:.2f}"
                cells["outputs"] = "equal" if served["outputs"] == colocated["outputs"] else "DIFFER"
        print(" ".join(f"{value:>{width}}" for value, width in zip([name, *cells.values()], columns.values())))
    if bandwidth:
        print(MODES_HELP)
    if "ttft" in colocated:
        print(f"colocated TTFT {colocated['ttft'] * 1e3:.2f} ms (median of {arguments.requests} streamed requests)")
    for label, result in bandwidth.items():
        if "error" in result:
            print(f"{label} bandwidth failed: {result['error']}")
    for name in arguments.backends:
        if "error" in serving.get(name, {}):
            print(f"{name} serving failed: {serving[name]['error']}")
        if "transfers" in serving.get(name, {}):
            print(f"{name} prefill server's transfers: {serving[name]['transfers']}")
    for name in ("colocated", *arguments.backends):
        served = serving.get(name, {})
        if "timings" in served:  # where TTFT goes (means over the streamed requests, ms)
            timings = ", ".join(f"{label} {seconds * 1e3:.2f}" for label, seconds in served["timings"].items())
            print(f"{name} timings (mean ms): client TTFT {served['client ttft mean'] * 1e3:.2f}, {timings}")
    print("goals: fraction >= 0.85, added TTFT <= 5 ms (Llama-3.1-8B shape, 2,048 tokens, 2 GPUs), outputs equal")


def variant(text: str) -> tuple[float, float]:
    direct, _, staging = text.partition(":")
    return float(direct), float(staging)


def parse_arguments(argv=None) -> argparse.Namespace:
    from common import add_model_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--device", default="auto", choices=("auto", "one-gpu", "cpu"),
                        help="auto: cuda:0 and cuda:1; one-gpu: both legs on cuda:0 (PD's steps without the link: "
                             "where TTFT goes; NIXL only); cpu: both legs in host memory")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--nccl-variants", nargs="*", default=[(4.0, 32.0), (1024.0, 16.0), (1024.0, 64.0)],
                        type=variant,
                        help="more NCCL segmentings measured in part 1, DIRECT_MIB:STAGING_MIB (runs of at least "
                             "DIRECT_MIB sent in place, shorter ones gathered into pipelined staged sends of "
                             "STAGING_MIB); the default row uses the backend's own (64:32); 4:32 was the default "
                             "before (4 MiB runs sent in place, one NCCL group)")
    parser.add_argument("--kv-cache-layout", choices=("page-major", "layer-major"), default="page-major",
                        help="the pools of both parts' PD sides (PD servers' default is page-major: a prompt's "
                             "pages are one run per state group; layer-major: one run per layer buffer)")
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment for every process of the run (e.g. NCCL_MIN_P2P_NCHANNELS=32 to try "
                             "NCCL's point-to-point tuning, UCX_... for NIXL's transport)")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8, help="streamed requests per setup (TTFT median)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="prefill chunk of the servers: pages stream to the decode server as chunks complete, "
                             "so only the last chunk's transfer adds to TTFT")
    parser.add_argument("--rounds", type=int, default=10, help="timed PD writes per backend (median)")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds for everything")
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--log-directory", default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def resolve_devices(arguments) -> None:
    import torch

    if arguments.device == "cpu":
        arguments.prefill_device = arguments.decode_device = "cpu"
        arguments.shape = arguments.shape or "micro"
        arguments.dtype = arguments.dtype or "float32"
        arguments.load_format = "auto"
        return
    if arguments.device == "one-gpu":  # both servers on cuda:0: PD's own steps without the link
        if "nccl" in arguments.backends:
            print("one-gpu: NCCL allows one rank per device; measuring NIXL only", flush=True)
            arguments.backends = [name for name in arguments.backends if name != "nccl"]
        arguments.prefill_device = arguments.decode_device = "cuda:0"
    elif torch.cuda.device_count() < 2:
        raise SystemExit("pd_gpu.py: needs two visible GPUs (or --device one-gpu: both sides on one GPU, "
                         "or --device cpu to check the steps on a CPU)")
    else:
        arguments.prefill_device, arguments.decode_device = "cuda:0", "cuda:1"
    arguments.shape = arguments.shape or "llama3-8b"
    arguments.dtype = arguments.dtype or "bfloat16"
    arguments.load_format = "dummy" if not arguments.model else "auto"


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    deadline = Deadline(arguments.deadline)
    os.environ.pop("TANDEM_SANITIZE", None)  # measure the engine as deployed
    for setting in arguments.env:  # before any process, backend or communicator starts
        key, separator, value = setting.partition("=")
        if not separator or not key:
            raise SystemExit(f"pd_gpu.py: --env takes KEY=VALUE, got {setting!r}")
        os.environ[key] = value
    os.environ["PYTHONPATH"] = os.pathsep.join(  # the servers import this checkout (and what the caller added)
        [str(REPOSITORY_ROOT)] + [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path])
    resolve_devices(arguments)
    from common import model_dir_for

    arguments.model = arguments.model or model_dir_for(arguments.shape, arguments.load_format)
    arguments.log_directory = arguments.log_directory or tempfile.mkdtemp(prefix="tandem-pd-gpu-")
    Path(arguments.log_directory).mkdir(parents=True, exist_ok=True)
    print(f"model {arguments.model} ({arguments.shape}, {arguments.dtype}, {arguments.load_format}); "
          f"logs in {arguments.log_directory}", flush=True)
    bandwidth, serving = {}, {}
    try:
        if not arguments.skip_bandwidth:
            print("== part 1: transfer bandwidth ==", flush=True)
            bandwidth = run_bandwidth(arguments, deadline)
            free_device_memory()
        if not arguments.skip_serving and deadline.left():
            print("== part 2: serving (TTFT, outputs) ==", flush=True)
            serving = run_serving(arguments, deadline)
    finally:
        print_table(arguments, bandwidth, serving)
    return 0


if __name__ == "__main__":
    sys.exit(main())
