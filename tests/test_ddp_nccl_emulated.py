"""The DDP bucketer on device arrays over the NCCL backend, on the CUDA emulation: the fused
bucketing kernels (emulated, tests/emulated_cuda/kernels.py) and NCCL all-reduces in stream
order, eagerly and captured into a CUDA graph that is launched once per step. Results against
NumPy. Real CuPy, NVRTC and NCCL run the same steps in tests/test_nccl_gpu.py.
"""

import weakref

import numpy as np
import pytest

from gpucoll import kernel_tables
from gpucoll.ddp import Bucketer, PowerSGD

from nccl_emulated_harness import emu, run  # noqa: F401

pytestmark = pytest.mark.timeout(60)

SHAPES = [(3, 5), (7,), (64,), (2, 2, 2), (1,)]
LOSS_SCALE = 4.0


def _grads(rank, step, shapes=SHAPES):
    """Rank ``rank``'s float32 gradients of ``step`` (exact in bfloat16 and float16 once
    averaged over two ranks: small integers over 8)."""
    rng = np.random.default_rng(100 * step + rank)
    return [(rng.integers(-64, 64, shape) / 8).astype(np.float32) for shape in shapes]


def _mean(step, n, scale=1.0):
    per_rank = [_grads(r, step) for r in range(n)]
    return [np.mean([g[i].astype(np.float64) for g in per_rank], axis=0) / scale
            for i in range(len(SHAPES))]


@pytest.mark.parametrize("compression", [None, "bf16", "fp16"])
def test_an_eager_step_averages_device_gradients(run, emu, compression):
    cp = emu.cupy

    def fn(comm):
        bucketer = Bucketer(comm, [np.zeros(s, np.float32) for s in SHAPES],
                            bucket_cap_bytes=256, first_bucket_cap_bytes=64,
                            compression=compression)
        out = []
        for step in range(2):
            grads = [cp.asarray(g) for g in _grads(comm.rank, step)]
            bucketer.reduce(grads, loss_scale=LOSS_SCALE)
            comm.synchronize()
            out.append(([g.get() for g in grads], bucketer.found_nonfinite()))
        return len(bucketer.buckets), out

    for buckets, out in run(2, fn):
        assert buckets > 1  # several buckets, each its own pack, all-reduce and unpack
        for step, (got, nonfinite) in enumerate(out):
            assert not nonfinite
            for have, want in zip(got, _mean(step, 2, LOSS_SCALE)):
                assert have.dtype == np.float32
                np.testing.assert_array_equal(have, want.astype(np.float32))
    assert emu.kernel_launches > 0


@pytest.mark.parametrize("n", [2, 3])
def test_a_captured_step_replays_at_each_launch(run, emu, n):
    """Capture ``reduce`` once; each launch averages whatever the gradient arrays hold then.
    Nothing runs at capture. The work tables the graph reads survive the eviction of the
    eager tables (the emulated kernel faults on freed memory); the non-finite flag is zeroed
    by each launch and set by the one whose gradients hold an inf, on every rank."""
    cp = emu.cupy
    steps = 4

    def fn(comm):
        bucketer = Bucketer(comm, [np.zeros(s, np.float32) for s in SHAPES],
                            bucket_cap_bytes=256, first_bucket_cap_bytes=64, compression="bf16")
        grads = [cp.asarray(g) for g in _grads(comm.rank, 0)]
        bucketer.reduce(grads, loss_scale=LOSS_SCALE)  # an eager step first (not needed)
        comm.synchronize()
        stream = cp.cuda.Stream(non_blocking=True)
        launches_before = emu.kernel_launches
        with stream:
            stream.begin_capture()
            bucketer.reduce(grads, loss_scale=LOSS_SCALE)
            graph = stream.end_capture()
        captured = [g.get() for g in grads]  # unchanged: nothing ran
        flag = weakref.ref(bucketer.found_inf)
        seen = []
        for step in range(1, steps + 1):
            if step == 3:  # an eager step between launches makes a flag of its own
                bucketer.reduce([cp.zeros(s, dtype=cp.float32) for s in SHAPES],
                                loss_scale=LOSS_SCALE)
                comm.synchronize()
                assert bucketer.found_inf is not flag()
            for array, host in zip(grads, _grads(comm.rank, step)):
                if step == 2 and comm.rank == 1:
                    host[0] = np.inf
                array[...] = cp.asarray(host)
            kernel_tables._TABLES.clear()  # the eager tables go (freed at once); the graph's must not
            comm.launch_graph(graph, stream=stream)
            stream.synchronize()
            seen.append(([g.get() for g in grads], int(flag().get()[0])))  # alive with graph
        comm.synchronize()
        return captured, seen, emu.kernel_launches > launches_before

    close = dict(rtol=2 ** -7, atol=2 ** -6)  # bfloat16 sums of terms up to 8 / n, over 4
    for rank, (captured, seen, launched) in enumerate(run(n, fn)):
        assert launched
        for have, want in zip(captured, _mean(0, n, LOSS_SCALE)):
            np.testing.assert_allclose(have, want, **close)  # the eager step's result
        for step, (got, flag) in enumerate(seen, start=1):
            assert flag == (1 if step == 2 else 0), (rank, step, flag)
            if step == 2:
                assert np.isinf(got[0].reshape(-1)[0])
                continue
            for have, want in zip(got, _mean(step, n, LOSS_SCALE)):
                np.testing.assert_allclose(have, want, **close, err_msg=f"step {step}")


