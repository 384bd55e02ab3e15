"""bench/lora/lora_bench.py --state on the CPU (the tiny model): a part cut short by one command's time limit resumes in
the next from its saved adapters and optimizer state, and its rows count every trained step."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(steps, state, out):
    cmd = [sys.executable, "bench/lora/lora_bench.py", "--smoke", "--parts", "14b", "--steps", str(steps), "--state",
           state, "--budget-s", "300", "--out", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_part_resumes_from_its_state_and_counts_every_step(tmp_path):
    state = str(tmp_path / "state")
    _run(1, state, str(tmp_path / "a"))
    first = json.load(open(os.path.join(state, "14b.json")))
    assert first["trained"] == 2 and len(first["step_s"]) == 1 and first["processes"] == 1
    saved = torch.load(os.path.join(state, "14b", "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    assert saved and all("lora_" in k for k in saved)  # the adapters only, not the frozen base

    # in a process of its own (it sets up torch.distributed): a new engine takes back the saved state (DeepSpeed's
    # step count and the adapters; the warm-up learning rate is ~0 here, so the adapters alone could not tell)
    check = (f"import sys, torch; sys.path.insert(0, 'bench/lora'); import lora_bench as lb\n"
             f"args = lb.parse_args(['--smoke', '--out', {str(tmp_path / 'b')!r}, '--state', {state!r}])\n"
             f"engine = lb.build(lb.PARTS['14b'], args)[0]\n"
             f"print(engine.global_steps)\n"
             f"print(lb.resume(engine, {state!r}, '14b'))\n"
             f"print(engine.global_steps)\n"
             f"saved = torch.load({os.path.join(state, '14b', 'mp_rank_00_model_states.pt')!r}, "
             f"weights_only=False)['module']\n"
             f"now = {{k: v for k, v in engine.module.state_dict().items() if k in saved}}\n"
             f"print('same' if now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved) "
             f"else 'differ')\n")
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip().splitlines()[-4:] == ["0", str(first), "2", "same"], proc.stderr[-2000:]

    _run(2, state, str(tmp_path / "c"))
    second = json.load(open(os.path.join(state, "14b.json")))
    assert second["trained"] == 4 and second["step_s"][:1] == first["step_s"] and second["processes"] == 2
    rows = {r["metric"]: r for r in __import__("csv").DictReader(open(tmp_path / "c" / "results-staging.csv"))}
    assert float(rows["steps without OOM"]["value"]) == 4 and "2 processes" in rows["MFU"]["note"]
    # the count left after every step, for a process that its machine's limit cuts off before the rows are written
    progress = json.load(open(tmp_path / "c" / "lora-14b-progress.json"))
    assert progress["trained"] == 4 and progress["step_s"] == second["step_s"] and progress["processes"] == 2
