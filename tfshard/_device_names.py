"""Device spellings read as `tf.DeviceSpec` names: pure parsing, nothing started.

What a user types (``"cuda1"``, ``"GPU:1"``, ``"/device:GPU:1"``,
``"worker1:GPU:0"``, ``"/job:worker/task:1/device:CPU:0"``) becomes a
`tf.DeviceSpec` here, and `DeviceKey` says when two names are one device. Nothing
here starts TensorFlow's runtime or checks that a device exists: that is
`tfshard.pinning`'s job, which resolves these specs against the devices
TensorFlow lists, and makes `is_remote` public.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import tensorflow as tf

__all__ = ("is_remote",)

DeviceSpecLike = int | str | tf.config.LogicalDevice | tf.DeviceSpec

# TensorFlow names this process's own job "localhost" (its devices'
# "/job:localhost/replica:0/task:0/device:CPU:0", and a client's job in a cluster).
_LOCAL_JOB = "localhost"

# Spellings people type for a local device: "gpu", "GPU:1", "/gpu:1",
# "/device:GPU:1", "device:gpu:1", "cuda", "cuda1", "cpu:0".
_LOCAL_RE = re.compile(r"^/?(?:device:)?(?P<type>[A-Za-z_]+)(?::(?P<index>\d+))?$")
_CUDA_RE = re.compile(r"^cuda(?P<index>\d*)$", re.IGNORECASE)
# The short spelling of a remote device: "worker1:GPU:0" is task 1 of job
# "worker", device GPU:0 ("worker1:cpu" is its CPU:0).
_SHORT_REMOTE_RE = re.compile(
    r"^(?P<job>[A-Za-z][A-Za-z0-9_]*?)(?P<task>\d+):(?P<type>[A-Za-z_]+)(?::(?P<index>\d+))?$"
)


@dataclasses.dataclass(frozen=True)
class DeviceKey:
    """What identifies a device, so that equal keys name one device: job None is
    this process, and a missing replica or task is 0, as TensorFlow reads it."""

    job: str | None
    replica: int
    task: int
    device_type: str
    index: int

    @classmethod
    def of(cls, spec: tf.DeviceSpec) -> DeviceKey:
        job = None if is_local_job(spec.job) else spec.job
        replica, task = (spec.replica or 0, spec.task or 0) if job is not None else (0, 0)
        return cls(job, replica, task, spec.device_type.upper(), spec.device_index)


def is_local_job(job: str | None) -> bool:
    """Whether a DeviceSpec's job is this process: no job, or TensorFlow's ``"localhost"``
    (the one place that says which job names are local).

    >>> is_local_job(None), is_local_job("localhost"), is_local_job("worker")
    (True, True, False)
    """
    return job is None or job == _LOCAL_JOB


def parse_spec(text: str) -> tf.DeviceSpec | None:
    """The DeviceSpec for a device spelling, or None when it is not one. Pure name
    parsing: it does not start TensorFlow or check that the device exists."""
    cuda = _CUDA_RE.match(text)
    if cuda:
        return tf.DeviceSpec(device_type="GPU", device_index=int(cuda["index"] or 0))
    local = _LOCAL_RE.match(text)
    if local:
        index = int(local["index"]) if local["index"] is not None else 0
        return tf.DeviceSpec(device_type=local["type"].upper(), device_index=index)
    short = _SHORT_REMOTE_RE.match(text)
    if short:
        index = int(short["index"] or 0)
        return tf.DeviceSpec(short["job"], 0, int(short["task"]), short["type"].upper(), index)
    if text.startswith("/job:") or text.startswith("/replica:") or "/device:" in text:
        try:
            spec = tf.DeviceSpec.from_string(text)
        except ValueError:
            return None
        if spec.device_type is None:
            return None
        if spec.device_index is None:
            spec = spec.replace(device_index=0)
        return spec.replace(device_type=spec.device_type.upper())
    return None


def parse_name(device: Any) -> tf.DeviceSpec | None:
    """`parse_spec` of a name, a LogicalDevice or a DeviceSpec; None for anything else."""
    if isinstance(device, tf.config.LogicalDevice):
        return parse_spec(device.name)
    if isinstance(device, tf.DeviceSpec):
        return parse_spec(device.to_string())
    if isinstance(device, str):
        return parse_spec(device.strip())
    return None


def same_device(have: str, want: str) -> bool:
    """Whether two device names name one device ("" names none: a graph tensor unplaced)."""
    if not have:  # A tensor in a graph, before placement.
        return False
    try:
        have_key = DeviceKey.of(tf.DeviceSpec.from_string(have))
        return have_key == DeviceKey.of(tf.DeviceSpec.from_string(want))
    except ValueError:
        return False


def is_remote(device: DeviceSpecLike) -> bool:
    """True when a device lives on another TensorFlow server (so data crosses the network).

    Pure name inspection: it does not start TensorFlow or resolve the device.

    >>> tfshard.pinning.is_remote("/job:worker/replica:0/task:1/device:CPU:0")
    True
    >>> tfshard.pinning.is_remote("worker1:GPU:0"), tfshard.pinning.is_remote("/device:CPU:1")
    (True, False)
    """
    parsed = parse_name(device)
    return parsed is not None and not is_local_job(parsed.job)
