"""Host and disk tiers behind the prefix cache, and preemption by swap, for every family against
transformers (fp32, CPU): greedy tokens equal, top-5 logprobs within 1e-4.

(a) a host hit after the device cache was flushed; (b) a disk hit in a fresh engine on the same
directory; (c) swap preemption forced by a small pool; (d) all three in one mixed workload with
chunked prefill. The sanitizer is on: books of every tier balance after every step, and at the
end every device page is free and every host page free or cached, nothing in flight."""
from __future__ import annotations

import functools
import time

import pytest

from tandem import SamplingParams
from tests.support.engines import GREEDY, check_outputs, make_llm, prompts_for

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "deepseek_v3", "deepseek_v32", "glm_moe_dsa",
            "qwen3_next", "nemotron_h", "qwen3_moe")
# The disk and swap workload (~20 s a family) skips qwen3_moe: its state is qwen3's (paged K/V),
# and its swap preemption runs in test_qwen3_moe.py.
DISK_FAMILIES = tuple(arch for arch in FAMILIES if arch != "qwen3_moe")
# A host tier of 10 MiB behind every engine here (the DSA indexer unquantised: exact comparisons).
make_llm = functools.partial(make_llm, max_total_tokens=2048, max_num_batched_tokens=256, max_num_seqs=16,
                             host_cache_size=0.01)


def tier_stats(llm):
    return llm.engine.stats().tiers


@pytest.mark.parametrize("arch", FAMILIES)
def test_host_hit_after_device_flush(arch, model_dirs, oracles):
    prompts = prompts_for(11, (9, 30), shared=70)
    llm = make_llm(model_dirs[arch])
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = llm.generate(prompts[:1], params)
    llm.engine.tiers.drain()
    assert llm.engine.reset_prefix_cache() > 0  # the device copies go; the host keeps them
    second = llm.generate(prompts[1:], params)
    stats = tier_stats(llm)
    assert stats.host_hit_tokens >= 64, stats
    assert second[0].num_cached_tokens >= 64
    check_outputs(first + second, prompts, 6, oracles[arch], f"{arch} host hit")
    llm.engine.check_all_free()


def close(llm) -> None:
    llm.engine.check_all_free()
    llm.engine.shutdown()  # queued disk writes finish first


@pytest.mark.parametrize("arch, layout", [(arch, "layer-major") for arch in DISK_FAMILIES]
                         + [(arch, "page-major") for arch in ("llama", "deepseek_v32", "qwen3_next")])
def test_disk_hits_host_hits_and_swap_in_one_workload(arch, layout, model_dirs, oracles, tmp_path):
    """(b) a fresh engine on the same disk directory hits it; (c) swap preemption forced by a
    small pool, resumed requests exact; (d) all of it in one workload with chunked prefill, and
    host hits after a device flush. Page-major: the device pools of both engines."""
    directory = str(tmp_path / "disk")
    params = SamplingParams(max_tokens=6, **GREEDY)
    earlier = prompts_for(41, (20, 45), shared=60)
    writer = make_llm(model_dirs[arch], disk_cache_dir=directory, kv_cache_layout=layout)
    first = writer.generate(earlier, params)
    close(writer)
    check_outputs(first, earlier, 6, oracles[arch], f"{arch} before restart")

    llm = make_llm(model_dirs[arch], disk_cache_dir=directory, max_total_tokens=192,
                   max_num_batched_tokens=64, host_cache_size=0.05, kv_cache_layout=layout)
    again = [earlier[1][:-3] + [7, 8, 9]] + prompts_for(42, (120, 17, 64, 90))
    outputs = llm.generate(again, params)
    stats = llm.engine.stats().tiers
    assert stats.disk_hit_tokens >= 96, stats
    assert llm.engine.tiers.prefetch.installed_pages >= 6  # read off the engine loop
    assert stats.swaps["out"] > 0 and stats.swaps["in"] == stats.swaps["out"], stats.swaps
    llm.engine.tiers.drain()
    llm.engine.reset_prefix_cache()
    repeat = llm.generate(again[1:3], params)
    assert llm.engine.stats().tiers.host_hit_tokens > stats.host_hit_tokens
    check_outputs(outputs + repeat, again + again[1:3], 6, oracles[arch], f"{arch} mixed")
    close(llm)


