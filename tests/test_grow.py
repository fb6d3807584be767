"""``comm.grow()`` and GPUCOLL_JOIN: new ranks join a running job (the inverse of shrink).

The store protocol (``gpucoll.rendezvous.joiners``) with threads over one in-process store:
who is admitted, in which order, what is refused, what is cleaned up, what times out. Then
real processes: ``grow()`` with nobody waiting at 1 to 3 ranks, and ``gpucoll run --elastic
--replace 1``, where a SIGKILLed rank's replacement joins the survivors, who shrank first.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import gpucoll
from gpucoll.errors import CommAbortedError, CommTimeoutError
from gpucoll.rendezvous import MemoryStore, PrefixStore
from gpucoll.rendezvous import joiners
from gpucoll.rendezvous.joiners import agree_on_growth, request_to_join
from gpucoll.rendezvous.survivors import death_key, publish_death

from mp_harness import rank_pools
from test_launch import SCRIPTS, _rank_lines, _run

pytestmark = pytest.mark.timeout(60)


def _in_threads(calls):
    """Run each call in a thread; return each one's result or exception, in order."""
    results = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as exc:  # returned, for the test to check
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    return results


def _members(store, world_ranks, epoch="grow1", timeout=10.0):
    comm_store = PrefixStore("world1", store)
    return [lambda r=r: agree_on_growth(comm_store, store, r, world_ranks, epoch,
                                        "world1/grow1", timeout)
            for r in range(len(world_ranks))]


def test_nobody_waiting_every_member_gets_none_and_the_decision_is_removed():
    store = MemoryStore()
    assert _in_threads(_members(store, [0, 1, 2])) == [None, None, None]
    assert not store.check(["world1/grow1/decision"]) and not store.check(["world1/grow1/read"])


def test_newcomers_are_admitted_in_world_rank_order_and_their_deaths_forgotten():
    store = MemoryStore()
    publish_death(store, 1, "signal SIGKILL")
    waiting = _in_threads([lambda w=w: request_to_join(store, w, 0.05) for w in (5, 1)])
    assert all(isinstance(e, CommTimeoutError) for e in waiting)   # nobody grew yet
    assert "asked to join the job (ticket 1) but no communicator's members called grow() " \
           "within 0.05 s" in str(waiting[0])
    # two new requests, then the members grow: the timed-out tickets were withdrawn, so the
    # same world ranks are admitted from their new tickets
    calls = [lambda w=w: request_to_join(store, w, 10.0) for w in (5, 1)]
    results = _in_threads(calls + _members(store, [0, 2, 3]))
    admitted, members = results[:2], results[2:]
    for growth in members:
        assert growth.world_ranks == (0, 1, 2, 3, 5) and growth.joined == (1, 5)
        assert growth.comm_id == "world1/grow1"
    assert [(a.rank, a.world_ranks, a.joined, a.comm_id) for a in admitted] == [
        (4, (0, 1, 2, 3, 5), (1, 5), "world1/grow1"), (1, (0, 1, 2, 3, 5), (1, 5), "world1/grow1")]
    assert not store.check([death_key(1)])   # a later shrink waits for world rank 1 again
    assert not store.check(["world1/grow1/decision"])
    # every ticket was taken: the next grow admits nobody
    assert _in_threads(_members(store, [0, 1, 2, 3, 5], epoch="grow2")) == [None] * 5


def test_a_world_rank_that_is_still_a_member_is_refused():
    store = MemoryStore()
    results = _in_threads([lambda: request_to_join(store, 2, 10.0)] + _members(store, [0, 2]))
    assert isinstance(results[0], CommAbortedError)
    assert str(results[0]) == ("world rank 2: not admitted: world rank 2 is already a member of "
                               "the growing communicator")
    assert results[1:] == [None, None]


def test_a_ticket_whose_rank_never_wrote_its_world_rank_is_skipped(monkeypatch):
    monkeypatch.setattr(joiners, "_TICKET_WAIT", 0.05)
    store = MemoryStore()
    store.add("gpucoll/join/count", 1)   # a joiner that died between its two store calls
    assert _in_threads(_members(store, [0, 1])) == [None, None]


def test_min_size_makes_member_0_wait_for_newcomers():
    store = MemoryStore()
    members = [lambda r=r: agree_on_growth(PrefixStore("world1", store), store, r, [0, 2],
                                           "grow1", "world1/grow1", 10.0, min_size=3)
               for r in range(2)]

    def late_joiner():
        threading.Event().wait(0.3)   # after the members began to wait
        return request_to_join(store, 1, 10.0)

    results = _in_threads(members + [late_joiner])
    assert [g.world_ranks for g in results[:2]] == [(0, 1, 2)] * 2
    assert results[2].rank == 1 and results[2].joined == (1,)
    # nobody comes: member 0 gives up after the timeout and the members stay as they are
    quiet = [lambda r=r: agree_on_growth(PrefixStore("world1", store), store, r, [0, 1, 2],
                                         "grow2", "world1/grow2", 0.1, min_size=4)
             for r in range(3)]
    assert _in_threads(quiet) == [None] * 3


def test_members_time_out_when_member_0_does_not_decide():
    store = MemoryStore()
    comm_store = PrefixStore("world1", store)
    error = _in_threads([lambda: agree_on_growth(comm_store, store, 1, [0, 1], "grow1",
                                                 "world1/grow1", 0.05)])[0]
    assert isinstance(error, CommTimeoutError)
    assert "rank 1: grow: member 0 did not publish who joins within 0.05 s" in str(error)


