"""Decode offload over PD, in process (``PDPair``): a decode server writes every page that fills
while it decodes to the store it shares with the prefill server, which hits them on the
conversation's next turn.

- Seed 004's two races, held open with the copy-delay hook: a request that finishes while the
  device→host copies of its pages are delayed leaves those pages held (prompt pages included),
  never on the free list and never handed to a concurrent request, until the copies complete;
  the copies read the pages as the request left them. The sanitizer checks the books after
  every step; once idle, everything is free or cached.
- Multi-turn conversations per family: every turn equals ``transformers`` on the whole
  conversation; from turn 2 on, the prefill server's store hits written by the decode server
  cover the pages the previous turn completed while decoding.
- Sliding window past the window (Gemma 3, page 16, window 24): the decode server holds only the
  window's pages of a long prompt, yet caches and offloads the pages it completes, and the next
  turn hits them as far as llama's does (64 of a 70-token prompt, 32 of them the decode server's).
- A decode server's own prefix cache: a prompt whose prefix it holds moves only the rest.
"""
from __future__ import annotations

import random

import pytest
import torch

from tandem.entrypoints.router.affinity import PrefillAffinity, conversation_key, conversation_keys
from tandem.kv.tiers.store import open_store
from tandem.sampling_params import SamplingParams
from tests.support.pd import PDPair

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ENGINE = dict(page_size=4, max_total_tokens=512, max_num_seqs=4, max_num_batched_tokens=16)
EXACT = {"deepseek_v32": dict(indexer_cache_dtype="float32")}
TOKENS = 6  # generated per turn
PARAMS = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=3)
# Families whose decode server caches (and offloads) every page it completes: all of them (a
# sliding-window group's cache nodes may lack the pages before its window, see
# kv/managers/sliding_window.py).
DECODE_HITS = ("llama", "gemma3", "deepseek_v32", "qwen3_next")


def offload_pair(model_dir: str, arch: str, store, *, offload: bool = True, **decode_options) -> PDPair:
    options = {**ENGINE, **EXACT.get(arch, {})}
    return PDPair(model_dir, prefill_options=dict(disk_cache_dir=str(store)),
                  decode_options=dict(disk_cache_dir=str(store), decode_offload=offload, **decode_options),
                  **options)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(count)]


def decode_origin_hits(pair: PDPair) -> int:
    return pair.prefill.stats().tiers.disk_hit_tokens_by_origin.get("decode", 0)


def inflight_tier_pages(engine, group: int = 0) -> set[int]:
    """Device pages some tier copy holds."""
    return {page for owner, pages in engine.coordinator.inflight_references(group)
            if owner.startswith("inflight:tier") for page in pages}


