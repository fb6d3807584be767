"""The C arguments that gpucoll's NCCL backend makes CuPy's REAL NCCL binding pass, no GPU.

tests/test_real_cupy.py holds the emulation's names and signatures against CuPy's; this goes one
step further. Two ranks (threads) of the NCCL backend run over the emulated CUDA runtime, but
``cupy.cuda.nccl`` is CuPy's own Cython binding, and ``libnccl.so.2`` is a stand-in
(tests/nccl_stub/libnccl_stub.c, built here with the host C compiler and put in front of the
real library with LD_PRELOAD) that records each call's C arguments and moves no data. So
CuPy's real argument conversion runs, and the test reads what NCCL itself would receive:
element counts, ncclDataType_t and ncclRedOp_t codes, roots, peers, group brackets, the
caller's stream handle, the unique id every rank passed, split colors and keys, destroy.

Skipped, with the reason, without CuPy's NCCL binding or a C compiler.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

import pytest

try:
    import cupy.cuda.nccl as real_nccl
except Exception as exc:  # ImportError, or a CUDA install CuPy cannot load
    pytest.skip(f"CuPy is not importable ({type(exc).__name__}: {exc})", allow_module_level=True)
if not getattr(real_nccl, "available", False):
    pytest.skip("CuPy has no NCCL binding here (pip install nvidia-nccl-cu12)",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
LINE = re.compile(r"(\w+)(?: comm=(\S+))?((?: \w+=\S+)*)$")

# ncclDataType_t and ncclRedOp_t, from nccl.h
UINT8, INT32, UINT32, INT64, FLOAT32, BFLOAT16 = 1, 2, 3, 4, 7, 9
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    """Run tests/scripts/real_nccl_binding.py against the stub: ``(per-rank calls, ranks'
    streams and GPUs, every call in order)``."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler to build the NCCL stand-in")
    work = tmp_path_factory.mktemp("nccl_stub")
    library, log = work / "libnccl.so.2", work / "calls.log"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library),
                    os.path.join(HERE, "nccl_stub", "libnccl_stub.c")], check=True, timeout=60)
    env = dict(os.environ, LD_PRELOAD=str(library), STUB_NCCL_LOG=str(log),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GPUCOLL_DEBUG", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "real_nccl_binding.py")],
                          capture_output=True, text=True, timeout=90, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    rank_of, per_rank, ordered = {}, defaultdict(list), []
    for text in log.read_text().splitlines():
        name, comm, fields = LINE.match(text).groups()
        args = dict(field.split("=", 1) for field in fields.split())
        ordered.append((name, comm, args))
        if name == "init":
            rank_of[comm] = int(args["rank"])
        if comm in rank_of:
            per_rank[rank_of[comm]].append((name, args))
    assert set(rank_of.values()) == {0, 1}, log.read_text()
    return per_rank, info, ordered


def _brief(call, keys):
    name, args = call
    return (name,) + tuple(int(args[k], 0) if k != "stream" else int(args[k], 16)
                           if args[k] != "(nil)" else 0 for k in keys)


def test_every_rank_joins_with_the_same_unique_id(calls):
    per_rank, _, _ = calls
    inits = [per_rank[r][0][1] for r in (0, 1)]
    assert [int(a["nranks"]) for a in inits] == [2, 2]
    assert inits[0]["id"] == inits[1]["id"]  # rank 0's ncclGetUniqueId, through the store


def test_collectives_pass_element_counts_nccl_codes_and_the_callers_stream(calls):
    per_rank, info, _ = calls
    for rank in (0, 1):
        stream = info["ranks"][str(rank)]["stream"]
        ops = [c for c in per_rank[rank] if c[0] in ("allReduce", "reduce", "broadcast",
                                                     "allGather", "reduceScatter")]
        expected = [("allReduce", 6, FLOAT32, SUM, 1, stream),             # float32 (6,)
                    ("allReduce", 6, FLOAT32, AVG, 0, stream)]             # complex64 (3,): pairs
        if info["bfloat16"]:
            expected.append(("allReduce", 4, BFLOAT16, MAX, 1, stream))
        got = [_brief(c, ("count", "datatype", "op", "inplace", "stream"))
               for c in ops[:len(expected)]]
        assert got == expected, (rank, got)
        rest = ops[len(expected):]
        assert _brief(rest[0], ("count", "datatype", "op", "root", "stream")) == \
            ("reduce", 5, INT64, MIN, 1, stream)
        assert _brief(rest[1], ("count", "datatype", "root", "inplace", "stream")) == \
            ("broadcast", 30, UINT8, 1, 1, stream)                        # int16 (3, 5): bytes
        assert _brief(rest[2], ("count", "datatype", "stream")) == \
            ("allGather", 32, UINT8, stream)                              # float64 (4,): bytes
        assert _brief(rest[3], ("count", "datatype", "op", "stream")) == \
            ("reduceScatter", 3, UINT32, PROD, stream)                    # per-rank count
        assert _brief(rest[4], ("count", "datatype", "op", "inplace", "stream")) == \
            ("allReduce", 1, INT32, SUM, 1, stream)                       # the barrier
        assert len(rest) == 5


def test_all_to_all_is_one_group_of_byte_sends_and_receives(calls):
    per_rank, info, ordered = calls
    for rank in (0, 1):
        stream = info["ranks"][str(rank)]["stream"]
        p2p = [_brief(c, ("count", "datatype", "peer", "stream")) for c in per_rank[rank]
               if c[0] in ("send", "recv")]
        last = ("send", 40, UINT8, 1, stream) if rank == 0 else ("recv", 40, UINT8, 0, stream)
        assert p2p[:3] == [("send", 16, UINT8, 1 - rank, stream),
                           ("recv", 16, UINT8, 1 - rank, stream), last], (rank, p2p)
    # each rank's grouped calls (all_to_all's, sendrecv's, then batch_isend_irecv's) sit
    # between its own thread's groupStart and groupEnd
    by_thread = defaultdict(list)
    for name, _, args in ordered:
        by_thread[args["thread"]].append(name)
    groups = []
    for names in by_thread.values():
        assert names.count("groupStart") == names.count("groupEnd"), names
        starts = [i for i, n in enumerate(names) if n == "groupStart"]
        if starts:
            groups.append([names[i + 1:names.index("groupEnd", i)] for i in starts])
    assert groups == [[["send", "recv"], ["send", "recv"],
                       ["send", "send", "recv", "recv"]]] * 2, groups


def test_sendrecv_is_one_group_of_one_send_and_one_receive(calls):
    per_rank, info, ordered = calls
    for rank in (0, 1):
        other, stream = 1 - rank, info["ranks"][str(rank)]["stream"]
        p2p = [c for c in per_rank[rank] if c[0] in ("send", "recv")]
        assert [_brief(c, ("count", "datatype", "peer", "stream")) for c in p2p[3:5]] == \
            [("send", 12 + 4 * rank, UINT8, other, stream),     # x: float32 (3 + rank,)
             ("recv", 12 + 4 * other, UINT8, other, stream)], (rank, p2p)  # out: (3 + other,)
        thread = p2p[3][1]["thread"]
        names = [name for name, _, args in ordered if args["thread"] == thread]
        start = [i for i, name in enumerate(names) if name == "groupStart"][1]  # its second
        assert names[start:start + 4] == ["groupStart", "send", "recv", "groupEnd"], names


def test_batch_isend_irecv_is_one_group_of_every_send_and_receive(calls):
    per_rank, info, ordered = calls
    for rank in (0, 1):
        other, stream = 1 - rank, info["ranks"][str(rank)]["stream"]
        p2p = [c for c in per_rank[rank] if c[0] in ("send", "recv")]
        assert [_brief(c, ("count", "datatype", "peer", "stream")) for c in p2p[5:]] == \
            [("send", 16 + 8 * rank, UINT8, other, stream),     # int64 (2 + rank,)
             ("send", 5, UINT8, other, stream),
             ("recv", 16 + 8 * other, UINT8, other, stream),    # int64 (2 + other,)
             ("recv", 5, UINT8, other, stream)], (rank, p2p)
        thread = p2p[5][1]["thread"]
        names = [name for name, _, args in ordered if args["thread"] == thread]
        start = len(names) - 1 - names[::-1].index("groupStart")  # the rank's last group
        assert names[start:start + 6] == ["groupStart", "send", "send", "recv", "recv",
                                          "groupEnd"], names


def test_split_passes_color_and_key_and_every_communicator_is_destroyed(calls):
    per_rank, _, ordered = calls
    splits = {r: [a for n, a in per_rank[r] if n == "split"] for r in (0, 1)}
    assert [(int(a["color"]), int(a["key"])) for a in splits[0]] == [(-1, 3)]  # None: no color
    assert [(int(a["color"]), int(a["key"])) for a in splits[1]] == [(7, 3)]
    assert splits[0][0]["child"] == "(nil)"
    destroyed = [comm for name, comm, _ in ordered if name == "destroy"]
    made = [comm for name, comm, _ in ordered if name == "init"] + [splits[1][0]["child"]]
    assert sorted(destroyed) == sorted(made)  # each once: the child, then both parents
    assert not [name for name, _, _ in ordered if name == "abort"]
