"""Local SGD and DiLoCo against plain data parallelism: an MLP on scikit-learn's digits.

Run with::

    gpucoll run -n 2 -m gpucoll.examples.train_local_sgd --algorithm diloco --sync-every 8
    gpucoll run -n 3 -m gpucoll.examples.train_local_sgd --algorithm local-sgd --sync-every 4
    gpucoll run -n 2 -m gpucoll.examples.train_local_sgd --algorithm ddp     # every step
    gpucoll run -n 4 --elastic -m gpucoll.examples.train_local_sgd --algorithm diloco \\
        --elastic --kill-rank 2 --kill-step 30             # survives a lost rank

Every rank trains the same MLP (rank 0's weights) on its own shard of each epoch
(``DistributedSampler``, ``--batch-size`` / ranks samples a step) with SGD (``--lr``,
``--momentum``; the same inner optimizer for every algorithm).
``--algorithm ddp`` averages the gradients every step (``Bucketer``); ``local-sgd`` steps
locally and averages the weights every ``--sync-every`` steps (``gpucoll.ddp.LocalSGD``);
``diloco`` applies the replicas' averaged change every ``--sync-every`` steps with an outer
Nesterov SGD (``gpucoll.ddp.DiLoCo``, ``--outer-lr``, ``--outer-momentum``). ``--compression
bf16`` sends half precision. Rank 0 prints the loss and accuracy per epoch and, at the end,
the all-reduces this rank issued and the bytes it handed to them.

With ``--elastic`` (local-sgd, diloco), a lost rank does not end the run: the survivors
``comm.shrink()``, ``rebind()`` the averager to the new communicator (a sync the failure
interrupted is completed among them), re-shard the rest of the epoch and go on; rank 0 prints
"continued on N ranks from step S". ``--kill-rank R --kill-step S`` makes world rank R
SIGKILL itself at step S.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any, Dict, List, Optional

import numpy as np

from gpucoll.ddp import (SGD, Bucketer, DiLoCo, DistributedSampler, LocalSGD, all_reduce_metrics,
                         broadcast_parameters)
from gpucoll.examples.train_digits import (FAILURES, _array_module, _init, add_common_arguments,
                                           init_params, load_digits_split, loss_and_grads)

__all__ = ["ALGORITHMS", "make_averager", "train", "main"]

ALGORITHMS = ("ddp", "local-sgd", "diloco")


def make_averager(comm, params: List[Any], algorithm: str, *, sync_every: int = 8,
                  outer_lr: float = 0.7, outer_momentum: float = 0.9,
                  compression: Optional[str] = None):
    """The object that averages: a Bucketer (ddp, gradients), LocalSGD or DiLoCo."""
    if algorithm == "ddp":
        return Bucketer(comm, params, first_bucket_cap_bytes=64 << 10, compression=compression)
    if algorithm == "local-sgd":
        return LocalSGD(comm, params, sync_every=sync_every, compression=compression)
    if algorithm == "diloco":
        return DiLoCo(comm, params, sync_every=sync_every, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, compression=compression)
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def _wire(averager, algorithm: str, steps: int):
    """(all-reduces, bytes) of ``steps`` steps of ``averager`` (its completed syncs)."""
    if algorithm == "ddp":
        return steps * len(averager.buckets), steps * averager.wire_bytes_per_step()
    return (averager.syncs * len(averager.buckets),
            averager.syncs * averager.wire_bytes_per_sync())


def train(comm, params: List[Any], x_train, y_train, *, algorithm: str = "diloco",
          epochs: int = 5, batch_size: int = 64, lr: float = 0.05, momentum: float = 0.9,
          sync_every: int = 8, outer_lr: float = 0.7, outer_momentum: float = 0.9,
          compression: Optional[str] = None, seed: int = 0, xp: Any = np,
          elastic: bool = False, kill_rank: Optional[int] = None,
          kill_step: Optional[int] = None, on_epoch=None) -> Dict[str, Any]:
    """Train ``params`` (equal on every rank) in place; a collective of ``comm``'s ranks.

    ``on_epoch(comm, epoch, totals)`` is called after each epoch with the summed loss,
    correct and seen samples of every rank. Returns the final communicator (``comm``, or
    the survivors' after a lost rank), the steps taken, and the all-reduces and the bytes
    handed to them per rank (``all_reduces``, ``wire_bytes``; syncs that completed).
    """
    averager = make_averager(comm, params, algorithm, sync_every=sync_every, outer_lr=outer_lr,
                             outer_momentum=outer_momentum, compression=compression)
    inner = SGD(lr=lr, momentum=momentum)
    local_batch = batch_size // comm.size
    x_dev, y_dev = xp.asarray(x_train), xp.asarray(y_train)
    sampler = DistributedSampler(len(x_train), comm, seed=seed, drop_last=True)
    epoch = offset = step = 0
    world_rank = comm.to_world(comm.rank)
    sums = {"loss": 0.0, "correct": 0, "seen": 0}
    while epoch < epochs:
        sampler.set_epoch(epoch)
        mine = sampler.indices(start=offset)
        regrouped = False
        for k in range(len(mine) // local_batch):
            if world_rank == kill_rank and step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            batch = xp.asarray(mine[k * local_batch:(k + 1) * local_batch])
            hook = averager.mark_ready if algorithm == "ddp" else None
            loss, hits, grads = loss_and_grads(params, x_dev[batch], y_dev[batch], xp,
                                               on_grad=hook)
            if algorithm == "ddp":
                grads = averager.finish()
            for index, (param, grad) in enumerate(zip(params, grads)):
                inner.update(index, param, grad)
            sums["loss"] += loss * local_batch
            sums["correct"] += hits
            sums["seen"] += local_batch
            offset += local_batch * comm.size
            step += 1
            if algorithm == "ddp":
                continue
            try:
                averager.step()
            except FAILURES:
                if not elastic:
                    raise
                comm = _survive(comm, averager, step)
                sampler = DistributedSampler(len(x_train), comm, seed=seed, drop_last=True)
                sampler.set_epoch(epoch)
                regrouped = True
                break
        if regrouped:
            continue
        try:
            totals = all_reduce_metrics(comm, sums)
        except FAILURES:
            if not elastic or algorithm == "ddp":
                raise
            comm = _survive(comm, averager, step)
            totals = all_reduce_metrics(comm, sums)
        if on_epoch is not None:
            on_epoch(comm, epoch, totals)
        epoch, offset = epoch + 1, 0
        sums = {"loss": 0.0, "correct": 0, "seen": 0}
    all_reduces, wire_bytes = _wire(averager, algorithm, step)
    return {"comm": comm, "steps": step, "all_reduces": all_reduces, "wire_bytes": wire_bytes}


def _survive(comm, averager, step: int):
    """Shrink to the survivors and rebind the averager (it completes an interrupted sync)."""
    old, comm = comm, comm.shrink()
    old.close()
    averager.rebind(comm)
    if comm.rank == 0:
        lost = ", ".join(f"{rank} ({why})" for rank, why in sorted(comm.lost.items()))
        print(f"# lost rank(s) {lost}: continued on {comm.size} ranks from step {step}",
              flush=True)
    return comm


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="diloco")
    parser.add_argument("--sync-every", type=int, default=8, metavar="H",
                        help="inner steps between syncs (local-sgd, diloco)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer lr")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="DiLoCo's outer Nesterov momentum")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="the inner SGD's momentum (DiLoCo's outer momentum on top of "
                             "an inner one of 0.9 overshoots on this small problem)")
    parser.add_argument("--compression", choices=["none", "bf16", "fp16"], default="none")
    parser.add_argument("--elastic", action="store_true",
                        help="survive lost ranks (local-sgd, diloco): shrink and rebind")
    parser.add_argument("--kill-rank", type=int, default=None, metavar="R",
                        help="fault injection: world rank R SIGKILLs itself at --kill-step")
    parser.add_argument("--kill-step", type=int, default=None, metavar="S",
                        help="the step (from 0) at which --kill-rank dies")
    parser.set_defaults(lr=0.1, batch_size=48)
    args = parser.parse_args(argv)
    if (args.kill_rank is None) != (args.kill_step is None):
        parser.error("--kill-rank and --kill-step go together")
    if args.elastic and args.algorithm == "ddp":
        parser.error("--elastic here is for local-sgd and diloco (train_digits --elastic "
                     "covers ddp)")
    if args.sync_every < 1:
        parser.error(f"--sync-every must be >= 1, got {args.sync_every}")
    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed, data=args.data)
    comm = _init(xp is np)
    try:
        if args.batch_size % comm.size:
            raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the "
                             f"{comm.size} ranks")
        params = init_params([64, args.hidden, args.hidden, 10], seed=args.seed + comm.rank, xp=xp)
        broadcast_parameters(comm, params, root=0)    # every rank starts from rank 0's weights
        if comm.rank == 0:
            print(f"# digits: {len(x_train)} train / {len(x_test)} test, {comm.size} rank(s), "
                  f"backend {comm.backend}, arrays {xp.__name__}, global batch "
                  f"{args.batch_size}, {args.algorithm}"
                  + ("" if args.algorithm == "ddp" else f", sync every {args.sync_every}")
                  + (f", outer lr {args.outer_lr} momentum {args.outer_momentum}"
                     if args.algorithm == "diloco" else "")
                  + f", compression {args.compression}", flush=True)
        x_test_dev, y_test_dev = xp.asarray(x_test), xp.asarray(y_test)
        start = [time.perf_counter()]

        def report(comm, epoch, totals):
            _, test_correct, _ = loss_and_grads(params, x_test_dev, y_test_dev, xp)
            if comm.rank == 0:
                print(f"epoch {epoch + 1:3d}  loss {totals['loss'] / totals['seen']:.4f}  "
                      f"train acc {totals['correct'] / totals['seen']:.4f}  "
                      f"test acc {test_correct / len(x_test):.4f}  "
                      f"({time.perf_counter() - start[0]:.2f} s)", flush=True)
            start[0] = time.perf_counter()

        result = train(comm, params, x_train, y_train, algorithm=args.algorithm,
                       epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                       momentum=args.momentum, sync_every=args.sync_every,
                       outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                       compression=None if args.compression == "none" else args.compression,
                       seed=args.seed, xp=xp, elastic=args.elastic, kill_rank=args.kill_rank,
                       kill_step=args.kill_step, on_epoch=report)
        comm = result["comm"]
        if comm.rank == 0:
            print(f"# {result['steps']} steps: {result['all_reduces']} all-reduces, "
                  f"{result['wire_bytes']} bytes sent into them by rank 0", flush=True)
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
