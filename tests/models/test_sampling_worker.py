"""Rank 0's worker samples (``Worker.sample``, ``engine/ranks/sampling_plan.py``): one engine run
of seeded sampling with forks (n > 1), penalties, min_tokens, a grammar and an unseeded row,
replayed with a plain ``Sampler`` on the same logits. The replay derives every input from the
sequences' final tokens and their requests (penalties over the outputs so far, min_tokens' banned
ids, a generator per sequence seeded ``seed + index``, forks reading their parent's row), never
from the sampling message, so it checks what the engine core puts in the message and what the
worker does with it. The generators of sequences that end (or are aborted) are dropped."""
from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.engine.ranks import sampling_plan
from tandem.protocol import EngineRequest
from tandem.sampling_params import StructuredOutputsParams
from tandem.worker.sampler import Sampler, SamplingMetadata
from tests.support.engines import make_llm, random_prompt

pytestmark = pytest.mark.usefixtures("single_torch_thread")


class Recorder:
    """Each sampling message's rows (the sequences), their outputs so far, the logits each row
    read and the grammar mask, as the engine sampled them."""

    def __init__(self, engine) -> None:
        self.calls: list[dict] = []
        self.messages: list[bytes] = []
        build, sample = engine.sampling_plan, engine.worker.sample

        def recording_plan(sequences, rows=None):
            plan = build(sequences, rows)
            self.calls.append(dict(sequences=list(sequences), outputs=[s.num_output_tokens for s in sequences]))
            return plan

        def recording_sample(plan):
            if plan.num_rows:
                worker_logits = engine.worker.logits
                rows = plan.logits_rows if plan.logits_rows is not None else list(range(plan.num_rows))
                call = self.calls[-1]
                call["logits"] = worker_logits[rows].clone()
                call["rows"] = list(rows)
                call["bitmask"] = None if plan.token_bitmask is None else plan.token_bitmask.copy()
                self.messages.append(sampling_plan.encode(plan))
            return sample(plan)

        engine.sampling_plan, engine.worker.sample = recording_plan, recording_sample


def replay(calls, eos_token_ids, seed: int, device: str) -> int:
    """Sample every recorded step again with a plain ``Sampler``; returns the rows compared."""
    sampler = Sampler(seed=seed, device=device)
    generators: dict[int, torch.Generator] = {}
    compared = 0
    for call in calls:
        sequences = call["sequences"]
        params = [s.params for s in sequences]
        outputs = [s.token_ids[s.num_prompt_tokens:][:count] for s, count in zip(sequences, call["outputs"])]
        for sequence in sequences:
            if sequence.params.seed is not None and id(sequence) not in generators:
                generators[id(sequence)] = torch.Generator(device=device).manual_seed(sequence.params.seed + sequence.index)
        banned = [[] if len(output) >= p.min_tokens else
                  ([] if p.ignore_eos else list(eos_token_ids)) + list(p.stop_token_ids)
                  for output, p in zip(outputs, params)]
        bitmask = None if call["bitmask"] is None else torch.from_numpy(call["bitmask"]).to(device)
        metadata = SamplingMetadata.build(params, [generators.get(id(s)) for s in sequences],
                                          [s.prompt_token_ids for s in sequences], outputs, banned, device,
                                          token_bitmask=bitmask)
        tokens = sampler(call["logits"], metadata).token_ids.tolist()
        for sequence, output, token in zip(sequences, outputs, tokens):
            final = sequence.token_ids[sequence.num_prompt_tokens:]
            if len(output) < len(final):  # (else a row whose token was discarded: it had ended)
                assert token == final[len(output)], (sequence.request_id, sequence.index, len(output))
                compared += 1
    return compared


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_worker_sampling_equals_the_plain_sampler_and_drops_generators(model_dirs, device):
    llm = make_llm(model_dirs["llama"], async_scheduling=True, max_num_batched_tokens=128, max_num_seqs=8,
                   device=device, dtype="float32")
    engine = llm.engine
    recorder = Recorder(engine)
    rng = random.Random(23)
    requests = {
        "forks": SamplingParams(n=3, temperature=0.9, top_p=0.9, top_k=40, seed=3, max_tokens=10, ignore_eos=True),
        "penalties": SamplingParams(temperature=0.8, seed=4, max_tokens=9, presence_penalty=0.5,
                                    frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=4,
                                    stop_token_ids=[7]),
        "grammar": SamplingParams(temperature=1.0, seed=5, max_tokens=12, structured_outputs=StructuredOutputsParams(
            choice=["yes indeed", "no way", "maybe later"])),
        "shared": SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),  # the sampler's generator
        "greedy": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    }
    for name, params in requests.items():
        engine.add_request(EngineRequest(request_id=name, prompt_token_ids=random_prompt(rng, rng.randrange(5, 60)),
                                         sampling_params=params))
    while engine.has_unfinished_requests():
        engine.step()
        # No generator outlives its sequence: every key with one is a live sequence's (the
        # sanitizer's check_books checks it too, after every step of every test).
        live = {s.arrival_order for s in engine.scheduler.live_sequences()}
        assert engine.worker.live_keys() <= live
    engine.check_all_free()
    assert engine.worker.live_keys() == set()

    sequences = {(s.request_id, s.index): s for call in recorder.calls for s in call["sequences"]}
    assert len(sequences) == 7 and all(s.num_output_tokens > 0 for s in sequences.values())
    text = llm.tokenizer.decode(sequences[("grammar", 0)].token_ids[sequences[("grammar", 0)].num_prompt_tokens:],
                                skip_special_tokens=True)
    assert text in ("yes indeed", "no way", "maybe later")
    assert any(call["bitmask"] is not None for call in recorder.calls)
    # Forks read their parent's logits row at the end of the prompt.
    for call in recorder.calls:
        parent_rows = {}
        for sequence, row, count in zip(call["sequences"], call["rows"], call["outputs"]):
            if sequence.request_id == "forks" and count == 0:
                parent_rows.setdefault("forks", row)
                assert row == parent_rows["forks"]
    compared = replay(recorder.calls, engine.model_info.eos_token_ids, engine.config.seed, device)
    assert compared == sum(s.num_output_tokens for s in sequences.values())
    # The messages are host-only and travel as msgpack.
    for payload in recorder.messages:
        plan = sampling_plan.decode(payload)
        assert sampling_plan.encode(plan) == payload
        assert plan.token_bitmask is None or plan.token_bitmask.dtype == np.int32
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"keys": "x"}), type=sampling_plan.SamplingPlan)

    # An aborted request's generators go with it.
    engine.add_request(EngineRequest(request_id="aborted", prompt_token_ids=random_prompt(rng, 20),
                                     sampling_params=SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=40)))
    for _ in range(3):
        engine.step()
    assert len(engine.worker.live_keys()) == 2
    engine.abort_requests(["aborted"])
    assert engine.worker.live_keys() == set()
    engine.check_all_free()
