"""Fully sharded data parallelism (ZeRO-3 / FSDP): an MLP on scikit-learn's digits.

Run with::

    gpucoll run -n 2 -m gpucoll.examples.train_fsdp [--epochs 10] [--compute-dtype bf16]
        [--max-norm 1.0] [--checkpoint-dir ckpt] [--replicas R]

Every rank keeps 1 / world_size of each layer's parameters, gradients and Adam or SGD state
(``gpucoll.ddp.FullyShardedParameters``, one unit per linear layer). Forward gathers a layer
just before it computes and prefetches the next one meanwhile; backward gathers each layer
again, releases it, and reduce-scatters its gradients while the layers below are still being
differentiated. At most two layers are whole on a rank at any time. ``--compute-dtype bf16``
gathers and reduces in bfloat16 (half the bytes) while the master slices stay float32; the
arithmetic here runs in float32 either way. Rank 0 prints the loss, the accuracy and the bytes
each rank holds against what an unsharded replica would. ``--max-norm`` clips the gradients
to a global norm (their slices' squares summed over the ranks). ``--checkpoint-dir D`` saves
the sharded state to ``D/step-N`` after every epoch and resumes from the newest there, at any
number of ranks. ``--replicas R`` is hybrid sharding (HSDP): ``Mesh(comm, replicate=R,
shard=-1)``, each layer sharded over the ranks of one shard group and each slice's gradient
averaged across the ``R`` groups.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any, List

import numpy as np

from gpucoll.ddp import DistributedSampler, FullyShardedParameters, all_reduce_metrics
from gpucoll import Mesh
from gpucoll.examples.checkpointing import resume, save_step
from gpucoll.examples.train_digits import (_array_module, _init, add_common_arguments, epoch_line,
                                           init_params, load_digits_split)
from gpucoll.pp.layers import softmax_cross_entropy

__all__ = ["fsdp_loss_and_grads", "fsdp_logits", "main"]


def _weights(fsdp: FullyShardedParameters, layer: int, xp: Any, prefetch: int) -> List[Any]:
    """Layer ``layer`` gathered (float32 for the arithmetic), ``prefetch`` already on its way."""
    views = fsdp.gather(layer)
    if 0 <= prefetch < fsdp.units:
        fsdp.gather(prefetch, async_op=True)
    return [v.astype(xp.float32, copy=False) for v in views]


def fsdp_logits(fsdp: FullyShardedParameters, x: Any, xp: Any = np, *,
                keep: bool = False) -> tuple:
    """Forward through the units as linear layers (ReLU between): the logits and the layer
    inputs backward needs. Each layer is released once used, except the last one when
    ``keep`` (backward starts with it)."""
    inputs, h = [], x
    layers = fsdp.units
    for layer in range(layers):
        w, b = _weights(fsdp, layer, xp, layer + 1)
        inputs.append(h)
        h = h @ w + b
        if layer < layers - 1:
            h = xp.maximum(h, 0)
        if layer < layers - 1 or not keep:
            fsdp.release(layer)
    return h, inputs


def fsdp_loss_and_grads(fsdp: FullyShardedParameters, x: Any, y: Any, xp: Any = np, *,
                        scale: float = 1.0, track: List[int] = None) -> tuple:
    """One forward and backward of the batch: returns the summed loss and the correct count;
    each unit's gradients (of ``scale`` times the mean loss) are reduce-scattered as soon as
    they exist. ``track`` collects how many units were whole after each gather."""
    logits, inputs = fsdp_logits(fsdp, x, xp, keep=True)
    loss, correct, delta = softmax_cross_entropy(logits, y, scale / x.shape[0])
    for layer in reversed(range(fsdp.units)):
        w, _ = _weights(fsdp, layer, xp, layer - 1)
        if track is not None:
            track.append(len(fsdp.gathered_units))
        grads = [inputs[layer].T @ delta, delta.sum(axis=0)]
        if layer > 0:
            delta = (delta @ w.T) * (inputs[layer] > 0)
        fsdp.release(layer)
        fsdp.reduce_gradients(layer, [g.astype(fsdp.compute_dtype) for g in grads])
    return loss, correct


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, hidden=256)
    parser.add_argument("--layers", type=int, default=3, help="linear layers (>= 2)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--compute-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="dtype of the gathers and gradient reductions")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="gradient accumulation: micro-batches per step (each unit is "
                             "reduce-scattered once per micro-batch)")
    parser.add_argument("--max-norm", type=float, default=None,
                        help="clip the gradients to this global norm")
    parser.add_argument("--checkpoint-dir", default=None, metavar="D",
                        help="save to D/step-N after every epoch; resume from the newest there")
    parser.add_argument("--replicas", type=int, default=1, metavar="R",
                        help="hybrid sharding: shard over size / R ranks, replicate R times")
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error(f"--replicas must be at least 1, got {args.replicas}")
    if args.max_norm is not None and not args.max_norm > 0:
        parser.error(f"--max-norm must be > 0, got {args.max_norm}")
    if args.layers < 2:
        parser.error("--layers must be at least 2")
    if args.micro_batches < 1:
        parser.error("--micro-batches must be at least 1")
    compute = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}[args.compute_dtype]

    xp = _array_module(args.cpu)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed, data=args.data)
    with _init(xp is np) as comm:
        if args.batch_size % (comm.size * args.micro_batches):
            raise SystemExit(f"--batch-size {args.batch_size} must divide among the "
                             f"{comm.size} ranks and {args.micro_batches} micro-batch(es)")
        if comm.size % args.replicas:
            raise SystemExit(f"--replicas {args.replicas} must divide the {comm.size} ranks")
        mesh = Mesh(comm, replicate=args.replicas, shard=-1) if args.replicas > 1 else None
        shard, replicate = (mesh["shard"], mesh["replicate"]) if mesh else (comm, None)
        sizes = [64] + [args.hidden] * (args.layers - 1) + [10]
        params = init_params(sizes, seed=args.seed, xp=xp)
        settings = {"lr": args.lr} if args.optimizer == "sgd" else {"lr": args.lr / 50}
        fsdp = FullyShardedParameters(shard, [params[i:i + 2] for i in range(0, len(params), 2)],
                                      args.optimizer, compute_dtype=compute,
                                      replicate_comm=replicate, **settings)
        # an unsharded replica holds parameters, gradients and the optimizer's state slots
        slots = 1 if args.optimizer == "sgd" else 2
        replica = (2 + slots) * sum(int(p.nbytes) for p in params)
        del params   # from here on this rank holds only its slices
        sampler = DistributedSampler(len(x_train), comm, seed=args.seed, drop_last=True)
        local = args.batch_size // comm.size
        x_dev, y_dev = xp.asarray(x_train), xp.asarray(y_train)
        if comm.rank == 0:
            print(f"# digits, fully sharded: {comm.size} ranks ({args.replicas} replica(s) of "
                  f"{fsdp.comm.size}), layers {sizes}, optimizer "
                  f"{args.optimizer}, compute dtype {fsdp.compute_dtype.name}, arrays "
                  f"{xp.__name__}", flush=True)
        progress = SimpleNamespace(epoch=0, offset=0, step=0)
        if args.checkpoint_dir:
            path = resume(fsdp, args.checkpoint_dir, progress)
            if path is not None and comm.rank == 0:
                print(f"# resumed from {path}: epoch {progress.epoch + 1} on {comm.size} "
                      f"rank(s)", flush=True)
        whole: list = []   # stays empty when a resumed run has no epoch left
        for epoch in range(progress.epoch, args.epochs):
            sampler.set_epoch(epoch)
            mine = sampler.indices()
            start = time.perf_counter()
            loss_sum, correct, seen, whole = 0.0, 0, 0, []
            for step in range(len(mine) // local):
                rows = xp.asarray(mine[step * local:(step + 1) * local])
                # the loss is each rank's mean (over its micro-batches, each scaled by 1 / their
                # number): step() averages the ranks' summed gradients
                for part in xp.split(rows, args.micro_batches):
                    loss, hits = fsdp_loss_and_grads(fsdp, x_dev[part], y_dev[part], xp,
                                                     scale=1 / args.micro_batches, track=whole)
                    loss_sum, correct = loss_sum + loss, correct + hits
                fsdp.step(max_norm=args.max_norm)
                seen += len(rows)
            totals = all_reduce_metrics(comm, {"loss": loss_sum, "correct": correct,
                                               "seen": seen})
            logits, _ = fsdp_logits(fsdp, xp.asarray(x_test), xp)
            test = float((logits.argmax(axis=1) == xp.asarray(y_test)).mean())
            if comm.rank == 0:
                print(epoch_line(epoch, totals, test, start), flush=True)
            if args.checkpoint_dir:
                progress.epoch, progress.step = epoch + 1, fsdp.steps
                save_step(fsdp, args.checkpoint_dir, progress)
        held = fsdp.resident_bytes()
        if comm.rank == 0:
            print(f"# bytes per rank: {held} held between steps (parameter and gradient "
                  f"slices, optimizer state) against {replica} in an unsharded replica; at "
                  f"most {max(whole, default=0)} layer(s) whole at once", flush=True)
        if mesh is not None:
            mesh.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
