"""The config table: typed parsing, defaults, unknown names, and the README staying in sync."""

import os

import pytest

from gpucoll import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_typed_values_and_defaults():
    env = {"GPUCOLL_TIMEOUT": "2.5", "GPUCOLL_DEBUG": "yes", "GPUCOLL_SOCKET_BUFFER": "4MiB",
           "GPUCOLL_CHUNK_BYTES": "256KiB", "GPUCOLL_TRANSPORT": "TCP", "RANK": "3"}
    assert config.get("GPUCOLL_TIMEOUT", env) == 2.5
    assert config.get("GPUCOLL_DEBUG", env) is True
    assert config.get("GPUCOLL_SOCKET_BUFFER", env) == 4 << 20
    assert config.get("GPUCOLL_CHUNK_BYTES", env) == 256 << 10
    assert config.get("GPUCOLL_TRANSPORT", env) == "tcp"
    assert config.get("RANK", env) == 3
    assert config.get("GPUCOLL_RING_THRESHOLD", {}) == 256 << 10
    assert config.get("WORLD_SIZE", {}) is None
    assert config.get("GPUCOLL_TIMEOUT", {"GPUCOLL_TIMEOUT": ""}) == 300.0


@pytest.mark.parametrize("name,value", [("GPUCOLL_TIMEOUT", "soon"), ("GPUCOLL_DEBUG", "maybe"),
                                        ("GPUCOLL_TRANSPORT", "carrier-pigeon"),
                                        ("GPUCOLL_SOCKET_BUFFER", "4 parsecs")])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        config.get(name, {name: value})


def test_undeclared_names_are_rejected_and_reported():
    with pytest.raises(KeyError, match="GPUCOLL_NOPE"):
        config.get("GPUCOLL_NOPE")
    assert config.unknown_names({"GPUCOLL_TIMOUT": "1", "GPUCOLL_TIMEOUT": "1", "PATH": "/"}) == \
        ["GPUCOLL_TIMOUT"]


def test_readme_table_is_generated_from_config():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    start = readme.index("<!-- config-table:start -->") + len("<!-- config-table:start -->")
    end = readme.index("<!-- config-table:end -->")
    assert readme[start:end].strip() == config.markdown_table().strip()
    for name, setting in config.SETTINGS.items():
        assert f"`{name}`" in readme, f"{name} is not documented in the README"


def test_only_config_reads_the_environment():
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "gpucoll")):
        for name in files:
            if not name.endswith(".py") or name == "config.py":
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                text = f.read()
            for needle in ("os.environ.get", "os.getenv", "environ["):
                if needle in text:
                    offenders.append(f"{os.path.relpath(path, ROOT)}: {needle}")
    assert offenders == []
