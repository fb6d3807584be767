"""Data-parallel training of a small MLP on scikit-learn's digits (8x8 images, 10 classes).

Run with::

    gpucoll run -n 2 -m gpucoll.examples.train_digits [--epochs 10] [--compression bf16]
    gpucoll run -n 3 -m gpucoll.examples.train_digits --zero [--optimizer adam] [--loss-scaling]
    python -m gpucoll.examples.train_digits          # one process
    gpucoll run -n 4 --elastic -m gpucoll.examples.train_digits --elastic   # survives a lost rank
    gpucoll run -n 4 -m gpucoll.examples.train_digits --zero --checkpoint-dir ckpt   # resumable
    gpucoll run -n 2 -m gpucoll.examples.train_digits --powersgd 2   # low-rank gradients

Forward and backward are written with the array module: CuPy when it is installed and a GPU
is present (``--cpu`` forces NumPy), NumPy otherwise. Each rank takes a disjoint shard of every
global batch (``DistributedSampler``); gradients are averaged by the ``Bucketer``, which starts
each bucket's all-reduce from inside backward as soon as its gradients exist. Rank 0 prints the
global loss and the train / test accuracy per epoch. ``--zero`` replaces the Bucketer and
the local optimizer with the ``ShardedOptimizer`` (ZeRO-1: reduce-scatter, update this rank's
shard, all-gather), and prints the optimizer state each rank holds. ``--loss-scaling`` scales
the loss with a ``DynamicLossScaler`` and skips steps whose gradients overflowed. The dataset
ships with scikit-learn (no download): ``pip install 'gpucoll[examples]'``. ``--powersgd R``
makes the Bucketer send rank-R PowerSGD approximations (``comm_hook=PowerSGD(...)``): each
bucket's P goes out during backward as the plain buckets do.

With ``--elastic``, a rank that dies mid-epoch does not end the run: the survivors catch the
error, ``comm.shrink()`` to the ranks still alive, take the newest replicated state (data
parallelism keeps every rank's weights identical; the survivor with the most steps done
broadcasts its weights, momentum and position), re-shard the rest of the epoch over the
remaining ranks and redo the interrupted step; rank 0 prints "continued on N ranks from step
S". ``--kill-rank R --kill-step S`` makes world rank R SIGKILL itself at global step S (to try
it, and for the tests). ``--elastic`` alone takes the replicated SGD path: with ``--zero`` each
rank holds only its shard of the optimizer state, which a lost rank takes with it.

``--checkpoint-dir D`` (with ``--zero``) saves the sharded state, the position in the data
and the loss scaler to ``D/step-N`` every ``--checkpoint-every`` steps (and at step 0 and at
the end), keeping
the newest two. A run started with a checkpoint in D resumes from it, at any number of ranks.
With ``--elastic`` too, the survivors of a lost rank shrink and go back to the newest
checkpoint (the lost rank's shard of the state comes back from its files): rank 0 prints
"continued on N ranks from the checkpoint of step S".

Under ``gpucoll run --elastic --replace N`` a lost rank's place is taken by a new process,
which waits in ``init()``; with ``--elastic`` the ranks call ``comm.grow()`` every
``--grow-every`` steps (``--wait-for-ranks N``: waiting for replacements while fewer than N
train), and when it comes in they send it the replicated state (weights,
momentum, position), or with ``--zero --checkpoint-dir`` save a checkpoint that every rank,
the newcomer too, loads; rank 0 prints "rank(s) R joined: continued on N ranks from step S".
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import os
import signal
import time
from typing import Any, Callable, List, Optional

import numpy as np

import gpucoll
from gpucoll import config
from gpucoll.ddp import (Bucketer, DistributedSampler, DynamicLossScaler, PowerSGD,
                         ShardedOptimizer, all_reduce_metrics, broadcast_parameters,
                         make_optimizer)
from gpucoll.examples.checkpointing import resume, save_step
from gpucoll.examples.elastic import (FAILURES, Progress, add_elastic_arguments,
                                      check_elastic_arguments, first_member, is_newcomer,
                                      joined_line, lost_line, share_progress)


def init_params(sizes, seed: int = 0, xp: Any = np, dtype: Any = np.float32) -> List[Any]:
    """He-initialized weights and zero biases: ``[W0, b0, W1, b1, ...]`` (registration order)."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append(xp.asarray(rng.normal(0.0, np.sqrt(2.0 / fan_in), (fan_in, fan_out)),
                                 dtype=dtype))
        params.append(xp.zeros(fan_out, dtype=dtype))
    return params


