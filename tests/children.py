"""The environment of every Python child a test starts (one helper for every test file).

A child must find the packages the test process found, however it found them: TensorFlow
through PYTHONPATH (the GPU machine's recipe), a venv, a ``pip install -e``, or an entry
pytest put on ``sys.path``; and it must import this checkout's tfshard, not another one an
editable install points at. `environ` builds that on the library's own rule for its workers
(`tfshard.processes.child_environ`); never set ``PYTHONPATH`` by hand (``{**os.environ,
"PYTHONPATH": repo}`` drops the entries the test process found TensorFlow through).

    subprocess.run([sys.executable, script], env=children.environ(TF_CPP_MIN_LOG_LEVEL="3"))
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tfshard import processes

REPO = Path(__file__).resolve().parent.parent


def environ(
    base: Mapping[str, str] | None = None, /, *, without: Iterable[str] = (), **variables: str
) -> dict[str, str]:
    """`base` (default ``os.environ``) for a Python child started by a test.

    Args:
        base: the variables to start from.
        without: names to remove (``"TF_CONFIG"``, ``"TFSHARD_CONTEXTS"``).
        **variables: names to set, after PYTHONPATH is made.

    Returns:
        A new dict whose PYTHONPATH has this checkout first, then every ``sys.path`` entry of
        this process its interpreter would not add by itself, then `base`'s PYTHONPATH.
    """
    env = processes.child_environ([str(REPO)], os.environ if base is None else base)
    for name in without:
        env.pop(name, None)
    env.update(variables)
    return env


def python(code: str, *, timeout: float = 120, **variables: str) -> subprocess.CompletedProcess:
    """`code` run by a Python child from the repository root, with `environ(**variables)`;
    its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=environ(**variables),
    )


def printed_json(code: str, *, timeout: float = 120, **variables: str) -> Any:
    """What `code`, run by `python` (TensorFlow quiet, no GPU), printed as JSON on its last
    line; the child's failure fails the test with the end of its stderr."""
    done = python(
        code,
        timeout=timeout,
        **{"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "", **variables},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def as_in_a_terminal() -> None:
    """A child's ``preexec_fn``: Ctrl-C (SIGINT) does what it does in a terminal.

    A shell's background job (``make test &``, a CI runner's) starts with SIGINT ignored,
    which its children inherit, and Python then never raises KeyboardInterrupt.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finished(
    started: Mapping[str, subprocess.Popen], timeout: float = 180
) -> dict[str, tuple[int, str, str]]:
    """Waits for every process of `started`, started at once so their TensorFlow starts
    overlap, each with its output piped as text.

    Returns:
      name -> (exit status, stdout, stderr).
    """
    runs = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=timeout)
        runs[name] = (process.returncode, out, err)
    return runs
