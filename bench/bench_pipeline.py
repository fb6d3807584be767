"""Pipeline parallelism measured: time per step of GPipe, 1F1B and interleaved 1F1B against one
process running the whole model, the activations each stage keeps at its peak, and the idle
time (bubble) of each stage against the textbook ``(P - 1) / (v M + P - 1)``, on the digits
MLP.

Every configuration starts fresh ranks with ``gpucoll run -n P`` (``P = 1``: the whole model
in one process, the same ``Stage`` code with no communication) and trains ``--steps`` steps of
the same batch size from the same weights (SGD momentum 0.9). Each rank gets one BLAS thread,
so a stage stands for one device and the one-process baseline for one device running
everything. Time per step: mean over the steps after ``--warmup`` of ``Pipeline.step`` on each
rank, the slowest rank's. Busy time of a stage: its forwards, backwards and (last stage) loss;
idle = 1 - busy / step. The MLP's stages are not balanced (the first holds 64 x H and H x H,
the last H x 10), so the textbook bubble (equal stages, free messages) is a lower bound for the
busiest stage.

    python bench/bench_pipeline.py [--stages 2 3] [--microbatches 1 2 4 8] [--hidden 128 1024]
        [--steps 60] [--latency] [--json bench/pipeline.json]
        [--schedules gpipe 1f1b interleaved] [--virtual-stages 2] [--hidden-layers 2]

``interleaved`` gives each stage ``--virtual-stages`` chunks of the MLP (``--hidden-layers``
must make at least ``P v - 1`` hidden layers) and runs only where ``M`` is a multiple of ``P``;
its peak is of (micro-batch, chunk) activations, each about ``1 / v`` of a stage's.

``--latency`` first times one pipeline hop between two ranks (blocking send / recv against
``isend`` / ``irecv``), and ``--stages 1`` runs the micro-batches in one process: the cost
of splitting the batch, without any message.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = 64
LR = 0.05


# ---------------------------------------------------------------------------- one rank
def child(args) -> int:
    import gpucoll
    from gpucoll.ddp import make_optimizer
    from gpucoll.examples.train_digits import init_params, load_digits_split
    from gpucoll.pp import Pipeline, Stage, mlp_layers, peak_in_flight, softmax_cross_entropy

    x_train, y_train, _, _ = load_digits_split(0)
    comm = gpucoll.init(backend="cpu")
    params = init_params([64] + [args.hidden] * args.hidden_layers + [10], seed=0)
    per_rank = args.virtual_stages if args.schedule == "interleaved" else 1
    layers = mlp_layers(params, comm.size * per_rank)
    chunks = [Stage(layers[c]) for c in range(comm.rank, len(layers), comm.size)]
    busy = [0.0]

    def timed(fn):
        def run(*a):
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                busy[0] += time.perf_counter() - start
        return run

    for stage in chunks:
        stage.forward, stage.backward = timed(stage.forward), timed(stage.backward)
    pipe = Pipeline(comm, chunks if per_rank > 1 else chunks[0],
                    micro_batches=args.micro_batches, schedule=args.schedule,
                    loss_fn=timed(softmax_cross_entropy))
    params = [p for stage in chunks for p in stage.params]
    optimizer = make_optimizer("sgd", lr=LR)
    order = np.random.default_rng(0).permutation(len(x_train))
    times, busy_times, peak = [], [], 0
    for step in range(args.steps):
        rows = order[(step * BATCH) % (len(order) - BATCH):][:BATCH]
        comm.barrier()
        busy[0] = 0.0
        start = time.perf_counter()
        loss = pipe.step(x_train[rows], y_train[rows])
        times.append(time.perf_counter() - start)
        busy_times.append(busy[0])
        peak = max(peak, chunks[0].peak_stored) if per_rank == 1 else \
            peak_in_flight(pipe.actions)
        grads = [g for stage in chunks for g in stage.grads]
        for index, (p, g) in enumerate(zip(params, grads)):
            optimizer.update(index, p, g)
    timed_steps = slice(args.warmup, None)
    result = {"stage": comm.rank, "step_ms": 1e3 * float(np.mean(times[timed_steps])),
              "busy_ms": 1e3 * float(np.mean(busy_times[timed_steps])), "peak_stored": peak,
              "loss": loss}
    with open(f"{args.out}.{comm.rank}", "w") as handle:
        json.dump(result, handle)
    comm.close()
    return 0


def latency_child(args) -> int:
    """Round trip of one (BATCH / 8, hidden) float32 activation between two ranks: blocking
    send / recv against isend / irecv waited at once (what one pipeline hop costs)."""
    import gpucoll

    comm = gpucoll.init(backend="cpu")
    x = np.zeros((BATCH // 8, args.hidden), np.float32)
    out = np.empty_like(x)
    peer = 1 - comm.rank
    result = {}
    for mode in ("blocking", "async"):
        times = []
        for trip in range(args.steps * 5):
            start = time.perf_counter()
            for turn in ((0, 1) if comm.rank == 0 else (1, 0)):
                if turn == 0:
                    comm.send(x, peer) if mode == "blocking" else comm.isend(x, peer).wait()
                else:
                    comm.recv(out, peer) if mode == "blocking" else comm.irecv(out, peer).wait()
            times.append(time.perf_counter() - start)
        result[mode] = 1e6 * float(np.median(times[args.warmup:]))
    with open(f"{args.out}.{comm.rank}", "w") as handle:
        json.dump(result, handle)
    comm.close()
    return 0


# ---------------------------------------------------------------------------- driver
def run_config(stages: int, schedule: str, micro_batches: int, hidden: int, steps: int,
               warmup: int, latency: bool = False, hidden_layers: int = 2,
               virtual_stages: int = 1) -> list:
    with tempfile.TemporaryDirectory(prefix="gpucoll-bench-pp-") as tmp:
        out = os.path.join(tmp, "result")
        command = [sys.executable, "-m", "gpucoll", "run", "-n", str(stages), "--timeout",
                   "600", os.path.abspath(__file__), "--child", "--schedule", schedule,
                   "--microbatches", str(micro_batches), "--hidden", str(hidden), "--steps",
                   str(steps), "--warmup", str(warmup), "--out", out, "--hidden-layers",
                   str(hidden_layers), "--virtual-stages", str(virtual_stages)]
        command += ["--latency"] if latency else []
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1")
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
        return [json.load(open(f"{out}.{rank}")) for rank in range(stages)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--latency", action="store_true",
                        help="also time one hop: blocking against isend / irecv round trips")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                        choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="chunks per stage of the interleaved schedule")
    parser.add_argument("--hidden-layers", type=int, default=2,
                        help="hidden layers of the MLP (the same for every schedule)")
    args = parser.parse_args(argv)
    if args.child:
        args.hidden, args.micro_batches = args.hidden[0], args.microbatches[0]
        return latency_child(args) if args.latency else child(args)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    from gpucoll.pp import bubble_fraction

    load = os.getloadavg()
    print(f"# digits MLP [64, {'H, ' * args.hidden_layers}10], batch {BATCH}, {args.steps} "
          f"steps (first "
          f"{args.warmup} not timed), one BLAS thread per rank; {os.cpu_count()} CPUs, load "
          f"average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    results = []
    for hidden in args.hidden if args.latency else []:
        trips = run_config(2, "gpipe", 1, hidden, args.steps, args.warmup, latency=True)[0]
        print(f"# one hop, ({BATCH // 8}, {hidden}) float32 round trip: blocking send/recv "
              f"{trips['blocking']:.0f} us, isend/irecv {trips['async']:.0f} us "
              f"({trips['async'] / trips['blocking']:.1f}x)", flush=True)
        results.append({"hidden": hidden, "round_trip_us": trips})
    print(f"# {'hidden':>6} {'P':>2} {'schedule':>11} {'M':>2} {'ms/step':>8} {'vs 1 proc':>9} "
          f"{'peak acts per stage':>19} {'idle per stage':>20} {'textbook':>8}")
    for hidden in args.hidden:
        base = run_config(1, "gpipe", 1, hidden, args.steps, args.warmup,
                          hidden_layers=args.hidden_layers)[0]["step_ms"]
        print(f"  {hidden:>6} {1:>2} {'-':>11} {1:>2} {base:8.2f} {1:9.2f}", flush=True)
        results.append({"hidden": hidden, "stages": 1, "schedule": None, "micro_batches": 1,
                        "step_ms": base})
        for stages in args.stages:
            for schedule in args.schedules:
                chunks = args.virtual_stages if schedule == "interleaved" else 1
                for micro_batches in args.microbatches:
                    if schedule == "interleaved" and (stages < 2 or micro_batches % stages):
                        continue    # the interleaved schedule needs M a multiple of P >= 2
                    rows = run_config(stages, schedule, micro_batches, hidden, args.steps,
                                      args.warmup, hidden_layers=args.hidden_layers,
                                      virtual_stages=chunks)
                    step = max(r["step_ms"] for r in rows)
                    idle = [1 - r["busy_ms"] / step for r in rows]
                    peaks = [r["peak_stored"] for r in rows]
                    textbook = bubble_fraction(stages, micro_batches, chunks)
                    results.append({"hidden": hidden, "stages": stages, "schedule": schedule,
                                    "micro_batches": micro_batches, "step_ms": step,
                                    "vs_one_process": step / base, "peak_stored": peaks,
                                    "idle": idle, "textbook_bubble": textbook})
                    print(f"  {hidden:>6} {stages:>2} {schedule:>11} {micro_batches:>2} "
                          f"{step:8.2f} {step / base:9.2f} {str(peaks):>19} "
                          f"{' '.join(f'{v:.2f}' for v in idle):>20} {textbook:8.2f}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
