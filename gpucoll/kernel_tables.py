"""Work tables of the bucketing kernels: which block copies what, built once, uploaded once.

A launch of ``gpucoll_bucket_pack`` / ``gpucoll_bucket_unpack`` reads an int64 table laid out
as ``kernels/common.cuh`` describes (the arrays' addresses, bucket offsets, sizes, the prefix
sum of their blocks and each block's array). A training step packs each bucket from the same
arrays at the same offsets every step, so the tables are remembered on the host (keyed by the
arrays' addresses, offsets and sizes) and on the GPU (keyed by their bytes, per device and
stream); a CUDA graph's tables are kept for every replay until :func:`release_graph_tables`.

Importing this module never imports CuPy (the caller passes the module in).
"""

from __future__ import annotations

import collections
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["launch_plan", "work_tables", "release_graph_tables", "MAX_ARRAYS_PER_LAUNCH",
           "MAX_BLOCKS_PER_LAUNCH", "TILE_ELEMS"]

#: Arrays one kernel launch carries at most (size of its work table); longer lists are split.
MAX_ARRAYS_PER_LAUNCH = 65536
#: Blocks one launch may have (CUDA's grid.x limit).
MAX_BLOCKS_PER_LAUNCH = 2 ** 31 - 1
#: Elements one thread block copies (a multiple of 16, so every vector width divides it).
#: With the work table's block map, 4,096 matched or beat 2,048, 8,192 and 16,384 on an H200
#: for every layout and dtype pair (``bench/bench_bucket_tiles.py``).
TILE_ELEMS = 4096


def _touch(cache: "collections.OrderedDict", key: Any) -> None:
    """Mark ``key`` of a cache newest (evicted by another thread meanwhile: nothing to do)."""
    try:
        cache.move_to_end(key)
    except KeyError:
        pass


def _keep_newest(cache: "collections.OrderedDict", kept: int) -> None:
    """Evict a cache's oldest entries beyond ``kept`` (other threads may evict meanwhile)."""
    try:
        while len(cache) > kept:
            cache.popitem(last=False)
    except KeyError:
        pass


