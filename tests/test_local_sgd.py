"""LocalSGD and DiLoCo: the example's training on 1, 2 and 3 ranks equals a one-process NumPy
simulation of each algorithm on the same data split (every rank's weights checked), and its
all-reduces (read from the flight recorder) are exactly one per bucket per sync; on the
digits, accuracy comparable to DDP's with 1 / H of the all-reduces; a lost rank (shrink,
rebind) equals the simulation of the survivors going on, and so does its replacement joining
(grow, ``joined=True``); the example under ``gpucoll run --elastic --replace 1`` takes the
replacement in and ends with equal parameters on every rank, at an undisturbed run's
accuracy; state_dict round trips resume bit for bit; usage errors come before
anything is sent."""

import numpy as np
import pytest

from gpucoll.ddp import SGD, DiLoCo, LocalSGD, broadcast_parameters
from gpucoll.examples.train_digits import init_params, loss_and_grads
from gpucoll.examples.train_local_sgd import train
from mp_harness import error_text, rank_pools, run_ranks

pytestmark = pytest.mark.timeout(120)

pool = rank_pools([1, 2, 3], env={"GPUCOLL_TRACE_BUFFER": "2048"})

SIZES = [8, 16, 3]            # a small MLP: two weight matrices, two bias vectors
SAMPLES, BATCH, SEED = 96, 12, 4
SETTINGS = dict(lr=0.1, momentum=0.5, outer_lr=0.7, outer_momentum=0.9)


def dataset():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((SAMPLES, SIZES[0])).astype(np.float32)
    y = (x @ rng.standard_normal((SIZES[0], SIZES[-1]))).argmax(axis=1).astype(np.int64)
    return x, y


