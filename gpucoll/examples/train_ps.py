"""Parameter-server training of the digits MLP: synchronous or asynchronous workers.

Run with::

    gpucoll run -n 3 -m gpucoll.examples.train_ps --mode sync            # 1 server, 2 workers
    gpucoll run -n 4 -m gpucoll.examples.train_ps --mode async --servers 2 --staleness 2

Ranks ``0 .. K-1`` are servers (``--servers K``); each owns a shard of the flattened
parameters and runs SGD with momentum on it. The other ranks are workers: each takes a
disjoint shard of every global batch (``DistributedSampler`` over the workers), computes its
gradients, pushes them to every server and pulls the parameters back. ``--mode sync``: the
servers average one push from every worker per step (the same arithmetic as data
parallelism); ``--mode async``: each push is applied at once and a worker may run up to
``--staleness`` steps ahead of the slowest. At the end of each epoch the workers meet (one
all-reduce among them), pull the current parameters and the first worker prints the loss and
the accuracy; the first server prints how stale the applied gradients were. On NCCL the
servers and workers talk over ``comm.host_group()`` (CuPy arrays staged through host memory).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np

from gpucoll.ddp import DistributedSampler, all_reduce_metrics
from gpucoll.examples.train_digits import (_array_module, _init, add_common_arguments, epoch_line,
                                           init_params, load_digits_split, loss_and_grads)
from gpucoll.ps import ParameterServer, PSWorker


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sync", "async"], default="sync")
    parser.add_argument("--servers", type=int, default=1, help="server ranks (shards)")
    parser.add_argument("--staleness", type=int, default=2,
                        help="async: steps a worker may run ahead of the slowest")
    add_common_arguments(parser)
    args = parser.parse_args(argv)

    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed, data=args.data)
    staleness = 0 if args.mode == "sync" else args.staleness
    with _init(xp is np) as comm, contextlib.ExitStack() as closing:
        if not 1 <= args.servers < comm.size:
            raise SystemExit(f"--servers {args.servers} must leave at least one worker among "
                             f"the {comm.size} ranks")
        workers = comm.size - args.servers
        if args.batch_size % workers:
            raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the "
                             f"{workers} workers")
        is_server = comm.rank < args.servers
        worker_comm = comm.split(None if is_server else 0)
        # a server takes whichever worker's message comes first: on NCCL, whose receives
        # complete in issue order, the parameter traffic takes a host group beside it
        ps_comm = comm if comm.memory == "host" else closing.enter_context(comm.host_group())
        params = init_params([64, args.hidden, args.hidden, 10], seed=args.seed, xp=xp)
        if is_server:
            server = ParameterServer(ps_comm, params, num_servers=args.servers, staleness=staleness,
                                     lr=args.lr, momentum=0.9)
            stats = server.serve()
            if comm.rank == 0:
                print(f"# server 0: {stats['updates']} updates, gradient staleness mean "
                      f"{stats['mean_staleness']:.2f} max {stats['max_staleness']} (versions), "
                      f"workers at most {stats['max_lead']} step(s) apart, "
                      f"{stats['seconds']:.2f} s", flush=True)
            return 0
        worker = PSWorker(ps_comm, params, num_servers=args.servers, staleness=staleness)
        sampler = DistributedSampler(len(x_train), worker_comm, seed=args.seed, drop_last=True)
        local = args.batch_size // workers
        x_dev, y_dev = xp.asarray(x_train), xp.asarray(y_train)
        if worker_comm.rank == 0:
            print(f"# digits, parameter server: {args.servers} server(s), {workers} worker(s), "
                  f"mode {args.mode}" + (f" (staleness {staleness})" if staleness else "") +
                  f", arrays {xp.__name__}", flush=True)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            mine = sampler.indices()
            start = time.perf_counter()
            loss_sum, correct, seen = 0.0, 0, 0
            for step in range(len(mine) // local):
                batch = xp.asarray(mine[step * local:(step + 1) * local])
                loss, hits, grads = loss_and_grads(params, x_dev[batch], y_dev[batch], xp)
                worker.push_pull(grads)
                loss_sum, correct, seen = loss_sum + loss * local, correct + hits, seen + local
            totals = all_reduce_metrics(worker_comm, {"loss": loss_sum, "correct": correct,
                                                      "seen": seen})
            worker.pull()    # every worker pushed this epoch's last step: the same parameters
            _, test_correct, _ = loss_and_grads(params, xp.asarray(x_test), xp.asarray(y_test), xp)
            if worker_comm.rank == 0:
                print(epoch_line(epoch, totals, test_correct / len(x_test), start), flush=True)
        worker.close()
        worker_comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
