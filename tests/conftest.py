import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the thread hand-offs
# cost more than the maths.
torch.set_num_threads(1)

from models import tiny_llama  # noqa: E402
from serve_helpers import METRICS_PORT, port_ray_leaves_free, start_local_serve, stop_local_serve  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_compiles():
    """Each test's compiled graphs are its own: without a reset, the suite's compiles of the one
    `ModelRunner._compute` code object would add up against dynamo's limits across tests."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module", autouse=True)
def frozen_leftovers():
    """After each test file, what the process still holds is left out of later garbage collections.
    Compiles leave objects behind that a dynamo reset does not free (fake-tensor and shape-env
    caches: over a million objects by the middle of the suite), and every full collection walked
    them all again (after test_fusion alone, a sampling test took 25 s, 19 s with them frozen, 14 s
    in a fresh process). Set up before the file's other fixtures, this runs after their teardown,
    so a file's own garbage is collected first."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def server():
    """Ray (2 CPUs, 127.0.0.1) + Serve + the tiny app, started once for every serve test file (20-40 s)."""
    url = start_local_serve(port_ray_leaves_free(), metrics_port=METRICS_PORT)
    yield url
    stop_local_serve()


@pytest.fixture(scope="session")
def head_dir(tmp_path_factory):
    """A feature head trained briefly on test_feature_drafter's target (once per session)."""
    from test_feature_drafter import target as head_target, train_tiny_head

    return train_tiny_head(head_target(), tmp_path_factory.mktemp("head"))


@pytest.fixture
def local_coordinator(monkeypatch):
    """config -> a Coordinator running in this process with its real workers (tests/local_actors.py)."""
    from local_actors import patch_coordinator

    return patch_coordinator(monkeypatch)
