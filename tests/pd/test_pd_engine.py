"""PD inside the engine: a prefill and a decode engine core in this process, joined by real NIXL
agents and a real control channel. Exactness for every state family (against ``transformers``),
I1 (the transfer writes exactly the registry's buffers), I4 (metadata rows are copied out),
I7 (room ids checked; forward-only states), and the lifetimes of pages under aborts, failures and
dead peers (I2: nothing freed under a writer; everything free once idle)."""
import os
import time

os.environ["TANDEM_SANITIZE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem import LLM  # noqa: E402
from tandem.disagg.transfers import PrefillLink  # noqa: E402
from tandem.kv.registry import StateRegistry  # noqa: E402
from tandem.kv.spec import FullAttentionSpec  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402
from tandem.transfer.descriptors import coalesce, describe_layout, plan_page_writes  # noqa: E402
from tandem.transfer.messages import Drained, TransferFailed, first_difference, new_room  # noqa: E402
from tandem.transfer.metadata import POISON_BYTE, MetadataBuffer, MetadataRow  # noqa: E402
from tandem.transfer.state import TransferState, TransferStateError, TransferStatus  # noqa: E402
from tests.support.models import ARCH_OPTIONS  # noqa: E402
from tests.support.pd import GREEDY, PDPair  # noqa: E402

ALL_ARCHS = tuple(ARCH_OPTIONS)
SMALL = dict(page_size=4, max_total_tokens=512, max_num_seqs=4, max_num_batched_tokens=16)
# The sparse-attention indexer's deployed FP8 cache is not bit-comparable with transformers; the
# oracle runs use its unquantised mode (the FP8 pages are checked against colocated below).
EXACT_OPTIONS = {"deepseek_v32": dict(indexer_cache_dtype="float32"), "glm_moe_dsa": dict(indexer_cache_dtype="float32")}
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(21)]  # spans two prefill chunks of 16
SHORT_PROMPT = [11, 12, 13]


@pytest.fixture
def llama_pair(model_dirs):
    pair = PDPair(model_dirs["llama"], transfer=dict(peer_timeout=2.0), **SMALL)
    yield pair
    pair.close()


# -- units ---------------------------------------------------------------------------------------------


def test_state_machine_only_moves_forward():
    status = TransferStatus(new_room())
    status.advance(TransferState.BOUND)
    status.advance(TransferState.SENDING)
    with pytest.raises(TransferStateError):
        status.advance(TransferState.BOUND)
    assert status.end(TransferState.FAILED, "boom")
    assert not status.end(TransferState.ABORTED, "late")  # terminal stays terminal
    with pytest.raises(TransferStateError):
        status.advance(TransferState.DONE)
    assert status.state is TransferState.FAILED and status.reason == "boom"


def test_writes_are_coalesced_and_cover_every_buffer():
    assert coalesce([(4, 12), (5, 13), (6, 14), (9, 20), (0, 3), (10, 0)]) == [(4, 12, 3), (9, 20, 1)]
    registry = StateRegistry()
    spec = FullAttentionSpec(num_kv_heads=2, head_dim=4, dtype=torch.float32)
    for layer in ("a", "b"):
        registry.register(layer, spec)
    registry.finalize()
    for descriptor_layer in ("a", "b"):
        for layout in spec.buffer_layouts():
            registry.attach_buffer(0, descriptor_layer, layout, torch.zeros(8, 4, 2, 4))
    remote = [1 << 20, 2 << 20, 3 << 20, 4 << 20]
    plan = plan_page_writes(registry, remote, [[(1, 2), (2, 3), (5, 7)]])
    assert plan.touched == {d.key for d in registry.buffers()}
    assert len(plan.descriptors) == 2 * 4  # two runs in each of four buffers
    page_bytes = 4 * 2 * 4 * 4
    first = next(registry.buffers())
    assert plan.descriptors[0] == (first.tensor.data_ptr() + page_bytes, remote[0] + 2 * page_bytes, 2 * page_bytes)
    assert plan.num_bytes == 4 * 3 * page_bytes


