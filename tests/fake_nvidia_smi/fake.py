"""What the test modules share about the fake nvidia-smi beside this file.

The test modules of tfshard.utilization and of its command line import this module (pytest
puts tests/ on sys.path) and wrap these helpers in their scenario fixtures.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

FAKE_DIR = Path(__file__).resolve().parent
FAKE = FAKE_DIR / "nvidia-smi"
SCENARIOS = FAKE_DIR / "scenarios"


def executable() -> Path:
    """The fake, made executable: a checkout through an archive or a copy may drop the bit."""
    mode = FAKE.stat().st_mode
    if not mode & stat.S_IXUSR:
        FAKE.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return FAKE


def search_path() -> str:
    """A PATH with the fake first, then this interpreter's directory.

    The interpreter's directory comes next so the fake's `env python3` starts fast (a pyenv
    shim costs 0.1 s a call) and runs a Python that exists.
    """
    return os.pathsep.join([str(FAKE_DIR), str(Path(sys.executable).parent)])


def install(monkeypatch: pytest.MonkeyPatch, state: Path) -> Callable[[str], Path]:
    """Puts the fake first on PATH; returns a function that picks a scenario.

    The fake counts its calls in ``state`` (files "calls" and "pid"), which the returned
    function returns.
    """
    executable()
    monkeypatch.setenv("PATH", os.pathsep.join([search_path(), os.environ["PATH"]]))
    monkeypatch.setenv("FAKE_NVIDIA_SMI_STATE", str(state))
    for name in ("TFSHARD_NVIDIA_SMI", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    hide_this_process_gpus(monkeypatch)

    def use(scenario: str) -> Path:
        assert (SCENARIOS / f"{scenario}.txt").is_file(), scenario
        monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", scenario)
        return state

    return use


def hide_this_process_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes this process's TensorFlow list no GPU for the rest of the test.

    A scenario is a machine of its own: its GPUs are named by the CUDA rules alone, as in a
    process whose TensorFlow lists no GPU. Without this, a real GPU of the machine running the
    tests (an H100 split into two logical GPUs by ../conftest.py) would rename the scenario's
    GPUs. Only the configuration queries tfshard's GPU naming reads are replaced, not the
    runtime: ops still run where they ran. A test that fakes TensorFlow's GPUs itself patches
    these after this.
    """
    tf = sys.modules.get("tensorflow")
    if getattr(tf, "config", None) is None:
        return  # TensorFlow not imported: the CUDA rules alone apply already

    def without_gpus(query: Callable[..., list]) -> Callable[..., list]:
        def listed(device_type: str | None = None) -> list:
            return [d for d in query(device_type) if d.device_type != "GPU"]

        return listed

    for name in ("list_physical_devices", "get_visible_devices"):
        monkeypatch.setattr(tf.config, name, without_gpus(getattr(tf.config, name)))


def calls(state: Path) -> int:
    """How many times the fake ran with this state directory."""
    return int((state / "calls").read_text())
