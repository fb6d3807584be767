"""Data-parallel training of a small MLP on scikit-learn's digits (8x8 images, 10 classes).

Run with::

    gpucoll run -n 2 -m gpucoll.examples.train_digits [--epochs 10] [--compression bf16]
    gpucoll run -n 3 -m gpucoll.examples.train_digits --zero [--optimizer adam] [--loss-scaling]
    python -m gpucoll.examples.train_digits          # one process

Forward and backward are written with the array module: CuPy when it is installed and a GPU
is present (``--cpu`` forces NumPy), NumPy otherwise. Each rank takes a disjoint shard of every
global batch (``DistributedSampler``); gradients are averaged by the ``Bucketer``, which starts
each bucket's all-reduce from inside backward as soon as its gradients exist. Rank 0 prints the
global loss and the train / test accuracy per epoch. ``--zero`` replaces the Bucketer and
the local optimizer with the ``ShardedOptimizer`` (ZeRO-1: reduce-scatter, update this rank's
shard, all-gather), and prints the optimizer state each rank holds. ``--loss-scaling`` scales the
loss with a ``DynamicLossScaler`` and skips steps whose gradients overflowed. The dataset ships with scikit-learn (no
download): ``pip install 'gpucoll[examples]'``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, List, Optional

import numpy as np

import gpucoll
from gpucoll.ddp import (Bucketer, DistributedSampler, DynamicLossScaler, ShardedOptimizer,
                         all_reduce_metrics, broadcast_parameters, make_optimizer)


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


def _array_module(force_cpu: bool):
    if not force_cpu:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return cupy
        except Exception:
            pass
    return np


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """Standardized digits features, split into train and test sets (same on every rank)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise SystemExit("this example needs scikit-learn: pip install 'gpucoll[examples]'") from exc
    data = load_digits()
    x = data.data.astype(np.float32) / 16.0
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(axis=0), x[train].std(axis=0) + 1e-6
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def _init(force_cpu: bool):
    """The launcher's communicator, or a one-rank one when started without a launcher."""
    try:
        return gpucoll.init(backend="cpu" if force_cpu else None)
    except ValueError:  # no rank / world size in the environment: a single process
        import tempfile

        store = tempfile.mkdtemp(prefix="gpucoll-digits-")
        return gpucoll.init(backend="cpu", rank=0, world_size=1, url=f"file://{store}/store")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--compression", choices=["none", "bf16", "fp16"], default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="use NumPy even when CuPy works")
    parser.add_argument("--zero", action="store_true",
                        help="shard the optimizer state across ranks (ZeRO-1)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--loss-scaling", action="store_true",
                        help="dynamic loss scaling (skip steps that overflow)")
    args = parser.parse_args(argv)
    if args.zero and args.compression != "none":
        parser.error("--compression applies to the Bucketer, not to --zero")
    settings = {"lr": args.lr} if args.optimizer == "sgd" else {"lr": args.lr / 50}

    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    with _init(xp is np) as comm:
        if args.batch_size % comm.size:
            raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the "
                             f"{comm.size} ranks")
        local_batch = args.batch_size // comm.size
        params = init_params([64, args.hidden, args.hidden, 10], seed=args.seed + comm.rank, xp=xp)
        broadcast_parameters(comm, params, root=0)   # every rank starts from rank 0's weights
        scaler = DynamicLossScaler(init_scale=2.0 ** 12, growth_interval=100) \
            if args.loss_scaling else None
        if args.zero:
            zero = ShardedOptimizer(comm, params, args.optimizer, first_bucket_cap_bytes=64 << 10,
                                    **settings)
            hook, n_buckets = zero.mark_ready, len(zero.buckets)
        else:
            optimizer = make_optimizer(args.optimizer, **settings)
            bucketer = Bucketer(comm, params, first_bucket_cap_bytes=64 << 10,
                                compression=None if args.compression == "none" else
                                args.compression)
            hook, n_buckets = bucketer.mark_ready, len(bucketer.buckets)
        sampler = DistributedSampler(len(x_train), comm, seed=args.seed, drop_last=True)
        x_train_dev, y_train_dev = xp.asarray(x_train), xp.asarray(y_train)
        x_test_dev, y_test_dev = xp.asarray(x_test), xp.asarray(y_test)
        if comm.rank == 0:
            print(f"# digits: {len(x_train)} train / {len(x_test)} test, {comm.size} rank(s), "
                  f"backend {comm.backend}, arrays {xp.__name__}, global batch {args.batch_size}, "
                  f"{n_buckets} bucket(s), compression {args.compression}, optimizer "
                  f"{args.optimizer}{' sharded (ZeRO-1)' if args.zero else ''}")
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            mine = sampler.indices()
            steps = len(mine) // local_batch
            start = time.perf_counter()
            loss_sum, correct, seen = 0.0, 0, 0
            for step in range(steps):
                batch = xp.asarray(mine[step * local_batch:(step + 1) * local_batch])
                scale = scaler.scale if scaler else 1.0
                loss, hits, grads = loss_and_grads(params, x_train_dev[batch], y_train_dev[batch],
                                                   xp, on_grad=hook, scale=scale)
                if args.zero:
                    zero.step(scaler=scaler)
                else:
                    grads = bucketer.finish(loss_scale=scaler.scale if scaler else None)
                    if scaler is None or scaler.update(bucketer.found_nonfinite()):
                        for index, (param, grad) in enumerate(zip(params, grads)):
                            optimizer.update(index, param, grad)
                loss_sum += loss * local_batch
                correct += hits
                seen += local_batch
            _, test_correct, _ = loss_and_grads(params, x_test_dev, y_test_dev, xp)
            totals = all_reduce_metrics(comm, {"loss": loss_sum, "correct": correct,
                                               "seen": seen})
            if comm.rank == 0:
                print(f"epoch {epoch + 1:3d}  loss {totals['loss'] / totals['seen']:.4f}  "
                      f"train acc {totals['correct'] / totals['seen']:.4f}  "
                      f"test acc {test_correct / len(x_test):.4f}  "
                      f"({time.perf_counter() - start:.2f} s)", flush=True)
        state = zero.state_bytes() if args.zero else optimizer.state_bytes()
        states = all_reduce_metrics(comm, {"state": state}, op="max")
        if comm.rank == 0:
            skipped = f", {scaler.skipped_steps} step(s) skipped by the loss scaler" if scaler else ""
            print(f"# optimizer state per rank: {states['state']} bytes"
                  f"{' (sharded)' if args.zero else ''}{skipped}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
