"""Shared fixtures: a seeded random generator per test, seeded grading, and the gpu marker.

Seeds are fixed per test by default (a hash of the test's id), so a run on CI is reproducible: a red run is a
real failure, not an unlucky draw. ``FLASHLAB_SEED=random`` draws fresh seeds (each is printed, so a failure can
be replayed with ``FLASHLAB_SEED=N``); ``python -m flashlab.mistakes --seeds N`` grades every known mistake
with N seeds.
"""

from __future__ import annotations

import os
import zlib

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


def _seed(request) -> int:
    env = os.environ.get("FLASHLAB_SEED", "").strip()
    if env == "random":
        return int(np.random.SeedSequence().entropy % 2**32)
    if env:
        return int(env)
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def rng(request):
    """Inputs from a seed fixed per test (FLASHLAB_SEED=random: fresh ones; FLASHLAB_SEED=N replays a failure)."""
    seed = _seed(request)
    print(f"\n[{request.node.name}] FLASHLAB_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _seeded_grading(request, monkeypatch):
    """Grader questions run in this process draw their seeds from the test's seed too (see _seed)."""
    from flashlab.grading import core

    draws = np.random.default_rng(_seed(request) ^ 0x5EED)
    monkeypatch.setattr(core, "new_seed", lambda: int(draws.integers(0, 2**31)))
