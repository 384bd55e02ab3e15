"""Single-process units of the training glue: derive_ds_config (the one place a DeepSpeed JSON is derived)
and the failure agreement's messages (failures.py)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train import config, failures
from tests.launcher import master_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_JSON = os.path.join(ROOT, "configs", "ds_tiny_cpu.json")


def test_derive_ds_config_overrides_and_leaves_the_base_alone(tmp_path):
    base = json.load(open(TINY_JSON))
    before = json.dumps(base, sort_keys=True)
    ds = config.derive_ds_config(base, zero_stage=2, grad_accum=4, dp=3, sp=2, bf16=True,
                                 adaptive_load={"policy": "dual", "on_oom": None}, monitor_path=tmp_path / "m",
                                 steps_per_print=None, wall_clock_breakdown=True)
    assert json.dumps(base, sort_keys=True) == before  # a deep copy
    assert ds["zero_optimization"] == {**base["zero_optimization"], "stage": 2}
    assert (ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (4, 1, 12)
    assert ds["sequence_parallel_size"] == 2 and ds["bf16"] == {"enabled": True}
    assert ds["adaptive_load"]["policy"] == "dual" and "on_oom" not in ds["adaptive_load"]
    assert ds["adaptive_load"]["profile"] == base["adaptive_load"]["profile"]
    assert ds["csv_monitor"] == {**base["csv_monitor"], "output_path": str(tmp_path / "m")}
    assert "steps_per_print" not in ds and ds["wall_clock_breakdown"] is True
    assert "sequence_parallel_size" not in config.derive_ds_config(ds, sp=1)


def test_derive_ds_config_from_a_path_is_what_the_trainer_loads(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config.derive_ds_config(TINY_JSON, grad_accum=3,
                                                       adaptive_load={"profile": os.path.join(
                                                           ROOT, "configs", "profiles", "tiny-cpu.yaml")})))
    ds, al = config.load_ds_config(path)
    assert ds["gradient_accumulation_steps"] == 3 and al.policy == "packed"
    with pytest.raises(UserError, match="cannot read DeepSpeed config"):
        config.derive_ds_config(str(tmp_path / "missing.json"))


def test_agreement_without_a_process_group():
    failures.agree(None)
    with pytest.raises(failures.AgreedError, match="^step 3, rank 0: x$"):
        failures.agree("step 3, rank 0: x")
    assert failures.agreed(lambda a: a + 1, 1) == 2

    def bad():
        raise UserError("Traceback (most recent call last):\n  ...\nds_adaptiveload.errors.UserError: f.jsonl:3: no")
    with pytest.raises(failures.AgreedError, match="^f.jsonl:3: no$"):  # a worker's wrapped error: its last line
        failures.agreed(bad)


@pytest.mark.parametrize("key,module,pip", [("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb"),
                                            ("comet", "comet_ml", "comet_ml>=3.41.0")])
def test_a_monitor_without_its_package_is_named_when_the_config_is_read(tmp_path, monkeypatch, key, module, pip):
    """tensorboard enabled and not installed failed 89 s into a run, inside deepspeed.initialize on rank 0, among C++
    stack dumps. Now loading the config names the key and the package; disabled or installed, it loads."""
    missing = set()
    monkeypatch.setattr(config, "module_installed", lambda name: name not in missing)
    cfg = config.derive_ds_config(TINY_JSON, adaptive_load={"profile": os.path.join(ROOT, "configs", "profiles",
                                                                                  "tiny-cpu.yaml")})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**cfg, key: {"enabled": True, "output_path": str(tmp_path)}}))
    config.load_ds_config(path)  # installed
    missing.add(module)
    with pytest.raises(UserError) as e:
        config.load_ds_config(path)
    assert str(e.value) == (f"{path}: {key}.enabled is true but the {module} package is not installed: "
                            f"pip install '{pip}', or set {key}.enabled to false")
    path.write_text(json.dumps({**cfg, key: {"enabled": False}}))
    config.load_ds_config(path)


def test_a_failure_before_any_checkpoint_does_not_advise_resume(tmp_path):
    """A lost peer's line advised `--resume OUTPUT/checkpoints` before any checkpoint existed."""
    from types import SimpleNamespace

    from ds_adaptiveload.train.trainer import Trainer

    ckpt = tmp_path / "out" / "checkpoints"
    run = SimpleNamespace(ckpt_dir=str(ckpt), args=SimpleNamespace(resume=None), start=0)
    assert "--resume" not in Trainer.relaunch_advice(run) and "starts from step 0" in Trainer.relaunch_advice(run)
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step2")
    assert Trainer.relaunch_advice(run) == f"Relaunch with --resume {ckpt} (docs/reliability.md)"
    old = tmp_path / "old"  # resumed from another folder, no save of this run yet
    old.mkdir()
    (old / "latest").write_text("global_step4")
    run = SimpleNamespace(ckpt_dir=str(tmp_path / "new"), args=SimpleNamespace(resume=str(old)), start=4)
    assert Trainer.relaunch_advice(run) == f"Relaunch with --resume {old} (docs/reliability.md)"
    assert "--resume" not in failures.RELAUNCH


