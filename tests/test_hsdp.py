"""Hybrid sharding (HSDP): ``FullyShardedParameters(shard, ..., replicate_comm=replicate)``
over a ``Mesh(comm, replicate=R, shard=S)`` trains to the weights of one process on the whole
batch (2 x 2, the degenerate 4 x 1, 1 x 4, 1 x 3 and 3 x 1), clipped to the global norm of
that process; every replica ends bit-identical; only the shards' gradients cross the
replicate communicator (counted in its trace); checkpoints written by one replica load at
another layout and back; bad communicators raise on every rank and leave them usable."""

import os

import numpy as np
import pytest

import gpucoll
from gpucoll.ddp import (DynamicLossScaler, FullyShardedParameters, ShardedOptimizer,
                         checkpoint_exists, checkpoint_files)
from gpucoll.ddp.checkpoint_files import METADATA
from gpucoll.examples.train_digits import init_params, loss_and_grads
from gpucoll.examples.train_fsdp import fsdp_loss_and_grads
from gpucoll.kernels import bfloat16
from mp_harness import RankPool, error_text
from reference_training import SETTINGS, one_process_training, rank_batch, training_data

pytestmark = pytest.mark.timeout(120)

SIZES = [13, 17, 11, 7]        # 520 floats in three layers: no unit divides by 2, 3 or 4
GLOBAL_BATCH = 12
STEPS = 4
SAVED_AT = 2
MAX_NORM = 0.3                 # below every step's norm here: clipping acts at each step


@pytest.fixture(scope="module")
def pool():
    """Four ranks; three-rank runs use a group of the first three (the fourth sits out)."""
    ranks = RankPool(4)
    yield ranks
    ranks.close()


def _first(comm, n):
    """A communicator of the first ``n`` ranks of ``comm`` (None on the others)."""
    return comm if n == comm.size else comm.split(0 if comm.rank < n else None, key=comm.rank)


def _run(pool, n, fn, *args):
    """``fn(world, *args)`` on a world of ``n`` ranks (made of the pool's); their results."""
    return pool.run(_on_first, n, fn, *args)[:n]


def _on_first(comm, n, fn, *args):
    world = _first(comm, n)
    if world is None:
        return None
    try:
        return fn(world, *args)
    finally:
        if world is not comm:
            world.close()


def _data():
    return training_data(SIZES, STEPS, GLOBAL_BATCH)


def _units(params):
    return [params[i:i + 2] for i in range(0, len(params), 2)]


def reference(optimizer, steps=STEPS, max_norm=None):
    """One process, the whole batch, clipped in float64 when ``max_norm`` is given."""
    return one_process_training(optimizer, SIZES, _data(), steps, GLOBAL_BATCH, max_norm)


def _hybrid(comm, mesh, optimizer, params, **settings):
    return FullyShardedParameters(mesh["shard"], _units(params), optimizer,
                                  replicate_comm=mesh["replicate"],
                                  **dict(SETTINGS[optimizer], **settings))


def _train(comm, fsdp, steps, max_norm=None):
    """Each world rank trains on its share of the global batch."""
    x, y = _data()
    norms = []
    for step in steps:
        fsdp_loss_and_grads(fsdp, *rank_batch(x, y, step, comm.rank, comm.size, GLOBAL_BATCH))
        assert fsdp.step(max_norm=max_norm)
        norms.append(None if max_norm is None else float(fsdp.grad_norm[0]))
    return norms


def _full(fsdp):
    return [p for unit in fsdp.full_parameters() for p in unit]


def _counting_writes():
    """Record the slice files this rank writes (restore with the returned function)."""
    written, original = [], checkpoint_files._write_array

    def counting(array, path):
        written.append(os.path.basename(path))
        original(array, path)

    checkpoint_files._write_array = counting
    return written, lambda: setattr(checkpoint_files, "_write_array", original)


