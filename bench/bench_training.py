"""Data parallelism against parameter servers, measured: time per step, bytes per worker and
final accuracy after a fixed number of steps, on the digits MLP.

Methods (``W`` workers each; a parameter server adds ``K`` server ranks on top):

* ``ddp``        - Bucketer (ring / shared-memory all-reduce), SGD-momentum on every rank;
* ``zero``       - ShardedOptimizer (ZeRO-1: reduce-scatter, shard update, all-gather);
* ``fsdp``       - FullyShardedParameters (ZeRO-3: gather each layer forward and again
  backward, prefetching the next, reduce-scatter its gradients, update the slices);
* ``ps-sync-1``  - one synchronous parameter server; ``ps-sync-2`` - two (sharded);
* ``ps-async-1`` - one asynchronous server, staleness bound 2;
* ``local-sgd-8`` - LocalSGD: local SGD steps, the weights averaged every 8 steps;
* ``diloco-8``   - DiLoCo: local SGD steps, every 8 an outer Nesterov step (lr 0.7,
  momentum 0.9) on the averaged pseudo-gradient.

Each rank gets ``cpus // ranks`` BLAS threads (at least one), as torchrun's OMP_NUM_THREADS=1
does: on a shared host, oversubscribed BLAS threads otherwise dominate every step.

Every configuration starts fresh ranks with ``gpucoll run`` and trains ``--steps`` steps of the
same global batch (64) from the same initial weights and data order; time per step is the mean
over the steps after ``--warmup``, averaged over the workers. Bytes per worker per step: for
the collectives, what the algorithm puts on the wire per rank (ring model: 2 (W - 1) / W of
the gradient bytes, the same for reduce-scatter + all-gather; LocalSGD and DiLoCo: that of
one all-reduce of the weights every 8 steps, divided by 8); for the parameter servers, the
exact payload pushed and pulled by a worker, and separately what one server moves.

    python bench/bench_training.py [--ranks 2 3 4] [--hidden 128 1024] [--steps 80]
        [--json bench/training.json] [--plot bench/training_comparison.png]
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

METHODS = {"ddp": (0, 0), "zero": (0, 0), "fsdp": (0, 0), "ps-sync-1": (1, 0), "ps-sync-2": (2, 0),
           "ps-async-1": (1, 2), "local-sgd-8": (0, 0), "diloco-8": (0, 0)}
# name -> (servers, staleness)
SYNC_EVERY = 8        # LocalSGD's and DiLoCo's H
GLOBAL_BATCH = 64
LR = 0.05


# ---------------------------------------------------------------------------- one rank
def child(args) -> int:
    import gpucoll
    from gpucoll.ddp import (Bucketer, DiLoCo, DistributedSampler, FullyShardedParameters,
                             LocalSGD, ShardedOptimizer, broadcast_parameters, make_optimizer)
    from gpucoll.examples.train_digits import init_params, load_digits_split, loss_and_grads
    from gpucoll.examples.train_fsdp import fsdp_logits, fsdp_loss_and_grads
    from gpucoll.ps import ParameterServer, PSWorker

    servers, staleness = METHODS[args.method]
    x_train, y_train, x_test, y_test = load_digits_split(0)
    comm = gpucoll.init(backend="cpu")
    workers = comm.size - servers
    is_server = comm.rank < servers
    group = comm.split(None if is_server else 0) if servers else comm
    params = init_params([64, args.hidden, args.hidden, 10], seed=0)
    result = {"method": args.method, "workers": workers, "servers": servers,
              "hidden": args.hidden, "elements": int(sum(p.size for p in params))}
    if is_server:
        server = ParameterServer(comm, params, num_servers=servers, staleness=staleness, lr=LR,
                                 momentum=0.9)
        stats = server.serve()
        steps = args.steps
        result.update(role="server", server_bytes_per_step=(stats["bytes_received"] +
                                                            stats["bytes_sent"]) / steps,
                      mean_staleness=stats["mean_staleness"], max_lead=stats["max_lead"])
        _write(args.out, comm.rank, result)
        comm.close()
        return 0
    broadcast_parameters(group, params)
    sampler = DistributedSampler(len(x_train), group, seed=0, drop_last=True)
    local = GLOBAL_BATCH // workers
    if args.method == "ddp":
        bucketer = Bucketer(group, params)
        optimizer = make_optimizer("sgd", lr=LR)
        wire = 2 * (workers - 1) / workers * sum(int(p.nbytes) for p in params)
    elif args.method == "zero":
        zero = ShardedOptimizer(group, params, "sgd", lr=LR)
        wire = zero.wire_bytes_per_step()
    elif args.method in ("local-sgd-8", "diloco-8"):
        kind = LocalSGD if args.method == "local-sgd-8" else DiLoCo
        averager = kind(group, params, sync_every=SYNC_EVERY)
        optimizer = make_optimizer("sgd", lr=LR)
        wire = 2 * (workers - 1) / workers * averager.wire_bytes_per_sync() / SYNC_EVERY
    elif args.method == "fsdp":
        fsdp = FullyShardedParameters(group, [params[i:i + 2] for i in range(0, len(params), 2)],
                                      "sgd", lr=LR)
    else:
        worker = PSWorker(comm, params, num_servers=servers, staleness=staleness)
        before = worker.bytes_sent + worker.bytes_received
    times, epoch, order, position = [], 0, None, 0
    for step in range(args.steps):
        if order is None or position + local > len(order):
            sampler.set_epoch(epoch)
            order, position, epoch = sampler.indices(), 0, epoch + 1
        batch = order[position:position + local]
        position += local
        start = time.perf_counter()
        if args.method == "ddp":
            _, _, grads = loss_and_grads(params, x_train[batch], y_train[batch],
                                         on_grad=bucketer.mark_ready)
            for index, (p, g) in enumerate(zip(params, bucketer.finish())):
                optimizer.update(index, p, g)
        elif args.method == "zero":
            loss_and_grads(params, x_train[batch], y_train[batch], on_grad=zero.mark_ready)
            zero.step()
        elif args.method in ("local-sgd-8", "diloco-8"):
            _, _, grads = loss_and_grads(params, x_train[batch], y_train[batch])
            for index, (p, g) in enumerate(zip(params, grads)):
                optimizer.update(index, p, g)
            averager.step()
        elif args.method == "fsdp":
            # each rank's mean loss, as loss_and_grads: step() averages over the ranks
            fsdp_loss_and_grads(fsdp, x_train[batch], y_train[batch])
            fsdp.step()
        else:
            _, _, grads = loss_and_grads(params, x_train[batch], y_train[batch])
            worker.push_pull(grads)
        times.append(time.perf_counter() - start)
    if servers:
        wire = (worker.bytes_sent + worker.bytes_received - before) / args.steps
        group.barrier()      # every worker has pushed its last step
        worker.pull()
        worker.close()
    if args.method == "fsdp":
        wire = fsdp.wire_bytes / args.steps
        logits, _ = fsdp_logits(fsdp, x_test)
        correct = int((logits.argmax(axis=1) == y_test).sum())
    else:
        _, correct, _ = loss_and_grads(params, x_test, y_test)
    result.update(role="worker", step_ms=1e3 * float(np.mean(times[args.warmup:])),
                  bytes_per_step=wire, accuracy=correct / len(x_test))
    _write(args.out, comm.rank, result)
    if group is not comm:
        group.close()
    comm.close()
    return 0


def _write(path: str, rank: int, result: dict) -> None:
    with open(f"{path}.{rank}", "w") as handle:
        json.dump(result, handle)


# ---------------------------------------------------------------------------- driver
def run_config(method: str, workers: int, hidden: int, steps: int, warmup: int) -> dict:
    servers = METHODS[method][0]
    ranks = workers + servers
    with tempfile.TemporaryDirectory(prefix="gpucoll-bench-train-") as tmp:
        out = os.path.join(tmp, "result")
        command = [sys.executable, "-m", "gpucoll", "run", "-n", str(ranks), "--timeout", "600",
                   os.path.abspath(__file__), "--child", "--method", method, "--hidden",
                   str(hidden), "--steps", str(steps), "--warmup", str(warmup), "--out", out]
        # one BLAS thread per rank share of the cores: oversubscribed BLAS threads cost 100x
        threads = str(max(1, (os.cpu_count() or 1) // ranks))
        env = dict(os.environ, OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
                   MKL_NUM_THREADS=threads)
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
        rows = [json.load(open(f"{out}.{r}")) for r in range(ranks)]
    work = [r for r in rows if r["role"] == "worker"]
    serve = [r for r in rows if r["role"] == "server"]
    return {"method": method, "workers": workers, "servers": servers, "hidden": hidden,
            "elements": work[0]["elements"], "steps": steps,
            "step_ms": float(np.mean([r["step_ms"] for r in work])),
            "bytes_per_worker": float(np.mean([r["bytes_per_step"] for r in work])),
            "bytes_per_server": float(np.mean([r["server_bytes_per_step"] for r in serve]))
            if serve else None,
            "accuracy": work[0]["accuracy"],
            "mean_staleness": serve[0]["mean_staleness"] if serve else 0.0}


def plot(results, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'gpucoll[plot]'") from None
    sizes = sorted({r["hidden"] for r in results})
    fig, axes = plt.subplots(2, len(sizes), figsize=(5.5 * len(sizes), 7.5), squeeze=False)
    for column, hidden in enumerate(sizes):
        mine = [r for r in results if r["hidden"] == hidden]
        elements = mine[0]["elements"]
        for method in METHODS:
            rows = sorted((r for r in mine if r["method"] == method), key=lambda r: r["workers"])
            if not rows:
                continue
            xs = [r["workers"] for r in rows]
            axes[0][column].plot(xs, [r["step_ms"] for r in rows], marker="o", label=method)
            axes[1][column].plot(xs, [r["bytes_per_worker"] / 1e6 for r in rows], marker="o",
                                 label=method)
        axes[0][column].set_title(f"digits MLP, hidden {hidden} ({elements:,} parameters)")
        axes[0][column].set_ylabel("time per step (ms)")
        axes[1][column].set_ylabel("MB moved per worker per step")
        for row in (0, 1):
            axes[row][column].set_xlabel("workers")
            axes[row][column].set_xticks(sorted({r["workers"] for r in mine}))
            axes[row][column].grid(alpha=0.3)
        axes[0][column].legend(fontsize=8)
    fig.suptitle("gpucoll cpu backend, one host: data parallelism vs parameter servers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=sorted(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4],
                        help="worker counts (a parameter server adds its servers)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 1024],
                        help="hidden widths: the model sizes")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.child:
        args.hidden = args.hidden[0]
        return child(args)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    load = os.getloadavg()
    print(f"# digits MLP [64, H, H, 10], global batch {GLOBAL_BATCH}, {args.steps} steps "
          f"(first {args.warmup} not timed), SGD momentum 0.9 lr {LR}; {os.cpu_count()} CPUs, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"# {'hidden':>6} {'params':>9} {'method':>11} {'workers':>7} {'servers':>7} "
          f"{'ms/step':>8} {'vs ddp':>6} {'MB/worker':>9} {'MB/server':>9} {'stale':>5} "
          f"{'test acc':>8}")
    results = []
    for hidden in args.hidden:
        for workers in args.ranks:
            base = None
            for method in args.methods:
                row = run_config(method, workers, hidden, args.steps, args.warmup)
                results.append(row)
                base = row["step_ms"] if method == "ddp" else base
                ratio = f"{row['step_ms'] / base:6.2f}" if base else "     -"
                server = (f"{row['bytes_per_server'] / 1e6:9.3f}" if row["bytes_per_server"]
                          else "        -")
                print(f"  {hidden:>6} {row['elements']:>9,} {method:>11} {workers:>7} "
                      f"{row['servers']:>7} {row['step_ms']:8.2f} {ratio} "
                      f"{row['bytes_per_worker'] / 1e6:9.3f} {server} "
                      f"{row['mean_staleness']:5.2f} {row['accuracy']:8.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
