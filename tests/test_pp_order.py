"""The pipeline's sends and receives, in the order each stage issues them, cannot deadlock on a
stream-ordered backend.

On NCCL every operation of a rank runs in issue order on its stream, and a send finishes only
once its receiver has reached the matching receive (for messages larger than NCCL's buffers);
a ``sendrecv`` is one group whose two halves progress together. Two ranks connect lazily, one
direction at a time: the host call of a rank's first send to a peer waits until the peer is at
its first receive from it (NVIDIA/nccl#783), so until then nothing of that call progresses.
The pipeline connects its neighbours first (``connect_peers``). The CPU backend is more
forgiving (sends progress on their own threads), so a schedule that runs there may still hang
on a GPU. This file records each stage's issue order from the real ``Pipeline`` (a recording
communicator; every stage in this process) and plays the stages against each other under the
strict rule: every schedule, 1 to 5 stages, 1 to 8 micro-batches, training and evaluation,
must finish, with each receive matching its send's tag and size. The interleaved schedule
(1 to 3 chunks per rank) goes in lockstep slots, each slot's sends and receives as one group;
issued as the other schedules are (after each action, its output and the next action's input)
it deadlocks from two chunks per rank and M > P on.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest

from gpucoll.examples.train_digits import init_params
from gpucoll.pp import Pipeline, Stage, mlp_layers
from gpucoll.types import wire_code

SIZES = [6, 10, 8, 7, 9, 4]      # up to 5 stages of one linear layer each (ReLU between)

Op = Tuple[str, int, int, int]   # (kind, peer, tag, bytes)


class _Done:
    """A finished Work (the recording communicator delivers nothing, so nothing waits)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class RecordingComm:
    """Stage ``rank`` of ``size``: records each operation as a unit of one or two ops."""

    memory = "host"

    def __init__(self, rank: int, size: int, table: np.ndarray):
        self.rank, self.size, self.table = rank, size, table
        self.units: List[List[Op]] = []

    def all_gather(self, row):
        return self.table

    def isend(self, x, dst, *, tag=0):
        self.units.append([("send", dst, tag, x.nbytes)])
        return _Done()

    def irecv(self, out, src, *, tag=0):
        out[...] = 0
        self.units.append([("recv", src, tag, out.nbytes)])
        return _Done()

    def sendrecv(self, x, dst, out, src, *, tag=0, recv_tag=None, async_op=False):
        out[...] = 0
        self.units.append([("send", dst, tag, x.nbytes),
                           ("recv", src, tag if recv_tag is None else recv_tag, out.nbytes)])
        return _Done() if async_op else out

    def batch_isend_irecv(self, ops):
        unit = []
        for op in ops:
            if op.op == "recv":
                op.array[...] = 0
            unit.append((op.op, op.peer, op.tag, op.array.nbytes))
        self.units.append(unit)
        return [_Done() for _ in ops]

    def connect_peers(self, peers):
        """One group of a one-byte send to and receive from each peer (as on NCCL); tag -1."""
        if peers:  # none: nothing is sent
            self.units.append([op for peer in sorted(peers)
                               for op in (("send", peer, -1, 1), ("recv", peer, -1, 1))])

    def abort(self):
        pass


def issue_orders(schedule: str, stages: int, micro_batches: int, training: bool = True,
                 virtual_stages: int = 1) -> List[List[List[Op]]]:
    """Each stage's units, recorded from ``Pipeline`` running two steps (interleaved: rank
    ``r`` runs chunks ``r, r + P, ...`` of ``P v``, each of one linear layer)."""
    chunks = stages * virtual_stages
    sizes = SIZES[:chunks + 1] if chunks < len(SIZES) else [4 + i % 7 for i in range(chunks + 1)]
    built = [Stage(layer) for layer in mlp_layers(init_params(sizes, seed=0), chunks)]
    table = np.array([[[s.in_features, s.out_features, wire_code(s.dtype)]
                       for s in built[index::stages]] for index in range(stages)])
    rows = 2 * micro_batches
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], rows)
    orders = []
    for index in range(stages):
        comm = RecordingComm(index, stages, table)
        stage = built[index] if schedule != "interleaved" else built[index::stages]
        pipe = Pipeline(comm, stage, micro_batches=micro_batches, schedule=schedule)
        args = dict(inputs=x if index == 0 else None, labels=y if index == stages - 1 else None,
                    batch_size=None if index in (0, stages - 1) else rows)
        for _ in range(2):
            (pipe.step if training else pipe.evaluate)(**args)
        orders.append(comm.units)
    return orders