def test_combined_messages_are_one_line():
    assert failures.combine([None, "a", "a", "b"]) == "a; b"
    assert failures.combine(["m1", "m2", "m3", "m4", "m5"]) == "m1; m2; m3 (and 2 more)"


@pytest.fixture
def signals_back():
    """report() holds SIGTERM and SIGCHLD (failures.hold_signals): give this process its handlers back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGCHLD)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_report_prints_one_line_and_returns_the_code(capsys, signals_back):
    assert failures.report(failures.AgreedError("step 2, rank 1: bad")) == failures.EXIT_USER_ERROR
    assert capsys.readouterr().err == "error: step 2, rank 1: bad\n"
    assert failures.report(failures.Terminated(), step=4) == failures.EXIT_TERMINATED
    assert capsys.readouterr().err.startswith("error: step 4: stopped by SIGTERM")
    with pytest.raises(KeyError):  # a bug keeps its traceback
        failures.report(KeyError("x"))


_PEER_RUN = """
import sys
import torch.distributed as dist
sys.path.insert(0, {root!r})
from ds_adaptiveload.train import failures
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
code = failures.report(RuntimeError("[gloo] Connection reset by peer: 127.0.0.1:4242\\nmore text"), step=3)
dist.destroy_process_group()
sys.exit(code)
"""


def _raised_while_handling(*errors):
    """errors[-1] raised while errors[-2] was handled, and so on: the chain a signal leaves behind."""
    for older, newer in zip(errors, errors[1:]):
        newer.__context__ = older
    return errors[-1]


_WORKER_ENDED = "DataLoader worker (pid 4242) is killed by signal: Terminated. "


def test_report_names_the_first_error_when_a_signal_lands_during_its_handling(capsys, signals_back):
    """The launcher SIGTERMs a rank's workers, then the rank: either signal can raise anew while an error is handled.
    The first error is reported; a bug raised while handling a known error keeps its traceback."""
    import signal
    import sys

    e = _raised_while_handling(failures.AgreedError("step 2, rank 0: bad"), failures.Terminated(),
                               RuntimeError(_WORKER_ENDED))
    assert failures.first_cause(e).__class__ is failures.AgreedError
    assert failures.report(e, step=2) == failures.EXIT_USER_ERROR
    assert capsys.readouterr().err == "error: step 2, rank 0: bad\n"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # held until the rank has left
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    for e in (RuntimeError(_WORKER_ENDED), _raised_while_handling(failures.Terminated(), RuntimeError(_WORKER_ENDED))):
        assert failures.report(e, step=4) == failures.EXIT_TERMINATED
        assert capsys.readouterr().err.startswith("error: step 4: stopped by SIGTERM")
    class Bar:  # the error line must start a line: the bar is closed first
        def close(self):
            print("<bar closed>", file=sys.stderr)
    assert failures.report(failures.Terminated(), step=4, bar=Bar()) == failures.EXIT_TERMINATED
    assert capsys.readouterr().err.startswith("<bar closed>\nerror: step 4: stopped by SIGTERM")
    with pytest.raises(KeyError):  # a bug in the handling code
        failures.report(_raised_while_handling(failures.AgreedError("x"), KeyError("y")))
    # a worker killed otherwise (the OOM killer) is no SIGTERM, and no bad input: the retryable code, one line
    assert failures.report(RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed."), step=3) == \
        failures.EXIT_PEER_LOST
    assert capsys.readouterr().err == ("error: step 3, rank 0: DataLoader worker (pid 1) is killed by signal: Killed.; "
                                       "the data is not at fault: Relaunch (docs/reliability.md)\n")


_LAUNCHER_KILL = """
import functools, os, signal, sys, time
import torch
import torch.distributed as dist
from tqdm import tqdm
sys.path.insert(0, {root!r})
from ds_adaptiveload.train import failures
from ds_adaptiveload.train.setup import end_loop

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        time.sleep(0.01)
        return i

