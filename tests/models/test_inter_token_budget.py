"""SLO-aware chunked prefill (``max_itl_ms``): the online step-time fit, the prefill cap it
implies, the scheduler applying it (hand-fed step times, so every case is deterministic), and
the engine staying exact against transformers with the cap on (it changes chunking only)."""
from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.entrypoints.cli import build_parser
from tandem.kv.coordinator import StateCoordinator
from tandem.kv.planner import allocate_buffers, plan_pools
from tandem.kv.registry import StateRegistry
from tandem.kv.spec import FullAttentionSpec
from tandem.sampling_params import SamplingParams as Params
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.sequence import Sequence
from tandem.scheduler.step_time import HostStepClock, InterTokenBudget, StepTimeModel
from tests.support.oracle import assert_matches

PAGE_SIZE = 4
# A step costs 2 ms plus 0.1 ms per token: a 10 ms gap target leaves room for 80 tokens a step.
INTERCEPT, SLOPE = 0.002, 0.0001


def feed_line(record, intercept: float = INTERCEPT, slope: float = SLOPE) -> None:
    """Steps of 1 to 1,000 tokens, timed exactly on the line, given to ``record(tokens, seconds)``."""
    for tokens in (1, 3, 8, 40, 200, 1000):
        record(tokens, intercept + slope * tokens)


def test_step_time_model_fits_and_follows_drift():
    model = StepTimeModel()
    assert model.line() is None and model.max_tokens_within(0.01) is None  # nothing seen yet
    model.observe(16, INTERCEPT + SLOPE * 16)
    model.observe(17, INTERCEPT + SLOPE * 17)  # the same bucket: still one point
    assert model.line() is None
    feed_line(model.observe)
    intercept, slope = model.line()
    assert intercept == pytest.approx(INTERCEPT, rel=0.05) and slope == pytest.approx(SLOPE, rel=0.05)
    assert model.max_tokens_within(0.010) == pytest.approx(80, abs=4)
    assert model.max_tokens_within(0.001) == 0  # even an empty step is over
    # the steps get twice as slow: the running means follow within some tens of steps
    for _ in range(30):
        feed_line(model.observe, 2 * INTERCEPT, 2 * SLOPE)
    assert model.predict(500) == pytest.approx(2 * (INTERCEPT + SLOPE * 500), rel=0.02)
    falling = StepTimeModel()
    falling.observe(1, 0.010)
    falling.observe(100, 0.001)
    assert falling.line() is None  # a falling line predicts nothing


def test_slow_steps_of_other_causes_do_not_starve_prefill():
    """A step slow for a reason other than its size (the first of its size compiled a kernel)
    must not keep the cap at one page: a bucket's first steps keep their fastest, a later spike
    counts at most SPIKE_FACTOR times the mean, and a bucket left unmeasured leaves the fit."""
    from tandem.scheduler.step_time import SPIKE_FACTOR, STALE_STEPS

    on_line = InterTokenBudget(0.010, min_prefill_tokens=PAGE_SIZE)
    feed_line(on_line.observe)
    fair = on_line.prefill_tokens(num_decode_tokens=20, token_budget=512)
    # the first 1,000-token step took a second; the next two of that size were on the line
    budget = InterTokenBudget(0.010, min_prefill_tokens=PAGE_SIZE)
    budget.observe(1000, 1.0)
    for tokens in (1, 3, 8, 40, 200):
        budget.observe(tokens, INTERCEPT + SLOPE * tokens)
    assert budget.prefill_tokens(num_decode_tokens=20, token_budget=512) < fair // 2  # believed, for now
    budget.observe(1000, INTERCEPT + SLOPE * 1000)
    assert budget.prefill_tokens(num_decode_tokens=20, token_budget=512) == pytest.approx(fair, abs=2)
    # an established bucket: one spike moves its mean by at most BUCKET_WEIGHT x (SPIKE_FACTOR - 1)
    before = budget.model.predict(1000)
    budget.observe(1000, 5.0)
    assert budget.model.predict(1000) < before * (1 + 0.2 * (SPIKE_FACTOR - 1)) + 1e-9
    # a spike seeded a bucket and the cap then kept steps small: only small steps are measured
    stuck = InterTokenBudget(0.010, min_prefill_tokens=PAGE_SIZE)
    stuck.observe(1000, 1.0)
    stuck.observe(1, INTERCEPT + SLOPE)
    assert stuck.prefill_tokens(num_decode_tokens=20, token_budget=512) == PAGE_SIZE
    for step in range(STALE_STEPS + 1):
        tokens = (1, 24)[step % 2]
        stuck.observe(tokens, INTERCEPT + SLOPE * tokens)
    assert 1000 .bit_length() not in stuck.model.buckets  # gone from the fit
    assert stuck.prefill_tokens(num_decode_tokens=20, token_budget=512) == pytest.approx(fair, abs=2)


