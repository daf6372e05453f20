r"""Starts one TensorFlow worker server, for `tfshard.connect` to use.

Run one per machine (or one per task), each with the whole cluster and its own
task index, then connect from the client::

    host1$ python -m tfshard.worker --cluster=host1:2222,host2:2222 --task=0
    host2$ python -m tfshard.worker --cluster=host1:2222,host2:2222 --task=1
    client>>> tfshard.connect("host1:2222,host2:2222")

``--cluster`` takes what `tfshard.cluster.cluster_spec` takes: a comma list of
``host:port`` (job ``worker``) or JSON such as ``'{"worker": [...], "ps":
[...]}'``; without it, and without ``--task``, both come from ``TF_CONFIG``.
The server (a `tf.distribute.Server`, started by `tfshard.cluster.start_server`)
listens on its port on every interface, without authentication: run it on a
trusted network only. It serves until the process is stopped (Ctrl-C or SIGTERM).

A bad cluster, job or task, or a port in use, ends it with status 1 and one line
``tfshard.worker: error: ...`` naming the fix; once the server listens it prints
`READY` (scripts wait for that line); Ctrl-C ends it with status 0.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging

from tfshard import cluster
from tfshard.errors import TfshardError

__all__ = ("READY", "main", "serve")

# Printed (and flushed) once the server listens; scripts and tests wait for it.
READY = "tfshard.worker: serving"
_WAKE_S = 0.5  # The longest a served worker takes to see Ctrl-C (see `serve`).


def _define_flags() -> None:
    """The script's flags; defined only when run as a script, so an importer's flags don't clash."""
    flags.DEFINE_string(
        "cluster",
        None,
        "The cluster: a comma list of host:port (job 'worker', task i is entry i), or JSON "
        'such as \'{"worker": ["host1:2222", "host2:2222"]}\'. Default: TF_CONFIG\'s cluster.',
    )
    flags.DEFINE_string(
        "job", None, "This server's job name. Default: TF_CONFIG's task type, else 'worker'."
    )
    flags.DEFINE_integer(
        "task", None, "This server's task index in its job. Default: TF_CONFIG's.", lower_bound=0
    )


def main(argv: list[str]) -> None:
    """The entry point of ``python -m tfshard.worker``, after absl parsed the flags.

    Reads ``--cluster``, ``--job`` and ``--task`` from absl's flags, as an absl
    program does, and `serve`s; a `TfshardError` ends the process with status 1
    and its message, without a traceback. Without ``--cluster`` or ``TF_CONFIG``
    it ends so at once, with the fix said as flags.
    """
    del argv
    values = flags.FLAGS
    if values.cluster is None and not os.environ.get(cluster.TF_CONFIG_ENV, "").strip():
        sys.exit(
            f"tfshard.worker: error: no cluster given and {cluster.TF_CONFIG_ENV} is not set: "
            "pass the whole cluster and this server's place in it, e.g. "
            "--cluster=host1:2222,host2:2222 --task=0 (task i is entry i), or set "
            f'{cluster.TF_CONFIG_ENV} to \'{{"cluster": {{"worker": ["host1:2222", '
            '"host2:2222"]}, "task": {"type": "worker", "index": 0}}\''
        )
    try:
        serve(values.cluster, values.job, values.task)
    except TfshardError as error:
        sys.exit(f"tfshard.worker: error: {cluster.as_flags(str(error))}")


def serve(cluster_spec: str | None = None, job: str | None = None, task: int | None = None) -> None:
    """Starts one task's server, prints `READY` and serves until Ctrl-C.

    Args:
      cluster_spec: anything `tfshard.cluster.cluster_spec` accepts; None reads
        ``TF_CONFIG``.
      job: this task's job, as `tfshard.cluster.start_server` takes it.
      task: this task's index, as `tfshard.cluster.start_server` takes it.

    Raises:
      ArgumentError: as `tfshard.cluster.start_server` raises, before anything
        listens.
    """
    server = cluster.start_server(cluster_spec, job, task)
    jobs = cluster.cluster_jobs(cluster_spec)
    job, task = server.server_def.job_name, server.server_def.task_index
    address = jobs[job][task]
    logging.info(
        "tfshard worker: job %s task %d serving at %s (%s)", job, task, address, server.target
    )
    # Not server.join(), nor one long sleep: Python runs signal handlers in the
    # main thread between bytecodes, and the kernel may hand Ctrl-C's SIGINT to
    # any of TensorFlow's threads, which leaves a blocked main thread asleep.
    # Waking every _WAKE_S bounds how long Ctrl-C takes. SIGTERM keeps its
    # default action and ends the process at once (a TF server has no stop).
    # The ready line is inside the try: a Ctrl-C sent the moment it is read can
    # land while print is still flushing it.
    try:
        print(
            f"{READY} /job:{job}/replica:0/task:{task} at {address}; connect with "
            f"tfshard.connect({cluster.cluster_flag(jobs)!r})",
            flush=True,
        )
        while True:
            time.sleep(_WAKE_S)
    except KeyboardInterrupt:
        logging.info("tfshard worker: job %s task %d stopped", job, task)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