def launcher_kills():  # its order: every child of the rank first, then the rank
    for w in it._workers:
        os.kill(w.pid, signal.SIGTERM)
    time.sleep({pause})
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep({pause})

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
signal.signal(signal.SIGTERM, failures.on_sigterm)
it = iter(torch.utils.data.DataLoader(Slow(), num_workers=2,
                                      worker_init_fn=functools.partial(failures.die_with_parent, os.getpid())))
bar = tqdm(total=5, desc="train")
next(it)
bar.update(3)
try:
    try:
        try:
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")  # the collective, a peer gone
        finally:
            if {during_handling}:
                launcher_kills()
    finally:
        if not {during_handling}:
            launcher_kills()  # a SIGTERM here cuts the loop's finally short: the bar is still open
        end_loop(it, bar.close)
except BaseException as e:
    code = failures.report(e, 4, bar)
failures.teardown()
sys.exit(code)
"""


@pytest.mark.parametrize("pause,during_handling", [(0.0, True), (0.3, True), (0.3, False)])
def test_the_launchers_sigterms_during_a_peer_failure_leave_one_line(pause, during_handling):
    """The CI failure of test_rank_killed_mid_step_...: after a peer died, the launcher SIGTERMed the survivor's
    DataLoader worker and then the survivor, while it handled the failed collective. The worker's death raised
    "DataLoader worker ... killed by signal: Terminated" over Terminated over the collective's error, and the rank
    printed a traceback. A SIGTERM in the loop's `finally` left the progress bar open, and the error line ran on
    from the bar's. Now: the collective's error is reported, one line at the start of a line, exit 3."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _LAUNCHER_KILL.format(root=ROOT, port=master_port(), pause=pause,
                                                                       during_handling=during_handling)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == failures.EXIT_PEER_LOST, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert [x for x in lines if x.startswith("error:")] == [
        "error: step 4: another rank stopped answering (a collective failed); rank 0 stops too. Relaunch "
        "(docs/reliability.md)"], proc.stderr[-3000:]
    assert all(x.startswith(("error:", "note:")) for x in lines if "error:" in x or "note:" in x), proc.stderr[-3000:]


_DEAD_WORKER_HOLDS_LOCK = """
import faulthandler, multiprocessing as mp, os, signal, sys
import torch
sys.path.insert(0, {root!r})
from ds_adaptiveload.train.setup import end_loop

class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 100
    def __getitem__(self, i):
        return i

it = iter(torch.utils.data.DataLoader(Items(), num_workers=2))
next(it)
done = it._workers_done_event
def die_holding_it():  # a worker the launcher's SIGTERM ends inside done_event.is_set()
    done._cond.acquire()
    os.kill(os.getpid(), signal.SIGKILL)
p = mp.Process(target=die_holding_it)
p.start()
p.join()
faulthandler.dump_traceback_later(30, exit=True)  # a hang prints where, and fails the test
try:
    try:
        raise RuntimeError("the collective failed")
    finally:
        end_loop(it)
except RuntimeError as e:
    print("left with:", e, [w.is_alive() for w in it._workers])
"""


