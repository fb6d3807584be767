"""What ``gpucoll run`` is asked to do (:class:`LaunchConfig`) and the checked plan made of it
(:func:`plan_launch`): world size, where the store binds, the auth token, the command and the
ranks' base environment. Every usage error is raised here, before anything starts."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, TextIO, Tuple

from . import config
from .cliutil import UsageError
from .launch_program import program_command

__all__ = ["LaunchConfig", "Plan", "plan_launch", "DEFAULT_MULTI_NODE_PORT", "KILL_GRACE"]

DEFAULT_MULTI_NODE_PORT = 29500
KILL_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL when ranks are stopped."""


@dataclass
class LaunchConfig:
    """What to run and how (the ``gpucoll run`` options).

    Attributes:
        program: path of the script, or the module name when ``module`` is true.
        args: arguments passed to the program untouched.
        nproc: ranks started on this node.
        module: run ``program`` as ``python -m program``.
        no_python: run ``program`` as an executable even when it is a Python script
            (torchrun's ``--no-python``).
        nnodes: nodes in the job; each runs its own launcher with the same ``nproc``.
        node_rank: this node's index (0 serves the store).
        master_addr: host of the store. One node: the address the store binds (default
            127.0.0.1). Several nodes: required; the store binds 0.0.0.0.
        master_port: port of the store. Default: 0 (an ephemeral port) for one node,
            29500 for several.
        timeout: wall-clock limit of the whole job in seconds (None: no limit).
        kill_grace: seconds between SIGTERM and SIGKILL when ranks are stopped.
        env: base environment of the ranks (None: this process's environment).
            ``GPUCOLL_AUTH_TOKEN`` is taken from it when set.
        stdout: where prefixed rank stdout lines go (None: ``sys.stdout`` at run time).
        stderr: where prefixed rank stderr lines and launcher messages go (None: ``sys.stderr``).
        elastic: a rank that dies does not stop the others (see the module doc).
        min_ranks: with ``elastic``, stop the job when fewer of this node's ranks remain.
        replace: with ``elastic``, start a new process in a lost rank's place, at most this
            many times on this node; it joins the survivors when they call ``comm.grow()``.
        orphan_reaper: start the watcher that stops the ranks' process groups if this
            launcher is killed (:mod:`gpucoll.orphan_reaper`); False only to measure its cost.
    """

    program: str
    args: Sequence[str] = ()
    nproc: int = 1
    module: bool = False
    no_python: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    timeout: Optional[float] = None
    kill_grace: float = KILL_GRACE
    env: Optional[Mapping[str, str]] = None
    stdout: Optional[TextIO] = None
    stderr: Optional[TextIO] = None
    elastic: bool = False
    min_ranks: int = 1
    replace: int = 0
    orphan_reaper: bool = True


@dataclass(frozen=True)
class Plan:
    """A validated :class:`LaunchConfig` with every default resolved."""

    world_size: int
    bind_host: Optional[str]  # None: this node does not serve the store
    port: int
    master_addr: str
    token: str
    command: Tuple[str, ...]
    base_env: Dict[str, str]
    orphan_grace: float = 3.0  # GPUCOLL_ORPHAN_GRACE of the ranks' environment


def token_hint() -> str:
    return (f"export the same secret on every node before running gpucoll, e.g. on each node:\n"
            f"    export GPUCOLL_AUTH_TOKEN={secrets.token_hex(16)}")


def plan_launch(cfg: LaunchConfig) -> Plan:
    """Check ``cfg`` and resolve its defaults.

    Raises:
        UsageError: the message says which value is wrong and why.
    """
    def need_int(name: str, value: object, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
        return value

    nproc = need_int("nproc (-n)", cfg.nproc, 1)
    nnodes = need_int("nnodes", cfg.nnodes, 1)
    node_rank = need_int("node_rank", cfg.node_rank, 0)
    if node_rank >= nnodes:
        raise UsageError(f"node_rank must be in [0, {nnodes - 1}] for nnodes={nnodes}, got {node_rank}")
    if not cfg.program:
        raise UsageError("missing the program to run: give script.py or -m module")
    command = program_command(cfg.program, cfg.args, module=cfg.module,
                              no_python=cfg.no_python)
    if cfg.timeout is not None and not cfg.timeout > 0:
        raise UsageError(f"timeout must be > 0 seconds, got {cfg.timeout!r}")
    min_ranks = need_int("min_ranks", cfg.min_ranks, 1)
    if min_ranks != 1 and not cfg.elastic:
        raise UsageError("--min-ranks applies to elastic jobs only: add --elastic")
    if need_int("replace", cfg.replace, 0) and not cfg.elastic:
        raise UsageError("--replace applies to elastic jobs only: add --elastic")
    if min_ranks > nproc:
        raise UsageError(f"min_ranks={min_ranks} is more than the {nproc} ranks of this node")
    if not cfg.kill_grace >= 0:
        raise UsageError(f"kill_grace must be >= 0 seconds, got {cfg.kill_grace!r}")

    port = cfg.master_port
    if port is None:
        port = 0 if nnodes == 1 else DEFAULT_MULTI_NODE_PORT
    need_int("master_port", port, 0)
    if port > 65535:
        raise UsageError(f"master_port must be in [0, 65535], got {port}")

    base_env = dict(os.environ if cfg.env is None else cfg.env)
    token = config.get("GPUCOLL_AUTH_TOKEN", base_env)
    if nnodes == 1:
        master_addr = cfg.master_addr or "127.0.0.1"
        bind_host: Optional[str] = master_addr
        token = token or secrets.token_hex(16)
    else:
        if not cfg.master_addr:
            raise UsageError(f"nnodes={nnodes} needs --master-addr: the address of node 0 that "
                             f"every node can reach")
        if port == 0:
            raise UsageError("master_port 0 (ephemeral) works only with one node: the other "
                             "nodes must know the port in advance")
        if not token:
            raise UsageError(f"nnodes={nnodes} needs GPUCOLL_AUTH_TOKEN, the secret that keeps "
                             f"other users off the job's store; {token_hint()}")
        master_addr = cfg.master_addr
        bind_host = "0.0.0.0" if node_rank == 0 else None
    try:
        orphan_grace = config.get("GPUCOLL_ORPHAN_GRACE", base_env)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not 0 <= orphan_grace < float("inf"):
        raise UsageError(f"GPUCOLL_ORPHAN_GRACE must be a finite number of seconds >= 0, got "
                         f"{orphan_grace!r}")
    return Plan(nnodes * nproc, bind_host, port, master_addr, token, command, base_env,
                orphan_grace)
