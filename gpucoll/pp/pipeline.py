"""The pipeline executor: one training step over ``M`` micro-batches on ``P`` stages, one rank
of a communicator per stage (rank ``s`` runs stage ``s``), or, with the interleaved schedule,
``v`` model chunks per rank (rank ``r`` runs chunks ``r, r + P, ..., r + (v - 1) P`` of the
``P v``; chunk ``c`` sends to rank ``(c + 1) mod P``, so the last rank's chunk ``k P + P - 1``
feeds rank 0's chunk ``(k + 1) P``).

Activations go forward and gradients backward. After each action, its output (to one
neighbour) and the next action's input (from one neighbour) go as one ``sendrecv`` (an
``isend`` or ``irecv`` where there is only one of them), the pairing of Megatron's
``send_forward_recv_backward``: on a stream-ordered backend (NCCL), where a send finishes only
once its receiver is at the matching receive, no stage then waits on a neighbour that waits on
it, for GPipe and 1F1B and any number of stages and micro-batches (``tests/test_pp_order.py``
checks the issue order under that rule); the CPU backend progresses both halves on their own
threads, so a send never blocks the schedule there either. The interleaved schedule, issued
that way, deadlocks on NCCL's rule (a rank sends the next chunk's activation to a neighbour
that is still sending it a gradient); it runs instead in the lockstep slots of
``schedule.timetable`` (as torch's multi-stage schedules post one batch per time step): in
each slot a rank runs its action, if any, then posts that action's output together with the
receives of what its two neighbours send it in the same slot, as one operation
(``sendrecv`` or ``batch_isend_irecv``), so every operation's counterparts are in the
neighbours' operations of the same slot. Messages carry the tag
``(2 ((pass v + c // P) M + m) + direction) mod 2**32`` (``pass`` counts this pipeline's
steps and evaluations, ``c`` the chunk whose output goes forward or whose input gradient
comes back, ``m`` the micro-batch, direction 0 forward / 1 backward; ``v = 1``:
``2 (pass M + m) + direction``), so a rank that runs a different step or schedule from its
neighbour fails with ``CollectiveMismatchError`` instead of reading the wrong micro-batch or
chunk.

Shapes: every chunk's input and output width and the activation dtype are exchanged once,
at construction (one small all-gather), and checked against the next chunk's. Each step's
micro-batch rows are ``batch_size / M`` on every rank: ``step`` takes the batch size from the
inputs or labels it is given, or ``batch_size=`` on stages that see neither. So an activation
is ``(batch_size / M, out_features)`` of the common dtype, known to its receiver without a
header.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..batch_p2p import P2POp
from ..mesh import Mesh
from ..types import dtype_from_code, wire_code
from .layers import softmax_cross_entropy
from .schedule import SCHEDULES, schedule_actions, timetable
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
        stage: this rank's :class:`Stage`; with ``schedule="interleaved"``, the list of this
            rank's ``v`` chunks ``[chunk r, chunk r + P, ...]`` (Stages) of the model cut into
            ``P v`` (``mlp_layers(params, P * v)[r::P]``).
        micro_batches: M >= 1; each step's batch is split into M equal micro-batches (a
            multiple of P for the interleaved schedule).
        schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"interleaved"`` (see
            ``gpucoll.pp.schedule``).
        virtual_stages: the chunks per rank ``v``; default: as many as ``stage`` lists.
        loss_fn: the last stage's ``loss_fn(logits, labels, scale) -> (loss_sum, correct,
            grad)``; default softmax cross-entropy.

    Raises:
        ValueError: M < 1, an unknown schedule, several chunks without the interleaved
            schedule, ``virtual_stages`` not the number of chunks, an interleaved M that is not
            a multiple of P or a one-rank interleaved pipeline, a stage's ``index`` /
            ``stages`` not this rank (chunk) / the communicator size (times v), or (on every
            rank) neighbouring stages whose widths or dtypes differ, naming the stages and the
            numbers.
        TypeError: ``stage`` not a Stage (or list of Stages).

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

    Interleaved, two chunks per rank (the model cut into ``2 * comm.size`` chunks)::

        cut = mlp_layers(params, 2 * comm.size)              # chunk c runs on rank c % P
        chunks = [Stage(layers) for layers in cut[comm.rank::comm.size]]
        pipe = Pipeline(comm, chunks, micro_batches=2 * comm.size, schedule="interleaved")
    """

    def __init__(self, comm, stage: Union[Stage, Sequence[Stage]], *, micro_batches: int,
                 schedule: str = "1f1b", virtual_stages: Optional[int] = None,
                 loss_fn: Callable = softmax_cross_entropy):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                or micro_batches < 1):
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        chunks = self._chunks_of(stage, schedule, virtual_stages)
        self.virtual_stages = len(chunks)
        if schedule == "interleaved":
            if comm.size < 2:
                raise ValueError("the interleaved schedule needs a pipeline of 2 ranks or more, "
                                 "got 1 (on one rank, put every layer in one Stage)")
            if micro_batches % comm.size:
                raise ValueError(f"the interleaved schedule needs micro_batches to be a "
                                 f"multiple of the {comm.size} stages, got {micro_batches}")
        total = comm.size * self.virtual_stages
        for k, chunk in enumerate(chunks):
            if chunk.stages is not None and chunk.stages != total:
                raise ValueError(
                    f"a pipeline of {chunk.stages} stages needs a communicator of "
                    f"{chunk.stages} ranks (one per stage), got {comm.size}"
                    if self.virtual_stages == 1 else
                    f"rank {comm.rank}'s chunk {k} belongs to a pipeline of {chunk.stages} "
                    f"chunks, but {comm.size} ranks x {self.virtual_stages} chunks make {total}")
            want = k * comm.size + comm.rank
            if chunk.index is not None and chunk.index != want:
                raise ValueError(
                    f"stage {chunk.index} must run on rank {chunk.index} of the pipeline's "
                    f"communicator, not on rank {comm.rank}" if self.virtual_stages == 1 else
                    f"rank {comm.rank}'s chunk {k} must be the model's chunk {want} (chunk c "
                    f"runs on rank c % {comm.size}), got stage index {chunk.index}")
        self.comm, self.stage, self.chunks, self.loss_fn = comm, stage, chunks, loss_fn
        self.micro_batches, self.schedule = micro_batches, schedule
        self.index, self.stages = comm.rank, comm.size
        self.is_first, self.is_last = self.index == 0, self.index == self.stages - 1
        self.actions = schedule_actions(schedule, self.index, self.stages, micro_batches,
                                        self.virtual_stages)
        if schedule == "interleaved":      # every rank's actions in unit time slots
            self._plan = timetable(schedule, self.stages, micro_batches, self.virtual_stages)
            self._eval_plan = timetable(schedule, self.stages, micro_batches,
                                        self.virtual_stages, training=False)
        else:                              # this rank's actions, as (kind, m, chunk 0)
            self._plan = [(kind, m, 0) for kind, m in self.actions]
            self._eval_plan = [(kind, m, 0) for kind, m in self.actions if kind == "F"]
        self.correct = 0       # the last stage's correct predictions in the last step
        self._passes = 0
        self._check_neighbours()
        # NCCL connects two ranks inside their first send/receive and GPipe's first receive
        # from the next stage comes grouped after sends that stage must take first: connect
        # both ways with both neighbours now, all stages at once (tests/test_pp_order.py);
        # interleaved, the last rank and rank 0 are neighbours too
        if schedule == "interleaved":
            peers = {(self.index - 1) % self.stages, (self.index + 1) % self.stages}
        else:
            peers = {self.index - 1, self.index + 1} & set(range(self.stages))
        comm.connect_peers(peers)

    @staticmethod
    def _chunks_of(stage: Any, schedule: str, virtual_stages: Optional[int]) -> List[Stage]:
        """This rank's chunks as a list; TypeError / ValueError for what does not fit."""
        chunks = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        for chunk in chunks:
            if not isinstance(chunk, Stage):
                raise TypeError(f"stage must be a gpucoll.pp.Stage (or a list of them), got "
                                f"{type(chunk).__name__}")
        if not chunks:
            raise ValueError("stage: the list of chunks must not be empty")
        if virtual_stages is not None and virtual_stages != len(chunks):
            raise ValueError(f"virtual_stages={virtual_stages!r} needs a list of "
                             f"{virtual_stages!r} Stages (this rank's chunks), got "
                             f"{len(chunks)}")
        if schedule != "interleaved" and len(chunks) > 1:
            raise ValueError(f"schedule {schedule!r} runs one Stage per rank, got "
                             f"{len(chunks)} chunks (use schedule='interleaved')")
        return chunks

    # ------------------------------------------------------------------ construction checks
    def _name(self, chunk: int) -> str:
        return (f"stage {chunk}" if self.virtual_stages == 1 else
                f"chunk {chunk} (rank {chunk % self.stages})")

    def _check_neighbours(self) -> None:
        """All-gather (in, out, dtype) of every chunk; compare each with the next one."""
        mine = np.array([[chunk.in_features, chunk.out_features, wire_code(chunk.dtype)]
                         for chunk in self.chunks], dtype=np.int64)
        if self.stages == 1:
            return
        table = self.comm.all_gather(self.chunks[0].xp.asarray(mine))
        table = table.get() if hasattr(table, "get") else np.asarray(table)
        table = table.reshape(self.stages, self.virtual_stages, 3)
        rows = [table[c % self.stages][c // self.stages]
                for c in range(self.stages * self.virtual_stages)]
        for c in range(len(rows) - 1):
            out_features, in_features = int(rows[c][1]), int(rows[c + 1][0])
            if out_features != in_features:
                raise ValueError(f"pipeline stages do not fit: {self._name(c)} gives "
                                 f"{out_features} features, {self._name(c + 1)} takes "
                                 f"{in_features}")
            left, right = dtype_from_code(int(rows[c][2])), dtype_from_code(int(rows[c + 1][2]))
            if left != right:
                raise ValueError(f"pipeline stages do not fit: {self._name(c)} sends {left}, "
                                 f"{self._name(c + 1)} expects {right}")

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
        width = self.chunks[0].in_features
        if self.is_first and (inputs.ndim != 2 or inputs.shape[1] != width):
            raise ValueError(f"stage 0: inputs must have shape (rows, {width}), got "
                             f"{inputs.shape}")
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
        for chunk in self.chunks:
            chunk.zero_grad()
            chunk.reset_peak()
        return self._run(self._plan, inputs, labels, rows)[0]

    def evaluate(self, inputs: Any = None, labels: Any = None, *,
                 batch_size: Optional[int] = None) -> Tuple[Optional[float], Optional[int]]:
        """Forwards only (nothing kept for backward): ``(mean loss, correct)`` on the last
        stage, ``(None, None)`` elsewhere. Same arguments and checks as :meth:`step`."""
        rows = self._batch_rows(inputs, labels, batch_size)
        loss, correct = self._run(self._eval_plan, inputs, labels, rows, training=False)
        return loss, correct

    def _tag(self, boundary: int, micro_batch: int, direction: int) -> int:
        """The tag of what crosses from chunk ``boundary`` to ``boundary + 1`` (or back)."""
        group = self._passes * self.virtual_stages + boundary // self.stages
        return (2 * (group * self.micro_batches + micro_batch) + direction) % 2 ** 32

    def _consumer(self, peer: int, action: Optional[tuple]) -> Optional[Tuple[str, int, int]]:
        """Interleaved: the action of this rank that uses what ``peer``'s ``action`` sends,
        or None when it sends nothing here."""
        if action is None:
            return None
        kind, m, k = action
        chunk, last = k * self.stages + peer, self.stages * self.virtual_stages - 1
        target = (chunk + 1 if kind == "F" and chunk < last else
                  chunk - 1 if kind == "B" and chunk > 0 else None)
        if target is None or target % self.stages != self.index:
            return None
        return kind, m, target // self.stages

    def _run(self, plan: list, inputs: Any, labels: Any, rows: int, training: bool = True):
        """Run ``plan``: the actions of this rank (GPipe, 1F1B), or every rank's timetable
        (interleaved)."""
        chunks, xp, comm = self.chunks, self.chunks[0].xp, self.comm
        rows_per = rows // self.micro_batches
        scale = 1.0 / rows
        ranks, last = self.stages, self.stages * self.virtual_stages - 1
        loss_grads: Dict[int, Any] = {}             # last chunk: loss gradient per micro-batch
        sends: List[Tuple[Any, Any]] = []           # (Work, array kept alive until sent)
        loss_sum, correct = 0.0, 0

        def incoming(action: Optional[Tuple[str, int, int]]):
            """(peer, buffer, tag) of what ``action`` receives before it runs, or None."""
            if action is None:
                return None
            kind, m, k = action
            chunk, c = chunks[k], k * ranks + self.index
            if kind == "F" and c > 0:
                return ((c - 1) % ranks,
                        xp.empty((rows_per, chunk.in_features), dtype=chunk.dtype),
                        self._tag(c - 1, m, FORWARD))
            if kind == "B" and c < last:
                return ((c + 1) % ranks,
                        xp.empty((rows_per, chunk.out_features), dtype=chunk.dtype),
                        self._tag(c, m, BACKWARD))
            return None

        def exchange(outgoing, action: Optional[Tuple[str, int, int]]):
            """Post this action's output and the next action's input as one operation; the
            (Work, buffer) of that input, or None."""
            want = incoming(action)
            if outgoing is not None:
                array, peer, tag, dtype = outgoing
                array = xp.ascontiguousarray(array, dtype=dtype)
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

        def post_slot(outgoing, slot: int) -> Dict[Tuple[str, int, int], Tuple[Any, Any]]:
            """Interleaved: this slot's output and what the neighbours send this rank in the
            same slot, as one operation; ``{action: (Work, buffer)}`` of those inputs."""
            ops: List[Tuple[str, Any, int, int]] = []
            if outgoing is not None:
                array, peer, tag, dtype = outgoing
                ops.append(("send", xp.ascontiguousarray(array, dtype=dtype), peer, tag))
            wanted = {}
            for peer in sorted({(self.index - 1) % ranks, (self.index + 1) % ranks}):
                action = self._consumer(peer, plan[peer][slot])
                if action is not None:
                    src, buffer, recv_tag = incoming(action)
                    ops.append(("recv", buffer, src, recv_tag))
                    wanted[action] = buffer
            if not ops:
                return {}
            kinds = [op[0] for op in ops]
            if kinds == ["send"]:
                work = comm.isend(ops[0][1], ops[0][2], tag=ops[0][3])
            elif kinds == ["recv"]:
                work = comm.irecv(ops[0][1], ops[0][2], tag=ops[0][3])
            elif kinds == ["send", "recv"]:
                work = comm.sendrecv(ops[0][1], ops[0][2], ops[1][1], ops[1][2], tag=ops[0][3],
                                     recv_tag=ops[1][3], async_op=True)
            else:
                work = comm.batch_isend_irecv([P2POp(*op) for op in ops])[0]
            if kinds[0] == "send":
                sends.append((work, ops[0][1]))
            return {action: (work, buffer) for action, buffer in wanted.items()}

        def run(action: Tuple[str, int, int], received: Any):
            """One forward or backward; (array, peer, tag, dtype) of its output, or None."""
            nonlocal loss_sum, correct
            kind, m, k = action
            chunk, c = chunks[k], k * ranks + self.index
            outgoing = None
            if kind == "F":
                if c == 0:
                    x = xp.ascontiguousarray(
                        xp.asarray(inputs[m * rows_per:(m + 1) * rows_per]), dtype=chunk.dtype)
                else:
                    x = received
                y = chunk.forward(x) if training else chunk.predict(x)
                if c == last:
                    batch_labels = xp.asarray(labels[m * rows_per:(m + 1) * rows_per])
                    loss, hits, grad = self.loss_fn(y, batch_labels, scale)
                    loss_sum, correct = loss_sum + loss, correct + hits
                    if training:
                        loss_grads[m] = grad
                else:
                    outgoing = (y, (c + 1) % ranks, self._tag(c, m, FORWARD), chunk.dtype)
            else:
                grad = loss_grads.pop(m) if c == last else received
                grad_input = chunk.backward(grad)
                if c > 0:
                    outgoing = (grad_input, (c - 1) % ranks, self._tag(c - 1, m, BACKWARD),
                                chunk.dtype)
            return outgoing

        try:
            if self.schedule == "interleaved":
                waiting: Dict[Tuple[str, int, int], Tuple[Any, Any]] = {}
                for slot, action in enumerate(plan[self.index]):
                    outgoing = None
                    if action is not None:
                        received = take(waiting.pop(action)) if action in waiting else None
                        outgoing = run(action, received)
                    waiting.update(post_slot(outgoing, slot))
                    sends = [entry for entry in sends if not _finished(entry[0])]
            else:
                pending = exchange(None, plan[0] if plan else None)
                for index, action in enumerate(plan):
                    received = take(pending) if pending is not None else None
                    outgoing = run(action, received)
                    following = plan[index + 1] if index + 1 < len(plan) else None
                    pending = exchange(outgoing, following)
                    sends = [entry for entry in sends if not _finished(entry[0])]
            for work, _ in sends:
                work.wait()
        except BaseException:
            for chunk in chunks:
                chunk.clear()
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
