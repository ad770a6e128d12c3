"""``benchmarks/goodput.py``: the SLO judgement and goodput arithmetic on hand-made requests, the
Poisson arrivals, and the ``--smoke`` sweep end to end against its stand-in server (which answers
after 5 ms, then a token every 2 ms)."""
from __future__ import annotations

import json

import pytest


from benchmarks import goodput
from benchmarks.serve import RequestRecord


def record(ttft: float, gaps: list[float], ok: bool = True) -> RequestRecord:
    """A request sent at 0 whose tokens came after ``ttft`` and then after each of ``gaps``."""
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(sent=0.0, token_times=times, chunk_gaps=list(gaps), output_tokens=len(times), ok=ok)


def test_slo_judgement_and_goodput():
    slo = goodput.Slo(ttft=1.0, worst_gap=0.05)
    meets = record(0.5, [0.01, 0.02, 0.05])
    late_first = record(1.2, [0.01, 0.01, 0.01])
    one_long_gap = record(0.1, [0.01, 0.2, 0.01])  # mean 73 ms per token, worst 200 ms
    failed = record(0.1, [0.01], ok=False)
    assert slo.met(meets) and not slo.met(late_first) and not slo.met(one_long_gap) and not slo.met(failed)
    assert goodput.Slo(ttft=1.0, tpot=0.1).met(one_long_gap)  # its mean gap is within a TPOT SLO
    assert not goodput.Slo(ttft=1.0, tpot=0.05).met(one_long_gap)
    level = goodput.Level(rate=2.0, concurrency=None, records=[meets, late_first, one_long_gap, failed] + [meets] * 6,
                          duration=5.0)
    summary = goodput.summarize(level, slo, num_gpus=2)
    assert (summary.sent, summary.completed) == (10, 9)
    assert summary.attainment == pytest.approx(0.7)
    assert summary.goodput == pytest.approx(7 / 5.0) and summary.goodput_per_gpu == pytest.approx(0.7)
    assert summary.request_throughput == pytest.approx(9 / 5.0)
    assert summary.worst_gap_p99_ms == pytest.approx(200 - 0.08 * 150, rel=1e-6)  # between 50 and 200 ms
    assert summary.ttft_p50_ms == pytest.approx(500.0)

    def at(rate, attainment):
        return goodput.Summary(f"rate {rate}", rate, None, 10, 10, 1, 1, 1, 1, 1, 1, attainment, 1, 1)

    sweep = [at(1, 1.0), at(2, 0.95), at(4, 0.9), at(8, 0.5), goodput.Summary("conc 32", None, 32, 10, 10, 1, 1, 1,
                                                                              1, 1, 1, 1.0, 1, 1)]
    assert goodput.best_rate(sweep, 0.9).rate == 4  # closed-loop levels have no rate
    assert goodput.best_rate(sweep[3:], 0.9) is None


def test_poisson_arrivals():
    offsets = goodput.poisson_offsets(4000, rate=8.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(1 / 8.0, rel=0.05)  # the mean gap is 1/rate
    assert offsets == goodput.poisson_offsets(4000, rate=8.0, seed=3)  # seeded
    assert goodput.poisson_offsets(5, rate=float("inf"), seed=0) == [0.0] * 5  # all at once


def test_smoke_sweep_end_to_end(tmp_path, capsys):
    path = tmp_path / "summaries.json"
    assert goodput.main(["--smoke", "--json", str(path)]) == 0
    report = capsys.readouterr().out
    summaries = json.loads(path.read_text())
    assert [summary["name"] for summary in summaries] == ["rate 40/s", "rate 80/s", "conc 4"]
    for summary in summaries:
        assert summary["sent"] == summary["completed"] == 16
        assert summary["ttft_p50_ms"] >= 5.0  # the stand-in answers after 5 ms
        assert summary["tpot_p50_ms"] >= 2.0 - 0.5  # and streams a token every 2 ms
        assert summary["goodput"] == pytest.approx(summary["attainment"] * summary["request_throughput"])
    assert "max rate at >= 90% attainment" in report or "no request rate reached 90% attainment" in report
    # a first-token SLO no server meets: nothing attains, and the report says so
    assert goodput.main(["--smoke", "--ttft-slo-ms", "1", "--request-rates", "80", "--concurrency"]) == 0
    report = capsys.readouterr().out
    assert "rate 80/s: 0.0% attainment" in report and "no request rate reached 90% attainment" in report


@pytest.mark.parametrize("flags, message", [
    ([], "--base-url is required"),
    (["--smoke", "--base-url", "http://x"], "leave out --base-url"),
    (["--smoke", "--itl-slo-ms", "0"], "--itl-slo-ms must be > 0"),
    (["--smoke", "--request-rates", "--concurrency"], "nothing to run"),
])
def test_flag_errors_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        goodput.parse_arguments(flags)
    assert message in capsys.readouterr().err