def test_the_cap_follows_the_steps_with_prefill():
    """Decode-only steps replay a graph; a step with a prompt chunk costs more than its tokens
    say beside them. The cap predicts steps with prefill from those steps alone once they come
    in two sizes (every step's line until then)."""
    budget = InterTokenBudget(0.010, min_prefill_tokens=PAGE_SIZE)
    for tokens in (1, 8, 16):  # decode-only steps, on the line
        budget.observe(tokens, INTERCEPT + SLOPE * tokens)
    budget.observe(500, 0.003 + INTERCEPT + SLOPE * 500, with_prefill=True)
    every_step = budget.prefill_tokens(num_decode_tokens=20, token_budget=512)
    # one size of steps with prefill, no line of its own yet: a step in proportion to it
    assert every_step == int(0.010 * 500 / (0.003 + INTERCEPT + SLOPE * 500)) - 20
    budget.observe(100, 0.003 + INTERCEPT + SLOPE * 100, with_prefill=True)
    # a prefill step carries 3 ms more: 30 fewer tokens fit in 10 ms than the every-step line allowed
    assert budget.prefill_tokens(num_decode_tokens=20, token_budget=512) == pytest.approx(80 - 30 - 20, abs=2)
    assert every_step > 80 - 30 - 20 + 5


def test_off_a_gpu_a_step_runs_from_its_scheduling_or_the_last_read_back(monkeypatch):
    """Off a GPU a step has finished when its launch returns: from its scheduling, or the
    previous read-back where that came later (it waited behind that step), to its read-back."""
    import tandem.scheduler.step_time as step_time

    now = iter([1.010, 1.030, 1.050])
    monkeypatch.setattr(step_time.time, "perf_counter", lambda: next(now))
    clock = HostStepClock()
    assert clock.interval(1.000) == pytest.approx(0.010)
    assert clock.interval(1.000) == pytest.approx(0.020)  # scheduled before the previous read-back
    assert clock.interval(1.045) == pytest.approx(0.005)


def test_a_long_run_of_one_size_keeps_two_points():
    """Stale buckets leave the fit only while two remain: a long run of decode-only steps of one
    size (a full batch) must not leave one point, no line, and so no cap."""
    from tandem.scheduler.step_time import STALE_STEPS

    budget = InterTokenBudget(0.010, min_prefill_tokens=PAGE_SIZE)
    feed_line(budget.observe)
    for _ in range(2 * STALE_STEPS):
        budget.observe(16, INTERCEPT + SLOPE * 16)
    assert len(budget.model.buckets) == 2 and 16 .bit_length() in budget.model.buckets
    assert budget.prefill_tokens(num_decode_tokens=20, token_budget=512) == pytest.approx(80 - 20, abs=2)