def launch_plan(sizes: Sequence[int], tile: Optional[int] = None) -> List[Tuple[int, int, np.ndarray]]:
    """Split arrays into launches: ``[(first, stop, block_start), ...]`` where ``block_start``
    is the prefix sum of ``ceil(size / tile)`` over ``sizes[first:stop]``; a launch carries at
    most ``MAX_ARRAYS_PER_LAUNCH`` arrays and ``MAX_BLOCKS_PER_LAUNCH`` blocks; ``tile``
    defaults to ``TILE_ELEMS``."""
    tile = TILE_ELEMS if tile is None else tile
    blocks = -(-np.asarray(sizes, dtype=np.int64) // tile)
    plan, first, n = [], 0, len(blocks)
    while first < n:
        stop = min(first + MAX_ARRAYS_PER_LAUNCH, n)
        cumulative = np.cumsum(blocks[first:stop])
        fits = int(np.searchsorted(cumulative, MAX_BLOCKS_PER_LAUNCH, side="right"))
        if fits == 0:
            raise ValueError(f"array of {sizes[first]} elements needs more than "
                             f"{MAX_BLOCKS_PER_LAUNCH} blocks of {tile}")
        stop = first + fits
        plan.append((first, stop, np.concatenate(([0], cumulative[:fits])).astype(np.int64)))
        first = stop
    return plan


def work_tables(pointers: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
                tile: Optional[int] = None) -> Iterator[Tuple[int, int, np.ndarray]]:
    """The launches for arrays at ``pointers`` (addresses): ``(number of arrays, grid, work
    table)`` per launch, the int64 table laid out as ``kernels/common.cuh`` describes; launches
    of zero-length arrays only are left out; ``tile`` as for :func:`launch_plan`."""
    pointers_np = np.asarray(pointers, dtype=np.uint64).view(np.int64)
    offsets_np = np.asarray(offsets, dtype=np.int64)
    sizes_np = np.asarray(sizes, dtype=np.int64)
    for first, stop, block_start in launch_plan(sizes, tile):
        grid = int(block_start[-1])
        if grid == 0:
            continue
        head = 4 * (stop - first) + 1
        table = np.empty(head + (grid + 1) // 2, dtype=np.int64)
        table[:head] = np.concatenate((pointers_np[first:stop], offsets_np[first:stop],
                                       sizes_np[first:stop], block_start))
        block_map = table[head:].view(np.int32)
        block_map[grid:] = 0
        block_map[:grid] = np.repeat(np.arange(stop - first, dtype=np.int32),
                                     np.diff(block_start))
        yield stop - first, grid, table


#: Launches worked out before, newest last: {(pointers, offsets, sizes, tile): [(number of
#: arrays, grid, work table, its bytes)]}. A training step packs each bucket from the same
#: arrays at the same offsets at every step; the bytes' hash is computed once, where it is
#: the key of the table on the GPU.
_PLANS: "collections.OrderedDict[tuple, List[Tuple[int, int, np.ndarray, bytes]]]" = \
    collections.OrderedDict()
PLANS_KEPT = 64


def _planned(pointers: Sequence[int], offsets: Sequence[int],
             sizes: Sequence[int]) -> List[Tuple[int, int, np.ndarray, bytes]]:
    """:func:`work_tables` of these arrays, each table with its bytes, remembered."""
    key = (tuple(pointers), tuple(offsets), tuple(sizes), TILE_ELEMS)
    found = _PLANS.get(key)
    if found is not None:
        _touch(_PLANS, key)
        return found
    found = _PLANS[key] = [(n, grid, table, table.tobytes())
                           for n, grid, table in work_tables(pointers, offsets, sizes)]
    _keep_newest(_PLANS, PLANS_KEPT)
    return found


#: Work tables kept on the GPU, newest last: {(device, stream, table bytes): device array}.
_TABLES: "collections.OrderedDict[Tuple[int, int, bytes], Any]" = collections.OrderedDict()
#: How many: a training step packs and unpacks a few buckets, each with its own table.
TABLES_KEPT = 64


def _device_table(cupy: Any, device: int, stream: int, table: np.ndarray,
                  content: Optional[bytes] = None) -> Any:
    """``table`` on the GPU, uploaded once per (device, stream, content) and then reused.

    The upload is a copy from pageable memory, which first waits for everything queued on the
    stream: done at every call, it made ``pack`` wait for the backward pass it should overlap.
    Arrays at the same addresses (a memory pool's usual reuse) give the same table. Keyed by
    stream too, so the memory of an evicted table is reused only in that stream's order.
    ``content``: ``table.tobytes()``, when the caller has it."""
    key = (device, stream, table.tobytes() if content is None else content)
    found = _TABLES.get(key)
    if found is not None:
        _touch(_TABLES, key)
        return found
    found = _TABLES[key] = cupy.asarray(table)
    _keep_newest(_TABLES, TABLES_KEPT)
    return found


#: Work tables of launches a CUDA graph captured, {(device, table bytes): device array}: every
#: replay reads them again, so unlike the tables above they are never evicted.
_GRAPH_TABLES: Dict[Tuple[int, bytes], Any] = {}
_UPLOAD_STREAMS: Dict[int, Any] = {}  # per GPU: where tables for a capture are uploaded


def _graph_table(cupy: Any, device: int, table: np.ndarray,
                 content: Optional[bytes] = None) -> Any:
    """``table`` on the GPU for a launch being captured into a CUDA graph, kept until
    :func:`release_graph_tables`. Uploaded on a stream of its own that is not capturing, and
    waited for there: the copy from host memory cannot be part of the capture (CUDA refuses
    it, or the graph would read CuPy's reused staging memory at each replay)."""
    key = (device, table.tobytes() if content is None else content)
    found = _GRAPH_TABLES.get(key)
    if found is None:
        side = _UPLOAD_STREAMS.get(device)
        if side is None:
            side = _UPLOAD_STREAMS[device] = cupy.cuda.Stream(non_blocking=True)
        with side:
            found = cupy.asarray(table)
        side.synchronize()
        _GRAPH_TABLES[key] = found
    return found


def release_graph_tables() -> int:
    """Free the work tables kept for CUDA graphs that captured :func:`pack` or :func:`unpack`
    (each distinct table is kept once: 32 bytes per array and 4 per block of 4,096 elements,
    a few KiB for a training step's buckets); call it only once those graphs are gone.
    Returns how many were freed."""
    count = len(_GRAPH_TABLES)
    _GRAPH_TABLES.clear()
    return count
