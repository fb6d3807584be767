"""Shared test set-up: GPU tests skip with a reason when CuPy or a CUDA device is missing;
``solo`` is a world of one on the cpu backend; the rank pools and clusters that test modules
share (``mp_harness.share_for_session``) are closed when the session ends. Where Python is told
not to write bytecode (PYTHONDONTWRITEBYTECODE), gpucoll and these test modules are compiled
once, so that the rank processes the suite starts by the thousand read the .pyc instead of each
compiling them again (about 0.2 s of CPU per process)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_sessionstart(session):
    if not sys.flags.dont_write_bytecode:
        return            # each process writes what it compiles; the next one reads it
    import compileall

    import gpucoll

    for directory in (os.path.dirname(gpucoll.__file__), os.path.dirname(__file__)):
        if os.access(directory, os.W_OK):
            compileall.compile_dir(directory, quiet=2)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    from gpucoll.cuda_env import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    """A one-rank cpu communicator (a file store), for checks that need no peers."""
    import gpucoll

    url = f"file://{tmp_path_factory.mktemp('store')}/store"
    with gpucoll.init(backend="cpu", rank=0, world_size=1, url=url, timeout=10) as comm:
        yield comm


@pytest.fixture(scope="session", autouse=True)
def _close_what_modules_share():
    yield
    from mp_harness import close_shared

    close_shared()
