"""Local SGD and DiLoCo against plain data parallelism: an MLP on scikit-learn's digits.

Run with::

    gpucoll run -n 2 -m gpucoll.examples.train_local_sgd --algorithm diloco --sync-every 8
    gpucoll run -n 3 -m gpucoll.examples.train_local_sgd --algorithm local-sgd --sync-every 4
    gpucoll run -n 2 -m gpucoll.examples.train_local_sgd --algorithm ddp     # every step
    gpucoll run -n 4 --elastic -m gpucoll.examples.train_local_sgd --algorithm diloco \\
        --elastic --kill-rank 2 --kill-step 30             # survives a lost rank
    gpucoll run -n 3 --elastic --replace 1 -m gpucoll.examples.train_local_sgd --elastic \\
        --kill-rank 2 --kill-step 33 --wait-for-ranks 3    # ... and takes its replacement in

Every rank trains the same MLP (rank 0's weights) on its own shard of each epoch
(``DistributedSampler``, ``--batch-size`` / ranks samples a step) with SGD (``--lr``,
``--momentum``; the same inner optimizer for every algorithm).
``--algorithm ddp`` averages the gradients every step (``Bucketer``); ``local-sgd`` steps
locally and averages the weights every ``--sync-every`` steps (``gpucoll.ddp.LocalSGD``);
``diloco`` applies the replicas' averaged change every ``--sync-every`` steps with an outer
Nesterov SGD (``gpucoll.ddp.DiLoCo``, ``--outer-lr``, ``--outer-momentum``). ``--compression
bf16`` sends half precision. Rank 0 prints the loss and accuracy per epoch and, at the end,
the all-reduces this rank issued and the bytes it handed to them; every rank prints a CRC-32
of its parameters (the same on every rank when the run ended on a sync).

With ``--elastic`` (local-sgd, diloco), a lost rank does not end the run: the survivors
``comm.shrink()``, ``rebind()`` the averager to the new communicator (a sync the failure
interrupted is completed among them), re-shard the rest of the epoch and go on; rank 0 prints
"continued on N ranks from step S". ``--kill-rank R --kill-step S`` makes world rank R
SIGKILL itself at step S. Every replica keeps the local batch it started with
(``--batch-size`` / ranks): fewer ranks take fewer samples a step.

Under ``gpucoll run --elastic --replace N`` a lost rank's place is taken by a new process,
which waits in ``init()``; the ranks call ``comm.grow()`` every ``--grow-every`` steps
(``--wait-for-ranks N``: waiting for replacements while fewer than N train), and when it
comes in the members ``rebind()`` the averager to the grown communicator while the newcomer
makes its own with ``joined=True`` (it receives the anchor, outer momentum and counters, and
the parameters to start from), then takes the position in the data and the local batch size
from the first member; rank 0 prints "rank(s) R joined: continued on N ranks from step S",
and every rank the CRC-32 of the parameters it goes on from.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import zlib
from typing import Any, Dict, List, Optional

import numpy as np

from gpucoll.ddp import (SGD, Bucketer, DiLoCo, DistributedSampler, LocalSGD, all_reduce_metrics,
                         broadcast_parameters)
from gpucoll.examples.elastic import (FAILURES, Progress, add_elastic_arguments,
                                      check_elastic_arguments, first_member, is_newcomer,
                                      joined_line, lost_line, share_progress)
from gpucoll.examples.train_digits import (_array_module, _init, add_common_arguments,
                                           init_params, load_digits_split, loss_and_grads)

__all__ = ["ALGORITHMS", "make_averager", "train", "checksum_line", "main"]

ALGORITHMS = ("ddp", "local-sgd", "diloco")


def make_averager(comm, params: List[Any], algorithm: str, *, sync_every: int = 8,
                  outer_lr: float = 0.7, outer_momentum: float = 0.9,
                  compression: Optional[str] = None, joined: bool = False):
    """The object that averages: a Bucketer (ddp, gradients), LocalSGD or DiLoCo.

    ``joined``: this rank came in through ``comm.grow()``; its LocalSGD or DiLoCo takes the
    state from a member (which calls ``rebind``)."""
    if algorithm == "ddp":
        if joined:
            raise ValueError("joined=True is for local-sgd and diloco: ddp does not grow")
        return Bucketer(comm, params, first_bucket_cap_bytes=64 << 10, compression=compression)
    if algorithm == "local-sgd":
        return LocalSGD(comm, params, sync_every=sync_every, compression=compression,
                        joined=joined)
    if algorithm == "diloco":
        return DiLoCo(comm, params, sync_every=sync_every, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, compression=compression, joined=joined)
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
          elastic: bool = False, grow_every: Optional[int] = None, wait_for_ranks: int = 0,
          kill_rank: Optional[int] = None, kill_step: Optional[int] = None,
          on_epoch=None) -> Dict[str, Any]:
    """Train ``params`` (equal on every rank) in place; a collective of ``comm``'s ranks.

    Each rank takes ``batch_size // comm.size`` samples a step, and keeps that number after a
    shrink or a grow (a newcomer takes the members'). With ``elastic`` (local-sgd, diloco) a lost rank does not end the run (the
    survivors shrink and rebind the averager), and with ``grow_every`` the ranks call
    ``comm.grow(min_size=wait_for_ranks)`` every ``grow_every`` steps: a lost rank's
    replacement, started as ``comm.joined`` says, calls ``train`` too (its ``params`` need
    only the right shapes) and takes the averager's state and the position from the members.
    ``on_epoch(comm, epoch, totals)`` is called after each epoch with the summed loss,
    correct and seen samples of every rank. Returns the final communicator (``comm``, or the
    one a shrink or grow gave), the averager, the steps taken, and the all-reduces and the
    bytes handed to them per rank (``all_reduces``, ``wire_bytes``; syncs that completed).
    After a grow every rank prints a :func:`checksum_line` of its parameters.
    """
    newcomer = is_newcomer(comm)
    averager = make_averager(comm, params, algorithm, sync_every=sync_every, outer_lr=outer_lr,
                             outer_momentum=outer_momentum, compression=compression,
                             joined=newcomer)
    inner = SGD(lr=lr, momentum=momentum)
    progress = Progress()
    local_batch = batch_size // comm.size
    if newcomer:
        local_batch = _welcome(comm, progress, local_batch)
        print(checksum_line(params, xp, progress.step, averager), flush=True)
    x_dev, y_dev = xp.asarray(x_train), xp.asarray(y_train)
    world_rank = comm.to_world(comm.rank)
    sums = {"loss": 0.0, "correct": 0, "seen": 0}
    while progress.epoch < epochs:
        sampler = DistributedSampler(len(x_train), comm, seed=seed, drop_last=True)
        sampler.set_epoch(progress.epoch)
        mine = sampler.indices(start=progress.offset)
        # the same count on every rank (after a regroup the shards may differ by a sample)
        steps_left = (sampler.total_size - progress.offset) // (local_batch * comm.size)
        regrouped = False
        for k in range(steps_left):
            if world_rank == kill_rank and progress.step == kill_step:
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
            progress.offset += local_batch * comm.size
            progress.step += 1
            if algorithm == "ddp":
                continue
            try:
                averager.step()
                bigger = comm
                if elastic and grow_every and progress.step % grow_every == 0:
                    bigger = comm.grow(min_size=wait_for_ranks)
            except FAILURES:
                if not elastic:
                    raise
                comm = _survive(comm, averager, progress)
                regrouped = True
                break
            if bigger is not comm:      # newcomers: they take the state, all re-shard
                averager.rebind(bigger)
                comm.close()
                comm = bigger
                local_batch = _welcome(comm, progress, local_batch)
                print(checksum_line(params, xp, progress.step, averager), flush=True)
                regrouped = True
                break
        if regrouped:
            continue
        try:
            totals = all_reduce_metrics(comm, sums)
        except FAILURES:
            if not elastic or algorithm == "ddp":
                raise
            comm = _survive(comm, averager, progress)
            totals = all_reduce_metrics(comm, sums)
        if on_epoch is not None:
            on_epoch(comm, progress.epoch, totals)
        progress.epoch, progress.offset = progress.epoch + 1, 0
        sums = {"loss": 0.0, "correct": 0, "seen": 0}
    all_reduces, wire_bytes = _wire(averager, algorithm, progress.step)
    return {"comm": comm, "averager": averager, "steps": progress.step,
            "all_reduces": all_reduces, "wire_bytes": wire_bytes}


def _survive(comm, averager, progress: Progress):
    """Shrink to the survivors and rebind the averager (it completes an interrupted sync);
    they go on from the position of the one that got furthest."""
    old, comm = comm, comm.shrink()
    old.close()
    averager.rebind(comm)
    steps = comm.all_gather(np.array([progress.step], dtype=np.int64))
    share_progress(comm, progress, int(np.argmax(steps[:, 0])))
    if comm.rank == 0:
        print(lost_line(comm, progress), flush=True)
    return comm


def _welcome(comm, progress: Progress, local_batch: int) -> int:
    """After ``grow()`` (the averager rebound, or made with ``joined=True``): every rank of
    ``comm``, the newcomers too, takes the first member's position and local batch."""
    (local_batch,) = share_progress(comm, progress, first_member(comm), [local_batch])
    if comm.rank == 0:
        print(joined_line(comm, progress), flush=True)
    return local_batch


