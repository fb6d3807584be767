"""``gpucoll run``: start the ranks of one node, serve their store, stop all of them on a failure.

The launcher of node 0 serves the rendezvous store (:class:`~gpucoll.rendezvous.tcp_store.
TCPStoreServer`) itself, so the ranks only connect to it (``GPUCOLL_LAUNCHER_STORE=1``). Each
rank runs the program in its own session (process group): a Python script (``.py``, a
``python`` shebang, or Python source) or ``-m module`` with ``sys.executable``, anything else
executable (``python3 -u x.py``, a shell script, a binary) as it is (``no_python`` forces
that). The torchrun variables are set::

    RANK = node_rank * nproc + local_rank     WORLD_SIZE = nnodes * nproc
    LOCAL_RANK, LOCAL_WORLD_SIZE = nproc, GROUP_RANK = node_rank
    MASTER_ADDR, MASTER_PORT, GPUCOLL_AUTH_TOKEN, GPUCOLL_LAUNCHER_STORE=1, PYTHONUNBUFFERED=1
    GPUCOLL_LAUNCHER_PID, GPUCOLL_LAUNCHER_PID_NAMESPACE   (see gpucoll.orphan_guard)

and, when several ranks share the node and the user set none of them, ``OMP_NUM_THREADS=1``
and the BLAS thread variables (said once on stderr), so the ranks' math libraries do not
oversubscribe the cores.

Everything a rank writes is copied to the launcher's stdout or stderr with a ``[rank R] ``
prefix as soon as a line ends with ``\n`` or ``\r`` (progress bars stay live). The first rank
that exits non-zero stops the job: the others get up to ``PEER_REPORT_WAIT`` seconds to end on
their own (a peer's abort reaches them within milliseconds, and their errors say why), then
every other rank's process group gets SIGTERM, then SIGKILL after a grace period, and the launcher ends with the root cause's exit code and the last lines
of its stderr. The root cause is the first failure that is not a consequence of another rank's
(a rank whose last error is gpucoll's ``PeerError`` or ``CommAbortedError`` failed because a
peer did): after such a failure the launcher waits up to ``ROOT_CAUSE_WAIT`` seconds for the
rank that started it. With ``elastic`` a rank that fails or is killed does not stop the others:
the launcher records its death in the store (so ``comm.shrink()`` on the survivors need not
wait for it), and the job succeeds when the survivors exit 0; it is stopped as above when
fewer than ``min_ranks`` ranks remain. With ``replace`` it also starts a new process in the
lost rank's place (same rank and local rank, GPUCOLL_JOIN=1), up to that many times on this
node; its ``init()`` waits until the survivors call ``comm.grow()``. With several nodes, the
launchers agree through the store on when the job is over (:mod:`gpucoll.launch_nodes`). SIGINT, SIGTERM and SIGHUP sent to the launcher stop the ranks
the same way (exit 128 + signal number); ``timeout`` stops them with exit code 124. A launcher
killed outright (SIGKILL) cannot. Two layers stop its ranks then: its orphan reaper
(:mod:`gpucoll.orphan_reaper`), a watcher it starts before the ranks, in a session of its own,
that sends every still-running rank's process group SIGTERM, then SIGKILL after
``GPUCOLL_ORPHAN_GRACE`` (ranks that never call ``gc.init()`` and every process a rank started
included); and, in ranks that call ``gc.init()``, the in-rank guard (:mod:`gpucoll.orphan_guard`),
by which a launcher that is itself a rank of another one stops as on SIGTERM when that one dies.

Example::

    from gpucoll.launch import LaunchConfig, run_job
    code = run_job(LaunchConfig("train.py", args=["--epochs", "3"], nproc=4, timeout=600))
"""

from __future__ import annotations

import collections
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Deque, Dict, List, Optional, Sequence, Set, TextIO, Tuple

from .cliutil import UsageError
from .errors import StoreError
from .launch_config import DEFAULT_MULTI_NODE_PORT, KILL_GRACE, LaunchConfig  # noqa: F401
from .launch_config import Plan as _Plan
from .launch_config import plan_launch as _plan
from .launch_nodes import NodesOfJob
from .launch_program import THREAD_VARIABLES, limits_threads, thread_notice
from .launch_reaper import ReaperLink
from .launch_signals import SignalTrap as _SignalTrap
from .launch_signals import describe_exit, exit_code_of  # noqa: F401  (re-exported)
from .launch_signals import signal_group as _signal_group
from .launch_signals import signal_name as _signal_name
from .orphan_guard import guard_rank, launcher_variables

