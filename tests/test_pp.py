"""Pipeline parallelism: a pipelined step's loss and every stage's gradients equal the unsplit
model's (NumPy reference) for GPipe and 1F1B at 2 and 3 stages and 1, 3 and 4 micro-batches;
the schedules' order, peak stored activations and bubble; usage errors before anything is
sent; a dying stage named on every other stage; pipelines x data-parallel replicas."""

import os
import time

import numpy as np
import pytest

import gpucoll
from gpucoll.examples.train_digits import init_params, loss_and_grads
from gpucoll.types import wire_code
from gpucoll.pp import (Linear, Pipeline, ReLU, Stage, bubble_fraction, mlp_layers,
                        peak_in_flight, pipeline_groups, schedule_actions)
from mp_harness import rank_pools, run_ranks, shared_pool
from test_nccl_gpu import MULTI_RANK_ENV, on_nccl, two_ranks

# ranks share the cores: one BLAS thread each (else oversubscription slows steps 100x)
_ONE_BLAS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.timeout(120)

SIZES = [7, 12, 9, 5]      # three linear layers: 2 stages take (2, 1), 3 stages (1, 1, 1)
BATCH = 12                 # divisible by 1, 3 and 4 micro-batches
SEED = 4


def _batch(step, rows=BATCH):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((rows, SIZES[0])).astype(np.float32)
    return x, rng.integers(0, SIZES[-1], rows)


def _reference(step, rows=BATCH):
    params = init_params(SIZES, seed=SEED)
    x, y = _batch(step, rows)
    loss, correct, grads = loss_and_grads(params, x, y)
    return loss, correct, grads


def _stage_slices(stages):
    """Which of the reference's parameter arrays each stage holds."""
    slices, start = [], 0
    for layers in mlp_layers(init_params(SIZES, seed=SEED), stages):
        count = sum(len(layer.params) for layer in layers)
        slices.append(slice(start, start + count))
        start += count
    return slices


