"""The planner's predicted micro-batch and step times with activation offload (schedule/offload.py): the recompute
the offload saves and the host-copy time it does not hide, worked out by hand; "off" changes nothing."""
import json

import pytest

from ds_adaptiveload.schedule.manifest import Sample
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
from ds_adaptiveload.schedule.profile import CostProfile

L, DIM = 10, 500  # a block input: 500 bf16 values, 1000 bytes per token
TOKENS = 5000  # one 1x800x1600 sample: 1 latent frame of 50 x 100 patches


def _profile(host_bps, **time_ms):
    # all checkpointed: 12,000 B/token, each open block 4,000 more; 100 MB hold 5,000 tokens with 8 checkpointed
    return CostProfile.from_dict({
        "geometry": {"vae_stride": [4, 8, 8], "patch_size": [1, 2, 2]},
        "time_ms": {"fixed": 100.0, "per_token": 0.1, "per_token_sq": 0.0, "step_fixed": 0.0,
                    "recompute_frac": 0.3, **time_ms},
        "memory": {"budget_tokens": 8333, "capacity_bytes": 100e6, "safety": 1.0, "fixed_bytes": 0.0,
                   "bytes_per_token": 12000.0, "block_bytes_per_token": 4000.0, "host_link_bytes_per_s": host_bps},
        "meta": {"model": {"dim": DIM, "num_layers": L}}})


def _samples(n=1):
    return [Sample(f"s{i}", 1, 800, 1600) for i in range(n)]


def _mb_ms(profile, offload, checkpoint="auto", world=1, lockstep=False):
    cfg = PlanConfig("equal-tokens", world_size=world, checkpoint=checkpoint, activation_offload=offload,
                     lockstep=lockstep)
    return make_plan(_samples(world), profile, cfg)


# t = 100 + 0.1 * 5000 = 600 ms with every block checkpointed; one block's forward 0.3 * 600 / 10 = 18 ms.
# off: 8 checkpointed, 2 open: 600 * (1 - 0.3 * 2 / 10) = 564.
# 4 offloaded: 4 x 5 MB off the device, 7 checkpointed: 600 * (1 - 0.3 * 3 / 10) = 546, plus per block the copy out
# (5 MB / link) beyond the 18 ms forward and the copy back beyond the 36 ms backward.
@pytest.mark.parametrize("host_bps, expected", [(1e8, 546 + 4 * ((50 - 18) + (50 - 36))),  # 50 ms copies: 730
                                                (1e9, 546.0),  # 5 ms copies: hidden
                                                (2.5e8, 546 + 4 * (20 - 18))])  # 20 ms: the forward hides 18
def test_offload_replaces_recompute_at_the_models_time(host_bps, expected):
    prof = _profile(host_bps)
    assert _mb_ms(prof, "off").micro_batch_ms(0) == [[pytest.approx(564.0)]]
    plan = _mb_ms(prof, 4)
    assert plan.micro_batch_ms(0) == [[pytest.approx(expected)]]
    assert plan.pred_wall_ms[0] == pytest.approx(expected)


def test_auto_step_and_lockstep_carry_the_offload_time():
    """Under auto-step (ZeRO-3) every micro-batch runs at the step's plan, offload included; lockstep walls sum the
    slowest micro-batch of each round."""
    plan = _mb_ms(_profile(1e8), 4, "auto-step", world=2, lockstep=True)
    assert plan.micro_batch_ms(0) == [[pytest.approx(730.0)], [pytest.approx(730.0)]]
    assert plan.pred_wall_ms == [pytest.approx(730.0)]


def test_fixed_checkpoint_count_adds_the_exposed_copies():
    """A fixed checkpoint count (checkpoint all: timed as every block checkpointed) offloading 3 blocks adds their
    exposed copy time; without recompute_frac no forward is known to hide them: counted whole."""
    assert _mb_ms(_profile(1e8), 3, "all").micro_batch_ms(0) == [[pytest.approx(600 + 3 * (32 + 14))]]
    assert _mb_ms(_profile(1e8, recompute_frac=0.0), 3, "all").micro_batch_ms(0) == [[pytest.approx(600 + 3 * 100)]]
    assert _mb_ms(_profile(1e8), "auto", "all").micro_batch_ms(0) == [[pytest.approx(600.0)]]  # needs auto


def test_auto_picks_the_faster_of_recompute_and_offload():
    assert _mb_ms(_profile(1e8), "auto").micro_batch_ms(0) == [[pytest.approx(564.0)]]  # the copies cost more
    # a free link: 4 offloaded open a third block (3 leave 8 checkpointed, more open none): 546 ms
    assert _mb_ms(_profile(1e12), "auto").micro_batch_ms(0) == [[pytest.approx(546.0)]]


def test_off_is_byte_identical(tmp_path, capsys):
    """plan --json and --dump with --activation-offload off equal those without the flag; with 4 blocks offloaded
    at a slow link the predicted wall time is the hand-worked 730 ms per step."""
    from ds_adaptiveload.cli import main

    prof = tmp_path / "p.yaml"
    _profile(1e8).to_yaml(str(prof))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "frames": 1, "height": 800, "width": 1600}) + "\n"
                                for i in range(4)))
    argv = ["plan", "--manifest", str(manifest), "--profile", str(prof), "--world-size", "2", "--checkpoint", "auto",
            "--policy", "equal-tokens", "--json"]
    out = {}
    for name, extra in (("none", []), ("off", ["--activation-offload", "off"]), ("4", ["--activation-offload", "4"])):
        assert main(argv + extra + ["--dump", str(tmp_path / f"{name}.jsonl")]) == 0
        out[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        out[name].pop("plan_seconds")
    assert out["off"] == out["none"]
    assert (tmp_path / "off.jsonl").read_bytes() == (tmp_path / "none.jsonl").read_bytes()
    assert out["none"]["predicted_wall_s"] == pytest.approx(2 * 0.564)
    assert out["4"]["predicted_wall_s"] == pytest.approx(2 * 0.730)
