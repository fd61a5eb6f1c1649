"""Fixtures of the serving tests: a repository of two models (yolov3-tiny at 64 with dynamic
batching, micro-v4-sgd without), one server process over it for the session, and the same
networks loaded in this process as the reference."""

import pytest
from serve_harness import ServerProcess, add_micro, add_tiny

import darknet_metal as dm


@pytest.fixture(scope="session")
def repository(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repository")
    add_tiny(repo)
    add_micro(repo)
    return repo


@pytest.fixture(scope="session")
def server(repository):
    with ServerProcess(repository, "-q") as process:
        yield process
    assert process.process.returncode == 0, process.log


@pytest.fixture(scope="session")
def reference(repository):
    """name -> the network the server runs, loaded here on the CPU."""
    def load(name):
        folder = repository / name / "1"
        return dm.load(next(folder.glob("*.cfg")), next(folder.glob("*.weights")))
    return {"tiny": load("tiny"), "micro": load("micro")}
