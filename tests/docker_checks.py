"""Static checks of docker/: parsers of Dockerfiles, compose.yaml and Markdown, and the checks.

Docker is not needed: the Dockerfiles and compose.yaml are parsed and checked statically.
Each check is a function returning a list of problems, so that the tests can run it on the
real files (``test_docker_files.py``) and show that it reports a deliberately broken file
(``test_docker_checks.py``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

try:
    import yaml
except ImportError:
    yaml = None

from gpucoll import config

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
CUDA_DOCKERFILE = DOCKER / "Dockerfile.cuda"
CPU_DOCKERFILE = DOCKER / "Dockerfile.cpu"
COMPOSE_FILE = DOCKER / "compose.yaml"
DOCKERFILES = (CUDA_DOCKERFILE, CPU_DOCKERFILE)

# Environment variables compose.yaml may set that gpucoll does not read (NCCL's and the NVIDIA
# container runtime's own); every other name must be declared in gpucoll.config.SETTINGS.
FOREIGN_ENV_PREFIXES = ("NCCL_", "NVIDIA_", "CUDA_")

needs_toml = pytest.mark.skipif(tomllib is None, reason="needs tomllib (Python 3.11+) or tomli")
needs_yaml = pytest.mark.skipif(yaml is None, reason="needs PyYAML (in the test extra)")


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

class Instruction(NamedTuple):
    keyword: str  # upper case: FROM, RUN, COPY...
    value: str  # the rest, continuation lines joined
    line: int  # 1-based line of the keyword


def parse_dockerfile(text: str) -> List[Instruction]:
    """Instructions of a Dockerfile: comments dropped, backslash continuations joined."""
    instructions: List[Instruction] = []
    pending: List[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments and blank lines may also sit inside a continuation
        if not pending:
            start = number
        continued = stripped.endswith("\\")
        pending.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            keyword, _, value = " ".join(pending).partition(" ")
            instructions.append(Instruction(keyword.upper(), value.strip(), start))
            pending = []
    if pending:
        keyword, _, value = " ".join(pending).partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
    return instructions


def arg_defaults(instructions: Sequence[Instruction]) -> Dict[str, str]:
    """``ARG NAME=default`` values (single-stage files: a later ARG overrides an earlier one)."""
    defaults = {}
    for inst in instructions:
        if inst.keyword == "ARG":
            name, sep, default = inst.value.partition("=")
            if sep:
                defaults[name.strip()] = default.strip().strip("\"'")
    return defaults


def substitute(text: str, variables: Dict[str, str]) -> str:
    """Expand ``$NAME``, ``${NAME}`` and ``${NAME:-default}`` from ``variables`` (unknown names
    without a default stay as they are)."""
    def expand(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        if name in variables:
            return variables[name]
        return match.group(2) if match.group(2) is not None else match.group(0)

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", expand, text)


def instruction_words(value: str) -> List[str]:
    """Words of an exec-form (JSON array) or shell-form instruction argument."""
    if value.startswith("["):
        words = json.loads(value)
        assert isinstance(words, list) and all(isinstance(w, str) for w in words), value
        return words
    return split_words(value)


def split_words(text: str) -> List[str]:
    """Shell words of ``text``; plain whitespace split where quoting is unbalanced (a command
    cut at a pipe inside ``$(...)``)."""
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split()


def base_image(instructions: Sequence[Instruction]) -> str:
    """The image of the last FROM, with ARG defaults filled in."""
    froms = [inst for inst in instructions if inst.keyword == "FROM"]
    assert froms, "no FROM instruction"
    words = [w for w in froms[-1].value.split() if not w.startswith("--")]
    return substitute(words[0], arg_defaults(instructions))


def split_image(image: str) -> Tuple[str, Optional[str]]:
    """'nvidia/cuda:12.8.1-runtime-ubuntu24.04' -> ('nvidia/cuda', '12.8.1-runtime-ubuntu24.04')."""
    image = image.split("@", 1)[0]
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:  # no tag (a colon, if any, belonged to a registry port)
        return image, None
    return name, tag


def docker_commands(instructions: Sequence[Instruction]) -> List[List[str]]:
    """The words of every RUN, CMD and ENTRYPOINT, with ARG defaults filled in; RUN lines are
    split into their ``&&`` / ``;`` / ``|`` separated commands."""
    variables = arg_defaults(instructions)
    commands = []
    for inst in instructions:
        if inst.keyword in ("CMD", "ENTRYPOINT"):
            commands.append([substitute(w, variables) for w in instruction_words(inst.value)])
        elif inst.keyword == "RUN":
            for part in re.split(r"&&|\|\||;|\|", inst.value):
                words = split_words(substitute(part, variables))
                if words:
                    commands.append(words)
    return commands


def final_cmd(instructions: Sequence[Instruction]) -> Optional[List[str]]:
    cmds = [inst for inst in instructions if inst.keyword == "CMD"]
    return instruction_words(cmds[-1].value) if cmds else None


def load_pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return tomllib.load(handle)


def load_compose(text: Optional[str] = None) -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8") if text is None else text)


def compose_commands(compose: dict) -> List[List[str]]:
    commands = []
    for service in compose.get("services", {}).values():
        for key in ("command", "entrypoint"):
            value = service.get(key)
            if value:
                commands.append(as_words(value))
    return commands


def as_words(command) -> List[str]:
    """A compose ``command`` (list, or string in shell syntax) as a list of words."""
    return [str(w) for w in command] if isinstance(command, list) else split_words(str(command))


def compose_environment(service: dict) -> Dict[str, Optional[str]]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["NAME=value", "NAME"]
        return {k: (v if sep else None) for k, sep, v in (item.partition("=") for item in env)}
    return {str(k): (None if v is None else str(v)) for k, v in env.items()}


def shell_lines(markdown: str) -> List[str]:
    """Lines of the fenced shell blocks (```bash, ```sh, ```console or no language) of a
    Markdown text, with backslash continuations joined."""
    lines, language = [], None
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            language = line.strip()[3:].strip() if language is None else None
            continue
        if language in ("", "bash", "sh", "shell", "console"):
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line)
    return lines


def readme_test_command(readme: str) -> Tuple[List[str], List[str]]:
    """(install words, test words) of the README's test command: the first fenced shell line
    that runs ``python -m pytest``, e.g. ``pip install '.[test]' && python -m pytest -q tests``."""
    for line in shell_lines(readme):
        segments = [split_words(part) for part in line.split("&&")]
        for index, words in enumerate(segments):
            if words[:3] == ["python", "-m", "pytest"]:
                install = segments[index - 1] if index else []
                return install, words
    raise AssertionError("README.md has no fenced `python -m pytest` command")


EXTRA_PATTERN = re.compile(r"(?<![\w.-])(?:gpucoll|\.|\./|/[\w./-]*)\[([\w,\s-]+)\]")


def mentioned_extras(text: str) -> List[str]:
    """Extras named as ``gpucoll[x]``, ``.[x]``, ``./[x]`` or ``/path[x]`` in ``text``."""
    return [extra.strip() for group in EXTRA_PATTERN.findall(text) for extra in group.split(",")]


def dockerignore_patterns() -> List[str]:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def ignored_by_dockerignore(path: str, patterns: Sequence[str]) -> bool:
    """Whether .dockerignore drops ``path`` (or a parent of it) from the build context.

    A simplified form of Docker's rules: patterns are matched with fnmatch against the path and
    each of its parents, ``**/`` also matches at the top level, and the last match wins.
    """
    parts = Path(path).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        variants = {pattern, pattern.replace("**/", "")}
        if any(fnmatch.fnmatchcase(c, v) for c in candidates for v in variants):
            ignored = not negate
    return ignored


# --------------------------------------------------------------------------------------------
# Checks: each returns the list of problems it found
# --------------------------------------------------------------------------------------------

def problems_extras(text: str, extras: Dict[str, list]) -> List[str]:
    return [f"extra [{e}] is not in [project.optional-dependencies] ({sorted(extras)})"
            for e in mentioned_extras(text) if e not in extras]


def problems_cuda_base(instructions: Sequence[Instruction]) -> List[str]:
    """FROM nvidia/cuda:<X.Y.Z>-runtime-..., and the CuPy extra installed matches CUDA X."""
    image = base_image(instructions)
    name, tag = split_image(image)
    problems = []
    if not re.fullmatch(r"(?:[\w.-]+/)?nvidia/cuda", name):
        problems.append(f"base image {image!r} is not nvidia/cuda")
    if tag is None or tag == "latest":
        return problems + [f"base image {image!r} has no pinned tag"]
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)-(\w+)-[\w.]+", tag)
    if not match:
        return problems + [f"tag {tag!r} is not <major>.<minor>.<patch>-<flavour>-<os>"]
    if match.group(4) != "runtime":
        problems.append(f"base image {image!r} is the {match.group(4)!r} variant, not runtime")
    major = match.group(1)
    cuda_extras = [e for cmd in docker_commands(instructions) if cmd[:2] == ["pip", "install"]
                   for e in mentioned_extras(" ".join(cmd)) if re.fullmatch(r"cu\d+", e)]
    if not cuda_extras:
        problems.append("no pip install of a cuNN extra (CuPy and the NCCL wheel)")
    problems += [f"extra [{e}] does not match CUDA {major} of {image!r}"
                 for e in cuda_extras if e != f"cu{major}"]
    return problems


def problems_python_base(instructions: Sequence[Instruction]) -> List[str]:
    image = base_image(instructions)
    name, tag = split_image(image)
    if name.split("/")[-1] != "python":
        return [f"base image {image!r} is not python"]
    if tag is None or not re.fullmatch(r"3\.11\.\d+-slim(-\w+)?", tag):
        return [f"base image {image!r} is not a pinned python:3.11.<patch>-slim tag"]
    return []


def problems_non_root(instructions: Sequence[Instruction]) -> List[str]:
    users = [inst for inst in instructions if inst.keyword == "USER"]
    if not users:
        return ["no USER instruction: the container would run as root"]
    user = substitute(users[-1].value, arg_defaults(instructions)).split(":")[0].strip()
    if user in ("", "root", "0"):
        return [f"line {users[-1].line}: the last USER is {users[-1].value!r} (root)"]
    return []


def problems_commands(commands: Sequence[Sequence[str]], scripts: Dict[str, str]) -> List[str]:
    """Console scripts exist in [project.scripts] and import; subcommands exist; every
    ``-m module`` is importable."""
    problems = []
    for words in commands:
        if not words:
            continue
        program = words[0]
        runs_python = bool(re.fullmatch(r"python(3(\.\d+)?)?", Path(program).name))
        if program == "gpucoll" or program in scripts:
            if program not in scripts:
                problems.append(f"{program!r} is not in [project.scripts]")
                continue
            module_name, _, function_name = scripts[program].partition(":")
            try:
                target = getattr(importlib.import_module(module_name), function_name)
            except (ImportError, AttributeError) as exc:
                problems.append(f"[project.scripts] {program} = {scripts[program]!r}: {exc}")
                continue
            if not callable(target):
                problems.append(f"{scripts[program]!r} is not callable")
            if program == "gpucoll" and len(words) > 1 and not words[1].startswith("-"):
                problems += problems_gpucoll_subcommand(words[1])
        for index, word in enumerate(words[:-1] if runs_python or program in scripts else []):
            if word == "-m":
                module = words[index + 1]
                if importlib.util.find_spec(module) is None:
                    problems.append(f"`{' '.join(words)}`: module {module!r} is not importable")
                break  # what follows belongs to the module
    return problems


def problems_gpucoll_subcommand(name: str) -> List[str]:
    from gpucoll.cli import build_parser

    parser, _ = build_parser()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            parser.parse_args([name, "--help"])  # a known subcommand prints its help, exits 0
        except SystemExit as exc:
            if exc.code == 0:
                return []
    return [f"`gpucoll {name}` is not a gpucoll subcommand"]


def problems_copy_sources(instructions: Sequence[Instruction]) -> List[str]:
    """COPY / ADD sources from the build context (the repo root) exist and are not ignored."""
    problems = []
    patterns = dockerignore_patterns()
    for inst in instructions:
        if inst.keyword not in ("COPY", "ADD"):
            continue
        words = instruction_words(inst.value)
        if any(w.startswith("--from") for w in words):
            continue
        sources = [w for w in words if not w.startswith("--")][:-1]
        if not sources:
            problems.append(f"line {inst.line}: {inst.keyword} without a source")
        for source in sources:
            relative = source.strip("/").removeprefix("./")
            if relative in ("", "."):
                continue  # the whole context
            if not any(ROOT.glob(relative)):
                problems.append(f"line {inst.line}: {source!r} does not exist in the repository")
            elif ignored_by_dockerignore(relative, patterns):
                problems.append(f"line {inst.line}: {source!r} is excluded by .dockerignore")
    return problems


def problems_wheel_inputs(instructions: Sequence[Instruction], project: dict) -> List[str]:
    """An image that copies only part of the repository before ``pip install`` still copies
    every file pyproject.toml names for the build (its readme and license files)."""
    sources = []
    for inst in instructions:
        words = instruction_words(inst.value)
        if inst.keyword in ("COPY", "ADD") and not any(w.startswith("--from") for w in words):
            sources += [w.strip("/").removeprefix("./")
                        for w in words if not w.startswith("--")][:-1]
    if any(source in ("", ".") for source in sources):
        return []  # the whole context
    wanted = [project["readme"]] if isinstance(project.get("readme"), str) else []
    for pattern in project.get("license-files", []):
        wanted += [str(path.relative_to(ROOT)) for path in sorted(ROOT.glob(pattern))]
    return [f"{name} (named in pyproject.toml) is not copied before the wheel build"
            for name in wanted
            if not any(name == s or name.startswith(s + "/") for s in sources)]


def problems_cpu_cmd(instructions: Sequence[Instruction], readme: str) -> List[str]:
    install, test = readme_test_command(readme)
    problems = []
    cmd = final_cmd(instructions)
    if cmd != test:
        problems.append(f"CMD {cmd} is not the README's test command {test}")
    installed = [e for c in docker_commands(instructions) if c[:2] == ["pip", "install"]
                 for e in mentioned_extras(" ".join(c))]
    wanted = mentioned_extras(" ".join(install))
    if not wanted or not set(wanted) <= set(installed):
        problems.append(f"the image installs extras {installed}, the README's command {wanted}")
    return problems


def _dockerfile_of(service: dict) -> str:
    build = service.get("build")
    return str(build.get("dockerfile", "Dockerfile")) if isinstance(build, dict) else ""


def _gpu_devices(service: dict) -> List[dict]:
    reservations = ((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    return [d for d in reservations.get("devices") or []
            if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])
            and ("count" in d or "device_ids" in d)]


def problems_compose(compose: dict, readme: str) -> List[str]:
    problems = []
    services = compose.get("services") or {}
    cuda = {name: s for name, s in services.items()
            if _dockerfile_of(s).endswith("Dockerfile.cuda")}
    if not cuda:
        problems.append("no service builds docker/Dockerfile.cuda")
    for name, service in services.items():
        build = service.get("build")
        if isinstance(build, dict):
            context = (COMPOSE_FILE.parent / build.get("context", ".")).resolve()
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if context != ROOT:
                problems.append(f"{name}: build context {context} is not the repository root")
            if not dockerfile.is_file():
                problems.append(f"{name}: dockerfile {dockerfile} does not exist")
        for var in compose_environment(service):
            if var.startswith("GPUCOLL_") and var not in config.SETTINGS:
                problems.append(f"{name}: {var} is not declared in gpucoll.config.SETTINGS")
            elif var not in config.SETTINGS and not var.startswith(FOREIGN_ENV_PREFIXES):
                problems.append(f"{name}: gpucoll does not read {var}")
    for name, service in cuda.items():
        if service.get("ipc") != "host" and not service.get("shm_size"):
            problems.append(f"{name}: neither `ipc: host` nor shm_size (NCCL needs /dev/shm)")
        memlock = (service.get("ulimits") or {}).get("memlock")
        if memlock != -1 and memlock != {"soft": -1, "hard": -1}:
            problems.append(f"{name}: ulimits memlock is {memlock!r}, not -1")
        if not _gpu_devices(service):
            problems.append(f"{name}: no deploy.resources.reservations.devices GPU reservation")

    def runs_two_ranks(words: List[str]) -> bool:
        words = " ".join(words).replace("=", " ").split()
        return words[:2] == ["gpucoll", "run"] and any(
            option in ("-n", "--nproc-per-node") and value == "2"
            for option, value in zip(words, words[1:]))

    one_container = [name for name, s in cuda.items()
                     if runs_two_ranks(as_words(s.get("command") or []))]
    ranked = {name: compose_environment(s) for name, s in cuda.items()
              if "RANK" in compose_environment(s)}
    problems += problems_rank_services(ranked, {n: cuda[n] for n in ranked})
    if not one_container and len(ranked) != 2:
        problems.append("no service runs `gpucoll run -n 2` and there are no two rank services")

    cpu = [s for s in services.values() if _dockerfile_of(s).endswith("Dockerfile.cpu")]
    if not cpu:
        problems.append("no service builds docker/Dockerfile.cpu")
    _, test = readme_test_command(readme)
    for service in cpu:
        command = service.get("command")
        if command and as_words(command) != test:
            problems.append(f"cpu service command {command} is not the README's {test}")
    return problems


def problems_rank_services(envs: Dict[str, Dict[str, Optional[str]]],
                           services: Dict[str, dict]) -> List[str]:
    """Services that each run one rank agree on the job and cover ranks 0..WORLD_SIZE-1."""
    if not envs:
        return []
    problems = []
    for key in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPUCOLL_AUTH_TOKEN"):
        values = {env.get(key) for env in envs.values()}
        if len(values) != 1 or None in values:
            problems.append(f"rank services disagree on (or miss) {key}: "
                            f"{sorted(map(str, values))}")
    sizes = {env.get("WORLD_SIZE") for env in envs.values()}
    ranks = sorted(str(env.get("RANK")) for env in envs.values())
    if len(sizes) == 1 and None not in sizes:
        size = int(sizes.pop())
        if ranks != [str(r) for r in range(size)]:
            problems.append(f"rank services have RANK {ranks}, expected 0..{size - 1}")
    master = {env.get("MASTER_ADDR") for env in envs.values()}
    rank0 = [name for name, env in envs.items() if env.get("RANK") == "0"]
    if rank0 and master != {rank0[0]} and master != {services[rank0[0]].get("hostname")}:
        problems.append(f"MASTER_ADDR {sorted(map(str, master))} is not the RANK 0 service "
                        f"{rank0[0]}")
    device_ids = [tuple(d.get("device_ids") or ()) for s in services.values()
                  for d in _gpu_devices(s)]
    if len(set(device_ids)) != len(device_ids) and all(device_ids):
        problems.append(f"rank services share GPUs: {device_ids}")
    return problems