def test_metadata_rows_are_copied_out_and_poisoned_on_release():
    rows = MetadataBuffer(4, hidden_size=3, sanitize=True)
    row = rows.allocate()
    room = new_room()
    rows.write(row, MetadataRow(room=room, first_token=42, num_cached_tokens=8, logprob_token_ids=(42, 7),
                                logprobs=(-0.5, -1.5), rank=1, hidden_states=(1.0, 2.0)))
    value = rows.read(row)
    rows.release(row)  # I4: the value read stays valid after the row is released and reused
    assert bytes(rows.tensor[row].tolist()) == bytes([POISON_BYTE]) * rows.row_bytes
    again = rows.allocate()
    rows.write(again, MetadataRow(room=new_room(), first_token=1))
    assert value == MetadataRow(room=room, first_token=42, num_cached_tokens=8, logprob_token_ids=(42, 7),
                                logprobs=(-0.5, -1.5), rank=1, hidden_states=(1.0, 2.0))
    rows.release(again)
    with pytest.raises(RuntimeError):
        rows.release(again)  # a double release is refused


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_rewritten_row_holds_only_its_new_value(device):
    """A row is filled in place (device rows through a pinned host copy): a shorter value written
    over a longer one leaves exactly the bytes a fresh row would hold, and on a device it has
    landed when ``write`` returns; ``stage`` (the last write's way) fills it without waiting,
    handing back the copy's event on a device (nothing to wait for in host memory)."""
    long = MetadataRow(room=new_room(), first_token=5, num_cached_tokens=3, logprob_token_ids=(5, 6, 7),
                       logprobs=(-0.1, -0.2, -0.3), rank=2, hidden_states=(1.0, 2.0, 3.0))
    short = MetadataRow(room=new_room(), first_token=9, hidden_states=(4.0,))
    reused, fresh = MetadataBuffer(2, hidden_size=3, device=device), MetadataBuffer(2, hidden_size=3, device=device)
    reused.write(1, long)
    reused.write(1, short)
    fresh.write(1, short)
    assert torch.equal(reused.tensor[1].cpu(), fresh.tensor[1].cpu()) and reused.read(1) == short
    assert not reused.tensor[0].any()
    staged = reused.stage(0, long)
    assert (staged is None) == (device == "cpu")
    if staged is not None:
        staged.synchronize()
    fresh.write(0, long)
    assert torch.equal(reused.tensor.cpu(), fresh.tensor.cpu()) and reused.read(0).room == long.room


def test_layout_difference_names_the_first_field(model_dirs):
    llama = LLM(model=model_dirs["llama"], page_size=4, max_total_tokens=64).engine
    qwen = LLM(model=model_dirs["qwen3"], page_size=4, max_total_tokens=64).engine

    def layout(engine, page_size=None):
        return describe_layout(engine.registry, architecture=engine.model_info.architecture,
                               model={"vocab_size": engine.model_info.vocab_size},
                               page_size=page_size or engine.coordinator.page_size, metadata_row_bytes=100)

    assert first_difference(layout(llama), layout(llama)) is None
    assert first_difference(layout(llama), layout(qwen)).startswith("architecture: local has 'LlamaForCausalLM'")
    assert first_difference(layout(llama), layout(llama, 8), "prefill", "decode") == \
        "page_size: prefill has 4, decode has 8"
    fp8 = LLM(model=model_dirs["llama"], page_size=4, max_total_tokens=64, kv_cache_dtype="fp8").engine
    difference = first_difference(layout(llama), layout(fp8), "prefill", "decode")  # FP8 and wider K/V never pair
    assert difference.startswith(
        "state buffer 0 (model.layers.0.self_attn/key) item_size: prefill has 4, decode has 1"), difference


