"""bench/device/run.py on CPU with fake stages: what fits runs (side by side where asked), what does not fit
the budget or lacks its script is skipped and says so, a failing or cut stage is reported, and everything
comes back packed in at most 6 files."""
import importlib.util
import json
import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runner():
    spec = importlib.util.spec_from_file_location("bench_device_run", os.path.join(ROOT, "bench", "device", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _py(code):
    return [[sys.executable, "-c", code]]


def _packed_files(out):
    """{member name: text} of every .tgz the runner left in `out`."""
    members = {}
    for f in os.listdir(out):
        if f.endswith(".tgz"):
            with tarfile.open(out / f) as t:
                members.update({m.name: t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()})
    return members


def test_runner_fits_skips_fails_and_packs(tmp_path, capsys):
    run = _runner()
    S = run.Stage
    write = "import os; open(os.environ['OUT'] + '/result.txt', 'w').write('{}'); print('wrote {}')"
    stages = {
        "fits": S(_py(write.format("a", "a")) + _py("print('second command')"), 20, "fits"),
        "fits2": S(_py(write.format("b", "b")), 20, "fits beside fails"),
        "fits3": S([["{py}", "-c", "import os, sys; print('args', sys.argv[1:], os.environ['TRITON_CACHE_DIR'])"]], 20,
                   "takes --args"),
        "fails": S(_py("import sys; print('boom'); sys.exit(3)"), 20, "fails"),
        "slow": S(_py("import time; print('sleeping', flush=True); time.sleep(60)"), 2, "cut at its limit"),
        "big": S(_py("print('never')"), 10_000, "does not fit"),
        "later": S(_py("print('never')"), 5, "its script is not there", needs_file="bench/no_such_script.py"),
    }
    out = tmp_path / "out"
    # --wheels: a checkout that carries .whl/ for the GPU machine must not make the CPU test install them
    rc = run.main(["--stages", "fits,fits2+fails,big,slow,later,fits3=5", "--out", str(out), "--budget-s", "60",
                   "--wheels", str(tmp_path / "no-wheels"),
                   "--args", "fits3=--x 'a b'"], stages=stages)
    assert rc == 1  # a stage failed
    files = sorted(os.listdir(out))
    assert len(files) <= 6 and {"summary.txt", "report.json"} <= set(files), files
    assert all(f.endswith(".tgz") for f in files if f not in ("summary.txt", "report.json"))
    rep = json.loads((out / "report.json").read_text())
    status = {r["stage"]: r["status"] for r in rep["records"]}
    assert status["fits"] == status["fits2"] == status["fits3"] == "ok"
    assert status["fails"] == "failed (exit 3)"
    assert status["slow"].startswith("timeout")
    assert status["big"].startswith("skipped: needs 10000 s")
    assert status["later"] == "skipped: bench/no_such_script.py not there yet"
    assert sorted(rep["files"]) == files
    # 5 stage folders ran: the 3 largest packed alone, the other 2 together
    members = _packed_files(out)
    assert members["fits/result.txt"] == "a" and members["fits2/result.txt"] == "b"
    assert "second command" in members["fits/stage.log"] and "boom" in members["fails/stage.log"]
    assert "args ['--x', 'a b']" in members["fits3/stage.log"]
    # compile caches of the stage's own: kernels a stage times were not picked for an earlier stage's shapes
    assert os.path.join("dsal-compile-caches", "fits3", "triton") in members["fits3/stage.log"]
    assert {n.split("/")[0] for n in members} == {"fits", "fits2", "fits3", "fails", "slow"}
    summary = (out / "summary.txt").read_text()
    assert "big: skipped: needs 10000 s" in summary and "fails: failed (exit 3)" in summary
    assert "[fits] wrote a" in capsys.readouterr().out  # teed to stdout with the stage's name


def test_stage_table_parses_and_adds_the_build():
    run = _runner()
    groups = run.parse_stages("calib=300+kernel_test,env", run.STAGES)
    assert groups == [[("build", None)], [("calib", 300.0), ("kernel_test", None)], [("env", None)]]
    assert run.parse_stages("env,oom", run.STAGES) == [[("env", None)], [("oom", None)]]
    for st in run.STAGES.values():  # every script a stage names is in the checkout (or registered for later)
        for cmd in st.cmds:
            scripts = [a for a in cmd if a.endswith(".py") and "/" in a]
            assert st.needs_file or all(os.path.exists(os.path.join(ROOT, s)) for s in scripts), cmd


def test_accum_memory_runs_one_process_per_grad_accum(tmp_path):
    """bench/e2e/accum_memory.py on CPU (tiny model, no peak statistics there): one child per G, each running its
    steps of G micro-batches through training's micro_step and engine.step, and the JSON the device stage keeps."""
    out = tmp_path / "accum"
    p = subprocess.run([sys.executable, "bench/e2e/accum_memory.py", "--out", str(out), "--config",
                        "configs/ds_tiny_cpu.json", "--model-config", "configs/wan_tiny.yaml", "--shape", "1x32x32",
                        "--steps", "2", "--ga", "1,2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads((out / "accum-memory.json").read_text())
    assert [r["grad_accum"] for r in doc["runs"]] == [1, 2]
    assert [len(s["micro_peak_bytes"]) for r in doc["runs"] for s in r["steps"]] == [1, 1, 2, 2]
    assert doc["runs"][0]["params"] == doc["runs"][1]["params"] > 0 and set(doc["extra_peak_bytes"]) == {"1", "2"}


def test_run_child_gives_the_child_a_port_of_its_own(monkeypatch):
    """bench/harness.run_child: a MASTER_PORT this process set (an in-process engine's single_process_env, left in
    os.environ with its store still listening) does not reach the child, whose single_process_env then takes a free
    port; before, accum_memory's children failed with EADDRINUSE after tests/test_mfu_bench.py had run."""
    import socket

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from harness import run_child

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        code = ("import json, os; from ds_adaptiveload.train.engine import single_process_env; single_process_env(); "
                "print('PORT ' + json.dumps(int(os.environ['MASTER_PORT'])))")
        got, p = run_child(["-c", code], "PORT ")
    assert p.returncode == 0, p.stderr[-2000:]
    assert isinstance(got, int) and got != port


def test_fa4_libraries_install_from_parts_split_over_two_calls(tmp_path, monkeypatch):
    """--fa4: the CuTe DSL libraries' tar.xz may come in parts, the first left in FA4_PARTS by an earlier call on
    the same machine; they are joined in name order and unpacked once, and every stage gets FA4_SITE and the
    DSL's packages on PYTHONPATH. A missing part is an error naming both places, and the install reports False."""
    import io
    import lzma

    run = _runner()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        data = b"lib" * 1000
        info = tarfile.TarInfo("nvidia_cutlass_dsl/dsl_packages/cutlass/lib.so")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    assert lzma.decompress(blob)
    fa4_dir, parts, site = tmp_path / "fa4", tmp_path / "parts", tmp_path / "site"
    fa4_dir.mkdir(), parts.mkdir()
    (parts / "cu13.tar.xz.part00").write_bytes(blob[:100])
    (fa4_dir / "cu13.tar.xz.part01").write_bytes(blob[100:])
    monkeypatch.setattr(run, "FA4_SITE", str(site))
    monkeypatch.setattr(run, "FA4_PARTS", str(parts))
    (fa4_dir / "flash_attn_4-0-py3-none-any.whl").write_bytes(b"")
    pips = []
    monkeypatch.setattr(run.subprocess, "run", lambda cmd, check: pips.append(cmd))
    env, logged = {"PYTHONPATH": "/x"}, []
    assert run.install_fa4(str(fa4_dir), env, logged.append)
    (pip,) = pips
    assert pip[-1].endswith("flash_attn_4-0-py3-none-any.whl") and pip[pip.index("--target") + 1] == str(site)
    assert (site / "nvidia_cutlass_dsl/dsl_packages/cutlass/lib.so").read_bytes() == data
    assert env["PYTHONPATH"].split(os.pathsep) == [str(site), f"{site}/nvidia_cutlass_dsl/dsl_packages", "/x"]
    (parts / "cu13.tar.xz.part00").unlink()
    (site / ".done").unlink()
    assert not run.install_fa4(str(fa4_dir), {}, logged.append)
    assert "found parts ['cu13.tar.xz.part01']" in logged[-1] and str(parts) in logged[-1]


def test_ref_stages_run_in_the_reference_tree_with_their_own_build(tmp_path):
    """--ref DIR: NAME-ref runs NAME's commands in DIR, DIR's package first on the path, the op JIT-built apart
    (TORCH_EXTENSIONS_DIR), each tree's build in front of its own op stages; a DIR without the package is refused."""
    run = _runner()
    S = run.Stage
    show = ("import os; print('cwd', os.getcwd()); print('path0', os.environ['PYTHONPATH'].split(os.pathsep)[0]); "
            "print('ext', os.environ.get('TORCH_EXTENSIONS_DIR', '-'))")
    stages = {"build": S(_py("print('built')"), 20, "build"), "bench": S(_py(show), 20, "op stage", op=True)}
    ref = tmp_path / "ref"
    (ref / "ds_adaptiveload").mkdir(parents=True)
    (ref / "ds_adaptiveload" / "__init__.py").write_text("")
    both = run.with_ref(stages, str(ref))
    assert run.parse_stages("bench,bench-ref", both) == [[("build", None)], [("build-ref", None)], [("bench", None)],
                                                        [("bench-ref", None)]]
    assert run.parse_stages("bench", both) == [[("build", None)], [("bench", None)]]
    out = tmp_path / "out"
    rc = run.main(["--stages", "bench,bench-ref", "--out", str(out), "--budget-s", "60", "--ref", str(ref),
                   "--wheels", str(tmp_path / "no-wheels")], stages=stages)
    assert rc == 0
    logs = _packed_files(out)
    assert f"cwd {ROOT}\n" in logs["bench/stage.log"] and f"path0 {ROOT}\n" in logs["bench/stage.log"]
    assert f"ext {run.REF_EXTENSIONS}" not in logs["bench/stage.log"]
    assert f"cwd {ref}\n" in logs["bench-ref/stage.log"] and f"path0 {ref}\n" in logs["bench-ref/stage.log"]
    assert f"ext {run.REF_EXTENSIONS}\n" in logs["bench-ref/stage.log"] and "built" in logs["build-ref/stage.log"]
    try:
        run.with_ref(stages, str(tmp_path))
    except SystemExit as e:
        assert "no ds_adaptiveload package" in str(e)
    else:
        raise AssertionError("a tree without the package was taken as --ref")


def test_kernel_compare_tables_two_runs(tmp_path):
    """bench/kernel/compare.py: the rows both runs hold, each stream time of both and its change, the fwd+bwd %;
    rows in one run only are named; a run without rows is refused with its path."""
    def row(B, dtype, fwd, bwd, pct):
        return {"B": B, "S": 1560, "D": 1536, "dtype": dtype, "layout": "sample", "ours_stream_fwd_ms": fwd,
                "ours_stream_bwd_ms": bwd, "ours_stream_fwdbwd_bw%": pct}

    new, ref, sweep = tmp_path / "new.json", tmp_path / "ref.json", tmp_path / "sweep.json"
    new.write_text(json.dumps({"rows": [row(32, "bfloat16", 0.0825, 0.1338, 83.0),
                                        row(64, "bfloat16", 0.16, 0.26, 84.0)]}))
    ref.write_text(json.dumps({"rows": [row(32, "bfloat16", 0.0830, 0.1436, 79.4),
                                        row(300, "float16", 0.74, 1.16, 88.7)]}))
    sweep.write_text(json.dumps({"rows": [], "tiles": [{"B": 32}]}))
    script = os.path.join(ROOT, "bench", "kernel", "compare.py")
    res = subprocess.run([sys.executable, script, str(new), str(ref), "--names", "branch,main"], capture_output=True,
                         text=True, check=True)
    lines = res.stdout.splitlines()
    assert lines[0].startswith("| shape | dtype | layout | fwd branch, us | fwd main, us | change | bwd branch, us")
    assert lines[2] == "| 32x1560x1536 | bf16 | sample | 82.5 | 83.0 | -0.6% | 133.8 | 143.6 | -6.8% | 83.0 / 79.4 |"
    assert lines[-1] == "In one run only: 64x1560x1536 bfloat16 sample, 300x1560x1536 float16 sample"
    bad = subprocess.run([sys.executable, script, str(sweep), str(ref)], capture_output=True, text=True)
    assert bad.returncode != 0 and f"{sweep}: no 'rows'" in bad.stderr
