r"""Embed N samples with a small MLP on other machines' devices, over a TensorFlow cluster.

The same `tfshard.parallelize` as on one machine: after `tfshard.connect`, the
workers' devices are names like ``/job:worker/replica:0/task:1/device:CPU:0``
(or ``worker1:CPU:0``) and shards are placed on them like on local devices.
The script prints the plan, which shards cross the network, and checks the
result against the same function on this machine's CPU alone.

    # One worker per machine, each given the whole cluster and its own task:
    host1$ python -m tfshard.worker --cluster=host1:2222,host2:2222 --task=0
    host2$ python -m tfshard.worker --cluster=host1:2222,host2:2222 --task=1
    # The client:
    python examples/cluster_map.py --cluster=host1:2222,host2:2222
    # A demo on this machine: two workers on 127.0.0.1, stopped at exit.
    python examples/cluster_map.py --start_local_workers=2

It connects this process to a cluster, so it runs as a script (a smoke test
runs it as a subprocess), not imported next to other examples.

Copy it with ``_common.py`` and ``_mlp.py`` (in examples/), which it imports.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import _common
import _mlp
import numpy as np
from _common import tf
from absl import app, flags

import tfshard
from tfshard.errors import ClusterError

FEATURES, HIDDEN, DIM = 64, 256, 32
WORKER_START_SECONDS = 120  # importing TF on a busy machine is slow

_CLUSTER = flags.DEFINE_string(
    "cluster",
    None,
    "The worker servers: a comma list host:port,host:port (job 'worker'), or JSON such as "
    '\'{"worker": ["host1:2222", "host2:2222"]}\'. Default: TF_CONFIG\'s cluster.',
)
_START_LOCAL_WORKERS = flags.DEFINE_integer(
    "start_local_workers",
    0,
    "Start this many workers on 127.0.0.1 (python -m tfshard.worker) for a demo, and stop "
    "them at exit; instead of --cluster.",
    lower_bound=0,
)
_DEVICES = _common.define_devices_flag(
    "Comma-separated devices: 'worker0:CPU:0,worker1:GPU:0', full names, or local ones "
    "('cpu:0') to mix in. Default: each worker's GPUs, else its CPU."
)
_NUM_SAMPLES = flags.DEFINE_integer(
    "num_samples", 4096, "How many samples to embed.", lower_bound=0
)
flags.register_multi_flags_validator(
    ["cluster", "start_local_workers"],
    lambda values: not (values["cluster"] and values["start_local_workers"]),
    "give --cluster (workers already running) or --start_local_workers=N, not both",
)


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports: all held open while choosing, as the OS hands a
    port just closed out again."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def local_workers(count: int) -> Iterator[str]:
    """Runs `count` workers on 127.0.0.1 (free ports) while the block runs.

    Yields:
      The cluster, as ``--cluster`` takes it ("127.0.0.1:p0,127.0.0.1:p1").
    """
    addresses = ",".join(f"127.0.0.1:{port}" for port in _free_ports(count))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    children = []
    try:
        for task in range(count):
            command = [sys.executable, "-m", "tfshard.worker", f"--cluster={addresses}"]
            children.append(
                subprocess.Popen(
                    [*command, f"--task={task}"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env=env,
                )
            )
        deadline = time.monotonic() + WORKER_START_SECONDS
        for task, child in enumerate(children):
            print(_wait_ready(child, task, deadline))
        yield addresses
    finally:
        for child in children:
            child.kill()
            child.wait()
            child.stdout.close()


def _wait_ready(child: subprocess.Popen, task: int, deadline: float) -> str:
    """The worker's ready line, or ClusterError when it exits or `deadline` passes."""
    from tfshard import worker  # imports TensorFlow: not before flags are parsed

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterError(
                f"local worker {task} did not start within {WORKER_START_SECONDS} s"
            )
        readable, _, _ = select.select([child.stdout], [], [], left)
        if not readable:
            continue
        line = child.stdout.readline()  # The worker prints whole, flushed lines.
        if not line:
            raise ClusterError(
                f"local worker {task} exited with {child.wait()} before serving; run "
                "python -m tfshard.worker by hand to see why"
            )
        if line.startswith(worker.READY):
            return line.strip()


