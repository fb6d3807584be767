"""Context-parallel training: one causal attention layer learns a whole-sequence task.

Run with::

    gpucoll run -n 2 -m gpucoll.examples.train_cp [--layer ring|ulysses] [--sharding zigzag]
    python -m gpucoll.examples.train_cp              # one process: the same losses

The task: every sequence of ``--seq`` tokens over 8 symbols favours one of them (drawn with
probability 0.3, each other symbol 0.1), and every position must name the favoured symbol. The
token at a position alone is right 30 % of the time; the most frequent token so far, the best
guess there is, about 80 % of the time over 64 tokens. So the model gets better only by
attending back across the sequence, to tokens that other ranks hold.

The model: token embedding plus fixed sinusoidal features of each token's global position
(``sequence_positions``), one causal self-attention layer (q/k/v/o projections; ``--kv-heads``
below ``--heads`` for grouped-query attention), a residual and a linear read-out, trained with
Adam on a fresh batch each step. Every rank draws the same batch from the seed and keeps its
``seq / world_size`` tokens (``shard_sequence``). The attention layer (``RingAttention`` or
``UlyssesAttention``) brings in what the other ranks' tokens contribute, forward and backward;
the weights are replicated, so their gradients, summed over this rank's tokens, need one
``all_reduce`` per step over the group. A run on any number of ranks therefore follows the run on
one, up to rounding. Rank 0 prints the loss every few steps, then the accuracy on a held-out
batch and the bytes this rank sent per step.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, Optional

import numpy as np

from gpucoll.cp import (RingAttention, UlyssesAttention, sequence_positions, sequence_segments,
                        shard_sequence)
from gpucoll.cp.sharding import SHARDINGS
from gpucoll.ddp import all_reduce_metrics, make_optimizer
from gpucoll.examples.train_digits import _array_module, _init
from gpucoll.pp.layers import softmax_cross_entropy

__all__ = ["make_batch", "position_features", "init_params", "forward", "backward", "main"]

VOCAB, FAVOURED_PROBABILITY = 8, 0.3
HELD_OUT_SEQUENCES = 64     # the final accuracy's batch: large enough to be a fair estimate
LAYERS = {"ring": RingAttention, "ulysses": UlyssesAttention}


def make_batch(rng: np.random.Generator, batch: int, seq: int):
    """Tokens ``(batch, seq)`` and each sequence's favoured symbol ``(batch,)``."""
    favoured = rng.integers(0, VOCAB, batch)
    probabilities = np.full((batch, VOCAB), (1 - FAVOURED_PROBABILITY) / (VOCAB - 1))
    probabilities[np.arange(batch), favoured] = FAVOURED_PROBABILITY
    cumulative = probabilities.cumsum(axis=1)[:, None, :]
    tokens = (rng.random((batch, seq, 1)) > cumulative).sum(axis=2)     # inverse CDF
    return np.minimum(tokens, VOCAB - 1), favoured