# ---------------------------------------------------------------- training
def rank_train(comm, replicas, shards, optimizer, max_norm):
    with gpucoll.Mesh(comm, replicate=replicas, shard=shards) as mesh:
        params = init_params(SIZES, seed=5)
        if comm.rank != 0:
            params = [p + 1 for p in params]      # only world rank 0's values may count
        fsdp = _hybrid(comm, mesh, optimizer, params)
        shard, replicate = mesh["shard"], mesh["replicate"]
        before = len(shard.trace()), len(replicate.trace())
        norms = _train(comm, fsdp, range(STEPS), max_norm)
        crossed = [(e["op"], e["bytes"], e["state"]) for e in replicate.trace()[before[1]:]]
        inside = [e["op"] for e in shard.trace()[before[0]:]]
        return (_full(fsdp), norms, crossed, inside, fsdp.shard_sizes, fsdp.replicas,
                fsdp.data_parallel_size, fsdp.replicate_wire_bytes)


LAYOUTS = [(4, 2, 2), (4, 4, 1), (4, 1, 4), (3, 1, 3), (3, 3, 1)]   # ranks, replicas, shards


@pytest.mark.parametrize("optimizer,max_norm", [("sgd", None), ("adam", MAX_NORM)])
@pytest.mark.parametrize("n,replicas,shards", LAYOUTS,
                         ids=[f"{r}x{s}" for _, r, s in LAYOUTS])
def test_hybrid_equals_full_batch(pool, n, replicas, shards, optimizer, max_norm):
    want, want_norms = reference(optimizer, max_norm=max_norm)
    results = _run(pool, n, rank_train, replicas, shards, optimizer, max_norm)
    for full, norms, crossed, inside, sizes, reps, ranks, replicate_bytes in results:
        assert reps == replicas and ranks == n
        for got, expected in zip(full, want):
            assert got.dtype == np.float32 and got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        if max_norm is not None:   # the global norm: not counted once per replica
            np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        # across replicas: one all-reduce of each unit's slice (float32) per step, nothing else
        slices = [("all_reduce", 4 * size, "done") for size in sizes]
        assert crossed == (slices * STEPS if replicas > 1 else [])
        assert replicate_bytes == STEPS * sum(2 * (replicas - 1) * 4 * size // replicas
                                              for size in sizes)   # ring model
        # inside a shard group: the gathers, the reduce-scatters, the norm's all-reduce
        assert inside.count("all_reduce") == (STEPS if max_norm and shards > 1 else 0)
        assert set(inside) <= {"all_gather", "reduce_scatter", "all_reduce"}
    for result in results[1:]:      # every rank of every replica: the same weights, bit for bit
        for a, b in zip(result[0], results[0][0]):
            np.testing.assert_array_equal(a, b)


def rank_train_zero(comm, replicas, shards, where):
    """ZeRO-1 with a replicate communicator: several buckets, clipped, Adam; then saved."""
    x, y = _data()
    with gpucoll.Mesh(comm, replicate=replicas, shard=shards) as mesh:
        params = init_params(SIZES, seed=5)
        opt = ShardedOptimizer(mesh["shard"], params, "adam", replicate_comm=mesh["replicate"],
                               first_bucket_cap_bytes=64, bucket_cap_bytes=512,
                               **SETTINGS["adam"])
        replicate = mesh["replicate"]
        before = len(replicate.trace())
        norms = []
        for step in range(STEPS):
            loss_and_grads(params, *rank_batch(x, y, step, comm.rank, comm.size, GLOBAL_BATCH),
                           on_grad=opt.mark_ready)
            assert opt.step(max_norm=MAX_NORM)
            norms.append(float(opt.grad_norm[0]))
        crossed = [(e["op"], e["bytes"]) for e in replicate.trace()[before:]]
        slices = [4 * shard.chunk for shard in opt._shards]
        written, restore = _counting_writes()
        try:
            path = opt.save_checkpoint(where)
        finally:
            restore()
        state = opt.state_dict(root=shards - 1)
        return (params, norms, crossed, slices, opt.data_parallel_size, written, path,
                None if state is None else state["params"])


