"""Where things run: device discovery, name resolution, context maps, transfers.

Every function here speaks TensorFlow's *logical* device names, the ones
`tf.config.list_logical_devices()` reports (``/device:GPU:1``, or
``/job:worker/replica:0/task:1/device:CPU:0`` for a remote device). Those are the
canonical names: `resolve_device` turns any accepted spelling into one of them,
and everything else in tfshard takes what `resolve_device` takes.

A *context map* names roles instead of cards, in the format Aesara/Theano users
know::

    dev0->GPU:0; dev1->GPU:1

Once a map is active (`use_contexts`, `set_contexts`, or the ``TFSHARD_CONTEXTS``
environment variable), ``resolve_device("dev1")`` is ``/device:GPU:1``, so code
can say ``parallelize(devices=["dev0", "dev1"])`` and be moved to other cards by
changing one string.

Device discovery (`list_devices`, `resolve_device`, ...) starts the TensorFlow
runtime, after which logical devices can no longer be configured: call
`virtual_devices` first. `num_gpus`, `try_gpu` and `try_all_gpus` only read the
configuration and do not start the runtime.

`connect` makes another machine's devices names like any other: it connects
this process to TensorFlow worker servers (``python -m tfshard.worker``) as a
client, after which ``"/job:worker/task:1/device:GPU:0"`` (or the short
``"worker1:GPU:0"``) resolves, and `parallelize` can place shards there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import tensorflow as tf

from tfshard.errors import (
    ArgumentError,
    ClusterError,
    ContextMapError,
    DeviceError,
    DeviceSetupError,
)

__all__ = (
    "ContextMap",
    "active_contexts",
    "cluster_spec",
    "connect",
    "cpu",
    "explain_remote_error",
    "gpu",
    "host_of",
    "is_remote",
    "list_devices",
    "num_gpus",
    "pin",
    "resolve_device",
    "set_contexts",
    "to_device",
    "try_all_gpus",
    "try_gpu",
    "use_contexts",
    "virtual_devices",
)

_log = logging.getLogger("tfshard")

DeviceSpecLike = int | str | tf.config.LogicalDevice | tf.DeviceSpec

CONTEXTS_ENV = "TFSHARD_CONTEXTS"

# Spellings people type for a local device: "gpu", "GPU:1", "/gpu:1",
# "/device:GPU:1", "device:gpu:1", "cuda", "cuda1", "cpu:0".
_LOCAL_RE = re.compile(
    r"^/?(?:device:)?(?P<type>[A-Za-z_]+)(?::(?P<index>\d+))?$",
)
_CUDA_RE = re.compile(r"^cuda(?P<index>\d*)$", re.IGNORECASE)
# The short spelling of a remote device: "worker1:GPU:0" is task 1 of job
# "worker", device GPU:0 ("worker1:cpu" is its CPU:0).
_SHORT_REMOTE_RE = re.compile(
    r"^(?P<job>[A-Za-z][A-Za-z0-9_]*?)(?P<task>\d+):(?P<type>[A-Za-z_]+)(?::(?P<index>\d+))?$"
)
_RESERVED_PREFIXES = ("cuda", "opencl", "gpu", "cpu")


def _local_count(device_type: str) -> int:
    """Number of logical devices of a type on this machine, without starting TF."""
    count = 0
    for physical in tf.config.get_visible_devices(device_type):
        configs = tf.config.get_logical_device_configuration(physical)
        count += len(configs) if configs else 1
    return count


def num_gpus() -> int:
    """The number of logical GPUs TensorFlow will give this process.

    Reads the configuration only, so it is safe to call before `virtual_devices`.

    Returns:
      How many ``/device:GPU:N`` devices exist (0 on a machine without GPUs).

    >>> tfshard.num_gpus() >= 0
    True
    """
    return _local_count("GPU")


def cpu() -> str:
    """The canonical name of the first CPU device.

    >>> tfshard.cpu()
    '/device:CPU:0'
    """
    return "/device:CPU:0"


def gpu(i: int = 0) -> str:
    """The canonical name of GPU ``i``.

    Args:
      i: the GPU's index, as TensorFlow numbers them (``CUDA_VISIBLE_DEVICES``
        order).

    Returns:
      ``"/device:GPU:i"``.

    Raises:
      DeviceError: there is no GPU ``i``; use `try_gpu` to fall back to the CPU.
    """
    _check_index(i, "i")
    count = num_gpus()
    if i >= count:
        raise DeviceError(
            f"gpu({i}): this process has {count} GPU(s) "
            f"({', '.join(_gpu_names(count)) or 'none'}); use tfshard.try_gpu({i}) "
            "to fall back to the CPU, or tfshard.virtual_devices(n, 'GPU', "
            "memory_limit_mb=...) to split one GPU into several"
        )
    return f"/device:GPU:{i}"


def try_gpu(i: int = 0) -> str:
    """GPU ``i`` if it exists, else the CPU.

    >>> tfshard.try_gpu(99)
    '/device:CPU:0'
    """
    _check_index(i, "i")
    return f"/device:GPU:{i}" if i < num_gpus() else cpu()


def try_all_gpus() -> list[str]:
    """Every GPU, or ``[cpu()]`` when there is none.

    >>> tfshard.try_all_gpus() == (tfshard.pinning._gpu_names(tfshard.num_gpus())
    ...                            or ['/device:CPU:0'])
    True
    """
    return _gpu_names(num_gpus()) or [cpu()]


def _gpu_names(count: int) -> list[str]:
    return [f"/device:GPU:{i}" for i in range(count)]


def _check_index(i: Any, name: str) -> None:
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise DeviceError(f"{name}={i!r}: a device index is an int >= 0")


def list_devices(device_type: str | None = None) -> list[str]:
    """Canonical names of the logical devices, local and (after connecting) remote.

    Starts the TensorFlow runtime.

    Args:
      device_type: ``"CPU"``, ``"GPU"``, ... (any case), or None for all.

    Returns:
      Names exactly as `tf.config.list_logical_devices` reports them.

    >>> tfshard.list_devices("cpu")[:2]
    ['/device:CPU:0', '/device:CPU:1']
    """
    kind = device_type.upper() if device_type else None
    return [d.name for d in tf.config.list_logical_devices(kind)]


# ---------------------------------------------------------------- resolution


@dataclasses.dataclass(frozen=True)
class _Key:
    """The parts of a device name that identify it; None is "local default"."""

    job: str | None
    replica: int | None
    task: int | None
    device_type: str
    index: int

    @classmethod
    def of(cls, spec: tf.DeviceSpec) -> _Key:
        job = spec.job if spec.job != "localhost" else None
        replica = spec.replica if job is not None else None
        task = spec.task if job is not None else None
        return cls(job, replica, task, spec.device_type.upper(), spec.device_index)

    def matches(self, other: _Key) -> bool:
        """True when `self` (what was asked for) names `other` (what exists)."""
        if (self.device_type, self.index, self.job) != (
            other.device_type,
            other.index,
            other.job,
        ):
            return False
        # A request without replica/task means replica 0 / task 0, as TF reads it.
        return (self.replica or 0) == (other.replica or 0) and (self.task or 0) == (other.task or 0)


def _parse_spec(text: str) -> tf.DeviceSpec | None:
    """The DeviceSpec for a device spelling, or None when it is not one."""
    cuda = _CUDA_RE.match(text)
    if cuda:
        return tf.DeviceSpec(device_type="GPU", device_index=int(cuda["index"] or 0))
    local = _LOCAL_RE.match(text)
    if local:
        index = int(local["index"]) if local["index"] is not None else 0
        return tf.DeviceSpec(device_type=local["type"].upper(), device_index=index)
    short = _SHORT_REMOTE_RE.match(text)
    if short:
        return tf.DeviceSpec(
            job=short["job"],
            replica=0,
            task=int(short["task"]),
            device_type=short["type"].upper(),
            device_index=int(short["index"] or 0),
        )
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


def resolve_device(spec: DeviceSpecLike) -> str:
    """Turns any accepted device spelling into its canonical name.

    Accepted: an int (GPU index); ``"gpu"``, ``"gpu:1"``, ``"GPU:1"``,
    ``"/gpu:1"``, ``"/device:GPU:1"``, ``"cuda"``, ``"cuda1"``; ``"cpu"``,
    ``"cpu:0"``; a full name such as ``"/job:worker/replica:0/task:1/device:CPU:0"``
    (replica and task default to 0) or its short form ``"worker1:CPU:0"`` (job
    ``worker``, task 1; remote devices exist after `connect`); a
    `tf.config.LogicalDevice` or `tf.DeviceSpec`; or a context name from the
    active context map. Case and surrounding whitespace do not matter in device
    types; job and context names are matched exactly.

    Args:
      spec: the device to look up.

    Returns:
      The device's name as `tf.config.list_logical_devices` reports it.

    Raises:
      DeviceError: the spelling is not a device name, or no such device exists;
        the message lists the devices that do exist.

    >>> tfshard.resolve_device("cpu:1")
    '/device:CPU:1'
    >>> with tfshard.use_contexts("dev0->cpu:2", log=False):
    ...     tfshard.resolve_device("dev0")
    '/device:CPU:2'
    """
    if isinstance(spec, bool):
        raise DeviceError(f"device {spec!r}: a bool is not a device")
    if isinstance(spec, int):
        _check_index(spec, "device")
        parsed = tf.DeviceSpec(device_type="GPU", device_index=spec)
    elif isinstance(spec, tf.config.LogicalDevice):
        parsed = _parse_spec(spec.name)
    elif isinstance(spec, tf.DeviceSpec):
        parsed = _parse_spec(spec.to_string())
    elif isinstance(spec, str):
        text = spec.strip()
        contexts = active_contexts()
        if contexts is not None and text in contexts:
            return contexts.resolve(text)
        if text.lower().startswith("opencl"):
            raise DeviceError(
                f"device {spec!r}: TensorFlow has no OpenCL devices; use one of {_existing()}"
            )
        if text.lower().startswith("/physical_device:"):
            raise DeviceError(
                f"device {spec!r} is a physical device; tfshard places work on "
                f"logical devices: use one of {_existing()}"
            )
        parsed = _parse_spec(text)
    else:
        raise DeviceError(
            f"device {spec!r} of type {type(spec).__name__}: pass an int (GPU index), "
            "a name such as 'GPU:1' or 'cpu', a tf.config.LogicalDevice, or a "
            "context name"
        )
    if parsed is None:
        names = active_contexts()
        known = f"; active context names: {sorted(names)}" if names else ""
        raise DeviceError(
            f"device {spec!r} is not a device name (examples: 'GPU:1', 'cuda1', "
            f"'cpu', '/job:worker/task:1/device:CPU:0', 'worker1:CPU:0'){known}"
        )
    wanted = _Key.of(parsed)
    devices = tf.config.list_logical_devices()
    for device in devices:
        if wanted.matches(_Key.of(tf.DeviceSpec.from_string(device.name))):
            return device.name
    hint = ""
    if wanted.device_type == "GPU":
        hint = "; tfshard.try_gpu()/try_all_gpus() fall back to the CPU when a GPU is missing"
    if wanted.job is not None:
        hint += f"; {_remote_hint(wanted.job, wanted.task or 0)}"
    else:
        hint += (
            "; tfshard.virtual_devices(n) before the first TF op splits the CPU (or a "
            "GPU) into n logical devices"
        )
    raise DeviceError(
        f"device {spec!r} ({parsed.to_string()}) does not exist; this process has "
        f"{_existing(devices)}{hint}"
    )


def _existing(devices: list[tf.config.LogicalDevice] | None = None) -> str:
    devices = tf.config.list_logical_devices() if devices is None else devices
    return ", ".join(d.name for d in devices) or "no devices"


def _describe(name: str) -> str:
    """A short human description of a canonical device, for logs."""
    spec = tf.DeviceSpec.from_string(name)
    if spec.job not in (None, "localhost"):
        return f"{spec.device_type} {spec.device_index} of {spec.job} task {spec.task}"
    physical = tf.config.get_visible_devices(spec.device_type)
    if len(physical) == 1 and spec.device_type != "GPU":
        total = _local_count(spec.device_type)
        if total > 1:
            return f"logical device {spec.device_index} of {total} on {physical[0].name}"
        return physical[0].name
    if spec.device_type == "GPU":
        for device in physical:
            # Only the unsplit case maps logical index to physical index 1:1.
            if device.name.endswith(f":{spec.device_index}") and _local_count("GPU") == len(
                physical
            ):
                details = tf.config.experimental.get_device_details(device)
                return details.get("device_name", device.name)
    return spec.device_type


# --------------------------------------------------------------- context maps


class ContextMap(Mapping[str, str]):
    """An immutable map from context names (roles) to device specs.

    Parse one from the Aesara-style string ``"dev0->GPU:0;dev1->GPU:1"`` with
    `ContextMap.parse`. Rules, each checked with the entry's position in the
    error: a name is non-empty, contains neither ``->`` nor ``;``, does not begin
    with ``cuda``, ``opencl``, ``gpu`` or ``cpu`` (those read as device names),
    and appears once; several names may map to one device (they will share it).
    Whitespace around names and devices, and a trailing ``;``, are ignored.

    Targets are device specs, resolved when the map is used, so a map can be
    parsed before TensorFlow starts.

    >>> m = tfshard.ContextMap.parse("dev0->GPU:0; dev1->GPU:1;")
    >>> dict(m)
    {'dev0': 'GPU:0', 'dev1': 'GPU:1'}
    """

    def __init__(self, mapping: Mapping[str, str] | None = None) -> None:
        self._map: dict[str, str] = {}
        for position, (name, device) in enumerate((mapping or {}).items()):
            _check_context_entry(name, device, f"entry {position} {name!r}->{device!r}")
            self._map[name] = device

    @classmethod
    def parse(cls, text: str) -> ContextMap:
        """Parses ``"name->device;name->device"``.

        Args:
          text: the map; an empty or blank string is an empty map.

        Returns:
          The map, in the order written.

        Raises:
          ContextMapError: an entry is malformed; the message names the entry
            and its position.
        """
        if not isinstance(text, str):
            raise ContextMapError(
                f"context map {text!r}: expected a string like 'dev0->GPU:0;dev1->GPU:1'"
            )
        entries = text.split(";")
        if entries and not entries[-1].strip():
            entries = entries[:-1]
        parsed: dict[str, str] = {}
        for position, entry in enumerate(entries):
            where = f"entry {position} {entry.strip()!r} of context map {text!r}"
            if "->" not in entry:
                raise ContextMapError(
                    f"{where}: expected 'name->device' (e.g. 'dev0->GPU:0'), "
                    "entries separated by ';'"
                )
            name, device = (part.strip() for part in entry.split("->", 1))
            if "->" in device:
                raise ContextMapError(f"{where}: more than one '->'; a name cannot contain '->'")
            _check_context_entry(name, device, where)
            if name in parsed:
                raise ContextMapError(
                    f"{where}: name {name!r} is already mapped to {parsed[name]!r}; "
                    "each context name may appear once"
                )
            parsed[name] = device
        return cls(parsed)

    def resolve(self, name: str) -> str:
        """The canonical device a context name maps to.

        Raises:
          DeviceError: the name is unknown, or its device does not exist.
        """
        if name not in self._map:
            raise DeviceError(
                f"context name {name!r} is not in the context map {self}; "
                f"known names: {sorted(self._map)}"
            )
        target = self._map[name]
        if target in self._map:  # A chain such as "a->b;b->GPU:0" is not a device.
            raise DeviceError(f"context {name!r} maps to another context name {target!r}")
        try:
            return resolve_device(target)
        except DeviceError as error:
            raise DeviceError(f"context {name!r} -> {target!r}: {error}") from None

    def log_mappings(self) -> None:
        """Logs ``Mapped name dev0 to device /device:GPU:0 (description)``."""
        targets: dict[str, list[str]] = {}
        for name in self._map:
            device = self.resolve(name)
            targets.setdefault(device, []).append(name)
            _log.info("Mapped name %s to device %s (%s)", name, device, _describe(device))
        for device, names in targets.items():
            if len(names) > 1:
                _log.info("Context names %s share device %s", ", ".join(names), device)

    def __getitem__(self, name: str) -> str:
        return self._map[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __str__(self) -> str:
        return ";".join(f"{name}->{device}" for name, device in self._map.items())

    def __repr__(self) -> str:
        return f"ContextMap.parse({str(self)!r})"


def _check_context_entry(name: str, device: str, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise ContextMapError(f"{where}: the context name is empty")
    if "->" in name or ";" in name:
        raise ContextMapError(f"{where}: a context name cannot contain '->' or ';'")
    lowered = name.lower()
    for prefix in _RESERVED_PREFIXES:
        if lowered.startswith(prefix):
            raise ContextMapError(
                f"{where}: context name {name!r} begins with {prefix!r}, which reads "
                "as a device name; choose another name (e.g. 'dev0')"
            )
    if not isinstance(device, str) or not device:
        raise ContextMapError(f"{where}: the device of {name!r} is empty")


_contexts_lock = threading.Lock()
_explicit: list[ContextMap | None] = []  # A stack; the top is the active map.
_env_cache: dict[str, ContextMap] = {}


def active_contexts() -> ContextMap | None:
    """The active context map: the innermost `use_contexts`/`set_contexts`,
    else ``TFSHARD_CONTEXTS``, else None.

    Raises:
      ContextMapError: ``TFSHARD_CONTEXTS`` is set but malformed.
    """
    with _contexts_lock:
        if _explicit:
            return _explicit[-1]
    text = os.environ.get(CONTEXTS_ENV)
    if not text or not text.strip():
        return None
    cached = _env_cache.get(text)
    if cached is None:
        try:
            cached = ContextMap.parse(text)
        except ContextMapError as error:
            raise ContextMapError(f"{CONTEXTS_ENV}: {error}") from None
        _env_cache.clear()
        _env_cache[text] = cached  # Before logging: logging resolves through here.
        try:
            cached.log_mappings()
        except DeviceError as error:
            # Raised only when that name is used, not on every unrelated lookup.
            _log.warning("%s: %s", CONTEXTS_ENV, error)
    return cached


def _coerce_map(contexts: ContextMap | str | Mapping[str, str] | None) -> ContextMap | None:
    if contexts is None or isinstance(contexts, ContextMap):
        return contexts
    if isinstance(contexts, str):
        return ContextMap.parse(contexts) if contexts.strip() else None
    if isinstance(contexts, Mapping):
        return ContextMap(contexts)
    raise ContextMapError(
        f"contexts={contexts!r}: pass a ContextMap, a string like "
        "'dev0->GPU:0;dev1->GPU:1', a dict, or None"
    )


def set_contexts(
    contexts: ContextMap | str | Mapping[str, str] | None, *, log: bool = True
) -> ContextMap | None:
    """Makes a context map active for the whole process (None clears it).

    This is how a ``--contexts`` flag is applied: ``set_contexts(FLAGS.contexts)``.
    It replaces every map set before, including those of enclosing `use_contexts`
    blocks until they exit.

    Args:
      contexts: the map, its string form, a dict, or None.
      log: log each mapping (``Mapped name dev0 to device ...``) at INFO level.

    Returns:
      The active map.

    Raises:
      ContextMapError: the map is malformed.
      DeviceError: a mapped device does not exist (checked when `log` is true).
    """
    parsed = _coerce_map(contexts)
    if parsed is not None and log:
        parsed.log_mappings()
    with _contexts_lock:
        _explicit[:] = [parsed]
    return parsed


@contextlib.contextmanager
def use_contexts(
    contexts: ContextMap | str | Mapping[str, str] | None, *, log: bool = True
) -> Iterator[ContextMap | None]:
    """Makes a context map active inside a ``with`` block (None hides any map).

    Args:
      contexts: the map, its string form, a dict, or None.
      log: log each mapping at INFO level when the block starts.

    Yields:
      The active map.
    """
    parsed = _coerce_map(contexts)
    if parsed is not None and log:
        parsed.log_mappings()
    with _contexts_lock:
        _explicit.append(parsed)
        depth = len(_explicit)
    try:
        yield parsed
    finally:
        with _contexts_lock:
            del _explicit[depth - 1 :]


# ------------------------------------------------------------ virtual devices


def virtual_devices(
    n: int, device_type: str = "CPU", memory_limit_mb: int | None = None
) -> list[str]:
    """Splits the first physical device of a type into ``n`` logical devices.

    This is how to test multi-device code without several GPUs: four logical
    CPU devices behave like four (slow) accelerators. It must run before the
    first TensorFlow op; calling it again with the same arguments is harmless.

    Args:
      n: how many logical devices, >= 1.
      device_type: ``"CPU"`` or ``"GPU"``.
      memory_limit_mb: memory of each logical GPU, required for GPUs (TF needs
        it to split one); not accepted for CPUs.

    Returns:
      The names of the new logical devices.

    Raises:
      ArgumentError: `n` or `memory_limit_mb` is invalid.
      DeviceError: there is no physical device of that type.
      DeviceSetupError: TensorFlow has already started with another split.
    """
    from tfshard.errors import ArgumentError

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ArgumentError(f"virtual_devices(n={n!r}): n is the number of devices, an int >= 1")
    kind = device_type.upper()
    if kind == "GPU":
        if memory_limit_mb is None or memory_limit_mb <= 0:
            raise ArgumentError(
                f"virtual_devices({n}, 'GPU'): splitting a GPU needs memory_limit_mb, "
                "the memory of each logical GPU (e.g. memory_limit_mb=2048)"
            )
    elif memory_limit_mb is not None:
        raise ArgumentError(
            f"virtual_devices({n}, {device_type!r}, memory_limit_mb={memory_limit_mb}): "
            "a memory limit applies to GPUs only; drop memory_limit_mb"
        )
    physical = tf.config.get_visible_devices(kind)
    if not physical:
        raise DeviceError(
            f"virtual_devices({n}, {device_type!r}): this machine has no visible "
            f"{kind}; physical devices: "
            f"{[d.name for d in tf.config.list_physical_devices()]}"
        )
    configs = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)] * n
    if tf.config.get_logical_device_configuration(physical[0]) != configs:
        try:
            tf.config.set_logical_device_configuration(physical[0], configs)
        except RuntimeError:
            current = tf.config.list_logical_devices(kind)
            raise DeviceSetupError(
                f"virtual_devices({n}, {device_type!r}) must run before TensorFlow "
                f"starts its runtime (before the first op or device query); it has "
                f"already started with {len(current)} logical {kind} device(s): "
                f"{[d.name for d in current]}. Call virtual_devices at the top of "
                "the program, right after importing tfshard"
            ) from None
    return [f"/device:{kind}:{i}" for i in range(n)]


# ------------------------------------------------------------------ transfers


def _same_device(have: str, want: str) -> bool:
    if not have:
        return False
    try:
        return _Key.of(tf.DeviceSpec.from_string(have)) == _Key.of(tf.DeviceSpec.from_string(want))
    except ValueError:
        return False


def to_device(x: Any, device: DeviceSpecLike) -> Any:
    """Copies `x` (a tensor, array, or nested structure of them) to a device.

    Returns `x` itself, the same object, when every tensor in it already lives on
    that device, so calling it on data that is already in place costs nothing.
    NumPy arrays and Python numbers are converted to tensors on the device;
    variables are read and their value copied. Inside a `tf.function` the copy
    is an identity op placed on the device.

    Args:
      x: the data.
      device: anything `resolve_device` accepts.

    Returns:
      `x` or a copy of it on `device`, with the same structure.

    >>> x = tf.constant([1.0, 2.0])
    >>> tfshard.to_device(x, "cpu:0") is x
    True
    >>> tfshard.to_device(x, "cpu:1").device
    '/job:localhost/replica:0/task:0/device:CPU:1'
    """
    name = resolve_device(device)
    leaves = tf.nest.flatten(x, expand_composites=True)
    if leaves and all(
        isinstance(leaf, (tf.Tensor, tf.Variable)) and _same_device(leaf.device, name)
        for leaf in leaves
    ):
        return x

    def copy(leaf: Any) -> Any:
        if isinstance(leaf, tf.Tensor) and _same_device(leaf.device, name):
            return leaf
        with tf.device(name):
            return tf.identity(leaf)

    return tf.nest.map_structure(copy, x, expand_composites=True)


@contextlib.contextmanager
def pin(device: DeviceSpecLike) -> Iterator[str]:
    """A `tf.device` scope that accepts every spelling `resolve_device` does.

    Yields:
      The canonical device name.

    >>> with tfshard.pin("cuda0" if tfshard.num_gpus() else "cpu:1") as name:
    ...     y = tf.constant(1.0) + 1.0
    >>> y.device.endswith(name.split("/device:")[1])
    True
    """
    name = resolve_device(device)
    with tf.device(name):
        yield name


# ------------------------------------------------------------------- clusters

TF_CONFIG_ENV = "TF_CONFIG"
GRPC_OPTIONS_ENV = "TF_GRPC_DEFAULT_OPTIONS"
# gRPC keepalive, set by `connect` for the client and by tfshard.worker for
# each worker (a worker's own channels carry the calls to its peers). Without
# it a worker that stops answering but keeps its connections open (a stopped
# process; likewise a host that drops off the network) blocks a call forever
# (measured: > 5 min, and > 13 min with keepalive on the client alone). With it
# on every process, a call with a SIGSTOPped worker on loopback failed with
# UnavailableError("ping timeout") naming that task after 60-80 s (3 runs).
# A killed worker needs none of this: its calls fail at once. Pings every 5 s
# detected no faster (59-125 s), and made a healthy 3-minute call fail with
# "Too many pings" from its busy worker; 5 min is the interval gRPC servers
# accept by default (a healthy 273 s call passed).
KEEPALIVE_OPTIONS = "grpc.keepalive_time_ms=300000,grpc.keepalive_timeout_ms=20000"
# The job this process takes in the cluster, TensorFlow's name for the client;
# its devices keep their local names ("/device:CPU:0").
_CLIENT_JOB = "localhost"
_JOB_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_WORKER_SERVICE = "/tensorflow.WorkerService/GetStatus"

_Jobs = dict[str, dict[int, str]]  # job -> task index -> "host:port"


@dataclasses.dataclass(frozen=True)
class _Connection:
    """The cluster this process is connected to (see `connect`)."""

    jobs: _Jobs  # the remote tasks
    client: str  # this process's own gRPC address, "host:port"

    def address(self, job: str, task: int) -> str | None:
        return self.jobs.get(job, {}).get(task)


# TensorFlow's cluster connection is process-wide state (one server def per
# process), so tfshard's record of it is too: it is set only by `connect`.
_connection: _Connection | None = None


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


def _cluster_jobs(cluster: Any) -> _Jobs:
    """The validated jobs of any spelling `cluster_spec` accepts."""
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
    jobs: _Jobs = {}
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

    >>> tfshard.pinning.cluster_spec("127.0.0.1:2222,127.0.0.1:2223").as_dict()
    {'worker': ['127.0.0.1:2222', '127.0.0.1:2223']}
    """
    return tf.train.ClusterSpec(_cluster_jobs(cluster))


