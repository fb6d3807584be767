"""The package's layers import downward only, and no module imports its way back to itself.

Layers, lowest first: basics (errors, types, config, auth, work, communicator and its helpers, the CUDA/NCCL
probe and graph-capture check, the kernel loader, the CLI helpers) -> rendezvous -> transports -> algorithms ->
backends -> api -> what sits on top (launcher, bench, topo, doctor, trace, cli, training helpers,
examples). Every import counts, also the ones inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpucoll"

LAYERS = {
    "errors": 0, "types": 0, "config": 0, "auth": 0, "work": 0, "communicator": 0,
    "cuda_env": 0, "graph_capture": 0, "kernels": 0, "cliutil": 0, "hostarrays": 0, "objects": 0, "composite": 0,
    "kernel_tables": 0,
    "composite_alltoall": 0, "composite_scatter": 0, "scan": 0, "sendrecv": 0, "batch_p2p": 0,
    "groups": 0,
    "default_comm": 0, "orphan_guard": 0, "flight_recorder": 0,
    "rendezvous": 1, "transports": 2, "algorithms": 3, "backends": 4, "api": 5,
    "trace_report": 6, "trace_timeline": 6,
}
TOP = 6  # launch, perf, topo, doctor, trace_report, cli, ddp, tp, ep, pp, cp, ps, examples, __main__


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known) -> set:
    """The gpucoll modules ``name`` imports (absolute names), wherever the import statement is."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [f"{module}.{alias.name}" for alias in node.names
                          if f"{module}.{alias.name}" in known]
            # "from pkg import submodule" depends on the submodule; "from pkg import name" on pkg
            targets = submodules if len(submodules) == len(node.names) else [module] + submodules
        else:
            continue
        for target in targets:
            if target in known and target != name:
                found.add(target)
    return found


def _layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1:  # the package itself: a facade that re-exports
        return TOP
    return LAYERS.get(parts[1], TOP)


GRAPH = {name: _imports(name, path, set(_modules())) for name, path in _modules().items()}


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_go_downward(name):
    upward = sorted(target for target in GRAPH[name]
                    if _layer(target) > _layer(name) and target != "gpucoll")
    assert not upward, f"{name} (layer {_layer(name)}) imports higher layers: {upward}"


def test_no_module_imports_itself_back():
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "active"
        stack.append(node)
        for target in sorted(GRAPH[node]):
            if target == "gpucoll":  # the facade re-exports; importing it is not a dependency
                continue
            if state.get(target) == "active":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_files_stay_small():
    big = {str(path.relative_to(PACKAGE.parent)): n for path in PACKAGE.rglob("*.py")
           if (n := len(path.read_text().splitlines())) > 600}
    assert not big, f"split these by concern: {big}"