def test_a_disk_prefix_is_read_while_running_sequences_step(model_dirs, oracles, tmp_path, monkeypatch):
    """A waiting prompt whose prefix is on disk waits for its read (done by a thread) while the
    running sequence keeps stepping; then it hits the pages read, exactly."""
    from tandem.kv.tiers.disk_store import DiskStore

    directory = str(tmp_path / "disk")
    stored = prompts_for(44, (100,))
    writer = make_llm(model_dirs["llama"], disk_cache_dir=directory)
    writer.generate(stored, SamplingParams(max_tokens=2, **GREEDY))
    close(writer)
    original = DiskStore.read_entry

    def slow_read(store, key):
        time.sleep(0.05)  # a slow disk: 6 pages take 0.3 s
        return original(store, key)
    monkeypatch.setattr(DiskStore, "read_entry", slow_read)

    llm = make_llm(model_dirs["llama"], disk_cache_dir=directory)
    engine, prefetch = llm.engine, llm.engine.tiers.prefetch
    steps_during_read = []
    step = engine.step

    def recording_step(*args, **kwargs):
        deltas = step(*args, **kwargs)
        if prefetch.in_flight:
            steps_during_read.append(sum(len(delta.new_token_ids) for delta in deltas))
        return deltas
    monkeypatch.setattr(engine, "step", recording_step)
    running = prompts_for(45, (9,))  # first in the queue: admitted at once
    prompts = running + [stored[0][:96] + [5, 6, 7]]
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=40, **GREEDY), SamplingParams(max_tokens=6, **GREEDY)])
    assert sum(steps_during_read) >= 2, steps_during_read  # tokens came out while the read was in flight
    assert prefetch.installed_pages == 6 and engine.stats().tiers.disk_hit_tokens == 96
    assert outputs[1].num_cached_tokens == 96
    check_outputs(outputs[:1], prompts[:1], 40, oracles["llama"], "running during a disk read")
    check_outputs(outputs[1:], prompts[1:], 6, oracles["llama"], "after a disk read")
    close(llm)


def test_corrupt_disk_page_is_a_counted_miss(model_dirs, oracles, tmp_path):
    directory = tmp_path / "disk"
    params = SamplingParams(max_tokens=4, **GREEDY)
    prompts = prompts_for(43, (70,))
    writer = make_llm(model_dirs["llama"], disk_cache_dir=str(directory))
    writer.generate(prompts, params)
    close(writer)
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    assert len(files) == 4  # one per full page of the prompt
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    llm = make_llm(model_dirs["llama"], disk_cache_dir=str(directory))
    outputs = llm.generate(prompts, params)
    stats = llm.engine.stats().tiers
    assert sum(stats.disk_rejected.values()) == 1, stats.disk_rejected
    check_outputs(outputs, prompts, 4, oracles["llama"], "corrupt page")
    close(llm)


def test_unwritable_disk_directory_serves_without_the_disk_tier(model_dirs, oracles, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level("WARNING"):
        llm = make_llm(model_dirs["llama"], disk_cache_dir=str(blocker / "disk"))
    assert "disk tier off" in caplog.text and "--disk-cache-dir" in caplog.text
    assert not llm.engine.stats().tiers.disk_enabled
    prompts = prompts_for(44, (40,))
    check_outputs(llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY)), prompts, 4, oracles["llama"], "no disk")
    close(llm)


@pytest.mark.parametrize("options, message", [
    (dict(host_cache_size=-1), "host_cache_size"),
    (dict(host_cache_write_policy="sometimes"), "host_cache_write_policy"),
    (dict(preemption_mode="swap", host_cache_size=0), "preemption_mode"),
    (dict(preemption_mode="later"), "preemption_mode"),
    (dict(disk_cache_size=0), "disk_cache_size"),
])
def test_bad_tier_options_name_the_field(options, message):
    from tandem.config import EngineConfig

    with pytest.raises(ValueError, match=f"^{message}: "):
        EngineConfig(model="unused", **options)


def test_full_host_tier_moves_pages_on_to_disk(model_dirs, oracles, tmp_path):
    """A host tier of 6 pages under a workload of ~20: least recently used host copies go to
    disk (device → host → disk), and a later prompt hits pages that only the disk still holds."""
    from tandem.kv.tiers.host_pool import node_bytes

    probe = make_llm(model_dirs["llama"])
    per_page = node_bytes(probe.engine.tiers.layouts)
    probe.engine.shutdown()
    directory = str(tmp_path / "disk")
    llm = make_llm(model_dirs["llama"], host_cache_size=6.5 * per_page / (1 << 30),
                   disk_cache_dir=directory, max_total_tokens=256)
    tiers = llm.engine.tiers
    assert tiers.host.num_pages == 6
    params = SamplingParams(max_tokens=4, **GREEDY)
    prompts = prompts_for(45, (100, 90, 120))
    first = llm.generate(prompts, params)
    llm.engine.reset_prefix_cache()
    tiers.drain()
    assert tiers.disk.stats.files >= 18  # every page went to disk; the host keeps 6
    again = [prompts[0][:96] + [5, 6, 7]]  # its first pages were evicted from the host long ago
    second = llm.generate(again, params)
    assert llm.engine.stats().tiers.disk_hit_tokens >= 64
    check_outputs(first + second, prompts + again, 4, oracles["llama"], "host full")
    close(llm)
