"""Training that survives a lost rank: ``gpucoll run --elastic -m gpucoll.examples.train_digits
--elastic`` with one rank SIGKILLed mid-epoch finishes every epoch on the survivors, at the
accuracy of an undisturbed run; with ZeRO-1 (sharded state) the survivors go back to the last
checkpoint; a stopped run resumes from its checkpoint at another number of ranks; and the
sampler's resume position that makes it possible."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gpucoll.ddp import DistributedSampler

pytestmark = pytest.mark.timeout(120)

# a global batch of 48 is 12 per rank on 4 ranks and 16 on 3: after the shrink every step
# averages the same samples it would have on 4 ranks, so the runs should agree closely
TRAIN = ["-m", "gpucoll.examples.train_digits", "--cpu", "--epochs", "2", "--batch-size", "48"]


def _launch(*args: str, ranks: int = 4) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", str(ranks), *args],
                          capture_output=True, text=True, timeout=100)


def _test_accuracies(stdout: str):
    return [float(m.group(1)) for m in re.finditer(r"\] epoch +\d+ .* test acc ([0-9.]+)", stdout)]


_UNDISTURBED = {}


def _undisturbed(*args: str):
    """The test accuracies of an undisturbed 4-rank run (one run per argument list)."""
    if args not in _UNDISTURBED:
        plain = _launch(*args)
        assert plain.returncode == 0, plain.stdout + plain.stderr
        _UNDISTURBED[args] = _test_accuracies(plain.stdout)
    return _UNDISTURBED[args]


# ``gpucoll run --elastic --replace 1`` starts a process in the lost rank's place; with
# ``--wait-for-ranks 4`` the survivors' next grow() (every 10 steps) waits for it
REPLACED = ["--elastic", "--replace", "1"]
WAIT = ["--wait-for-ranks", "4"]


def test_a_sigkilled_rank_costs_no_step_and_no_accuracy_and_its_replacement_joins():
    """The survivors redo the interrupted step on 3 ranks; at step 40 the replacement of the
    lost rank comes in, gets the weights, momentum and position from a survivor (the
    newcomer is rank 0 of the grown communicator, so the state comes from rank 1), and the
    run ends on 4 ranks at the undisturbed accuracy."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    # world rank 0 dies at global step 35 (step 6 of epoch 2: 29 steps of 48 samples per epoch)
    elastic = _launch(*REPLACED, *TRAIN, "--elastic", "--kill-rank", "0", "--kill-step", "35",
                      *WAIT)
    assert elastic.returncode == 0, elastic.stdout + elastic.stderr
    assert "gpucoll run: rank 0 lost (signal SIGKILL)" in elastic.stderr, elastic.stderr
    assert ("4 of 4 ranks exited 0; lost rank(s) 0 (signal SIGKILL); 1 replacement(s) "
            "started") in elastic.stderr, elastic.stderr
    # the new rank 0 (world rank 1) reports where it went on: the step that was interrupted
    assert re.search(r"^\[rank 1\] # lost rank\(s\) 0 \(signal SIGKILL\): continued on 3 ranks "
                     r"from step 35 \(epoch 2, sample 288\)$", elastic.stdout, re.M), elastic.stdout
    # ... and the newcomer, world rank 0 again, where all four went on together
    assert re.search(r"^\[rank 0\] # rank\(s\) 0 joined: continued on 4 ranks from step 40 "
                     r"\(epoch 2, sample 528\)$", elastic.stdout, re.M), elastic.stdout
    expected, got = _undisturbed(*TRAIN), _test_accuracies(elastic.stdout)
    assert len(expected) == len(got) == 2, elastic.stdout
    assert expected[-1] > 0.9
    assert abs(got[-1] - expected[-1]) <= 0.01, (expected, got)


ZERO = TRAIN + ["--zero", "--optimizer", "adam", "--loss-scaling"]