def test_prefill_allowance():
    budget = InterTokenBudget(0.010, min_prefill_tokens=PAGE_SIZE)
    assert budget.prefill_tokens(num_decode_tokens=5, token_budget=512) == 512  # no fit yet: no cap
    feed_line(budget.observe)
    assert budget.prefill_tokens(num_decode_tokens=0, token_budget=512) == 512  # nothing waits on the step
    allowed = budget.prefill_tokens(num_decode_tokens=20, token_budget=512)
    assert allowed == budget.model.max_tokens_within(0.010) - 20 and 50 < allowed < 70
    assert budget.prefill_tokens(num_decode_tokens=20, token_budget=32) == 32
    # every step's line alone (no steps with prefill in two sizes yet): at least a page
    assert budget.prefill_tokens(num_decode_tokens=500, token_budget=512) == PAGE_SIZE
    feed_line(lambda tokens, seconds: budget.observe(tokens, seconds, with_prefill=True))
    # the steps with prefill say not even a page beside the decodes fits the target: every step
    # with prefill misses it, so prefill takes the whole budget (the fewest steps miss it), and
    # the warning says so once
    assert budget.prefill_tokens(num_decode_tokens=500, token_budget=512) == 512 and budget.out_of_reach
    within = budget.model.max_tokens_within(0.010)
    assert budget.prefill_tokens(num_decode_tokens=within - PAGE_SIZE + 1, token_budget=512) == 512
    assert budget.prefill_tokens(num_decode_tokens=within - PAGE_SIZE, token_budget=512) == PAGE_SIZE
    assert not budget.out_of_reach
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_itl_ms"):
            InterTokenBudget(bad, PAGE_SIZE)
        with pytest.raises(ValueError, match="max_itl_ms"):
            EngineConfig(model="unused", max_itl_ms=bad)
    with pytest.raises(SystemExit):  # the serve flag: argparse names it
        build_parser().parse_args(["serve", "--max-itl-ms", "0"])
    assert build_parser().parse_args(["serve", "--max-itl-ms", "25"]).max_itl_ms == 25.0


def make_scheduler(max_itl_ms, max_num_batched_tokens: int = 512) -> Scheduler:
    registry = StateRegistry()
    registry.register("attention", FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32))
    registry.finalize()
    plan = plan_pools(registry, PAGE_SIZE, max_total_tokens=8192, memory_budget_bytes=None, max_num_seqs=64)
    allocate_buffers(registry, plan, torch.device("cpu"))
    coordinator = StateCoordinator(registry, plan, enable_prefix_caching=False, sanitize=True)
    return Scheduler(coordinator, max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens,
                     max_itl_ms=max_itl_ms)


def add(scheduler: Scheduler, name: str, prompt_length: int, order: int) -> Sequence:
    sequence = Sequence(request_id=name, index=0, token_ids=list(range(3, 3 + prompt_length)),
                        num_prompt_tokens=prompt_length, params=Params(max_tokens=1000),
                        state=scheduler.coordinator.new_state(f"{name}#0"), arrival_order=order, max_tokens=1000)
    scheduler.add(sequence)
    return sequence


def run_step(scheduler: Scheduler) -> dict[str, int]:
    """Schedule one step and book it as computed (a sampled token appended): tokens per sequence."""
    output = scheduler.schedule()
    for chunk in output.chunks:
        scheduler.on_computed(chunk)
        if chunk.samples:
            chunk.sequence.token_ids.append(7)
    return {chunk.sequence.request_id: chunk.num_new_tokens for chunk in output.chunks}


def test_scheduler_caps_prefill_beside_decodes_only():
    scheduler = make_scheduler(max_itl_ms=10.0)
    decodes = [add(scheduler, f"decode{number}", 8, number) for number in range(20)]
    assert run_step(scheduler) == {sequence.request_id: 8 for sequence in decodes}  # no fit yet: all of them
    feed_line(scheduler.record_step)
    allowed = scheduler.inter_token_budget.model.max_tokens_within(0.010) - 20
    add(scheduler, "long", 300, 20)
    add(scheduler, "second", 300, 21)
    step = run_step(scheduler)
    assert all(step[sequence.request_id] == 1 for sequence in decodes)  # decodes are never cut
    assert step["long"] == allowed and "second" not in step  # the long prompt takes what is left
    step = run_step(scheduler)
    assert step["long"] == allowed and "second" not in step  # a running prompt's chunks are capped too
    for sequence in decodes:  # the decodes end: nothing waits on the step any more
        scheduler.finish(sequence, "stop")
    step = run_step(scheduler)
    assert step == {"long": 300 - 2 * allowed, "second": 300}  # the whole budget (512) again
    for sequence in list(scheduler.running):
        scheduler.finish(sequence, "stop")
    scheduler.coordinator.sanitizer.check_all_free(scheduler.coordinator)


