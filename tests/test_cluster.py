"""Connecting to a TensorFlow cluster: names, probing, and two real workers on loopback.

`tfshard.connect` changes this process's TensorFlow context for good, and the
other tests rely on the four local logical CPUs of ../conftest.py, so nothing
here connects in the pytest process: the client runs in a subprocess (the
script `CLIENT` below) and reports JSON lines. The workers are
``python -m tfshard.worker`` processes on 127.0.0.1, started and killed by the
`two_workers` fixture. Only loopback addresses are used.
"""

import concurrent.futures
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import children
import numpy as np
import pytest
import tensorflow as tf
from ports import free_ports

import tfshard
from tfshard import cluster, pinning, worker
from tfshard.errors import ArgumentError, ClusterError, DeviceError

ROOT = Path(__file__).resolve().parent.parent
# Quiet TF's C++ logs in the children; keep tfshard's own.
# The cluster bed is CPU workers (their CPU:0 is what the tests name); a GPU of the machine
# would add /device:GPU:0 to every task's devices.
CHILD_ENV = children.environ(
    without=(pinning.CONTEXTS_ENV, cluster.TF_CONFIG_ENV),
    TF_CPP_MIN_LOG_LEVEL="2",
    PYTHONUNBUFFERED="1",
    CUDA_VISIBLE_DEVICES="",
)
START_TIMEOUT = 90  # seconds for a child to import TF and get going on a busy machine


# ------------------------------------------------------- names, in-process


# How remote spellings parse: tests/test_device_names.py.


@pytest.mark.parametrize("spec", ["cpu:1", "/device:CPU:0", "GPU:1", "cuda1", 2])
def test_local_spellings_are_not_remote(spec):
    assert not pinning.is_remote(spec)
    assert cluster.host_of(spec) is None


def test_short_remote_name_without_a_cluster_says_to_connect():
    with pytest.raises(
        DeviceError,
        match=r"'worker1:GPU:0' .*does not exist.*this process is not connected to a cluster: "
        r"call tfshard\.connect\(cluster\) first \(with a 'worker' job of at least 2 task",
    ):
        tfshard.resolve_device("worker1:GPU:0")
    assert cluster.host_of("worker1:GPU:0") is None


# With a cluster connected, what host_of and resolve_device say of remote names:
# test_parallelize_across_two_workers_survives_a_worker_restart (a real connection).


# ------------------------------------------------------ clusters, in-process