def _probe(address: str, timeout: float) -> tuple[str | None, str | None]:
    """(problem, local address) for one TensorFlow server, bounded by `timeout`.

    First a TCP connect, retried while it is refused so that workers still
    starting up (importing TensorFlow takes seconds) are waited for; then a
    gRPC call to the server's worker service, so a port that accepts
    connections but never answers (a stopped process, or not a TensorFlow
    server) is caught too. `problem` is None when it answered.
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


def _probe_all(jobs: _Jobs, timeout: float) -> dict[tuple[str, int], tuple[str | None, str | None]]:
    """`_probe` of every task at once: the whole check takes about `timeout` at most."""
    tasks = [(job, task, address) for job, ts in jobs.items() for task, address in ts.items()]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(tasks))) as pool:
        futures = {
            (job, task): pool.submit(_probe, address, timeout) for job, task, address in tasks
        }
        return {key: future.result() for key, future in futures.items()}


def _cluster_flag(jobs: _Jobs) -> str:
    """The --cluster value of `python -m tfshard.worker` for these jobs."""
    if list(jobs) == ["worker"] and list(jobs["worker"]) == list(range(len(jobs["worker"]))):
        return ",".join(jobs["worker"].values())
    dense = {
        job: list(tasks.values()) if list(tasks) == list(range(len(tasks))) else tasks
        for job, tasks in jobs.items()
    }
    return json.dumps(dense, separators=(",", ":"))


def _worker_command(jobs: _Jobs, job: str, task: int) -> str:
    job_flag = "" if job == "worker" else f" --job={job}"
    return (
        f"python -m tfshard.worker --cluster={shlex.quote(_cluster_flag(jobs))}"
        f"{job_flag} --task={task}"
    )


def _remote_hint(job: str, task: int) -> str:
    connection = _connection
    if connection is None:
        return (
            "this process is not connected to a cluster: call tfshard.connect(cluster) "
            f"first (with a {job!r} job of at least {task + 1} task(s))"
        )
    if connection.address(job, task) is None:
        have = ", ".join(f"{j} tasks {sorted(ts)}" for j, ts in connection.jobs.items())
        return f"the connected cluster has {have}"
    return f"/job:{job}/task:{task} at {connection.address(job, task)} has no such device"


def _local_address(local: str | None) -> str:
    """This process's gRPC address as the workers see it, on a free port.

    `local` is the address our probe connection came from, so it is the
    interface that reaches the workers (127.0.0.1 for workers on loopback).
    """
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
    workers are gone), and the next call works.

    A worker that dies fails the running or next call at once with
    `tf.errors.UnavailableError` naming its task (`explain_remote_error` says
    which workers are down and how to recover). One that stops answering with
    its connections still open (a stopped process, a network partition) would
    block a call forever; `connect` (and ``python -m tfshard.worker`` on each
    worker) turns on gRPC keepalive (``TF_GRPC_DEFAULT_OPTIONS``, unless already
    set; read when the process makes its first connection), so that such a
    call fails instead, after about a minute (measured 60-80 s; workers started
    another way need the same variable). Pings more often than every 5 minutes
    are not safe with default gRPC servers: they fail long calls with "Too many
    pings".

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
      ArgumentError: the cluster is malformed, or `timeout` is not > 0.
      ClusterError: a worker did not answer; the message names each such task,
        its address and why, and the command that starts it.
    """
    global _connection
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ArgumentError(f"connect(timeout={timeout!r}): seconds, a number > 0")
    jobs = _cluster_jobs(cluster)
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
    previous = _connection
    if previous is not None and previous.jobs == jobs:
        client = previous.client  # The same server def: TF keeps our server and port.
    else:
        client = _local_address(next(iter(probes.values()))[1])
    os.environ.setdefault(GRPC_OPTIONS_ENV, KEEPALIVE_OPTIONS)
    spec = tf.train.ClusterSpec({**jobs, _CLIENT_JOB: {0: client}})
    try:
        with _without_session_config_log():
            tf.config.experimental_connect_to_cluster(spec, job_name=_CLIENT_JOB, task_index=0)
        # Connecting is lazy; listing the devices makes TF reach every worker now.
        devices = tf.config.list_logical_devices()
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        raise ClusterError(
            f"connect: TensorFlow could not connect to {_cluster_flag(jobs)} as {client}: {error}"
        ) from None
    _connection = _Connection(jobs, client)
    remote = [d.name for d in devices if is_remote(d.name)]
    deadline = time.monotonic() + timeout
    per_task = {}
    for job, tasks in jobs.items():
        for task, address in tasks.items():
            names = [n for n in remote if (_key_of(n).job, _key_of(n).task) == (job, task)]
            if not names:
                raise ClusterError(
                    f"connect: /job:{job}/task:{task} at {address} answered but reported no devices"
                )
            per_task[(job, task)] = names
    _check_links([names[0] for names in per_task.values()], jobs, client, deadline)
    for (job, task), names in per_task.items():
        _log.info(
            "Connected to /job:%s/task:%d at %s: %s",
            job,
            task,
            jobs[job][task],
            ", ".join(n.rsplit("/device:", 1)[-1] for n in names),
        )
    return remote


