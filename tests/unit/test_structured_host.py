"""The host's share of a constrained step, kept small without losing a guarantee:

- a matcher's sync costs O(new tokens) yet still reaches the state a fresh matcher reaches on
  the same output, whenever the output was cut back and grown again (a stale matcher is not
  used); sanitizer mode compares the whole history;
- the step's bitmask comes from a reused ring of host buffers, every row allowing every token
  until filled, and never aliases what the device reads (CUDA: a buffer is not rewritten while
  its copy to the device is still queued);
- a cache hit neither re-checks nor recompiles the grammar;
- the fill threads follow the CPUs this process may use (affinity and cgroup quota).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tandem.engine import structured_outputs
from tandem.sampling_params import StructuredOutputsParams
from tandem.structured import bitmask_staging
from tandem.structured.bitmask import bitmask_words, cgroup_cpu_quota, fill_threads
from tandem.structured.bitmask_staging import BitmaskStaging
from tandem.structured.matcher import RequestGrammar

SCHEMA = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "note": {"type": "string", "maxLength": 40}},
          "required": ["count", "note"]}


def grammar_of(structured) -> RequestGrammar:
    constraint = StructuredOutputsParams(json=SCHEMA)
    sequence = SimpleNamespace(grammar=None, params=SimpleNamespace(structured_outputs=constraint))
    structured.attach(sequence, structured.compile(constraint))
    return sequence.grammar


def walk(structured, length: int, seed: int) -> list[int]:
    """``length`` tokens the grammar allows, each the ``seed``-th allowed one (a path through it)."""
    grammar, tokens = grammar_of(structured), []
    mask = torch.empty((1, bitmask_words(structured.vocab_size)), dtype=torch.int32)
    for _ in range(length):
        grammar.fill(mask, 0)
        allowed = [token for token in range(structured.vocab_size) if (int(mask[0, token // 32]) >> (token % 32)) & 1]
        token = allowed[(seed * 7 + len(tokens)) % len(allowed)]
        if token in structured.eos_token_ids or not grammar.try_accept(token):
            break
        tokens.append(token)
    return tokens


def mask_after(grammar: RequestGrammar, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros((1, bitmask_words(vocab_size)), dtype=torch.int32)
    grammar.fill(mask, 0)
    return mask


def test_sync_accepts_only_new_tokens_and_catches_a_stale_matcher(structured):
    first, second = walk(structured, 12, seed=1), walk(structured, 12, seed=2)
    assert len(first) == len(second) == 12
    diverge = next(index for index, (a, b) in enumerate(zip(first, second)) if a != b)
    grammar = grammar_of(structured)
    accepted = []
    accept = grammar.accept
    grammar.accept = lambda token: (accepted.append(token), accept(token))
    grammar.sync(first[:5])
    grammar.sync(first[:9])
    assert accepted == first[:9]  # each sync accepted only the tokens it had not seen
    # Cut back past the divergence and grown along another path: rolled back, then caught up.
    grammar.sync(second)
    assert grammar.consumed == second
    fresh = grammar_of(structured)
    fresh.sync(second)
    assert torch.equal(mask_after(grammar, structured.vocab_size), mask_after(fresh, structured.vocab_size))
    # Cut back only: rolled back.
    grammar.sync(second[:diverge])
    assert grammar.consumed == second[:diverge]
    # A history rewritten under an unchanged last token: the whole-history check catches it.
    path_a, path_b = same_last_token_different_history(structured, first)
    grammar.sync(path_a)
    grammar.sync(path_b, check_history=True)
    assert grammar.consumed == path_b
    fresh = grammar_of(structured)
    fresh.sync(path_b)
    assert torch.equal(mask_after(grammar, structured.vocab_size), mask_after(fresh, structured.vocab_size))


def same_last_token_different_history(structured, first: list[int]) -> tuple[list[int], list[int]]:
    """Two grammar paths of one length ending in the same token, differing before it."""
    for seed in range(3, 40):
        other = walk(structured, len(first), seed)
        for end in range(1, min(len(first), len(other))):
            if first[end] == other[end] and first[:end] != other[:end]:
                return first[:end + 1], other[:end + 1]
    raise AssertionError("no two paths found")


def test_staging_rows_allow_every_token_and_the_device_copy_is_its_own():
    staging = BitmaskStaging(words=5, device=torch.device("cpu"))
    views = []
    for rows in (3, 2, 70, 1, 3):
        view = staging.take(rows)
        assert view.shape == (rows, 5) and bool((view == -1).all())
        device_mask = staging.to_device(view)
        view.zero_()  # the next user of this buffer
        assert bool((device_mask == -1).all())  # what the sampler reads is not the ring's buffer
        views.append(view)
    assert views[0].data_ptr() == views[-1].data_ptr()  # the ring came round: the buffer is reused
    assert len({view.data_ptr() for view in views[:bitmask_staging.SLOTS]}) == bitmask_staging.SLOTS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_never_rewrites_a_buffer_whose_copy_is_queued():
    staging = BitmaskStaging(words=4008, device=torch.device("cuda"))
    view = staging.take(64)
    pattern = torch.randint(-2**31, 2**31 - 1, view.shape, dtype=torch.int32)
    view.copy_(pattern)
    assert view.is_pinned()
    torch.cuda._sleep(200_000_000)  # the stream stays busy: the copy below is still queued
    device_mask = staging.to_device(view)
    for _ in range(bitmask_staging.SLOTS):  # the last take is of the same slot, its copy still queued
        again = staging.take(64)
        again.zero_()
    assert again.data_ptr() != view.data_ptr()  # a new buffer, not the one being read
    assert torch.equal(device_mask.cpu(), pattern)
    torch.cuda.synchronize()
    staging.take(64)
    assert not staging._retired  # the replaced buffer is let go once its copy has completed


def test_a_cache_hit_neither_checks_nor_compiles_again(structured, monkeypatch):
    constraint = StructuredOutputsParams(json={**SCHEMA, "title": "hit"})
    first = structured.compile(constraint)
    first.result()
    checks, hits = [], structured.pool.stats.num_cache_hits
    monkeypatch.setattr(structured_outputs, "check", lambda *arguments: checks.append(arguments))
    assert structured.compile(StructuredOutputsParams(json={**SCHEMA, "title": "hit"})) is first
    assert checks == [] and structured.pool.stats.num_cache_hits == hits + 1
    monkeypatch.undo()
    with pytest.raises(ValueError, match="structured_outputs"):  # not cached: checked, named
        structured.compile(StructuredOutputsParams(json='{"type": "object"'))


@pytest.mark.parametrize("files, cores", [({"cpu.max": "350000 100000\n"}, 4), ({"cpu.max": "max 100000\n"}, None),
                                          ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),
                                          ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
                                          ({}, None)])
def test_fill_threads_follow_the_cgroup_quota(tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(str(tmp_path)) == cores
    assert fill_threads() >= 1


def test_batch_sync_on_threads_equals_one_by_one_and_raises_after_every_share(structured):
    from tandem.structured.batch_sync import BatchSync
    from tandem.structured.matcher import GrammarViolation

    outputs = [walk(structured, 6 + index % 5, seed=index) for index in range(16)]
    threaded, serial = [grammar_of(structured) for _ in outputs], [grammar_of(structured) for _ in outputs]
    batch = BatchSync(threads=4)
    try:
        batch.sync(list(zip(threaded, outputs)))
        for grammar, output in zip(serial, outputs):
            grammar.sync(output)
        for one, other, output in zip(threaded, serial, outputs):
            assert one.consumed == output
            assert torch.equal(mask_after(one, structured.vocab_size), mask_after(other, structured.vocab_size))
        grown = [output + walk_from(structured, output) for output in outputs]
        bad = list(grown)
        bad[5] = outputs[5] + forbidden_after(structured, outputs[5])
        with pytest.raises(GrammarViolation):
            batch.sync(list(zip(threaded, bad)))
        for index, (grammar, output) in enumerate(zip(threaded, bad)):  # every other row was brought level
            if index != 5:
                assert grammar.consumed == output
    finally:
        batch.close()


def walk_from(structured, output: list[int]) -> list[int]:
    """One more token the grammar allows after ``output``."""
    grammar = grammar_of(structured)
    grammar.sync(output)
    mask = mask_after(grammar, structured.vocab_size)
    return [next(token for token in range(structured.vocab_size)
                 if (int(mask[0, token // 32]) >> (token % 32)) & 1 and token not in structured.eos_token_ids)]


def forbidden_after(structured, output: list[int]) -> list[int]:
    """A token the grammar does not allow after ``output``."""
    grammar = grammar_of(structured)
    grammar.sync(output)
    mask = mask_after(grammar, structured.vocab_size)
    return [next(token for token in range(structured.vocab_size) if not (int(mask[0, token // 32]) >> (token % 32)) & 1)]


def test_a_schema_keeps_its_property_order():
    """Answers write their keys in the schema's order (as OpenAI's strict mode does), so the
    grammar's source must not reorder the properties; the order is part of the cache key."""
    from tandem.sampling_params import StructuredOutputsParams
    from tandem.structured.source import GrammarSource

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}},
              "required": ["name", "arguments"]}
    reordered = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    source = GrammarSource.of(StructuredOutputsParams(json=schema))
    assert list(json.loads(source.text)["properties"]) == ["name", "arguments"]
    assert source != GrammarSource.of(StructuredOutputsParams(json=reordered))


def test_a_schema_with_integers_past_64_bits_reaches_the_engine_as_its_text():
    """JSON Schema allows any integer; msgpack (the frontend-to-engine messages) holds 64 bits.
    Such a schema travels as its JSON text: the request encodes, and the grammar built on the
    engine's side is the one the schema asks for. A schema within 64 bits stays a dict."""
    import msgspec

    from tandem.protocol import AddRequestMessage, EngineRequest, FrontendMessage
    from tandem.sampling_params import SamplingParams
    from tandem.structured.source import GrammarSource

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2 ** 70}}, "maxProperties": -2 ** 64}
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))
    message = AddRequestMessage(request=EngineRequest(request_id="r", prompt_token_ids=[1], sampling_params=params))
    received = msgspec.msgpack.Decoder(FrontendMessage).decode(msgspec.msgpack.Encoder().encode(message))
    source = GrammarSource.of(received.request.sampling_params.structured_outputs)
    assert json.loads(source.text) == schema and list(json.loads(source.text)) == list(schema)  # keys in order
    assert StructuredOutputsParams(json={"type": "integer", "maximum": 2 ** 63}).json == {"type": "integer",
                                                                                          "maximum": 2 ** 63}