@pytest.mark.parametrize(
    "spelling",
    [
        {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
        {"worker": {0: "127.0.0.1:2222", 1: "127.0.0.1:2223"}},
        tf.train.ClusterSpec({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}),
        "127.0.0.1:2222, 127.0.0.1:2223",
        '{"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}',
        '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {}}',
    ],
)
def test_every_cluster_spelling_gives_the_same_spec(spelling):
    spec = cluster.cluster_spec(spelling)
    assert spec.as_dict() == {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


def test_cluster_comes_from_tf_config(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps({"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "chief"}}),
    )
    assert cluster.cluster_spec().as_dict() == {"worker": ["127.0.0.1:2222"]}


def test_missing_tf_config_says_how_to_give_a_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ArgumentError, match=r"TF_CONFIG is not set: pass the workers"):
        cluster.cluster_spec()


@pytest.mark.parametrize(
    "spelling, message",
    [
        ({"worker": ["127.0.0.1"]}, r"job 'worker' task 0: address '127.0.0.1' is not 'host:port'"),
        ({"worker": ["127.0.0.1:0"]}, r"a port is 1-65535"),
        ({"worker": []}, r"job 'worker' has no tasks"),
        ({"1worker": ["127.0.0.1:1"]}, r"job name '1worker' is not a TensorFlow job name"),
        ({"localhost": ["127.0.0.1:1"]}, r"job 'localhost' is the name this process takes"),
        ({"worker": ["127.0.0.1:1", "127.0.0.1:1"]}, r"task:0 and /job:worker/task:1 .*same|both"),
        ({"worker": {-1: "127.0.0.1:1"}}, r"task -1: a task index is an int >= 0"),
        ('{"worker": [', r"is not valid JSON"),
        (42, r"cluster=42: pass a tf.train.ClusterSpec"),
        ({}, r"the cluster has no jobs"),
    ],
)
def test_bad_clusters_name_the_job_task_and_fix(spelling, message):
    with pytest.raises(ArgumentError, match=message):
        cluster.cluster_spec(spelling)


def test_a_failed_connect_gives_the_command_that_starts_each_worker():
    ports = free_ports(3)  # Nothing listens there now.
    addresses = [f"127.0.0.1:{port}" for port in ports]
    with pytest.raises(ClusterError) as raised:
        tfshard.connect(",".join(addresses[:2]), timeout=1)
    message = str(raised.value)
    assert "connect: 2 of 2 worker(s) did not answer within 1 s:" in message
    assert f"--cluster={addresses[0]},{addresses[1]} --task=1" in message
    two_jobs = {"worker": addresses[:2], "ps": addresses[2:]}
    with pytest.raises(ClusterError) as raised:
        tfshard.connect(two_jobs, timeout=1)
    flag = cluster.cluster_flag(cluster.cluster_jobs(two_jobs))
    assert cluster.cluster_jobs(json.loads(flag)) == cluster.cluster_jobs(two_jobs)
    assert f"/job:ps/task:0 at {addresses[2]}: " in str(raised.value)
    assert f"python -m tfshard.worker --cluster='{flag}' --job=ps --task=0" in str(raised.value)


def test_connect_to_a_closed_port_fails_fast_naming_the_address():
    (port,) = free_ports(1)  # Nothing listens there now.
    start = time.monotonic()
    with pytest.raises(ClusterError) as raised:
        tfshard.connect({"worker": [f"127.0.0.1:{port}"]}, timeout=2)
    assert time.monotonic() - start < 30  # bounded by the timeout, however busy the machine
    message = str(raised.value)
    assert f"/job:worker/task:0 at 127.0.0.1:{port}: Connection refused for 2 s" in message
    assert f"python -m tfshard.worker --cluster=127.0.0.1:{port} --task=0" in message
    # Nothing changed: TF was never asked to connect.
    assert cluster.host_of("worker0:CPU:0") is None
    with pytest.raises(DeviceError, match=r"this process is not connected to a cluster"):
        tfshard.resolve_device("worker0:CPU:0")


def test_a_port_that_never_answers_is_bounded_by_the_timeout():
    with socket.socket() as silent:  # Accepts connections (backlog), never speaks gRPC.
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ClusterError) as raised:
            tfshard.connect(address, timeout=1.0)
    assert time.monotonic() - start < 30  # bounded by the timeout, however busy the machine
    assert f"/job:worker/task:0 at {address}: accepted a connection but did not answer " in str(
        raised.value
    )


def test_connect_rejects_a_bad_timeout():
    with pytest.raises(ArgumentError, match=r"timeout=0"):
        tfshard.connect("127.0.0.1:1", timeout=0)


def test_explain_remote_error_ignores_errors_without_a_cluster():
    error = tf.errors.UnavailableError(None, None, "Socket closed")
    assert cluster.connection() is None  # nothing connects in this process
    assert cluster.explain_remote_error(error) is None


# A record of a cluster built by hand connects nothing: what `connect` records, and what
# the module's functions read from it, is in the two-worker test below.


@contextlib.contextmanager
def _fake_worker(address: str = "127.0.0.1:0"):
    """A gRPC server that answers TensorFlow's worker status call (a probe), counting them.

    Yields an object with `address` and `calls`.
    """
    import grpc  # A dependency of TensorFlow.

    worker = types.SimpleNamespace(calls=0, address=None)
    lock = threading.Lock()

    def get_status(request, context):  # an empty GetStatusResponse
        with lock:
            worker.calls += 1
        return b""

    handler = grpc.method_handlers_generic_handler(
        "tensorflow.WorkerService", {"GetStatus": grpc.unary_unary_rpc_method_handler(get_status)}
    )
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        server = grpc.server(pool)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port(address)
        assert port, f"could not listen on {address}"
        worker.address = f"127.0.0.1:{port}"
        server.start()
        try:
            yield worker
        finally:
            server.stop(None).wait()


def test_explain_names_the_dead_worker():
    (port,) = free_ports(1)
    connection = cluster.Connection({"worker": {0: f"127.0.0.1:{port}"}}, "127.0.0.1:9")
    error = tf.errors.UnavailableError(
        None, None, "remote target /job:worker/replica:0/task:0/device:CPU:0 while calling x"
    )
    hint = connection.explain(error, probe_timeout=1)
    assert f"/job:worker/task:0 at 127.0.0.1:{port} is down (Connection refused" in hint
    assert "--task=0" in hint and "tfshard.connect(...) again" in hint
    assert connection.explain(ValueError("x")) is None
    assert connection.host_of("worker0:CPU:0") == f"127.0.0.1:{port}"
    assert connection.host_of("worker1:CPU:0") is None and connection.host_of("cpu:0") is None
    with pytest.raises(ArgumentError, match=r"explain\(probe_timeout=0\)"):
        connection.explain(error, probe_timeout=0)


def test_explain_ignores_a_shards_error_that_a_worker_sent():
    """A worker that sent the shard's own error (gRPC status 3) is up: no hint, no probe."""
    with socket.socket() as worker:  # a probe would connect here
        worker.bind(("127.0.0.1", 0))
        worker.listen(4)
        address = f"127.0.0.1:{worker.getsockname()[1]}"
        connection = cluster.Connection({"worker": {0: address}}, "127.0.0.1:9")
        error = tf.errors.InvalidArgumentError(
            None,
            None,
            "log of a negative\nAdditional GRPC error information from remote target "
            "/job:localhost/replica:0/task:0/device:CPU:0 and /job:worker/replica:0/task:0 "
            "while calling x:\n:UNKNOWN:Error received from peer  "
            '{grpc_status:3, grpc_message:"log"}',
        )
        assert connection.explain(error) is None
        worker.setblocking(False)
        with pytest.raises(BlockingIOError):
            worker.accept()  # nothing connected: no probe
    assert connection.found_down() == {}


def test_a_task_found_down_stays_down_until_connect_and_is_not_probed_again():
    (port,) = free_ports(1)  # task 1: nothing listens there, a connection is refused
    with _fake_worker() as up:
        jobs = {"worker": {0: up.address, 1: f"127.0.0.1:{port}"}}
        connection = cluster.Connection(jobs, "127.0.0.1:9")
        assert not connection.any_down()
        error = tf.errors.UnavailableError(
            None, None, "Socket closed from remote target /job:worker/replica:0/task:1 while x"
        )
        # A refused connection is a worker down, not one starting: no wait ("Connection
        # refused for 2 s" is the probe's word for one waited on).
        assert connection.explain(error).startswith(
            f"/job:worker/task:1 at 127.0.0.1:{port} is down (Connection refused: is the worker "
            f"running?); restart it with: python -m tfshard.worker --cluster={up.address},"
            f"127.0.0.1:{port} --task=1; then call tfshard.connect(...) again with the same "
            "cluster and run the call again (it returned nothing"
        )
        assert up.calls == 1  # every task was probed, task 0 answered
        assert connection.found_down() == {
            ("worker", 1): "Connection refused: is the worker running?"
        }
        assert connection.any_down()
        assert connection.down_task("/job:worker/replica:0/task:1/device:CPU:0") == ("worker", 1)
        assert connection.down_task("/job:worker/replica:0/task:0/device:CPU:0") is None
        assert connection.down_task("/device:CPU:0") is None
        # Found down, it is not asked again, even once it answers: only task 0 is.
        with _fake_worker(jobs["worker"][1]) as back:
            assert not connection.all_answer()
            assert (up.calls, back.calls) == (2, 0)
        assert connection.down_hint().endswith(
            "(this call did not run: an earlier call found the worker down, and every call on "
            "it fails at once until then)"
        )
    # `connect` makes a new record of the cluster: nothing is down in it.
    fresh = cluster.Connection(jobs, "127.0.0.1:9")
    assert not fresh.any_down() and fresh.down_hint() is None


@pytest.mark.parametrize(
    "job, task, message",
    [
        (None, None, r"^which task of job 'worker' is this\? pass task=N \(N in \[0, 1\]\)"),
        (None, 5, r"^task=5: job 'worker' has tasks \[0, 1\] \(0: 127.0.0.1:2222, 1: "),
        ("ps", 0, r"job 'ps' is not in the cluster \(its jobs: worker\); pass job=NAME with one"),
        # "0" would print as the task 0 the cluster has
        (None, "0", r"^task='0' is of type str; pass this task's index in its job, an int$"),
        (None, 0.0, r"^task=0\.0 is of type float"),
        (None, True, r"^task=True is of type bool"),
        (3, 0, r"^job=3 is of type int; pass the job's name, a str such as 'worker'$"),
    ],
)
def test_worker_names_a_bad_task_before_starting(monkeypatch, job, task, message):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ArgumentError, match=message) as raised:
        cluster.start_server("127.0.0.1:2222,127.0.0.1:2223", job, task)
    # A call names the function's arguments; the command's flags are python -m tfshard.worker's.
    assert "--" not in str(raised.value)


def test_a_start_server_message_said_as_the_command_s_flags():
    said = cluster.as_flags("task=5: job 'worker' has tasks [0, 1]; pass job=NAME, cluster=X")
    assert said == "--task=5: job 'worker' has tasks [0, 1]; pass --job=NAME, --cluster=X"
    assert cluster.as_flags("--task=5 of /job:worker/task:1, TF_CONFIG's task_index=1") == (
        "--task=5 of /job:worker/task:1, TF_CONFIG's task_index=1"
    )


def test_a_numpy_task_index_is_an_index(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ArgumentError, match=r"^task=5: job 'worker' has tasks \[0, 1\]"):
        cluster.start_server("127.0.0.1:2222,127.0.0.1:2223", None, np.int64(5))


def test_worker_on_a_busy_port_says_which():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(ArgumentError, match=rf"port \d+ of this task's address '{address}' is"):
            cluster.start_server(address, None, 0)


# ------------------------------------------------------------ two workers

CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import tensorflow as tf
    import tfshard
    from tfshard import cluster, pinning

    def say(**event):
        print(json.dumps(event), flush=True)

    def wait_for_go():
        assert sys.stdin.readline().strip() == "go"

    addresses = sys.argv[1]
    wait_for_go()  # TF is imported; the workers are serving now.
    remote = cluster.connect(addresses, timeout=20)
    say(event="connected", remote=remote, devices=tfshard.list_devices(),
        short=tfshard.resolve_device("worker1:cpu"),
        full=tfshard.resolve_device("/job:worker/task:0/device:CPU:0"),
        local=tfshard.resolve_device("cpu:0"), host=cluster.host_of("worker1:CPU:0"),
        host0=cluster.host_of("/job:worker/replica:0/task:0/device:CPU:0"),
        host_outside=cluster.host_of("worker7:CPU:0"), jobs=cluster.connection().jobs)

    def missing(spec):
        try:
            tfshard.resolve_device(spec)
        except tfshard.DeviceError as error:
            return str(error)
        return "resolved"

    say(event="missing", task=missing("worker7:CPU:0"), job=missing("ps0:CPU:0"),
        device=missing("worker1:CPU:5"))

    W = tf.constant(np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32))

    def embed(sample):  # [6] -> [4], and the row itself to check order
        return {"y": tf.tanh(tf.linalg.matvec(W, sample, transpose_a=True)), "row": sample}

    devices = ["worker0:CPU:0", "cpu:0", "worker1:CPU:0"]
    f = tfshard.parallelize(embed, devices=devices)
    local = tfshard.parallelize(embed, devices=["cpu:0"])
    count = tfshard.parallelize(lambda s: tf.ones([]), devices=devices, reduce="sum")

    def check(n):
        x = np.arange(n * 6, dtype=np.float32).reshape(n, 6) / 7.0
        out, ref = f(x), local(x)
        return {
            "n": n,
            "rows_in_order": bool(np.array_equal(out["row"].numpy(), x)),
            "max_rel_err": float(np.max(np.abs(out["y"].numpy() - ref["y"].numpy())
                                        / np.maximum(np.abs(ref["y"].numpy()), 1e-6),
                                        initial=0.0)),
            "count": float(count(x).numpy()),
            "output_device": out["y"].device,
        }

    say(event="results", checks=[check(n) for n in (0, 1, 2, 7, 64)],
        explain=f.explain(np.zeros((7, 6), np.float32)),
        remote_flags=[pinning.is_remote(d) for d in f.devices],
        trace_count=f.trace_count)

    # Datasets: gathered on a worker (one call per batch), and here (the traced loop).
    here = tfshard.parallelize(embed, devices=devices, output_device="cpu:0")
    streams = []
    for n in (0, 7, 23):
        x = np.arange(n * 6, dtype=np.float32).reshape(n, 6) / 7.0
        ds = tf.data.Dataset.from_tensor_slices(x).batch(5)
        streams.append({"n": n, "on_worker": bool(np.array_equal(f(ds)["row"].numpy(), x)),
                        "here": bool(np.array_equal(here(ds)["row"].numpy(), x))})
    say(event="datasets", streams=streams)

    # Where each shard is, and weights="auto", across workers (issue 30).
    ones = tf.ones([6, 256])

    def where(block):  # each row's shard and global row, after work enough to time
        work = tf.reduce_sum(tf.tanh(tf.matmul(block, ones)), axis=1)
        shard = tf.cast(tf.fill(tf.shape(work), tfshard.shard_index()), tf.float32)
        return tf.stack([shard + 0.0 * work, tf.cast(tfshard.row_index(), tf.float32)], 1)

    auto = tfshard.parallelize(where, devices=devices, per_sample=False, weights="auto",
                               output_device="cpu:0")
    x = np.ones((3000, 6), np.float32)
    plans, placed = [], True
    for _ in range(6):
        plan, got = auto.plan(3000), auto(x).numpy()
        plans.append(plan)
        want = np.stack([np.repeat(np.arange(3), plan), np.arange(3000)], 1)
        placed = placed and bool(np.array_equal(got, want))
    # Measured on every device: weights found, or even kept as no split is predicted faster
    # (the devices are alike here), never "not every device yet".
    lines = [line for line in auto.explain(x).splitlines() if "weights='auto'" in line]
    say(event="auto", weights=auto.weights, plans=plans, placed=placed, weights_line=lines)

    say(event="kill_worker", task=1)
    wait_for_go()
    start = time.monotonic()
    try:
        check(8)
        say(event="dead_call", ok=True)
    except Exception as error:  # noqa: BLE001
        say(event="dead_call", ok=False, seconds=time.monotonic() - start,
            type=type(error).__name__, tf_type=isinstance(error, tf.errors.OpError),
            message=str(error)[:3000], hint=cluster.explain_remote_error(error),
            found_down=list(cluster.connection().found_down()))

    say(event="restart_worker", task=1)
    wait_for_go()
    start = time.monotonic()
    cluster.connect(addresses, timeout=20)
    say(event="reconnected", seconds=time.monotonic() - start, results=check(9),
        found_down=list(cluster.connection().found_down()))
    """
)


class _Child:
    """A subprocess whose stdout lines are read in the background, with deadlines."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=CHILD_ENV,
            cwd=ROOT,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        pump = threading.Thread(target=self._pump, args=(self.process.stdout, self.lines))
        pump.daemon = True
        pump.start()
        threading.Thread(target=self._drain, daemon=True).start()

    @staticmethod
    def _pump(stream, lines) -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def _drain(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line)

    def read_until(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                message = f"timed out after {timeout} s; stderr:\n{self.tail()}"
                raise AssertionError(message) from None
            if line is None:
                raise AssertionError(f"exited with {self.process.wait()}; stderr:\n{self.tail()}")
            if predicate(line):
                return line

    def send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def tail(self) -> str:
        return "".join(self.stderr[-30:])

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()


class _Workers:
    """``python -m tfshard.worker`` processes on 127.0.0.1, one per task."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.addresses = [f"127.0.0.1:{port}" for port in free_ports(count)]
        self.cluster = ",".join(self.addresses)
        self.children: dict[int, _Child] = {}
        self.ready: dict[int, str] = {}  # task -> the line it printed once serving

    def start(self, task: int) -> None:
        self.ready.pop(task, None)
        self.children[task] = _Child(
            [sys.executable, "-m", "tfshard.worker", f"--cluster={self.cluster}", f"--task={task}"]
        )

    def wait_ready(self, task: int) -> str:
        if task not in self.ready:
            ready = self.children[task].read_until
            self.ready[task] = ready(lambda line: line.startswith(worker.READY), START_TIMEOUT)
        return self.ready[task]

    def serve_every_task(self) -> None:
        """Starts each task that is not running (never started, killed, or exited)."""
        for task in range(self.count):
            child = self.children.get(task)
            if child is None or child.process.poll() is not None:
                if child is not None:
                    self.kill(task)
                self.start(task)

    def kill(self, task: int) -> None:
        self.ready.pop(task, None)
        self.children.pop(task).kill()

    def kill_all(self) -> None:
        for task in list(self.children):
            self.kill(task)


@pytest.fixture(scope="module")
def _served_workers():
    """The module's two worker servers; every process killed at the end of the module."""
    workers = _Workers(2)
    try:
        yield workers
    finally:
        workers.kill_all()


@pytest.fixture
def two_workers(_served_workers):
    """Two worker servers on free loopback ports, each task running when the test starts.

    Shared by the tests of this module (a worker imports TensorFlow: seconds each): a task
    a test killed, or left busy and killed at its end, is started again for the next. A
    worker holds nothing of a client that left: each client connects its own context.
    """
    _served_workers.serve_every_task()
    return _served_workers


def _event(child: _Child, name: str, timeout: float = START_TIMEOUT) -> dict:
    def wanted(line: str) -> bool:
        return line.startswith("{") and json.loads(line)["event"] == name

    return json.loads(child.read_until(wanted, timeout))


def test_parallelize_across_two_workers_survives_a_worker_restart(two_workers):
    client = _Child([sys.executable, "-c", CLIENT, two_workers.cluster])
    try:
        ready = [two_workers.wait_ready(task) for task in range(2)]
        assert ready[1] == (
            f"{worker.READY} /job:worker/replica:0/task:1 at {two_workers.addresses[1]}; "
            f"connect with tfshard.connect({two_workers.cluster!r})"
        )
        client.send("go")

        connected = _event(client, "connected")
        remote = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(2)]
        assert connected["remote"] == remote
        assert set(remote) < set(connected["devices"]) and "/device:CPU:0" in connected["devices"]
        assert connected["short"] == remote[1] and connected["full"] == remote[0]
        assert connected["local"] == "/device:CPU:0"
        assert connected["host"] == two_workers.addresses[1]
        assert connected["host0"] == two_workers.addresses[0]
        assert connected["host_outside"] is None
        # What connect recorded (JSON spells the task indices as strings).
        want = {"worker": {str(i): a for i, a in enumerate(two_workers.addresses)}}
        assert connected["jobs"] == want
        missing = _event(client, "missing")
        for name in ("task", "job"):
            assert missing[name].endswith("; the connected cluster has worker tasks [0, 1]")
        assert missing["device"].startswith(
            "device 'worker1:CPU:5' (/job:worker/replica:0/task:1/device:CPU:5) does not exist"
        )
        assert missing["device"].endswith("; /job:worker/task:1 has no such device")

        results = _event(client, "results")
        for check in results["checks"]:  # Order, exactly once, and the local result.
            assert check["rows_in_order"], check
            assert check["count"] == check["n"], check
            assert check["max_rel_err"] < 1e-5, check
            assert check["output_device"].endswith("/job:worker/replica:0/task:0/device:CPU:0")
        assert results["remote_flags"] == [True, False, True]
        # Per sample: one graph for exactly the first size (0 rows); then, rows open, one
        # for 1 and 2 rows on the 3 devices (a shard without rows) and one for 7 and 64
        # (every device has rows): the same graphs serve every batch size.
        assert results["trace_count"] == 3
        explain = results["explain"]
        assert "/job:worker/replica:0/task:1/device:CPU:0  [5:7)" in explain
        assert f"(network: {two_workers.addresses[1]})" in explain
        # The output lands on worker 0, so even the local shard's result crosses.
        assert "3 of 3 shards cross the network" in explain

        streams = _event(client, "datasets")["streams"]
        assert all(s["on_worker"] and s["here"] for s in streams), streams
        auto = _event(client, "auto")
        # Each row knew its shard and global row under every plan, and the shards on the
        # workers were timed on their own clocks: every device is measured (explain says so).
        assert auto["placed"] and auto["plans"][0] == [1000, 1000, 1000], auto
        assert len(auto["weights_line"]) == 1, auto
        assert "not every device yet" not in auto["weights_line"][0], auto
        assert auto["weights"] is None or len(auto["weights"]) == 3, auto

        _event(client, "kill_worker")
        two_workers.kill(1)
        client.send("go")
        dead = _event(client, "dead_call", timeout=60)
        assert not dead["ok"]
        assert dead["seconds"] < 30, dead  # Measured: milliseconds for a killed process.
        assert dead["tf_type"] and dead["type"].endswith("UnavailableError"), dead
        assert "task:1" in dead["message"], dead["message"]
        assert dead["hint"].startswith(
            f"/job:worker/task:1 at {two_workers.addresses[1]} is down (Connection refused"
        ), dead["hint"]
        assert "then call tfshard.connect(...) again" in dead["hint"]
        assert dead["found_down"] == [["worker", 1]]

        _event(client, "restart_worker")
        two_workers.start(1)
        two_workers.wait_ready(1)
        client.send("go")
        again = _event(client, "reconnected", timeout=60)
        assert again["results"]["rows_in_order"] and again["results"]["max_rel_err"] < 1e-5
        assert again["results"]["count"] == 9
        assert again["found_down"] == []  # connect made a new record
        assert client.process.wait(timeout=30) == 0, client.tail()
    finally:
        client.kill()