def test_zero_goes_back_to_its_last_checkpoint_after_a_lost_rank(tmp_path):
    """The lost rank's shard of Adam's state comes back from the checkpoint's files; its
    replacement gets the sharded state through a checkpoint the members save when it joins,
    which all four load (no step lost to the join)."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    where = str(tmp_path / "ckpt")
    elastic = _launch(*REPLACED, *ZERO, "--elastic", "--checkpoint-dir", where,
                      "--checkpoint-every", "10", "--kill-rank", "2", "--kill-step", "35", *WAIT)
    assert elastic.returncode == 0, elastic.stdout + elastic.stderr
    assert "gpucoll run: rank 2 lost (signal SIGKILL)" in elastic.stderr, elastic.stderr
    assert "4 of 4 ranks exited 0" in elastic.stderr, elastic.stderr
    # steps 30 to 34 were trained on 4 ranks, then redone on 3 from the checkpoint of step 30
    assert re.search(r"^\[rank 0\] # lost rank\(s\) 2 \(signal SIGKILL\): continued on 3 ranks "
                     r"from the checkpoint of step 30 \(epoch 2, sample 48\)$", elastic.stdout,
                     re.M), elastic.stdout
    assert re.search(r"^\[rank 0\] # rank\(s\) 2 joined: continued on 4 ranks from step 40 "
                     r"\(epoch 2, sample 528\)$", elastic.stdout, re.M), elastic.stdout
    expected, got = _undisturbed(*ZERO), _test_accuracies(elastic.stdout)
    assert len(expected) == len(got) == 2, elastic.stdout
    assert expected[-1] > 0.9
    assert abs(got[-1] - expected[-1]) <= 0.01, (expected, got)
    assert sorted(os.listdir(where)) == ["step-00000050", "step-00000058"]   # newest two




def test_a_stopped_run_resumes_from_its_checkpoint_on_fewer_ranks(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    where = str(tmp_path / "ckpt")
    one_go = _launch(*ZERO, ranks=2)
    first = _launch(*ZERO, "--epochs", "1", "--checkpoint-dir", where, ranks=3)   # the last wins
    assert first.returncode == 0 and len(_test_accuracies(first.stdout)) == 1, first.stdout
    resumed = _launch(*ZERO, "--checkpoint-dir", where, ranks=2)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert re.search(r"^\[rank 0\] # resumed from .*step-00000029: step 29 \(epoch 2, sample 0\) "
                     r"on 2 rank\(s\)$", resumed.stdout, re.M), resumed.stdout
    expected, got = _test_accuracies(one_go.stdout), _test_accuracies(resumed.stdout)
    assert len(expected) == 2 and len(got) == 1, resumed.stdout      # only epoch 2 was left
    assert abs(got[-1] - expected[-1]) <= 0.01, (expected, got)


@pytest.mark.parametrize("args,message", [
    (["--checkpoint-dir", "d"], "--checkpoint-dir saves the sharded state of --zero"),
    (["--zero", "--checkpoint-dir", "d", "--checkpoint-every", "0"], "must be >= 1, got 0"),
    (["--zero", "--elastic"], "or add --checkpoint-dir with --zero"),
    (["--elastic", "--grow-every", "0"], "--grow-every must be >= 1, got 0"),
    (["--elastic", "--wait-for-ranks", "-1"], "--wait-for-ranks must be >= 0, got -1"),
])
def test_checkpoint_usage_errors_exit_2(args, message):
    run = subprocess.run([sys.executable, "-m", "gpucoll.examples.train_digits", *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, run.stderr


@pytest.mark.parametrize("world,new_world,start", [(4, 3, 72), (4, 3, 0), (3, 2, 100)])
def test_sampler_resumes_an_epoch_on_fewer_ranks(world, new_world, start):
    size = 1438
    before = [DistributedSampler(size, rank=r, world_size=world, seed=3, drop_last=True)
              for r in range(world)]
    after = [DistributedSampler(size, rank=r, world_size=new_world, seed=3, drop_last=True)
             for r in range(new_world)]
    for sampler in before + after:
        sampler.set_epoch(2)
    order = np.random.default_rng((3, 2)).permutation(size)
    # the positions before ``start`` were trained on: the resumed shards are the rest, split
    # over the new ranks in the same interleaving, none repeated
    resumed = [s.indices(start=start) for s in after]
    cut = size // new_world * new_world
    for r, shard in enumerate(resumed):
        np.testing.assert_array_equal(shard, order[start:cut][r::new_world])
    seen = np.concatenate(resumed)
    assert len(set(seen.tolist())) == len(seen) == cut - start
    np.testing.assert_array_equal(before[1].indices(start=0), before[1].indices())
    with pytest.raises(ValueError, match="start must be an int >= 0, got -1"):
        after[0].indices(start=-1)
