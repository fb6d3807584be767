"""The checks of ``docker_checks.py`` each report a deliberately broken file.

Without these, a check that could never fail would let the real files pass unchecked.
"""

from __future__ import annotations

from typing import List

import pytest

from docker_checks import (ROOT, Instruction, docker_commands, load_compose, needs_yaml,
                           parse_dockerfile, problems_commands, problems_compose,
                           problems_copy_sources, problems_cpu_cmd, problems_cuda_base,
                           problems_extras, problems_non_root, problems_python_base,
                           problems_wheel_inputs)


@pytest.fixture(scope="module")
def readme():
    return (ROOT / "README.md").read_text(encoding="utf-8")


GOOD_CUDA = """\
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}
ARG GPUCOLL_EXTRA=cu12
COPY pyproject.toml README.md ./
RUN pip install --no-cache-dir "./[${GPUCOLL_EXTRA}]" \\
    && gpucoll --version
USER 1000
CMD ["gpucoll", "run", "-n", "2", "-m", "gpucoll.examples.allreduce"]
"""


def _broken(old: str, new: str, text: str = GOOD_CUDA) -> List[Instruction]:
    assert old in text
    return parse_dockerfile(text.replace(old, new))


def test_the_good_example_passes():
    scripts = {"gpucoll": "gpucoll.cli:main"}
    instructions = parse_dockerfile(GOOD_CUDA)
    assert problems_cuda_base(instructions) == []
    assert problems_non_root(instructions) == []
    assert problems_commands(docker_commands(instructions), scripts) == []
    assert problems_copy_sources(instructions) == []


@pytest.mark.parametrize("old, new", [
    ("12.8.1-runtime-ubuntu24.04", "latest"),
    ("12.8.1-runtime-ubuntu24.04", "12.8.1-devel-ubuntu24.04"),
    ("12.8.1-runtime-ubuntu24.04", "12-runtime-ubuntu24.04"),
    ("nvidia/cuda:12.8.1-runtime-ubuntu24.04", "nvidia/cuda"),
    ("nvidia/cuda:", "ubuntu/cuda:"),
    ("GPUCOLL_EXTRA=cu12", "GPUCOLL_EXTRA=cu13"),
    ("./[${GPUCOLL_EXTRA}]", "."),
], ids=["latest", "devel", "unpinned", "no-tag", "not-nvidia", "cu13-on-12", "no-extra"])
def test_cuda_base_check_catches(old, new):
    assert problems_cuda_base(_broken(old, new))


@pytest.mark.parametrize("old, new", [
    ("USER 1000\n", ""), ("USER 1000", "USER root"), ("USER 1000", "USER 0:0"),
    ("USER 1000\nCMD", "ARG U=0\nUSER ${U}\nCMD"),
], ids=["no-user", "root", "uid-0", "arg-0"])
def test_non_root_check_catches(old, new):
    assert problems_non_root(_broken(old, new))


@pytest.mark.parametrize("old, new", [
    ("gpucoll.examples.allreduce", "gpucoll.examples.no_such_example"),
    ('"gpucoll", "run"', '"gpucoll", "launch"'),
    ("gpucoll --version", "gpucolll --version"),
], ids=["module", "subcommand", "script"])
def test_command_check_catches(old, new):
    scripts = {"gpucoll": "gpucoll.cli:main", "gpucolll": "gpucoll.cli:no_such_function"}
    assert problems_commands(docker_commands(_broken(old, new)), scripts)


def test_command_check_catches_a_missing_console_script():
    assert problems_commands([["gpucoll", "run", "-n", "2", "x.py"]], {})


def test_copy_check_catches_missing_and_ignored_paths():
    assert problems_copy_sources(_broken("README.md", "NO_SUCH_FILE.md"))
    assert problems_copy_sources(_broken("README.md", "build"))


def test_wheel_inputs_check_catches_a_license_left_behind():
    project = {"readme": "README.md", "license-files": ["LICENSE"]}
    copied_all = _broken("README.md", "README.md LICENSE")
    assert problems_wheel_inputs(copied_all, project) == []
    assert problems_wheel_inputs(_broken("README.md", "LICENSE"), project) == [
        "README.md (named in pyproject.toml) is not copied before the wheel build"]
    assert problems_wheel_inputs(_broken("README.md", "README.md"), project) == [
        "LICENSE (named in pyproject.toml) is not copied before the wheel build"]


def test_extras_check_catches_an_unknown_extra():
    extras = {"test": [], "cu12": []}
    assert problems_extras('pip install ".[cu12,test]" gpucoll[cu12]', extras) == []
    assert problems_extras('pip install ".[cuda12]"', extras)
    assert problems_extras("pip install 'gpucoll[cu13]'", extras)


def test_cpu_cmd_check_catches_a_different_command(readme):
    good = 'FROM python:3.11.11-slim-bookworm\nRUN pip install "./[test]"\nUSER 1000\n' \
           'CMD ["python", "-m", "pytest", "-q", "tests"]\n'
    readme_block = "```bash\npip install '.[test]' && python -m pytest -q tests\n```\n"
    assert problems_cpu_cmd(parse_dockerfile(good), readme_block) == []
    assert problems_cpu_cmd(parse_dockerfile(good.replace('"-q", ', "")), readme_block)
    assert problems_cpu_cmd(parse_dockerfile(good.replace("[test]", "[plot]")), readme_block)
    for tag in ("3.11-slim", "latest", "3.11.11-bookworm"):
        assert problems_python_base(parse_dockerfile(good.replace("3.11.11-slim-bookworm", tag)))


@needs_yaml
@pytest.mark.parametrize("breakage", [
    lambda c: c["services"]["allreduce"].pop("ipc"),
    lambda c: c["services"]["allreduce"].pop("ulimits"),
    lambda c: c["services"]["allreduce"].pop("deploy"),
    lambda c: c["services"]["allreduce"]["deploy"]["resources"]["reservations"]["devices"][0]
    .update(driver="amd"),
    lambda c: c["services"]["allreduce"].update(command=["gpucoll", "run", "-n", "3", "x.py"])
    or [c["services"].pop(n) for n in ("rank0", "rank1")],
    lambda c: c["services"]["rank1"]["environment"].update(RANK="0"),
    lambda c: c["services"]["rank1"]["environment"].update(WORLD_SIZE="3"),
    lambda c: c["services"]["rank1"]["environment"].update(MASTER_ADDR="rank1"),
    lambda c: c["services"]["rank1"]["environment"].update(GPUCOLL_TIMOUT="5"),
    lambda c: c["services"]["rank1"]["environment"].update(MASTER_HOST="rank0"),
    lambda c: c["services"]["rank1"]["deploy"]["resources"]["reservations"]["devices"][0]
    .update(device_ids=["0"]),
    lambda c: c["services"]["cpu"].update(command=["python", "-m", "pytest", "tests"]),
    lambda c: c["services"]["cpu"]["build"].update(dockerfile="docker/Dockerfile.nope"),
    lambda c: c["services"].pop("cpu"),
], ids=["no-ipc", "no-memlock", "no-gpu", "wrong-driver", "no-two-ranks", "two-rank-0",
        "world-size", "master-addr", "unknown-gpucoll-var", "unknown-var", "same-gpu",
        "cpu-command", "missing-dockerfile", "no-cpu-service"])
def test_compose_check_catches(breakage, readme):
    compose = load_compose()
    assert problems_compose(compose, readme) == []
    breakage(compose)
    assert problems_compose(compose, readme)