def test_scheduler_caps_down_to_a_page_then_gives_up_on_a_target_out_of_reach():
    scheduler = make_scheduler(max_itl_ms=2.55)  # one decode and one page: 2 ms + 5 x 0.1 ms
    feed_line(scheduler.record_step)
    decode = add(scheduler, "decode", 5, 0)
    run_step(scheduler)
    add(scheduler, "long", 100, 1)
    add(scheduler, "short", 3, 2)
    for _ in range(3):
        step = run_step(scheduler)
        assert step["decode"] == 1 and step["long"] == PAGE_SIZE and "short" not in step  # one page a step
    feed_line(lambda tokens, seconds: scheduler.record_step(tokens, seconds, with_prefill=True))
    scheduler.inter_token_budget.max_itl_seconds = 0.001  # below the 2 ms of an empty step
    assert run_step(scheduler) == {"decode": 1, "long": 100 - 3 * PAGE_SIZE, "short": 3}  # the whole budget
    plain = make_scheduler(max_itl_ms=None)
    feed_line(plain.record_step)  # recorded steps change nothing without a target
    assert plain.inter_token_budget is None
    add(plain, "decode", 5, 0)
    run_step(plain)
    add(plain, "long", 100, 1)
    assert run_step(plain) == {"decode": 1, "long": 100}
    for owner in (scheduler, plain):
        for sequence in list(owner.running) + list(owner.waiting):
            owner.finish(sequence, "stop")
        owner.coordinator.sanitizer.check_all_free(owner.coordinator)
    assert decode.is_finished


def run_capped_engine(model_dir, oracle, **options) -> tuple[list, list]:
    """Four prompts (two long) through an engine whose target leaves room for 20 tokens a step
    (the fed line's): every step with running decodes takes 20 tokens less the decodes of prompt. The fit is fed the line instead of the engine's
    measured times (real timings would make the chunking vary from run to run). Checks the outputs
    against the oracle; returns the steps (decoding sequences, prefill tokens, tokens) and the
    measured (tokens, seconds)."""
    rng = random.Random(26)
    prompts = [[rng.randrange(3, 500) for _ in range(length)] for length in (5, 150, 9, 90)]
    llm = LLM(model=model_dir, page_size=16, max_total_tokens=2048, max_num_batched_tokens=64, max_num_seqs=8,
              max_itl_ms=(INTERCEPT + SLOPE * 20.5) * 1e3, **options)
    scheduler = llm.engine.scheduler
    measured, steps = [], []

    def record_step(num_tokens, seconds, with_prefill=False):
        measured.append((num_tokens, seconds, with_prefill))
        scheduler.inter_token_budget.observe(num_tokens, INTERCEPT + SLOPE * num_tokens)

    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        decoding = sum(1 for sequence in scheduler.running if sequence.num_tokens - sequence.num_computed_tokens == 1)
        output = schedule(*args, **kwargs)
        if output is not None and output.chunks:
            steps.append((decoding, sum(chunk.num_new_tokens for chunk in output.chunks if chunk.num_new_tokens > 1),
                          output.num_tokens))
        return output

    scheduler.record_step, scheduler.schedule = record_step, recording_schedule
    feed_line(scheduler.inter_token_budget.observe)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True),
                           use_tqdm=False)
    for number, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert_matches(output.outputs[0], oracle.greedy(prompt, 12), context=f"prompt {number}")
    capped = [prefill for decoding, prefill, _ in steps if decoding and prefill]
    assert len(capped) >= 8 and max(capped) <= 20, steps  # prompts went 20 tokens a step less the decodes
    assert steps[0] == (0, 64, 64), steps  # nothing decoding yet: the whole budget
    assert measured and all(seconds > 0 for _, seconds, _ in measured)
    llm.engine.check_all_free()
    return steps, measured


@pytest.mark.parametrize("overlapped", [False, True], ids=["one-step", "overlapped"])
def test_engine_stays_exact_with_the_cap_on(overlapped, model_dirs, oracles):
    """The cap changes chunking only: tokens and logprobs still match transformers, with the
    plain loop and with the overlapped one (step N+1 scheduled before step N is read back, as on
    CUDA)."""
    steps, measured = run_capped_engine(model_dirs["llama"], oracles["llama"], async_scheduling=overlapped)
    # every step timed but the process's first (it compiles), the steps holding a prompt chunk told apart
    assert [(tokens, with_prefill) for tokens, _, with_prefill in measured] == [
        (tokens, prefill > 0) for _, prefill, tokens in steps[1:]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_overlapped_loop_stays_exact_with_the_cap_on(model_dirs, oracles, monkeypatch):
    """On CUDA the overlapped loop schedules step N+1 while step N runs, and decodes replay CUDA
    graphs; the capped chunking still matches transformers (logprobs within 1e-3: GPU reduction
    order differs)."""
    import tests.support.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "LOGPROB_TOLERANCE", 1e-3)
    steps, measured = run_capped_engine(model_dirs["llama"], oracles["llama"], device="cuda", dtype="float32")
    # the device times every step, those with a prompt chunk too (the host's read-backs could not)
    assert [(tokens, with_prefill) for tokens, _, with_prefill in measured] == [
        (tokens, prefill > 0) for _, prefill, tokens in steps[1:]]


