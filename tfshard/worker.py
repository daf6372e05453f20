r"""Starts one TensorFlow worker server, for `tfshard.connect` to use.

Run one per machine (or one per task), each with the whole cluster and its own
task index, then connect from the client::

    host1$ python -m tfshard.worker --cluster=host1:2222,host2:2222 --task=0
    host2$ python -m tfshard.worker --cluster=host1:2222,host2:2222 --task=1
    client>>> tfshard.connect("host1:2222,host2:2222")

``--cluster`` takes what `tfshard.pinning.cluster_spec` takes: a comma list of
``host:port`` (job ``worker``) or JSON such as ``'{"worker": [...], "ps":
[...]}'``; without it, and without ``--task``, both come from ``TF_CONFIG``.
The server (a `tf.distribute.Server`) listens on its port on every interface,
without authentication: run it on a trusted network only. It serves until the
process is stopped (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import time
from typing import Any

import tensorflow as tf
from absl import app, flags, logging

from tfshard import pinning
from tfshard.errors import ArgumentError, TfshardError

__all__ = ("start_server",)

# Printed (and flushed) once the server listens; scripts and tests wait for it.
READY = "tfshard.worker: serving"


def _check_port_free(address: str) -> None:
    """Fails fast, naming the port, where TF would only say "Could not start"."""
    _, port = pinning._split_address(address, "this task")
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


def start_server(cluster: Any = None, job: str | None = None, task: int | None = None) -> Any:
    """Starts the TensorFlow server of one task of a cluster.

    Args:
      cluster: anything `tfshard.pinning.cluster_spec` accepts; None reads
        ``TF_CONFIG``.
      job: this task's job; None takes ``TF_CONFIG``'s task type, else
        ``"worker"``.
      task: this task's index; None takes ``TF_CONFIG``'s task index.

    Sets ``TF_GRPC_DEFAULT_OPTIONS`` to tfshard's gRPC keepalive when it is
    not set (see `tfshard.pinning.connect`).

    Returns:
      The running `tf.distribute.Server`.

    Raises:
      ArgumentError: the cluster is malformed, the job or task is not in it, or
        the task's port is in use.
    """
    config_task: dict[str, Any] = {}
    if os.environ.get(pinning.TF_CONFIG_ENV, "").strip():
        _, config_task = pinning._read_tf_config()
    jobs = pinning._cluster_jobs(cluster)
    job = job or config_task.get("type") or "worker"
    if task is None:
        task = config_task.get("index")
    if job not in jobs:
        raise ArgumentError(
            f"job {job!r} is not in the cluster (its jobs: {', '.join(jobs)}); pass --job"
        )
    if task is None:
        raise ArgumentError(
            f"which task of job {job!r} is this? pass --task=N (N in {sorted(jobs[job])}), "
            "or set TF_CONFIG's task index"
        )
    if task not in jobs[job]:
        raise ArgumentError(
            f"--task={task}: job {job!r} has tasks {sorted(jobs[job])} "
            f"({_describe_job(jobs[job])}); pass one of them"
        )
    address = jobs[job][task]
    _check_port_free(address)
    # Keepalive on this server's own channels too (to the other workers and to
    # the client), so that a peer that stops answering fails the call; see
    # pinning.KEEPALIVE_OPTIONS. Read when the first channel is made.
    os.environ.setdefault(pinning.GRPC_OPTIONS_ENV, pinning.KEEPALIVE_OPTIONS)
    server = tf.distribute.Server(
        tf.train.ClusterSpec(jobs), job_name=job, task_index=task, protocol="grpc", start=True
    )
    return server


def _describe_job(tasks: dict[int, str]) -> str:
    return ", ".join(f"{i}: {a}" for i, a in tasks.items())


def _define_flags() -> tuple[flags.FlagHolder, flags.FlagHolder, flags.FlagHolder]:
    """The script's flags, defined only when it runs as a script.

    Defining them at import would put --cluster, --job and --task into the flags
    of every program that imports tfshard.worker (pytest imports it for its
    doctests), where an example's own --cluster would then clash.
    """
    cluster = flags.DEFINE_string(
        "cluster",
        None,
        "The cluster: a comma list of host:port (job 'worker', task i is entry i), or JSON "
        'such as \'{"worker": ["host1:2222", "host2:2222"]}\'. Default: TF_CONFIG\'s cluster.',
    )
    job = flags.DEFINE_string(
        "job", None, "This server's job name. Default: TF_CONFIG's task type, else 'worker'."
    )
    task = flags.DEFINE_integer(
        "task", None, "This server's task index in its job. Default: TF_CONFIG's.", lower_bound=0
    )
    return cluster, job, task


def main(argv: list[str]) -> None:
    del argv
    try:
        server = start_server(_CLUSTER.value, _JOB.value, _TASK.value)
    except TfshardError as error:
        sys.exit(f"tfshard.worker: error: {error}")
    jobs = pinning._cluster_jobs(_CLUSTER.value)
    job, task = server.server_def.job_name, server.server_def.task_index
    address = jobs[job][task]
    logging.info(
        "tfshard worker: job %s task %d serving at %s (%s)", job, task, address, server.target
    )
    print(
        f"{READY} /job:{job}/replica:0/task:{task} at {address}; connect with "
        f"tfshard.connect({pinning._cluster_flag(jobs)!r})",
        flush=True,
    )
    # Not server.join(): Python runs signal handlers only between bytecodes, so
    # a main thread blocked in join() would never see Ctrl-C. SIGTERM keeps its
    # default action and ends the process at once (a TF server has no stop).
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        logging.info("tfshard worker: job %s task %d stopped", job, task)


if __name__ == "__main__":
    _CLUSTER, _JOB, _TASK = _define_flags()
    app.run(main)
