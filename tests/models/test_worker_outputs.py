"""The engine core keeps the books and no tensors: rank 0's worker returns host values.

One overlapped engine run (prompt logprobs over a chunked prompt, sampled logprobs, seeded forks,
greedy rows): every output the executor hands back for a step is host data (the prompt logprobs
its worker computed from the logits it kept), the step in flight holds no tensor but its tokens'
copy to the host (rank 0's worker keeps the tokens the next step reads, and the plan names the
rows they go to), and the outputs equal ``transformers``'s and the one-step loop's."""
from __future__ import annotations

import dataclasses
import random
import types

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.engine import step_planner
from tandem.step_context import StepContext
from tandem.worker.graph_choice import GraphChoice
from tandem.worker.model_runner import ModelRunner
from tandem.worker.sampler import HostSamplerOutput
from tests.support.engines import GREEDY, check_outputs, make_llm, random_prompt
from tests.support.oracle import assert_position

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def tensors_in(value, path: str = "value", seen: set | None = None) -> list[str]:
    """The paths of every tensor reachable from ``value``: through containers, dataclasses and
    the project's objects (their attributes), and functions' closures."""
    seen = set() if seen is None else seen
    if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool, np.ndarray)):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [path]
    found = []
    if isinstance(value, dict):
        items = [(f"{path}[{key!r}]", item) for key, item in value.items()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
    elif isinstance(value, types.FunctionType):
        items = [(f"{path}.<closure {index}>", cell.cell_contents)
                 for index, cell in enumerate(value.__closure__ or ())]
    elif isinstance(value, HostSamplerOutput):  # the copy to the host: on the host
        return [] if value.packed.device.type == "cpu" else [f"{path}.packed"]
    elif dataclasses.is_dataclass(value) or type(value).__module__.startswith("tandem."):
        attributes = dict(getattr(value, "__dict__", {}))
        for name in getattr(type(value), "__slots__", ()) or ():
            attributes[name] = getattr(value, name, None)
        if hasattr(type(value), "__struct_fields__"):  # msgspec structs
            attributes.update({name: getattr(value, name) for name in type(value).__struct_fields__})
        items = [(f"{path}.{name}", item) for name, item in attributes.items()]
    else:
        return []
    for item_path, item in items:
        found += tensors_in(item, item_path, seen)
    return found


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_the_worker_returns_host_values(model_dirs, oracles, device):
    engine_options = dict(max_num_batched_tokens=32, max_num_seqs=8, device=device, dtype="float32")
    llm = make_llm(model_dirs["llama"], async_scheduling=True, **engine_options)
    engine = llm.engine
    outputs = []
    execute_step = engine.executor.execute_step

    def recording_execute_step(plan, *arguments):
        output = execute_step(plan, *arguments)
        outputs.append((plan, output))
        return output

    engine.executor.execute_step = recording_execute_step
    step = engine.step
    in_flight = []

    def checking_step(*arguments):
        deltas = step(*arguments)
        launched = engine._in_flight
        if launched is not None:
            in_flight.append(launched)
            # The core holds no tensor between steps: the step in flight, the planner's caches.
            held = tensors_in(launched, "the step in flight") + tensors_in(engine.planner.page_table_rows, "rows")
            assert not held, held
        return deltas

    engine.step = checking_step
    # The step planner chooses graphs from host values the worker gave it at start-up.
    assert isinstance(engine.planner.graphs, GraphChoice) and not tensors_in(engine.planner.graphs, "graphs")
    assert not any(isinstance(value, ModelRunner) for value in vars(step_planner).values())
    assert not any(isinstance(value, ModelRunner) for value in vars(engine.planner).values())
    rng = random.Random(31)
    prompt = random_prompt(rng, 45)  # two chunks of prompt logprobs (32 tokens a step)
    requests = {
        "prompt": (prompt, SamplingParams(max_tokens=3, prompt_logprobs=3, **GREEDY)),
        "forks": (random_prompt(rng, 12), SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=6, logprobs=2,
                                                          ignore_eos=True)),
        "greedy": (random_prompt(rng, 7), SamplingParams(max_tokens=8, **GREEDY)),
    }
    results = llm.generate([token_ids for token_ids, _ in requests.values()],
                           [params for _, params in requests.values()], use_tqdm=False)
    engine.check_all_free()

    # Every step's output came back as host values (no tensor reachable from it).
    assert len(outputs) > 5
    for number, (plan, output) in enumerate(outputs):
        assert not tensors_in(output, f"step {number}'s output"), tensors_in(output, f"step {number}'s output")
        assert len(output.prompt_logprobs) == len(plan.prompt_logit_ranges) == len(plan.prompt_targets)
    assert len(in_flight) > 5
    # Decode rows read the tokens the worker sampled in the step before: the plan names the
    # sample row of each (a steady batch: the same rows; after forks and finished rows, others).
    pending = [plan for plan, _ in outputs if plan.pending_targets]
    assert len(pending) > 3 and all(plan.inputs_from_root for plan in pending)
    assert all(len(plan.pending_targets) == len(plan.pending_sources) for plan in pending)
    assert any(plan.pending_sources != plan.pending_targets for plan in pending)
    assert any(plan.pending_sources == plan.pending_targets for plan in pending)  # (one slice copy)
    ranges = [(plan, index) for plan, _ in outputs for index in range(len(plan.prompt_logit_ranges))]
    assert len(ranges) == 2 and all(plan.prompt_top[index] == 3 for plan, index in ranges)
    assert [token for plan, index in ranges for token in plan.prompt_targets[index]] == prompt[1:]

    # The prompt logprobs the worker computed equal the oracle's.
    positions = results[0].prompt_logprobs
    assert positions[0] is None and len(positions) == len(prompt)
    oracle_logprobs = oracles["llama"].prompt_logprobs(prompt)
    for position in range(1, len(prompt)):
        assert prompt[position] in positions[position]
        assert_position(positions[position], oracle_logprobs[position - 1], 3, f"prompt position {position}")
    assert all(len(choice.logprobs) == len(choice.token_ids) for choice in results[1].outputs)
    check_outputs(results[2:], [requests["greedy"][0]], 8, oracles["llama"], "greedy")
    # The same tokens and logprobs as the one-step loop (seeded sampling included).
    # (On CUDA the two loops' batches may replay graphs of other sizes: the tokens are compared.)
    plain = make_llm(model_dirs["llama"], async_scheduling=False, **engine_options)
    again = plain.generate([token_ids for token_ids, _ in requests.values()],
                           [params for _, params in requests.values()], use_tqdm=False)
    as_values = lambda outputs: [[(choice.token_ids, [sorted((t, lp.logprob) for t, lp in entry.items())
                                                      for entry in choice.logprobs or []] if device == "cpu" else [])
                                  for choice in output.outputs] for output in outputs]
    assert as_values(results) == as_values(again)