# -- exactness for every family ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_decode_continues_exactly_for_every_family(arch, model_dirs, oracles):
    """Chunked prefill, a prefill-side prefix hit (the same prompt again), a short prompt: the
    decode engine's tokens and logprobs equal ``transformers``; the transfer wrote every registry
    buffer (I1); afterwards every page and row on both sides is free."""
    pair = PDPair(model_dirs[arch], **SMALL, **EXACT_OPTIONS.get(arch, {}))
    try:
        prompts = {"long": LONG_PROMPT, "short": SHORT_PROMPT}
        for request_id, prompt in prompts.items():
            pair.submit(request_id, prompt)
        pair.run_until(lambda: all(pair.finished(r) for r in prompts))
        pair.submit("again", LONG_PROMPT)  # the prefill engine now hits its prefix cache
        prompts["again"] = LONG_PROMPT
        pair.run_until(lambda: pair.finished("again"))
        for request_id, prompt in prompts.items():
            pair.assert_matches(request_id, oracles[arch].greedy(prompt, GREEDY.max_tokens))
        assert pair.prefill.scheduler.prefix_hit_tokens > 0 or arch in ("qwen3_next", "nemotron_h")
        assert pair.prefill.pd.touched == {d.key for d in pair.prefill.registry.buffers()}  # I1
        assert pair.prefill.pd.layout == pair.decode.pd.layout
        pair.settle()
        pair.assert_all_free()
        assert pair.decode.pd.metrics.outcomes["done"] == 3 and pair.prefill.pd.metrics.outcomes["done"] == 3
    finally:
        pair.close()


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_prefill_computes_before_the_destination_comes(arch, model_dirs, oracles):
    """The prefill engine does not wait for the decode side: the whole prompt is computed and
    its first token sampled before the decode leg even arrives; the final pages are held past
    the sequence's end (I2) and written once the destination comes; the decode engine's tokens
    still equal ``transformers``, and everything is free afterwards."""
    pair = PDPair(model_dirs[arch], **SMALL, **EXACT_OPTIONS.get(arch, {}))
    try:
        room = pair.submit("late", LONG_PROMPT, decode=False)
        transfer = pair.prefill.pd.transfers[room]
        pair.run_until(lambda: transfer.first_delta is not None, decode=False)
        assert transfer.sequence.is_finished and transfer.destination is None
        assert transfer.unsent_holds and pair.prefill.coordinator.pages_used() > 0  # held for the writes
        pair.submit("late", LONG_PROMPT, room=room, prefill=False)
        pair.run_until(lambda: pair.finished("late"))
        pair.assert_matches("late", oracles[arch].greedy(LONG_PROMPT, GREEDY.max_tokens))
        pair.settle()
        pair.assert_all_free()
        phases = pair.prefill.pd.metrics.phases
        assert phases["destination_wait"].total > 0 and phases["compute"].total > 0
    finally:
        pair.close()


def test_prompts_computed_before_their_destinations_wait_for_pages(model_dirs, oracles):
    """A prefill pool too small for three computed prompts at once: the third waits for pages
    while the first two are held for destinations that have not come (nothing is preempted or
    lost); once the decode legs come, every prompt is written and continued exactly, and every
    page on both sides is free."""
    pair = PDPair(model_dirs["llama"], **{**SMALL, "max_total_tokens": 48})
    prompts = {f"r{index}": [(token + 11 * index) % 500 + 5 for token in LONG_PROMPT] for index in range(3)}
    try:
        rooms = {request_id: pair.submit(request_id, prompt, decode=False) for request_id, prompt in prompts.items()}
        transfers = [pair.prefill.pd.transfers[room] for room in rooms.values()]
        pair.run_until(lambda: sum(transfer.first_delta is not None for transfer in transfers) == 2, decode=False)
        for _ in range(20):  # the third cannot get pages while the first two hold theirs
            pair.step(decode=False)
        assert sum(transfer.first_delta is not None for transfer in transfers) == 2
        assert pair.prefill.coordinator.pools[0].num_free < 6  # (a 21-token prompt needs 6 pages of 4)
        for request_id, prompt in prompts.items():
            pair.submit(request_id, prompt, room=rooms[request_id], prefill=False)
        pair.run_until(lambda: all(pair.finished(request_id) for request_id in prompts))
        for request_id, prompt in prompts.items():
            pair.assert_matches(request_id, oracles["llama"].greedy(prompt, GREEDY.max_tokens))
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


