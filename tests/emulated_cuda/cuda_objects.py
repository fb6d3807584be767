"""``cupy.cuda.Device``, ``Stream`` and ``Event``, and the queue of work each stream holds."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, List, Optional

from .basics import CUDARuntimeError, _index

if TYPE_CHECKING:
    from .emulation import Emulation


class _StreamState:
    """Work queued on one stream: ("call" or "event", fn, on_error) or ("wait", ready, None)."""

    def __init__(self, name: str, device: int):
        self.name = name
        self.device = device
        self.queue: collections.deque = collections.deque()
        self.stalled = False
        self.running = False
        self.fault: Optional[int] = None  # a CUDA error its held work fails with (inject_fault)
        self.capture: Optional["Graph"] = None  # the graph it is capturing into (begin_capture)


# ---------------------------------------------------------------------- CUDA objects
class Device:
    """``cupy.cuda.Device``: makes a device current for the calling thread."""

    _emu: "Emulation"

    def __init__(self, device: Optional[int] = None):
        emu = self._emu
        self.id = emu.current_device() if device is None else _index(device, "device")
        if not 0 <= self.id < emu.device_count:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id} "
                                   f"({emu.device_count} devices)")
        self._previous: List[int] = []

    def use(self) -> None:
        self._emu._local.device = self.id

    def synchronize(self) -> None:
        self._emu.synchronize_device(self.id)

    def __enter__(self) -> "Device":
        self._previous.append(self._emu.current_device())
        self.use()
        return self

    def __exit__(self, *exc) -> None:
        self._emu._local.device = self._previous.pop()

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class Stream:
    """``cupy.cuda.Stream``; ``ptr`` 0 is the null stream of the current device."""

    _emu: "Emulation"
    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        emu = self._emu
        if null:
            self.ptr, self.device_id = 0, None
        else:
            self.ptr = emu._handle()
            self.device_id = emu.current_device()
            with emu.lock:
                emu._streams[self.ptr] = _StreamState(f"stream {self.ptr:#x}", self.device_id)

    @property
    def done(self) -> bool:
        state = self._emu._state(self.ptr)
        with self._emu.lock:
            return not state.queue and not state.running

    def synchronize(self) -> None:
        self._emu.synchronize_stream(self.ptr)

    def record(self, event=None):
        event = self._emu.cupy.cuda.Event() if event is None else event
        self._emu.event_record(event.ptr, self.ptr)
        return event

    def wait_event(self, event) -> None:
        self._emu.stream_wait_event(self.ptr, event.ptr)

    def begin_capture(self, mode=None) -> None:
        """Work enqueued from now on is recorded into a graph instead of run (CuPy's default
        mode, relaxed); ``end_capture()`` returns the graph."""
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream; use a "
                               "non-default stream instead")
        state = self._emu._state(self.ptr)
        with self._emu.lock:
            if state.capture is not None:
                raise CUDARuntimeError("cudaErrorIllegalState: the stream is already capturing")
            state.capture = Graph(self._emu)

    def end_capture(self) -> "Graph":
        state = self._emu._state(self.ptr)
        with self._emu.lock:
            graph, state.capture = state.capture, None
        if graph is None:
            raise CUDARuntimeError("cudaErrorIllegalState: the stream is not capturing")
        if graph.invalidated:
            raise CUDARuntimeError(901)
        return graph

    def is_capturing(self) -> bool:
        return self._emu.stream_is_capturing(self.ptr)

    def use(self) -> "Stream":
        stack = self._emu._stream_stack()
        if stack:
            stack[-1] = self
        else:
            stack.append(self)
        return self

    def __enter__(self) -> "Stream":
        self._emu._stream_stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._emu._stream_stack().pop()

    def __repr__(self) -> str:
        return f"<emulated Stream {self.ptr:#x}>"


class Event:
    """``cupy.cuda.Event``: ``done`` once the work before its last record has run."""

    _emu: "Emulation"

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        emu = self._emu
        self.ptr = emu._handle()
        self.device_id = emu.current_device()
        self._recorded = 0
        self._completed = 0
        self._captured = False  # last recorded on a capturing stream
        with emu.lock:
            emu._events[self.ptr] = self

    @property
    def done(self) -> bool:
        """CuPy's ``Event.done``: ``eventQuery(ptr) == 0``, so a failed event is never done."""
        return self._emu.event_query(self.ptr) == 0

    def record(self, stream=None) -> None:
        emu = self._emu
        ptr = emu.get_current_stream().ptr if stream is None else stream.ptr
        emu.event_record(self.ptr, ptr)

    def synchronize(self) -> None:
        emu = self._emu
        if self._captured:
            raise CUDARuntimeError(907)
        with emu.cond:
            if not emu.cond.wait_for(lambda: self._completed >= self._recorded, emu.timeout):
                raise CUDARuntimeError(f"emulated: event {self.ptr:#x} not done within "
                                       f"{emu.timeout:g} s (is its stream stalled?)")


class Graph:
    """``cupy.cuda.graph.Graph``: the work captured on a stream, run again by each ``launch``.

    Each node is a function of the stream state it runs on, which enqueues the captured work
    there anew (a collective takes its place among the communicator's collectives at launch,
    as a replayed NCCL kernel does)."""

    def __init__(self, emu: "Emulation"):
        self._emu = emu
        self.nodes: List = []
        self.invalidated = False  # a call the capture could not hold failed during it

    def launch(self, stream=None) -> None:
        emu = self._emu
        ptr = emu.get_current_stream().ptr if stream is None else stream.ptr
        state = emu._state(ptr)
        if state.capture is not None:  # into a capture: the nodes join it
            state.capture.nodes.extend(self.nodes)
            return
        for node in self.nodes:
            node(state)
