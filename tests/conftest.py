"""Fixtures shared by the test modules (the device split is in ../conftest.py)."""

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import tensorflow as tf
from fake_nvidia_smi import fake

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


def _process_gone(pid: int, seconds: float = 10.0) -> bool:
    """True once pid is gone or a zombie (init reaps what it inherits, on its own time)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def process_gone() -> Callable[..., bool]:
    """`process_gone(pid, seconds=10.0)`: waits until pid is gone (or a zombie)."""
    return _process_gone


# ------------------------------------------------ the fake nvidia-smi and its scenarios


@pytest.fixture
def fake_nvidia_smi(monkeypatch, tmp_path) -> Callable[[str], Path]:
    """Puts the fake first on PATH; returns a function that picks a scenario.

    The fake counts its calls in the returned state directory (files "calls" and "pid").
    """
    return fake.install(monkeypatch, tmp_path)


@pytest.fixture
def nvidia_smi_several_gpus_busy(fake_nvidia_smi):
    return fake_nvidia_smi("several_gpus_busy")


@pytest.fixture
def nvidia_smi_units_and_header(fake_nvidia_smi):
    return fake_nvidia_smi("several_gpus_busy_with_units_and_header")


@pytest.fixture
def nvidia_smi_one_gpu_idle(fake_nvidia_smi):
    return fake_nvidia_smi("one_gpu_idle")


@pytest.fixture
def nvidia_smi_not_supported_fields(fake_nvidia_smi):
    return fake_nvidia_smi("not_supported_fields")


@pytest.fixture
def nvidia_smi_mig_enabled(fake_nvidia_smi):
    return fake_nvidia_smi("mig_enabled")


@pytest.fixture
def nvidia_smi_utilization_changes(fake_nvidia_smi):
    return fake_nvidia_smi("utilization_changes")


@pytest.fixture
def nvidia_smi_driver_library_mismatch(fake_nvidia_smi):
    return fake_nvidia_smi("driver_library_mismatch")


@pytest.fixture
def nvidia_smi_driver_hangs(fake_nvidia_smi):
    return fake_nvidia_smi("driver_hangs")


@pytest.fixture
def nvidia_smi_no_devices(fake_nvidia_smi):
    return fake_nvidia_smi("no_devices")
