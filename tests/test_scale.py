"""Planning 10M samples stays within 4 GB (issue: reliability at scale). Runs bench/plan/plan_scale.py in a fresh
process so the peak RSS is the planner's plus the samples'. About 2 minutes on 2 cores."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_ten_million_samples_plan_within_4gb():
    out = subprocess.run([sys.executable, "bench/plan/plan_scale.py", "--samples", "10000000", "--ranks", "1024"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["samples_planned"] == 10_000_000
    assert row["peak_rss_MiB"] < 4096, row
    assert row["idle_fraction"] <= 0.03, row
