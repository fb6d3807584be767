"""An emulation of the small part of the CuPy and NCCL APIs that gpucoll's NCCL backend calls.

It runs on the CPU and exists to test gpucoll's own bookkeeping (argument translation, pointer
arithmetic, results handed back, events and streams, the watchdog, split, abort) on machines
without a GPU. It is neither CuPy nor NCCL and proves nothing about them: real NCCL is tested
by ``tests/test_nccl_gpu.py``.

Usage::

    emu = Emulation(device_count=4)
    monkeypatch.setattr(gpucoll.cuda_env, "_LOADED", (emu.cupy, emu.nccl))

``emu.cupy`` stands for ``cupy`` and ``emu.nccl`` for ``cupy.cuda.nccl`` (the CuPy 14 API:
``get_unique_id()`` returns bytes, ``NcclCommunicator(ndev, commId: bytes, rank)``, and
``commSplit(color, key)``, which returns None for color -1).

The model
    Device memory is NumPy buffers. ``ndarray`` wraps a NumPy array; ``x.data.ptr`` is the
    real address of its memory, and every allocation is registered with its device, so a
    pointer that strays outside the buffers of the communicator's GPU is caught (``NcclError``).
    ``asarray`` of an object with ``__cuda_array_interface__`` makes a view of the same
    memory, never a copy.

    Ranks are threads of one process (addresses are valid in every thread). Communicators
    meet by unique id in a registry of the ``Emulation``; every wait is bounded by
    ``emu.timeout`` and raises ``NcclError`` instead of hanging.

    Work is run at enqueue time, in order per stream, in the thread that enqueues it; a
    collective blocks (bounded) until every rank of the communicator has issued it, then the
    result is computed with NumPy from the raw pointers. ``emu.stall(stream)`` holds back
    everything enqueued on a stream afterwards (events recorded there stay not done, streams
    that wait for those events wait too) until ``emu.release(stream)``, which runs the held
    work in the releasing thread. Work held on a stalled stream of an aborted communicator is
    dropped when it runs, as aborted kernels exit. An error of held work becomes the
    communicator's asynchronous error (``check_async_error``). An array freed while work is
    held on the stream that was current at its allocation keeps its memory until that work
    has run (CuPy's pool reuses a block in the order of that stream only). The two-array
    ufuncs that ``scan`` combines with (``cupy.add``, ``minimum``, ``bitwise_and``,
    ``logical_or``...) write ``out=`` in order on the current stream, as a kernel does.

    Sends and receives issued between ``groupStart()`` and ``groupEnd()`` run together at
    ``groupEnd`` (sends are posted first, so a grouped exchange cannot deadlock); outside a
    group a send waits for the peer's matching receive and the other way round. Messages
    between two ranks match in order and must have the same size. As in NCCL, two ranks
    connect lazily, one direction at a time: the host call of a rank's first send to a peer
    (the lone call, or ``groupEnd``) waits until the peer has made the host call of its first
    receive from it, and the other way round (NVIDIA/nccl#783).

    Two ranks of one communicator on one device are refused as NCCL does ("Duplicate GPU"),
    unless ``emu.nccl_version`` is 2.30 or later and ``NCCL_MULTI_RANK_GPU_ENABLE=1``.

    Arguments are checked as NCCL would (datatype, op, counts, root and peer in range, buffers
    inside device memory of the communicator's GPU, known streams) and nonsense raises
    ``NcclError``; ranks that issue different collectives (name, count, datatype, op, root)
    at the same position get ``NcclError`` too, where real NCCL would hang or corrupt data.

    CUDA graphs: work enqueued on a capturing stream (copies, collectives, event records,
    gpucoll's bucketing kernels, in-place changes of arrays: setitem, fill, ``+=``, the fill of
    ``zeros``) is recorded and run again by each ``graph.launch``; a synchronize or a copy
    to or from the host there fails with cudaErrorStreamCaptureUnsupported and invalidates
    the capture. Operations that make new arrays run at capture only.

    The array type says it is CuPy's (``cupy.ndarray``), so gpucoll treats it as CuPy;
    ``cupy.RawModule`` knows gpucoll's bucketing kernels (kernels.py: their launches read the
    work table and arrays through device addresses, in stream order).

Test hooks: ``emu.stall(stream)``, ``emu.release(stream)``, ``emu.release_all()``,
``emu.inject_async_error(nccl_comm, detail)``, ``emu.pending(stream)``, ``emu.calls`` (a Counter
of calls by name), ``emu.history`` (every NCCL operation issued: communicator, name,
arguments), ``emu.errors`` (errors of held work that no communicator owned),
``emu.kernel_launches`` (bucketing kernels launched).
"""

# The parts: basics (CUDA and NCCL constants, the errors, argument conversion), arrays
# (ndarray), cuda_objects (Device, Stream, Event, Graph), communicator (NcclCommunicator),
# kernels (RawModule: the bucketing kernels) and emulation (Emulation: memory, stream
# scheduling, and the fake cupy and nccl modules).
# Every public name of the emulation is importable from the package itself.
from .arrays import ndarray  # noqa: F401
from .basics import (INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE, MEMCPY_DEFAULT,  # noqa: F401
                     MEMCPY_DEVICE_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE,
                     MEMCPY_HOST_TO_HOST, NCCL_CONSTANTS, NCCL_VERSION, REMOTE_ERROR, SUCCESS,
                     SYSTEM_ERROR, UNHANDLED_CUDA_ERROR, UNIQUE_ID_BYTES, CUDARuntimeError,
                     NcclError, ml_dtypes)
from .communicator import NcclCommunicator  # noqa: F401
from .cuda_objects import Device, Event, Stream  # noqa: F401
from .emulation import Emulation

__all__ = ["Emulation", "NcclError", "CUDARuntimeError"]