FAILING_CLIENT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf
    import tfshard
    from tfshard import cluster
    from tfshard.errors import ShardError

    assert sys.stdin.readline().strip() == "go"
    cluster.connect(sys.argv[1], timeout=20)
    devices = ["worker0:CPU:0", "cpu:0", "worker1:CPU:0"]
    named = []
    for per_sample in (False, True):
        # The output lands on worker 0 (the first device).
        f = tfshard.parallelize(
            lambda s: tf.debugging.check_numerics(tf.math.log(s), "log of a negative"),
            devices=devices, per_sample=per_sample)
        for bad in range(9):
            x = np.ones((9, 1), np.float32)
            x[bad] = -1.0
            k = bad // 3
            try:
                f(x)  # never read: the call itself must fail, naming the shard
                named.append(f"row {bad}: the call returned")
            except ShardError as error:
                text = str(error)
                right = (
                    f"shard {k} on {f.devices[k]} (rows [{3 * k}:{3 * k + 3}) of 9) failed: "
                    in text and "log of a negative" in text
                    and isinstance(error, tf.errors.InvalidArgumentError)
                    and "lost contact" not in text  # the workers never went away
                )
                named.append("ok" if right else f"row {bad}: {text[:400]}")
            except Exception as error:  # noqa: BLE001
                named.append(f"row {bad}: {type(error).__name__}: {str(error)[:400]}")
            try:  # nothing is left pending: the next call works
                good = f(np.full((9, 1), np.e, np.float32)).numpy()
                if not np.allclose(good, 1.0):
                    named.append(f"row {bad}: next call returned {good.ravel().tolist()}")
            except Exception as error:  # noqa: BLE001
                named.append(f"row {bad}: next call {type(error).__name__}: {str(error)[:400]}")
    # Inside a tf.function the call is traced, not run: nothing to wait for there.
    outer = tf.function(lambda x: f(x))
    if not np.allclose(outer(tf.fill([9, 1], np.float32(np.e))).numpy(), 1.0):
        named.append("in a tf.function: a wrong result")
    print(json.dumps({"event": "failures", "named": named}), flush=True)
    """
)


def test_a_failing_shard_across_workers_is_named_every_time(two_workers):
    """With the output on a worker, the call itself fails naming the shard, its device
    and rows, and leaves nothing behind for the next call.

    Before, the call returned before the shards ran: TF raised where the value was
    read, naming no shard; an unread failed value failed the next call ("Primary
    device is not remote"), and a failure reported late by the other worker
    surfaced in the next call, naming the shard that failed before (2 of 5 runs).
    Across workers each shard traces in place: as a shared call, a failure lost
    its error to the cancelled receives from other tasks (7 of 18 times).
    """
    client = _Child([sys.executable, "-c", FAILING_CLIENT, two_workers.cluster])
    try:
        for task in range(2):
            two_workers.wait_ready(task)
        client.send("go")
        named = _event(client, "failures", timeout=120)["named"]
        assert named == ["ok"] * 18, [n for n in named if n != "ok"]
    finally:
        client.kill()


DYING_CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import tensorflow as tf
    import tfshard
    from tfshard import cluster
    from tfshard.errors import ShardError

    def say(**event):
        print(json.dumps(event), flush=True)

    def wait_for_go():
        assert sys.stdin.readline().strip() == "go"

    def spin(block):  # [rows, 1] -> the rows, after block[0, 0] steps of a loop
        steps = tf.cast(block[0, 0], tf.int32)
        _, y = tf.while_loop(
            lambda i, y: i < steps, lambda i, y: (i + 1, tf.sin(y)), (0, block))
        return block + 0.0 * y

    def timed(x):
        start = time.monotonic()
        try:
            out = f(x).numpy()
            return {"ok": bool(np.array_equal(out, x)), "seconds": time.monotonic() - start}
        except Exception as error:  # noqa: BLE001
            return {"ok": False, "seconds": time.monotonic() - start,
                    "type": type(error).__name__, "shard_error": isinstance(error, ShardError),
                    "unavailable": isinstance(error, tf.errors.UnavailableError),
                    "message": str(error)}

    addresses = sys.argv[1]
    wait_for_go()
    cluster.connect(addresses, timeout=20)
    f = tfshard.parallelize(spin, devices=["worker0:CPU:0", "worker1:CPU:0"],
                            output_device="worker0:CPU:0", per_sample=False)
    quick = np.zeros((4, 1), np.float32)  # no steps: the rows come back at once
    endless = np.full((4, 1), 2.0**24, np.float32)  # minutes of steps on each worker
    for killed in (1, 0):
        say(event="warm", result=timed(quick))
        say(event="calling")
        say(event="died", result=timed(endless))  # a worker is killed under way
        say(event="after", results=[timed(quick) for _ in range(3)])
        if killed:
            wait_for_go()  # the worker restarted
            cluster.connect(addresses, timeout=20)
    """
)


