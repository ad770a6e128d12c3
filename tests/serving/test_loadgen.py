"""An external load generator (NVIDIA AIPerf, ``benchmarks/loadgen.py``) drives ``tandem serve`` at
fixed input/output lengths; its request and token counts equal the server's ``/metrics`` and its
mean TTFT, ITL and latency agree with the server's histograms. AIPerf lives in a virtual
environment of its own (see ``benchmarks/loadgen.py``): the test runs where ``$TANDEM_AIPERF`` or
``aiperf`` on PATH names it, and is skipped elsewhere."""
import os
import shutil

import pytest


AIPERF = os.environ.get("TANDEM_AIPERF") or shutil.which("aiperf")


@pytest.mark.skipif(AIPERF is None, reason="AIPerf is not installed (set TANDEM_AIPERF)")
def test_aiperf_numbers_agree_with_the_servers_metrics(model_dirs, capsys):
    from benchmarks import loadgen

    status = loadgen.main(["--aiperf", AIPERF, "--model", model_dirs["llama"], "--input-len", "32", "--output-len",
                           "8", "--concurrency", "2", "--requests", "12"])
    report = capsys.readouterr().out
    assert status == 0, report
    assert "requests completed       12.0       12.0  yes" in report
