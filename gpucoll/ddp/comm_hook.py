"""The comm-hook protocol: what a :class:`~gpucoll.ddp.Bucketer` calls instead of its own
packed all-reduce, bucket by bucket (torch's ``DistributedDataParallel.register_comm_hook``).

A hook owns the communication of a step. The Bucketer keeps what does not depend on how the
gradients travel: the bucket plan, the order buckets are issued in (the same on every rank),
``no_sync`` accumulation, and the checks of each gradient's index, shape and dtype. The calls:

1. ``attach`` once, from the Bucketer's constructor, with its bucket plan;
2. ``issue`` per bucket as it fills during backward, in bucket order: start communicating
   (``async_op=True``) so it overlaps with the rest of backward;
3. ``finish`` once every bucket is issued: complete the step, writing the result into the
   gradient arrays ``issue`` was given (the hook may read them until then);
4. ``cancel`` instead of ``finish`` when the Bucketer abandons a step (a usage error found in
   ``finish()``): wait for what was issued and undo the step's changes to the hook's state.
"""

from __future__ import annotations

import abc
from typing import Any, List, Sequence

__all__ = ["CommHook"]


class CommHook(abc.ABC):
    """Per-bucket communication for a Bucketer (see the module doc); ``PowerSGD`` is one."""

    @abc.abstractmethod
    def attach(self, comm, buckets: Sequence[Sequence[int]], shapes: Sequence[tuple],
               dtypes: Sequence[Any]) -> None:
        """Take the Bucketer's plan: ``buckets`` are parameter indices in issue order.

        Raises:
            ValueError, TypeError: the plan, shapes or dtypes do not fit this hook (another
                communicator, other parameters, already attached to a Bucketer).
        """

    @abc.abstractmethod
    def issue(self, bucket: int, grads: List[Any]) -> None:
        """Bucket ``bucket`` is complete (``grads`` in its members' order): start sending."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Every bucket of the step was issued: complete it, results in the issued arrays."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Abandon the step in progress, if any: wait for what was sent, restore the state."""
