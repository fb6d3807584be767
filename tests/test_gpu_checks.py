"""``bench/gpu_checks.py``, the one-go runner of the GPU checks: its step list is valid, and its
machinery (hard limits that stop a step's whole process group, the time budget, re-runs only
after a failure, the summary) works. Real processes; no GPU needed."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_checks.py")
PY = sys.executable


def _load():
    spec = importlib.util.spec_from_file_location("gpu_checks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_checks"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _cli(*args, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([PY, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie is gone for our purpose
        return handle.read().split(")")[-1].split()[0] != "Z"


def test_every_step_names_a_script_or_module_that_exists(tmp_path):
    checks = _load()
    steps = checks.plan(str(tmp_path), digits="digits.npz")
    assert [s.phase for s in steps] == sorted((s.phase for s in steps), key=checks.PHASES.index)
    assert set(checks.PHASES) == {s.phase for s in steps}
    for step in steps:
        for i, word in enumerate(step.argv):
            if word.endswith(".py") and not os.path.isabs(word):
                assert os.path.exists(os.path.join(ROOT, word)), f"{step.name}: {word}"
            if word == "-m" and step.argv[i + 1:i + 2] and step.argv[i + 1].startswith("gpucoll."):
                assert importlib.util.find_spec(step.argv[i + 1]), f"{step.name}: {step.argv[i + 1]}"
        assert all(str(tmp_path) in w for w in step.argv if w.endswith((".json", ".xml")))
    assert all("-n" not in s.argv for s in steps if s.phase == "tests")  # no xdist unless asked
    tests = [s for s in checks.plan(str(tmp_path), workers=3) if s.phase == "tests"]
    assert tests and all(s.argv[s.argv.index("-n") + 1] == "3" for s in tests)
    training = [s for s in steps if "gpucoll.examples.train_digits" in s.argv]
    assert training and all(s.argv[-2:] == ["--data", "digits.npz"] for s in training)
    proc = _cli("--list", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == len(steps)
    assert "-m gpu" in proc.stdout and "NCCL_MULTI_RANK_GPU_ENABLE=1" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--phase", "tests,nope"], "unknown phase"),
    (["--budget", "0"], "--budget must be positive"),
    (["--workers", "-1"], "--workers must be 0 or more"),
    (["--only", "topo,nope"], "unknown step(s) nope"),
    (["--skip", "nope"], "unknown step(s) nope"),
    (["--phase", "env", "--only", "topo"], "no step left to run")])
def test_usage_errors_exit_2(args, message):
    proc = _cli(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_only_and_skip_pick_steps_by_name(tmp_path):
    def listed(*args):
        proc = _cli("--list", "--out", str(tmp_path), *args)
        assert proc.returncode == 0, proc.stderr
        return [line.split("]", 1)[1].split(",", 1)[0].strip() for line in proc.stdout.splitlines()]

    every = listed()
    assert listed("--only", "topo, bench-bucket") == ["bench-bucket", "topo"]  # plan order
    assert listed("--skip", "topo,nvidia-smi") == [n for n in every if n not in ("topo", "nvidia-smi")]
    assert listed("--phase", "bench", "--only", "topo,nvidia-smi") == ["topo"]


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    sys.path.insert(0, ROOT)
    from gpucoll.cuda_env import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is usable here")
    proc = _cli("--out", str(tmp_path / "logs"))
    assert proc.returncode == 3 and "no GPU here" in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_runner_limits_budgets_reruns_and_summarizes(tmp_path):
    checks = _load()
    child_pid = tmp_path / "child.pid"
    hang = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(child_pid)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    Step = checks.Step
    steps = [
        Step("a", "ok", 20, [PY, "-c", "print('hello from ok')"]),
        Step("a", "rerun-not-needed", 20, [PY, "-c", "pass"], only_if_failed="ok"),
        Step("a", "fails", 20, [PY, "-c", "import sys; print('it broke'); sys.exit(4)"]),
        Step("a", "rerun", 20, [PY, "-c", "print('second try')"], only_if_failed="fails"),
        Step("b", "hangs", 2, [PY, "-c", hang]),
        Step("b", "too-long", 10_000, [PY, "-c", "pass"]),
        Step("b", "env", 20, [PY, "-c", "import os; print(os.environ['GPU_CHECKS_PROBE'])"],
             {"GPU_CHECKS_PROBE": "seen"}),
    ]
    lines = []
    start = time.monotonic()
    status = checks.run(steps, str(tmp_path / "out"), budget=120,
                        echo=lambda text, flush=True: lines.append(text))
    assert time.monotonic() - start < 60
    assert status == 1
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    got = {r["name"]: (r["status"], r["rc"]) for r in doc["steps"]}
    assert got == {"ok": ("passed", 0), "rerun-not-needed": ("not needed (ok passed)", None),
                   "fails": ("failed", 4), "rerun": ("passed", 0),
                   "hangs": ("timed out", -15), "too-long": ("passed", 0),
                   "env": ("passed", 0)}
    too_long = [r for r in doc["steps"] if r["name"] == "too-long"][0]
    assert 20 <= too_long["limit_s"] <= 120  # cut to what was left of the budget
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the timed-out step's own child was left running"
    logs = {r["name"]: (tmp_path / "out" / r["log"]) for r in doc["steps"]}
    assert "hello from ok" in logs["ok"].read_text()
    assert logs["env"].read_text().splitlines()[-1] == "seen"
    checks.MIN_START = 1000.0  # now less is left of any budget than a step needs to start
    assert checks.run(steps[:1], str(tmp_path / "out2"), budget=120,
                      echo=lambda text, flush=True: None) == 0
    doc = json.loads((tmp_path / "out2" / "summary.json").read_text())
    assert [r["status"] for r in doc["steps"]] == ["not run (budget)"]
    assert not (tmp_path / "out2" / doc["steps"][0]["log"]).exists()
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| a | fails | failed | 4 |" in summary
    assert "## fails: failed" in summary and "it broke" in summary
    assert "## hangs: timed out" in summary and "## ok" not in summary
    assert any("hangs: timed out" in line for line in lines)


def test_outputs_missing_modules_and_reruns_without_passed_tests(tmp_path):
    """A step that exits 0 without its JSON fails (a stale file from an earlier run does not
    count); a step needing a missing module is not run; the re-run leaves out what passed."""
    checks = _load()
    Step = checks.Step
    out = tmp_path / "out"
    out.mkdir()
    stale, written = out / "stale.json", out / "written.json"
    stale.write_text("{}")
    probe = tmp_path / "probe.py"  # a stand-in for pytest -v: prints its arguments as results
    probe.write_text(
        "import sys\n"
        "print('tests/test_a.py::test_one PASSED  [ 33%]')\n"
        "print('[gw1] [ 66%] PASSED tests/test_a.py::test_two[x 1] ')\n"
        "print('tests/test_a.py::test_three FAILED  [100%]')\n"
        "print('ARGS', sys.argv[1:])\n"
        "sys.exit(1)\n")
    steps = [
        Step("a", "no-json", 20, [PY, "-c", "print('nothing to measure')"],
             outputs=[str(stale)]),
        Step("a", "json", 20, [PY, "-c", f"open({str(written)!r}, 'w').write('{{}}')"],
             outputs=[str(written)]),
        Step("a", "needs", 20, [PY, "-c", "pass"], needs_module="no_such_module_gpu_checks"),
        Step("b", "tests-x", 20, [PY, str(probe)]),
        Step("b", "tests-all", 20, [PY, str(probe)], only_if_failed="tests-x",
             skip_passed_of="tests-x"),
    ]
    status = checks.run(steps, str(out), budget=None, echo=lambda text, flush=True: None)
    assert status == 1
    doc = json.loads((out / "summary.json").read_text())
    got = {r["name"]: r["status"] for r in doc["steps"]}
    assert got == {"no-json": "failed", "json": "passed",
                   "needs": "not run (no_such_module_gpu_checks is not installed)",
                   "tests-x": "failed", "tests-all": "failed"}
    logs = {r["name"]: (out / r["log"]) for r in doc["steps"]}
    assert "did not write" in logs["no-json"].read_text() and not stale.exists()
    args = [line for line in logs["tests-all"].read_text().splitlines() if line.startswith("ARGS")]
    want = ["--deselect", "tests/test_a.py::test_one", "--deselect", "tests/test_a.py::test_two[x 1]"]
    assert args == [f"ARGS {want}"]
    assert [r.get("deselected") for r in doc["steps"]][-1] == 2


def test_digits_file_is_checked_and_made_absolute(tmp_path):
    proc = _cli("--list", "--digits", str(tmp_path / "missing.npz"))
    assert proc.returncode == 2 and "no such file" in proc.stderr
    data = tmp_path / "digits.npz"
    data.write_bytes(b"")
    proc = subprocess.run([PY, SCRIPT, "--list", "--digits", "digits.npz", "--phase", "ranks"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    training = [line for line in proc.stdout.splitlines()
                if "examples.train_digits" in line or "examples.train_ps" in line]
    assert len(training) == 3 and all(f"--data {data}" in line for line in training)
