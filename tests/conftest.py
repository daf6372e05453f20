"""Fixtures shared by the test modules (the device split is in ../conftest.py)."""

import os

import pytest
import tensorflow as tf

from tfshard import pinning


def _gpu_or_skip(count: int = 1) -> None:
    have = len(tf.config.list_logical_devices("GPU"))
    if have >= count:
        return
    reason = f"needs {count} GPU(s), this machine has {have}"
    if os.environ.get("TFSHARD_REQUIRE_GPU") == "1":
        pytest.fail(f"TFSHARD_REQUIRE_GPU=1 but the test {reason}")
    pytest.skip(reason)


@pytest.fixture
def one_gpu():
    """Skips (or, with TFSHARD_REQUIRE_GPU=1, fails) without a GPU."""
    _gpu_or_skip(1)


@pytest.fixture
def two_gpus():
    """Skips (or, with TFSHARD_REQUIRE_GPU=1, fails) without two GPUs."""
    _gpu_or_skip(2)


@pytest.fixture(autouse=True)
def no_active_contexts(monkeypatch):
    """Every test starts with no context map, explicit or from the environment."""
    monkeypatch.setattr(pinning, "_explicit", [])
    monkeypatch.delenv(pinning.CONTEXTS_ENV, raising=False)
