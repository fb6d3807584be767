"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages): the action lists against a
hand-checked example and Megatron's warm-up, every chunk's forward and backward once and in
order, the lockstep timetable and its bubble ``(P - 1) / (v M + P - 1)``; a pipelined step
with two chunks per rank equals the unsplit model (NumPy reference) at 2 and 3 ranks; usage
errors before anything is sent; the example (``gpucoll.examples.train_pp --schedule
interleaved``) under ``gpucoll run -n 2`` trains as the same model does in one process. The
issue order is checked in ``tests/test_pp_order.py``."""

import numpy as np
import pytest

from gpucoll.examples.train_digits import init_params, loss_and_grads
from gpucoll.pp import (Pipeline, Stage, bubble_fraction, mlp_layers, peak_in_flight,
                        schedule_actions, timetable)
from gpucoll.types import wire_code
from mp_harness import rank_pools

pytestmark = pytest.mark.timeout(120)

# the rank processes import this module: tests/test_pp.py (its batches, FakeComm, schedule
# simulation) is imported only where the test process needs it, as it pulls in CuPy
_ONE_BLAS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}   # as in tests/test_pp.py


def _pp():
    import test_pp

    return test_pp

DEEP = [7, 12, 9, 11, 8, 10, 5]     # six linear layers: 2 ranks x 2 chunks take (2, 2, 1, 1)
BATCH, SEED = 12, 4                 # divisible by M = 2, 3, 4 and 6


# ---------------------------------------------------------------------------- schedule
def test_two_stages_two_chunks_four_micro_batches_by_hand():
    """Rank 0 warms up 2 (P - 1) + (v - 1) P = 4 forwards, rank 1 2; forwards go in groups of
    P = 2 micro-batches per chunk, backwards the same with the chunks reversed."""
    F = lambda m, k: ("F", m, k)      # noqa: E731
    B = lambda m, k: ("B", m, k)      # noqa: E731
    rank0 = [F(0, 0), F(1, 0), F(0, 1), F(1, 1),
             F(2, 0), B(0, 1), F(3, 0), B(1, 1), F(2, 1), B(0, 0), F(3, 1), B(1, 0),
             B(2, 1), B(3, 1), B(2, 0), B(3, 0)]
    rank1 = [F(0, 0), F(1, 0),
             F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2, 0), B(0, 0), F(3, 0), B(1, 0),
             F(2, 1), B(2, 1), F(3, 1), B(3, 1),
             B(2, 0), B(3, 0)]
    assert schedule_actions("interleaved", 0, 2, 4, 2) == rank0
    assert schedule_actions("interleaved", 1, 2, 4, 2) == rank1
    # in lockstep: rank 1 starts one slot late; rank 0 waits twice for chunk 3's backwards
    slots = timetable("interleaved", 2, 4, 2)
    assert slots[0] == rank0[:12] + [None, B(2, 1), None, B(3, 1), B(2, 0), B(3, 0)]
    assert slots[1] == [None] + rank1 + [None]
    assert [peak_in_flight(rank0), peak_in_flight(rank1)] == [5, 3]
    assert bubble_fraction(2, 4, 2) == pytest.approx(1 / 9)   # 1F1B: 1 / 5


def _megatron_warmup(rank, stages, micro_batches, chunks):
    if micro_batches == stages:
        return chunks * micro_batches
    return min(2 * (stages - 1 - rank) + (chunks - 1) * stages, chunks * micro_batches)


def test_interleaved_invariants():
    for stages in range(2, 5):
        for chunks in range(1, 4):
            for micro_batches in (stages, 2 * stages, 3 * stages):
                slots = timetable("interleaved", stages, micro_batches, chunks)
                starts = {}
                makespan = _pp()._simulate("interleaved", stages, micro_batches, chunks, starts)
                for rank in range(stages):
                    actions = schedule_actions("interleaved", rank, stages, micro_batches,
                                               chunks)
                    every = {(kind, m, k) for kind in "FB" for m in range(micro_batches)
                             for k in range(chunks)}
                    assert sorted(actions) == sorted(every)          # each exactly once
                    for k in range(chunks):     # a chunk's backwards in its forwards' order
                        for kind in "FB":
                            assert [m for x, m, c in actions if (x, c) == (kind, k)] == \
                                list(range(micro_batches))
                    assert all(actions.index(("F", m, k)) < actions.index(("B", m, k))
                               for _, m, k in every)
                    warmup = _megatron_warmup(rank, stages, micro_batches, chunks)
                    assert all(kind == "F" for kind, _, _ in actions[:warmup])
                    assert warmup == len(actions) or actions[warmup + 1][0] == "B"
                    assert peak_in_flight(actions) == min(warmup + 1, chunks * micro_batches)
                    # the timetable: the same actions, at the slots of an independent
                    # simulation (dependencies across ranks and the wrap-around respected)
                    assert [a for a in slots[rank] if a is not None] == actions
                    assert all(slots[rank][starts[(rank, a)]] == a for a in actions)
                assert makespan == len(slots[0]) == 2 * (chunks * micro_batches + stages - 1)
                busy = 2 * chunks * micro_batches
                assert (makespan - busy) / makespan == pytest.approx(
                    bubble_fraction(stages, micro_batches, chunks))


def test_one_chunk_schedules_are_unchanged():
    assert schedule_actions("1f1b", 0, 3, 4, virtual_stages=1) == \
        schedule_actions("1f1b", 0, 3, 4)
    assert bubble_fraction(3, 4) == bubble_fraction(3, 4, 1) == pytest.approx(2 / 6)
    assert timetable("gpipe", 2, 2) == [[("F", 0), ("F", 1), None, None, ("B", 0), ("B", 1)],
                                        [None, ("F", 0), ("F", 1), ("B", 0), ("B", 1), None]]


def test_schedule_usage_errors():
    with pytest.raises(ValueError, match="needs micro_batches to be a multiple of the 3 "
                                         "stages, got 4"):
        schedule_actions("interleaved", 0, 3, 4, 2)
    with pytest.raises(ValueError, match="schedule '1f1b' runs one model chunk per stage, got "
                                         "virtual_stages=2"):
        schedule_actions("1f1b", 0, 2, 4, 2)
    with pytest.raises(ValueError, match="virtual_stages must be an int >= 1, got 0"):
        schedule_actions("interleaved", 0, 2, 4, 0)
    with pytest.raises(ValueError, match="schedule must be one of .*got 'Interleaved1F1B'"):
        timetable("Interleaved1F1B", 2, 4, 2)


# ---------------------------------------------------------------------------- equal to unsplit
def _chunk_slices(chunks):
    """Which of the reference's parameter arrays each model chunk holds."""
    slices, start = [], 0
    for layers in mlp_layers(init_params(DEEP, seed=SEED), chunks):
        count = sum(len(layer.params) for layer in layers)
        slices.append(slice(start, start + count))
        start += count
    return slices