@pytest.mark.parametrize("n,replicas,shards", [(4, 2, 2), (3, 3, 1)], ids=["2x2", "3x1"])
def test_zero1_with_replicas_equals_full_batch(pool, tmp_path, n, replicas, shards):
    want, want_norms = reference("adam", max_norm=MAX_NORM)
    where = str(tmp_path / "zero")
    results = _run(pool, n, rank_train_zero, replicas, shards, where)
    for world_rank, (params, norms, crossed, slices, ranks, written, path, state) in \
            enumerate(results):
        assert ranks == n and len(slices) > 1
        # only replica 0 (world ranks 0 .. shards - 1) writes, and gathers the state dict
        assert len(written) == (3 if world_rank < shards else 0)
        assert path == os.path.join(where, METADATA)
        assert (state is None) == (world_rank != shards - 1)
        for got, expected in zip(state or [], want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        for got, expected in zip(params, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        assert crossed == [("all_reduce", size) for size in slices] * STEPS
    for result in results[1:]:
        for a, b in zip(result[0], results[0][0]):
            np.testing.assert_array_equal(a, b)


def rank_train_narrow(comm, micro_batches):
    """2 x 2, bfloat16 gathers and reductions, ``micro_batches`` per step."""
    x, y = _data()
    with gpucoll.Mesh(comm, replicate=2, shard=2) as mesh:
        fsdp = FullyShardedParameters(mesh["shard"], _units(init_params(SIZES, seed=5)), "sgd",
                                      compute_dtype="bfloat16",
                                      replicate_comm=mesh["replicate"], **SETTINGS["sgd"])
        before = len(mesh["replicate"].trace())
        for step in range(STEPS):
            xb, yb = rank_batch(x, y, step, comm.rank, comm.size, GLOBAL_BATCH)
            assert len(xb) % micro_batches == 0
            rows = len(xb) // micro_batches
            for m in range(micro_batches):
                part = slice(m * rows, (m + 1) * rows)
                fsdp_loss_and_grads(fsdp, xb[part], yb[part], scale=1 / micro_batches)
            assert fsdp.step()
        crossed = [(e["op"], e["bytes"], e["dtype"])
                   for e in mesh["replicate"].trace()[before:]]
        return _full(fsdp), crossed, fsdp.shard_sizes


@pytest.mark.skipif(bfloat16 is None, reason="bfloat16 on NumPy needs ml_dtypes")
@pytest.mark.parametrize("micro_batches", [1, 3])   # 3 rows per rank: 1 or 3 parts
def test_hybrid_bfloat16_and_accumulation(pool, micro_batches):
    """One micro-batch: the slices cross in bfloat16 (2 bytes); three: their float32 sum
    crosses once per step, not once per micro-batch."""
    want, _ = reference("sgd")
    itemsize, dtype = (2, "bfloat16") if micro_batches == 1 else (4, "float32")
    for full, crossed, sizes in _run(pool, 4, rank_train_narrow, micro_batches):
        for got, expected in zip(full, want):
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=0, atol=2e-2)
        assert crossed == [("all_reduce", itemsize * size, dtype) for size in sizes] * STEPS


def rank_overflow(comm):
    """World rank 3 (replica 1, shard rank 1) alone sends an inf at the second step."""
    with gpucoll.Mesh(comm, replicate=2, shard=2) as mesh:
        params = init_params(SIZES, seed=1)
        fsdp = FullyShardedParameters(mesh["shard"], _units(params), lr=0.1, momentum=0.0,
                                      replicate_comm=mesh["replicate"])
        scaler = DynamicLossScaler(init_scale=8.0)
        stepped, after = [], []
        for step in range(3):
            for index in reversed(range(fsdp.units)):
                grads = [np.full(p.shape, 8.0 * (comm.rank + 1), np.float32)
                         for p in params[2 * index:2 * index + 2]]
                if step == 1 and index == 0 and comm.rank == 3:
                    grads[0][0, 0] = np.inf
                fsdp.reduce_gradients(index, grads)
            stepped.append(fsdp.step(scaler=scaler))
            after.append(_full(fsdp))
        return stepped, after, params


def test_overflow_on_one_rank_of_one_replica_skips_everywhere(pool):
    for stepped, after, start in _run(pool, 4, rank_overflow):
        assert stepped == [True, False, True]
        for first, skipped, last, p in zip(*after, start):
            # unscaled gradient: the mean over the 4 ranks of (rank + 1) = 2.5
            np.testing.assert_allclose(first, p - 0.25, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(skipped, first)
            # the scale backed off to 4: the same gradients unscale to twice as much
            np.testing.assert_allclose(last, p - 0.75, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- checkpoints
def rank_save_hybrid(comm, where):
    with gpucoll.Mesh(comm, replicate=2, shard=2) as mesh:
        fsdp = _hybrid(comm, mesh, "adam", init_params(SIZES, seed=5))
        _train(comm, fsdp, range(SAVED_AT))
        written, restore = _counting_writes()
        try:
            pending = fsdp.save_checkpoint(where, extra={"step": SAVED_AT}, async_write=True)
            path = pending.wait()
        finally:
            restore()
        state = fsdp.state_dict(root=0)
        return written, path, state


def rank_resume_plain(comm, where):
    fsdp = FullyShardedParameters(comm, _units([p * 0 + 7 for p in init_params(SIZES)]),
                                  "adam", lr=0.5)
    extra = fsdp.load_checkpoint(where)
    _train(comm, fsdp, range(fsdp.steps, STEPS))
    return _full(fsdp), extra


def rank_save_plain(comm, where):
    fsdp = FullyShardedParameters(comm, _units(init_params(SIZES, seed=5)), "adam",
                                  **SETTINGS["adam"])
    _train(comm, fsdp, range(SAVED_AT))
    fsdp.save_checkpoint(where)


def rank_resume_hybrid(comm, where):
    with gpucoll.Mesh(comm, replicate=2, shard=2) as mesh:
        fsdp = _hybrid(comm, mesh, "adam", [p * 0 + 7 for p in init_params(SIZES)], lr=0.5)
        # replica 1 is given a directory without a checkpoint: replica 0 must not load alone
        wrong = where if mesh.coords["replicate"] == 0 else where + "-missing"
        failed = error_text(lambda: fsdp.load_checkpoint(wrong), (OSError,))
        unchanged = fsdp.steps == 0 and all((p == 7).all() for p in _full(fsdp))
        fsdp.load_checkpoint(where)
        steps = fsdp.steps
        _train(comm, fsdp, range(steps, STEPS))
        return _full(fsdp), steps, fsdp.optimizer.lr, failed, unchanged


def test_checkpoint_of_one_replica_loads_at_another_layout_and_back(pool, tmp_path):
    want, _ = reference("adam")
    saved, _ = reference("adam", SAVED_AT)
    keys = ["param", "m", "v"]
    hybrid_dir = str(tmp_path / "hybrid")
    results = _run(pool, 4, rank_save_hybrid, hybrid_dir)
    shard_files = {rank: sorted(f"{k}-rank{rank:05d}-of-00002.npy" for k in keys)
                   for rank in range(2)}
    for world_rank, (written, path, state) in enumerate(results):
        assert path == os.path.join(hybrid_dir, METADATA)
        # replica 0 (world ranks 0, 1) writes its shard ranks' files; replica 1 nothing
        assert sorted(written) == (shard_files[world_rank] if world_rank < 2 else [])
        assert (state is None) == (world_rank != 0)
    for got, expected in zip(results[0][2]["params"], saved):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert checkpoint_exists(hybrid_dir)
    assert sorted(os.listdir(hybrid_dir)) == sorted([METADATA] + shard_files[0] + shard_files[1])

    for full, extra in _run(pool, 3, rank_resume_plain, hybrid_dir):   # 2 x 2 -> 3 ranks
        assert extra == {"step": SAVED_AT}
        for got, expected in zip(full, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)

    plain_dir = str(tmp_path / "plain")
    _run(pool, 3, rank_save_plain, plain_dir)
    results = _run(pool, 4, rank_resume_hybrid, plain_dir)            # 3 ranks -> 2 x 2
    for world_rank, (full, steps, lr, failed, unchanged) in enumerate(results):
        assert failed.startswith("FileNotFoundError: ") and unchanged
        if world_rank < 2:
            assert failed.startswith("FileNotFoundError: load_checkpoint failed on replicate "
                                     "rank 1: FileNotFoundError: ")
        assert steps == SAVED_AT and lr == SETTINGS["adam"]["lr"]
        for got, expected in zip(full, want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        for a, b in zip(full, results[0][0]):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- usage errors
class _DeviceComm:
    """A communicator-like object whose arrays live on the GPU (never called)."""
    rank, size, memory = 0, 2, "cuda"

    def all_reduce(self, *args, **kwargs):
        raise AssertionError("a collective ran before the check")


def rank_errors(comm):
    units = _units(init_params(SIZES, seed=5))
    errors = {}
    with gpucoll.Mesh(comm, replicate=2, shard=2) as mesh:
        shard = mesh["shard"]

        def make(replicate, model=units):
            return lambda: FullyShardedParameters(shard, model, replicate_comm=replicate)

        errors["itself"] = error_text(make(shard))
        errors["world"] = error_text(make(comm))
        errors["type"] = error_text(make(5))
        errors["memory"] = error_text(make(_DeviceComm()))
        crossed = comm.split(0 if comm.rank in (0, 3) else 1, key=comm.rank)   # [0, 3], [1, 2]
        errors["crossed"] = error_text(make(crossed))
        crossed.close()
        wider = list(SIZES)
        wider[1] += 1
        other = _units(init_params(wider, seed=5))
        errors["replica model"] = error_text(make(mesh["replicate"],
                                                  other if comm.rank >= 2 else units))
        errors["one rank"] = error_text(make(mesh["replicate"],
                                             other if comm.rank == 3 else units))
        usable = comm.all_reduce(np.array([comm.rank + 1.0]))    # nothing is left half-done
        fsdp = FullyShardedParameters(shard, units, replicate_comm=mesh["replicate"])
        return errors, float(usable[0]), fsdp.replicas


def test_bad_replicate_communicators_raise_on_every_rank(pool):
    for rank, (errors, usable, replicas) in enumerate(_run(pool, 4, rank_errors)):
        shard_ranks = [0, 1] if rank < 2 else [2, 3]
        assert usable == 10.0 and replicas == 2
        assert errors["itself"].startswith("ValueError: FullyShardedParameters: replicate_comm "
                                           "is the shard communicator itself")
        assert errors["world"] == (
            f"ValueError: FullyShardedParameters: the shard communicator (world ranks "
            f"{shard_ranks}) and replicate_comm (world ranks [0, 1, 2, 3]) share world ranks "
            f"{shard_ranks}; they must meet in this rank only")
        assert errors["type"] == ("TypeError: FullyShardedParameters: replicate_comm must be a "
                                  "gpucoll Communicator (or None), got int")
        assert errors["memory"].startswith("ValueError: FullyShardedParameters: the shard "
                                           "communicator holds 'host' arrays and "
                                           "replicate_comm 'cuda' ones")
        mine, theirs = (0, 1) if rank < 2 else (1, 0)      # this rank's replicate rank
        hint = ("; the ranks of the replicate communicator must have the same shard rank of "
                "shard communicators of one size (Mesh(comm, replicate=R, shard=S) makes both) "
                "and the same parameters")
        # crossed replicas: ranks 0 and 3 (1 and 2) hold different slices
        assert errors["crossed"] == (
            f"ValueError: FullyShardedParameters: replicate rank {mine} and replicate rank "
            f"{theirs} hold different shards (shard rank {rank % 2} vs {1 - rank % 2}){hint}")
        # replica 1's model is larger: each replica agrees within itself, not with the other
        sizes = ("532 vs 556", "231790030 vs 921237367") if rank < 2 else \
            ("556 vs 532", "921237367 vs 231790030")
        assert errors["replica model"] == (
            f"ValueError: FullyShardedParameters: replicate rank {mine} and replicate rank "
            f"{theirs} hold different shards (elements {sizes[0]}, shape checksum "
            f"{sizes[1]}){hint}")
        if rank < 2:    # the other replica's shard group disagreed within itself
            assert errors["one rank"] == (
                "ValueError: FullyShardedParameters: the shard group of replicate rank 1 has "
                "different parameter layouts; every rank must pass units of the same "
                "parameter shapes and dtypes")
        else:           # only rank 3's model is larger
            ours, other = ("556 vs 532", "921237367 vs 231790030") if rank == 3 else \
                ("532 vs 556", "231790030 vs 921237367")
            assert errors["one rank"] == (
                f"ValueError: FullyShardedParameters: rank {rank - 2} and rank {3 - rank} have "
                f"different parameter layouts (elements {ours}, shape checksum {other}); every "
                f"rank must pass units of the same parameter shapes and dtypes")
