"""scripts/gpu_check.py --smoke: the GPU check's every code path, on the CPU, so that the one
command a lent GPU runs is known to work before it runs there."""

import json
import subprocess
import sys

import pytest
from helpers import ENV, ROOT


@pytest.mark.slow  # (two minutes beside the rest of the fast tier: it runs every part)
def test_the_gpu_check_runs_on_the_cpu_and_its_correctness_rows_pass(tmp_path):
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--out",
                             str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["check"]: row for row in report["rows"]}
    assert report["smoke"] and report["device"] == "CPU"
    # Every part ran: correctness (judged), the save, the speed runs, the loop's overhead.
    correct = [row for row in report["rows"] if row["group"] == "correct"]
    assert [row["ok"] for row in correct if row["ok"] is not None] == [True] * 3
    assert "torch.equal: True" in rows["… resumed with --deterministic == uninterrupted"]["value"]
    assert {"save", "speed"} <= {row["group"] for row in report["rows"]}
    # The loop's ratio: kit and bare processes alternated, the spread of the pairs and steps.
    loop = rows["kit's step ÷ bare loop (bench_loop.py)"]["value"]
    assert "(pairs: min " in loop and "2 kit + 2 bare processes alternated" in loop, loop
    assert rows["… step ms, kit; bare loop (min / median / max of the processes)"]["value"]
    assert "eager: kit's pipeline ÷ random tokens" in rows
    # The table on stdout holds the same rows.
    assert all(f"| {row['check']} |" in result.stdout for row in report["rows"])