def play(orders: List[List[List[Op]]]) -> Optional[str]:
    """Run every rank's units in order under NCCL's rule; None if all finish, else why not.

    A rank works on its first unit only; an op of it matches the counterpart op (the k-th send
    from a to b with the k-th receive at b from a) once that is in the peer's first unit; a
    unit is done when all its ops are matched. A unit with an op in a direction (a, b) not yet
    connected progresses only once, for each such direction, the peer's first unit holds the
    other side's op too; the direction is then connected.
    """
    counted: Dict[Tuple[str, int, int], int] = {}
    queues = []
    for rank, units in enumerate(orders):
        queue = []
        for unit in units:
            keyed = []
            for kind, peer, tag, nbytes in unit:
                pair = (rank, peer) if kind == "send" else (peer, rank)
                number = counted[(kind,) + pair] = counted.get((kind,) + pair, 0) + 1
                keyed.append((kind, pair, number, tag, nbytes))
            queue.append(keyed)
        queues.append(queue)
    matched, connected = set(), set()
    while any(queues):
        progress = False
        launched = []  # per rank: its first unit is past its host call (connected)
        for rank, queue in enumerate(queues):
            unconnected = {(kind, pair) for kind, pair, *_ in (queue[0] if queue else [])
                           if pair not in connected}
            ready = bool(queue)
            for kind, pair in unconnected:
                peer = pair[1] if kind == "send" else pair[0]
                other = "recv" if kind == "send" else "send"
                head = queues[peer][0] if queues[peer] else []
                ready = ready and any(op[:2] == (other, pair) for op in head)
            launched.append(ready)
        for rank, queue in enumerate(queues):
            if launched[rank]:
                news = {pair for _, pair, *_ in queue[0]} - connected
                progress = progress or bool(news)
                connected |= news
        for rank, queue in enumerate(queues):
            if not launched[rank]:
                continue  # its host call waits for the connection
            for kind, pair, number, tag, nbytes in queue[0]:
                if (kind, pair, number) in matched:
                    continue
                peer = pair[1] if kind == "send" else pair[0]
                other = "recv" if kind == "send" else "send"
                head = queues[peer][0] if queues[peer] and launched[peer] else []
                for op in head:
                    if op[:3] == (other, pair, number):
                        if (op[3], op[4]) != (tag, nbytes):
                            return (f"{kind} #{number} of {pair}: tag {tag}, {nbytes} bytes; "
                                    f"its {other}: tag {op[3]}, {op[4]} bytes")
                        matched.update({(kind, pair, number), (other, pair, number)})
                        progress = True
        for queue in queues:
            if queue and all(op[:3] in matched for op in queue[0]):
                queue.pop(0)
                progress = True
        if not progress:
            return "deadlock; first units: " + "; ".join(
                f"rank {rank}: {[op[:3] for op in queue[0]]}"
                for rank, queue in enumerate(queues) if queue)
    return None


# ---------------------------------------------------------------------------- the rule itself
def test_the_rule_finds_a_deadlock_and_lets_a_group_through():
    both_send_first = [[[("send", 1, 0, 8)], [("recv", 1, 0, 8)]],
                       [[("send", 0, 0, 8)], [("recv", 0, 0, 8)]]]
    assert play(both_send_first).startswith("deadlock")
    grouped = [[[("send", 1, 0, 8), ("recv", 1, 0, 8)]],
               [[("send", 0, 0, 8), ("recv", 0, 0, 8)]]]
    assert play(grouped) is None
    one_receives_first = [[[("send", 1, 0, 8)], [("recv", 1, 0, 8)]],
                          [[("recv", 0, 0, 8)], [("send", 0, 0, 8)]]]
    assert play(one_receives_first) is None
    wrong_tag = [[[("send", 1, 3, 8)]], [[("recv", 0, 4, 8)]]]
    assert "tag 3" in play(wrong_tag)


