"""CUDA graphs and the NCCL backend: collectives captured into a graph, and its launches.

A training step captured into a CUDA graph (``stream.begin_capture()`` ... ``end_capture()``
in CuPy) replays with one launch and no host work per kernel, which is where a small model's
step spends most of its time. NCCL kernels can be captured: a blocking ``all_reduce``,
``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter``, ``send``, ``recv`` or
``sendrecv`` (and the grouped ``gather``, ``scatter``, ``all_to_all``) issued on a capturing
stream is recorded into the graph instead of run. A graph holds the addresses of the arrays
it was captured with: they must stay alive, and a launch reads and writes them again. Nothing
of it runs at capture, so gpucoll records no event and the watchdog follows nothing; its
flight recorder record says ``"captured"``.

Each launch of the graph runs the captured collectives again, and every rank must launch its
graph as it would issue the collectives. A plain ``graph.launch(stream)`` is outside gpucoll's
view: a rank that never launches leaves the others' kernels waiting with no timeout.
:meth:`GraphLaunches.launch_graph` launches the graph as one collective of the communicator,
followed by the watchdog and the flight recorder like any other: a launch that does not finish
within the timeout fails the communicator with an error that names it. A graph that captured
collectives of several communicators of the GPU is launched by one, naming the others
(``also=``): each follows the launch as one collective of its own.

What cannot be captured says so before anything is enqueued, and the capture stays valid:
``async_op=True`` (its Work waits for an event the capture never completes), ``barrier`` (it
waits on the host), and the composite calls that read counts or objects on the host
(``*_object``, ``all_gather_v``, ``gather_v``, ``all_to_all_v``: CUDA would refuse their host
copy and invalidate the capture; see :mod:`gpucoll.graph_capture`).
"""

from __future__ import annotations

from typing import Any, List, Sequence

from ..flight_recorder import describe_nothing, traced
from ..graph_capture import HOST_READS, refusal

__all__ = ["GraphLaunches"]


class GraphLaunches:
    """Mixin of :class:`~gpucoll.backends.nccl.NCCLCommunicator` (uses its ``_cupy``,
    ``_runtime``, ``device``, ``_check_alive``, ``_enqueue`` and ``_seq``)."""

    def _capturing_now(self) -> bool:
        """Whether the current stream of this communicator's GPU is capturing a CUDA graph
        (where a call without ``stream=`` would enqueue)."""
        runtime, cuda = self._runtime, self._cupy.cuda
        if runtime.getDevice() == self.device:
            return bool(runtime.streamIsCapturing(cuda.get_current_stream().ptr))
        with cuda.Device(self.device):
            return bool(runtime.streamIsCapturing(cuda.get_current_stream().ptr))

    def _refuse_in_capture(self, name: str, x: Any = None) -> None:
        """The composite calls (objects, uneven gathers, ``all_to_all_v``) in a capture: refused
        before anything is enqueued (see :mod:`gpucoll.graph_capture`)."""
        if self._capturing_now():
            raise refusal(self.backend, name, HOST_READS)

    @traced(describe_nothing)
    def launch_graph(self, graph: Any, *, stream: Any = None, also: Sequence[Any] = ()) -> None:
        """Launch ``graph`` (a ``cupy.cuda.graph.Graph`` that captured collectives of this
        communicator) on ``stream`` (a CuPy stream; default the current one), as one
        collective: every rank launches its graph, in the same order as its other collectives.
        Returns once enqueued, as a blocking collective does; the watchdog then holds the
        launch to the communicator's timeout (see the module doc).

        ``also``: the other NCCL communicators of this GPU whose collectives the graph captured
        too (the tensor- and data-parallel groups of one step, say). Each follows the launch
        as one collective of its own: its watchdog holds it to its timeout, its flight
        recorder records it. Every rank of each passes it, in the same order as its other
        collectives.

        Example (two ranks)::

            stream = cupy.cuda.Stream()
            with stream:
                stream.begin_capture()
                comm.all_reduce(grads)          # recorded, not run
                graph = stream.end_capture()
            for step in range(steps):
                ...                             # grads of this step
                comm.launch_graph(graph, stream=stream)
        """
        if not callable(getattr(graph, "launch", None)):
            raise TypeError(f"graph must be a cupy.cuda.graph.Graph (from "
                            f"stream.end_capture()), got {type(graph).__name__}")
        target = self._cupy.cuda.get_current_stream() if stream is None else stream
        if not isinstance(getattr(target, "ptr", None), int):
            raise TypeError(f"stream must be a CuPy stream, got {type(stream).__name__}")
        partners = self._launch_partners(also)
        self._enqueue("launch_graph", lambda ptr: graph.launch(target), target, False, None,
                      seq=self._seq + 1)
        for partner in partners:
            partner._follow_launch(target)

    def _launch_partners(self, also: Sequence[Any]) -> List["GraphLaunches"]:
        """``also`` of :meth:`launch_graph`, checked before anything is enqueued."""
        if isinstance(also, (str, bytes)) or not hasattr(also, "__iter__"):
            raise TypeError(f"also must be a sequence of NCCL communicators, got "
                            f"{type(also).__name__}")
        partners = list(also)
        for index, other in enumerate(partners):
            if not isinstance(other, GraphLaunches):
                raise TypeError(f"also[{index}] must be an NCCL communicator, got "
                                f"{type(other).__name__}")
            if other is self or partners.index(other) != index:
                what = "this communicator" if other is self else "given twice"
                raise ValueError(f"also[{index}] is {what}: each communicator follows a launch "
                                 f"once")
            if other.device != self.device:
                raise ValueError(f"also[{index}] is on GPU {other.device}, this communicator on "
                                 f"GPU {self.device}: a graph runs on one GPU")
            other._check_alive()
        return partners

    @traced(describe_nothing, op="launch_graph")
    def _follow_launch(self, stream: Any) -> None:
        """A launch another communicator of this GPU enqueued on ``stream`` (``also`` of
        :meth:`launch_graph`), followed as one collective of this one: an event after it,
        held to this communicator's timeout."""
        self._enqueue("launch_graph", lambda ptr: None, stream, False, None, seq=self._seq + 1)
