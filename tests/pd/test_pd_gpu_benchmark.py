"""``benchmarks/pd_gpu.py`` on a CPU: both parts run their steps for both transfer backends (the
figures mean nothing here), and the serving part's greedy outputs through each PD pair equal the
colocated server's. The table's "outputs" column is the benchmark's own comparison; this test
reads it, and that every bandwidth row was measured (no mode failed)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("nixl", "nccl")


def test_pd_gpu_benchmark_runs_on_a_cpu_and_pd_outputs_equal_colocated(tmp_path):
    command = [sys.executable, "-m", "benchmarks.pd_gpu", "--device", "cpu", "--shape", "micro", "--input-len", "64",
               "--rounds", "2", "--requests", "3", "--nccl-variants", "--deadline", "240",
               "--log-directory", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("== PD over GPU memory"):result.stdout.index("rows of part 1")]
    # a row: the label right-aligned in its first 17 characters, then the cells
    rows = {line[:17].strip(): line[17:].split() for line in table.splitlines() if line[:17].strip().startswith(BACKENDS)}
    for backend in BACKENDS:
        cells = rows[backend]
        assert cells[-1] == "equal", f"{backend}: PD outputs differ from the colocated server's: {cells}"
        assert float(cells[-3]) > 0, f"{backend}: no TTFT measured: {cells}"
        measured = [cells for label, cells in rows.items() if label.split()[0] == backend]
        modes = 9 if backend == "nixl" else 8  # (NIXL's own: the PD write described afresh, "nixl described")
        assert len(measured) == modes, f"{backend}: bandwidth modes missing: {sorted(rows)}"
        assert all(cells[0] != "-" for cells in measured), f"{backend}: a bandwidth mode failed:\n{table}"
    assert "failed" not in result.stdout, result.stdout[-3000:]