SPECULATION = {"llama": dict(speculative_model="same", num_speculative_tokens=2),
               "deepseek_v3": dict(speculative_method="mtp", num_speculative_tokens=2)}


@pytest.mark.parametrize("arch", sorted(SPECULATION))
def test_speculation_is_messages_to_the_worker(arch, model_dirs, oracles):
    """While speculating, the engine core hands rank 0's worker host-only messages and books the
    host values they return: the verification (the verdicts) and the proposer's draft passes and
    proposal ends (the drafts); the drafts' distributions, the proposal's device drafts and an MTP
    layer's hidden inputs stay with the worker (under their sequence's key, dropped when it ends),
    and no sequence's speculation state holds a tensor. The step context names no model runner
    nor sampler. Greedy rows equal transformers (a draft model identical to the target; a random
    MTP layer)."""
    speculation = dict(SPECULATION[arch])
    if speculation.get("speculative_model") == "same":
        speculation["speculative_model"] = model_dirs[arch]
    llm = make_llm(model_dirs[arch], max_num_batched_tokens=32, max_num_seqs=8, **speculation)
    engine = llm.engine
    assert not {"runner", "sampling"} & set(StepContext.__annotations__)
    verified, passes, ends, drawn_keys, sequences = [], [], [], set(), {}
    executor = engine.executor
    verify, draft_pass, end_proposal = executor.verify, executor.draft_pass, executor.end_proposal

    def recording_verify(plan):
        drawn_keys.update(key for key in plan.keys if engine.worker.sampling.draft_probs(key) is not None)
        sequences.update((id(sequence), sequence) for sequence in engine.scheduler.live_sequences())
        output = verify(plan)
        verified.append((plan, output))
        return output

    def recording_draft_pass(plan):
        tokens = draft_pass(plan)
        passes.append((plan, tokens))
        return tokens

    def recording_end_proposal(plan):
        output = end_proposal(plan)
        ends.append((plan, output))
        return output

    executor.verify, executor.draft_pass, executor.end_proposal = recording_verify, recording_draft_pass, \
        recording_end_proposal
    rng = random.Random(32)
    prompts = [random_prompt(rng, n) for n in (11, 40)]
    params = [SamplingParams(n=2, temperature=0.9, seed=8, max_tokens=7, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=9, **GREEDY)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_outputs(outputs[1:], prompts[1:], 9, oracles[arch], "greedy while speculating")
    assert all(len(choice.token_ids) == 7 and len(choice.logprobs) == 7 for choice in outputs[0].outputs)
    assert len(verified) > 3 and any(sum(map(len, plan.draft_token_ids)) for plan, _ in verified)
    assert any(any(plan.drawn) for plan, _ in verified)  # the sampled rows' drafts were drawn
    for number, (plan, output) in enumerate(verified):
        found = tensors_in(plan, f"verification {number}") + tensors_in(output, f"verdicts {number}")
        assert not found, found
        assert len(output.token_ids) == len(output.num_accepted) == plan.num_items
    # The proposer's messages and what they return are host values.
    assert len(passes) > 3 and len(ends) > 3
    found = [path for number, (plan, tokens) in enumerate(passes)
             for path in tensors_in(plan, f"draft pass {number}") + tensors_in(tokens, f"drawn {number}")]
    found += [path for number, (plan, output) in enumerate(ends)
              for path in tensors_in(plan, f"proposal end {number}") + tensors_in(output, f"drafts {number}")]
    assert not found, found
    rows = [row for plan, _ in passes for row in plan.rows]
    assert any(row.chained for row in rows) and any(len(row.token_ids) > 1 for row in rows)
    if arch == "deepseek_v3":  # the MTP rows read the target's hidden states the worker kept
        assert all(row.target_rows is not None for row in rows if not row.chained)
    assert any(any(tokens) for _, output in ends for tokens in output.token_ids)
    # The books' speculation state holds no tensor, for live and ended sequences alike.
    assert len(sequences) >= 3
    for number, sequence in enumerate(sequences.values()):
        assert sequence.speculation is not None
        found = tensors_in(sequence.speculation, f"sequence {number}'s speculation state")
        assert not found, found
    assert drawn_keys  # the worker kept drafts' distributions while they were verified ...
    engine.check_all_free()
    assert engine.worker.live_keys() == set()  # ... and dropped them with their sequences