def _check_links(devices: list[str], jobs: _Jobs, client: str, deadline: float) -> None:
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
            raise ClusterError(
                f"connect: the workers of {_cluster_flag(jobs)} answer, but a value could not go "
                f"from this client ({client}) to every worker, between every two workers, and "
                f"back: {error.message}. Every worker must reach every other worker's address "
                f"and this client's address {client} (firewalls, or 'localhost' in the cluster "
                "where another machine needs a real address)"
            ) from None


def is_remote(device: DeviceSpecLike) -> bool:
    """True when a device lives on another TensorFlow server (so data crosses the network).

    Pure name inspection: it does not start TensorFlow or resolve the device.

    >>> tfshard.pinning.is_remote("/job:worker/replica:0/task:1/device:CPU:0")
    True
    >>> tfshard.pinning.is_remote("worker1:GPU:0"), tfshard.pinning.is_remote("/device:CPU:1")
    (True, False)
    """
    key = _key_of(device)
    return key is not None and key.job is not None


def host_of(device: DeviceSpecLike) -> str | None:
    """The ``host:port`` of the worker server a device lives on; None when local.

    Also None for a remote name outside the connected cluster (or before
    `connect`).

    >>> tfshard.pinning.host_of("/device:CPU:0") is None
    True
    """
    key = _key_of(device)
    connection = _connection
    if key is None or key.job is None or connection is None:
        return None
    return connection.address(key.job, key.task or 0)


