"""The clock sampler the latency benchmark prints beside its prefill figures: it reads what
``nvidia-smi`` prints while the block runs, and says so when there is no ``nvidia-smi``."""
import os
import stat
import time

from benchmarks.gpu_clocks import ClockSampler, Sample, parse_samples, summarise


def test_samples_are_parsed_and_summarised():
    text = "1980, 551.39, 700.00\n[N/A], [N/A], 700.00\n1380, 678.50, 700.00\nWarning: something\n1455, 708.19, 700.00\n"
    samples = parse_samples(text)
    assert samples == [Sample(1980, 551.39, 700), Sample(1380, 678.5, 700), Sample(1455, 708.19, 700)]
    assert summarise(samples) == ("SM clock 1,380-1,980 MHz (median 1,455); power up to 708 W (limit 700 W); "
                                  "3 samples")


def test_sampler_reads_nvidia_smi_while_the_block_runs(tmp_path, monkeypatch):
    """A stand-in ``nvidia-smi`` on PATH prints two samples, then waits to be stopped: the sampler
    stops it when the block ends and keeps what it printed (its arguments name the device)."""
    program = tmp_path / "nvidia-smi"
    program.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/arguments"\n'
                       'echo "1500, 690.0, 700.0"\necho "1320, 701.5, 700.0"\nexec sleep 30\n')
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    with ClockSampler(device_index=1, interval_ms=100) as sampler:
        time.sleep(0.5)
    assert time.monotonic() - started < 10  # stopped, not waited for
    assert sampler.samples == [Sample(1500, 690, 700), Sample(1320, 701.5, 700)]
    assert "SM clock 1,320-1,500 MHz" in sampler.summary()
    assert (tmp_path / "arguments").read_text().split()[:2] == ["-i", "1"]


def test_without_nvidia_smi_nothing_is_sampled(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with ClockSampler() as sampler:
        pass
    assert sampler.samples == [] and sampler.summary() == "SM clock not sampled (no nvidia-smi output)"