def interleaved_steps(comm, chunks_per_rank, micro_batches, batches):
    total = comm.size * chunks_per_rank
    layers = mlp_layers(init_params(DEEP, seed=SEED), total)
    chunks = [Stage(layers[c], index=c, stages=total)
              for c in range(comm.rank, total, comm.size)]
    pipe = Pipeline(comm, chunks, micro_batches=micro_batches, schedule="interleaved",
                    virtual_stages=chunks_per_rank)
    results = []
    for x, y in batches:       # the second step checks that gradients restart from zero
        loss = pipe.step(x if comm.rank == 0 else None, y if pipe.is_last else None,
                         batch_size=BATCH)
        results.append((loss, pipe.correct, [[np.array(g) for g in c.grads] for c in chunks],
                        [c.stored for c in chunks]))
    x, y = batches[0]
    return results, pipe.evaluate(x, y), [c.stored for c in chunks]


pool = rank_pools([2, 3], ids=lambda n: f"{n}ranks", env=_ONE_BLAS)


@pytest.mark.parametrize("per_stage", [1, 2], ids=["M=P", "M=2P"])
def test_interleaved_step_equals_unsplit_model(pool, per_stage):
    stages, chunks_per_rank = pool.world_size, 2
    micro_batches = per_stage * stages
    batches = [_pp()._batch(step) for step in range(2)]
    per_rank = pool.run(interleaved_steps, chunks_per_rank, micro_batches, batches)
    slices = _chunk_slices(stages * chunks_per_rank)
    params = init_params(DEEP, seed=SEED)
    for step, (x, y) in enumerate(batches):
        loss_ref, correct_ref, grads_ref = loss_and_grads(params, x, y)
        for rank, (results, _, _) in enumerate(per_rank):
            loss, correct, grads, stored = results[step]
            if rank == stages - 1:
                assert loss == pytest.approx(loss_ref, rel=1e-5) and correct == correct_ref
            else:
                assert loss is None
            assert stored == [0] * chunks_per_rank
            for k, chunk_grads in enumerate(grads):
                want = grads_ref[slices[k * stages + rank]]
                assert len(chunk_grads) == len(want)
                for got, expected in zip(chunk_grads, want):
                    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    loss_ref, correct_ref, _ = loss_and_grads(params, *batches[0])
    for rank, (_, (loss, correct), stored) in enumerate(per_rank):
        assert stored == [0] * chunks_per_rank          # evaluation keeps nothing
        if rank == stages - 1:
            assert loss == pytest.approx(loss_ref, rel=1e-5) and correct == correct_ref
        else:
            assert loss is None and correct is None


