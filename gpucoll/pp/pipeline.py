"""The pipeline executor: one training step over ``M`` micro-batches on ``P`` stages, one rank
of a communicator per stage (rank ``s`` runs stage ``s``).

Activations go forward and gradients backward. After each action, its output (to one
neighbour) and the next action's input (from one neighbour) go as one ``sendrecv`` (an
``isend`` or ``irecv`` where there is only one of them), the pairing of Megatron's
``send_forward_recv_backward``: on a stream-ordered backend (NCCL), where a send finishes only
once its receiver is at the matching receive, no stage then waits on a neighbour that waits on
it, for either schedule and any number of stages and micro-batches (``tests/test_pp_order.py``
checks the issue order under that rule); the CPU backend progresses both halves on their own
threads, so a send never blocks the schedule there either. Messages carry the tag
``(2 (pass M + m) + direction) mod 2**32`` (``pass`` counts this pipeline's steps and
evaluations, ``m`` the micro-batch, direction 0 forward / 1 backward), so a rank that runs a
different step or schedule from its neighbour fails with ``CollectiveMismatchError`` instead
of reading the wrong micro-batch.

Shapes: every stage's input and output width and the activation dtype are exchanged once,
at construction (one small all-gather), and checked against the neighbours'. Each step's
micro-batch rows are ``batch_size / M`` on every rank: ``step`` takes the batch size from the
inputs or labels it is given, or ``batch_size=`` on stages that see neither. So an activation
is ``(batch_size / M, out_features)`` of the common dtype, known to its receiver without a
header.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..mesh import Mesh
from ..types import dtype_from_code, wire_code
from .layers import softmax_cross_entropy
from .schedule import SCHEDULES, schedule_actions
from .stage import Stage

__all__ = ["Pipeline", "pipeline_groups"]

FORWARD, BACKWARD = 0, 1


def _rows(value: Any, name: str) -> Optional[int]:
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if not shape:
        raise ValueError(f"{name} must be an array with a batch dimension, got {shape!r}")
    return int(shape[0])


def _finished(work: Any) -> bool:
    """True when a send has finished (raising its error if it failed), so its array may go."""
    return work.is_completed() and work.wait()


class Pipeline:
    """Runs ``stage`` as stage ``comm.rank`` of a ``comm.size``-stage pipeline.

    Args:
        comm: the pipeline's communicator; rank ``s`` is stage ``s``.
        stage: this rank's :class:`Stage`.
        micro_batches: M >= 1; each step's batch is split into M equal micro-batches.
        schedule: ``"1f1b"`` (default) or ``"gpipe"`` (see ``gpucoll.pp.schedule``).
        loss_fn: the last stage's ``loss_fn(logits, labels, scale) -> (loss_sum, correct,
            grad)``; default softmax cross-entropy.

    Raises:
        ValueError: M < 1, an unknown schedule, the stage's ``index`` / ``stages`` not this
            rank / the communicator size, or (on every rank) neighbouring stages whose widths
            or dtypes differ, naming the stages and the numbers.

    Gradients: each micro-batch's loss gradient is scaled by ``1 / batch_size``, and the
    stage sums the micro-batches' parameter gradients, so after ``step`` the stage's
    ``grads`` are the gradients of the whole batch's mean loss, as the unsplit model gives.

    Example (two ranks, one per stage)::

        params = init_params([64, 128, 128, 10], seed=0)          # the same on both ranks
        stage = Stage(mlp_layers(params, comm.size)[comm.rank])
        pipe = Pipeline(comm, stage, micro_batches=4, schedule="1f1b")
        loss = pipe.step(x, y)          # the mean loss on the last stage, None elsewhere
        for index, (p, g) in enumerate(zip(stage.params, stage.grads)):
            optimizer.update(index, p, g)
    """

    def __init__(self, comm, stage: Stage, *, micro_batches: int, schedule: str = "1f1b",
                 loss_fn: Callable = softmax_cross_entropy):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                or micro_batches < 1):
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        if not isinstance(stage, Stage):
            raise TypeError(f"stage must be a gpucoll.pp.Stage, got {type(stage).__name__}")
        if stage.stages is not None and stage.stages != comm.size:
            raise ValueError(f"a pipeline of {stage.stages} stages needs a communicator of "
                             f"{stage.stages} ranks (one per stage), got {comm.size}")
        if stage.index is not None and stage.index != comm.rank:
            raise ValueError(f"stage {stage.index} must run on rank {stage.index} of the "
                             f"pipeline's communicator, not on rank {comm.rank}")
        self.comm, self.stage, self.loss_fn = comm, stage, loss_fn
        self.micro_batches, self.schedule = micro_batches, schedule
        self.index, self.stages = comm.rank, comm.size
        self.is_first, self.is_last = self.index == 0, self.index == self.stages - 1
        self.actions = schedule_actions(schedule, self.index, self.stages, micro_batches)
        self.correct = 0       # the last stage's correct predictions in the last step
        self._passes = 0
        self._check_neighbours()
        # NCCL connects two ranks inside their first send/receive and GPipe's first receive
        # from the next stage comes grouped after sends that stage must take first: connect
        # both ways with both neighbours now, all stages at once (tests/test_pp_order.py)
        comm.connect_peers({self.index - 1, self.index + 1} & set(range(self.stages)))

    # ------------------------------------------------------------------ construction checks
    def _check_neighbours(self) -> None:
        """All-gather (in, out, dtype) of every stage; compare each with the next one."""
        mine = np.array([self.stage.in_features, self.stage.out_features,
                         wire_code(self.stage.dtype)], dtype=np.int64)
        if self.stages == 1:
            return
        table = self.comm.all_gather(self.stage.xp.asarray(mine))
        table = table.get() if hasattr(table, "get") else np.asarray(table)
        for s in range(self.stages - 1):
            out_features, in_features = int(table[s][1]), int(table[s + 1][0])
            if out_features != in_features:
                raise ValueError(f"pipeline stages do not fit: stage {s} gives {out_features} "
                                 f"features, stage {s + 1} takes {in_features}")
            left, right = (dtype_from_code(int(table[s][2])),
                           dtype_from_code(int(table[s + 1][2])))
            if left != right:
                raise ValueError(f"pipeline stages do not fit: stage {s} sends {left}, stage "
                                 f"{s + 1} expects {right}")

    # ------------------------------------------------------------------ step checks
    def _batch_rows(self, inputs: Any, labels: Any, batch_size: Optional[int]) -> int:
        """The batch size every rank agrees on; ValueError before anything is sent."""
        known = {"inputs": _rows(inputs, "inputs"), "labels": _rows(labels, "labels"),
                 "batch_size": batch_size}
        given = {name: rows for name, rows in known.items() if rows is not None}
        if self.is_first and inputs is None:
            raise ValueError("stage 0 needs the inputs")
        if self.is_last and labels is None:
            raise ValueError(f"the last stage ({self.index}) needs the labels")
        if not given:
            raise ValueError(f"stage {self.index} needs batch_size= (it gets neither inputs "
                             f"nor labels)")
        if len(set(given.values())) > 1:
            raise ValueError(f"stage {self.index}: batch sizes differ: " + ", ".join(
                f"{name} {rows}" for name, rows in given.items()))
        rows = next(iter(given.values()))
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {rows!r}")
        if rows % self.micro_batches:
            raise ValueError(f"a batch of {rows} rows does not split into {self.micro_batches} "
                             f"equal micro-batches (batch_size must be a multiple of "
                             f"micro_batches)")
        if self.is_first and (inputs.ndim != 2 or inputs.shape[1] != self.stage.in_features):
            raise ValueError(f"stage 0: inputs must have shape (rows, {self.stage.in_features}),"
                             f" got {inputs.shape}")
        if self.is_last and labels.ndim != 1:
            raise ValueError(f"labels must have shape ({rows},), got {labels.shape}")
        return int(rows)

    # ------------------------------------------------------------------ running
    def step(self, inputs: Any = None, labels: Any = None, *,
             batch_size: Optional[int] = None) -> Optional[float]:
        """One training step: forwards and backwards of every micro-batch, in the schedule's
        order. Stage 0 reads ``inputs`` (rows, in_features); the last stage reads ``labels``
        (rows,); other stages need only the row count (from either, or ``batch_size``).

        Returns:
            The whole batch's mean loss on the last stage, None on the others. The stage's
            ``grads`` hold this step's gradients (see the class doc); ``correct`` the last
            stage's correct predictions.

        Raises:
            ValueError: bad inputs (before anything is sent).
            GpucollError: a neighbour failed or timed out; this rank aborts its
                communicator on any error so that the others learn it at once.
        """
        rows = self._batch_rows(inputs, labels, batch_size)
        self.stage.zero_grad()
        self.stage.reset_peak()
        return self._run(self.actions, inputs, labels, rows)[0]

    def evaluate(self, inputs: Any = None, labels: Any = None, *,
                 batch_size: Optional[int] = None) -> Tuple[Optional[float], Optional[int]]:
        """Forwards only (nothing kept for backward): ``(mean loss, correct)`` on the last
        stage, ``(None, None)`` elsewhere. Same arguments and checks as :meth:`step`."""
        rows = self._batch_rows(inputs, labels, batch_size)
        loss, correct = self._run([("F", m) for m in range(self.micro_batches)], inputs, labels,
                                  rows, training=False)
        return loss, correct

    def _tag(self, micro_batch: int, direction: int) -> int:
        return (2 * (self._passes * self.micro_batches + micro_batch) + direction) % 2 ** 32

    def _run(self, actions: List[Tuple[str, int]], inputs: Any, labels: Any, rows: int,
             training: bool = True):
        stage, xp, comm = self.stage, self.stage.xp, self.comm
        rows_per = rows // self.micro_batches
        scale = 1.0 / rows
        prev, nxt = self.index - 1, self.index + 1
        loss_grads: Dict[int, Any] = {}             # last stage: loss gradient per micro-batch
        sends: List[Tuple[Any, Any]] = []           # (Work, array kept alive until sent)
        loss_sum, correct = 0.0, 0

        def incoming(action: Optional[Tuple[str, int]]):
            """(peer, buffer, tag) of what ``action`` receives before it runs, or None."""
            if action is None:
                return None
            kind, m = action
            if kind == "F" and not self.is_first:
                return (prev, xp.empty((rows_per, stage.in_features), dtype=stage.dtype),
                        self._tag(m, FORWARD))
            if kind == "B" and not self.is_last:
                return (nxt, xp.empty((rows_per, stage.out_features), dtype=stage.dtype),
                        self._tag(m, BACKWARD))
            return None

        def exchange(outgoing, action: Optional[Tuple[str, int]]):
            """Post this action's output and the next action's input as one operation; the
            (Work, buffer) of that input, or None."""
            want = incoming(action)
            if outgoing is not None:
                array, peer, tag = outgoing
                array = xp.ascontiguousarray(array, dtype=stage.dtype)
                if want is None:
                    sends.append((comm.isend(array, peer, tag=tag), array))
                    return None
                src, buffer, recv_tag = want
                work = comm.sendrecv(array, peer, buffer, src, tag=tag, recv_tag=recv_tag,
                                     async_op=True)
                sends.append((work, array))
                return work, buffer
            if want is None:
                return None
            src, buffer, recv_tag = want
            return comm.irecv(buffer, src, tag=recv_tag), buffer

        def take(pending) -> Any:
            work, buffer = pending
            work.wait()
            return buffer

        try:
            pending = exchange(None, actions[0] if actions else None)
            for index, (kind, m) in enumerate(actions):
                received = take(pending) if pending is not None else None
                outgoing = None
                if kind == "F":
                    if self.is_first:
                        x = xp.ascontiguousarray(
                            xp.asarray(inputs[m * rows_per:(m + 1) * rows_per]), dtype=stage.dtype)
                    else:
                        x = received
                    y = stage.forward(x) if training else stage.predict(x)
                    if self.is_last:
                        batch_labels = xp.asarray(labels[m * rows_per:(m + 1) * rows_per])
                        loss, hits, grad = self.loss_fn(y, batch_labels, scale)
                        loss_sum, correct = loss_sum + loss, correct + hits
                        if training:
                            loss_grads[m] = grad
                    else:
                        outgoing = (y, nxt, self._tag(m, FORWARD))
                else:
                    grad = loss_grads.pop(m) if self.is_last else received
                    grad_input = stage.backward(grad)
                    if not self.is_first:
                        outgoing = (grad_input, prev, self._tag(m, BACKWARD))
                following = actions[index + 1] if index + 1 < len(actions) else None
                pending = exchange(outgoing, following)
                sends = [entry for entry in sends if not _finished(entry[0])]
            for work, _ in sends:
                work.wait()
        except BaseException:
            stage.clear()
            try:
                comm.abort()   # the neighbours fail now rather than at their timeout
            except Exception:
                pass
            raise
        finally:
            self._passes += 1
        if not self.is_last:
            return None, None
        if training:
            self.correct = correct
        return loss_sum / rows, correct


def pipeline_groups(comm, stages: int):
    """Split ``comm`` into ``comm.size / stages`` pipelines of ``stages`` ranks and the
    data-parallel groups across them: world rank ``r`` runs stage ``r % stages`` of replica
    ``r // stages``: the axes ``pp`` and ``dp`` of a :class:`gpucoll.Mesh`.

    Returns:
        ``(pipe_comm, dp_comm)``: this rank's pipeline (rank = stage) and the ranks holding
        the same stage in the other replicas (average the stage's gradients there).

    Raises:
        ValueError: ``stages`` does not divide the communicator size (before any split).
    """
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if comm.size % stages:
        raise ValueError(f"{stages} stages do not divide the {comm.size} ranks into pipelines")
    mesh = Mesh(comm, dp=comm.size // stages, pp=stages)
    return mesh["pp"], mesh["dp"]
