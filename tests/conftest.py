import os

os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

import attnlib as al


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def task():
    """A small, moderately conditioned, noisy task in float64."""
    return al.Task.random(5, 3, cond=10.0, signal=1.0, noise_std=0.3, seed=0)