def _key_of(device: DeviceSpecLike) -> _Key | None:
    if isinstance(device, tf.config.LogicalDevice):
        parsed = _parse_spec(device.name)
    elif isinstance(device, tf.DeviceSpec):
        parsed = _parse_spec(device.to_string())
    elif isinstance(device, str):
        parsed = _parse_spec(device.strip())
    else:
        return None
    return _Key.of(parsed) if parsed is not None else None


_REMOTE_TARGET_RE = re.compile(
    r"remote target /job:(?P<job>[A-Za-z][A-Za-z0-9_]*)/replica:\d+/task:(?P<task>\d+)"
)
_PEER_RE = re.compile(r"ipv[46]:(?P<address>\[[^\]]+\]:\d+|[^\s:\"]+:\d+)")
_GRPC_MESSAGE_RE = re.compile(r"grpc_message:\s*\"(?P<message>[^\"\\]*)")


def explain_remote_error(error: BaseException, probe_timeout: float = 2.0) -> str | None:
    """What a failed call's TensorFlow error means for the cluster, and what to do.

    A worker that died or stopped answering fails the call with a TensorFlow
    error (usually `tf.errors.UnavailableError`) whose message is gRPC detail.
    This names the worker(s) actually down, checked again now (each probe is
    bounded by `probe_timeout`), and the way back: restart the worker, then
    ``tfshard.connect(...)`` again with the same cluster.

    Args:
      error: the exception a call raised.
      probe_timeout: seconds to wait for each worker's answer.

    Returns:
      One paragraph for the user, or None when `error` is not about the cluster
      (no cluster is connected, or it is not a TensorFlow error that mentions
      a worker or the network).
    """
    connection = _connection
    if connection is None or not isinstance(error, tf.errors.OpError):
        return None
    text = str(getattr(error, "message", "") or error)
    named = {(m["job"], int(m["task"])) for m in _REMOTE_TARGET_RE.finditer(text)}
    by_address = {a: (j, t) for j, ts in connection.jobs.items() for t, a in ts.items()}
    for match in _PEER_RE.finditer(text):
        if match["address"] in by_address:
            named.add(by_address[match["address"]])
    unavailable = isinstance(error, tf.errors.UnavailableError | tf.errors.DeadlineExceededError)
    if not named and not unavailable:
        return None
    reason = _GRPC_MESSAGE_RE.search(text)
    probes = _probe_all(connection.jobs, probe_timeout)
    down = [(key, problem) for key, (problem, _) in probes.items() if problem]
    command = "tfshard.connect(...) again with the same cluster"
    if down:
        parts = [
            f"/job:{job}/task:{task} at {connection.jobs[job][task]} is down ({problem}); "
            f"restart it with: {_worker_command(connection.jobs, job, task)}"
            for (job, task), problem in down
        ]
        return (
            "; ".join(parts)
            + f"; then call {command} and run the call again (it returned nothing; a "
            "function that updates variables may have updated them on the shards that finished)"
        )
    where = (
        ", ".join(f"/job:{j}/task:{t} at {connection.address(j, t)}" for j, t in sorted(named))
        or "a worker"
    )
    detail = f" ({reason['message']})" if reason else ""
    return (
        f"the call lost contact with {where}{detail}, but every worker answers now: if it "
        f"restarted, its state from before is gone, so call {command} and retry the call"
    )