# ---------------------------------------------------------------------------- schedules
def _simulate(schedule, stages, micro_batches, virtual_stages=1, starts=None):
    """Unit-time forwards and backwards, each stage running its actions in order as soon as
    their inputs exist: returns the makespan (a deadlock would leave actions unrun). Model
    chunk ``k P + s`` is chunk ``k`` of stage ``s``; ``starts[(s, action)]``: its start."""
    done = {}
    lists = [schedule_actions(schedule, s, stages, micro_batches, virtual_stages)
             for s in range(stages)]
    last = stages * virtual_stages - 1
    clock = [0] * stages
    position = [0] * stages
    while any(position[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(lists[s]):
                continue
            action = lists[s][position[s]]
            kind, m = action[:2]
            c = (action[2] if len(action) > 2 else 0) * stages + s
            needs = ([("F", c - 1, m)] if kind == "F" and c > 0 else
                     [("B", c + 1, m)] if kind == "B" and c < last else [])
            if kind == "B":
                needs.append(("F", c, m))
            if all(need in done for need in needs):
                start = max([clock[s]] + [done[need] for need in needs])
                done[(kind, c, m)] = clock[s] = start + 1
                if starts is not None:
                    starts[(s, action)] = start
                position[s] += 1
                progressed = True
        assert progressed, f"{schedule} deadlocks at {position}"
    return max(clock)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_order_peak_and_bubble(schedule):
    for stages in range(1, 5):
        for micro_batches in range(1, 7):
            for stage in range(stages):
                actions = schedule_actions(schedule, stage, stages, micro_batches)
                forwards = [m for kind, m in actions if kind == "F"]
                backwards = [m for kind, m in actions if kind == "B"]
                assert forwards == backwards == list(range(micro_batches))
                assert all(actions.index(("F", m)) < actions.index(("B", m))
                           for m in range(micro_batches))
                expected = (micro_batches if schedule == "gpipe"
                            else min(stages - stage, micro_batches))
                assert peak_in_flight(actions) == expected
            busy = 2 * micro_batches
            makespan = _simulate(schedule, stages, micro_batches)
            assert makespan == 2 * (micro_batches + stages - 1)
            assert (makespan - busy) / makespan == pytest.approx(
                bubble_fraction(stages, micro_batches))


def test_one_f_one_b_order_is_the_textbook_one():
    assert schedule_actions("1f1b", 0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0),
                                                ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert schedule_actions("1f1b", 2, 3, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1),
                                                ("F", 2), ("B", 2), ("F", 3), ("B", 3)]


# ---------------------------------------------------------------------------- equal to unsplit
def pipelined_steps(comm, schedule, micro_batches, recompute):
    params = init_params(SIZES, seed=SEED)
    stage = Stage(mlp_layers(params, comm.size)[comm.rank], index=comm.rank, stages=comm.size,
                  recompute=recompute)
    pipe = Pipeline(comm, stage, micro_batches=micro_batches, schedule=schedule)
    results = []
    for step in range(2):      # the second step checks that gradients restart from zero
        x, y = _batch(step)
        loss = pipe.step(x if comm.rank == 0 else None, y if pipe.is_last else None,
                         batch_size=BATCH)
        results.append((loss, pipe.correct, [np.array(g) for g in stage.grads],
                        stage.peak_stored, stage.stored))
    x, y = _batch(0)
    evaluated = pipe.evaluate(x, y)
    return results, evaluated, stage.stored


pool = rank_pools([2, 3], ids=lambda n: f"{n}stages", env=_ONE_BLAS, shared=True)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("micro_batches", [1, 3, 4])
def test_pipelined_step_equals_unsplit_model(pool, schedule, micro_batches):
    stages = pool.world_size
    per_rank = pool.run(pipelined_steps, schedule, micro_batches, micro_batches == 3)
    slices = _stage_slices(stages)
    for step in range(2):
        loss_ref, correct_ref, grads_ref = _reference(step)
        for rank, (results, _, _) in enumerate(per_rank):
            loss, correct, grads, peak, stored = results[step]
            if rank == stages - 1:
                assert loss == pytest.approx(loss_ref, rel=1e-5)
                assert correct == correct_ref
            else:
                assert loss is None
            assert len(grads) == len(grads_ref[slices[rank]])
            for got, want in zip(grads, grads_ref[slices[rank]]):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
            expected_peak = (micro_batches if schedule == "gpipe"
                             else min(stages - rank, micro_batches))
            assert peak == expected_peak and stored == 0
    loss_ref, correct_ref, _ = _reference(0)
    for rank, (_, (loss, correct), stored) in enumerate(per_rank):
        assert stored == 0                  # evaluation keeps nothing for backward
        if rank == stages - 1:
            assert loss == pytest.approx(loss_ref, rel=1e-5) and correct == correct_ref
        else:
            assert loss is None and correct is None


def single_slot_layers(comm):
    """Tensor-parallel layers (one saved input each) on a one-rank group, recomputed."""
    from gpucoll.tp import ColumnParallelLinear

    solo = comm.split(comm.rank)
    params = init_params(SIZES, seed=SEED)
    layers = []
    for index in range(3):
        layers.append(ColumnParallelLinear(solo, params[2 * index], params[2 * index + 1]))
        if index < 2:
            layers.append(ReLU())
    mine = layers[:4] if comm.rank == 0 else layers[4:]
    try:
        Stage(mine)
    except ValueError as exc:
        refused = str(exc)
    stage = Stage(mine, recompute=True)
    pipe = Pipeline(comm, stage, micro_batches=4, schedule="gpipe")
    x, y = _batch(0)
    loss = pipe.step(x, y)
    grads = [np.array(g) for g in stage.grads]
    solo.close()
    return refused, loss, grads


def test_single_slot_layers_need_and_work_with_recompute():
    per_rank = shared_pool(2, env=_ONE_BLAS).run(single_slot_layers, timeout=60)
    loss_ref, _, grads_ref = _reference(0)
    assert "layer(s) 0 (ColumnParallelLinear), 2 (ColumnParallelLinear) keep only the last " \
           "input" in per_rank[0][0]
    assert per_rank[1][1] == pytest.approx(loss_ref, rel=1e-5)
    for got, want in zip(per_rank[0][2] + per_rank[1][2], grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def cupy_pipeline(comm, schedule):
    import cupy

    params = init_params(SIZES, seed=SEED, xp=cupy)
    stage = Stage(mlp_layers(params, comm.size)[comm.rank])
    pipe = Pipeline(comm, stage, micro_batches=3, schedule=schedule)
    x, y = _batch(0)
    loss = pipe.step(cupy.asarray(x), cupy.asarray(y))
    return loss, [cupy.asnumpy(g) for g in stage.grads]


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_on_cupy_arrays(schedule):
    per_rank = run_ranks(cupy_pipeline, 2, schedule, timeout=90)
    loss_ref, _, grads_ref = _reference(0)
    assert per_rank[1][0] == pytest.approx(loss_ref, rel=1e-4)
    for got, want in zip(per_rank[0][1] + per_rank[1][1], grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@two_ranks
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_over_nccl_two_ranks_on_one_gpu(schedule):
    """Stream-ordered sends and receives: each action's output and the next one's input go
    as one NCCL group (tests/test_pp_order.py checks the order without a GPU)."""
    per_rank = run_ranks(on_nccl, 2, cupy_pipeline, schedule, init=False, env=MULTI_RANK_ENV,
                         timeout=240)
    loss_ref, _, grads_ref = _reference(0)
    assert per_rank[1][0] == pytest.approx(loss_ref, rel=1e-4)
    for got, want in zip(per_rank[0][1] + per_rank[1][1], grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- usage errors
class FakeComm:
    """Rank, size and a canned all-gather; any send or receive fails the test."""

    def __init__(self, rank, size, table=None):
        self.rank, self.size, self.table = rank, size, table

    def all_gather(self, row):
        assert self.table is not None, "no all-gather expected"
        return np.array(self.table)

    def isend(self, *args, **kwargs):
        raise AssertionError("sent before the arguments were checked")

    irecv = isend

    def connect_peers(self, peers):  # a built pipeline connects its neighbours: no data
        self.connected = sorted(peers)


def _two_stages():
    return mlp_layers(init_params(SIZES, seed=SEED), 2)


def test_usage_errors_before_anything_is_sent():
    first, last = _two_stages()
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1, got 0"):
        Pipeline(FakeComm(0, 2), Stage(first), micro_batches=0)
    with pytest.raises(ValueError, match="schedule must be one of .*got 'zb'"):
        Pipeline(FakeComm(0, 2), Stage(first), micro_batches=2, schedule="zb")
    with pytest.raises(ValueError, match="a pipeline of 2 stages needs a communicator of 2 "
                                         "ranks .*got 3"):
        Pipeline(FakeComm(0, 3), Stage(first, index=0, stages=2), micro_batches=2)
    with pytest.raises(ValueError, match="stage 1 must run on rank 1 .*not on rank 0"):
        Pipeline(FakeComm(0, 2), Stage(last, index=1, stages=2), micro_batches=2)
    with pytest.raises(ValueError, match="stage 0: layer 0 \\(Linear\\) gives 12 features but "
                                         "layer 1 \\(Linear\\) takes 9"):
        Stage([first[0], last[0]], index=0)
    with pytest.raises(ValueError, match="layers must not be empty"):
        Stage([])
    with pytest.raises(TypeError, match="layer 0 \\(int\\) has no forward"):
        Stage([3])
    # neighbours: stage 0 gives 9 features, stage 1 takes 12 (every rank sees the table)
    f32, f64 = wire_code(np.float32), wire_code(np.float64)
    table = [[7, 9, f32], [12, 5, f32]]
    for rank in (0, 1):
        with pytest.raises(ValueError, match="pipeline stages do not fit: stage 0 gives 9 "
                                             "features, stage 1 takes 12"):
            Pipeline(FakeComm(rank, 2, table), Stage(first if rank == 0 else last),
                     micro_batches=2)
    with pytest.raises(ValueError, match="stage 0 sends float32, stage 1 expects float64"):
        Pipeline(FakeComm(0, 2, [[7, 9, f32], [9, 5, f64]]), Stage(first), micro_batches=2)
    fits = [[7, 9, f32], [9, 5, f32], [5, 5, f32]]
    pipe = Pipeline(FakeComm(0, 2, fits[:2]), Stage(first), micro_batches=3)
    x, y = _batch(0)
    with pytest.raises(ValueError, match="a batch of 10 rows does not split into 3 equal "
                                         "micro-batches"):
        pipe.step(x[:10])
    with pytest.raises(ValueError, match="stage 0 needs the inputs"):
        pipe.step(None, y)
    with pytest.raises(ValueError, match="batch sizes differ: inputs 12, batch_size 6"):
        pipe.step(x, batch_size=6)
    with pytest.raises(ValueError, match=r"inputs must have shape \(rows, 7\), got \(12, 6\)"):
        pipe.step(x[:, :6])
    last_pipe = Pipeline(FakeComm(1, 2, fits[:2]), Stage(last), micro_batches=3)
    with pytest.raises(ValueError, match="the last stage \\(1\\) needs the labels"):
        last_pipe.step(x)
    middle = Pipeline(FakeComm(1, 3, fits), Stage(last), micro_batches=3)
    with pytest.raises(ValueError, match="stage 1 needs batch_size="):
        middle.step()


def neighbours_disagree(comm):
    layers = mlp_layers(init_params(SIZES, seed=SEED), 3)
    mine = layers[comm.rank] if comm.rank != 1 else [Linear(*init_linear_pair())]
    try:
        Pipeline(comm, Stage(mine), micro_batches=2)
    except ValueError as exc:
        return str(exc)
    return None


def init_linear_pair():
    from gpucoll.tp import init_linear

    return init_linear(12, 8)


def test_mismatched_stages_are_named_on_every_rank():
    messages = run_ranks(neighbours_disagree, 3, timeout=60, env=_ONE_BLAS)
    assert messages == ["pipeline stages do not fit: stage 1 gives 8 features, stage 2 "
                        "takes 9"] * 3


# ---------------------------------------------------------------------------- faults
def stage_dies(rank, size, url, victim, how):
    """Stage ``victim`` dies (SIGKILL-like exit) or raises in its third forward."""
    comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url)
    stage = Stage(mlp_layers(init_params(SIZES, seed=SEED), size)[rank])
    pipe = Pipeline(comm, stage, micro_batches=4, schedule="1f1b")
    if rank == victim:
        forward, calls = stage.forward, []

        def failing_forward(x):
            calls.append(x)
            if len(calls) == 3:
                if how == "dies":
                    os._exit(3)
                raise RuntimeError("a layer failed")
            return forward(x)
        stage.forward = failing_forward
    x, y = _batch(0)
    start = time.monotonic()
    try:
        for _ in range(2):
            pipe.step(x, y)
        return "finished", None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    finally:
        comm.abort()


@pytest.mark.parametrize("victim,how", [(2, "dies"), (1, "dies"), (0, "raises")])
def test_a_failing_stage_is_an_error_on_every_other_stage(victim, how):
    timeout = 10.0
    survivors = [r for r in range(3) if how == "raises" or r != victim]
    results = run_ranks(stage_dies, 3, victim, how, init=False, ranks=survivors, timeout=60,
                        env=dict(_ONE_BLAS, GPUCOLL_TIMEOUT=str(timeout)))
    for rank, (message, elapsed) in zip(survivors, results):
        if rank == victim:
            assert message == "RuntimeError: a layer failed"
            continue
        name = message.split(":")[0]
        assert name in ("PeerError", "CommAbortedError"), message
        assert issubclass(getattr(gpucoll, name), gpucoll.GpucollError)
        assert f"rank {rank}" in message
        assert elapsed < timeout, message    # told by the closed links, not by the timeout


# ---------------------------------------------------------------------------- with DP
def pipelines_times_replicas(comm, stages, schedule):
    from gpucoll.ddp import Bucketer

    pipe_comm, dp_comm = pipeline_groups(comm, stages)
    stage = Stage(mlp_layers(init_params(SIZES, seed=SEED), stages)[pipe_comm.rank])
    pipe = Pipeline(pipe_comm, stage, micro_batches=3, schedule=schedule)
    x, y = _batch(0, rows=BATCH * dp_comm.size)
    mine = slice(dp_comm.rank * BATCH, (dp_comm.rank + 1) * BATCH)
    loss = pipe.step(x[mine], y[mine])
    grads = Bucketer(dp_comm, stage.params).reduce(stage.grads)
    result = (pipe_comm.rank, dp_comm.rank, loss, [np.array(g) for g in grads])
    pipe_comm.close()
    dp_comm.close()
    return result


@pytest.mark.parametrize("stages,replicas,schedule", [(2, 2, "1f1b"), (3, 2, "gpipe")])
def test_pipelines_times_data_parallel_replicas(stages, replicas, schedule):
    per_rank = run_ranks(pipelines_times_replicas, stages * replicas, stages, schedule,
                         timeout=90, env=_ONE_BLAS)
    loss_ref, _, grads_ref = _reference(0, rows=BATCH * replicas)
    slices = _stage_slices(stages)
    for world_rank, (stage, replica, loss, grads) in enumerate(per_rank):
        assert (stage, replica) == (world_rank % stages, world_rank // stages)
        for got, want in zip(grads, grads_ref[slices[stage]]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    losses = [loss for stage, _, loss, _ in per_rank if stage == stages - 1]
    assert np.mean(losses) == pytest.approx(loss_ref, rel=1e-5)


def test_stages_must_divide_the_ranks():
    with pytest.raises(ValueError, match="3 stages do not divide the 4 ranks"):
        pipeline_groups(FakeComm(0, 4), 3)


def test_example_trains_pipelines_inside_data_parallel_groups():
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", "4", "-m",
                          "gpucoll.examples.train_pp", "--epochs", "2", "--cpu", "--dp", "2",
                          "--schedule", "gpipe", "--microbatches", "4"],
                         capture_output=True, text=True, timeout=100,
                         env=dict(os.environ, **_ONE_BLAS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 data-parallel replica(s) x 2 stage(s), schedule gpipe, 4 micro-batches" \
        in out.stdout
    epochs = [line for line in out.stdout.splitlines() if "] epoch" in line]
    assert len(epochs) == 2 and float(epochs[-1].split("test acc")[1].split()[0]) > 0.9