__all__ = [
    "LaunchConfig",
    "UsageError",
    "run_job",
    "launch",
    "exit_code_of",
    "describe_exit",
    "DEFAULT_MULTI_NODE_PORT",
    "KILL_GRACE",
    "STDERR_TAIL_LINES",
    "EXIT_TIMEOUT",
    "ROOT_CAUSE_WAIT",
    "PEER_REPORT_WAIT",
    "THREAD_VARIABLES",
]

STDERR_TAIL_LINES = 50
"""Lines of stderr kept per rank for the failure report."""
EXIT_TIMEOUT = 124
"""Exit code when ``timeout`` fires (as coreutils ``timeout``)."""
EXIT_LAUNCH_FAILED = 1
ROOT_CAUSE_WAIT = 3.0
"""Seconds to wait, after a failure caused by another rank's, for the rank that caused it."""
PEER_REPORT_WAIT = 2.0
"""Seconds the other ranks get, after a failure, to report it and exit before SIGTERM."""

# The last line of a traceback whose error says a peer failed first.
_CONSEQUENCE = re.compile(r"^(?:[\w.]+\.)?(?:PeerError|CommAbortedError): ")
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")

_REAP_TIMEOUT = 5.0  # seconds to wait for SIGKILLed ranks to be reaped
_READER_JOIN_TIMEOUT = 2.0  # seconds to wait for a rank's pipes to drain once it is gone
_POLL_INTERVAL = 0.1  # longest time a signal or the timeout waits to be noticed
NODE_CHECK_INTERVAL = 0.5  # several nodes: seconds between asks whether replacements may go


def _ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


class _Rank:
    """One spawned rank: its process, reader threads and stderr tail."""

    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen):
        self.rank = rank
        self.local_rank = local_rank
        self.proc = proc
        self.returncode: Optional[int] = None
        self.stopped = False  # still running when the launcher began stopping the job
        self.stderr_tail: Deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.threads: List[threading.Thread] = []
        self.join_id: Optional[str] = None   # a replacement's GPUCOLL_JOIN
        self.dismissed = False  # a replacement stopped because nobody was left to admit it


