"""Pipeline-parallel training (GPipe, 1F1B or interleaved 1F1B) of an MLP on scikit-learn's
digits.

Run with::

    gpucoll run -n 2 -m gpucoll.examples.train_pp [--schedule 1f1b|gpipe] [--microbatches M]
    gpucoll run -n 4 -m gpucoll.examples.train_pp --dp 2      # 2 stages x 2 replicas
    gpucoll run -n 2 -m gpucoll.examples.train_pp --schedule interleaved --virtual-stages 2 \
        --hidden-layers 3

The MLP ``64 -> hidden -> ... -> hidden -> 10`` (``--hidden-layers`` hidden layers, default
2: three linear layers, ReLU between) is cut into ``world / dp`` stages, one rank each
(``gpucoll.pp.mlp_layers``: earlier stages take the extra layer); with ``--schedule
interleaved`` into ``stages x --virtual-stages`` chunks, chunk ``c`` on stage ``c % stages``
(each chunk needs a linear layer: 2 stages x 2 chunks need ``--hidden-layers 3``). Every
global batch is split among the ``--dp`` replicas, each replica's share into
``--microbatches`` micro-batches that flow through its pipeline: activations forward,
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
    parser.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                        help="model chunks per stage (--schedule interleaved; default 2)")
    parser.add_argument("--hidden-layers", type=int, default=2, metavar="L")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    if args.microbatches < 1:
        parser.error(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.virtual_stages is not None and args.schedule != "interleaved":
        parser.error(f"--virtual-stages needs --schedule interleaved, got {args.schedule}")
    chunks_per_stage = (args.virtual_stages or 2) if args.schedule == "interleaved" else 1
    if chunks_per_stage < 1 or args.hidden_layers < 0:
        parser.error(f"--virtual-stages must be >= 1 and --hidden-layers >= 0, got "
                     f"{chunks_per_stage} and {args.hidden_layers}")

    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed, data=args.data)
    with _init(xp is np) as comm:
        if args.dp < 1 or comm.size % args.dp:
            raise SystemExit(f"--dp {args.dp} must divide the {comm.size} ranks")
        stages = comm.size // args.dp
        chunks = stages * chunks_per_stage
        linear = args.hidden_layers + 1
        if chunks > linear:
            raise SystemExit(f"the MLP has {linear} linear layers: at most {linear} chunks, got "
                             f"{chunks} ({stages} stage(s) x {chunks_per_stage}; pass "
                             f"--hidden-layers {chunks - 1})")
        if args.schedule == "interleaved" and (stages < 2 or args.microbatches % stages):
            raise SystemExit(f"--schedule interleaved needs 2 stages or more and --microbatches "
                             f"a multiple of them: {stages} stage(s), {args.microbatches}")
        local = args.batch_size // args.dp
        if args.batch_size % args.dp or local % args.microbatches:
            raise SystemExit(f"--batch-size {args.batch_size} must split among {args.dp} "
                             f"replica(s) into {args.microbatches} micro-batches each")
        pipe_comm, dp_comm = pipeline_groups(comm, stages)
        params = init_params([64] + [args.hidden] * (linear - 1) + [10], seed=args.seed, xp=xp)
        layers = mlp_layers(params, chunks)
        my_chunks = [Stage(layers[c], index=c, stages=chunks)
                for c in range(pipe_comm.rank, chunks, stages)]
        stage = my_chunks[0] if len(my_chunks) == 1 else my_chunks
        pipe = Pipeline(pipe_comm, stage, micro_batches=args.microbatches,
                        schedule=args.schedule)
        my_params = [p for chunk in my_chunks for p in chunk.params]
        bucketer = Bucketer(dp_comm, my_params) if args.dp > 1 else None
        optimizer = make_optimizer("sgd", lr=args.lr)
        sampler = DistributedSampler(len(x_train), dp_comm, seed=args.seed, drop_last=True)
        x_dev, y_dev = xp.asarray(x_train), xp.asarray(y_train)
        test_rows = len(x_test) - len(x_test) % args.microbatches
        x_eval, y_eval = xp.asarray(x_test[:test_rows]), xp.asarray(y_test[:test_rows])
        if comm.rank == 0:
            print(f"# digits, pipeline parallel: {comm.size} ranks = {args.dp} data-parallel "
                  f"replica(s) x {stages} stage(s), schedule {args.schedule}, "
                  + (f"{chunks_per_stage} chunks per stage, " if chunks_per_stage > 1 else "")
                  + f"{args.microbatches} micro-batches of {local // args.microbatches} rows, "
                  f"{linear} linear layers, hidden {args.hidden}, arrays {xp.__name__}",
                  flush=True)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            mine = sampler.indices()
            start = time.perf_counter()
            loss_sum, correct, seen = 0.0, 0, 0
            for step in range(len(mine) // local):
                rows = xp.asarray(mine[step * local:(step + 1) * local])
                loss = pipe.step(x_dev[rows] if pipe.is_first else None,
                                 y_dev[rows] if pipe.is_last else None, batch_size=local)
                grads = [g for chunk in my_chunks for g in chunk.grads]
                grads = bucketer.reduce(grads) if bucketer else grads
                for index, (param, grad) in enumerate(zip(my_params, grads)):
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
