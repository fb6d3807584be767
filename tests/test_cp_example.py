"""The context-parallel training example (``gpucoll.examples.train_cp``): on 2 and 4 ranks, with
ring or Ulysses attention and either sharding, it prints the losses of the run on one process
(float64 to 1e-5 relative, float32 to 1e-4: only the order of additions differs) and learns the
task; the bytes it reports are the layers' documented wire sizes; a sequence or head count the
group cannot split is a usage error (exit 2) on every rank before anything is sent."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
MODULE = "gpucoll.examples.train_cp"
# the defaults, spelled out because the expected bytes below depend on them
SHAPE = dict(batch=8, seq=64, heads=4, kv_heads=2, head_dim=8)
FLAGS = ["--cpu", "--dtype", "float64"] + [
    item for name, value in SHAPE.items() for item in (f"--{name.replace('_', '-')}", str(value))]
FINAL = re.compile(r"final accuracy (?P<accuracy>[\d.]+) .*the token alone (?P<alone>[\d.]+).*; "
                   r"sent_bytes per step (?P<sent>\d+) in attention \(forward (?P<forward>\d+), "
                   r"backward (?P<backward>\d+)\)")


def _run(ranks: int, *flags: str):
    """(exit code, output, losses, final-line match) of the example on ``ranks`` processes."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GPUCOLL_QUIET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    launch = ["gpucoll", "run", "-n", str(ranks), "-m"] if ranks > 1 else []
    out = subprocess.run([sys.executable, "-m"] + launch + [MODULE] + FLAGS + list(flags),
                         capture_output=True, text=True, timeout=90, env=env)
    text = out.stdout + out.stderr
    lines = [line.split("] ", 1)[-1] for line in out.stdout.splitlines()]
    losses = [float(line.split("loss ")[1].split()[0]) for line in lines
              if line.startswith("step ")]
    final = next((FINAL.match(line) for line in lines if FINAL.match(line)), None)
    return out.returncode, text, losses, final


def _expected_bytes(layer: str, ranks: int, itemsize: int = 8):
    """(forward, backward) bytes one rank sends per step, from the layers' module docs."""
    local = SHAPE["seq"] // ranks
    if ranks == 1:
        return 0, 0
    if layer == "ring":   # a block is k and v of this rank's tokens; p - 1 forward, 2p - 1 back
        block = 2 * SHAPE["batch"] * local * SHAPE["kv_heads"] * SHAPE["head_dim"] * itemsize
        return (ranks - 1) * block, (2 * ranks - 1) * block
    # Ulysses: (p - 1) / p of q, k, v (k, v at max(kv_heads, p) heads) and of the output forward;
    # of the output gradient and dq, dk, dv backward
    heads = 2 * SHAPE["heads"] + 2 * max(SHAPE["kv_heads"], ranks)
    each_way = SHAPE["batch"] * local * heads * SHAPE["head_dim"] * itemsize * (ranks - 1) // ranks
    return each_way, each_way


@pytest.fixture(scope="module")
def one_process():
    code, text, losses, final = _run(1)
    assert code == 0, text
    return losses, final


@pytest.mark.parametrize("layer, ranks, sharding", [
    ("ring", 2, "zigzag"), ("ring", 4, "contiguous"),
    ("ulysses", 2, "contiguous"), ("ulysses", 4, "zigzag")])
def test_example_matches_one_process_and_learns(one_process, layer, ranks, sharding):
    reference, reference_final = one_process
    code, text, losses, final = _run(ranks, "--layer", layer, "--sharding", sharding)
    assert code == 0, text
    assert len(losses) == len(reference) == 5 and final is not None, text
    assert losses == pytest.approx(reference, rel=1e-5)
    assert losses[-1] < 0.8 * losses[0]
    accuracy, alone = float(final["accuracy"]), float(final["alone"])
    assert accuracy == pytest.approx(float(reference_final["accuracy"]), abs=0.01)
    assert accuracy > max(0.6, alone + 0.3), text     # chance is 1/8, the token alone ~0.3
    forward, backward = _expected_bytes(layer, ranks)
    assert (int(final["forward"]), int(final["backward"])) == (forward, backward), text
    assert int(final["sent"]) == forward + backward
    assert (int(reference_final["forward"]), int(reference_final["backward"])) == (0, 0)


def test_float32_matches_one_process():
    # float32 rounding (6e-8 per operation) drifts the printed losses by ~3e-8 over the 200 Adam
    # steps; a wrong position or a lost block moves them by ~1e-2
    runs = [_run(ranks, "--dtype", "float32") for ranks in (1, 2)]
    for code, text, losses, final in runs:
        assert code == 0 and len(losses) == 5 and final is not None, text
    assert runs[1][2] == pytest.approx(runs[0][2], rel=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--seq", "30"], "--seq 30: zigzag sharding over 2 ranks needs a sequence length "
                      "divisible by 4, got 30"),
    (["--layer", "ulysses", "--heads", "3", "--kv-heads", "1"],
     "--heads 3 must be divisible by the 2 ranks")], ids=["seq", "ulysses-heads"])
def test_usage_error_before_training(flags, message):
    code, text, losses, final = _run(2, *flags)
    assert code == 2, text
    assert text.count(message) >= 2, text     # each rank names the problem
    assert losses == [] and final is None
    assert "context parallel:" not in text    # stopped before the model was built