def test_the_rule_connects_lazily():
    """GPipe's pattern on two stages: stage 0's first receive is grouped with its last send;
    stage 1 sends only after that send arrived. It hung on a real GPU in the host call (the
    connection 1 -> 0 waits for stage 1's first send); connecting both ways first ends it."""
    stage0 = [[("send", 1, 0, 8)], [("send", 1, 1, 8), ("recv", 1, 2, 8)]]
    stage1 = [[("recv", 0, 0, 8)], [("recv", 0, 1, 8)], [("send", 0, 2, 8)]]
    assert play([stage0, stage1]).startswith("deadlock")
    connect = [("send", 1, -1, 1), ("recv", 1, -1, 1)], [("send", 0, -1, 1), ("recv", 0, -1, 1)]
    assert play([[connect[0]] + stage0, [connect[1]] + stage1]) is None


def test_the_old_order_of_the_pipeline_deadlocks():
    """Two stages, two micro-batches of 1F1B issued as the pipeline used to: every receive
    posted early on its own (the next input as soon as the current one arrived, the gradient
    right after the activation went), every send on its own."""
    stage0 = [[("send", 1, 0, 8)], [("recv", 1, 1, 8)], [("send", 1, 2, 8)],
              [("recv", 1, 3, 8)]]
    stage1 = [[("recv", 0, 0, 8)], [("recv", 0, 2, 8)], [("send", 0, 1, 8)],
              [("send", 0, 3, 8)]]
    assert play([stage0, stage1]).startswith("deadlock")


# ---------------------------------------------------------------------------- the pipeline
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_training_steps_cannot_deadlock_on_a_stream_ordered_backend(schedule, stages):
    for micro_batches in range(1, 9):
        orders = issue_orders(schedule, stages, micro_batches)
        assert play(orders) is None, (schedule, stages, micro_batches)
        sends = sum(op[0] == "send" and op[2] >= 0
                    for units in orders for unit in units for op in unit)
        assert sends == 2 * 2 * micro_batches * (stages - 1)   # 2 steps, forward and back
        for index, units in enumerate(orders):  # neighbours connected once, before anything
            neighbours = sorted({index - 1, index + 1} & set(range(stages)))
            connects = [unit for unit in units if unit[0][2] == -1]
            assert connects == ([units[0]] if neighbours else [])
            assert not neighbours or [op[1] for op in units[0][::2]] == neighbours


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_evaluation_cannot_deadlock_on_a_stream_ordered_backend(stages):
    for micro_batches in (1, 4, 7):
        orders = issue_orders("1f1b", stages, micro_batches, training=False)
        assert play(orders) is None, (stages, micro_batches)


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_interleaved_steps_cannot_deadlock_on_a_stream_ordered_backend(stages):
    for virtual_stages in (1, 2, 3):
        for micro_batches in (stages, 2 * stages, 3 * stages):
            for training in (True, False):
                orders = issue_orders("interleaved", stages, micro_batches, training,
                                      virtual_stages)
                assert play(orders) is None, (stages, virtual_stages, micro_batches, training)
                sends = sum(op[0] == "send" and op[2] >= 0
                            for units in orders for unit in units for op in unit)
                # 2 passes, each message of every chunk boundary (and back when training)
                assert sends == 2 * (1 + training) * micro_batches * (
                    stages * virtual_stages - 1)
                for index, units in enumerate(orders):   # the ring neighbours, first
                    ring = sorted({(index - 1) % stages, (index + 1) % stages})
                    assert [unit for unit in units if unit[0][2] == -1] == [units[0]]
                    assert [op[1] for op in units[0][::2]] == ring
                    # one tag per (pass, micro-batch, chunk, direction): none sent twice
                    tags = [op[2] for unit in units for op in unit
                            if op[0] == "send" and op[2] >= 0]
                    assert len(set(tags)) == len(tags)
