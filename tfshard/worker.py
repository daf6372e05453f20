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
"""

from __future__ import annotations

import sys
import time

from absl import app, flags, logging

from tfshard import cluster
from tfshard.errors import TfshardError

__all__ = ("READY", "main")

# Printed (and flushed) once the server listens; scripts and tests wait for it.
READY = "tfshard.worker: serving"


def _define_flags() -> tuple[flags.FlagHolder, flags.FlagHolder, flags.FlagHolder]:
    """The script's flags, defined only when it runs as a script.

    Defining them at import would put --cluster, --job and --task into the flags
    of every program that imports tfshard.worker (pytest imports it for its
    doctests), where an example's own --cluster would then clash.
    """
    cluster_flag = flags.DEFINE_string(
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
    return cluster_flag, job, task


def main(argv: list[str]) -> None:
    del argv
    try:
        server = cluster.start_server(_CLUSTER.value, _JOB.value, _TASK.value)
    except TfshardError as error:
        sys.exit(f"tfshard.worker: error: {error}")
    jobs = cluster.cluster_jobs(_CLUSTER.value)
    job, task = server.server_def.job_name, server.server_def.task_index
    address = jobs[job][task]
    logging.info(
        "tfshard worker: job %s task %d serving at %s (%s)", job, task, address, server.target
    )
    print(
        f"{READY} /job:{job}/replica:0/task:{task} at {address}; connect with "
        f"tfshard.connect({cluster.cluster_flag(jobs)!r})",
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