# ---------------------------------------------------------------------------- usage errors
def _chunks(rank, stages=2, per_rank=2, indexed=False):
    total = stages * per_rank
    layers = mlp_layers(init_params(DEEP, seed=SEED), total)
    return [Stage(layers[c], **(dict(index=c, stages=total) if indexed else {}))
            for c in range(rank, total, stages)]


def _table():
    """What the all-gather of (in, out, dtype) per chunk returns for DEEP on 2 ranks x 2:
    rank r's row k is chunk k * 2 + r."""
    f32 = wire_code(np.float32)
    return [[(s.in_features, s.out_features, f32) for s in _chunks(rank)] for rank in (0, 1)]


def test_interleaved_usage_errors_before_anything_is_sent():
    FakeComm, mine = _pp().FakeComm, _chunks(0)
    with pytest.raises(ValueError, match="needs micro_batches to be a multiple of the 2 "
                                         "stages, got 3"):
        Pipeline(FakeComm(0, 2), mine, micro_batches=3, schedule="interleaved")
    with pytest.raises(ValueError, match="schedule '1f1b' runs one Stage per rank, got 2 "
                                         "chunks"):
        Pipeline(FakeComm(0, 2), mine, micro_batches=2)
    with pytest.raises(ValueError, match="virtual_stages=3 needs a list of 3 Stages"):
        Pipeline(FakeComm(0, 2), mine, micro_batches=2, schedule="interleaved",
                 virtual_stages=3)
    with pytest.raises(ValueError, match="virtual_stages=2 needs a list of 2 Stages .*got 1"):
        Pipeline(FakeComm(0, 2), mine[0], micro_batches=2, schedule="interleaved",
                 virtual_stages=2)
    with pytest.raises(ValueError, match="needs a pipeline of 2 ranks or more, got 1"):
        Pipeline(FakeComm(0, 1), mine, micro_batches=2, schedule="interleaved")
    with pytest.raises(TypeError, match="a gpucoll.pp.Stage \\(or a list of them\\), got list"):
        Pipeline(FakeComm(0, 2), [mine[0], [mine[1]]], micro_batches=2,
                 schedule="interleaved")
    with pytest.raises(ValueError, match="rank 0's chunk 1 must be the model's chunk 2 "
                                         "\\(chunk c runs on rank c % 2\\), got stage index 1"):
        Pipeline(FakeComm(0, 2), [_chunks(0, indexed=True)[0], _chunks(1, indexed=True)[0]],
                 micro_batches=2, schedule="interleaved")
    with pytest.raises(ValueError, match="rank 0's chunk 0 belongs to a pipeline of 4 chunks, "
                                         "but 3 ranks x 2 chunks make 6"):
        Pipeline(FakeComm(0, 3), _chunks(0, indexed=True), micro_batches=3,
                 schedule="interleaved")
    # across the wrap-around: chunk 1 (rank 1) gives 8 features, chunk 2 (rank 0) takes 8;
    # every rank sees the table, so every rank names the same two chunks
    table = _table()
    table[0][1] = (9, table[0][1][1], table[0][1][2])
    for rank in (0, 1):
        with pytest.raises(ValueError, match="pipeline stages do not fit: chunk 1 \\(rank 1\\) "
                                             "gives 8 features, chunk 2 \\(rank 0\\) takes 9"):
            Pipeline(FakeComm(rank, 2, table), _chunks(rank), micro_batches=2,
                     schedule="interleaved")
    pipe = Pipeline(FakeComm(0, 2, _table()), mine, micro_batches=2, schedule="interleaved")
    x, _ = _pp()._batch(0)
    with pytest.raises(ValueError, match=r"inputs must have shape \(rows, 7\), got \(12, 6\)"):
        pipe.step(x[:, :6])
    assert pipe.virtual_stages == 2 and pipe.chunks == mine


