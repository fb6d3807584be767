"""FullyShardedParameters (ZeRO-3 / FSDP): the same weights as one process on the full batch
(SGD-momentum and Adam, 2 and 3 ranks, units not divisible by the world size), 1 / world_size
of the parameters, gradients and state per rank, at most two layers whole at once, bfloat16
gathers, ``sync_from``, overflow skipping, layout mismatches and usage errors."""

import os
import subprocess
import sys

import numpy as np
import pytest

from gpucoll.ddp import DynamicLossScaler, FullyShardedParameters
from gpucoll.examples.train_digits import init_params, loss_and_grads
from gpucoll.examples.train_fsdp import fsdp_loss_and_grads
from gpucoll.kernels import bfloat16
from mp_harness import RankPool, rank_pools, run_ranks
from reference_training import SETTINGS, ReferenceOptimizer, rank_batch, training_data
from test_nccl_gpu import MULTI_RANK_ENV, on_nccl, two_ranks

pytestmark = pytest.mark.timeout(120)

SIZES = [13, 17, 11, 7]        # three linear layers, 520 floats: no unit divides by 2 or 3
GLOBAL_BATCH = 12
STEPS = 4

pool = rank_pools([2, 3], shared=True)


def _units(params):
    return [params[i:i + 2] for i in range(0, len(params), 2)]


def _data():
    return training_data(SIZES, STEPS, GLOBAL_BATCH)


def _batch(x, y, step, rank, size):
    return rank_batch(x, y, step, rank, size, GLOBAL_BATCH)


def reference(optimizer):
    """One process, the whole batch, the optimizer written apart from gpucoll's."""
    x, y = _data()
    params = init_params(SIZES, seed=5)
    opt = ReferenceOptimizer(optimizer, params)
    for step in range(STEPS):
        _, _, grads = loss_and_grads(params, *_batch(x, y, step, 0, 1))
        opt.step(params, grads)
    return params


def rank_train(comm, optimizer, compute=None, xp=np, micro_batches=1):
    x, y = _data()
    params = init_params(SIZES, seed=5)
    if comm.rank != 0:
        params = [p + 1 for p in params]   # only sync_from's (rank 0's) values may count
    fsdp = FullyShardedParameters(comm, _units([xp.asarray(p) for p in params]), optimizer,
                                  compute_dtype=compute, **SETTINGS[optimizer])
    whole, held = [], []
    for step in range(STEPS):
        xb, yb = (xp.asarray(a) for a in _batch(x, y, step, comm.rank, comm.size))
        rows = xb.shape[0] // micro_batches
        for m in range(micro_batches):      # each unit reduced once per micro-batch
            part = slice(m * rows, (m + 1) * rows)
            fsdp_loss_and_grads(fsdp, xb[part], yb[part], xp, scale=1 / micro_batches,
                                track=whole)
        held.append(fsdp.resident_bytes())
        assert fsdp.step()
        assert fsdp.gathered_units == []
    full = [np.asarray(getattr(p, "get", lambda: p)()) for unit in fsdp.full_parameters()
            for p in unit]
    wire = fsdp.wire_bytes / STEPS    # full_parameters() above sent one more gather of each
    return (full, fsdp.state_bytes(), fsdp.shard_elements, fsdp.total_elements, max(whole),
            fsdp.resident_bytes(), max(held), wire, fsdp.shard_sizes)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fsdp_equals_full_batch(pool, optimizer):
    n = pool.world_size
    expected = reference(optimizer)
    results = pool.run(rank_train, optimizer)
    elements = sum(p.size for p in expected)
    slots = 1 if optimizer == "sgd" else 2
    for full, state, shard, total, whole, rest, during, wire, sizes in results:
        for got, want in zip(full, expected):
            assert got.dtype == np.float32 and got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # each rank holds 1/n of the (padded) parameter space: slices, gradients, state
        assert total == shard * n and elements <= total < elements + n * 4 * 3
        assert state == slots * shard * 4
        assert rest == (2 + slots) * shard * 4
        assert whole == 2                    # the layer computing and the one prefetched
        assert rest < during                 # gradient buffers in flight before step()
        # per step: gather every unit forward, every unit but the last again backward,
        # reduce-scatter every unit; (n - 1) slices of 4 bytes each time (ring model)
        assert wire == (n - 1) * 4 * (3 * shard - sizes[-1]) + (n - 1) * 4 * shard / STEPS
        assert sum(sizes) == shard
    for result in results[1:]:               # every rank ends with the same weights, bit for bit
        for a, b in zip(result[0], results[0][0]):
            np.testing.assert_array_equal(a, b)