def forward(params: List[Any], x: Any, xp: Any = np):
    """Logits and the activations backward needs."""
    activations = [x]
    h = x
    layers = len(params) // 2
    for layer in range(layers):
        h = h @ params[2 * layer] + params[2 * layer + 1]
        if layer < layers - 1:
            h = xp.maximum(h, 0)
        activations.append(h)
    return h, activations


def loss_and_grads(params: List[Any], x: Any, y: Any, xp: Any = np,
                   on_grad: Optional[Callable[[int, Any], None]] = None, scale: float = 1.0):
    """Mean softmax cross-entropy over the batch and its gradients (times ``scale``).

    Backward runs last layer first and calls ``on_grad(index, grad)`` as soon as each gradient
    exists (the data-parallel hook). Returns ``(loss, correct, grads)``.
    """
    logits, activations = forward(params, x, xp)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    probs = exp / exp.sum(axis=1, keepdims=True)
    batch = x.shape[0]
    rows = xp.arange(batch)
    loss = float(-xp.log(probs[rows, y] + 1e-12).mean())
    correct = int((logits.argmax(axis=1) == y).sum())
    delta = probs
    delta[rows, y] -= 1
    delta *= scale / batch
    grads: List[Any] = [None] * len(params)
    for layer in reversed(range(len(params) // 2)):
        h_in = activations[layer]
        grads[2 * layer + 1] = delta.sum(axis=0).astype(params[2 * layer + 1].dtype)
        if on_grad:
            on_grad(2 * layer + 1, grads[2 * layer + 1])
        grads[2 * layer] = (h_in.T @ delta).astype(params[2 * layer].dtype)
        if on_grad:
            on_grad(2 * layer, grads[2 * layer])
        if layer > 0:
            delta = (delta @ params[2 * layer].T) * (activations[layer] > 0)
    return loss, correct, grads


def sgd_step(params: List[Any], grads: List[Any], velocity: List[Any], lr: float,
             momentum: float = 0.9) -> None:
    for p, g, v in zip(params, grads, velocity):
        v *= momentum
        v += g
        p -= lr * v


def epoch_line(epoch: int, totals, test_accuracy: float, start: float) -> str:
    """The per-epoch line the training examples print (``totals``: summed loss, correct, seen)."""
    return (f"epoch {epoch + 1:3d}  loss {totals['loss'] / totals['seen']:.4f}  "
            f"train acc {totals['correct'] / totals['seen']:.4f}  "
            f"test acc {test_accuracy:.4f}  ({time.perf_counter() - start:.2f} s)")


def add_common_arguments(parser, hidden: int = 128) -> None:
    """The options every training example shares: epochs, global batch size, learning rate,
    hidden width, seed, ``--cpu`` and ``--data``."""
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="use NumPy even when CuPy works")
    parser.add_argument("--data", metavar="FILE.npz",
                        help="the digits as an .npz with x (n, 64) and y (n,) instead of "
                             "scikit-learn's copy")


def _array_module(force_cpu: bool):
    if not force_cpu:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return cupy
        except Exception:
            pass
    return np


def load_digits_split(seed: int = 0, test_fraction: float = 0.2, data: Optional[str] = None):
    """Standardized digits features, split into train and test sets (same on every rank).

    ``data``: an ``.npz`` with ``x`` (n, 64) and ``y`` (n,), e.g. scikit-learn's ``load_digits``
    saved where it is installed, for hosts without scikit-learn.
    """
    x, y = _digits_from_file(data) if data else _digits_from_scikit_learn()
    x = np.asarray(x, np.float32) / 16.0
    y = np.asarray(y).astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0) + 1e-6
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def _digits_from_scikit_learn():
    """scikit-learn's digits, read from the file it ships without importing it.

    Importing scikit-learn costs about 2 s of CPU per rank (it pulls in SciPy), far more than
    training on digits; its ``datasets/data/digits.csv.gz`` holds the same numbers that
    ``load_digits()`` returns (64 features, then the label, per row). Where that file is not
    found, ``load_digits()`` reads it."""
    spec = importlib.util.find_spec("sklearn")      # finds the package without running it
    if spec is None:
        raise SystemExit("this example needs scikit-learn (pip install 'gpucoll[examples]') "
                         "or --data FILE.npz")
    for where in spec.submodule_search_locations or ():
        path = os.path.join(where, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, "rt") as rows:
                table = np.loadtxt(rows, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits
    digits = load_digits()
    return digits.data, digits.target


def _digits_from_file(path: str):
    """``x`` and ``y`` of an .npz, checked: 64 features per row, one label per row, 0-9."""
    try:
        with np.load(path) as saved:
            x, y = saved["x"], saved["y"]
    except (OSError, KeyError, ValueError) as exc:
        raise SystemExit(f"--data {path}: not an .npz with arrays x and y ({exc})") from exc
    if x.ndim != 2 or x.shape[1] != 64 or y.shape != (x.shape[0],) or x.shape[0] < 10:
        raise SystemExit(f"--data {path}: x must be (n, 64) and y (n,) with n >= 10; got x "
                         f"{x.shape}, y {y.shape}")
    if y.min() < 0 or y.max() > 9:
        raise SystemExit(f"--data {path}: labels must be 0-9, got {y.min()}..{y.max()}")
    return x, y


def _init(force_cpu: bool):
    """The launcher's communicator, or a one-rank one when started without a launcher.

    NumPy arrays (``force_cpu``) take the CPU backend unless GPUCOLL_BACKEND names one: a
    backend asked for by name that cannot run here is an error, not a quiet fallback."""
    named = config.get("GPUCOLL_BACKEND").lower() != "auto"
    try:
        return gpucoll.init(backend="cpu" if force_cpu and not named else None)
    except ValueError:  # no rank / world size in the environment: a single process
        import tempfile

        store = tempfile.mkdtemp(prefix="gpucoll-digits-")
        return gpucoll.init(backend="cpu", rank=0, world_size=1, url=f"file://{store}/store")


def _optimizer_settings(args) -> dict:
    return {"lr": args.lr} if args.optimizer == "sgd" else {"lr": args.lr / 50}


class _Shard:
    """What depends on the communicator: the local batch, the sampler, and the Bucketer (or,
    with ``--zero``, the ShardedOptimizer)."""

    def __init__(self, comm, params, args, dataset_size: int):
        self.comm = comm
        self.local_batch = args.batch_size // comm.size
        self.sampler = DistributedSampler(dataset_size, comm, seed=args.seed, drop_last=True)
        self.zero = self.bucketer = None
        if args.zero:
            self.zero = ShardedOptimizer(comm, params, args.optimizer,
                                         first_bucket_cap_bytes=64 << 10,
                                         **_optimizer_settings(args))
            self.hook, self.buckets = self.zero.mark_ready, len(self.zero.buckets)
        else:
            powersgd = PowerSGD(comm, params, rank=args.powersgd, start_step=10) \
                if args.powersgd else None     # each bucket's P is sent during backward
            self.bucketer = Bucketer(comm, params, first_bucket_cap_bytes=64 << 10,
                                     compression=None if args.compression == "none" else
                                     args.compression, comm_hook=powersgd)
            self.hook, self.buckets = self.bucketer.mark_ready, len(self.bucketer.buckets)

    def step(self, params, optimizer, scaler) -> None:
        """Average the gradients and update the weights (skipped when the scaler says so)."""
        if self.zero is not None:
            self.zero.step(scaler=scaler)
            return
        grads = self.bucketer.finish(loss_scale=scaler.scale if scaler else None)
        if scaler is None or scaler.update(self.bucketer.found_nonfinite()):
            for index, (param, grad) in enumerate(zip(params, grads)):
                optimizer.update(index, param, grad)


def _recover(shard: _Shard, params, velocity, progress: Progress, args, dataset_size: int):
    """Shrink to the survivors and continue from the newest replicated state."""
    old = shard.comm
    comm = old.shrink()
    old.close()
    # a survivor may have finished the step the others were still in: the one with the most
    # steps done has the newest state (all of them are consistent: the step's all-reduce
    # completed there with every rank's gradient)
    steps = comm.all_gather(np.array([progress.step], dtype=np.int64))
    source = int(np.argmax(steps[:, 0]))
    broadcast_parameters(comm, list(params) + list(velocity), root=source)
    share_progress(comm, progress, source)
    if comm.rank == 0:
        print(lost_line(comm, progress), flush=True)
    return _Shard(comm, params, args, dataset_size)


def _recover_from_checkpoint(shard: _Shard, params, progress: Progress, scaler, args,
                             dataset_size: int) -> _Shard:
    """Shrink to the survivors, re-shard the optimizer over them, load the newest checkpoint."""
    old = shard.comm
    comm = old.shrink()
    old.close()
    shard = _Shard(comm, params, args, dataset_size)
    path = resume(shard.zero, args.checkpoint_dir, progress, scaler)
    if path is None:
        raise SystemExit(f"--checkpoint-dir {args.checkpoint_dir} holds no complete checkpoint "
                         f"to continue from")
    if comm.rank == 0:
        print(lost_line(comm, progress, from_checkpoint=True), flush=True)
    return shard


def _welcome(old: Optional[_Shard], comm, params, velocity, progress: Progress, scaler, args,
             dataset_size: int) -> _Shard:
    """After ``grow()``: every rank of ``comm``, the newcomers too (``old`` None), gets the
    members' state and position; the members then close their old communicator."""
    if args.checkpoint_dir:   # sharded state: through a checkpoint saved by the members
        if old is not None:
            save_step(old.zero, args.checkpoint_dir, progress, scaler)
        comm.barrier()        # the newcomers look for the newest checkpoint only after it
        shard = _Shard(comm, params, args, dataset_size)
        resume(shard.zero, args.checkpoint_dir, progress, scaler)
    else:                     # replicated state: from the first member that is not new
        source = first_member(comm)
        broadcast_parameters(comm, list(params) + list(velocity), root=source)
        share_progress(comm, progress, source)
        shard = _Shard(comm, params, args, dataset_size)
    if old is not None:
        old.comm.close()
    if comm.rank == 0:
        print(joined_line(comm, progress), flush=True)
    return shard


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--compression", choices=["none", "bf16", "fp16"], default="none")
    parser.add_argument("--powersgd", type=int, default=0, metavar="R",
                        help="average gradients through PowerSGD's rank-R approximations "
                             "(exact for the first 10 steps)")
    parser.add_argument("--zero", action="store_true",
                        help="shard the optimizer state across ranks (ZeRO-1)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--loss-scaling", action="store_true",
                        help="dynamic loss scaling (skip steps that overflow)")
    add_elastic_arguments(parser, "survive lost ranks: shrink, re-shard, redo the "
                                  "interrupted step")
    parser.add_argument("--checkpoint-dir", default=None, metavar="D",
                        help="with --zero: save to D/step-N, resume from the newest there (at "
                             "any number of ranks), and with --elastic go back to it")
    parser.add_argument("--checkpoint-every", type=int, default=20, metavar="K",
                        help="steps between checkpoints (default 20)")
    args = parser.parse_args(argv)
    check_elastic_arguments(parser, args)
    if args.zero and args.compression != "none":
        parser.error("--compression applies to the Bucketer, not to --zero")
    if args.powersgd and (args.zero or args.compression != "none" or args.loss_scaling):
        parser.error("--powersgd is the Bucketer's comm hook (it sends each bucket): not "
                     "with --zero, --compression or --loss-scaling")
    if args.checkpoint_dir and not args.zero:
        parser.error("--checkpoint-dir saves the sharded state of --zero")
    if args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    if args.elastic and not args.checkpoint_dir and (args.zero or args.optimizer != "sgd"
                                                     or args.loss_scaling):
        parser.error("--elastic continues from replicated state: it takes the SGD path, without "
                     "--zero (sharded state), --optimizer adam or --loss-scaling; or add "
                     "--checkpoint-dir with --zero to go back to the last checkpoint")

    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed, data=args.data)
    comm = _init(xp is np)
    shard = None
    try:
        if args.batch_size % comm.size:
            raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the "
                             f"{comm.size} ranks")
        params = init_params([64, args.hidden, args.hidden, 10], seed=args.seed + comm.rank, xp=xp)
        newcomer = is_newcomer(comm)   # a lost rank's replacement
        if not newcomer:
            broadcast_parameters(comm, params, root=0)   # every rank starts from rank 0's weights
        optimizer = make_optimizer(args.optimizer, **_optimizer_settings(args))
        if args.optimizer == "sgd":  # the momentum, made now so that --elastic can replicate it
            optimizer.state = [{"velocity": xp.zeros_like(p)} for p in params]
        velocity = [slot["velocity"] for slot in optimizer.state]
        scaler = DynamicLossScaler(init_scale=2.0 ** 12, growth_interval=100) \
            if args.loss_scaling else None
        progress = Progress()
        shard = _welcome(None, comm, params, velocity, progress, scaler, args, len(x_train)) \
            if newcomer else _Shard(comm, params, args, len(x_train))
        x_train_dev, y_train_dev = xp.asarray(x_train), xp.asarray(y_train)
        x_test_dev, y_test_dev = xp.asarray(x_test), xp.asarray(y_test)
        if comm.rank == 0 and not newcomer:
            print(f"# digits: {len(x_train)} train / {len(x_test)} test, {comm.size} rank(s), "
                  f"backend {comm.backend}, arrays {xp.__name__}, global batch {args.batch_size}, "
                  f"{shard.buckets} bucket(s), compression "
                  f"{f'powersgd rank {args.powersgd}' if args.powersgd else args.compression}, "
                  f"optimizer "
                  f"{args.optimizer}{' sharded (ZeRO-1)' if args.zero else ''}"
                  + (", elastic" if args.elastic else ""))
        world_rank = comm.to_world(comm.rank)
        if args.checkpoint_dir and not newcomer:
            path = resume(shard.zero, args.checkpoint_dir, progress, scaler)
            if path is None:   # step 0: there is always a checkpoint to go back to
                save_step(shard.zero, args.checkpoint_dir, progress, scaler)
            elif comm.rank == 0:
                print(f"# resumed from {path}: step {progress.step} (epoch "
                      f"{progress.epoch + 1}, sample {progress.offset}) on {comm.size} "
                      f"rank(s)", flush=True)
        sums = {"loss": 0.0, "correct": 0, "seen": 0}
        start = time.perf_counter()
        while progress.epoch < args.epochs:
            try:
                comm, regrouped = shard.comm, False
                shard.sampler.set_epoch(progress.epoch)
                mine = shard.sampler.indices(start=progress.offset)
                local_batch = shard.local_batch
                for step in range(len(mine) // local_batch):
                    if world_rank == args.kill_rank and progress.step == args.kill_step:
                        os.kill(os.getpid(), signal.SIGKILL)
                    batch = xp.asarray(mine[step * local_batch:(step + 1) * local_batch])
                    loss, hits, _ = loss_and_grads(
                        params, x_train_dev[batch], y_train_dev[batch], xp, on_grad=shard.hook,
                        scale=scaler.scale if scaler else 1.0)
                    shard.step(params, optimizer, scaler)
                    progress.offset += local_batch * comm.size
                    progress.step += 1
                    sums["loss"] += loss * local_batch
                    sums["correct"] += hits
                    sums["seen"] += local_batch
                    if args.checkpoint_dir and progress.step % args.checkpoint_every == 0:
                        save_step(shard.zero, args.checkpoint_dir, progress, scaler)
                    if args.elastic and progress.step % args.grow_every == 0:
                        bigger = comm.grow(min_size=args.wait_for_ranks)
                        if bigger is not comm:   # newcomers: new shards of the rest
                            shard = _welcome(shard, bigger, params, velocity, progress,
                                             scaler, args, len(x_train))
                            regrouped = True
                            break
                if regrouped:
                    continue
                _, test_correct, _ = loss_and_grads(params, x_test_dev, y_test_dev, xp)
                totals = all_reduce_metrics(comm, sums)
            except FAILURES:
                if not args.elastic:
                    raise
                if args.checkpoint_dir:   # back to the checkpoint; this epoch's sums restart
                    shard = _recover_from_checkpoint(shard, params, progress, scaler, args,
                                                     len(x_train))
                    sums = {"loss": 0.0, "correct": 0, "seen": 0}
                else:
                    shard = _recover(shard, params, velocity, progress, args, len(x_train))
                continue
            if comm.rank == 0:
                print(epoch_line(progress.epoch, totals, test_correct / len(x_test), start),
                      flush=True)
            progress.epoch, progress.offset = progress.epoch + 1, 0
            sums = {"loss": 0.0, "correct": 0, "seen": 0}
            start = time.perf_counter()
        if args.checkpoint_dir:   # the end, too (as the start of the next epoch)
            save_step(shard.zero, args.checkpoint_dir, progress, scaler)
        state = shard.zero.state_bytes() if args.zero else optimizer.state_bytes()
        states = all_reduce_metrics(comm, {"state": state}, op="max")
        if comm.rank == 0:
            skipped = f", {scaler.skipped_steps} step(s) skipped by the loss scaler" if scaler else ""
            print(f"# optimizer state per rank: {states['state']} bytes"
                  f"{' (sharded)' if args.zero else ''}{skipped}", flush=True)
    finally:
        (shard.comm if shard is not None else comm).close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
