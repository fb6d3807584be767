"""Sharded checkpoints: gpucoll's ``save_checkpoint`` / ``load_checkpoint`` of FSDP + Adam state
against torch.distributed.checkpoint (DCP) saving and loading the same slices as sharded
DTensors over Gloo, in the same ranks and the same run.

    gpucoll run -n 2 bench/bench_checkpoint.py [--elements 4M,32M] [--units 8] [--repeat 3]
        [--dir DIRECTORY]

Each rank holds 1 / n of the parameters and of Adam's two moments (three float32 arrays per
unit). gpucoll writes each rank's slices to one .npy file per key and rank 0 the metadata;
DCP writes the same bytes as DTensors sharded along dimension 0 (one per unit and key) with
its FileSystemWriter. Both fsync their files. The floor beside them: each rank writing its
bytes with one ``np.save`` per key and an fsync (no metadata, no agreement). Every load is
checked element for element
against what was saved before timing counts. Times are the slowest rank's, best of
``--repeat``; the two take turns round by round. Loads read files the page cache still holds
(just written), for both. The async columns: the time until ``save_checkpoint(...,
async_write=True)`` and ``dcp.async_save`` return (what a training step waits for; each is
then waited for, untimed, before the next round). Needs torch (CPU build).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpucoll as gc  # noqa: E402
from gpucoll.ddp import FullyShardedParameters  # noqa: E402


def _count(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1]] if text[-1] in scale else int(text)


def make_fsdp(comm, elements: int, units: int, seed: int):
    """FSDP + Adam over ``units`` square-ish weights of ``elements`` floats in all, after one
    step (so the moments exist); its slices are seeded per rank."""
    rows = max(elements // units // 1024, 1)
    layers = [[np.zeros((rows, 1024), np.float32)] for _ in range(units)]
    fsdp = FullyShardedParameters(comm, layers, "adam", lr=1e-3, sync_from=None)
    rng = np.random.default_rng([seed, comm.rank])
    for index in range(units):
        fsdp.reduce_gradients(index, [rng.standard_normal((rows, 1024), np.float32)])
    fsdp.step()
    return fsdp


def slices(fsdp):
    """key -> this rank's slice of each unit (what both libraries save)."""
    out = {"param": fsdp.shards()}
    for key in ("m", "v"):
        out[key] = [slot[key] for slot in fsdp.optimizer.state]
    return out


def raw_save(fsdp, directory: str) -> None:
    """The floor: this rank's slices, one np.save per key, fsynced."""
    for key, arrays in slices(fsdp).items():
        path = os.path.join(directory, f"{key}-{fsdp.comm.rank}.npy")
        with open(path, "wb") as f:
            np.save(f, np.concatenate(arrays))
            f.flush()
            os.fsync(f.fileno())


def timed(comm, call) -> float:
    comm.barrier()
    start = time.perf_counter()
    call()
    mine = time.perf_counter() - start
    return max(comm.all_gather_object(mine))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", default="4M,32M", help="parameters in all, comma list")
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary "
                                                     "directory, removed after)")
    args = parser.parse_args()
    comm = gc.init(backend="cpu")
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from gpucoll.perf.devices import _Host
    from gpucoll.perf.gloo import GlooSide

    GlooSide(comm, _Host(), timeout=120.0)
    mesh = init_device_mesh("cpu", (comm.size,))
    base = comm.broadcast_object(args.dir or tempfile.mkdtemp(prefix="gpucoll-ckpt-bench-")
                                 if comm.rank == 0 else None)
    if comm.rank == 0:
        print(f"# sharded checkpoint of FSDP + Adam (param, m, v), {comm.size} ranks, "
              f"{args.units} units, best of {args.repeat}, slowest rank; torch {torch.__version__}")
        print(f"# {'elements':>9} {'MiB all':>8} {'raw save s':>11} {'save gc s':>10} "
              f"{'save dcp s':>11} {'dcp/gc':>7} {'load gc s':>10} {'load dcp s':>11} "
              f"{'dcp/gc':>7} {'async gc s':>11} {'async dcp s':>12} {'dcp/gc':>7}")
    try:
        for seed, elements in enumerate(_count(e) for e in args.elements.split(",")):
            source = make_fsdp(comm, elements, args.units, seed)
            target = make_fsdp(comm, elements, args.units, seed + 100)
            saved = {k: [a.copy() for a in v] for k, v in slices(source).items()}

            def dtensors(fsdp):
                return {f"{key}.{unit}": DTensor.from_local(torch.from_numpy(array), mesh,
                                                            [Shard(0)], run_check=False)
                        for key, arrays in slices(fsdp).items()
                        for unit, array in enumerate(arrays)}

            ours, theirs = os.path.join(base, "gpucoll"), os.path.join(base, "dcp")
            floor = os.path.join(base, "raw")
            os.makedirs(floor, exist_ok=True)
            runs = {"raw save": lambda: raw_save(source, floor),
                    "save gc": lambda: source.save_checkpoint(ours),
                    "save dcp": lambda: dcp.save(dtensors(source), checkpoint_id=theirs),
                    "load gc": lambda: target.load_checkpoint(ours),
                    "load dcp": lambda: dcp.load(dtensors(target), checkpoint_id=theirs)}
            pending = {}

            def start_gc():
                pending["gc"] = source.save_checkpoint(ours, async_write=True)

            def start_dcp():
                pending["dcp"] = dcp.async_save(dtensors(source), checkpoint_id=theirs)

            runs["async gc"], runs["async dcp"] = start_gc, start_dcp
            best = {name: float("inf") for name in runs}
            for _ in range(args.repeat):
                for name in ("raw save", "save gc", "save dcp"):
                    best[name] = min(best[name], timed(comm, runs[name]))
                for name in ("async gc", "async dcp"):
                    best[name] = min(best[name], timed(comm, runs[name]))
                    if name == "async gc":
                        pending.pop("gc").wait()
                    else:
                        pending.pop("dcp").result()
                    comm.barrier()
                for name in ("load gc", "load dcp"):
                    for key, arrays in slices(target).items():   # loads must write these
                        for array in arrays:
                            array[...] = -1
                    best[name] = min(best[name], timed(comm, runs[name]))
                    for key, arrays in slices(target).items():
                        for got, want in zip(arrays, saved[key]):
                            if not np.array_equal(got, want):
                                raise AssertionError(f"{name}: {key} differs after the load")
            total = 3 * source.total_elements * 4 / (1 << 20)
            if comm.rank == 0:
                print(f"  {elements:>9} {total:>8.0f} {best['raw save']:>11.3f} "
                      f"{best['save gc']:>10.3f} "
                      f"{best['save dcp']:>11.3f} {best['save dcp'] / best['save gc']:>7.2f} "
                      f"{best['load gc']:>10.3f} {best['load dcp']:>11.3f} "
                      f"{best['load dcp'] / best['load gc']:>7.2f} {best['async gc']:>11.3f} "
                      f"{best['async dcp']:>12.3f} "
                      f"{best['async dcp'] / best['async gc']:>7.2f}", flush=True)
    finally:
        comm.barrier()
        if comm.rank == 0 and args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        torch.distributed.destroy_process_group()
        comm.close()


if __name__ == "__main__":
    main()
