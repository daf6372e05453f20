"""Other machines: cluster specs, `connect`, probes, keepalive, remote errors.

`connect` makes another machine's devices names like any other: it connects
this process to TensorFlow worker servers as a client, after which
``"/job:worker/task:1/device:GPU:0"`` (or the short ``"worker1:GPU:0"``)
resolves with `tfshard.resolve_device`, and `parallelize` can place shards
there. `start_server` is the other end, one per task; ``python -m
tfshard.worker`` (tfshard/worker.py) is its command line.

One piece of state is module-level, as TensorFlow's cluster connection is: the
`Connection` record of the cluster this process is connected to, which
`connection()` returns and only `connect` replaces. A task found down in it
stays down: a later call that needs it fails before it runs, until `connect`.

A worker that dies fails the running or next call at once with
`tf.errors.UnavailableError` naming its task (`explain_remote_error` says which
workers are down and how to recover). One that stops answering with its
connections still open (a stopped process, a network partition) would block a
call forever; `connect` (and ``python -m tfshard.worker`` on each worker) turns
on gRPC keepalive (``TF_GRPC_DEFAULT_OPTIONS``, unless already set; read when
the process makes its first connection), so that such a call fails instead
(workers started another way need the same variable).

>>> tfshard.cluster.cluster_spec("127.0.0.1:2222,127.0.0.1:2223").as_dict()
{'worker': ['127.0.0.1:2222', '127.0.0.1:2223']}
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import logging
import numbers
import os
import re
import shlex
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import tensorflow as tf

from tfshard import _device_names
from tfshard.errors import (
    ArgumentError,
    ClusterError,
    join_failed,
    links_failed,
    lost_contact,
    remote_cause,
)

__all__ = (
    "Connection",
    "cluster_spec",
    "connect",
    "connection",
    "explain_remote_error",
    "host_of",
    "start_server",
)

_log = logging.getLogger("tfshard")

TF_CONFIG_ENV = "TF_CONFIG"
GRPC_OPTIONS_ENV = "TF_GRPC_DEFAULT_OPTIONS"
# gRPC keepalive, on every process of the cluster (a worker's own channels carry
# the calls to its peers; keepalive on the client alone does not stop the hang):
# a call whose worker stops answering fails with UnavailableError("ping timeout")
# naming the task. 5 min is the shortest interval default gRPC servers accept
# ("Too many pings" otherwise). Measurements: BENCHMARKS.md.
KEEPALIVE_OPTIONS = "grpc.keepalive_time_ms=300000,grpc.keepalive_timeout_ms=20000"
# The job this process takes in the cluster, TensorFlow's name for the client;
# its devices keep their local names ("/device:CPU:0").
_CLIENT_JOB = "localhost"
_JOB_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_WORKER_SERVICE = "/tensorflow.WorkerService/GetStatus"

Jobs = dict[str, dict[int, str]]  # job -> task index -> "host:port"


@dataclasses.dataclass(frozen=True)
class Connection:
    """A cluster this process is a client of: its tasks, this client's address, and
    the tasks found down.

    `connect` makes the one the module functions read (`connection()` returns
    it). One built by hand connects nothing: with the cluster connected another
    way (``tf.config.experimental_connect_to_cluster``), its methods explain that
    cluster's errors and probe its tasks as the module functions do for
    `connect`'s. Build it from validated jobs:
    ``Connection(cluster_jobs("host1:2222,host2:2222"), client="10.0.0.1:4000")``.

    A task found down stays down for this connection, whatever it does next:
    TensorFlow keeps this client's remote state of it until the next
    `connect` (a restarted worker has lost this client's context anyway), and
    `tf.experimental.async_clear_error`, which a failed call with its output
    on a worker needs, waits with no deadline (where Ctrl-C cannot reach it)
    for an answer a dead task never sends.
    """

    jobs: Jobs  # the remote tasks: {job: {task index: "host:port"}}
    client: str  # this process's own gRPC address, "host:port"
    # (job, task) -> why it was found down; only grows, under `lock`.
    down: dict[tuple[str, int], str] = dataclasses.field(default_factory=dict, compare=False)
    lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, compare=False, repr=False
    )

    def address(self, job: str, task: int) -> str | None:
        """The ``host:port`` of a task; None when the cluster has no such task."""
        return self.jobs.get(job, {}).get(task)

    def found_down(self) -> dict[tuple[str, int], str]:
        """The tasks found down so far, in cluster order."""
        with self.lock:
            down = dict(self.down)
        order = [(job, task) for job, tasks in self.jobs.items() for task in tasks]
        return {key: down[key] for key in order if key in down}

    def find_down(self, timeout: float) -> dict[tuple[str, int], str]:
        """Probes the tasks not found down yet (a refused connection counts); all tasks down."""
        known = self.found_down()
        rest = {
            job: {t: a for t, a in tasks.items() if (job, t) not in known}
            for job, tasks in self.jobs.items()
        }
        probes = _probe_all({job: tasks for job, tasks in rest.items() if tasks}, timeout, False)
        now = {key: problem for key, (problem, _) in probes.items() if problem}
        if now:
            with self.lock:
                self.down.update(now)
        return self.found_down()

    def host_of(self, device: _device_names.DeviceSpecLike) -> str | None:
        """`host_of` for this cluster."""
        task = _task_of(device)
        return None if task is None else self.address(*task)

    def explain(self, error: BaseException, probe_timeout: float = 2.0) -> str | None:
        """`explain_remote_error` for this cluster."""
        probe_timeout = _check_timeout(probe_timeout, "explain(probe_timeout")
        by_address = {a: (j, t) for j, ts in self.jobs.items() for t, a in ts.items()}
        tasks = frozenset(by_address.values())
        cause = remote_cause(error, by_address, tasks)
        if cause is None:
            return None
        down = self.find_down(probe_timeout)
        return lost_contact(
            cause,
            down=self._down_hint(down) if down else None,
            addresses={task: self.address(*task) for task in tasks},
            reconnect=_RECONNECT,
        )

    def any_down(self) -> bool:
        """Whether a task was found down; a lookup."""
        return bool(self.down)

    def down_task(self, device: _device_names.DeviceSpecLike) -> tuple[str, int] | None:
        """``(job, task)`` of `device` when that task was found down; None when not, or local."""
        task = _task_of(device)
        return task if task is not None and task in self.found_down() else None

    def down_hint(self) -> str | None:
        """The way back from every task found down, without probing; None when none was."""
        down = self.found_down()
        if not down:
            return None
        return (
            self._down_hint(down)
            + " and run the call again (this call did not run: an earlier call found the worker "
            "down, and every call on it fails at once until then)"
        )

    def all_answer(self, probe_timeout: float = 2.0) -> bool:
        """Whether every task answers: probes those not found down yet, records those down."""
        return not self.find_down(probe_timeout)

    def _down_hint(self, down: Mapping[tuple[str, int], str]) -> str:
        """Each task down, why, and the command that restarts it; then to connect again."""
        parts = [
            f"/job:{job}/task:{task} at {self.address(job, task)} is down ({problem}); "
            f"restart it with: {_worker_command(self.jobs, job, task)}"
            for (job, task), problem in down.items()
        ]
        return "; ".join(parts) + f"; then call {_RECONNECT}"


# TensorFlow's cluster connection is process-wide state (one server def per
# process), so tfshard's record of it is too. Only `connect` replaces it, whole
# and under `_connect_lock` (two threads connecting at once would each change
# TF's server def under the other); readers take the reference once, unlocked.
_connection: Connection | None = None
_connect_lock = threading.Lock()


# ------------------------------------------------------------ cluster specs


def _split_address(address: str, where: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ArgumentError naming `where`."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ArgumentError(
            f"{where}: address {address!r} is not 'host:port' (e.g. '10.0.0.2:2222', "
            "'127.0.0.1:2222'); a port is 1-65535"
        )
    return host, int(port)


def _tasks(job: str, tasks: Any, where: str) -> dict[int, str]:
    if isinstance(tasks, str):
        tasks = [t for t in (part.strip() for part in tasks.split(",")) if t]
    if isinstance(tasks, Mapping):
        items = list(tasks.items())
    elif isinstance(tasks, Sequence):
        items = list(enumerate(tasks))
    else:
        raise ArgumentError(
            f"{where}: job {job!r} has {tasks!r}; give its addresses as a list "
            "['host:port', ...] (task i is entry i) or a dict {task_index: 'host:port'}"
        )
    result: dict[int, str] = {}
    for task, address in items:
        if isinstance(task, str) and task.isdigit():  # JSON object keys are strings
            task = int(task)
        if isinstance(task, bool) or not isinstance(task, int) or task < 0:
            raise ArgumentError(f"{where}: job {job!r} task {task!r}: a task index is an int >= 0")
        if not isinstance(address, str):
            raise ArgumentError(
                f"{where}: job {job!r} task {task} has address {address!r}; expected a "
                "'host:port' string"
            )
        _split_address(address.strip(), f"{where}: job {job!r} task {task}")
        result[task] = address.strip()
    if not result:
        raise ArgumentError(f"{where}: job {job!r} has no tasks; list at least one 'host:port'")
    return dict(sorted(result.items()))


def _read_tf_config() -> tuple[Any, dict[str, Any]]:
    """The ``cluster`` and ``task`` entries of TF_CONFIG."""
    text = os.environ.get(TF_CONFIG_ENV, "").strip()
    if not text:
        raise ArgumentError(
            f"no cluster given and {TF_CONFIG_ENV} is not set: pass the workers, e.g. "
            "tfshard.connect({'worker': ['host1:2222', 'host2:2222']}) or "
            "tfshard.connect('host1:2222,host2:2222'), or set TF_CONFIG to "
            '\'{"cluster": {"worker": ["host1:2222", "host2:2222"]}}\''
        )
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ArgumentError(f"{TF_CONFIG_ENV} is not valid JSON ({error}): {text!r}") from None
    if not isinstance(config, Mapping) or "cluster" not in config:
        raise ArgumentError(
            f"{TF_CONFIG_ENV} has no 'cluster' entry: {text!r}; expected "
            '\'{"cluster": {"worker": ["host1:2222", ...]}, ...}\''
        )
    task = config.get("task") or {}
    return config["cluster"], task if isinstance(task, Mapping) else {}


def cluster_jobs(cluster: Any) -> Jobs:
    """The validated jobs of any spelling `cluster_spec` accepts (shared internal)."""
    cluster, where = _cluster_mapping(cluster)
    jobs: Jobs = {}
    for job, tasks in cluster.items():
        if not isinstance(job, str) or not _JOB_RE.match(job):
            raise ArgumentError(
                f"{where}: job name {job!r} is not a TensorFlow job name (a letter, then "
                "letters, digits or '_', e.g. 'worker')"
            )
        if job == _CLIENT_JOB:
            raise ArgumentError(
                f"{where}: job {job!r} is the name this process takes as the client; "
                "list only the worker servers, under another job name (e.g. 'worker')"
            )
        jobs[job] = _tasks(job, tasks, where)
    if not jobs:
        raise ArgumentError(f"{where}: the cluster has no jobs; e.g. {{'worker': ['host:2222']}}")
    seen: dict[str, str] = {}
    for job, tasks in jobs.items():
        for task, address in tasks.items():
            name = f"/job:{job}/task:{task}"
            if address in seen:
                raise ArgumentError(
                    f"{where}: {name} and {seen[address]} both have address {address!r}; "
                    "each task is its own server on its own port"
                )
            seen[address] = name
    return jobs


def _cluster_mapping(cluster: Any) -> tuple[Mapping[str, Any], str]:
    """``{job: tasks}`` of any `cluster_spec` spelling, not validated, and where it came from."""
    where = "cluster"
    if cluster is None:
        cluster, _ = _read_tf_config()
        where = TF_CONFIG_ENV
    elif isinstance(cluster, tf.train.ClusterSpec):
        cluster = cluster.as_dict()
    elif isinstance(cluster, str):
        text = cluster.strip()
        if text.startswith("{"):
            try:
                cluster = json.loads(text)
            except json.JSONDecodeError as error:
                raise ArgumentError(
                    f"cluster {text!r} is not valid JSON ({error}); pass JSON such as "
                    '\'{"worker": ["host1:2222", "host2:2222"]}\' or a comma list '
                    "'host1:2222,host2:2222'"
                ) from None
            if isinstance(cluster, Mapping) and "cluster" in cluster:
                cluster = cluster["cluster"]  # a whole TF_CONFIG
        else:
            cluster = {"worker": text}
    if not isinstance(cluster, Mapping):
        raise ArgumentError(
            f"cluster={cluster!r}: pass a tf.train.ClusterSpec, a dict such as "
            "{'worker': ['host1:2222', 'host2:2222']}, a comma list 'host1:2222,host2:2222', "
            f"or None to read {TF_CONFIG_ENV}"
        )
    return cluster, where


def cluster_spec(cluster: Any = None) -> tf.train.ClusterSpec:
    """The `tf.train.ClusterSpec` for any cluster spelling tfshard accepts.

    Args:
      cluster: a `tf.train.ClusterSpec`; a dict ``{"worker": ["host1:2222",
        "host2:2222"]}`` (a job's tasks as a list, or a dict ``{task_index:
        address}``); a JSON string of either (a whole ``TF_CONFIG`` works too);
        a comma list ``"host1:2222,host2:2222"``, which is job ``worker``; or None
        to read the ``cluster`` entry of the ``TF_CONFIG`` environment variable.

    Returns:
      The cluster, validated.

    Raises:
      ArgumentError: the cluster is malformed (the message names the job, task
        and address), names the reserved job ``localhost``, or is None without
        ``TF_CONFIG``.

    >>> tfshard.cluster.cluster_spec("127.0.0.1:2222,127.0.0.1:2223").as_dict()
    {'worker': ['127.0.0.1:2222', '127.0.0.1:2223']}
    """
    return tf.train.ClusterSpec(cluster_jobs(cluster))


# ------------------------------------------------------------------- probes


def _probe(
    address: str, timeout: float, wait_for_start: bool = True
) -> tuple[str | None, str | None]:
    """(problem, local address) for one TensorFlow server, bounded by `timeout`.

    First a TCP connect, retried while it is refused (with `wait_for_start`)
    so that workers still starting up (importing TensorFlow takes seconds) are
    waited for; then a gRPC call to the server's worker service, so a port
    that accepts connections but never answers (a stopped process, or not a
    TensorFlow server) is caught too. `problem` is None when it answered.
    Without `wait_for_start` a refused connection is a worker down: after a
    failed call nothing is starting, so waiting would only delay the failure.
    """
    host, port = _split_address(address, "address")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(
                (host, port), timeout=max(deadline - time.monotonic(), 0.05)
            ) as sock:
                local = sock.getsockname()[0]
            break
        except TimeoutError:
            return f"no TCP connection within {timeout:g} s (host down, or a firewall)", None
        except ConnectionRefusedError as error:
            if not wait_for_start:
                return f"{error.strerror}: is the worker running?", None
            if time.monotonic() + 0.25 < deadline:
                time.sleep(0.25)
                continue
            return f"{error.strerror} for {timeout:g} s (is the worker running?)", None
        except OSError as error:
            return f"{error.strerror or error} (is the address right?)", None
    left = max(deadline - time.monotonic(), 1.0)
    try:
        import grpc  # A dependency of TensorFlow itself.
    except ImportError:  # pragma: no cover - TF always brings grpcio.
        return None, local
    channel = grpc.insecure_channel(address)
    try:
        status = channel.unary_unary(_WORKER_SERVICE)
        status(b"", timeout=left)  # An empty GetStatusRequest.
    except grpc.RpcError as error:
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return (
                f"accepted a connection but did not answer within {timeout:g} s (a stopped "
                "or overloaded process, or not a TensorFlow server)"
            ), local
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return "answers, but is not a TensorFlow server (no tensorflow.WorkerService)", local
        problem = f"did not answer the TensorFlow worker service ({code.name}: {error.details()})"
        return problem, local
    finally:
        channel.close()
    return None, local


def _probe_all(
    jobs: Jobs, timeout: float, wait_for_start: bool = True
) -> dict[tuple[str, int], tuple[str | None, str | None]]:
    """`_probe` of every task at once: the whole check takes about `timeout` at most."""
    tasks = [(job, task, address) for job, ts in jobs.items() for task, address in ts.items()]
    if not tasks:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(tasks))) as pool:
        futures = {
            (job, task): pool.submit(_probe, address, timeout, wait_for_start)
            for job, task, address in tasks
        }
        return {key: future.result() for key, future in futures.items()}


def cluster_flag(jobs: Jobs) -> str:
    """The --cluster value of `python -m tfshard.worker` for these jobs (shared internal)."""
    if list(jobs) == ["worker"] and list(jobs["worker"]) == list(range(len(jobs["worker"]))):
        return ",".join(jobs["worker"].values())
    dense = {
        job: list(tasks.values()) if list(tasks) == list(range(len(tasks))) else tasks
        for job, tasks in jobs.items()
    }
    return json.dumps(dense, separators=(",", ":"))


def _worker_command(jobs: Jobs, job: str, task: int) -> str:
    job_flag = "" if job == "worker" else f" --job={job}"
    return (
        f"python -m tfshard.worker --cluster={shlex.quote(cluster_flag(jobs))}"
        f"{job_flag} --task={task}"
    )


# ------------------------------------------------------------------ connect


def _local_address(local: str | None) -> str:
    """This process's gRPC address: a free port on `local`, the interface the probe used."""
    host = local or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _DropSessionConfig(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("default session config")


@contextlib.contextmanager
def _without_session_config_log() -> Iterator[None]:
    """Hides the 20-line session config TF logs at INFO on every connect."""
    absl_logger = logging.getLogger("absl")
    drop = _DropSessionConfig()
    absl_logger.addFilter(drop)
    try:
        yield
    finally:
        absl_logger.removeFilter(drop)


def connect(cluster: Any = None, *, timeout: float = 10.0) -> list[str]:
    """Connects this process to TensorFlow worker servers, as a client.

    Afterwards the workers' devices are devices like any other:
    ``resolve_device("/job:worker/task:1/device:GPU:0")`` (or ``"worker1:GPU:0"``)
    resolves, `list_devices` includes them, and ``parallelize(devices=[...])``
    places shards on them, local and remote mixed. Local devices keep their
    names (``/device:CPU:0``). Start one server per task with
    ``python -m tfshard.worker --cluster=... --task=N``.

    Every address is probed first (a TCP connect, then a call to the server's
    TensorFlow worker service, all tasks at once), because TensorFlow itself
    waits forever for a worker that is not there. This process joins the cluster
    as job ``localhost`` at the address it reached the workers from, on a free
    port; workers send results back to that address, so it must be reachable
    from them. The gRPC server TensorFlow starts here (like the workers')
    listens on every interface without authentication: use trusted networks.

    Call it again with the same cluster after a worker restarts: that
    re-registers this client on every worker (tensors that lived on the old
    workers are gone), and the next call works. How a lost worker fails a call,
    and the keepalive that bounds it: see this module's docstring.

    Args:
      cluster: the worker servers; anything `cluster_spec` accepts (a
        ClusterSpec, ``{"worker": ["host1:2222", "host2:2222"]}``, a JSON string,
        ``"host1:2222,host2:2222"``), or None to read ``TF_CONFIG`` (its
        ``cluster``; this process is the client, so its ``task`` is ignored).
      timeout: seconds to wait for each worker to answer the probe.

    Returns:
      The canonical names of the remote devices, such as
      ``/job:worker/replica:0/task:1/device:CPU:0``, in cluster order.

    Raises:
      ArgumentError: the cluster is malformed, or `timeout` is not a finite
        number of seconds > 0 (at most a day).
      ClusterError: a worker did not answer; the message names each such task,
        its address and why, and the command that starts it.
    """
    global _connection
    timeout = _check_timeout(timeout, "connect(timeout")
    jobs = cluster_jobs(cluster)
    with _connect_lock:
        local = _probe_or_raise(jobs, timeout)
        previous = _connection
        if previous is not None and previous.jobs == jobs:
            client = previous.client  # The same server def: TF keeps our server and port.
        else:
            client = _local_address(local)
        devices = _join(jobs, client)
        _connection = Connection(jobs, client)
        deadline = time.monotonic() + timeout
        per_task = _devices_per_task(jobs, devices)
        _check_links([names[0] for names in per_task.values()], jobs, client, deadline)
    for (job, task), names in per_task.items():
        _log.info(
            "Connected to /job:%s/task:%d at %s: %s",
            job,
            task,
            jobs[job][task],
            ", ".join(n.rsplit("/device:", 1)[-1] for n in names),
        )
    return [name for name in devices if _device_names.is_remote(name)]


_MAX_TIMEOUT = 86400.0  # A day; sockets and gRPC overflow on far larger ones (inf).


def _task_of(device: _device_names.DeviceSpecLike) -> tuple[str, int] | None:
    """``(job, task)`` of a remote device name (no task: task 0); None when local."""
    parsed = _device_names.parse_name(device)
    if parsed is None or _device_names.is_local_job(parsed.job):
        return None
    return parsed.job, parsed.task or 0


def _check_timeout(value: Any, call: str) -> float:
    """`value` as float seconds; ArgumentError naming `call` (``"f(name"``) and the fix."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < value <= _MAX_TIMEOUT  # False for nan too
    ):
        raise ArgumentError(
            f"{call}={value!r}): seconds to wait for each worker, a finite number > 0 and at "
            f"most {_MAX_TIMEOUT:g} (a day), e.g. 10"
        )
    return float(value)


def _probe_or_raise(jobs: Jobs, timeout: float) -> str | None:
    """Probes every task; this process's address towards them, or ClusterError naming each
    task that did not answer and the command that (re)starts it."""
    probes = _probe_all(jobs, timeout)
    failed = [(key, problem) for key, (problem, _) in probes.items() if problem]
    if failed:
        lines = [
            f"  /job:{job}/task:{task} at {jobs[job][task]}: {problem}; (re)start it with: "
            f"{_worker_command(jobs, job, task)}"
            for (job, task), problem in failed
        ]
        raise ClusterError(
            f"connect: {len(failed)} of {len(probes)} worker(s) did not answer within "
            f"{timeout:g} s:\n" + "\n".join(lines)
        )
    return next(iter(probes.values()))[1]


def _join(jobs: Jobs, client: str) -> list[str]:
    """Makes TensorFlow's context a client of `jobs` at `client`; every device's name."""
    os.environ.setdefault(GRPC_OPTIONS_ENV, KEEPALIVE_OPTIONS)
    spec = tf.train.ClusterSpec({**jobs, _CLIENT_JOB: {0: client}})
    try:
        with _without_session_config_log():
            tf.config.experimental_connect_to_cluster(spec, job_name=_CLIENT_JOB, task_index=0)
        # Connecting is lazy; listing the devices makes TF reach every worker now.
        return [d.name for d in tf.config.list_logical_devices()]
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        raise join_failed(error, cluster=cluster_flag(jobs), client=client) from None


def _devices_per_task(jobs: Jobs, devices: list[str]) -> dict[tuple[str, int], list[str]]:
    """The remote devices of each task, in cluster order; ClusterError for a task with none."""
    per_task: dict[tuple[str, int], list[str]] = {}
    for job, tasks in jobs.items():
        for task, address in tasks.items():
            names = [n for n in devices if _task_of(n) == (job, task)]
            if not names:
                raise ClusterError(
                    f"connect: /job:{job}/task:{task} at {address} answered but reported no devices"
                )
            per_task[(job, task)] = names
    return per_task


def _check_links(devices: list[str], jobs: Jobs, client: str, deadline: float) -> None:
    """Sends a value over every link (client <-> task, task <-> task) and back.

    After a worker restarts, the channels to it (ours, and the other workers')
    can still be backing off from the failures for up to a second, so the
    first call would fail with UnavailableError; retrying here until `deadline`
    absorbs that. It also proves what multi-host use needs: every worker
    reaches every other worker and this client's address.
    """
    here = "/job:localhost/replica:0/task:0/device:CPU:0"

    @tf.function(autograph=False)
    def mesh(x: tf.Tensor) -> tf.Tensor:
        values = []
        for device in devices:
            with tf.device(device):
                values.append(x + 1.0)  # client -> task
        sums = []
        for device in devices:
            with tf.device(device):
                sums.append(tf.add_n(values))  # every task -> this task
        with tf.device(here):
            return tf.stack(sums)  # every task -> client

    while True:
        try:
            if mesh(tf.constant(1.0)).numpy().tolist() == [2.0 * len(devices)] * len(devices):
                return
        except tf.errors.OpError as error:
            if isinstance(error, tf.errors.UnavailableError) and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            raise links_failed(error, cluster=cluster_flag(jobs), client=client) from None


# ------------------------------------------------------------ remote errors


def host_of(device: _device_names.DeviceSpecLike) -> str | None:
    """The ``host:port`` of the worker server a device lives on; None when local.

    Also None for a remote name outside the connected cluster (or before
    `connect`).

    >>> tfshard.cluster.host_of("/device:CPU:0") is None
    True
    """
    connection = _connection
    return None if connection is None else connection.host_of(device)


def explain_remote_error(error: BaseException, probe_timeout: float = 2.0) -> str | None:
    """What a failed call's TensorFlow error means for the cluster, and what to do.

    A worker that died or stopped answering fails the call with a TensorFlow
    error (usually `tf.errors.UnavailableError`) whose message is gRPC detail.
    This names the worker(s) down, and the way back: restart the worker, then
    ``tfshard.connect(...)`` again with the same cluster. Tasks not found down
    before are checked again now (each probe bounded by `probe_timeout`; a
    refused connection counts at once); a task found down stays down until
    `connect`, and tfshard fails a call on it before it runs.

    Args:
      error: the exception a call raised.
      probe_timeout: seconds to wait for each worker's answer.

    Returns:
      One paragraph for the user, or None when `error` is not about the cluster
      (no cluster is connected, or it is not a TensorFlow error that mentions
      a worker or the network).

    Raises:
      ArgumentError: `probe_timeout` is not a finite number of seconds > 0.
    """
    probe_timeout = _check_timeout(probe_timeout, "explain_remote_error(probe_timeout")
    connection = _connection
    return None if connection is None else connection.explain(error, probe_timeout)


_RECONNECT = "tfshard.connect(...) again with the same cluster"


def connection() -> Connection | None:
    """The cluster `connect` connected this process to, and its tasks found down; None before.

    >>> tfshard.cluster.connection() is None  # before connect
    True
    """
    return _connection


def any_down() -> bool:
    """Whether a task of the connected cluster was found down; a lookup (shared internal)."""
    connection = _connection
    return connection is not None and connection.any_down()


def down_task(device: _device_names.DeviceSpecLike) -> tuple[str, int] | None:
    """``(job, task)`` of `device` when that task was found down; None when not, or local."""
    connection = _connection
    return None if connection is None else connection.down_task(device)


def down_hint() -> str | None:
    """The way back from every task found down, without probing; None when none was."""
    connection = _connection
    return None if connection is None else connection.down_hint()


def all_answer(probe_timeout: float = 2.0) -> bool:
    """Whether every task of the connected cluster answers (True without a cluster).

    Probes the tasks not found down yet and records those down.
    """
    connection = _connection
    return connection is None or connection.all_answer(probe_timeout)


# ------------------------------------------------------------------ servers


def start_server(cluster: Any = None, job: str | None = None, task: int | None = None) -> Any:
    """Starts the TensorFlow server of one task of a cluster.

    ``python -m tfshard.worker`` runs this and then serves until stopped.

    Args:
      cluster: anything `cluster_spec` accepts; None reads ``TF_CONFIG``.
      job: this task's job; None takes ``TF_CONFIG``'s task type, else
        ``"worker"``.
      task: this task's index; None takes ``TF_CONFIG``'s task index.

    Sets ``TF_GRPC_DEFAULT_OPTIONS`` to tfshard's gRPC keepalive when it is
    not set (see `connect`).

    Returns:
      The running `tf.distribute.Server`.

    Raises:
      ArgumentError: the cluster is malformed, the job is not a str or the task
        not an int (a NumPy integer is one), the job or task is not in the
        cluster, or the task's port is in use. The messages name the fix as this
        function's arguments (``task=N``); `as_flags` says them as
        ``python -m tfshard.worker``'s flags.
    """
    if job is not None and not isinstance(job, str):
        raise ArgumentError(
            f"job={job!r} is of type {type(job).__name__}; pass the job's name, a str such as "
            "'worker'"
        )
    if task is not None:
        if isinstance(task, bool) or not isinstance(task, numbers.Integral):
            raise ArgumentError(
                f"task={task!r} is of type {type(task).__name__}; pass this task's index in "
                "its job, an int"
            )
        task = int(task)
    config_task: dict[str, Any] = {}
    if os.environ.get(TF_CONFIG_ENV, "").strip():
        _, config_task = _read_tf_config()
    jobs = cluster_jobs(cluster)
    job = job or config_task.get("type") or "worker"
    if task is None:
        task = config_task.get("index")
    if job not in jobs:
        raise ArgumentError(
            f"job {job!r} is not in the cluster (its jobs: {', '.join(jobs)}); pass job=NAME "
            "with one of them"
        )
    if task is None:
        raise ArgumentError(
            f"which task of job {job!r} is this? pass task=N (N in {sorted(jobs[job])}), "
            "or set TF_CONFIG's task index"
        )
    if task not in jobs[job]:
        described = ", ".join(f"{i}: {a}" for i, a in jobs[job].items())
        raise ArgumentError(
            f"task={task}: job {job!r} has tasks {sorted(jobs[job])} ({described}); "
            "pass one of them"
        )
    address = jobs[job][task]
    _check_port_free(address)
    # Keepalive on this server's own channels too (to the other workers and to
    # the client), so that a peer that stops answering fails the call; see
    # KEEPALIVE_OPTIONS. Read when the first channel is made.
    os.environ.setdefault(GRPC_OPTIONS_ENV, KEEPALIVE_OPTIONS)
    return tf.distribute.Server(
        tf.train.ClusterSpec(jobs), job_name=job, task_index=task, protocol="grpc", start=True
    )


def as_flags(message: str) -> str:
    """A `start_server` message as ``python -m tfshard.worker`` says it.

    The arguments it names (``cluster=``, ``job=``, ``task=``) become the
    command's flags (``--cluster=``, ``--job=``, ``--task=``).

    >>> as_flags("which task of job 'worker' is this? pass task=N (N in [0, 1])")
    "which task of job 'worker' is this? pass --task=N (N in [0, 1])"
    """
    return _ARGUMENT.sub(r"--\1=", message)


# An argument of start_server named in a message: not a flag already, nor part of a word.
_ARGUMENT = re.compile(r"(?<![\w-])(cluster|job|task)=")


def _check_port_free(address: str) -> None:
    """Fails fast, naming the port, where TF would only say "Could not start"."""
    _, port = _split_address(address, "this task")
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ArgumentError(
                    f"port {port} of this task's address {address!r} is already in use (another "
                    "worker, or an earlier one still running?); stop that process or give this "
                    "task another port in --cluster"
                ) from None
            if error.errno != errno.EAFNOSUPPORT:
                raise
