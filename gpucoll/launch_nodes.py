"""``gpucoll run --nnodes N``: the launchers of a job's nodes agree, through the store that
node 0's launcher serves, on when the job is over.

Node 0's launcher serves the job's store, and used to close it as soon as its own ranks had
exited. Ranks of other nodes still using it then failed (a replacement waiting to be admitted
lost its store and its node's launcher reported the whole job failed), and a replacement
nobody could admit any more was stopped only on one node. Now:

- Node 0's launcher, once its ranks are done, serves the store on until every other node's
  launcher says it is done (``exited``) or has gone silent: each of them adds 1 to its
  ``beat`` counter every :data:`BEAT_INTERVAL` seconds, and one that has not for
  ``GPUCOLL_NODE_SILENCE`` seconds (default 10: its host lost, its launcher killed, the link
  cut) is not waited for.
- A node on which no member rank runs any more, only replacements waiting to be admitted (or
  nothing), says so (``idle``, with the replacements' join ids). When every node is idle and
  none of the listed replacements was admitted, no member is left anywhere to call
  ``comm.grow()``: each launcher stops its own waiting replacements, as one node's launcher
  alone does. A node whose replacement was admitted withdraws its ``idle``.

Every store call here is best effort with a short budget (:func:`~gpucoll.rendezvous.
best_effort.best_effort`): the store may be gone with node 0's host.

Keys::

    gpucoll/launch/beat/<node>     counter, every BEAT_INTERVAL s (nodes other than 0)
    gpucoll/launch/idle/<node>     join ids of the node's waiting replacements, comma-joined
    gpucoll/launch/exited/<node>   the node's launcher is done (any outcome)
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Set, Tuple

__all__ = ["BEAT_INTERVAL", "NodesOfJob"]

BEAT_INTERVAL = 1.0   # seconds between a node launcher's beats
CALL_BUDGET = 2.0     # seconds one best-effort store call may take
SAY_WAITING_AFTER = 2.0   # seconds node 0 waits for the others before it says so
_PREFIX = "gpucoll/launch"


def _key(kind: str, node: int) -> str:
    return f"{_PREFIX}/{kind}/{node}"


class NodesOfJob:
    """One node launcher's side of the agreement above (see the module doc)."""

    def __init__(self, addr: str, port: int, token: str, node_rank: int, nnodes: int):
        self.addr, self.port, self.token = addr, port, token
        self.node_rank, self.nnodes = node_rank, nnodes
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None
        self._idle: Optional[List[str]] = None   # what this node last said it waits with

    def _connect(self, timeout: float):
        from .rendezvous.tcp_store import TCPStore  # lazily: the launcher's CLI stays light

        return TCPStore(self.addr, self.port, token=self.token, timeout=timeout)

    def _call(self, call: Callable[[Any], Any]) -> Tuple[bool, Any]:
        """``call(store)`` on a new connection, held to :data:`CALL_BUDGET` seconds."""
        from .rendezvous.best_effort import best_effort

        def run() -> Any:
            with self._connect(CALL_BUDGET) as store:
                return call(store)

        return best_effort(run, CALL_BUDGET)

    # ------------------------------------------------------------------ beats
    def start_beating(self) -> None:
        """Nodes other than 0: add 1 to this node's beat every :data:`BEAT_INTERVAL` s until
        :meth:`close` (a thread; store errors are retried at the next beat)."""
        if self.node_rank == 0 or self._beat is not None:
            return
        self._beat = threading.Thread(target=self._beating, name="gpucoll-node-beat",
                                      daemon=True)
        self._beat.start()

    def _beating(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect(BEAT_INTERVAL * 2)
                store.add(_key("beat", self.node_rank), 1)
            except Exception:  # the store is not up yet, or gone: try again at the next beat
                if store is not None:
                    try:
                        store.close()
                    except Exception:
                        pass
                store = None
            self._stop.wait(BEAT_INTERVAL)
        if store is not None:
            try:
                store.close()
            except Exception:
                pass

    def close(self) -> None:
        """Stop beating. The thread is not waited for long: it is a daemon, and a beat after
        the end is harmless."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(0.2)

    # ------------------------------------------------------------------ replacements
    def replacements_verdict(self, waiting: List[str]) -> Optional[Tuple[bool, Set[str]]]:
        """Say that this node runs no member, only the replacements ``waiting`` (join ids),
        and read the others: ``(every node idle, the listed join ids anywhere that were
        admitted)``; None when the store did not answer in time."""
        from .rendezvous.joiners import admitted_key

        def read(store: Any) -> Tuple[bool, Set[str]]:
            if self._idle != waiting:
                store.set(_key("idle", self.node_rank), ",".join(waiting).encode())
            keys = [_key("idle", node) for node in range(self.nnodes)]
            if not store.check(keys):
                listed = list(waiting)
                everyone = False
            else:
                listed = [join_id for key in keys
                          for join_id in store.get(key, CALL_BUDGET).decode().split(",") if join_id]
                everyone = True
            return everyone, {join_id for join_id in listed if store.check([admitted_key(join_id)])}

        done, verdict = self._call(read)
        if not done:
            return None
        self._idle = list(waiting)
        return verdict

    def withdraw_idle(self) -> None:
        """A replacement of this node was admitted: a member runs here again."""
        if self._idle is not None and self._call(
                lambda store: store.delete(_key("idle", self.node_rank)))[0]:
            self._idle = None

    # ------------------------------------------------------------------ the end
    def say_done(self) -> bool:
        """This node's launcher is done (its ranks ended, whatever the outcome): idle with
        nothing waiting, and exited. True when the store took it in time."""
        def tell(store: Any) -> None:
            store.set(_key("idle", self.node_rank), b"")
            store.set(_key("exited", self.node_rank), b"1")

        return bool(self._call(tell)[0])

    def await_other_nodes(self, silence: float, deadline: Optional[float],
                          interrupted: Callable[[], bool],
                          say: Callable[[str], None]) -> Tuple[List[int], List[int]]:
        """Node 0: serve on until every other node's launcher is done or silent for
        ``silence`` seconds, the ``deadline`` (monotonic) passes or ``interrupted()``;
        ``say`` tells once when that takes more than :data:`SAY_WAITING_AFTER` seconds.

        Returns:
            ``(silent, running)``: nodes given up on for silence, and nodes still running
            when the deadline or an interruption ended the wait.
        """
        pending = set(range(1, self.nnodes))
        beats = {node: (None, time.monotonic()) for node in pending}  # (count, since)
        silent: List[int] = []
        started, said = time.monotonic(), False
        while pending and not interrupted():
            now = time.monotonic()
            if not said and now - started >= SAY_WAITING_AFTER:
                said = True
                say(f"this node's ranks are done; serving the store until the launcher(s) of "
                    f"node(s) {', '.join(map(str, sorted(pending)))} are done too")
            if deadline is not None and now >= deadline:
                break

            def read(store: Any) -> dict:
                found = {}
                for node in sorted(pending):
                    if store.check([_key("exited", node)]):
                        found[node] = "exited"
                    elif store.check([_key("beat", node)]):
                        found[node] = int(store.get(_key("beat", node), CALL_BUDGET))
                return found

            done, found = self._call(read)
            for node in sorted(pending):
                state = found.get(node) if done else None
                if state == "exited":
                    pending.discard(node)
                    continue
                count, since = beats[node]
                if state is not None and state != count:
                    beats[node] = (state, now)
                elif now - since >= silence:
                    pending.discard(node)
                    silent.append(node)
            if pending:
                time.sleep(min(BEAT_INTERVAL / 2, max(0.0, (deadline or now + 1) - now)))
        return silent, sorted(pending)
