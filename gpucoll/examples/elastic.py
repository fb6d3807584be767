"""What the elastic training examples share: their options, where training is, and how the
ranks agree on it after a loss or when a lost rank's replacement joins.

An elastic example (``--elastic``) catches :data:`FAILURES`, ``comm.shrink()``\\ s and goes on
among the survivors; under ``gpucoll run --elastic --replace N`` it calls ``comm.grow()``
every ``--grow-every`` steps, and a newcomer (:func:`is_newcomer`) learns the position
(:class:`Progress`) from the first member (:func:`first_member`, :func:`share_progress`).
Rank 0 says what happened in the lines :func:`lost_line` and :func:`joined_line` make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from gpucoll.errors import CommAbortedError, CommTimeoutError, PeerError

__all__ = ["FAILURES", "Progress", "add_elastic_arguments", "check_elastic_arguments",
           "is_newcomer", "first_member", "share_progress", "lost_line", "joined_line"]

FAILURES = (PeerError, CommTimeoutError, CommAbortedError)


@dataclass
class Progress:
    """Where training is: the same on every rank (replicated with the weights)."""

    epoch: int = 0
    offset: int = 0  # positions of this epoch's sample order already trained on
    step: int = 0    # optimizer steps taken since the start


def add_elastic_arguments(parser, elastic_help: str) -> None:
    """``--elastic`` (described by ``elastic_help``), ``--grow-every``, ``--wait-for-ranks``
    and the fault injection ``--kill-rank`` / ``--kill-step``."""
    parser.add_argument("--elastic", action="store_true", help=elastic_help)
    parser.add_argument("--grow-every", type=int, default=10, metavar="K",
                        help="with --elastic: call comm.grow() every K steps, so that ranks "
                             "started in lost ones' places (gpucoll run --replace) come in")
    parser.add_argument("--wait-for-ranks", type=int, default=0, metavar="N",
                        help="with --elastic: while fewer than N ranks train, each grow() "
                             "waits (up to the communicator's timeout) for replacements")
    parser.add_argument("--kill-rank", type=int, default=None, metavar="R",
                        help="fault injection: world rank R SIGKILLs itself at --kill-step")
    parser.add_argument("--kill-step", type=int, default=None, metavar="S",
                        help="the global step (from 0) at which --kill-rank dies")


def check_elastic_arguments(parser, args) -> None:
    """Usage errors (exit 2, before anything starts) for :func:`add_elastic_arguments`'s
    options."""
    if (args.kill_rank is None) != (args.kill_step is None):
        parser.error("--kill-rank and --kill-step go together")
    if args.grow_every < 1:
        parser.error(f"--grow-every must be >= 1, got {args.grow_every}")
    if args.wait_for_ranks < 0:
        parser.error(f"--wait-for-ranks must be >= 0, got {args.wait_for_ranks}")


def is_newcomer(comm) -> bool:
    """Whether this rank came in through ``grow()`` (a lost rank's replacement): it holds no
    state and takes the members'."""
    return comm.to_world(comm.rank) in comm.joined


def first_member(comm) -> int:
    """The rank of ``comm`` that sends the newcomers the state: the first that did not just
    join."""
    return next(r for r in range(comm.size) if comm.to_world(r) not in comm.joined)


def share_progress(comm, progress: Progress, root: int, extra: Sequence[int] = ()) -> List[int]:
    """Set every rank's ``progress`` to ``root``'s, in one broadcast of integers with
    ``extra`` (``root``'s) beside it; a collective of ``comm``. Returns ``root``'s ``extra``."""
    values = np.array([progress.epoch, progress.offset, progress.step, *extra], dtype=np.int64)
    comm.broadcast(values, root=root)
    progress.epoch, progress.offset, progress.step = (int(v) for v in values[:3])
    return [int(v) for v in values[3:]]


def _position(progress: Progress) -> str:
    return f"step {progress.step} (epoch {progress.epoch + 1}, sample {progress.offset})"


def lost_line(comm, progress: Progress, from_checkpoint: bool = False) -> str:
    """Rank 0's line after a shrink: who was lost, how many go on, and from where."""
    lost = ", ".join(f"{rank} ({why})" for rank, why in sorted(comm.lost.items()))
    return (f"# lost rank(s) {lost}: continued on {comm.size} ranks from "
            f"{'the checkpoint of ' if from_checkpoint else ''}{_position(progress)}")


def joined_line(comm, progress: Progress) -> str:
    """Rank 0's line after a grow: who came in, how many go on, and from where."""
    return (f"# rank(s) {', '.join(map(str, comm.joined))} joined: continued on {comm.size} "
            f"ranks from {_position(progress)}")
