"""Pipeline-parallel training (GPipe or 1F1B) of an MLP on scikit-learn's digits.

Run with::

    gpucoll run -n 2 -m gpucoll.examples.train_pp [--schedule 1f1b|gpipe] [--microbatches M]
    gpucoll run -n 4 -m gpucoll.examples.train_pp --dp 2      # 2 stages x 2 replicas

The MLP ``64 -> hidden -> hidden -> 10`` (three linear layers, ReLU between) is cut into
``world / dp`` stages, one rank each (``gpucoll.pp.mlp_layers``: earlier stages take the
extra layer). Every global batch is split among the ``--dp`` replicas, each replica's share
into ``--microbatches`` micro-batches that flow through its pipeline: activations forward,
gradients backward, ``isend`` / ``irecv`` between neighbouring stages. With ``--dp`` above 1
the ranks holding the same stage average their gradients with a ``Bucketer`` (``split``
makes the pipelines and the data-parallel groups). Every rank starts from the same weights;
the last stage of each replica computes the loss, and rank 0 prints the epoch lines of the
other examples (loss and accuracies summed over every rank, test accuracy from pipeline
evaluation).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gpucoll.ddp import Bucketer, DistributedSampler, all_reduce_metrics, make_optimizer
from gpucoll.examples.train_digits import (_array_module, _init, add_common_arguments, epoch_line,
                                           init_params, load_digits_split)
from gpucoll.pp import SCHEDULES, Pipeline, Stage, mlp_layers, pipeline_groups


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4, metavar="M")
    parser.add_argument("--dp", type=int, default=1, metavar="D",
                        help="data-parallel replicas of the pipeline")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    if args.microbatches < 1:
        parser.error(f"--microbatches must be >= 1, got {args.microbatches}")

    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed, data=args.data)
    with _init(xp is np) as comm:
        if args.dp < 1 or comm.size % args.dp:
            raise SystemExit(f"--dp {args.dp} must divide the {comm.size} ranks")
        stages = comm.size // args.dp
        if stages > 3:
            raise SystemExit(f"the MLP has 3 linear layers: at most 3 stages, got {stages} "
                             f"({comm.size} ranks / --dp {args.dp})")
        local = args.batch_size // args.dp
        if args.batch_size % args.dp or local % args.microbatches:
            raise SystemExit(f"--batch-size {args.batch_size} must split among {args.dp} "
                             f"replica(s) into {args.microbatches} micro-batches each")
        pipe_comm, dp_comm = pipeline_groups(comm, stages)
        params = init_params([64, args.hidden, args.hidden, 10], seed=args.seed, xp=xp)
        stage = Stage(mlp_layers(params, stages)[pipe_comm.rank], index=pipe_comm.rank,
                      stages=stages)
        pipe = Pipeline(pipe_comm, stage, micro_batches=args.microbatches,
                        schedule=args.schedule)
        bucketer = Bucketer(dp_comm, stage.params) if args.dp > 1 else None
        optimizer = make_optimizer("sgd", lr=args.lr)
        sampler = DistributedSampler(len(x_train), dp_comm, seed=args.seed, drop_last=True)
        x_dev, y_dev = xp.asarray(x_train), xp.asarray(y_train)
        test_rows = len(x_test) - len(x_test) % args.microbatches
        x_eval, y_eval = xp.asarray(x_test[:test_rows]), xp.asarray(y_test[:test_rows])
        if comm.rank == 0:
            print(f"# digits, pipeline parallel: {comm.size} ranks = {args.dp} data-parallel "
                  f"replica(s) x {stages} stage(s), schedule {args.schedule}, "
                  f"{args.microbatches} micro-batches of {local // args.microbatches} rows, "
                  f"hidden {args.hidden}, arrays {xp.__name__}", flush=True)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            mine = sampler.indices()
            start = time.perf_counter()
            loss_sum, correct, seen = 0.0, 0, 0
            for step in range(len(mine) // local):
                rows = xp.asarray(mine[step * local:(step + 1) * local])
                loss = pipe.step(x_dev[rows] if pipe.is_first else None,
                                 y_dev[rows] if pipe.is_last else None, batch_size=local)
                grads = bucketer.reduce(stage.grads) if bucketer else stage.grads
                for index, (param, grad) in enumerate(zip(stage.params, grads)):
                    optimizer.update(index, param, grad)
                if pipe.is_last:
                    loss_sum, correct = loss_sum + loss * local, correct + pipe.correct
                    seen += local
            totals = all_reduce_metrics(comm, {"loss": loss_sum, "correct": correct,
                                               "seen": seen})
            _, test_correct = pipe.evaluate(x_eval if pipe.is_first else None,
                                            y_eval if pipe.is_last else None,
                                            batch_size=test_rows)
            test = all_reduce_metrics(comm, {"correct": test_correct or 0,
                                             "seen": test_rows if pipe.is_last else 0})
            if comm.rank == 0:
                print(epoch_line(epoch, totals, test["correct"] / test["seen"], start),
                      flush=True)
        pipe_comm.close()
        dp_comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