def test_prefill_steps_of_one_size_do_not_keep_the_cap_where_it_is():
    """Before steps with prefill come in two sizes the cap allows a step in proportion to the
    latest of them (its seconds per token): one under the target lets the next step grow, one
    over it shrinks it, so another size is measured and their line forms. Every step's line alone
    (here through slow large steps: 36 ms at no tokens, as a compile-slowed step can make it) would
    hold prefill to a page a step, every such step of one size, and the line would never form."""
    budget = InterTokenBudget(0.025, min_prefill_tokens=PAGE_SIZE)
    for tokens, seconds in ((512, 0.0397), (2048, 0.0508)):
        budget.observe(tokens, seconds)
    assert budget.prefill_tokens(num_decode_tokens=12, token_budget=2048) == PAGE_SIZE
    budget.observe(28, 0.014, with_prefill=True)  # 14 ms for 28 tokens: under the target
    assert budget.prefill_tokens(num_decode_tokens=12, token_budget=2048) == int(0.025 * 28 / 0.014) - 12
    assert int(0.025 * 28 / 0.014) > 28
    budget.observe(2048, 0.055, with_prefill=True)  # a second size: their own line from here on
    assert budget.prefill_tokens(num_decode_tokens=12, token_budget=2048) == \
        budget.prefill_model.max_tokens_within(0.025) - 12 > 100
    alone = InterTokenBudget(0.025, min_prefill_tokens=PAGE_SIZE)
    alone.observe(2048, 0.055, with_prefill=True)  # the only one, over the target: a smaller step next
    assert alone.prefill_tokens(num_decode_tokens=12, token_budget=2048) == int(0.025 * 2048 / 0.055) - 12


def test_the_cap_reaches_the_engine_stats_and_metrics(model_dirs):
    """``--max-itl-ms`` engines report the target, the steps it held back and the fit on
    ``/metrics``; engines without it report none of it."""
    from tandem.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(model=model_dirs["llama"], page_size=16, max_total_tokens=2048, max_num_batched_tokens=64,
              max_num_seqs=8, max_itl_ms=(INTERCEPT + SLOPE * 20.5) * 1e3)
    budget = llm.engine.scheduler.inter_token_budget
    budget.observe = lambda tokens, seconds, with_prefill=False: InterTokenBudget.observe(
        budget, tokens, INTERCEPT + SLOPE * tokens, with_prefill)  # the line, not this machine's times
    feed_line(lambda tokens, seconds: InterTokenBudget.observe(budget, tokens, seconds, with_prefill=True))
    llm.generate([[5, 6, 7], list(range(3, 150))], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.engine.stats().inter_token_budget
    assert stats.target_seconds == pytest.approx((INTERCEPT + SLOPE * 20.5)) and not stats.out_of_reach
    # the first step had no decode (3 + 61 tokens, uncapped); then 147 - 61 = 86 prompt tokens went
    # 19 a step beside the short prompt's decode: four steps used their allowance, the fifth took 10
    assert stats.num_capped_steps == 4
    assert stats.intercept_seconds == pytest.approx(INTERCEPT) and stats.seconds_per_token == pytest.approx(SLOPE)
    text = ServerMetrics(lambda: llm.engine.stats()).render().decode()
    assert f"tandem:itl_capped_steps_total {float(stats.num_capped_steps)}" in text
    assert "tandem:itl_target_out_of_reach 0.0" in text and "tandem:itl_step_seconds_per_token " in text
    plain = LLM(model=model_dirs["llama"], page_size=16, max_total_tokens=512)
    assert plain.engine.stats().inter_token_budget is None
    assert "itl_" not in ServerMetrics(lambda: plain.engine.stats()).render().decode()
