"""Tensor parallelism inside data-parallel groups: an MLP on scikit-learn's digits.

Run with::

    gpucoll run -n 4 -m gpucoll.examples.train_tp [--tp 2] [--epochs 10] [--sequence-parallel]

The ranks form a grid of ``world / tp`` data-parallel replicas of ``tp`` ranks each, a
``gpucoll.Mesh(comm, dp=world / tp, tp=tp)``: ranks ``{0, 1}`` and ``{2, 3}`` share a model
(tensor-parallel groups: the hidden layer's features are split between them), ranks
``{0, 2}`` and ``{1, 3}`` hold the same slices (data-parallel groups: they see different data
and average their gradients with a ``Bucketer``). Per step: one all-reduce forward and one
backward in each tensor-parallel group, one bucketed all-reduce per data-parallel group. With
``--sequence-parallel`` each tensor-parallel rank gets half of its replica's batch rows and the
MLP all-gathers / reduce-scatters them instead. Rank 0 prints the loss and the accuracy per epoch.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gpucoll import Mesh
from gpucoll.ddp import Bucketer, DistributedSampler, all_reduce_metrics, make_optimizer
from gpucoll.examples.train_digits import (_array_module, _init, add_common_arguments, epoch_line,
                                           load_digits_split)
from gpucoll.pp.layers import softmax_cross_entropy
from gpucoll.tp import ParallelMLP


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel group size")
    add_common_arguments(parser, hidden=256)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args(argv)

    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed, data=args.data)
    with _init(xp is np) as comm:
        if args.tp < 1 or comm.size % args.tp:
            raise SystemExit(f"--tp {args.tp} must divide the {comm.size} ranks")
        replicas = comm.size // args.tp
        if args.batch_size % (replicas * (args.tp if args.sequence_parallel else 1)):
            raise SystemExit(f"--batch-size {args.batch_size} must divide among the replicas "
                             f"(and tensor-parallel ranks with --sequence-parallel)")
        mesh = Mesh(comm, dp=replicas, tp=args.tp)
        tp_comm = mesh["tp"]    # same model, different slices
        dp_comm = mesh["dp"]    # same slices, different data
        mlp = ParallelMLP(tp_comm, 64, args.hidden, 10, seed=args.seed, xp=xp,
                          sequence_parallel=args.sequence_parallel)
        bucketer = Bucketer(dp_comm, mlp.params)
        optimizer = make_optimizer("sgd", lr=args.lr)
        sampler = DistributedSampler(len(x_train), dp_comm, seed=args.seed, drop_last=True)
        local = args.batch_size // replicas
        x_dev, y_dev = xp.asarray(x_train), xp.asarray(y_train)
        if comm.rank == 0:
            print(f"# digits, tensor parallel: {comm.size} ranks = {replicas} data-parallel "
                  f"replica(s) x {args.tp} tensor-parallel rank(s), hidden {args.hidden} "
                  f"({args.hidden // args.tp} per rank), sequence parallel "
                  f"{args.sequence_parallel}, arrays {xp.__name__}", flush=True)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            mine = sampler.indices()
            start = time.perf_counter()
            loss_sum, correct, seen = 0.0, 0, 0
            for step in range(len(mine) // local):
                batch = mine[step * local:(step + 1) * local]
                if args.sequence_parallel:   # this tensor-parallel rank's rows of the batch
                    part = local // args.tp
                    batch = batch[tp_comm.rank * part:(tp_comm.rank + 1) * part]
                rows = xp.asarray(batch)
                logits = mlp.forward(x_dev[rows])
                loss, hits, grad = softmax_cross_entropy(logits, y_dev[rows], 1.0 / local)
                mlp.backward(grad.astype(logits.dtype))
                grads = bucketer.reduce([g.copy() for g in mlp.grads])
                for index, (param, g) in enumerate(zip(mlp.params, grads)):
                    optimizer.update(index, param, g)
                if tp_comm.rank == 0 or args.sequence_parallel:
                    loss_sum, correct, seen = loss_sum + loss, correct + hits, seen + len(batch)
            totals = all_reduce_metrics(comm, {"loss": loss_sum, "correct": correct,
                                               "seen": seen})
            test_rows = len(x_test) - len(x_test) % args.tp
            x_eval, y_eval = x_test[:test_rows], y_test[:test_rows]
            if args.sequence_parallel:
                part = test_rows // args.tp
                x_eval = x_eval[tp_comm.rank * part:(tp_comm.rank + 1) * part]
                y_eval = y_eval[tp_comm.rank * part:(tp_comm.rank + 1) * part]
            hits = int((mlp.forward(xp.asarray(x_eval)).argmax(axis=1) == xp.asarray(y_eval)).sum())
            test = all_reduce_metrics(tp_comm, {"correct": hits, "seen": len(y_eval)}) \
                if args.sequence_parallel else {"correct": hits, "seen": len(y_eval)}
            if comm.rank == 0:
                print(epoch_line(epoch, totals, test["correct"] / test["seen"], start), flush=True)
        mesh.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