def position_features(positions: np.ndarray, width: int) -> np.ndarray:
    """Sinusoidal features of global positions (Vaswani et al.): ``(len(positions), width)``."""
    frequencies = 1.0 / 10000 ** (np.arange(0, width, 2) / width)
    angles = positions[:, None] * frequencies[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def init_params(args, xp: Any, dtype: Any) -> Dict[str, Any]:
    """The replicated weights, the same on every rank (drawn from the seed)."""
    rng = np.random.default_rng([args.seed, 0])
    query_width, kv_width = args.heads * args.head_dim, args.kv_heads * args.head_dim
    shapes = {"embedding": (VOCAB, args.width), "query": (args.width, query_width),
              "key": (args.width, kv_width), "value": (args.width, kv_width),
              "output": (query_width, args.width), "readout": (args.width, VOCAB)}
    params = {name: xp.asarray(rng.normal(0.0, shape[0] ** -0.5, shape), dtype=dtype)
              for name, shape in shapes.items()}
    params["readout_bias"] = xp.zeros(VOCAB, dtype=dtype)
    return params


def forward(params: Dict[str, Any], tokens: Any, position_encoding: Any, attention, heads: int,
            xp: Any):
    """Logits ``(batch, local_seq, VOCAB)`` of this rank's tokens, and what backward needs."""
    batch, local = tokens.shape
    one_hot = xp.eye(VOCAB, dtype=position_encoding.dtype)[tokens]
    x = one_hot @ params["embedding"] + position_encoding
    q, k, v = (x @ params[name] for name in ("query", "key", "value"))
    head_dim = q.shape[-1] // heads
    attended = attention.forward(q.reshape(batch, local, heads, head_dim),
                                 k.reshape(batch, local, -1, head_dim),
                                 v.reshape(batch, local, -1, head_dim)).reshape(batch, local, -1)
    hidden = x + attended @ params["output"]
    logits = hidden @ params["readout"] + params["readout_bias"]
    return logits, dict(one_hot=one_hot, x=x, attended=attended, hidden=hidden,
                        head_dim=head_dim)


def backward(params: Dict[str, Any], saved: dict, grad_logits: Any, attention) -> Dict[str, Any]:
    """Gradients of every weight from this rank's tokens (still to be summed over the group)."""
    def rows(a):
        return a.reshape(-1, a.shape[-1])

    batch, local, _ = grad_logits.shape
    grads = {"readout": rows(saved["hidden"]).T @ rows(grad_logits),
             "readout_bias": grad_logits.sum(axis=(0, 1))}
    grad_hidden = grad_logits @ params["readout"].T
    grads["output"] = rows(saved["attended"]).T @ rows(grad_hidden)
    grad_attended = grad_hidden @ params["output"].T
    dq, dk, dv = attention.backward(grad_attended.reshape(batch, local, -1, saved["head_dim"]))
    grad_x = grad_hidden
    for name, grad in (("query", dq), ("key", dk), ("value", dv)):
        grad = grad.reshape(batch, local, -1)
        grads[name] = rows(saved["x"]).T @ rows(grad)
        grad_x = grad_x + grad @ params[name].T
    grads["embedding"] = rows(saved["one_hot"]).T @ rows(grad_x)
    return grads


def layout_problem(args, size: int) -> Optional[str]:
    """Why ``args`` cannot be split over ``size`` ranks, or None."""
    try:
        sequence_segments(args.seq, 0, size, args.sharding)
    except ValueError as exc:
        return f"--seq {args.seq}: {exc}"
    if args.layer == "ulysses" and args.heads % size:
        return (f"--layer ulysses spreads the heads over the ranks: --heads {args.heads} must "
                f"be divisible by the {size} ranks")
    if args.layer == "ulysses" and args.kv_heads % size and size % args.kv_heads:
        return (f"--layer ulysses needs --kv-heads {args.kv_heads} to be a multiple or a divisor "
                f"of the {size} ranks (--layer ring takes any)")
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", choices=sorted(LAYERS), default="ring")
    parser.add_argument("--sharding", choices=SHARDINGS, default="zigzag")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (all ranks)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--heads", type=int, default=4, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (divides --heads)")
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--width", type=int, default=32, help="embedding width (even)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="use NumPy even when CuPy works")
    args = parser.parse_args(argv)
    for name in ("seq", "batch", "heads", "kv_heads", "head_dim", "width", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.width % 2:
        parser.error(f"--width {args.width} must be even (sine and cosine features)")

    xp = _array_module(args.cpu)
    dtype = np.dtype(args.dtype)
    with _init(xp is np) as comm:
        problem = layout_problem(args, comm.size)
        if problem:
            parser.error(problem)       # on every rank, before anything is sent
        attention = LAYERS[args.layer](comm, causal=True, sharding=args.sharding)
        params = init_params(args, xp, dtype)
        optimizer = make_optimizer("adam", lr=args.lr)
        position_encoding = xp.asarray(position_features(
            sequence_positions(args.seq, comm.rank, comm.size, args.sharding), args.width),
            dtype=dtype)
        data = np.random.default_rng([args.seed, 1])     # the same batches on every rank

        def local_batch(sequences):
            tokens, favoured = make_batch(data, sequences, args.seq)
            mine = shard_sequence(tokens, comm.rank, comm.size, args.sharding)
            labels = np.repeat(favoured[:, None], mine.shape[1], axis=1)
            return xp.asarray(mine), xp.asarray(labels.reshape(-1)), tokens, favoured

        if comm.rank == 0:
            print(f"# context parallel: {comm.size} rank(s), {args.layer} attention, "
                  f"{args.sharding} sharding, {args.seq} tokens ({args.seq // comm.size} per "
                  f"rank), {args.heads} heads / {args.kv_heads} key-value heads, {args.dtype}, "
                  f"arrays {xp.__name__}", flush=True)
        tokens_per_step = args.batch * args.seq
        report_every = max(1, args.steps // 5)
        window = {"loss": 0.0, "correct": 0, "steps": 0}     # since the last printed line
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            tokens, labels, _, _ = local_batch(args.batch)
            logits, saved = forward(params, tokens, position_encoding, attention, args.heads, xp)
            loss, correct, grad_logits = softmax_cross_entropy(
                logits.reshape(-1, VOCAB), labels, 1.0 / tokens_per_step)
            grads = backward(params, saved, grad_logits.reshape(logits.shape), attention)
            step_bytes = dict(attention.sent_bytes)     # this step's forward and backward
            flat = comm.all_reduce(xp.concatenate([grads[name].ravel() for name in params]))
            offset = 0
            for index, param in enumerate(params.values()):
                optimizer.update(index, param, flat[offset:offset + param.size]
                                 .reshape(param.shape))
                offset += param.size
            window["loss"] += loss
            window["correct"] += correct
            window["steps"] += 1
            if step % report_every == 0 or step == args.steps:
                totals = all_reduce_metrics(comm, {"loss": window["loss"],
                                                   "correct": window["correct"]})
                seen = window["steps"] * tokens_per_step
                if comm.rank == 0:
                    print(f"step {step:4d}  loss {totals['loss'] / seen:.10f}  "
                          f"accuracy {totals['correct'] / seen:.4f}", flush=True)
                window = {"loss": 0.0, "correct": 0, "steps": 0}
        seconds = time.perf_counter() - start
        tokens, labels, all_tokens, favoured = local_batch(HELD_OUT_SEQUENCES)   # never trained on
        logits, _ = forward(params, tokens, position_encoding, attention, args.heads, xp)
        hits = int((logits.reshape(-1, VOCAB).argmax(axis=1) == labels).sum())
        accuracy = all_reduce_metrics(comm, {"correct": hits})["correct"] / all_tokens.size
        token_alone = float((all_tokens == favoured[:, None]).mean())
        counts_so_far = np.cumsum(np.eye(VOCAB, dtype=np.int64)[all_tokens], axis=1)
        best = float((counts_so_far.argmax(axis=2) == favoured[:, None]).mean())
        if comm.rank == 0:
            print(f"final accuracy {accuracy:.4f} on a held-out batch (chance {1 / VOCAB:.3f}, "
                  f"the token alone {token_alone:.3f}, the most frequent token so far "
                  f"{best:.3f}); sent_bytes per step "
                  f"{sum(step_bytes.values())} in attention (forward {step_bytes['forward']}, "
                  f"backward {step_bytes['backward']}) and {flat.nbytes} of "
                  f"gradients all-reduced; {seconds:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