# ---------------------------------------------------------------- the reference
def simulate(world, algorithm, epochs, sync_every, victim=None, kill_step=None, moved=None):
    """Every rank's weights after training, by the algorithms' definitions, in one process.

    Rank r of n takes positions r, r + n, ... of the epoch's permutation (from position
    ``offset``), ``BATCH // world`` samples a step, and steps with SGD and momentum. Every
    ``sync_every`` steps: LocalSGD sets every replica to the mean of the replicas; DiLoCo
    averages ``anchor - params``, takes a Nesterov SGD step on the anchor and sets every
    replica to it. ``victim`` stops at ``kill_step``; the others notice at the next sync,
    which they take without it, and share the rest of the epoch among themselves. ``moved``
    (a dict) receives each parameter's largest change of a replica between syncs."""
    x, y = dataset()
    start = init_params(SIZES, seed=SEED)
    weights = {r: [p.copy() for p in start] for r in range(world)}
    velocity = {r: [np.zeros_like(p) for p in start] for r in range(world)}
    anchor = [p.copy() for p in start]
    outer_velocity = [np.zeros_like(p) for p in start]
    lr, momentum = SETTINGS["lr"], SETTINGS["momentum"]
    outer_lr, outer_momentum = SETTINGS["outer_lr"], SETTINGS["outer_momentum"]
    alive, sharing = list(range(world)), list(range(world))
    local = BATCH // world
    epoch = offset = step = 0
    while epoch < epochs:
        size = len(sharing)
        order = np.random.default_rng((SEED, epoch)).permutation(SAMPLES)
        order = order[:SAMPLES // size * size][offset:]
        shard = {r: order[i::size] for i, r in enumerate(sharing)}
        regrouped = False
        for k in range(len(shard[sharing[0]]) // local):
            if step == kill_step:
                alive.remove(victim)
            for r in alive:
                batch = shard[r][k * local:(k + 1) * local]
                _, _, grads = loss_and_grads(weights[r], x[batch], y[batch])
                for p, v, g in zip(weights[r], velocity[r], grads):
                    v *= momentum
                    v += g
                    p -= lr * v
            offset += local * size
            step += 1
            if step % sync_every:
                continue
            mean = [np.mean([weights[r][i] for r in alive], axis=0) for i in range(len(start))]
            for i, a in enumerate(anchor):
                change = max(float(np.abs(a - weights[r][i]).max()) for r in alive)
                if moved is not None:
                    moved[i] = max(moved.get(i, 0.0), change)
            if algorithm == "local-sgd":
                anchor = [m.astype(np.float32) for m in mean]
            if algorithm == "diloco":
                for a, v, m in zip(anchor, outer_velocity, mean):
                    delta = a - m
                    v *= outer_momentum
                    v += delta
                    a -= outer_lr * (delta + outer_momentum * v)
                mean = anchor
            for r in alive:
                weights[r] = [m.astype(np.float32).copy() for m in mean]
            if alive != sharing:
                sharing, regrouped = list(alive), True
                break
        if regrouped:
            continue
        epoch, offset = epoch + 1, 0
    return weights


# ---------------------------------------------------------------- the example's training
def rank_train(comm, algorithm, epochs, sync_every, compression=None):
    """The example's train() on this rank; its weights and the all-reduces it issued."""
    x, y = dataset()
    params = init_params(SIZES, seed=SEED + comm.rank)
    broadcast_parameters(comm, params)
    first = comm.trace()[-1]["number"] if comm.trace() else 0
    result = train(comm, params, x, y, algorithm=algorithm, epochs=epochs, batch_size=BATCH,
                   sync_every=sync_every, compression=compression, seed=SEED, **SETTINGS)
    sent = [record["bytes"] for record in comm.trace()
            if record["number"] > first and record["op"] == "all_reduce"]
    return params, sent, result["steps"], result["all_reduces"], result["wire_bytes"]


@pytest.mark.parametrize("algorithm", ["local-sgd", "diloco"])
def test_training_equals_the_simulation(pool, algorithm):
    n, epochs, sync_every = pool.world_size, 2, 4
    want = simulate(n, algorithm, epochs, sync_every)
    results = pool.run(rank_train, algorithm, epochs, sync_every)
    steps = results[0][2]
    assert steps == epochs * (SAMPLES // n // (BATCH // n)) == 16
    elements = sum(int(np.prod(p.shape)) for p in want[0])       # 8*16 + 16 + 16*3 + 3 = 195
    for r, (params, sent, _, all_reduces, wire_bytes) in enumerate(results):
        for i, (got, expected) in enumerate(zip(params, want[r])):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {r}, parameter {i}")
            np.testing.assert_array_equal(got, results[0][0][i])   # synced at the end
        # one all-reduce of every parameter (one bucket, 4-element alignment) per sync, and
        # one of the three metrics (float64) per epoch: nothing else
        sync_bytes = 4 * (128 + 16 + 48 + 4)
        assert elements == 195
        assert sent == ([sync_bytes] * 2 + [24]) * epochs
        assert (all_reduces, wire_bytes) == (steps // sync_every, steps // sync_every * sync_bytes)


def test_bf16_local_sgd_sends_half_and_stays_close(pool):
    """The change since the last sync travels in bfloat16 (8 significant bits): each sync's
    average is off by at most about 2 ** -8 of the largest change (rounding in, rounding the
    sum), not of the weights."""
    n, epochs, sync_every, moved = pool.world_size, 1, 4, {}
    want = simulate(n, "local-sgd", epochs, sync_every, moved=moved)
    results = pool.run(rank_train, "local-sgd", epochs, sync_every, "bf16")
    for r, (params, sent, _, _, _) in enumerate(results):
        assert sent == [2 * (128 + 16 + 48 + 8)] * 2 + [24]      # 2-byte elements, 8-aligned
        for i, (got, expected) in enumerate(zip(params, want[r])):
            bound = 2 * 2 * 2.0 ** -8 * moved[i]                    # two syncs
            np.testing.assert_allclose(got, expected, rtol=0, atol=bound,
                                       err_msg=f"rank {r}, parameter {i}")


def rank_digits(comm, algorithm, digits):
    x_train, y_train, x_test, y_test = digits
    params = init_params([64, 64, 10], seed=comm.rank)
    broadcast_parameters(comm, params)
    first = comm.trace()[-1]["number"] if comm.trace() else 0
    result = train(comm, params, x_train, y_train, algorithm=algorithm, epochs=3, batch_size=48,
                   lr=0.1, momentum=0.0, sync_every=8)
    calls = sum(1 for record in comm.trace()
                if record["number"] > first and record["op"] == "all_reduce")
    _, correct, _ = loss_and_grads(params, x_test, y_test)
    return correct / len(x_test), calls, result["steps"]


def digits_file(directory):
    """scikit-learn's digits as an .npz for ``--data``, read as the examples read them (from
    the file scikit-learn ships, without importing it)."""
    import importlib.util

    from gpucoll.examples.train_digits import _digits_from_scikit_learn

    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("the digits ship with scikit-learn")
    x, y = _digits_from_scikit_learn()
    np.savez(directory / "digits.npz", x=x, y=y)
    return str(directory / "digits.npz")


def test_digits_accuracy_with_h_times_fewer_all_reduces(tmp_path):
    from gpucoll.examples.train_digits import load_digits_split
    from mp_harness import RankPool

    digits = load_digits_split(0, data=digits_file(tmp_path))
    ranks = RankPool(2, env={"GPUCOLL_TRACE_BUFFER": "2048"})
    try:
        found = {algorithm: ranks.run(rank_digits, algorithm, digits)[0]
                 for algorithm in ("ddp", "local-sgd", "diloco")}
    finally:
        ranks.close()
    steps = found["ddp"][2]
    assert steps == 3 * (1438 // 2 // 24) == 87
    assert found["ddp"][1] == steps + 3                    # one bucket a step, metrics
    for algorithm in ("local-sgd", "diloco"):
        assert found[algorithm][1] == steps // 8 + 3       # one bucket a sync, metrics
    assert found["ddp"][0] > 0.93, found
    for algorithm in ("local-sgd", "diloco"):
        assert found[algorithm][0] >= found["ddp"][0] - 0.02, found


def test_the_example_runs_under_the_launcher(tmp_path):
    """``gpucoll run -n 2 -m gpucoll.examples.train_local_sgd``: 2 epochs of 200 samples
    (``--data``), 3 steps an epoch, a sync every 3 steps: 2 all-reduces of every parameter."""
    import os
    import re
    import subprocess
    import sys

    rng = np.random.default_rng(5)
    x = rng.standard_normal((200, 64)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=np.arange(200) % 10)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GPUCOLL_QUIET="1")
    run = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "2", "-m",
                          "gpucoll.examples.train_local_sgd", "--cpu", "--data",
                          str(tmp_path / "data.npz"), "--epochs", "2", "--hidden", "16",
                          "--sync-every", "3"], capture_output=True, text=True, timeout=60,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "diloco, sync every 3, outer lr 0.7 momentum 0.9" in run.stdout, run.stdout
    assert len(re.findall(r"\[rank 0\] epoch +\d+ +loss [0-9.]+ +train acc", run.stdout)) == 2
    # 160 training samples, 24 a step per rank: 3 steps an epoch, 6 in all; 16-element
    # alignment of float32: 64*16 + 16 + 16*16 + 16 + 16*10 + 12 elements
    per_sync = 4 * (64 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 12)
    assert f"[rank 0] # 6 steps: 2 all-reduces, {2 * per_sync} bytes" in run.stdout, run.stdout


# ---------------------------------------------------------------- a lost rank
def rank_survive(rank, size, url, algorithm, victim, kill_step):
    import gpucoll

    comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url)
    x, y = dataset()
    params = init_params(SIZES, seed=SEED + comm.rank)
    broadcast_parameters(comm, params)
    result = train(comm, params, x, y, algorithm=algorithm, epochs=2, batch_size=BATCH,
                   sync_every=4, seed=SEED, elastic=True, kill_rank=victim,
                   kill_step=kill_step, **SETTINGS)
    result["comm"].close()
    return params, result["steps"], result["comm"].size


@pytest.mark.parametrize("algorithm", ["diloco"])
def test_a_lost_rank_and_the_survivors_go_on(algorithm):
    """Rank 2 of 3 dies at step 5; ranks 0 and 1 fail in the sync of step 8, shrink, redo
    it between them (rebind) and share the second epoch."""
    results = run_ranks(rank_survive, 3, algorithm, 2, 5, init=False, ranks=[0, 1],
                        env={"GPUCOLL_TIMEOUT": "3"}, timeout=60)
    want = simulate(3, algorithm, 2, 4, victim=2, kill_step=5)
    for r, (params, steps, size) in enumerate(results):
        assert (steps, size) == (8 + 96 // 2 // 4, 2)
        for i, (got, expected) in enumerate(zip(params, want[r])):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {r}, parameter {i}")


# the example under the launcher: 3 ranks, global batch 48 (16 a rank), 29 steps an epoch
LAUNCHED = ["-m", "gpucoll.examples.train_local_sgd", "--cpu", "--epochs", "2",
            "--sync-every", "4"]


def _launch(*args: str):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "3", *args],
                          capture_output=True, text=True, timeout=100, env=env)


def _last_test_accuracy(stdout: str) -> float:
    import re

    found = re.findall(r"^\[rank 0\] epoch +2 .* test acc ([0-9.]+)", stdout, re.M)
    assert len(found) == 1, stdout
    return float(found[0])


@pytest.mark.parametrize("algorithm,victim", [("diloco", 2), ("local-sgd", 0)])
def test_the_example_takes_a_lost_rank_s_replacement_in(algorithm, victim):
    """World rank ``victim`` dies at step 33 (epoch 2); the others fail in the sync of step
    36, shrink and go on on 2 ranks (16 samples each a step); at step 40 (``--grow-every
    10``) they wait for the replacement (``--wait-for-ranks 3``), which takes the averager's
    state and the position; all three hold the same parameters then (a sync; a CRC-32 each
    rank prints) and at the end, step 60 (20 steps of 48 from sample 464), at the accuracy
    of the same run undisturbed (58 steps) within 0.03 (11 of the 359 test images). With
    victim 0 the newcomer is rank 0 of the grown communicator and world rank 1 sends."""
    import re

    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    args = [*LAUNCHED, "--algorithm", algorithm]
    run = _launch("--elastic", "--replace", "1", *args, "--elastic", "--kill-rank", str(victim),
                  "--kill-step", "33", "--wait-for-ranks", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (f"3 of 3 ranks exited 0; lost rank(s) {victim} (signal SIGKILL); 1 replacement(s) "
            f"started") in run.stderr, run.stderr
    first = 1 if victim == 0 else 0           # rank 0 of the survivors
    assert re.search(rf"^\[rank {first}\] # lost rank\(s\) {victim} \(signal SIGKILL\): "
                     rf"continued on 2 ranks from step 36 \(epoch 2, sample 336\)$",
                     run.stdout, re.M), run.stdout
    assert re.search(rf"^\[rank 0\] # rank\(s\) {victim} joined: continued on 3 ranks from "
                     rf"step 40 \(epoch 2, sample 464\)$", run.stdout, re.M), run.stdout
    for step in (40, 60):          # the join and the end: both syncs
        checksums = dict(re.findall(rf"^\[rank (\d)\] # parameters crc32 ([0-9a-f]{{8}}) after "
                                    rf"step {step}, a sync: the same on every rank$", run.stdout,
                                    re.M))
        assert sorted(checksums) == ["0", "1", "2"], run.stdout
        assert len(set(checksums.values())) == 1, (step, checksums)
    plain = _launch(*args)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "[rank 0] # 58 steps: 14 all-reduces" in plain.stdout, plain.stdout
    expected, got = _last_test_accuracy(plain.stdout), _last_test_accuracy(run.stdout)
    assert expected > 0.9
    assert abs(got - expected) <= 0.03, (expected, got)


@pytest.mark.parametrize("args,message", [
    (["--algorithm", "ddp", "--elastic"], "--elastic here is for local-sgd and diloco"),
    (["--elastic", "--grow-every", "0"], "--grow-every must be >= 1, got 0"),
    (["--kill-rank", "1"], "--kill-rank and --kill-step go together"),
])
def test_the_example_s_usage_errors_exit_2(args, message):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "gpucoll.examples.train_local_sgd", *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def rank_rebind_from_the_furthest(comm):
    """Rank 0 completed a sync the others did not (as when a lost rank's all-reduce finished
    on some survivors): rebind hands its parameters, anchor, momentum and counters on."""
    params = [np.full((4, 3), 1.0 + comm.rank, np.float32), np.arange(5, dtype=np.float32)]
    diloco = DiLoCo(comm, params, sync_every=2)
    diloco.step()
    if comm.rank == 0:                      # its own sync, alone: as if the others' failed
        solo = comm.split(0)
        finished = DiLoCo(solo, params, sync_every=2)
        finished.anchor, finished._outer, finished.steps = diloco.anchor, diloco._outer, 1
        params[0] -= 0.5
        finished.step()
        diloco.steps, diloco.syncs = finished.steps, finished.syncs
        solo.close()
    else:
        comm.split(1).close()
        diloco._pending = True              # interrupted in that sync
    diloco.rebind(comm)
    return ([p.copy() for p in params], [a.copy() for a in diloco.anchor],
            [v.copy() for v in diloco._velocity()], diloco.steps, diloco.syncs)


def test_rebind_takes_the_state_of_the_furthest_rank(pool):
    results = pool.run(rank_rebind_from_the_furthest)
    first = results[0]
    # rank 0: pseudo-gradient 0.5 (weights) and 0 (biases); v = 0.5; anchor -= 0.7 * 0.95
    np.testing.assert_allclose(first[1][0], np.full((4, 3), 1.0 - 0.7 * (0.5 + 0.45)),
                               rtol=1e-6)
    np.testing.assert_array_equal(first[1][1], np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(first[2][0], np.full((4, 3), 0.5, np.float32))
    assert first[3:] == (2, 1)
    for params, anchor, velocity, steps, syncs in results:
        for got, expected in zip(params + anchor + velocity, first[0] + first[1] + first[2]):
            np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(params[0], anchor[0])
        assert (steps, syncs) == (2, 1)


# ---------------------------------------------------------------- a replacement joins (grow)
GROW_SHAPES = [(5, 4), (4,), (3, 2)]
GROW_H, GROW_STEPS, GROW_LR, GROW_MOMENTUM = 4, 16, 0.1, 0.5


def grow_start():
    return [np.random.default_rng([3, i]).standard_normal(s).astype(np.float32)
            for i, s in enumerate(GROW_SHAPES)]


def pull(params, world_rank, step):
    """The gradient of ``|p - target|^2 / 2`` towards a target of (world rank, step): it
    depends on the parameters, so a replica that starts elsewhere steps elsewhere."""
    rng = np.random.default_rng([9, world_rank, step])
    return [p - rng.standard_normal(p.shape).astype(np.float32) for p in params]


def inner_step(params, velocity, world_rank, step):
    for p, v, g in zip(params, velocity, pull(params, world_rank, step)):
        v *= GROW_MOMENTUM
        v += g
        p -= GROW_LR * v


def simulate_grow(world, algorithm, victim, leave_step, join_step):
    """Every replica's weights after GROW_STEPS steps, in one process: ``victim`` is away
    from ``leave_step`` to ``join_step``; it comes back (the same world rank, a fresh inner
    momentum) from the anchor (DiLoCo), or from the members' mean (LocalSGD, which keeps no
    anchor). Every GROW_H-th step syncs the replicas present."""
    weights = {r: grow_start() for r in range(world)}
    velocity = {r: [np.zeros_like(p) for p in grow_start()] for r in range(world)}
    anchor = grow_start()
    outer_velocity = [np.zeros_like(p) for p in anchor]
    alive = list(range(world))
    for step in range(GROW_STEPS):
        if step == leave_step:
            alive.remove(victim)
        if step == join_step:
            weights[victim] = [a.copy() for a in anchor] if algorithm == "diloco" else \
                [np.mean([weights[r][i] for r in alive], axis=0).astype(np.float32)
                 for i in range(len(anchor))]
            velocity[victim] = [np.zeros_like(p) for p in anchor]
            alive = sorted(alive + [victim])
        for r in alive:
            inner_step(weights[r], velocity[r], r, step)
        if (step + 1) % GROW_H:
            continue
        mean = [np.mean([weights[r][i] for r in alive], axis=0) for i in range(len(anchor))]
        if algorithm == "diloco":
            for a, v, m in zip(anchor, outer_velocity, mean):
                delta = a - m
                v *= SETTINGS["outer_momentum"]
                v += delta
                a -= SETTINGS["outer_lr"] * (delta + SETTINGS["outer_momentum"] * v)
            mean = anchor
        for r in alive:
            weights[r] = [m.astype(np.float32).copy() for m in mean]
    return weights


def make_periodic(comm, params, algorithm, joined=False):
    if algorithm == "diloco":
        return DiLoCo(comm, params, sync_every=GROW_H, outer_lr=SETTINGS["outer_lr"],
                      outer_momentum=SETTINGS["outer_momentum"], joined=joined)
    return LocalSGD(comm, params, sync_every=GROW_H, joined=joined)


def rank_join_beside(comm, algorithm, join_step):
    """The last rank stays out until ``join_step``: the others train on a group of their own,
    then rebind to ``comm`` while it constructs with ``joined=True``; all go on to the end."""
    newcomer = comm.rank == comm.size - 1
    group = comm.split(int(newcomer))
    params = [np.full(s, 7.0, np.float32) for s in GROW_SHAPES] if newcomer else grow_start()
    velocity = [np.zeros_like(p) for p in params]
    if newcomer:
        group.close()
        averager = make_periodic(comm, params, algorithm, joined=True)
        steps_at_join = averager.steps
    else:
        averager = make_periodic(group, params, algorithm)
        while averager.steps < join_step:
            inner_step(params, velocity, comm.rank, averager.steps)
            averager.step()
        averager.rebind(comm)
        group.close()
        steps_at_join = averager.steps
    at_join = [p.copy() for p in params]
    while averager.steps < GROW_STEPS:
        inner_step(params, velocity, comm.rank, averager.steps)
        averager.step()
    return params, steps_at_join, averager.syncs, at_join


@pytest.mark.parametrize("algorithm,join_step", [("diloco", 6), ("local-sgd", 6),
                                                 ("local-sgd", 8)])
def test_a_newcomer_takes_the_state_and_the_next_sync_includes_it(pool, algorithm, join_step):
    """Mid-period (step 6 of H = 4: DiLoCo hands on the anchor and momentum, LocalSGD the
    members' mean) and at a sync (step 8: LocalSGD's members are equal, and the newcomer
    gets their very parameters)."""
    n = pool.world_size
    if n == 1:
        pytest.skip("a newcomer needs a member beside it")
    want = simulate_grow(n, algorithm, n - 1, 0, join_step)
    results = pool.run(rank_join_beside, algorithm, join_step)
    for r, (params, steps_at_join, syncs, at_join) in enumerate(results):
        assert (steps_at_join, syncs) == (join_step, GROW_STEPS // GROW_H)
        if join_step % GROW_H == 0:
            for got, member in zip(at_join, results[0][3]):
                np.testing.assert_array_equal(got, member)
        for i, (got, expected) in enumerate(zip(params, want[r])):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {r}, parameter {i}")
            np.testing.assert_array_equal(got, results[0][0][i])


def rank_shrink_then_grow(rank, size, url, algorithm, world, victim):
    """Ranks 0 .. world-1 train; ``victim`` dies at step 5, the others fail in the sync of
    step 8, shrink and rebind; at step 10 they grow back: the last process, started as the
    launcher's replacement is (GPUCOLL_JOIN, the victim's world rank), joins."""
    import os
    import signal

    import gpucoll
    from gpucoll.examples.train_digits import FAILURES
    from gpucoll.rendezvous.survivors import publish_death

    newcomer = rank == world
    if newcomer:
        os.environ["GPUCOLL_JOIN"] = "replacement"
    comm = gpucoll.init(backend="cpu", rank=victim if newcomer else rank, world_size=world,
                        url=url, timeout=30 if newcomer else 3, set_default=False)
    world_rank = comm.to_world(comm.rank)
    params = [np.full(s, 7.0, np.float32) for s in GROW_SHAPES] if newcomer else grow_start()
    velocity = [np.zeros_like(p) for p in params]
    averager = make_periodic(comm, params, algorithm, joined=newcomer)
    steps_at_join = averager.steps
    while averager.steps < GROW_STEPS:
        if world_rank == victim and not newcomer and averager.steps == 5:
            publish_death(comm._root_store, world_rank, "signal SIGKILL")   # as the launcher
            os.kill(os.getpid(), signal.SIGKILL)
        inner_step(params, velocity, world_rank, averager.steps)
        try:
            averager.step()
        except FAILURES:
            old, comm = comm, comm.shrink()
            old.close()
            averager.rebind(comm)
        if averager.steps == 10 and comm.size < world:
            bigger = comm.grow(min_size=world)
            assert bigger is not comm, "the replacement did not come in"
            comm.close()
            comm = bigger
            averager.rebind(comm)
    sizes = (comm.size, sorted(comm.joined))
    comm.close()
    return world_rank, params, steps_at_join, averager.syncs, sizes


@pytest.mark.parametrize("algorithm,world,victim", [("diloco", 3, 0), ("local-sgd", 2, 1)])
def test_a_lost_rank_s_replacement_joins_and_all_end_equal(algorithm, world, victim):
    """A shrink, then a grow back to full size with the launcher's kind of replacement: every
    rank ends with the simulation's weights (the newcomer from the anchor or the members'
    mean, 6 steps behind nobody), the same on every rank."""
    survivors = [r for r in range(world) if r != victim]
    results = run_ranks(rank_shrink_then_grow, world + 1, algorithm, world, victim, init=False,
                        ranks=survivors + [world], env={"GPUCOLL_TIMEOUT": "3"}, timeout=60)
    want = simulate_grow(world, algorithm, victim, 5, 10)
    assert sorted(r[0] for r in results) == list(range(world))
    for world_rank, params, steps_at_join, syncs, sizes in results:
        assert steps_at_join == (10 if world_rank == victim else 0)
        assert syncs == GROW_STEPS // GROW_H and sizes == (world, [victim])
        for i, (got, expected) in enumerate(zip(params, want[world_rank])):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"world rank {world_rank}, parameter {i}")
            np.testing.assert_array_equal(got, results[0][1][i])


def rank_join_mistakes(comm, case):
    params = [np.ones((3, 2), np.float32)]
    diloco = DiLoCo(comm, params, sync_every=2)
    last = comm.rank == comm.size - 1
    if case == "interrupted":
        diloco._pending = True              # as a sync that raised and was not rebound
    joining = {"not marked": lambda: DiLoCo(comm, params, sync_every=2),
               "layout": lambda: DiLoCo(comm, [np.ones((2, 3), np.float32)], sync_every=2,
                                        joined=True),
               "outer": lambda: DiLoCo(comm, params, sync_every=2, outer_lr=0.5,
                                       joined=True)}.get(
        case, lambda: DiLoCo(comm, params, sync_every=2, joined=True))
    if case == "nobody holds state" or last:
        found = error_text(joining)
    else:
        found = error_text(lambda: diloco.rebind(comm))
    return found, float(comm.all_reduce(np.ones(1))[0])


@pytest.mark.parametrize("case", ["not marked", "nobody holds state", "layout", "outer",
                                  "interrupted"])
def test_join_mistakes_are_named_on_every_rank(pool, case):
    n = pool.world_size
    members, newcomers = list(range(n - 1)), [n - 1]
    for rank, (found, total) in enumerate(pool.run(rank_join_mistakes, case)):
        assert total == n                       # the communicator is still usable
        if n == 1 and case == "not marked":
            assert found == "no error"
        elif n == 1 or case == "nobody holds state":
            assert found == (f"ValueError: DiLoCo: ranks {list(range(n))} construct with "
                             f"joined=True and no rank holds the state to hand them: after "
                             f"grow(), the members call rebind(comm) with the grown "
                             f"communicator")
        elif case == "not marked":
            assert found == (f"ValueError: DiLoCo: ranks {newcomers} construct a new DiLoCo "
                             f"while ranks {members} call rebind(): a rank that came in "
                             f"through grow() holds no state; construct its DiLoCo with "
                             f"joined=True")
        elif case == "layout":
            other = n - 1 if rank != n - 1 else 0
            assert found.startswith(f"ValueError: DiLoCo: rank {rank} and rank {other} have "
                                    f"different parameter layouts (shape checksum"), found
        elif case == "outer":
            other, lrs = (n - 1, "0.7 vs 0.5") if rank != n - 1 else (0, "0.5 vs 0.7")
            assert found == (f"ValueError: DiLoCo: rank {rank} and rank {other} have different "
                             f"outer optimizers (outer_lr {lrs}, outer_momentum 0.9 vs 0.9); "
                             f"every rank must pass the same outer_lr and outer_momentum")
        else:
            assert found == (f"ValueError: DiLoCo.rebind: ranks {members} were interrupted in "
                             f"a sync and ranks {newcomers} join: rebind() to the communicator "
                             f"shrink() gave first, then grow()")


# ---------------------------------------------------------------- CuPy arrays
def rank_train_cupy(comm, algorithm, compression=None):
    """The example's training on CuPy arrays; the weights brought back to the host."""
    import cupy

    x, y = dataset()
    params = init_params(SIZES, seed=SEED + comm.rank, xp=cupy)
    broadcast_parameters(comm, params)
    train(comm, params, x, y, algorithm=algorithm, epochs=2, batch_size=BATCH, sync_every=4,
          compression=compression, seed=SEED, xp=cupy, **SETTINGS)
    return [cupy.asnumpy(p) for p in params]


def _check_cupy(results, algorithm):
    want = simulate(2, algorithm, 2, 4)
    for r, params in enumerate(results):
        for i, (got, expected) in enumerate(zip(params, want[r])):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5,
                                       err_msg=f"rank {r}, parameter {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["local-sgd", "diloco"])
def test_cupy_training_equals_the_simulation(algorithm):
    """CuPy parameters through the CPU backend (staged through host memory)."""
    from mp_harness import RankPool

    ranks = RankPool(2)
    try:
        _check_cupy(ranks.run(rank_train_cupy, algorithm), algorithm)
    finally:
        ranks.close()


@pytest.mark.gpu
def test_diloco_over_nccl_two_ranks_on_one_gpu():
    from test_nccl_gpu import MULTI_RANK_ENV, _nccl_version, on_nccl

    if _nccl_version() < 23000:
        pytest.skip("two ranks on one GPU need NCCL >= 2.30")
    _check_cupy(run_ranks(on_nccl, 2, rank_train_cupy, "diloco", init=False,
                          env=MULTI_RANK_ENV, timeout=240), "diloco")


# ---------------------------------------------------------------- checkpoints
def grads_of(rank, step, shapes):
    rng = np.random.default_rng([7, rank, step])
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def rank_resume(comm, kind, compression):
    """Twelve steps straight, and six, a state_dict, a fresh object, six more: bit for bit."""
    shapes = [(6, 5), (5,), (3, 2, 2)]

    def make(params):
        if kind == "diloco":
            return DiLoCo(comm, params, sync_every=4, compression=compression)
        return LocalSGD(comm, params, sync_every=4, compression=compression)

    def run(averager, params, steps):
        for step in steps:
            for p, g in zip(params, grads_of(comm.rank, step, shapes)):
                p -= 0.05 * g
            averager.step()

    start = [np.random.default_rng([8, i]).standard_normal(s).astype(np.float32)
             for i, s in enumerate(shapes)]
    straight = [p.copy() for p in start]
    run(make(straight), straight, range(12))
    resumed = [p.copy() for p in start]
    first = make(resumed)
    run(first, resumed, range(6))               # mid-period: steps 4 and 5 are local
    state, kept = first.state_dict(), [p.copy() for p in resumed]
    del first
    resumed = [np.zeros_like(p) for p in start]   # a new process: everything from the files
    second = make(resumed)
    for p, k in zip(resumed, kept):
        p[...] = k
    second.load_state_dict(state)
    run(second, resumed, range(6, 12))
    return straight, resumed, (second.steps, second.syncs), state


@pytest.mark.parametrize("kind,compression", [("diloco", None), ("diloco", "fp16"),
                                              ("local-sgd", "bf16"), ("local-sgd", None)])
def test_state_dict_resumes_bit_for_bit(pool, kind, compression):
    for straight, resumed, counters, state in pool.run(rank_resume, kind, compression):
        for a, b in zip(straight, resumed):
            np.testing.assert_array_equal(a, b)
        assert counters == (12, 3)
        assert (state["steps"], state["syncs"]) == (6, 1)
        if kind == "diloco":
            assert state["outer"]["settings"] == {"lr": 0.7, "momentum": 0.9,
                                                  "weight_decay": 0.0, "nesterov": True}
            assert [v.shape for v in state["outer"]["velocity"]] == [(6, 5), (5,), (3, 2, 2)]
        assert (state["anchor"] is None) == (kind == "local-sgd" and compression is None)


def rank_bad_states(comm):
    params = [np.ones((3, 2), np.float32)]
    diloco = DiLoCo(comm, params, sync_every=2)
    good = diloco.state_dict()
    found = []
    for change in [{"kind": "LocalSGD"}, {"sync_every": 3}, {"shapes": [[2, 3]]},
                   {"dtypes": ["float64"]}, {"format": "x"}]:
        found.append(error_text(lambda: diloco.load_state_dict(dict(good, **change))))
    other = dict(good, anchor=[np.full((3, 2), comm.rank, np.float32)])
    found.append(error_text(lambda: diloco.load_state_dict(other)))
    found.append(error_text(lambda: diloco.load_state_dict([1])))
    diloco.load_state_dict(good)              # still usable
    found.append(diloco.steps)
    return found


def test_states_that_do_not_fit_are_refused_on_every_rank(pool):
    n = pool.world_size
    for rank, found in enumerate(pool.run(rank_bad_states)):
        assert found[0] == "ValueError: the state is a LocalSGD's; this is a DiLoCo"
        assert found[1] == ("ValueError: the state was saved with sync_every=3; this DiLoCo "
                            "has sync_every=2")
        assert found[2] == ("ValueError: the state holds parameters of shapes [(2, 3)]; this "
                            "DiLoCo's are [(3, 2)]")
        assert found[3].startswith("TypeError: the state holds parameters of dtypes")
        assert found[4].startswith("ValueError: not a LocalSGD / DiLoCo state")
        if n == 1:
            assert found[5] == "no error"
        else:
            assert found[5].startswith("ValueError: load_state_dict: rank") and \
                "different checkpoints" in found[5], found[5]
        assert found[6].startswith("TypeError: state must be the dict")
        assert found[7] == 0


# ---------------------------------------------------------------- usage errors
class GpuOnly:
    """A communicator of a GPU backend (nothing is sent to it)."""
    memory, backend, rank, size = "cuda", "nccl", 0, 2


def test_usage_errors(solo):
    params = [np.zeros((3, 2), np.float32), np.zeros(4, np.float32)]
    for kwargs, words in [({"sync_every": 0}, "sync_every must be an int >= 1, got 0"),
                          ({"sync_every": 2.0}, "sync_every must be an int >= 1, got 2.0"),
                          ({"sync_every": True}, "sync_every must be an int >= 1, got True"),
                          ({"sync_every": 2, "compression": "int8"},
                           "compression must be None, 'bf16' or 'fp16', got 'int8'"),
                          ({"sync_every": 2, "bucket_cap_bytes": 0},
                           "bucket_cap_bytes must be positive, got 0")]:
        for cls in (LocalSGD, DiLoCo):
            assert error_text(lambda: cls(solo, params, **kwargs)) == f"ValueError: {words}"
    for kwargs, words in [({"outer_lr": 0}, "outer_lr must be a number > 0, got 0"),
                          ({"outer_momentum": 1.0}, "outer_momentum must be in [0, 1), got 1.0")]:
        assert error_text(lambda: DiLoCo(solo, params, sync_every=2, **kwargs)) == \
            f"ValueError: {words}"
    assert error_text(lambda: SGD(momentum=0, nesterov=True)) == \
        "ValueError: nesterov=True needs momentum > 0, got momentum=0"
    assert error_text(lambda: LocalSGD(solo, [], sync_every=2)) == "ValueError: params is empty"
    assert error_text(lambda: DiLoCo(solo, params, sync_every=2, joined="yes")) == \
        "TypeError: joined must be True or False, got 'yes'"
    assert error_text(lambda: LocalSGD(solo, [np.zeros(3, np.int32)], sync_every=2)) == \
        ("TypeError: params[0] has dtype int32; LocalSGD averages float16, bfloat16, float32 "
         "or float64 parameters")
    assert error_text(lambda: DiLoCo(solo, [np.zeros((4, 3), np.float32).T], sync_every=2)) \
        .startswith("ValueError: params[0] must be C-contiguous (shape (3, 4))")
    assert error_text(lambda: DiLoCo(GpuOnly(), params, sync_every=2)) == \
        ("TypeError: backend 'nccl' takes GPU arrays and the parameters are host arrays; use "
         "a host backend (cpu, mpi) or CuPy parameters")
    assert solo.all_reduce(np.ones(2))[0] == 1.0     # nothing was sent; still usable


def rank_mismatch(comm, what):
    shapes = [(3, 2), (4,)]
    if comm.rank == comm.size - 1:
        shapes = {"shapes": [(2, 3), (4,)], "sync_every": shapes}.get(what, shapes)
    params = [np.zeros(s, np.float32) for s in shapes]
    sync_every = 3 if what == "sync_every" and comm.rank == comm.size - 1 else 2
    found = error_text(lambda: DiLoCo(comm, params, sync_every=sync_every))
    return found, float(comm.all_reduce(np.ones(1))[0])


@pytest.mark.parametrize("what", ["shapes", "sync_every"])
def test_ranks_that_disagree_are_named(pool, what):
    n = pool.world_size
    for rank, (found, total) in enumerate(pool.run(rank_mismatch, what)):
        assert total == n                       # the communicator is still usable
        if n == 1:
            assert found == "no error"
            continue
        other = n - 1 if rank != n - 1 else 0
        field = "shape checksum" if what == "shapes" else "sync_every 2 vs 3" \
            if rank != n - 1 else "sync_every 3 vs 2"
        assert found.startswith(f"ValueError: DiLoCo: rank {rank} and rank {other} have "
                                f"different parameter layouts ("), found
        assert field in found and found.endswith("every rank must pass the same parameter "
                                                 "shapes and dtypes, sync_every and "
                                                 "compression"), found
