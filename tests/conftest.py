"""Shared fixtures: a fresh random generator per test (seed printed so a failure can be replayed) and the gpu marker."""

from __future__ import annotations

import os

import numpy as np
import pytest


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy; run `make test-gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """Fresh inputs every run; FLASHLAB_SEED=N replays a failure."""
    seed = int(os.environ.get("FLASHLAB_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"\n[{request.node.name}] FLASHLAB_SEED={seed}")
    return np.random.default_rng(seed)
