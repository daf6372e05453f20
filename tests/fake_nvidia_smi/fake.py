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

    def use(scenario: str) -> Path:
        assert (SCENARIOS / f"{scenario}.txt").is_file(), scenario
        monkeypatch.setenv("FAKE_NVIDIA_SMI_SCENARIO", scenario)
        return state

    return use


def calls(state: Path) -> int:
    """How many times the fake ran with this state directory."""
    return int((state / "calls").read_text())
