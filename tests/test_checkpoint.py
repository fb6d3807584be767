"""Checkpoints of ZeRO-1 and FSDP state: the content equals an independent reference (the
parameters and the optimizer's moments of one process on the full batch), training resumed
from a checkpoint at another world size (2 -> 3, 3 -> 2, 3 -> 1), in the other class or with
other bucket caps ends where one uninterrupted process ends, and resumed at the same size it
is bit-identical to never stopping. Every way a load or save can fail raises the same error
type on every rank and changes nothing."""

import json
import os
import pickle

import numpy as np
import pytest

from gpucoll.ddp import (CheckpointError, FullyShardedParameters, ShardedOptimizer,
                         checkpoint_exists)
from gpucoll.ddp.checkpoint_files import METADATA
from gpucoll.examples.train_digits import init_params, loss_and_grads
from gpucoll.examples.train_fsdp import fsdp_loss_and_grads
from mp_harness import RankPool, shared_pool
from reference_training import SETTINGS, ReferenceOptimizer, rank_batch, training_data

pytestmark = pytest.mark.timeout(180)

SIZES = [13, 17, 11, 7]        # 520 floats in three layers: no unit divides by 2 or 3
GLOBAL_BATCH = 12
STEPS = 5
SAVED_AT = 2                   # steps before the checkpoint
CAPS = {"zero": dict(first_bucket_cap_bytes=64, bucket_cap_bytes=512),   # several buckets
        "zero-other-caps": dict(first_bucket_cap_bytes=4096, bucket_cap_bytes=1 << 20)}


@pytest.fixture(scope="module")
def pools():
    """Pools of 2 and 3 ranks, shared with the other modules (the rank functions here leave
    the communicator as they found it)."""
    return {n: shared_pool(n) for n in (2, 3)}


def _data():
    return training_data(SIZES, STEPS, GLOBAL_BATCH)


def reference(optimizer, steps):
    """One process, the whole batch, the optimizer written apart from gpucoll's."""
    x, y = _data()
    params = init_params(SIZES, seed=5)
    opt = ReferenceOptimizer(optimizer, params)
    for step in range(steps):
        _, _, grads = loss_and_grads(params, *rank_batch(x, y, step, 0, 1, GLOBAL_BATCH))
        opt.step(params, grads)
    return params, opt


def _make(comm, kind, optimizer, params, **settings):
    settings = dict(SETTINGS[optimizer], **settings)
    if kind == "fsdp":
        units = [params[i:i + 2] for i in range(0, len(params), 2)]
        return FullyShardedParameters(comm, units, optimizer, **settings)
    return ShardedOptimizer(comm, params, optimizer, **CAPS[kind], **settings)


def _train(comm, kind, obj, params, steps):
    x, y = _data()
    for step in steps:
        xb, yb = rank_batch(x, y, step, comm.rank, comm.size, GLOBAL_BATCH)
        if kind == "fsdp":
            fsdp_loss_and_grads(obj, xb, yb)
        else:
            loss_and_grads(params, xb, yb, on_grad=obj.mark_ready)
        assert obj.step()


def _params_of(kind, obj, params):
    if kind == "fsdp":
        return [p for unit in obj.full_parameters() for p in unit]
    return [p.copy() for p in params]


def rank_start(comm, kind, optimizer, where, form, steps=SAVED_AT):
    """Train ``steps`` steps from the seed, then save (files, or a pickled state_dict)."""
    params = init_params(SIZES, seed=5)
    obj = _make(comm, kind, optimizer, params)
    _train(comm, kind, obj, params, range(steps))
    if form == "files":
        obj.save_checkpoint(where, extra={"step": steps, "sampler": [1, 2]})
    else:
        state = obj.state_dict(root=0)
        if comm.rank == 0:
            with open(where, "wb") as f:
                pickle.dump(state, f)
    return _params_of(kind, obj, params)


def rank_resume(comm, kind, optimizer, where, form):
    """Start from other values and another learning rate (the checkpoint's must replace
    them), load, train to STEPS."""
    params = [p * 0 + 7 for p in init_params(SIZES, seed=5)]
    obj = _make(comm, kind, optimizer, params, lr=0.5)
    if form == "files":
        extra = obj.load_checkpoint(where)
    else:
        with open(where, "rb") as f:
            obj.load_state_dict(pickle.load(f))
        extra = None
    steps = obj.steps
    _train(comm, kind, obj, params, range(steps, STEPS))
    return _params_of(kind, obj, params), extra, steps, obj.optimizer.lr