def rank_train_two_micro_batches(comm, optimizer, compute=None):
    return rank_train(comm, optimizer, compute, micro_batches=2)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_gradient_accumulation_equals_full_batch(pool, optimizer):
    """Two micro-batches per step (half the rows each, loss halved), every unit reduced once
    per micro-batch: the weights of one process on the whole batch. The running sum holds one
    slice per unit until step(); each micro-batch moves a step's bytes."""
    n = pool.world_size
    expected = reference(optimizer)
    singles = pool.run(rank_train, optimizer)
    for single, result in zip(singles, pool.run(rank_train_two_micro_batches, optimizer)):
        full, _, shard, _, whole, rest, during, wire, sizes = result
        for got, want in zip(full, expected):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert whole == 2 and rest == single[5]
        assert during == single[6] + shard * 4
        assert wire == 2 * (n - 1) * 4 * (3 * shard - sizes[-1]) + (n - 1) * 4 * shard / STEPS


@pytest.mark.skipif(bfloat16 is None, reason="bfloat16 on NumPy needs ml_dtypes")
def test_bfloat16_accumulation_sums_in_float32(pool):
    """bfloat16 on the wire, the micro-batches' slices summed in float32."""
    for full, *_ in pool.run(rank_train_two_micro_batches, "sgd", "bfloat16"):
        for got, want in zip(full, reference("sgd")):
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-2)


@pytest.mark.skipif(bfloat16 is None, reason="bfloat16 on NumPy needs ml_dtypes")
def test_bfloat16_gathers_train_close_to_float32(pool):
    n = pool.world_size
    expected = reference("sgd")
    for full, state, shard, total, whole, rest, during, wire, sizes in pool.run(
            rank_train, "sgd", "bfloat16"):
        for got, want in zip(full, expected):
            assert got.dtype == np.float32   # the master slices stay float32
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-2)
        assert rest == 3 * shard * 4
        # bfloat16 on the wire for the training (2 bytes), float32 for full_parameters()
        assert wire == (n - 1) * 2 * (3 * shard - sizes[-1]) + (n - 1) * 4 * shard / STEPS


def rank_bf16_buffers(comm):
    params = init_params(SIZES, seed=5)
    fsdp = FullyShardedParameters(comm, _units(params), compute_dtype="bfloat16")
    views = fsdp.gather(0)
    before = fsdp.resident_bytes()
    rounded = [np.asarray(p.astype(bfloat16).astype(np.float32)) for p in params[:2]]
    same = all(np.array_equal(v.astype(np.float32), r) for v, r in zip(views, rounded))
    fsdp.release(0)
    return [v.dtype.name for v in views], same, before - fsdp.resident_bytes(), \
        fsdp._units[0].length


@pytest.mark.skipif(bfloat16 is None, reason="bfloat16 on NumPy needs ml_dtypes")
def test_bfloat16_gather_holds_two_bytes_per_element(pool):
    for names, same, freed, length in pool.run(rank_bf16_buffers):
        assert names == ["bfloat16", "bfloat16"] and same
        assert freed == 2 * length           # the gathered buffer, in bfloat16


def rank_sync(comm, sync_from):
    params = [p + comm.rank for p in init_params(SIZES, seed=5)]
    if sync_from is None:
        params = init_params(SIZES, seed=5)
    fsdp = FullyShardedParameters(comm, _units(params), sync_from=sync_from)
    return [p for unit in fsdp.full_parameters() for p in unit]


@pytest.mark.parametrize("sync_from", [1, None])
def test_every_rank_starts_from_sync_from(pool, sync_from):
    offset = 0 if sync_from is None else sync_from
    want = [p + offset for p in init_params(SIZES, seed=5)]
    for full in pool.run(rank_sync, sync_from):
        for got, w in zip(full, want):
            np.testing.assert_array_equal(got, w)


def rank_prefetch(comm):
    fsdp = FullyShardedParameters(comm, _units(init_params(SIZES, seed=5)))
    assert fsdp.gather(2, async_op=True) is None
    assert fsdp.gathered_units == [2]
    first = fsdp.gather(2)
    again = fsdp.gather(2)                   # held: no second all-gather, the same buffer
    shared = all(np.shares_memory(a, b) for a, b in zip(first, again))
    fsdp.gather(0, async_op=True)
    fsdp.release(1)                          # not gathered: nothing to do
    with fsdp.gathered(1) as (w, b):
        shape = w.shape, b.shape
    left = fsdp.gathered_units
    fsdp.release(0)
    fsdp.release(2)
    return shared, shape, left, fsdp.gathered_units


