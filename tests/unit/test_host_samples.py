"""``benchmarks/host_samples.py``: py-spy's raw stacks summed per thread (a child process's
threads apart from its parent's), inclusive shares and own time by the innermost project line."""
from benchmarks.host_samples import read_samples, report

PARENT = 'process 10:"python3 -m benchmarks.offline"'
CHILD = 'process 11:"python3 -m tandem.engine.ranks.worker 1 2"'
RAW = f"""{PARENT};thread (10): MainThread;main (benchmarks/offline.py:1);EngineCore.step (tandem/engine/core.py:9);PlanChannel.send (tandem/engine/ranks/plan.py:184) 30
{PARENT};thread (10): MainThread;main (benchmarks/offline.py:1);EngineCore.step (tandem/engine/core.py:9);ModelRunner.forward (tandem/worker/model_runner.py:5);JITFunction.run (triton/runtime/jit.py:700) 50
{PARENT};thread (10): MainThread;main (benchmarks/offline.py:1);OutputProcessor.process (tandem/frontend/output_processor.py:3) 20
{PARENT};thread (12): tandem-tp-watch;_wait_any (tandem/engine/ranks/launcher.py:90) 100
{PARENT};{CHILD};thread (11): MainThread;PlanChannel.receive (tandem/engine/ranks/plan.py:189) 40
{PARENT};{CHILD};thread (11): MainThread;ModelRunner.forward (tandem/worker/model_runner.py:5) 60
not a sample line
"""


def test_samples_sum_per_thread_with_own_lines_and_inclusive_shares():
    threads = read_samples(RAW.splitlines())
    assert sorted(thread.total for thread in threads.values()) == [100, 100, 100]
    rank0 = threads[f"{PARENT};thread (10): MainThread"]
    assert rank0.inclusive["EngineCore.step"] == 80 and rank0.inclusive["ModelRunner.forward"] == 50
    # a library frame (the Triton launch) is charged to the project line that called it
    assert rank0.own["ModelRunner.forward (tandem/worker/model_runner.py:5)"] == 50
    assert rank0.own["PlanChannel.send (tandem/engine/ranks/plan.py:184)"] == 30
    rank1 = threads[f"{PARENT};{CHILD};thread (11): MainThread"]
    assert rank1.inclusive["PlanChannel.receive"] == 40 and "PlanChannel.send" not in rank1.inclusive
    text = report(threads, top=3, count=2, focus=["PlanChannel.send"])
    # the watcher, on one line all along, is not among the two busiest
    assert "tandem-tp-watch" not in text and "thread (11): MainThread" in text
    assert " 30.0%  PlanChannel.send (inclusive)" in text and " 50.0%  ModelRunner.forward (tandem" in text