class _Job:
    """Runs one node's ranks from spawn to report; see :func:`run_job`."""

    def __init__(self, cfg: LaunchConfig, plan: _Plan):
        self.cfg = cfg
        self.plan = plan
        self.out = cfg.stdout if cfg.stdout is not None else sys.stdout
        self.err = cfg.stderr if cfg.stderr is not None else sys.stderr
        self.lock = threading.Lock()  # one writer at a time, so lines never interleave
        self.ranks: List[_Rank] = []
        self.exits: "queue.Queue[Tuple[int, int]]" = queue.Queue()  # (local rank, returncode)
        self.lost: List[_Rank] = []  # elastic: ranks that died while the others went on
        self.replaced = 0   # elastic: processes started in lost ranks' places
        self.admitted: Set[str] = set()   # join ids of replacements the members let in
        self.port = plan.port
        self.reaper: Optional[ReaperLink] = None  # started by run()
        self.nodes: Optional[NodesOfJob] = None   # several nodes: started by run()
        self._next_node_check = 0.0

    # -- output ---------------------------------------------------------------------------

    def _write(self, stream: TextIO, text: str) -> None:
        with self.lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # closed or broken pipe: keep draining the ranks
                pass

    def say(self, message: str) -> None:
        """Write a launcher message to stderr."""
        self._write(self.err, f"gpucoll run: {message}\n")

    def _pump(self, pipe, stream: TextIO, prefix: str, tail: Optional[Deque[str]]) -> None:
        """Copy a rank's pipe to ``stream`` with ``prefix``, a segment at a time: each line as
        soon as it ends in ``\n``, and each ``\r``-ended piece (a progress bar) as it comes."""
        fd = pipe.fileno()
        pending = b""
        after_cr = False
        try:
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                pending += chunk
                end = 0
                pieces = []
                for match in _SEGMENT.finditer(pending):
                    segment = match.group(0)
                    end = match.end()
                    if segment == b"\n" and after_cr:  # the rest of a "\r\n" cut in two
                        pieces.append("\n")
                        after_cr = False
                        continue
                    cr = segment.endswith(b"\r")
                    text = segment.rstrip(b"\r\n").decode("utf-8", "replace")
                    if tail is not None and not cr:
                        tail.append(text)
                    pieces.append(f"{prefix}{text}{chr(13) if cr else chr(10)}")
                    after_cr = cr
                pending = pending[end:]
                if pieces:
                    self._write(stream, "".join(pieces))
            if pending:
                text = pending.decode("utf-8", "replace")
                if tail is not None:
                    tail.append(text)
                self._write(stream, f"{prefix}{text}\n")
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()

    def _watch(self, rank: _Rank) -> None:
        self.exits.put((rank.local_rank, rank.proc.wait()))

    # -- life cycle -----------------------------------------------------------------------

    def _rank_env(self, port: int, local_rank: int, join_id: Optional[str] = None) -> Dict[str, str]:
        cfg, plan = self.cfg, self.plan
        env = dict(plan.base_env)
        env.update({
            "RANK": str(cfg.node_rank * cfg.nproc + local_rank),
            "WORLD_SIZE": str(plan.world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(cfg.nproc),
            "GROUP_RANK": str(cfg.node_rank),
            "MASTER_ADDR": plan.master_addr,
            "MASTER_PORT": str(port),
            "GPUCOLL_AUTH_TOKEN": plan.token,
            "GPUCOLL_LAUNCHER_STORE": "1",
            "PYTHONUNBUFFERED": "1",
            **launcher_variables(),
        })
        if self.limit_threads:
            env.update({name: "1" for name in THREAD_VARIABLES})
        if join_id is not None:
            env["GPUCOLL_JOIN"] = join_id
        return env

    @property
    def limit_threads(self) -> bool:
        """Several ranks on this node and no thread variable of the user's."""
        return limits_threads(self.cfg.nproc, self.plan.base_env)

    def _spawn(self, port: int, trap: _SignalTrap) -> None:
        """Start the ranks from the calling thread: a rank's parent-death signal (see
        gpucoll.orphan_guard) fires when the thread that forked it ends, and this thread
        returns from :func:`run_job` only after every rank is reaped. Each rank is registered
        with the orphan reaper before its wait thread can reap it (its pid is then still its)."""
        for local_rank in range(self.cfg.nproc):
            if trap.received:
                return
            self.ranks.append(self._start(port, local_rank))

    def _start(self, port: int, local_rank: int, join_id: Optional[str] = None) -> _Rank:
        """Start one rank's process (a replacement with ``join_id``), its reader threads and
        its wait thread."""
        proc = subprocess.Popen(
            self.plan.command, env=self._rank_env(port, local_rank, join_id),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        if self.reaper is not None:  # before the wait thread below can reap it
            self.reaper.register(proc.pid)
        rank = _Rank(self.cfg.node_rank * self.cfg.nproc + local_rank, local_rank, proc)
        rank.join_id = join_id
        prefix = f"[rank {rank.rank}] "
        rank.threads = [
            threading.Thread(target=self._pump, args=(proc.stdout, self.out, prefix, None),
                             name=f"gpucoll-rank{rank.rank}-stdout", daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, self.err, prefix, rank.stderr_tail),
                             name=f"gpucoll-rank{rank.rank}-stderr", daemon=True),
        ]
        for thread in rank.threads:
            thread.start()
        threading.Thread(target=self._watch, args=(rank,), name=f"gpucoll-rank{rank.rank}-wait",
                         daemon=True).start()
        return rank

    def _record_exits(self, timeout: float) -> Optional[_Rank]:
        """Take one exit notice (waiting up to ``timeout``); return its rank, or None."""
        try:
            local_rank, returncode = self.exits.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        rank = self.ranks[local_rank]
        rank.returncode = returncode
        if returncode == 0 and self.reaper is not None:  # its group is left alone from now on
            self.reaper.ended(rank.proc.pid)
        return rank

    def _alive(self) -> List[_Rank]:
        return [rank for rank in self.ranks if rank.returncode is None]

    def _monitor(self, trap: _SignalTrap, deadline: Optional[float]) -> Tuple[str, Optional[_Rank]]:
        """Wait until every rank exited 0, one failed, a signal came or the deadline passed.

        Returns:
            ("ok" | "failed" | "signal" | "timeout", the failed rank or None).
        """
        while self._alive():
            if trap.received:
                return "signal", None
            wait = _POLL_INTERVAL
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout", None
                wait = min(wait, remaining)
            rank = self._record_exits(wait)
            if rank is not None and rank.returncode != 0:
                if rank.dismissed or (self.cfg.elastic and self._lose(rank)):
                    continue
                return "failed", self._root_cause(rank, trap)
            if self.replaced:
                self._dismiss_unadmitted()
        return "ok", None

    def _drain(self, rank: _Rank) -> None:
        """Let the rank's stderr reader take the last lines (bounded)."""
        for thread in rank.threads[1:]:
            thread.join(_READER_JOIN_TIMEOUT)

    def _is_consequence(self, rank: _Rank) -> bool:
        """The rank failed because a peer did: its last error is a PeerError or
        CommAbortedError (a signal or any other error is a failure of its own)."""
        if rank.returncode is None or rank.returncode < 0:
            return False
        self._drain(rank)
        lines = [line for line in rank.stderr_tail if line.strip()]
        return bool(lines) and _CONSEQUENCE.match(lines[-1]) is not None

    def _root_cause(self, first: _Rank, trap: _SignalTrap) -> _Rank:
        """The first failure that is not a consequence of another rank's (see module doc);
        ``first`` when none shows up within ``ROOT_CAUSE_WAIT`` seconds."""
        if not self._is_consequence(first):
            return first
        deadline = time.monotonic() + ROOT_CAUSE_WAIT
        while self._alive() and not trap.received:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            rank = self._record_exits(min(remaining, _POLL_INTERVAL))
            if rank is not None and rank.returncode != 0 and not self._is_consequence(rank):
                return rank
        return first

    def _lose(self, rank: _Rank) -> bool:
        """Elastic: record ``rank``'s death (here and in the store); True when enough remain."""
        from .launch_elastic import publish_death_briefly

        self.lost.append(rank)
        how = describe_exit(rank.returncode)
        publish_death_briefly(self.plan.master_addr, self.port, self.plan.token, rank.rank, how)
        if self.replaced < self.cfg.replace:
            self.replaced += 1
            join_id = f"node{self.cfg.node_rank}-pid{os.getpid()}-rank{rank.rank}-{self.replaced}"
            self.ranks[rank.local_rank] = self._start(self.port, rank.local_rank, join_id)
            self.say(f"rank {rank.rank} lost ({how}); started a process in its place "
                     f"(replacement {self.replaced} of {self.cfg.replace}), which joins when "
                     f"the others call comm.grow() (--elastic --replace)")
            return True
        remaining = len(self._alive())
        if remaining < self.cfg.min_ranks:
            self.say(f"rank {rank.rank} lost ({how}); {remaining} rank(s) left, fewer than "
                     f"--min-ranks {self.cfg.min_ranks}: stopping the job")
            return False
        self.say(f"rank {rank.rank} lost ({how}); {remaining} rank(s) go on (--elastic)")
        return True

    def _dismiss_unadmitted(self) -> None:
        """When every rank still running here is a replacement no member admitted, and no
        member runs anywhere else either (several nodes: see :mod:`gpucoll.launch_nodes`),
        nobody is left to call ``grow()``: stop them (SIGTERM, SIGKILL after the grace)."""
        from .launch_elastic import admitted_briefly

        alive = self._alive()
        if not alive or any(r.join_id is None or r.join_id in self.admitted for r in alive):
            return
        waiting = [r.join_id for r in alive]
        if self.nodes is None:
            found = admitted_briefly(self.plan.master_addr, self.port, self.plan.token, waiting)
            everyone = True
        else:
            now = time.monotonic()
            if now < self._next_node_check:
                return
            self._next_node_check = now + NODE_CHECK_INTERVAL
            verdict = self.nodes.replacements_verdict(waiting)
            everyone, found = verdict if verdict is not None else (False, None)
        if found is None:   # the store did not answer: ask again later
            return
        mine = found & set(waiting)
        if mine:
            self.admitted |= mine
            if self.nodes is not None:
                self.nodes.withdraw_idle()
            return
        if found or not everyone:  # a member may still call grow(), here or on another node
            return
        where = "of every node " if self.nodes is not None else ""
        self.say(f"the other ranks {where}finished before the replacement(s) for rank(s) "
                 f"{_ranks_text([r.rank for r in alive])} were admitted (nobody called "
                 f"comm.grow()): stopping them")
        for rank in alive:
            rank.dismissed = True
            _signal_group(rank.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.kill_grace
        while self._alive() and time.monotonic() < deadline:
            self._record_exits(_POLL_INTERVAL)
        for rank in self._alive():
            _signal_group(rank.proc.pid, signal.SIGKILL)

    def _end_with_other_nodes(self, outcome: str, trap: _SignalTrap,
                              deadline: Optional[float]) -> None:
        """Several nodes: say this node is done; node 0, when its ranks ended well, serves
        the store on until the other nodes' launchers are done too (bounded)."""
        assert self.nodes is not None
        self.nodes.say_done()
        self.nodes.close()
        if self.cfg.node_rank != 0 or outcome != "ok":
            return
        from . import config

        silence = max(config.get("GPUCOLL_NODE_SILENCE"), 0.0)
        silent, running = self.nodes.await_other_nodes(silence, deadline,
                                                       lambda: bool(trap.received), self.say)
        if silent:
            self.say(f"no word from the launcher(s) of node(s) {_ranks_text(silent)} for "
                     f"{silence:g} s (host lost? GPUCOLL_NODE_SILENCE): closed the store "
                     f"without them")
        if running:
            self.say(f"closed the store while node(s) {_ranks_text(running)} still ran")

    def stop_all(self, trap: _SignalTrap, settle: float = 0.0) -> None:
        """After up to ``settle`` seconds for the ranks to end on their own, SIGTERM every
        rank's process group, SIGKILL after the grace, reap (bounded).

        A signal that reaches the launcher during these waits skips the rest of them.
        """
        settled = time.monotonic() + settle
        while self._alive() and not trap.received and time.monotonic() < settled:
            self._record_exits(min(settled - time.monotonic(), _POLL_INTERVAL))
        while self._record_exits(0.0) is not None:  # ranks that already ended on their own
            pass
        for rank in self._alive():
            rank.stopped = True
        signals_before = len(trap.received)
        # Failed ranks too: children they left behind share their group. Groups of ranks that
        # ended well are left alone (their ids may belong to someone else by now).
        groups = sorted({rank.proc.pid for rank in self.ranks + self.lost  # replaced ones too
                         if rank.returncode != 0})
        for pid in groups:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.kill_grace
        while self._alive() and len(trap.received) == signals_before:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._record_exits(min(remaining, _POLL_INTERVAL))
        for pid in groups:
            _signal_group(pid, signal.SIGKILL)
        deadline = time.monotonic() + _REAP_TIMEOUT
        while self._alive() and time.monotonic() < deadline:
            self._record_exits(_POLL_INTERVAL)

    def join_readers(self) -> None:
        deadline = time.monotonic() + _READER_JOIN_TIMEOUT
        for rank in self.ranks:
            for thread in rank.threads:
                thread.join(max(deadline - time.monotonic(), 0.0))

    def _report_failure(self, failed: _Rank) -> None:
        stopped = [rank.rank for rank in self.ranks if rank.stopped and rank is not failed]
        others = [f"{rank.rank} ({describe_exit(rank.returncode)})" for rank in self.ranks
                  if rank is not failed and not rank.stopped and rank.returncode not in (0, None)]
        message = (f"root cause (first observed failure): rank {failed.rank} failed "
                   f"({describe_exit(failed.returncode)})")
        if stopped:
            message += f"; stopped ranks {_ranks_text(stopped)}"
        if others:
            message += f"; also failed: {', '.join(others)}"
        self.say(message)
        if failed.stderr_tail:
            lines = list(failed.stderr_tail)
            self.say(f"last {len(lines)} stderr lines of rank {failed.rank}:")
            self._write(self.err, "".join(f"[rank {failed.rank}] {line}\n" for line in lines))
        else:
            self.say(f"rank {failed.rank} wrote nothing to stderr")

    def _unreaped_warning(self) -> None:
        left = [rank for rank in self.ranks if rank.returncode is None]
        if left:
            self.say("ranks " + _ranks_text([rank.rank for rank in left]) + " (pids "
                     + _ranks_text([rank.proc.pid for rank in left]) + ") survived SIGKILL "
                     f"for {_REAP_TIMEOUT:g} s (uninterruptible?); they were killed but not reaped")

    def run(self) -> int:
        plan = self.plan
        with _SignalTrap() as trap:
            guard_rank()  # a nested launcher is a rank of the outer one: stop when that dies
            server = None
            port = plan.port
            if plan.bind_host is not None:
                from .rendezvous.tcp_store import TCPStoreServer  # imported lazily: cli stays light

                try:
                    server = TCPStoreServer(host=plan.bind_host, port=plan.port, token=plan.token)
                except (StoreError, OSError) as exc:
                    self.say(f"{exc}; pick another --master-port (0: any free port, one node only)")
                    return EXIT_LAUNCH_FAILED
                port = server.port
            if self.limit_threads and self.cfg.node_rank == 0:
                self.say(thread_notice(self.cfg.nproc))
            self.port = port
            if self.cfg.nnodes > 1:
                self.nodes = NodesOfJob(plan.master_addr, port, plan.token, self.cfg.node_rank,
                                        self.cfg.nnodes)
                self.nodes.start_beating()
            stopped = False
            try:
                start = time.monotonic()
                deadline = None if self.cfg.timeout is None else start + self.cfg.timeout
                if self.cfg.orphan_reaper:
                    self.reaper = ReaperLink(plan.orphan_grace, self.say)
                try:
                    self._spawn(port, trap)
                except OSError as exc:
                    first = self.cfg.node_rank * self.cfg.nproc + len(self.ranks)
                    self.say(f"cannot start rank {first} ({plan.command[0]}): {exc}")
                    outcome, failed = "spawn", None
                else:
                    outcome, failed = self._monitor(trap, deadline)
                running = [rank.rank for rank in self._alive()]
                if outcome != "ok":
                    self.stop_all(trap, PEER_REPORT_WAIT if outcome == "failed" else 0.0)
                    stopped = True
                self.join_readers()
                if self.nodes is not None:
                    self._end_with_other_nodes(outcome, trap, deadline)
            finally:
                if self.nodes is not None:
                    self.nodes.close()
                if not stopped and self._alive():  # an unexpected error: never leave orphans
                    self.stop_all(trap)
                if self.reaper is not None:
                    self.reaper.close()
                if server is not None:
                    server.close()
                if plan.token:  # segments of a rank killed while setting up its communicator
                    from .transports.shm import sweep_job

                    sweep_job(plan.token)

            if outcome == "ok":
                if self.lost:
                    lost = ", ".join(f"{r.rank} ({describe_exit(r.returncode)})" for r in self.lost)
                    finished = sum(r.returncode == 0 for r in self.ranks)
                    started = f"; {self.replaced} replacement(s) started" if self.replaced else ""
                    self.say(f"elastic job finished: {finished} of {len(self.ranks)} ranks "
                             f"exited 0; lost rank(s) {lost}{started}")
                return 0
            if outcome == "failed":
                assert failed is not None and failed.returncode is not None
                self._report_failure(failed)
                code = exit_code_of(failed.returncode)
            elif outcome == "timeout":
                self.say(f"timed out after {self.cfg.timeout:g} s; ranks still running: "
                         f"{_ranks_text(running)} (stopped)")
                code = EXIT_TIMEOUT
            elif outcome == "signal":
                signum = trap.received[0]
                what = f"stopped ranks {_ranks_text(running)}" if running else "no rank was running"
                self.say(f"interrupted by {_signal_name(signum)}; {what}")
                code = 128 + signum
            else:
                code = EXIT_LAUNCH_FAILED
            self._unreaped_warning()
            return code


def run_job(cfg: LaunchConfig) -> int:
    """Run one node's share of a job and return the launcher's exit code.

    Blocks until every rank has exited. Called from the main thread, it handles SIGINT, SIGTERM
    and SIGHUP for the duration (stopping the ranks and returning 128 + signal number) and then
    restores the previous handlers.

    Args:
        cfg: what to run; see :class:`LaunchConfig`.

    Returns:
        0 when every rank exited 0; the first failed rank's exit code (128 + N for signal N);
        124 when ``cfg.timeout`` passed; 128 + N when signal N stopped the launcher;
        1 when the store or a rank could not be started.

    Raises:
        UsageError: ``cfg`` is invalid (nothing was started).
    """
    return _Job(cfg, _plan(cfg)).run()


def launch(program: str, args: Sequence[str] = (), *, nproc: int = 1, module: bool = False,
           **options: object) -> int:
    """Shorthand for ``run_job(LaunchConfig(program, args, nproc, module, **options))``.

    Example::

        assert launch("worker.py", ["--size", "1024"], nproc=3, timeout=60) == 0
    """
    return run_job(LaunchConfig(program, tuple(args), nproc, module, **options))  # type: ignore[arg-type]