# ---------------------------------------------------------------- the example, launched
EPOCH_LINE = r"epoch +(\d+) +loss ([0-9.]+) +train acc ([0-9.]+) +test acc ([0-9.]+)"


def _example(tmp_path, data, launch=(), flags=()):
    """The epoch lines (epoch, loss, train acc, test acc) of train_pp and its output."""
    import os
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", *launch, "gpucoll.examples.train_pp",
                          "--cpu", "--data", data, "--epochs", "2", "--hidden", "32",
                          "--hidden-layers", "3", "--microbatches", "4", *flags],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env=dict(os.environ, GPUCOLL_QUIET="1", **_ONE_BLAS))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [tuple(float(v) for v in m.groups()) for m in re.finditer(EPOCH_LINE, out.stdout)]
    return lines, out.stdout


def test_the_interleaved_example_under_the_launcher_trains_as_one_process(tmp_path):
    """``gpucoll run -n 2 -m gpucoll.examples.train_pp --schedule interleaved
    --virtual-stages 2``: four one-layer chunks, chunk c on rank c % 2, and four micro-batches
    give every epoch the loss and accuracies of the same model trained in one process without
    a pipeline (the same seed; only the order of additions may differ), and it learns the
    digits (2 short epochs: 0.91 test accuracy)."""
    from test_local_sgd import digits_file     # the digits without importing scikit-learn

    data = digits_file(tmp_path)
    interleaved, shown = _example(tmp_path, data, ["gpucoll", "run", "-n", "2", "-m"],
                                  ["--schedule", "interleaved", "--virtual-stages", "2"])
    assert "2 stage(s), schedule interleaved, 2 chunks per stage, 4 micro-batches of 16 rows, " \
           "4 linear layers" in shown, shown
    alone, _ = _example(tmp_path, data)
    assert [line[0] for line in interleaved] == [line[0] for line in alone] == [1, 2], shown
    for (_, loss, train, test), (_, want_loss, want_train, want_test) in zip(interleaved, alone):
        assert loss == pytest.approx(want_loss, abs=2e-4)          # printed to 4 decimals
        assert train == pytest.approx(want_train, abs=2e-3)        # a sample of 1438
        assert test == pytest.approx(want_test, abs=3e-3)          # a sample of 359
    assert interleaved[-1][3] > 0.85 and interleaved[-1][1] < 0.6 * interleaved[0][1], shown