def test_calls_after_a_worker_dies_mid_call_fail_at_once_naming_the_shard(two_workers):
    """A worker killed under a call whose output lives on a worker: that call and the
    next three fail within seconds, naming the shard, its rows, the task and the remedy
    first; after a restart and `connect` the next call works.

    Before, a worker killed mid-call left the next call hung for good (and the call
    itself, when it was the output's worker): clearing TF's async error state waits,
    with no deadline, for every worker, the dead one too.
    """
    client = _Child([sys.executable, "-c", DYING_CLIENT, two_workers.cluster])
    try:
        for task in range(2):
            two_workers.wait_ready(task)
        client.send("go")
        for killed in (1, 0):  # a shard's worker, then the output's
            assert _event(client, "warm")["result"]["ok"]
            _event(client, "calling")
            time.sleep(1.0)  # the call is under way on both workers
            two_workers.kill(killed)
            died = _event(client, "died", timeout=60)["result"]
            assert died["seconds"] < 30, died  # Measured: ~0.1 s after the kill.
            after = _event(client, "after", timeout=60)["results"]
            device = f"/job:worker/replica:0/task:{killed}/device:CPU:0"
            shard = f"spin: shard {killed} on {device} (rows [{2 * killed}:{2 * killed + 2}) of 4)"
            address = two_workers.addresses[killed]
            remedy = (
                f"/job:worker/task:{killed} at {address} is down (Connection refused: is the "
                f"worker running?); restart it with: python -m tfshard.worker "
                f"--cluster={two_workers.cluster} --task={killed}; then call "
                "tfshard.connect(...) again with the same cluster and run the call again ("
            )
            if killed == 0:  # the output's worker: the output is lost too
                lost = f"{shard} and the output device {device} {{}}: the worker they run on"
            else:
                lost = f"{shard} {{}}: the worker it runs on"
            for result, verb in [(died, "failed"), *[(a, "did not run") for a in after]]:
                assert result["shard_error"] and result["unavailable"], result
                lines = result["message"].split("\n")
                assert lines[0] == lost.format(verb) + " is down", lines[0]
                assert lines[1].startswith(remedy), lines[1]
            assert all(a["seconds"] < 30 for a in after), after  # Measured: ~1 ms each.
            # TF's own text follows the remedy, without gRPC's repetitions.
            assert died["message"].split("\n")[2].startswith("TensorFlow's error: ")
            assert len(died["message"]) < 1500, died["message"]
            if killed:
                two_workers.start(killed)
                two_workers.wait_ready(killed)
                client.send("go")
        assert client.process.wait(timeout=30) == 0, client.tail()
    finally:
        client.kill()
        two_workers.kill_all()  # the restarted task may still run the endless call