def test_a_failing_rank_leaves_its_loader_when_a_dead_worker_holds_a_lock():
    """The hang of one suite run: a DataLoader worker ended inside its done event's lock leaves that lock held, and
    the iterator's own shutdown (which sets the event) waited forever. A failing rank kills its workers instead."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _DEAD_WORKER_HOLDS_LOCK.format(root=ROOT)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "left with: the collective failed [False, False]" in proc.stdout, proc.stderr[-3000:]


def test_a_failed_collective_with_every_peer_alive_says_what_failed():
    """A peer failure while every rank still runs (nothing to name): the error line as before, and a note with the
    collective's own first line from each rank, so a flaky start-up says what broke."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _PEER_RUN.format(root=ROOT, port=master_port())], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == failures.EXIT_PEER_LOST, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert "note: rank 0: the collective failed with: RuntimeError: [gloo] Connection reset by peer: 127.0.0.1:4242" \
        in lines, proc.stderr[-3000:]
    assert [x for x in lines if x.startswith("error:")] == [
        "error: step 3: another rank stopped answering (a collective failed); rank 0 stops too. Relaunch "
        "(docs/reliability.md)"]


def test_compile_cache_argument_is_checked_before_training(tmp_path):
    from types import SimpleNamespace

    from ds_adaptiveload.errors import UserError
    from ds_adaptiveload.train.setup import check_compile_cache

    ok = str(tmp_path / "cache.bin")
    check_compile_cache(SimpleNamespace(compile_cache=None, compile_blocks=False))
    check_compile_cache(SimpleNamespace(compile_cache=ok, compile_blocks=True))
    for path, blocks, msg in ((ok, False, "only used with --compile-blocks"), (str(tmp_path), True, "is a folder"),
                              (str(tmp_path / "no" / "c.bin"), True, "does not exist or is not writable")):
        with pytest.raises(UserError, match=msg) as err:
            check_compile_cache(SimpleNamespace(compile_cache=path, compile_blocks=blocks))
        assert path in str(err.value)


