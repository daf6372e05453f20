"""``python -m tfshard.worker`` (tfshard/worker.py), the command that starts one task's server.

Every test runs the real command in a child process on 127.0.0.1, as a user
would; `tfshard.cluster.start_server` underneath has its own tests in
tests/test_cluster.py. The runs that fail before serving start together, once
per module (each child pays for importing TensorFlow), and the tests below read
their results.
"""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import children
import pytest
from ports import free_addresses

from tfshard import worker

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 90  # seconds for a child to import TF and get going on a busy machine
# Quiet TF's C++ logs in the children; keep tfshard's own. No TF_CONFIG unless a test sets one.
ENV = children.environ(without=("TF_CONFIG",), TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")


def _start(*flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tfshard.worker", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or ENV,
        cwd=ROOT,
        preexec_fn=children.as_in_a_terminal,  # a worker in a terminal gets Ctrl-C's default
    )


def _ready_line(process: subprocess.Popen) -> str:
    """The first stdout line, which a serving worker prints once it listens."""
    deadline = time.monotonic() + START_TIMEOUT
    line = process.stdout.readline()  # Blocks until the line, or EOF when it exits.
    assert time.monotonic() < deadline, "no ready line in time"
    if not line:
        process.wait(timeout=30)
        raise AssertionError(f"exited {process.returncode}: {process.stderr.read()[-3000:]}")
    return line.rstrip("\n")


def _listens(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


# --------------------------------------------------------- runs that fail


@pytest.fixture(scope="module")
def failed_runs():
    """Each case of a worker that must not start: {case: (status, stdout, stderr)}."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    busy_address = f"127.0.0.1:{busy.getsockname()[1]}"
    two = ",".join(free_addresses(2))
    cases = {
        "bad_task": (f"--cluster={two}", "--task=5"),
        "no_task": (f"--cluster={two}",),
        "bad_job": (f"--cluster={two}", "--job=ps", "--task=0"),
        "no_cluster": (),
        "bad_cluster": ("--cluster=127.0.0.1", "--task=0"),
        "busy_port": (f"--cluster={busy_address}", "--task=0"),
        "negative_task": (f"--cluster={two}", "--task=-1"),
    }
    try:
        started = {case: _start(*flags) for case, flags in cases.items()}
        runs = children.finished(started, START_TIMEOUT * 2)
    finally:
        busy.close()
    runs["busy_address"] = busy_address
    return runs


@pytest.mark.parametrize(
    "case, message",
    [
        ("bad_task", r"--task=5: job 'worker' has tasks [0, 1] (0: 127.0.0.1:"),
        ("no_task", r"which task of job 'worker' is this? pass --task=N (N in [0, 1])"),
        ("bad_job", r"job 'ps' is not in the cluster (its jobs: worker); pass --job"),
        (
            "no_cluster",
            "no cluster given and TF_CONFIG is not set: pass the whole cluster and this "
            "server's place in it, e.g. --cluster=host1:2222,host2:2222 --task=0 (task i is "
            "entry i), or set TF_CONFIG to",
        ),
        ("bad_cluster", r"cluster: job 'worker' task 0: address '127.0.0.1' is not 'host:port'"),
    ],
)
def test_a_worker_that_cannot_start_exits_1_with_one_line_naming_the_fix(
    failed_runs, case, message
):
    status, out, err = failed_runs[case]
    assert status == 1, err[-3000:]
    assert f"tfshard.worker: error: {message}" in err
    assert "Traceback" not in err
    assert worker.READY not in out


def test_a_worker_on_a_busy_port_names_the_port_and_serves_nothing(failed_runs):
    status, out, err = failed_runs["busy_port"]
    address = failed_runs["busy_address"]
    port = address.rsplit(":", 1)[1]
    assert status == 1, err[-3000:]
    assert f"tfshard.worker: error: port {port} of this task's address '{address}' is " in err
    assert "already in use" in err and worker.READY not in out


def test_a_negative_task_is_a_flag_error(failed_runs):
    status, out, err = failed_runs["negative_task"]
    assert status == 1 and worker.READY not in out
    assert "flag --task=-1: -1 is not a non-negative integer" in err


# --------------------------------------------------------- runs that serve


def test_a_worker_serves_its_task_until_ctrl_c():
    addresses = free_addresses(2)
    process = _start(f"--cluster={','.join(addresses)}", "--task=1")
    try:
        line = _ready_line(process)
        assert line == (
            f"{worker.READY} /job:worker/replica:0/task:1 at {addresses[1]}; "
            f"connect with tfshard.connect({','.join(addresses)!r})"
        )
        assert _listens(addresses[1])
        process.send_signal(signal.SIGINT)  # What Ctrl-C sends, to the whole process.
        start = time.monotonic()
        _, err = process.communicate(timeout=60)
        # Measured: 2 s, most of it TensorFlow's exit; it served on for good before.
        assert time.monotonic() - start < 30
    finally:
        process.kill()
        process.wait(timeout=30)
    assert process.returncode == 0, err[-3000:]
    assert "tfshard worker: job worker task 1 stopped" in err
    assert "Traceback" not in err


def test_a_worker_takes_its_cluster_and_task_from_tf_config_and_ends_on_sigterm():
    worker_address, ps_address = free_addresses(2)
    jobs = {"worker": [worker_address], "ps": [ps_address]}
    config = {"cluster": jobs, "task": {"type": "ps", "index": 0}}
    process = _start(env=children.environ(ENV, TF_CONFIG=json.dumps(config)))
    try:
        line = _ready_line(process)
        prefix = f"{worker.READY} /job:ps/replica:0/task:0 at {ps_address}; connect with "
        assert line.startswith(prefix)
        # The connect call it prints names the whole cluster, both jobs.
        shown = line[len(prefix) :]
        assert shown.startswith("tfshard.connect('") and shown.endswith("')")
        assert json.loads(shown[len("tfshard.connect('") : -2]) == jobs
        assert _listens(ps_address)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        process.kill()
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGTERM  # The default action: a TF server has no stop.