def rank_state(comm, kind, optimizer, root):
    params = init_params(SIZES, seed=5)
    obj = _make(comm, kind, optimizer, params)
    _train(comm, kind, obj, params, range(SAVED_AT))
    return obj.state_dict(root=root)


# ---------------------------------------------------------------- content
@pytest.mark.parametrize("kind", ["zero", "fsdp"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("n", [2, 3])
def test_state_dict_holds_the_reference_state(pools, n, kind, optimizer):
    want_params, want = reference(optimizer, SAVED_AT)
    for root in (None, n - 1):
        states = pools[n].run(rank_state, kind, optimizer, root)
        if root is not None:
            assert [s is None for s in states] == [r != root for r in range(n)]
        state = states[n - 1]
        assert state["steps"] == SAVED_AT and state["skipped_steps"] == 0
        assert state["dtype"] == "float32"
        assert [tuple(s) for s in state["shapes"]] == [p.shape for p in want_params]
        assert state["optimizer"]["name"] == optimizer
        assert state["optimizer"]["settings"]["lr"] == SETTINGS[optimizer]["lr"]
        for got, expected in zip(state["params"], want_params):
            assert isinstance(got, np.ndarray) and got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        moments = state["optimizer"]["state"]
        if optimizer == "sgd":
            assert sorted(moments) == ["velocity"] and state["optimizer"]["scalars"] == {}
            pairs = [(moments["velocity"], want.m)]
        else:
            assert sorted(moments) == ["m", "v"]
            assert state["optimizer"]["scalars"] == {"step": [SAVED_AT] * len(want_params)}
            pairs = [(moments["m"], want.m), (moments["v"], want.v)]
        for gots, expecteds in pairs:
            for got, expected in zip(gots, expecteds):
                assert got.shape == expected.shape
                np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
        if root is None:   # every rank got the same dict
            for other in states[:-1]:
                for a, b in zip(other["params"], state["params"]):
                    np.testing.assert_array_equal(a, b)


def test_state_before_the_first_step_has_no_moments(solo):
    params = init_params(SIZES, seed=5)
    opt = ShardedOptimizer(solo, params, "adam")
    state = opt.state_dict()
    assert state["optimizer"]["state"] == {} and state["optimizer"]["scalars"] == {}
    fresh = ShardedOptimizer(solo, [p * 0 for p in params], "adam")
    fresh.load_state_dict(state)
    for a, b in zip(fresh.params, params):
        np.testing.assert_array_equal(a, b)
    assert fresh.optimizer.state == [] and fresh.steps == 0


# ---------------------------------------------------------------- resuming
RESUMES = [  # (saved by, loaded by, ranks saving, ranks loading, form)
    ("zero", "zero", 2, 3, "files"),
    ("zero", "zero", 3, 2, "dict"),
    ("fsdp", "fsdp", 3, 2, "files"),
    ("fsdp", "fsdp", 2, 3, "dict"),
    ("zero", "fsdp", 2, 3, "files"),
    ("fsdp", "zero-other-caps", 3, 2, "files"),
]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("saver,loader,a,b,form", RESUMES,
                         ids=[f"{s}{a}-to-{ld}{b}-{f}" for s, ld, a, b, f in RESUMES])
def test_resume_at_another_world_size_ends_where_one_process_ends(
        pools, tmp_path, optimizer, saver, loader, a, b, form):
    where = str(tmp_path / ("ckpt" if form == "files" else "state.pkl"))
    pools[a].run(rank_start, saver, optimizer, where, form)
    if form == "files":
        assert checkpoint_exists(where)
        names = sorted(os.listdir(where))
        keys = ["param"] + (["velocity"] if optimizer == "sgd" else ["m", "v"])
        assert names == sorted([METADATA] + [f"{k}-rank{r:05d}-of-{a:05d}.npy"
                                             for k in keys for r in range(a)])
    results = pools[b].run(rank_resume, loader, optimizer, where, form)
    want, _ = reference(optimizer, STEPS)
    for params, extra, steps, lr in results:
        assert steps == SAVED_AT and lr == SETTINGS[optimizer]["lr"]
        assert extra == ({"step": SAVED_AT, "sampler": [1, 2]} if form == "files" else None)
        for got, expected in zip(params, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["zero", "fsdp"])
def test_resume_at_the_same_size_is_bit_identical(pools, tmp_path, kind):
    where = str(tmp_path / "ckpt")
    uninterrupted = pools[3].run(rank_start, kind, "adam", str(tmp_path / "other"), "files",
                                 STEPS)
    pools[3].run(rank_start, kind, "adam", where, "files")
    resumed = pools[3].run(rank_resume, kind, "adam", where, "files")
    for (params, *_), whole in zip(resumed, uninterrupted):
        for got, expected in zip(params, whole):
            np.testing.assert_array_equal(got, expected)


def test_resume_on_one_rank_in_this_process(pools, solo, tmp_path):
    where = str(tmp_path / "ckpt")
    pools[3].run(rank_start, "fsdp", "adam", where, "files")
    params, extra, steps, _ = rank_resume(solo, "zero", "adam", where, "files")
    want, _ = reference("adam", STEPS)
    for got, expected in zip(params, want):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_saving_again_replaces_the_checkpoint_and_its_files(pools, tmp_path):
    where = str(tmp_path / "ckpt")
    pools[3].run(rank_start, "zero", "sgd", where, "files")
    pools[2].run(rank_start, "zero", "sgd", where, "files", 3)    # fewer ranks, later step
    assert sorted(os.listdir(where)) == sorted(
        [METADATA] + [f"{k}-rank{r:05d}-of-00002.npy" for k in ("param", "velocity")
                      for r in range(2)])
    with open(os.path.join(where, METADATA)) as f:
        assert json.load(f)["steps"] == 3


def rank_async_save(comm, kind, where):
    """Save without waiting, train on (the checkpoint must hold the state at the save), then
    wait; a second save before the wait is refused."""
    params = init_params(SIZES, seed=5)
    obj = _make(comm, kind, "adam", params)
    _train(comm, kind, obj, params, range(SAVED_AT))
    pending = obj.save_checkpoint(where, extra={"step": SAVED_AT}, async_write=True)
    complete_before = checkpoint_exists(where)
    _train(comm, kind, obj, params, range(SAVED_AT, STEPS))     # changes every slice
    refused = _outcome(lambda: obj.save_checkpoint(where + "-other"))
    path = pending.wait()
    assert pending.wait() == path and pending.done()
    return complete_before, refused, path, checkpoint_exists(where)


@pytest.mark.parametrize("kind", ["zero", "fsdp"])
def test_async_save_holds_the_state_at_the_call_and_completes_in_wait(pools, tmp_path, kind):
    where = str(tmp_path / "ckpt")
    for complete_before, refused, path, complete in pools[2].run(rank_async_save, kind, where):
        assert not complete_before and complete and path == os.path.join(where, METADATA)
        assert refused.startswith("ValueError: save_checkpoint: the previous "
                                  "save_checkpoint(async_write=True) has not been waited for")
    want, _ = reference("adam", STEPS)
    for params, extra, steps, _ in pools[3].run(rank_resume, "zero", "adam", where, "files"):
        assert steps == SAVED_AT and extra == {"step": SAVED_AT}
        for got, expected in zip(params, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def rank_async_write_error(comm, where):
    params = init_params(SIZES, seed=5)
    obj = _make(comm, "zero", "sgd", params)
    _train(comm, "zero", obj, params, range(1))
    pending = obj.save_checkpoint(where, async_write=True)
    return _outcome(pending.wait)


def test_an_async_write_error_comes_from_wait_on_every_rank(pools, tmp_path):
    where = tmp_path / "ckpt"
    (where / "velocity-rank00001-of-00002.npy").mkdir(parents=True)   # rank 1 cannot replace it
    outcomes = pools[2].run(rank_async_write_error, str(where))
    assert outcomes[1].startswith("IsADirectoryError:"), outcomes
    assert outcomes[0].startswith("IsADirectoryError: save_checkpoint failed on rank 1"), outcomes
    assert not checkpoint_exists(str(where))


# ---------------------------------------------------------------- failures
def _outcome(call):
    try:
        value = call()
    except (OSError, ValueError, TypeError, CheckpointError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"ok {value!r}"


def rank_failing_load(comm, case, where):
    params = init_params(SIZES, seed=5)
    kind, optimizer = "zero", "adam"
    if case == "shapes":
        params = init_params([13, 17, 11, 8], seed=5)
    elif case == "optimizer":
        optimizer = "sgd"
    elif case == "dtype":
        params = [p.astype(np.float64) for p in params]
    obj = _make(comm, kind, optimizer, params)
    before = [p.copy() for p in params]
    path = where[comm.rank] if isinstance(where, list) else where
    if case == "busy":
        x, y = _data()
        loss_and_grads(params, *rank_batch(x, y, 0, comm.rank, comm.size, GLOBAL_BATCH),
                       on_grad=obj.mark_ready)
        text = _outcome(lambda: obj.load_checkpoint(path))
        assert obj.step()        # the step in progress finishes as if nothing happened
        return text, True
    if case == "not a dict":
        text = _outcome(lambda: obj.load_state_dict([1, 2]))
    else:
        text = _outcome(lambda: obj.load_checkpoint(path))
    unchanged = all(np.array_equal(a, b) for a, b in zip(params, before))
    return text, unchanged and obj.steps == 0 and obj.optimizer.state == []


FAILURES = [  # case, what is done to the checkpoint, expected error type, words
    ("empty", None, "FileNotFoundError", "no complete checkpoint"),
    ("one rank elsewhere", None, "FileNotFoundError", "no complete checkpoint"),
    ("shapes", None, "ValueError", "parameter 4 has shape (11, 7) in the checkpoint and (11, 8)"),
    ("optimizer", None, "ValueError", "saved with optimizer 'adam'"),
    ("dtype", None, "TypeError", "holds float32 parameters"),
    ("slice file", "remove", "FileNotFoundError", "is missing from the checkpoint"),
    ("metadata", "truncate", "ValueError", "is not valid JSON"),
    ("different", None, "ValueError", "were given different checkpoints"),
    ("busy", None, "ValueError", "already marked ready"),
    ("not a dict", None, "TypeError", "state must be the dict"),
]


@pytest.mark.parametrize("case,damage,kind,words", FAILURES, ids=[f[0] for f in FAILURES])
def test_a_failed_load_raises_the_same_type_everywhere_and_changes_nothing(
        pools, tmp_path, case, damage, kind, words):
    where = str(tmp_path / "ckpt")
    if case != "empty":
        pools[2].run(rank_start, "fsdp", "adam", where, "files")
    if damage == "remove":
        os.remove(os.path.join(where, "m-rank00001-of-00002.npy"))
    elif damage == "truncate":
        with open(os.path.join(where, METADATA), "r+b") as f:
            f.truncate(40)
    target = where
    if case == "one rank elsewhere":
        target = [where, where, str(tmp_path / "nothing-here")]
    elif case == "different":
        later = str(tmp_path / "later")
        pools[2].run(rank_start, "fsdp", "adam", later, "files", 3)
        target = [where, where, later]
    outcomes = pools[3].run(rank_failing_load, case, target)
    for rank, (text, unchanged) in enumerate(outcomes):
        assert text.startswith(kind + ":"), (rank, text)
        assert unchanged, rank
    assert any(words in text for text, _ in outcomes), outcomes
    if case == "one rank elsewhere":   # rank 2 failed; the others quote it
        assert "failed on rank 2" in outcomes[0][0]


def rank_failing_save(comm, case, where):
    params = init_params(SIZES, seed=5)
    obj = _make(comm, "zero", "sgd", params)
    _train(comm, "zero", obj, params, range(1))
    if case == "extra":
        return _outcome(lambda: obj.save_checkpoint(where, extra={"bad": object()}))
    if case == "not shared":        # every rank but 0 writes somewhere rank 0 never looks
        path = where if comm.rank == 0 else f"{where}-rank{comm.rank}"
        return _outcome(lambda: obj.save_checkpoint(path))
    if case == "root":
        return _outcome(lambda: obj.state_dict(root=comm.size))
    raise AssertionError(case)


@pytest.mark.parametrize("case,kind,words", [
    ("extra", "TypeError", "extra must be JSON-compatible"),
    ("not shared", "FileNotFoundError", "on a shared file system"),
    ("root", "ValueError", "root must be a rank in [0, 2)"),
])
def test_a_failed_save_raises_everywhere_and_leaves_no_checkpoint(pools, tmp_path, case,
                                                                    kind, words):
    where = str(tmp_path / "ckpt")
    outcomes = pools[2].run(rank_failing_save, case, where)
    for text in outcomes:
        assert text.startswith(kind + ":") and (words in text or "failed on rank 0" in text), \
            outcomes
    assert words in outcomes[0]
    assert not checkpoint_exists(where)


def test_bad_state_dicts_are_refused_before_anything_changes(solo):
    params = init_params(SIZES, seed=5)
    opt = ShardedOptimizer(solo, params, "adam")
    opt.reduce_and_step([np.ones_like(p) for p in params])
    state = opt.state_dict()
    before = [p.copy() for p in params]
    cases = {
        "no format": ({k: v for k, v in state.items() if k != "format"}, "state has no format"),
        "other format": (dict(state, format="x"), "not a gpucoll sharded-training checkpoint"),
        "array shape": (dict(state, params=state["params"][:-1] + [np.zeros(3)]),
                        "'param' of parameter 5 has shape (3,)"),
        "too few": (dict(state, params=state["params"][:2]), "holds 2 arrays of 'param'"),
        "moments": (dict(state, optimizer=dict(state["optimizer"], state={
            "m": state["optimizer"]["state"]["m"]})), "optimizer state holds ['m']"),
    }
    for name, (bad, words) in cases.items():
        with pytest.raises(ValueError, match=None) as info:
            opt.load_state_dict(bad)
        assert words in str(info.value), (name, str(info.value))
        for a, b in zip(params, before):
            np.testing.assert_array_equal(a, b)
        assert opt.steps == 1


def test_state_dict_is_refused_while_gradients_are_marked(solo):
    params = init_params(SIZES, seed=5)
    opt = ShardedOptimizer(solo, params, "sgd")
    opt.mark_ready(5, np.ones(7, np.float32))
    with pytest.raises(ValueError, match=r"gradients \[5\] of this step were already marked"):
        opt.state_dict()
    for index in reversed(range(5)):
        opt.mark_ready(index, np.ones_like(params[index]))
    assert opt.step() and opt.state_dict()["steps"] == 1


def test_fsdp_load_releases_gathered_units_and_refuses_during_a_step(solo, tmp_path):
    params = init_params(SIZES, seed=5)
    fsdp = FullyShardedParameters(solo, [params[i:i + 2] for i in range(0, 6, 2)], "sgd")
    fsdp.save_checkpoint(str(tmp_path / "c"))
    stale = fsdp.gather(1)
    fsdp.load_checkpoint(str(tmp_path / "c"))
    assert fsdp.gathered_units == [] and stale[0].shape == (17, 11)
    fsdp.reduce_gradients(2, [np.zeros((11, 7), np.float32), np.zeros(7, np.float32)])
    with pytest.raises(ValueError, match=r"units \[2\] are being reduced"):
        fsdp.save_checkpoint(str(tmp_path / "d"))
    assert not checkpoint_exists(str(tmp_path / "d"))


# ---------------------------------------------------------------- GPU
def _gpu_resume(comm, where):
    import cupy

    params = [cupy.asarray(p) for p in init_params(SIZES, seed=5)]
    fsdp = _make(comm, "fsdp", "adam", params)
    x, y = _data()
    for step in range(SAVED_AT):
        xb, yb = (cupy.asarray(a) for a in rank_batch(x, y, step, comm.rank, comm.size,
                                                      GLOBAL_BATCH))
        fsdp_loss_and_grads(fsdp, xb, yb, cupy)
        assert fsdp.step()
    fsdp.save_checkpoint(where)
    zero = _make(comm, "zero", "adam", [p * 0 for p in params])
    zero.load_checkpoint(where)
    return [cupy.asnumpy(p) for p in zero.params], type(zero.optimizer.state[0]["m"]).__module__


@pytest.mark.gpu
def test_cupy_state_saves_and_loads_on_the_device(tmp_path):
    pool = RankPool(2)
    try:
        got = pool.run(_gpu_resume, str(tmp_path / "ckpt"))
    finally:
        pool.close()
    want, _ = reference("adam", SAVED_AT)
    for params, module in got:
        assert module.startswith("cupy")
        for g, expected in zip(params, want):
            np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-5)


def test_the_fsdp_example_resumes_on_fewer_ranks_with_clipping(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    import re
    import subprocess
    import sys

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GPUCOLL_QUIET="1")
    where = str(tmp_path / "ckpt")

    def launch(ranks, epochs, *extra):
        run = subprocess.run([sys.executable, "-m", "gpucoll", "run", "-n", str(ranks), "-m",
                              "gpucoll.examples.train_fsdp", "--cpu", "--optimizer", "adam",
                              "--batch-size", "48", "--max-norm", "1.0", "--epochs", str(epochs),
                              *extra], capture_output=True, text=True, timeout=100, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        return run.stdout, [float(a) for a in re.findall(r"test acc ([0-9.]+)", run.stdout)]

    _, whole = launch(2, 2)
    _, first = launch(3, 1, "--checkpoint-dir", where)
    out, rest = launch(2, 2, "--checkpoint-dir", where)
    assert len(whole) == 2 and len(first) == 1 and len(rest) == 1, out
    assert re.search(r"# resumed from .*step-00000029: epoch 2 on 2 rank\(s\)", out), out
    assert abs(rest[0] - whole[-1]) <= 0.02, (whole, rest)