def test_what_a_capture_cannot_hold_is_refused_before_anything_is_enqueued(run, emu):
    cp = emu.cupy

    def fn(comm):
        params = [cp.zeros(s, dtype=cp.float32) for s in SHAPES]
        grads = [cp.asarray(g) for g in _grads(comm.rank, 0)]
        plain = Bucketer(comm, params, uneven_inputs=True)
        hooked = Bucketer(comm, params, comm_hook=PowerSGD(comm, params, rank=1, start_step=0))
        seq = comm._seq
        stream = cp.cuda.Stream(non_blocking=True)
        messages = []
        with stream:
            stream.begin_capture()
            for call in (lambda: plain.join(),
                         lambda: hooked.reduce(grads)):
                with pytest.raises(RuntimeError, match="cannot be captured into a CUDA graph"
                                   ) as caught:
                    call()
                messages.append(str(caught.value))
            with plain.no_sync(), pytest.raises(RuntimeError) as caught:
                plain.mark_ready(0, grads[0])
            messages.append(str(caught.value))
            graph = stream.end_capture()
        assert comm._seq == seq and emu.pending(stream) == 0
        plain.reduce(grads)  # outside the capture all is well, the refused steps abandoned
        hooked.reduce([cp.asarray(g) for g in _grads(comm.rank, 1)])
        comm.synchronize()
        return messages, len(graph.nodes)

    for messages, nodes in run(2, fn):
        assert nodes == 0, nodes
        assert messages[0].startswith("Bucketer: join() cannot be captured into a CUDA graph: "
                                      "it reads on the host")
        assert messages[1].startswith("Bucketer: a comm hook (PowerSGD) cannot be captured")
        assert messages[2].startswith("Bucketer: gradient accumulation (no_sync) cannot be "
                                      "captured")
        assert all(m.endswith("(this step was abandoned)") for m in messages[1:]), messages


def test_the_graph_benchmark_checks_its_results(run, emu):
    """bench/bench_ddp_graph.py's measurement on emulated ranks: its eager and graph steps
    give the same gradients, over several buckets (timings mean nothing here)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                        "bench_ddp_graph.py")
    spec = importlib.util.spec_from_file_location("bench_ddp_graph", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sizes = bench.gradient_sizes(12, 64 << 10)
    assert len(sizes) == 12 and min(sizes) >= 256

    rows = run(2, lambda comm: bench.measure(comm, emu.cupy, sizes, 8 << 10, steps=2))
    for row in rows:
        assert row["equal"] and row["ranks"] == 2 and row["buckets"] > 2, row
        assert row["graph_step_us"] > 0 and row["eager_step_us"] > 0


@pytest.mark.parametrize("script, args, pattern", [
    ("bench_ddp_host.py", ["--arrays", "20", "--mib", "1", "--bucket-kib", "64", "--steps", "3",
                           "--rounds", "1"],
     r"^eager step, 20 arrays in \d+ buckets: median \d+ us/step"),
    ("bench_nccl_host.py", ["--calls", "20", "--rounds", "1", "--ops", "all_reduce,send"],
     r"all_reduce, cached attrs +median +[\d.]+ us/call"),
])
def test_the_host_cost_benchmarks_run(script, args, pattern):
    """The host-cost proxies of the NCCL path (no GPU): they stub the emulation's NCCL,
    events and kernels, so a change of what they stub breaks them; they must still run."""
    import os
    import re
    import subprocess
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                        script)
    proc = subprocess.run([sys.executable, path] + args, capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert re.search(pattern, proc.stdout, re.M), proc.stdout
