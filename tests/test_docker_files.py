"""docker/: the images and the compose file agree with pyproject.toml, the README and gpucoll.

Docker is not needed: the Dockerfiles and compose.yaml are parsed and checked statically by
the checks of ``docker_checks.py``; each must report no problem for the real files.
"""

from __future__ import annotations

import re

import pytest

from docker_checks import (COMPOSE_FILE, CPU_DOCKERFILE, CUDA_DOCKERFILE, DOCKER, DOCKERFILES,
                           ROOT, arg_defaults, compose_commands, docker_commands,
                           dockerignore_patterns, final_cmd, ignored_by_dockerignore,
                           load_compose, load_pyproject, needs_toml, needs_yaml,
                           parse_dockerfile, problems_commands, problems_compose,
                           problems_copy_sources, problems_cpu_cmd, problems_cuda_base,
                           problems_extras, problems_non_root, problems_python_base,
                           problems_wheel_inputs,
                           shell_lines, split_words, substitute)


@pytest.fixture(scope="module")
def cuda_instructions():
    return parse_dockerfile(CUDA_DOCKERFILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cpu_instructions():
    return parse_dockerfile(CPU_DOCKERFILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def readme():
    return (ROOT / "README.md").read_text(encoding="utf-8")


@needs_toml
@pytest.mark.parametrize("path", [*DOCKERFILES, COMPOSE_FILE, DOCKER / "README.md"],
                         ids=lambda p: p.name)
def test_every_extra_mentioned_exists(path):
    extras = load_pyproject()["project"]["optional-dependencies"]
    text = path.read_text(encoding="utf-8")
    if path.name.startswith("Dockerfile"):
        text = substitute(text, arg_defaults(parse_dockerfile(text)))
    assert problems_extras(text, extras) == []


def test_cuda_image_is_a_pinned_runtime_image_matching_its_extra(cuda_instructions):
    assert problems_cuda_base(cuda_instructions) == []


def test_cpu_image_is_pinned_python_slim(cpu_instructions):
    assert problems_python_base(cpu_instructions) == []


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_end_as_a_non_root_user(path):
    assert problems_non_root(parse_dockerfile(path.read_text(encoding="utf-8"))) == []


@needs_toml
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_commands_exist(path):
    scripts = load_pyproject()["project"]["scripts"]
    commands = docker_commands(parse_dockerfile(path.read_text(encoding="utf-8")))
    assert problems_commands(commands, scripts) == []


def test_cuda_image_runs_the_main_job(cuda_instructions):
    assert final_cmd(cuda_instructions) == ["gpucoll", "run", "-n", "2", "-m",
                                            "gpucoll.examples.allreduce"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist_and_reach_the_build_context(path):
    assert problems_copy_sources(parse_dockerfile(path.read_text(encoding="utf-8"))) == []


@needs_toml
def test_cuda_image_copies_what_the_wheel_build_reads(cuda_instructions):
    project = load_pyproject()["project"]
    assert project.get("license-files") and project.get("readme")   # both really checked
    assert problems_wheel_inputs(cuda_instructions, project) == []


def test_cpu_image_runs_the_readme_test_command(cpu_instructions, readme):
    assert problems_cpu_cmd(cpu_instructions, readme) == []


def test_dockerignore_drops_vcs_and_environments_but_keeps_the_sources():
    patterns = dockerignore_patterns()
    for path in (".git", ".ci-venv", "build", "gpucoll/__pycache__", "gpucoll.egg-info"):
        assert ignored_by_dockerignore(path, patterns), f"{path} reaches the build context"
    # Dockerfile.cpu copies the whole checkout and runs the tests, which read these.
    for path in ("README.md", "pyproject.toml", ".dockerignore", "gpucoll/api.py",
                 "kernels/common.cuh", "tests/test_docker_files.py", "tests/docker_checks.py",
                 "docker/Dockerfile.cuda", "docker/compose.yaml"):
        assert not ignored_by_dockerignore(path, patterns), f"{path} is excluded by .dockerignore"


@needs_yaml
def test_compose_runs_two_gpu_ranks_with_nccl_settings(readme):
    assert problems_compose(load_compose(), readme) == []


@needs_yaml
@needs_toml
def test_compose_commands_exist():
    scripts = load_pyproject()["project"]["scripts"]
    assert problems_commands(compose_commands(load_compose()), scripts) == []


@needs_toml
def test_gpucoll_commands_in_the_docker_readme_exist():
    """``gpucoll doctor``, ``gpucoll run -m module``... in docker/README.md's shell blocks."""
    scripts = load_pyproject()["project"]["scripts"]
    commands = []
    for line in shell_lines((DOCKER / "README.md").read_text(encoding="utf-8")):
        for part in line.split("&&"):
            words = split_words(part)
            if "gpucoll" in words:
                commands.append(words[words.index("gpucoll"):])
    assert commands
    assert problems_commands(commands, scripts) == []


@pytest.mark.parametrize("path", [CUDA_DOCKERFILE, DOCKER / "README.md"], ids=lambda p: p.name)
def test_documented_cuda_variants_pair_the_extra_with_the_image(path):
    """``--build-arg CUDA_IMAGE=nvidia/cuda:13...`` goes with ``--build-arg GPUCOLL_EXTRA=cu13``."""
    text = path.read_text(encoding="utf-8")
    lines = shell_lines(text) if path.suffix == ".md" else text.splitlines()
    pairs = 0
    for line in (line for line in lines if "--build-arg" in line):
        image = re.search(r"CUDA_IMAGE=\S*nvidia/cuda:(\d+)\.", line)
        extra = re.search(r"GPUCOLL_EXTRA=cu(\d+)", line)
        if image and extra:
            pairs += 1
            assert image.group(1) == extra.group(1), line
        else:
            assert not (image or extra), f"CUDA_IMAGE or GPUCOLL_EXTRA without the other: {line}"
    assert pairs >= 1