# ---------------------------------------------------------------- example


def test_cluster_map_example_runs_on_two_local_workers():
    command = [
        sys.executable,
        str(ROOT / "examples" / "cluster_map.py"),
        "--start_local_workers=2",
        "--devices=worker0:CPU:0,cpu:0,worker1:cpu",
        "--num_samples=37",
    ]
    # Its own session, so a timeout can kill the example and the workers it started.
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=CHILD_ENV,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=START_TIMEOUT + 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
    assert child.returncode == 0, err[-3000:]
    assert "2 of 3 shards cross the network" in out
    assert "  1      /device:CPU:0                              [13:25)" in out
    assert "OK: same embeddings, in the same order, as on one local device" in out


@pytest.mark.parametrize(
    "timeout", [float("inf"), float("-inf"), float("nan"), -1, 0, 1e308, "5", None, True, [1]]
)
def test_connect_and_explain_reject_a_timeout_that_is_not_finite_seconds(timeout):
    with pytest.raises(ArgumentError, match=r"connect\(timeout=.*\): .*a finite number > 0"):
        tfshard.connect("127.0.0.1:1", timeout=timeout)
    error = tf.errors.UnavailableError(None, None, "Socket closed")
    with pytest.raises(ArgumentError, match=r"explain_remote_error\(probe_timeout=.*\): "):
        cluster.explain_remote_error(error, probe_timeout=timeout)