def default_devices(remote: Sequence[str]) -> list[str]:
    """Each worker task's GPUs, or its first CPU when it has none."""
    by_task: dict[tuple[str, int], list[str]] = {}
    for name in remote:
        spec = tf.DeviceSpec.from_string(name)
        by_task.setdefault((spec.job, spec.task), []).append(name)
    chosen = []
    for names in by_task.values():
        gpus = [n for n in names if "/device:GPU:" in n]
        chosen.extend(gpus or [n for n in names if "/device:CPU:" in n][:1])
    return chosen


def make_params(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of the embedding MLP, ``FEATURES -> HIDDEN -> DIM``."""
    return _mlp.make_params(FEATURES, HIDDEN, DIM, seed)


def build(devices: Sequence[str], output_device: str = "cpu:0") -> tfshard.ShardedFunction:
    """`embed` on `devices`, results gathered on this machine (`output_device`)."""
    return tfshard.parallelize(
        _mlp.embed, devices=devices, broadcast=("params",), output_device=output_device
    )


def network_note(f: tfshard.ShardedFunction) -> str:
    """Which shards run on other machines, and what crosses the network per call."""
    from tfshard import cluster, pinning  # import TensorFlow: not before flags are parsed

    lines = []
    for k, device in enumerate(f.devices):
        if pinning.is_remote(device):
            lines.append(f"  shard {k} runs on {cluster.host_of(device) or 'a remote server'}")
    if not lines:
        return "no shard crosses the network"
    return "\n".join(
        [
            f"{len(lines)} of {len(f.devices)} shards cross the network; each call sends each "
            "of them its rows and the broadcast weights, and its results come back to "
            f"{f.output_device}:",
            *lines,
        ]
    )


class Result(NamedTuple):
    outputs: np.ndarray  # [N, DIM]
    seconds: float  # one call on the cluster, after a warm-up call
    max_abs_diff: float  # against this machine's CPU alone


def run(f: tfshard.ShardedFunction, x: np.ndarray, params: dict[str, np.ndarray]) -> Result:
    """Embeds `x` with `f` and with the same function on the local CPU alone."""
    f(x, params)  # warm-up: traces the graph and registers it on the workers
    start = time.perf_counter()
    outputs = f(x, params).numpy()
    seconds = time.perf_counter() - start
    reference = build(["cpu:0"])(x, params).numpy()
    diff = float(np.max(np.abs(outputs - reference), initial=0.0))
    return Result(outputs, seconds, diff)


def main(argv: list[str]) -> None:
    del argv
    with _common.exit_on_error(), contextlib.ExitStack() as stack:
        addresses = _CLUSTER.value
        if not (addresses or _START_LOCAL_WORKERS.value or os.environ.get("TF_CONFIG", "").strip()):
            raise tfshard.ArgumentError(
                "no cluster given and TF_CONFIG is not set: pass --cluster=host1:2222,host2:2222 "
                "(workers started with python -m tfshard.worker), --start_local_workers=2 for a "
                "demo on this machine, or set TF_CONFIG"
            )
        if _START_LOCAL_WORKERS.value:
            print(f"starting {_START_LOCAL_WORKERS.value} local worker(s) on 127.0.0.1")
            addresses = stack.enter_context(local_workers(_START_LOCAL_WORKERS.value))
        remote = tfshard.connect(addresses)
        print(f"connected: {', '.join(remote)}")
        devices = [tfshard.resolve_device(d) for d in _DEVICES.value or default_devices(remote)]
        f = build(devices)
        params = make_params()
        x = np.random.default_rng(1).standard_normal((_NUM_SAMPLES.value, FEATURES), np.float32)
        print(f"embedding {len(x)} samples with an MLP {FEATURES} -> {HIDDEN} -> {DIM}")
        print(f.explain(x, params))
        print(network_note(f))
        result = run(f, x, params)
        rate = len(x) / result.seconds if result.seconds > 0 else float("inf")
        print(f"{len(x)} samples in {result.seconds * 1e3:.1f} ms ({rate:,.0f} samples/s)")
        print(f"max |difference| from one local CPU: {result.max_abs_diff:.2e}")
        if not result.max_abs_diff < 1e-5:
            sys.exit("error: the cluster's result differs from the local one")
        print("OK: same embeddings, in the same order, as on one local device")


if __name__ == "__main__":
    app.run(main)