def test_finished_request_keeps_its_pages_until_its_offload_copies_complete(model_dirs, oracles, tmp_path):
    pair = offload_pair(model_dirs["llama"], "llama", tmp_path / "store")
    decode = pair.decode
    tiers, pool = decode.tiers, decode.coordinator.pools[0]
    keys = decode.registry.layer_buffers("model.layers.0.self_attn")["key"]
    rng = random.Random(4)
    first, second = random_tokens(rng, 21), random_tokens(rng, 30)
    try:
        tiers.local.stream.delay_s = 0.3
        pair.submit_destination_first("a", first, PARAMS)  # (the prefill server stores nothing first)
        pair.run_until(lambda: pair.decode.scheduler.running)
        sequence = decode.scheduler.running[0]
        prompt_pages = [page for page in sequence.state.page_tables[0][:len(first) // 4]]
        owner = sequence.state.owner
        while not pair.finished("a"):  # race 1: the prompt's pages stay the request's while it decodes
            assert all(pool.holders(page)[owner] == 1 for page in prompt_pages)
            pair.step()
        # Race 2: finished, its copies still delayed: its full pages (prompt pages included) are
        # held by the copies, not free, and keep what the request left in them.
        held = inflight_tier_pages(decode)
        assert tiers.copies_in_flight and set(prompt_pages) <= held
        snapshot = {page: keys[page].clone() for page in held}
        saved = {node.pages[0]: node for node in decode.coordinator.prefix_cache.all_nodes()
                 if node.pages is not None and node.pages[0] in held}
        decode.reset_prefix_cache()  # the cache lets go: only the copies hold them now
        assert all(page not in pool._free and pool.holders(page) for page in held)
        bound = []
        original_bind = decode.pd.bind

        def recording_bind(transfer, now):
            original_bind(transfer, now)
            bound.append((set(transfer.sequence.state.page_tables[0]), inflight_tier_pages(decode)))

        decode.pd.bind = recording_bind
        pair.submit_destination_first("b", second, PARAMS)  # would have reused them: gets other pages
        pair.run_until(lambda: pair.finished("b"))
        assert bound and all(not pages & still_held for pages, still_held in bound)
        assert any(still_held & held for _, still_held in bound), "the copies completed before b was bound"
        tiers.drain()
        tiers.local.stream.delay_s = 0.0
        for page, node in saved.items():  # the copies read the pages as the request left them
            layout = tiers.local.host.layouts[0]
            segment = layout.layer_segments("model.layers.0.self_attn")[0]
            copied = tiers.local.host.arrays[0][node.host_pages[0], segment.offset:segment.offset + segment.width]
            assert torch.equal(copied, snapshot[page].view(torch.uint8).flatten())
        pair.settle()
        pair.assert_matches("a", oracles["llama"].greedy(first, TOKENS))
        pair.assert_matches("b", oracles["llama"].greedy(second, TOKENS))
        pair.assert_all_free()
        # Every full page of a's (prompt and generated) reached the store, whole and verified.
        store = tiers.disk
        assert store.stats.writes >= (len(first) + TOKENS - 1) // 4 - len(first) // 4
    finally:
        tiers.local.stream.delay_s = 0.0
        pair.close()


def converse(pair: PDPair, oracle, rng: random.Random, *, conversations: int, turns: int,
             first_length: int = 9, message_length: int = 5, expect_decode_hits: bool = True) -> None:
    """Concurrent conversations: each turn's prompt is the previous turns plus a new message;
    every turn equals the oracle on the whole conversation."""
    page_size = ENGINE["page_size"]
    history = {number: random_tokens(rng, first_length) for number in range(conversations)}
    for turn in range(turns):
        before = decode_origin_hits(pair)
        for number, prompt in history.items():
            pair.submit(f"c{number}t{turn}", prompt, PARAMS)
        pair.run_until(lambda: all(pair.finished(f"c{number}t{turn}") for number in history), timeout=60)
        pair.decode.tiers.drain()  # the offload lands before the next turn (else: fewer hits)
        if turn and expect_decode_hits:
            # the pages the previous turn completed while decoding came from the store
            previous = [len(prompt) - TOKENS - message_length for prompt in history.values()]
            expected = sum(((length + TOKENS - 1) // page_size - length // page_size) * page_size
                           for length in previous)
            assert decode_origin_hits(pair) - before >= expected, (turn, decode_origin_hits(pair) - before, expected)
        for number, prompt in history.items():
            request_id = f"c{number}t{turn}"
            pair.assert_matches(request_id, oracle.greedy(prompt, TOKENS))
            history[number] = prompt + pair.tokens(request_id) + random_tokens(rng, message_length)


@pytest.mark.parametrize("arch", ("llama", "gemma3", "deepseek_v32", "qwen3_next"))
def test_multi_turn_conversations_hit_what_the_decode_server_offloaded(arch, model_dirs, oracles, tmp_path):
    pair = offload_pair(model_dirs[arch], arch, tmp_path / "store")
    try:
        converse(pair, oracles[arch], random.Random(11), conversations=3, turns=3,
                 expect_decode_hits=arch in DECODE_HITS)
        pair.settle()
        pair.assert_all_free()
        assert pair.decode.stats().tiers.offloaded_pages > 0 or arch not in DECODE_HITS
    finally:
        pair.close()


def test_sliding_window_turns_hit_the_pages_the_decode_server_completed(model_dirs, oracles, tmp_path):
    """The issue's shape: a 45-token prompt (past the window of 24: the decode server receives
    only the pages from token 22 on), 20 generated tokens, then a 70-token second turn. The
    decode server completed pages 2 and 3 (tokens 32..63) while decoding; the prefill server's
    second turn hits 64 tokens, pages 0-1 from its own cache and 2-3 from the decode server's
    store writes, as llama's does, and both turns equal ``transformers``."""
    page_size, generated = 16, 20
    params = SamplingParams(temperature=0.0, max_tokens=generated, ignore_eos=True, logprobs=3)
    rng = random.Random(27)
    first = random_tokens(rng, 45)
    hits = {}
    for arch in ("llama", "gemma3"):
        pair = PDPair(model_dirs[arch], prefill_options=dict(disk_cache_dir=str(tmp_path / arch)),
                      decode_options=dict(disk_cache_dir=str(tmp_path / arch), decode_offload=True),
                      **{**ENGINE, "page_size": page_size})
        try:
            # the decode server binds first, as a server does: the store holds none of the prompt yet
            pair.submit_destination_first("turn1", first, params)
            pair.run_until(lambda: pair.finished("turn1"))
            pair.decode.tiers.drain()
            second = first + pair.tokens("turn1") + random_tokens(rng, 5)
            before = pair.prefill.stats().prefix_cache_hit_tokens, decode_origin_hits(pair)
            pair.submit_destination_first("turn2", second, params)
            pair.run_until(lambda: pair.finished("turn2"))
            hits[arch] = (pair.prefill.stats().prefix_cache_hit_tokens - before[0],
                          decode_origin_hits(pair) - before[1])
            pair.assert_matches("turn1", oracles[arch].greedy(first, generated))
            pair.assert_matches("turn2", oracles[arch].greedy(second, generated))
            pair.settle()
            pair.assert_all_free()
        finally:
            pair.close()
    assert hits["gemma3"] == hits["llama"] == (64, 32), hits


def test_decode_offload_between_tensor_parallel_servers(model_dirs, oracles, tmp_path):
    """TP=2 on both sides: each rank writes its shard of every page to its own store under the
    shared directory (``tp2-rank0``, ``tp2-rank1``), and the prefill server's next turn hits the
    decode server's pages on both ranks (rank 0 installs only what every rank read)."""
    store = tmp_path / "store"
    pair = PDPair(model_dirs["llama"], tensor_parallel_size=2, prefill_options=dict(disk_cache_dir=str(store)),
                  decode_options=dict(disk_cache_dir=str(store), decode_offload=True), **ENGINE)
    try:
        converse(pair, oracles["llama"], random.Random(11), conversations=2, turns=2)
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()
    files = [sorted(path.name for path in (store / f"tp2-rank{rank}").rglob("*.page")) for rank in (0, 1)]
    assert files[0] and files[0] == files[1]


def test_without_decode_offload_the_decode_server_writes_nothing(model_dirs, oracles, tmp_path):
    pair = offload_pair(model_dirs["llama"], "llama", tmp_path / "store", offload=False)
    try:
        converse(pair, oracles["llama"], random.Random(12), conversations=2, turns=2, expect_decode_hits=False)
        assert decode_origin_hits(pair) == 0
        assert pair.decode.stats().tiers.offloaded_pages == 0
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_a_returning_conversation_moves_only_its_new_pages(model_dirs, oracles, tmp_path):
    """The decode server's prefix cache: the second turn's prompt pages it still holds are not
    destinations of the transfer (null entries), and the output is exact."""
    pair = offload_pair(model_dirs["llama"], "llama", tmp_path / "store")
    rng = random.Random(13)
    try:
        first = random_tokens(rng, 17)
        pair.submit("t1", first, PARAMS)
        pair.run_until(lambda: pair.finished("t1"))
        second = first + pair.tokens("t1") + random_tokens(rng, 6)
        sent = []
        original = pair.decode.pd.channel.send_to_address

        def recording_send(address, message):
            if type(message).__name__ == "Destination":
                sent.append(message)
            original(address, message)

        pair.decode.pd.channel.send_to_address = recording_send
        hits_before = pair.decode.stats().prefix_cache_hit_tokens
        pair.submit("t2", second, PARAMS)
        pair.run_until(lambda: pair.finished("t2"))
        hit = pair.decode.stats().prefix_cache_hit_tokens - hits_before
        assert hit >= (len(first) + TOKENS - 1) // 4 * 4
        (destination,) = sent
        assert destination.page_tables[0][:hit // 4] == [0] * (hit // 4)  # null: not written
        assert all(page != 0 for page in destination.page_tables[0][hit // 4:])
        pair.assert_matches("t1", oracles["llama"].greedy(first, TOKENS))
        pair.assert_matches("t2", oracles["llama"].greedy(second, TOKENS))
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_store_shared_by_two_processes_sees_each_others_pages(tmp_path):
    """The file backend across processes: a page one process writes is a hit in another that
    opened the directory before it was written; its origin travels with it."""
    import subprocess
    import sys

    directory = tmp_path / "store"
    reader = open_store(directory, 1 << 20, "fingerprint", origin="prefill")
    script = ("import torch, sys; from tandem.kv.tiers.store import open_store; "
              "s = open_store(sys.argv[1], 1 << 20, 'fingerprint', origin='decode'); "
              "s.write_async(b'k' * 16, torch.arange(64, dtype=torch.uint8)); s.close()")
    subprocess.run([sys.executable, "-c", script, str(directory)], check=True)
    payload = reader.read(b"k" * 16)
    assert payload is not None and bytes(payload) == bytes(range(64))
    assert reader.stats.hits_by_origin == {"decode": 1}
    reader.close()


def test_prefill_affinity_keys_a_conversation_by_its_start():
    turn1 = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    turn2 = {"model": "m", "messages": [*turn1["messages"], {"role": "assistant", "content": "hi"},
                                        {"role": "user", "content": "more"}]}
    other = {"model": "m", "messages": [{"role": "user", "content": "bye"}]}
    assert conversation_key(turn1) == conversation_key(turn2) != conversation_key(other)
    tokens = list(range(40))
    assert conversation_key({"prompt": tokens[:20]}) == conversation_key({"prompt": [tokens]})
    assert conversation_key({"prompt": ["a", "b"]}) is None  # several prompts: no single conversation
    affinity = PrefillAffinity(max_keys=2)
    for number, url in enumerate(("a", "b", "c")):
        affinity.remember(bytes([number]), url)
    assert affinity.remembered([bytes([0])]) is None and affinity.remembered([bytes([0]), bytes([2])]) == "c"
    affinity.remember(conversation_key({"prompt": tokens[:9]}), "short")  # a first turn shorter than the window
    assert affinity.remembered(conversation_keys({"prompt": tokens[:30]})) == "short"