def test_init_with_gpucoll_join_times_out_when_nobody_grows(monkeypatch):
    monkeypatch.setenv("GPUCOLL_JOIN", "1")
    with pytest.raises(CommTimeoutError, match=r"world rank 1: asked to join the job \(ticket 1\) "
                                               r"but no communicator's members called grow\(\) "
                                               r"within 0\.2 s"):
        gpucoll.init(backend="cpu", rank=1, world_size=2, store=MemoryStore(), timeout=0.2,
                     set_default=False)


pool = rank_pools([1, 2, 3], ids=lambda n: f"world{n}", shared=True)


def rank_grow_alone(comm):
    """grow() with nobody waiting, five times; then the usage errors."""
    same = [comm.grow() is comm for _ in range(5)]
    comm.barrier()
    left = comm._store.missing([f"grow{i}/decision" for i in range(1, 6)])
    x = comm.all_reduce(np.ones(3))   # still usable
    errors = []
    for bad in (0, -1.0, "5", True):
        try:
            comm.grow(timeout=bad)
        except ValueError as exc:
            errors.append(str(exc))
    for bad in (-1, 2.0, True):
        try:
            comm.grow(min_size=bad)
        except ValueError as exc:
            errors.append(str(exc))
    # a group of the job's ranks is no place for newcomers: refused, nothing sent
    groups = [comm.split(0), comm.new_group(list(range(comm.size))), comm.host_group()]
    for group in groups:
        try:
            group.grow()
        except ValueError as exc:
            errors.append(str(exc))
        group.close()
    return same, len(left), x, errors


def test_grow_with_nobody_waiting_returns_the_same_communicator(pool):
    n = pool.world_size
    for r, (same, left, x, errors) in enumerate(pool.run(rank_grow_alone)):
        assert same == [True] * 5
        assert left == 5                      # no decision key stays in the store
        np.testing.assert_array_equal(x, np.full(3, float(n)))
        assert errors == [f"timeout must be a positive number of seconds, got {bad!r}"
                          for bad in (0, -1.0, "5", True)] + [
                          f"min_size must be an int >= 0, got {bad!r}" for bad in (-1, 2.0, True)] \
            + [f"rank {r}: grow() adds ranks to the job's communicator, not to a group made by "
               f"split / new_group / host_group: grow that one, then make the groups again "
               f"from the grown communicator"] * 3


def test_grow_on_a_closed_communicator_is_refused():
    comm = gpucoll.init(backend="cpu", rank=0, world_size=1, set_default=False)
    comm.close()
    with pytest.raises(CommAbortedError, match="grow\\(\\) on a closed or aborted communicator"):
        comm.grow()


def test_launcher_replaces_a_lost_rank_and_it_joins_the_survivors():
    result = _run(["run", "-n", "3", "--elastic", "--replace", "1",
                   str(SCRIPTS / "elastic_replace.py"), "1", "3"], timeout=50)
    assert result.returncode == 0, result.stderr
    assert ("gpucoll run: rank 1 lost (signal SIGKILL); started a process in its place "
            "(replacement 1 of 1), which joins when the others call comm.grow() "
            "(--elastic --replace)") in result.stderr, result.stderr
    assert ("gpucoll run: elastic job finished: 3 of 3 ranks exited 0; lost rank(s) 1 (signal "
            "SIGKILL); 1 replacement(s) started") in result.stderr, result.stderr
    grown = {rank: json.loads(rest) for rank, rest in _rank_lines(result.stdout, "GROWN").items()}
    joined = {rank: json.loads(rest) for rank, rest in _rank_lines(result.stdout, "JOINED").items()}
    assert sorted(grown) == [0, 2] and sorted(joined) == [1]
    for world_rank, report in grown.items():
        assert report["calls"] >= 1
        del report["calls"]
        assert report == {"rank": world_rank, "size": 3, "ranks": [0, 1, 2], "joined": [1]}
    assert joined[1] == {"rank": 1, "size": 3, "ranks": [0, 1, 2], "joined": [1]}
    sums = {rank: json.loads(rest) for rank, rest in _rank_lines(result.stdout, "SUMS").items()}
    # world ranks + 1 summed on the grown communicator, and again after a healthy shrink of
    # it that kept all three (the replacement's death record was cleared when it joined)
    assert sums == {r: [6.0, 6.0, 3] for r in range(3)}


NOBODY_GROWS = """
import os, signal, time
import gpucoll
comm = gpucoll.init(backend="cpu", timeout=20)
if comm.joined:
    raise SystemExit("admitted, but nobody called grow()")
if comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5)
print("DONE", comm.rank, flush=True)
"""


def test_a_replacement_nobody_admits_is_stopped_when_the_others_finish(tmp_path):
    script = tmp_path / "nobody_grows.py"
    script.write_text(NOBODY_GROWS)
    result = _run(["run", "-n", "2", "--elastic", "--replace", "1", str(script)], timeout=40)
    assert result.returncode == 0, result.stderr
    assert ("gpucoll run: the other ranks finished before the replacement(s) for rank(s) 1 were "
            "admitted (nobody called comm.grow()): stopping them") in result.stderr, result.stderr
    assert ("gpucoll run: elastic job finished: 1 of 2 ranks exited 0; lost rank(s) 1 (signal "
            "SIGKILL); 1 replacement(s) started") in result.stderr, result.stderr
    assert "[rank 0] DONE 0" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--replace", "1"], "--replace applies to elastic jobs only: add --elastic"),
    (["--elastic", "--replace", "-1"], "replace must be an integer >= 0, got -1"),
])
def test_replace_usage_errors_exit_2(args, message):
    result = _run(["run", "-n", "2", *args, str(SCRIPTS / "elastic_replace.py"), "0", "0"])
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