def test_prefetch_gather_and_release(pool):
    for shared, shape, left, after in pool.run(rank_prefetch):
        assert shared and shape == ((17, 11), (11,))
        assert left == [0, 2] and after == []


def rank_overflow(comm, bad):
    params = init_params(SIZES, seed=1)
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=2)
    fsdp = FullyShardedParameters(comm, _units(params), lr=0.1)
    stepped, scales, flat = [], [], []
    for step in range(4):
        for index in reversed(range(fsdp.units)):
            grads = [np.full(p.shape, 1024.0 * (comm.rank + 1), np.float32)
                     for p in params[2 * index:2 * index + 2]]
            if step == 1 and index == 0 and comm.rank == comm.size - 1:
                grads[-1][0] = bad           # only the last rank, in the last unit reduced
            fsdp.reduce_gradients(index, grads)
        stepped.append(fsdp.step(scaler=scaler))
        scales.append(scaler.scale)
        flat.append([p for unit in fsdp.full_parameters() for p in unit])
    return stepped, scales, fsdp.skipped_steps, flat, params


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_overflow_on_one_rank_skips_everywhere(pool, bad):
    mean = np.mean(np.arange(1, pool.world_size + 1))
    for stepped, scales, skipped, flat, start in pool.run(rank_overflow, bad):
        assert stepped == [True, False, True, True]
        assert scales == [1024.0, 512.0, 512.0, 1024.0]   # back off, grow after 2 clean steps
        assert skipped == 1
        for after_first, after_skip, p in zip(flat[0], flat[1], start):
            # no momentum yet at the first step: p -= lr * mean over ranks of (rank + 1)
            np.testing.assert_allclose(after_first, p - 0.1 * mean, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(after_skip, after_first)


def rank_layout(comm):
    sizes = list(SIZES)
    if comm.rank == comm.size - 1:
        sizes[1] += 1   # one rank's model differs
    try:
        FullyShardedParameters(comm, _units(init_params(sizes)))
    except ValueError as exc:
        return str(exc)
    return None


def test_mismatched_layouts_raise_on_every_rank(pool):
    messages = pool.run(rank_layout)
    assert all(m is not None for m in messages), messages
    assert "FullyShardedParameters: rank 0 and rank" in messages[0]
    assert f"rank {pool.world_size - 1}" in messages[0] and "elements" in messages[0]


def test_usage_errors(solo):
    params = init_params(SIZES)
    units = _units(params)
    with pytest.raises(ValueError, match="units is empty"):
        FullyShardedParameters(solo, [])
    with pytest.raises(ValueError, match=r"units \[1\] hold no parameters"):
        FullyShardedParameters(solo, [units[0], []])
    with pytest.raises(TypeError, match="float16"):
        FullyShardedParameters(solo, [[p.astype(np.float16) for p in u] for u in units])
    with pytest.raises(TypeError, match=r"\['float32', 'float64'\]"):
        FullyShardedParameters(solo, [units[0], [p.astype(np.float64) for p in units[1]]])
    with pytest.raises(ValueError, match=r"units\[0\]\[0\] must be C-contiguous"):
        FullyShardedParameters(solo, [[params[0].T, params[1]]])
    with pytest.raises(ValueError, match="sync_from must be a rank in \\[0, 1\\) or None, got 3"):
        FullyShardedParameters(solo, units, sync_from=3)
    with pytest.raises(TypeError, match="compute_dtype .* got 'float16' for float64"):
        FullyShardedParameters(solo, [[p.astype(np.float64) for p in u] for u in units],
                               compute_dtype="float16")
    with pytest.raises(TypeError, match="got 'int8'"):
        FullyShardedParameters(solo, units, compute_dtype="int8")
    with pytest.raises(ValueError, match="lr must be > 0, got -1"):
        FullyShardedParameters(solo, units, "sgd", lr=-1)

    fsdp = FullyShardedParameters(solo, units)
    with pytest.raises(ValueError, match="unit index 3 is out of range for 3 units"):
        fsdp.gather(3)
    with pytest.raises(ValueError, match="unit 0 has 2 parameters, got 1 gradients"):
        fsdp.reduce_gradients(0, [params[0]])
    with pytest.raises(ValueError, match=r"gradient 1 of unit 0 has shape \(3,\), expected"):
        fsdp.reduce_gradients(0, [params[0], np.zeros(3, np.float32)])
    with pytest.raises(TypeError, match="gradient 0 of unit 1 has dtype float64, expected "
                                        "float32"):
        fsdp.reduce_gradients(1, [params[2].astype(np.float64), params[3]])
    fsdp.reduce_gradients(2, units[2])
    fsdp.reduce_gradients(2, units[2])         # a second micro-batch of unit 2
    with pytest.raises(ValueError, match=r"units \[0, 1\] were not reduced"):
        fsdp.step()
    for index in (0, 1, 1, 2):
        fsdp.reduce_gradients(index, units[index])
    with pytest.raises(ValueError, match=r"different numbers of micro-batches in this step: "
                                         r"\[1, 2, 1\] \(per unit\)"):
        fsdp.step()
    # the failed step dropped what was reduced: a whole step works after it
    before = [p for unit in fsdp.full_parameters() for p in unit]
    for index in reversed(range(3)):
        fsdp.reduce_gradients(index, [np.ones_like(p) for p in units[index]])
    assert fsdp.step() and fsdp.steps == 1
    after = [p for unit in fsdp.full_parameters() for p in unit]
    for a, b in zip(after, before):
        np.testing.assert_allclose(a, b - 0.05, rtol=1e-6, atol=1e-7)   # default lr 0.05


def _gpu_train(comm):
    import cupy

    full, *_ = rank_train(comm, "adam", xp=cupy)
    return full


@pytest.mark.gpu
def test_fsdp_on_cupy_arrays():
    """CuPy arrays (fused kernels on the GPU) over the cpu backend, which stages them."""
    pool = RankPool(2)
    try:
        got = pool.run(_gpu_train)
    finally:
        pool.close()
    expected = reference("adam")
    for full in got:
        for g, want in zip(full, expected):
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@two_ranks
def test_fsdp_over_nccl_two_ranks_on_one_gpu():
    """The NCCL backend: scatter from sync_from, prefetched all-gathers and reduce-scatters
    on the caller's stream, the Work of each waited by the next use."""
    got = run_ranks(on_nccl, 2, _gpu_train, init=False, env=MULTI_RANK_ENV, timeout=240)
    expected = reference("adam")
    for full in got:
        for g, want in zip(full, expected):
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


def test_example_matches_one_process_and_holds_half():
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", GPUCOLL_QUIET="1")
    runs = {}
    # the last accumulates, on 2 ranks as 2 replicas of 1 shard (hybrid sharding's wiring;
    # tests/test_hsdp.py trains 2 x 2 and the other layouts)
    for name, ranks, micro_batches, replicas in ((1, 1, 1, 1), (2, 2, 1, 1), ("2x1x4", 2, 4, 2)):
        launch = ["gpucoll", "run", "-n", str(ranks), "-m"] if ranks != 1 else []
        command = [sys.executable, "-m"] + launch + ["gpucoll.examples.train_fsdp"]
        out = subprocess.run(command + ["--epochs", "2", "--cpu", "--hidden", "64",
                                        "--micro-batches", str(micro_batches),
                                        "--replicas", str(replicas)],
                             capture_output=True, text=True, timeout=100, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = [line.split("] ", 1)[-1] for line in out.stdout.splitlines()]
        epochs = [line.rsplit("(", 1)[0] for line in lines if line.startswith("epoch")]
        held = [int(line.split("per rank: ")[1].split()[0]) for line in lines
                if "bytes per rank" in line]
        assert len(epochs) == 2 and len(held) == 1, out.stdout
        assert "at most 2 layer(s) whole at once" in out.stdout
        runs[name] = epochs, held[0]
    assert runs[2][0] == runs[1][0]                  # same losses and accuracies, to 4 digits
    assert "(2 replica(s) of 1)" in out.stdout
    # 2 replicas, 4 micro-batches: the same losses; a shard of 1 holds what one process does
    assert runs["2x1x4"] == (runs[2][0], runs[1][1])
    assert float(runs[2][0][-1].split("test acc ")[1]) > 0.85
    assert runs[1][1] / 2 <= runs[2][1] < runs[1][1] / 2 + 3 * 4 * 3 * 4   # half + padding