@pytest.mark.parametrize("arch", ["deepseek_v32"])
def test_fp8_indexer_pages_arrive_whole(arch, model_dirs):
    """The deployed FP8 indexer cache (keys then scales, packed per page): the decode engine's
    tokens equal a colocated engine's on the same weights."""
    pair = PDPair(model_dirs[arch], **SMALL)
    try:
        pair.submit("long", LONG_PROMPT)
        pair.run_until(lambda: pair.finished("long"))
        colocated = LLM(model=model_dirs[arch], **SMALL).generate([{"prompt_token_ids": LONG_PROMPT}], GREEDY,
                                                                  use_tqdm=False)[0]
        assert pair.tokens("long") == colocated.outputs[0].token_ids
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_fp8_kv_pages_arrive_whole(model_dirs):
    """FP8 K/V pages (``kv_cache_dtype="fp8"``) move as bytes: the decode engine's tokens and
    logprobs equal a colocated FP8 engine's, and the transfer wrote every registry buffer."""
    pair = PDPair(model_dirs["llama"], kv_cache_dtype="fp8", **SMALL)
    try:
        pair.submit("long", LONG_PROMPT)
        pair.run_until(lambda: pair.finished("long"))
        assert pair.prefill.pd.touched == {d.key for d in pair.prefill.registry.buffers()}
        assert {d.tensor.dtype for d in pair.decode.registry.buffers()} == {torch.float8_e4m3fn}
        colocated = LLM(model=model_dirs["llama"], kv_cache_dtype="fp8", **SMALL).generate(
            [{"prompt_token_ids": LONG_PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0]
        assert pair.tokens("long") == colocated.token_ids
        entries = [entry for delta in pair.outputs["long"] for entry in delta.new_logprobs or []]
        assert len(entries) == len(colocated.logprobs)
        for entry, expected in zip(entries, colocated.logprobs):
            assert abs(entry.logprobs[0] - expected[entry.token_ids[0]].logprob) <= 1e-4
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_fp8_and_wider_kv_servers_never_pair(model_dirs):
    pair = PDPair(model_dirs["llama"], prefill_options=dict(kv_cache_dtype="fp8"), **SMALL)
    try:
        pair.submit("r", SHORT_PROMPT)
        pair.run_until(lambda: pair.finished("r"))
        assert "PD handshake failed: state buffer 0 (model.layers.0.self_attn/key) item_size: the prefill " \
               "server has 1, the decode server has 4" in pair.error("r"), pair.error("r")
        pair.prefill.abort_requests(["r"])
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_seeded_sampling_continues_the_same_random_stream(llama_pair, model_dirs):
    """The prefill engine samples the first token with the request's seed; the decode engine
    continues that random stream: the output equals a colocated engine's."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)
    llama_pair.submit("seeded", LONG_PROMPT, params)
    llama_pair.run_until(lambda: llama_pair.finished("seeded"))
    colocated = LLM(model=model_dirs["llama"], **SMALL).generate([{"prompt_token_ids": LONG_PROMPT}], params,
                                                                 use_tqdm=False)[0]
    assert llama_pair.tokens("seeded") == colocated.outputs[0].token_ids


# -- lifetimes under faults --------------------------------------------------------------------------------


def decode_bound(pair: PDPair) -> bool:
    return pair.decode.pd.queue_lengths()["receiving"] > 0


def test_decode_abort_keeps_pages_until_the_prefill_side_drains(llama_pair):
    pair = llama_pair
    pair.submit("r", LONG_PROMPT)
    pair.run_until(lambda: decode_bound(pair))
    pages = list(pair.decode.scheduler.remote[0].state.page_tables[0])
    pair.step(decode=False)  # the prefill side sees the destination and starts writing
    pair.decode.abort_requests(["r"])
    census = pair.decode.coordinator.pools[0].census()
    assert census["inflight"] > 0 and census["used"] == 0  # held for the writer, not the request
    assert pair.decode.pd.queue_lengths()["draining"] == 1
    pair.settle()
    assert pair.prefill_error("r") is not None and "aborted" in pair.prefill_error("r")
    pair.assert_all_free()
    assert pair.decode.pd.metrics.outcomes["aborted"] == 1
    for descriptor in pair.decode.registry.buffers():  # released, then poisoned (I6)
        assert torch.isnan(descriptor.tensor[pages]).all(), descriptor.key


@pytest.mark.parametrize("message", ["drained", "failed"])
def test_only_the_writer_releases_a_draining_room(llama_pair, message):
    """I7: a room whose pages wait for the prefill side's drain is released only by the prefill
    engine that writes them; a ``Drained`` or ``TransferFailed(drained=True)`` for that room from
    another prefill engine leaves the pages held."""
    pair = llama_pair
    room = pair.submit("r", LONG_PROMPT)
    pair.run_until(lambda: decode_bound(pair))
    pair.step(decode=False)  # the prefill side starts writing
    pair.decode.abort_requests(["r"])
    assert pair.decode.pd.queue_lengths()["draining"] == 1
    other = "tcp://127.0.0.1:1"  # another prefill engine this decode engine talks to
    now = time.monotonic()
    pair.decode.pd.links[other] = PrefillLink(address=other, since=now, last_seen=now, ready=True)
    forged = Drained(room=room) if message == "drained" else TransferFailed(room=room, reason="x", drained=True)
    pair.decode.pd.handle(None, other, forged, now)
    del pair.decode.pd.links[other]
    assert pair.decode.pd.queue_lengths()["draining"] == 1
    assert pair.decode.coordinator.pools[0].census()["inflight"] > 0
    pair.settle()
    pair.assert_all_free()


def test_prefill_abort_fails_the_decode_leg(llama_pair):
    """Aborted while its first chunk's pages are on their way: the decode leg fails. The
    destination goes first, so pages stream chunk by chunk (a destination that came after the
    whole prompt was computed would take it all in one write, the notification with it, and the
    decode side could see it complete before the abort); only the prefill side steps until then."""
    pair = llama_pair
    pair.submit_destination_first("r", LONG_PROMPT)
    pair.run_until(lambda: pair.prefill.pd.queue_lengths()["sending"] > 0, decode=False)
    pair.prefill.abort_requests(["r"])
    pair.run_until(lambda: pair.finished("r"))
    assert "aborted on the prefill server" in pair.error("r")
    pair.settle()
    pair.assert_all_free()


def test_a_silent_prefill_engine_is_declared_dead(llama_pair):
    """The prefill side stops (as if killed) after the destination went out: the decode side
    fails the request after peer_timeout and frees its pages; the prefill side, when it runs
    again, finds the decode side silent, fails its leg, and frees its own."""
    pair = llama_pair
    pair.submit("r", LONG_PROMPT)
    pair.run_until(lambda: decode_bound(pair))
    pair.run_until(lambda: pair.finished("r"), prefill=False, timeout=15)
    assert "stopped responding" in pair.error("r")
    pair.decode.check_all_free()
    pair.run_until(lambda: pair.prefill_error("r") is not None, decode=False, timeout=15)
    pair.settle()
    pair.assert_all_free()


def test_injected_transfer_failures_end_both_legs(model_dirs):
    pair = PDPair(model_dirs["llama"], transfer=dict(failure_probability=1.0), **SMALL)
    try:
        for index in range(2):
            pair.submit(f"r{index}", LONG_PROMPT)
        pair.run_until(lambda: pair.finished("r0") and pair.finished("r1"))
        for request_id in ("r0", "r1"):
            assert "injected transfer failure" in pair.error(request_id)
        pair.settle()
        assert all(pair.prefill_error(r) for r in ("r0", "r1"))
        pair.assert_all_free()
    finally:
        pair.close()


def test_room_ids_are_checked_before_commit(llama_pair, monkeypatch):
    """I7: a metadata row carrying another room is refused; nothing is committed."""
    pair = llama_pair
    original = MetadataBuffer.stage

    def stage_wrong_room(self, row, value):
        return original(self, row, MetadataRow(**{**value.__dict__, "room": new_room()}))

    monkeypatch.setattr(pair.prefill.pd.metadata, "stage", stage_wrong_room.__get__(pair.prefill.pd.metadata))
    pair.submit("r", SHORT_PROMPT)
    pair.run_until(lambda: pair.finished("r"))
    assert "carries room" in pair.error("r") and pair.tokens("r") == []
    pair.settle()
    pair.assert_all_free()


TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def between_gpus(backend: str):
    return pytest.param(backend, marks=[pytest.mark.gpu, pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA "
                                                                                                  "devices")],
                        id=f"{backend}-gpu")


@pytest.mark.parametrize("backend", [None, between_gpus("nixl"), between_gpus("nccl")])
def test_the_metadata_row_is_filled_as_the_first_token_is_sampled(backend, model_dirs, oracles):
    """Requests whose destination came first, with and without logprobs: the prefill side
    fills the row when it launches the step that samples the first token, the token and its
    logprobs copied in from the sampler's output (``MetadataBuffer.prepare``; on GPUs in the
    sampler's stream order), so the last write fills none. The decode side's tokens and logprobs
    equal the oracle's (a row that differs from the one the host would fill fails the
    sanitizer's check), and a request aborted once its row was filled gives the row back."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    if backend is None:
        pair = PDPair(model_dirs["llama"], **SMALL)
    else:
        if backend == "nixl":
            pytest.importorskip("nixl", reason="NIXL is not installed")
        pair = PDPair(model_dirs["llama"], prefill_options=dict(device="cuda:0"), decode_options=dict(device="cuda:1"),
                      transfer=dict(backend=backend), **{**SMALL, "dtype": "float32"})
    metadata, prepared = pair.prefill.pd.metadata, []
    fill = metadata.prepare
    metadata.prepare = lambda row, value, *fields: prepared.append(row) or fill(row, value, *fields)
    try:
        for request_id, prompt, asked in (("short", SHORT_PROMPT, params), ("long", LONG_PROMPT, params),
                                          ("top-3", LONG_PROMPT, GREEDY)):
            pair.submit_destination_first(request_id, prompt, asked)
            pair.run_until(lambda: pair.finished(request_id))
            pair.assert_matches(request_id, oracles["llama"].greedy(prompt, 8))
        assert len(prepared) == 3 and GREEDY.logprobs == 3
        pair.submit_destination_first("aborted", LONG_PROMPT, params)
        pair.run_until(lambda: len(prepared) == 4, decode=False)
        pair.prefill.abort_requests(["aborted"])
        pair.run_until(lambda: pair.finished("aborted"))
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_a_full_decode_pool_holds_requests_back(model_dirs, oracles):
    """Each request needs 8 of the decode pool's 16 pages (prompt and every token it may make):
    at most two are admitted at once, the rest wait, and every one finishes exactly."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pair = PDPair(model_dirs["llama"], decode_options=dict(max_total_tokens=64), **{**SMALL, "max_total_tokens": 512})
    try:
        prompts = {f"r{index}": [index + 5] * 20 for index in range(4)}
        for request_id, prompt in prompts.items():
            pair.submit(request_id, prompt, params)
        seen_waiting = 0
        while not all(pair.finished(r) for r in prompts):
            pair.step()
            queues = pair.decode.pd.queue_lengths()
            assert queues["receiving"] + len(pair.decode.scheduler.running) <= 2
            seen_waiting = max(seen_waiting, queues["waiting_for_admission"])
        assert seen_waiting >= 2
        for request_id, prompt in prompts.items():
            assert pair.tokens(request_id) == oracles["llama"].greedy(prompt, 12).token_ids
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_mismatched_page_size_fails_at_connect(model_dirs):
    pair = PDPair(model_dirs["llama"], prefill_options=dict(page_size=8), **SMALL)
    try:
        pair.submit("r", SHORT_PROMPT)
        pair.run_until(lambda: pair.finished("r"))
        assert "PD handshake failed: page_size: the prefill server has 8, the decode server has 4" in pair.error("r")
        pair.prefill.abort_requests(["r"])
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()


def test_a_destination_that_arrived_before_a_stall_is_never_written(llama_pair):
    """I2/I7: the decode side sends its destination before the prefill leg of the request has
    arrived, then the prefill engine stalls past peer_timeout, so the decode side gives up and
    frees (and poisons) those pages. The prefill leg that arrives after the stall must not bind
    to that stale destination: it fails at once and nothing lands in the freed pages."""
    pair = llama_pair
    room = pair.submit("r", LONG_PROMPT, prefill=False)
    pair.run_until(lambda: room in pair.prefill.pd.early_destinations)
    pages = list(pair.decode.scheduler.remote[0].state.page_tables[0])
    pair.run_until(lambda: pair.finished("r"), prefill=False, timeout=15)  # the prefill engine stalls
    assert "stopped responding" in pair.error("r")
    pair.decode.check_all_free()
    for descriptor in pair.decode.registry.buffers():  # freed and poisoned (I6)
        assert torch.isnan(descriptor.tensor[pages]).all(), descriptor.key
    # (the decode side may give up a moment before the prefill engine's own stall passes
    # peer_timeout: it counts from the last message it heard, sent before the last poll)
    while time.monotonic() - pair.prefill.pd.last_poll <= pair.prefill.pd.config.peer_timeout:
        time.sleep(0.01)
    pair.step(decode=False)  # the prefill engine resumes: queued heartbeats make its peer look alive
    assert room not in pair.prefill.pd.early_destinations
    pair.submit("r", LONG_PROMPT, room=room, decode=False)
    pair.run_until(lambda: pair.prefill_error("r") is not None, decode=False, timeout=5)
    assert "stalled" in pair.prefill_error("r")
    pair.settle()
    assert pair.prefill.pd.touched == set()  # not one page was written
    for descriptor in pair.decode.registry.buffers():
        assert torch.isnan(descriptor.tensor[pages]).all(), descriptor.key
    pair.assert_all_free()


def test_fp8_and_unquantized_servers_never_pair(model_dirs):
    pair = PDPair(model_dirs["llama"], prefill_options=dict(quantization="fp8"), **SMALL)
    try:
        pair.submit("r", SHORT_PROMPT)
        pair.run_until(lambda: pair.finished("r"))
        assert "PD handshake failed: quantization: the prefill server has 'fp8-online:channel/dequantized', the " \
               "decode server has 'none'" in pair.error("r"), pair.error("r")
        pair.prefill.abort_requests(["r"])
        pair.settle()
        pair.assert_all_free()
    finally:
        pair.close()