def checksum_line(params: List[Any], xp: Any, step: int, averager) -> str:
    """A CRC-32 of this rank's parameters at ``step``, and whether it is a sync (then every
    rank prints the same) or how many steps after one (``averager`` a Bucketer: every step)."""
    crc = 0
    for param in params:
        crc = zlib.crc32(np.ascontiguousarray(param if xp is np else xp.asnumpy(param)), crc)
    since = averager.steps % averager.sync_every if hasattr(averager, "sync_every") else 0
    return (f"# parameters crc32 {crc:08x} after step {step}, "
            + (f"{since} step(s) after the last sync" if since else
               "a sync: the same on every rank"))


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
    add_elastic_arguments(parser, "survive lost ranks (local-sgd, diloco): shrink and "
                                  "rebind, and take replacements in when they come")
    parser.set_defaults(lr=0.1, batch_size=48)
    args = parser.parse_args(argv)
    check_elastic_arguments(parser, args)
    if args.elastic and args.algorithm == "ddp":
        parser.error("--elastic here is for local-sgd and diloco (train_digits --elastic "
                     "covers ddp)")
    if args.sync_every < 1:
        parser.error(f"--sync-every must be >= 1, got {args.sync_every}")
    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed, data=args.data)
    comm = _init(xp is np)
    try:
        newcomer = is_newcomer(comm)    # a lost rank's replacement: train() gives it the state
        if args.batch_size % comm.size and not newcomer:
            raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the "
                             f"{comm.size} ranks")
        params = init_params([64, args.hidden, args.hidden, 10], seed=args.seed + comm.rank, xp=xp)
        if not newcomer:
            broadcast_parameters(comm, params, root=0)   # every rank starts from rank 0's weights
        if comm.rank == 0 and not newcomer:
            print(f"# digits: {len(x_train)} train / {len(x_test)} test, {comm.size} rank(s), "
                  f"backend {comm.backend}, arrays {xp.__name__}, global batch "
                  f"{args.batch_size}, {args.algorithm}"
                  + ("" if args.algorithm == "ddp" else f", sync every {args.sync_every}")
                  + (f", outer lr {args.outer_lr} momentum {args.outer_momentum}"
                     if args.algorithm == "diloco" else "")
                  + f", compression {args.compression}"
                  + (f", elastic (grow every {args.grow_every})" if args.elastic else ""),
                  flush=True)
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
                       seed=args.seed, xp=xp, elastic=args.elastic,
                       grow_every=args.grow_every, wait_for_ranks=args.wait_for_ranks,
                       kill_rank=args.kill_rank, kill_step=args.kill_step, on_epoch=report)
        comm = result["comm"]
        if comm.rank == 0:
            print(f"# {result['steps']} steps: {result['all_reduces']} all-reduces, "
                  f"{result['wire_bytes']} bytes sent into them by rank 0", flush=True)
        print(checksum_line(params, xp, result["steps"], result["averager"]), flush=True)
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
