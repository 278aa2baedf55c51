"""GPU tests run only where CUDA is; elsewhere they are reported as skipped, never passed.
Whatever autopar caches (``parallelism.auto``'s probed profiles) goes to the session's own
folder, not the user's ``~/.cache``."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def autopar_cache(tmp_path_factory):
    """Spawned ranks inherit it through the environment."""
    os.environ["AUTOPAR_CACHE_DIR"] = str(tmp_path_factory.mktemp("autopar_cache"))


@pytest.fixture
def model_never_built(monkeypatch):
    """Fails the test if a Trainer starts building its model: a refusal of bad data must come
    before any weight is built or loaded."""

    def building(*args, **kwargs):
        raise AssertionError("the Trainer built its model before refusing the job")

    monkeypatch.setattr("autopar.training.trainer.build_parts", building)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
