"""torch CPU tensors (and any host DLPack array) through the CPU backend, in place, results in
the caller's type; the ddp helpers and metrics take them too. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest

from mp_harness import run_ranks

pytest.importorskip("torch", reason="torch tensors need torch (pip install torch; CPU is enough)")

pytestmark = pytest.mark.timeout(120)


def rank_tensors(comm):
    import torch

    from gpucoll.ddp import metrics

    out = {}
    x = torch.full((4,), float(comm.rank + 1))
    result = comm.all_reduce(x)
    out["all_reduce"] = (type(result).__name__, result is x, x.tolist())
    gathered = comm.all_gather(torch.tensor([comm.rank * 10, comm.rank * 10 + 1]))
    out["all_gather"] = (type(gathered).__name__, gathered.tolist())
    b = torch.arange(3, dtype=torch.float64) if comm.rank == 0 else torch.zeros(3, dtype=torch.float64)
    comm.broadcast(b, 0)
    out["broadcast"] = b.tolist()
    half = torch.full((5,), 1.5 * (comm.rank + 1), dtype=torch.bfloat16)
    comm.all_reduce(half)
    out["bfloat16"] = (str(half.dtype), half.float().tolist())
    total = metrics.all_reduce_metrics(comm, {"loss": torch.tensor(comm.rank + 1.0)})
    out["metrics"] = total["loss"]
    from gpucoll.ddp.bucketer import Bucketer, broadcast_parameters

    params = [torch.full((3,), float(comm.rank)), torch.full((2, 2), 10.0 * comm.rank)]
    broadcast_parameters(comm, params, root=1)
    out["broadcast_parameters"] = [p.tolist() for p in params]
    grads = [torch.full((3,), float(comm.rank + 1)), torch.full((2, 2), 2.0 * (comm.rank + 1))]
    averaged = Bucketer(comm, params).reduce(grads)
    out["bucketer"] = [(type(g).__name__, g.tolist()) for g in averaged]
    try:
        comm.all_reduce([1.0, 2.0])
    except TypeError as exc:
        out["refused"] = str(exc)
    return out


def test_torch_cpu_tensors_in_place_in_their_own_type():
    results = run_ranks(rank_tensors, 2, timeout=90)
    for rank, out in enumerate(results):
        assert out["all_reduce"] == ("Tensor", True, [3.0] * 4), out
        assert out["all_gather"] == ("Tensor", [[0, 1], [10, 11]]), out
        assert out["broadcast"] == np.arange(3.0).tolist(), out
        assert out["bfloat16"] == ("torch.bfloat16", [4.5] * 5), out
        assert out["metrics"] == 3.0, out  # sum of 1.0 and 2.0
        assert out["broadcast_parameters"] == [[1.0] * 3, [[10.0] * 2] * 2], out
        assert out["bucketer"] == [("Tensor", [1.5] * 3), ("Tensor", [[3.0] * 2] * 2)], out
        assert "list" in out["refused"], out