def test_profile_for_run_moves_memory_to_the_run_and_warns_on_sp_or_stage():
    """A ZeRO-2 run planning with the ZeRO-3 2-rank calibrated profile: on one rank its memory is moved to ZeRO-2
    there (a smaller budget) and rank 0 is told, with a warning that the time terms are ZeRO-3's; another sp
    is warned of; a matching run, or a profile that cannot say what it was calibrated for, is left alone."""
    from types import SimpleNamespace

    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train.config import zero_stage
    from ds_adaptiveload.train.setup import profile_for_run

    path = os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero3.yaml")
    z3 = CostProfile.load(path)
    zero2 = zero_stage(json.load(open(os.path.join(ROOT, "configs", "ds_zero2_bf16.json"))))
    one, two = (SimpleNamespace(sp=1, world=w) for w in (1, 2))
    moved, (note, warn) = profile_for_run(z3, zero2, one, path)
    assert zero2 == 2 and moved.budget_tokens < z3.budget_tokens and moved.meta["zero_stage"] == 2
    assert note.startswith(path) and "ZeRO-3 on 2 rank(s) to this run's ZeRO-2 on 1" in note
    assert "time terms were measured under ZeRO-3" in warn
    assert profile_for_run(z3, 3, two) == (z3, [])
    same, (w,) = profile_for_run(z3, 3, SimpleNamespace(sp=2, world=2))
    assert same is z3 and "calibrated for sp=1, this run has sp=2" in w
    tiny = CostProfile.load(os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml"))  # no meta.zero_stage
    assert profile_for_run(tiny, 2, one) == (tiny, [])


@pytest.mark.parametrize("stage,mode", [(2, "auto"), (3, "auto-step")])
def test_prepare_data_plans_the_recompute_of_checkpoint_blocks_auto(tmp_path, stage, mode):
    """--checkpoint-blocks auto with a profile that has the open-block and recompute fields: the sampler's plan costs
    the recompute (auto; auto-step under ZeRO-3) and the checkpoint layout records it; without the flag neither."""
    from types import SimpleNamespace

    from ds_adaptiveload.data import latents
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.mixes import make_mix
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train.setup import prepare_data, read_config

    tiny = CostProfile.load(os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml"))
    tiny.memory.update(capacity_bytes=4e6, safety=0.9, fixed_bytes=1e6, bytes_per_token=1e4, block_bytes_per_token=1e3)
    tiny.recompute_frac, tiny.meta = 0.25, {"model": {"num_layers": 2}}
    tiny.to_yaml(str(tmp_path / "p.yaml"))
    ds = json.load(open(TINY_JSON))
    ds["adaptive_load"]["profile"] = str(tmp_path / "p.yaml")
    ds["zero_optimization"] = {"stage": stage}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    model = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
    manifest = latents.write_synthetic(str(tmp_path / "d"), make_mix("tiny", 16, 0), text_dim=model.text_dim,
                                       max_text_len=model.text_len, dtype="fp32")
    for blocks, want in (("auto", mode), (True, "all")):
        args = SimpleNamespace(deepspeed_config=str(tmp_path / "ds.json"), model_config="configs/wan_tiny.yaml",
                               fault=None, checkpoint_blocks=blocks, checkpoint_policy="full", compile_blocks=False,
                               compile_cache=None, resume=None)
        c = read_config(args, 1, 0)
        d = prepare_data(args, manifest, c, 1, 0)
        assert d.sampler.cfg.checkpoint == want
        auto = blocks == "auto"
        assert d.layout.get("checkpoint") == ({"checkpoint": mode, "checkpoint_policy": "full"} if auto else None)
        pred = d.sampler.plan.pred_ms  # the plan the sampler deals from
        if auto:
            costed = pred
    assert sum(map(sum, costed)) < sum(map(sum, pred))  # some micro-batches open blocks: less recompute predicted


def test_single_process_env_takes_a_free_port_outside_the_fixed_ones(monkeypatch):
    """A one-process run (calibrate, bench/mfu.py in this very process) gets the launcher's variables on a port the
    kernel hands out as free: its ephemeral range, which holds none of the suite's fixed ports (295xx-297xx). The
    pid-derived port before was one of them in some runs, and its store, alive to the end of the suite, made a later
    launch on it fail with EADDRINUSE."""
    import socket

    from ds_adaptiveload.train.engine import single_process_env

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    single_process_env()
    port = int(os.environ["MASTER_PORT"])
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    assert low <= port <= high and not 29500 <= port < 29800, port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # still free
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    single_process_env()
    assert os.environ["MASTER_PORT"] == "29999"  # what the user or a launcher set stays


def test_prepare_data_passes_pack_tokens_to_the_plan_and_the_layout(tmp_path):
    """adaptive_load.pack_tokens reaches the sampler's plan (its micro-batches within the cap) and the resume layout;
    unset, the layout has no such key, as checkpoints written before it existed."""
    from types import SimpleNamespace

    from ds_adaptiveload.data import latents
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.mixes import make_mix
    from ds_adaptiveload.train.setup import prepare_data, read_config

    model = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
    manifest = latents.write_synthetic(str(tmp_path / "d"), make_mix("tiny", 24, 0), text_dim=model.text_dim,
                                       max_text_len=model.text_len, dtype="fp32")
    for cap in (None, 100):
        ds = json.load(open(TINY_JSON))
        ds["adaptive_load"].update(pack_tokens=cap)
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        args = SimpleNamespace(deepspeed_config=str(tmp_path / "ds.json"), model_config="configs/wan_tiny.yaml",
                               fault=None, checkpoint_blocks=False, checkpoint_policy="full", compile_blocks=False,
                               compile_cache=None, resume=None)
        c = read_config(args, 1, 0)
        d = prepare_data(args, manifest, c, 1, 0)
        plan = d.sampler.plan
        assert plan.pack_tokens == (c.profile.budget_tokens if cap is None else min(cap, c.profile.budget_tokens))
        assert ("pack_tokens" in d.layout["adaptive_load"]) == (cap is not None)
        if cap is not None:
            assert plan.pack_tokens < c.profile.budget_tokens, "the tiny profile's budget must be above the cap"
            mem = c.profile.mem_tokens
            assert all(sum(mem(plan.tokens[i]) for i in mb) <= cap for st in plan.steps for mbs in st for mb in mbs
                       if len(mb) > 1)


def test_trainer_warns_when_the_profile_was_calibrated_with_other_compiled_blocks():
    """The shipped ZeRO-2 profile was calibrated with compiled regions: a run without --compile-blocks (or with
    block) is told; auto (= regions) and a profile that does not record it are left alone."""
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train.setup import compile_mismatch

    path = os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero2.yaml")
    z2 = CostProfile.load(path)
    assert z2.meta["compile_blocks"] == "regions"
    assert compile_mismatch(z2, "regions") == compile_mismatch(z2, "auto") == []
    (line,) = compile_mismatch(z2, None, path)
    assert line.startswith(f"warning: {path} was calibrated with --compile-blocks regions, this run has no "
                           f"--compile-blocks")
    assert "this run has --compile-blocks block" in compile_mismatch(z2, "block")[0]
    eager = CostProfile.load(os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero3.yaml"))
    assert "compile_blocks" not in eager.meta and compile_mismatch(eager, "regions") == []
    eager.meta = {**eager.meta, "compile_blocks": "none"}
    assert compile_mismatch(eager, None) == [] and "calibrated with no --compile-blocks" in compile_mismatch(
        eager, "auto")[0]


def test_trainer_warns_when_the_profile_was_calibrated_with_other_attention_kernels():
    """The shipped H200 profiles ran SDPA: a run whose --attention resolves to fa4 is told, one on sdpa is not; a
    profile that records no backend, or the unresolved flag auto, is left alone."""
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train.setup import attention_mismatch

    path = os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero2.yaml")
    z2 = CostProfile.load(path)
    assert z2.meta["attention"] == "sdpa" and attention_mismatch(z2, "sdpa", path) == []
    (line,) = attention_mismatch(z2, "fa4", path)
    assert line.startswith(f"warning: {path} was calibrated with --attention sdpa, this run's attention is fa4")
    for recorded in (None, "auto"):
        z2.meta = {k: v for k, v in z2.meta.items() if k != "attention"} | ({"attention": recorded} if recorded else {})
        assert attention_mismatch(z2, "fa4") == []


def test_attention_is_compared_with_the_profile_after_agreement_only_for_auto_on_a_gpu():
    """read_config checks the profile's kernels itself except under --attention auto on a GPU, where the trainer
    checks the kernels the ranks agreed on."""
    import torch
    from ds_adaptiveload.train.setup import agree_attention_later

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert agree_attention_later(SimpleNamespace(attention="auto"), gpu)
    assert not agree_attention_later(SimpleNamespace(attention="auto"), cpu)
    assert not agree_attention_later(SimpleNamespace(attention="auto"), None)
    for flag in ("sdpa", "fa4"):
        assert not agree_attention_later(SimpleNamespace(attention=flag), gpu)
    assert not agree_attention_later(SimpleNamespace(), gpu)  # an own loop's args without the flag: sdpa


@pytest.mark.parametrize("policy", ["attention", "full"])
def test_checkpoint_for_sets_the_ffn_blocks_the_memory_model_gives(policy):
    """--checkpoint-blocks auto, not ZeRO-3: the loader's MicroBatch carries (k, k_full, k_ffn) from schedule/memory
    (checkpoint_ks and ffn_blocks, on this rank's tokens), the trainer passes them to the model
    (WanModel.set_checkpointing), the step log's ckpt_k is the triple when blocks keep FFN outputs, and the
    predicted peak counts them; under the full policy no block keeps one."""
    from types import SimpleNamespace

    from ds_adaptiveload.loader import AdaptiveLoader
    from ds_adaptiveload.model.wan import WanModel
    from ds_adaptiveload.schedule.memory import checkpoint_ks, ffn_blocks, predicted_peak_bytes
    from ds_adaptiveload.train.trainer import Trainer

    L, tokens = 30, 200_000
    mem = {"capacity_bytes": 100e9, "safety": 1.0, "fixed_bytes": 20e9, "bytes_per_token": 160e3,
           "block_bytes_per_token": 80e3, "attention_bytes_per_token": 5e3, "ffn_bytes_per_token": 3e3}
    cfg = SimpleNamespace(checkpoint="auto", checkpoint_policy=policy, sp=1)
    geometry = SimpleNamespace(tokens=lambda f, h, w: tokens // 2)  # two samples of tokens / 2
    sampler = SimpleNamespace(samples=[None, None], profile=SimpleNamespace(geometry=geometry), cfg=cfg)
    loader = AdaptiveLoader(sampler, None, None, {}, 1, None, None, memory_model=(mem, L))
    loader._tokens = lambda indices: [tokens // 2] * len(indices)
    (ks,) = loader._checkpoints(SimpleNamespace(micro_batches=[[0, 1]], all_micro_batches=[[[0, 1]]]))
    mb = SimpleNamespace(checkpoint=ks, tokens=[tokens // 2] * 2)
    tr = Trainer.__new__(Trainer)
    tr.dims, tr.profile, tr.model_cfg = SimpleNamespace(sp=1), SimpleNamespace(memory=mem), SimpleNamespace(num_layers=L)
    model = SimpleNamespace()
    model.set_checkpointing = lambda *a: WanModel.set_checkpointing(model, *a)
    tr.engine = SimpleNamespace(module=model)
    tr.checkpoint_for(mb)
    k, k_full = checkpoint_ks(tokens, 2, mem, L, policy)
    k_ffn = ffn_blocks(tokens, 2, mem, L, k, k_full)
    assert (model.checkpoint_blocks, model.checkpoint_full_blocks, model.checkpoint_ffn_blocks) == (k, k_full, k_ffn)
    assert (k_ffn > 0) == (policy == "attention")
    assert tr._step_ks == [[k, k_full, k_ffn] if k_ffn else [k, k_full]]
    assert tr._pred_peak_gib == pytest.approx(predicted_peak_bytes(tokens, 2, mem, L, k, k_full, k_ffn) / 2**30)


def test_the_exit_codes_docs_list_are_the_codes_failures_returns():
    """docs/reliability.md's exit-code table holds every code failures.py returns, and its entry-point table names no
    other code (besides the launcher's 247 for a SIGKILLed rank)."""
    import re

    text = open(os.path.join(ROOT, "docs", "reliability.md")).read()
    table = text[text.index("| exit code | meaning |"):text.index("### Every multi-rank entry point")]
    listed = {int(m) for m in re.findall(r"^\| (\d+)", table, re.M)}
    ours = {0, failures.EXIT_FAILED, failures.EXIT_USER_ERROR, failures.EXIT_PEER_LOST, failures.EXIT_TERMINATED}
    assert ours <= listed and listed - ours == {247}, listed
    entry = text[text.index("| entry point |"):text.index("A script of your own")]
    rows = [r for r in entry.splitlines()[2:] if r.startswith("|")]
    assert {r.split("|")[1].strip().split(" ")[0] for r in rows} == {"`train`", "`calibrate`", "`encode`", "loader"}
    for row in rows:
        codes = {int(c) for c in re.findall(r"\b(\d{1,3})\b", row.split("|")[-2])}
        assert codes <= listed, row


WATCHER_SCRIPT = r"""
import os, signal, sys, time, types
from ds_adaptiveload.train import failures

class GoneStore:  # rank 0's store after its process left: every read fails, so the watcher is done at once
    def set(self, *a): raise RuntimeError("store gone")
    def check(self, *a): raise RuntimeError("store gone")

failures._dist = lambda: types.SimpleNamespace(get_world_size=lambda: 2)
failures._store = lambda: GoneStore()
failures._rank = lambda: 1
signal.signal(signal.SIGTERM, lambda *a: None)
failures._watch_sigterm()
for _ in range(3):  # the group's SIGTERM, then the launcher's forwarded one, and one more
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
print("alive", failures._seen["thread"].is_alive())
"""


def test_sigterm_watcher_takes_repeated_signals_without_a_traceback():
    """A rank gets a group SIGTERM twice (the signal, then the launcher's forwarded copy); once the watcher had done
    its work, its socket's read end was collected and the second signal's write failed: Python printed "Exception
    ignored when trying to write to the signal wakeup fd" with a traceback on stderr (1 stress run in 4)."""
    proc = subprocess.run([sys.executable, "-c", WATCHER_SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert "alive True" in proc.stdout  # still draining: later signals' bytes never fill the socket
