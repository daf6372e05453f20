"""This process's devices: discovery, name resolution, context maps, transfers.

Every function here speaks TensorFlow's *logical* device names, the ones
`tf.config.list_logical_devices()` reports (``/device:GPU:1``, or
``/job:worker/replica:0/task:1/device:CPU:0`` for a remote device). Those are the
canonical names: `resolve_device` turns any accepted spelling into one of them,
and everything else in tfshard takes what `resolve_device` takes.

A *context map* names roles instead of cards, as Aesara/Theano users know it:
once ``"dev0->GPU:0; dev1->GPU:1"`` is active (`use_contexts`, `set_contexts`, or
the ``TFSHARD_CONTEXTS`` environment variable), ``resolve_device("dev1")`` is
``/device:GPU:1``, so ``parallelize(devices=["dev0", "dev1"])`` moves to other
cards by changing one string.

Device discovery (`list_devices`, `resolve_device`, ...) starts the TensorFlow
runtime, after which logical devices can no longer be configured: call
`virtual_devices` first. `num_gpus`, `try_gpu` and `try_all_gpus` only read the
configuration and do not start the runtime.

Remote names (``"/job:worker/task:1/device:GPU:0"``, short ``"worker1:GPU:0"``)
resolve once `tfshard.connect` has connected this process to their machines;
this module knows the cluster only as TensorFlow lists its devices.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tfshard._arguments import integer
from tfshard._device_names import (
    DeviceKey,
    DeviceSpecLike,
    is_local_job,
    is_remote,
    parse_name,
    parse_spec,
    same_device,
)
from tfshard.errors import ArgumentError, ContextMapError, DeviceError, DeviceSetupError

__all__ = (
    "ContextMap",
    "active_contexts",
    "cpu",
    "gpu",
    "is_remote",
    "list_devices",
    "num_gpus",
    "pin",
    "reset_contexts",
    "resolve_device",
    "set_contexts",
    "to_device",
    "try_all_gpus",
    "try_gpu",
    "use_contexts",
    "virtual_devices",
)

_log = logging.getLogger("tfshard")

CONTEXTS_ENV = "TFSHARD_CONTEXTS"

_RESERVED_PREFIXES = ("cuda", "opencl", "gpu", "cpu")
# Device types TensorFlow places ops on, besides those of this machine's devices.
_DEVICE_TYPES = frozenset({"CPU", "GPU", "TPU", "TPU_SYSTEM", "XLA_CPU", "XLA_GPU"})
# The device types TensorFlow splits into logical devices.
_SPLITTABLE = ("CPU", "GPU")
# What to_device copies as it is: tensors, arrays and Python scalars.
_TENSOR_LIKE = (tf.Tensor, tf.Variable, np.ndarray, np.generic)
_SCALARS = (bool, int, float, complex, str, bytes)


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
    i = _check_index(i, "i")
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
    i = _check_index(i, "i")
    return f"/device:GPU:{i}" if i < num_gpus() else cpu()


def try_all_gpus() -> list[str]:
    """Every GPU, or ``[cpu()]`` when there is none.

    >>> len(tfshard.try_all_gpus()) == max(tfshard.num_gpus(), 1)
    True
    """
    return _gpu_names(num_gpus()) or [cpu()]


def _gpu_names(count: int) -> list[str]:
    return [f"/device:GPU:{i}" for i in range(count)]


def _check_index(i: Any, name: str) -> int:
    index = integer(i)
    if index is None or index < 0:
        raise DeviceError(f"{name}={i!r}: a device index is an int >= 0")
    return index


def list_devices(device_type: str | None = None) -> list[str]:
    """Canonical names of the logical devices, local and (after connecting) remote.

    Starts the TensorFlow runtime.

    Args:
      device_type: ``"CPU"``, ``"GPU"``, ... (any case), or None for all. A type
        this machine has no device of gives an empty list.

    Returns:
      Names exactly as `tf.config.list_logical_devices` reports them.

    Raises:
      ArgumentError: `device_type` is not a device type (a device name such as
        ``"gpu:0"`` is one device: `resolve_device` names it); the message lists
        the types.

    >>> tfshard.list_devices("cpu")[:2]
    ['/device:CPU:0', '/device:CPU:1']
    """
    if device_type is None:
        return [d.name for d in tf.config.list_logical_devices()]
    devices = tf.config.list_logical_devices()
    types = _DEVICE_TYPES | {d.device_type for d in devices}
    kind = device_type.strip().upper() if isinstance(device_type, str) else None
    if kind not in types:
        hint = ""
        named = parse_spec(device_type.strip()) if isinstance(device_type, str) else None
        if named is not None and named.device_type in types:
            hint = f"; {device_type!r} names one device: tfshard.resolve_device gives its name"
        raise ArgumentError(
            f"list_devices(device_type={device_type!r}): a device type is one of "
            f"{', '.join(repr(t) for t in sorted(types))} (any case), or None for every "
            f"device{hint}"
        )
    return [d.name for d in devices if d.device_type == kind]


# ---------------------------------------------------------------- resolution


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
    name = context_name(spec)
    if name is not None:
        return active_contexts().resolve(name)
    parsed = _parse_request(spec)
    wanted = DeviceKey.of(parsed)
    devices = tf.config.list_logical_devices()
    for device in devices:
        if wanted == DeviceKey.of(tf.DeviceSpec.from_string(device.name)):
            return device.name
    hint = ""
    if wanted.device_type == "GPU":
        hint = "; tfshard.try_gpu()/try_all_gpus() fall back to the CPU when a GPU is missing"
    if wanted.job is not None:
        hint += "; " + _remote_hint(wanted, devices)
    else:
        hint += (
            "; tfshard.virtual_devices(n) before the first TF op splits the CPU (or a "
            "GPU) into n logical devices"
        )
    raise DeviceError(
        f"device {spec!r} ({parsed.to_string()}) does not exist; this process has "
        f"{_existing(devices)}{hint}"
    )


def context_name(spec: DeviceSpecLike) -> str | None:
    """The context name `spec` is in the active context map (stripped), else None:
    the one reading of a spelling as a role."""
    if not isinstance(spec, str):
        return None
    contexts = active_contexts()
    _active.log_env_once(contexts)
    name = spec.strip()
    return name if contexts is not None and name in contexts else None


def _remote_hint(wanted: DeviceKey, devices: list[tf.config.LogicalDevice]) -> str:
    """Why task `wanted.task` of job `wanted.job` has no such device, from TF's device list.

    TensorFlow lists a remote task's devices once this process is connected to its
    cluster, so the list says whether a cluster is connected and which tasks it has.
    """
    tasks: dict[str, set[int]] = {}
    for device in devices:
        key = DeviceKey.of(tf.DeviceSpec.from_string(device.name))
        if key.job is not None:
            tasks.setdefault(key.job, set()).add(key.task)
    job, task = wanted.job, wanted.task
    if not tasks:
        return (
            "this process is not connected to a cluster: call tfshard.connect(cluster) "
            f"first (with a {job!r} job of at least {task + 1} task(s))"
        )
    if task not in tasks.get(job or "", ()):
        have = ", ".join(f"{j} tasks {sorted(ts)}" for j, ts in tasks.items())
        return f"the connected cluster has {have}"
    return f"/job:{job}/task:{task} has no such device"


def _parse_request(spec: Any) -> tf.DeviceSpec:
    """What `resolve_device` was asked for, or a DeviceError saying why it is no device."""
    if isinstance(spec, bool):
        raise DeviceError(f"device {spec!r}: a bool is not a device")
    if integer(spec) is not None:
        return tf.DeviceSpec(device_type="GPU", device_index=_check_index(spec, "device"))
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text.startswith("opencl"):
            raise DeviceError(
                f"device {spec!r}: TensorFlow has no OpenCL devices; use one of {_existing()}"
            )
        if text.startswith("/physical_device:"):
            raise DeviceError(
                f"device {spec!r} is a physical device; tfshard places work on "
                f"logical devices: use one of {_existing()}"
            )
    elif not isinstance(spec, tf.config.LogicalDevice | tf.DeviceSpec):
        raise DeviceError(
            f"device {spec!r} of type {type(spec).__name__}: pass an int (GPU index), "
            "a name such as 'GPU:1' or 'cpu', a tf.config.LogicalDevice, or a "
            "context name"
        )
    parsed = parse_name(spec)
    if parsed is None:
        names = active_contexts()
        known = f"; active context names: {sorted(names)}" if names else ""
        raise DeviceError(
            f"device {spec!r} is not a device name (examples: 'GPU:1', 'cuda1', "
            f"'cpu', '/job:worker/task:1/device:CPU:0', 'worker1:CPU:0'){known}"
        )
    return parsed


def _existing(devices: list[tf.config.LogicalDevice] | None = None) -> str:
    devices = tf.config.list_logical_devices() if devices is None else devices
    return ", ".join(d.name for d in devices) or "no devices"


def _describe(name: str) -> str:
    """A short human description of a canonical device, for logs."""
    spec = tf.DeviceSpec.from_string(name)
    if not is_local_job(spec.job):
        return f"{spec.device_type} {spec.device_index} of {spec.job} task {spec.task}"
    physical = tf.config.get_visible_devices(spec.device_type)
    if len(physical) == 1 and spec.device_type != "GPU":
        total = _local_count(spec.device_type)
        if total > 1:
            return f"logical device {spec.device_index} of {total} on {physical[0].name}"
        return physical[0].name
    # Only an unsplit GPU maps its logical index to the physical one 1:1.
    if spec.device_type == "GPU" and _local_count("GPU") == len(physical):
        for device in physical:
            if device.name.endswith(f":{spec.device_index}"):
                details = tf.config.experimental.get_device_details(device)
                return details.get("device_name", device.name)
    return spec.device_type


# --------------------------------------------------------------- context maps


class ContextMap(Mapping[str, str]):
    """An immutable map from context names (roles) to device specs.

    Parse one from the Aesara-style string ``"dev0->GPU:0;dev1->GPU:1"`` with
    `ContextMap.parse`. Rules, each checked with the entry's position in the
    error: a name is non-empty, contains neither ``->`` nor ``;``, is not a
    device name (``"/device:CPU:1"``, ``"worker0:cpu:0"``, ``"tpu"``: it would
    hide that device) nor begins with ``cuda``, ``opencl``, ``gpu`` or ``cpu``,
    and appears once; several names may map to one device (they will share it).
    Whitespace around names and devices, and a trailing ``;``, are ignored.

    Targets are device specs, resolved when the map is used, so a map can be
    parsed before TensorFlow starts.

    >>> m = tfshard.ContextMap.parse("dev0->GPU:0; dev1->GPU:1;")
    >>> dict(m)
    {'dev0': 'GPU:0', 'dev1': 'GPU:1'}
    """

    def __init__(self, mapping: Mapping[str, str] | None = None) -> None:
        if mapping is not None and not isinstance(mapping, Mapping):
            hint = "; for a string use ContextMap.parse" if isinstance(mapping, str) else ""
            raise ContextMapError(
                f"ContextMap({mapping!r}): pass a mapping of context names to device specs "
                f"such as {{'dev0': 'GPU:0'}}, or None for an empty map{hint}"
            )
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
    if not isinstance(name, str):
        raise ContextMapError(
            f"{where}: the context name {name!r} is of type {type(name).__name__}; a "
            "context name is a non-empty string such as 'dev0'"
        )
    if not name:
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
    spec = parse_spec(name)
    physical = {d.device_type for d in tf.config.list_physical_devices()}
    if spec is not None and spec.device_type in _DEVICE_TYPES | physical:
        raise ContextMapError(
            f"{where}: context name {name!r} reads as the device {spec.to_string()} and would "
            "hide it from resolve_device and output_device=; choose another name (e.g. 'dev0')"
        )
    if not isinstance(device, str):
        example = f"'GPU:{device}'" if integer(device) is not None else "'GPU:1'"
        raise ContextMapError(
            f"{where}: the device of {name!r} is {device!r} of type {type(device).__name__}; "
            f"a context map's device is a device name string such as {example}"
        )
    if not device:
        raise ContextMapError(f"{where}: the device of {name!r} is empty")


class _ActiveContexts:
    """Where `active_contexts` looks: this thread's `use_contexts` blocks, innermost
    last, then the process's `set_contexts` map, then ``TFSHARD_CONTEXTS``.

    Process state on purpose, as `tf.device` scopes are: a map chosen once (a
    ``--contexts`` flag, the environment, a ``with`` block) reaches every name
    resolved under it without passing through the user's code.

    The variable is parsed once per value, under the lock (any thread may read it
    first), and logged once, when `resolve_device` first reads a name: logging
    resolves devices, which starts TF's runtime, and would break `virtual_devices`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # Guards all but the per-thread blocks.
        self.reset()

    def reset(self) -> None:
        """Forgets every map: the set one, every thread's blocks, the variable's parse."""
        with self._lock:
            self._thread = threading.local()
            # `set_contexts`' map: [] until set, then [map] ([None] hides the variable's).
            self._explicit: list[ContextMap | None] = []
            self._env: tuple[str, ContextMap] | None = None  # (text, its map)
            self._env_logged = False

    def blocks(self) -> list[ContextMap | None]:
        """This thread's `use_contexts` maps, innermost last; a new thread has none."""
        if not hasattr(self._thread, "maps"):
            self._thread.maps = []
        return self._thread.maps

    def get(self) -> ContextMap | None:
        blocks = self.blocks()
        if blocks:
            return blocks[-1]
        with self._lock:
            if self._explicit:
                return self._explicit[-1]
        return self._from_env()

    def set(self, contexts: ContextMap | None) -> None:
        with self._lock:
            self._explicit[:] = [contexts]

    def _from_env(self) -> ContextMap | None:
        """The map the variable spells now, None when unset; ContextMapError if malformed."""
        text = os.environ.get(CONTEXTS_ENV, "")
        if not text.strip():
            return None
        with self._lock:
            if self._env is None or self._env[0] != text:
                try:
                    parsed = ContextMap.parse(text)
                except ContextMapError as error:
                    raise ContextMapError(f"{CONTEXTS_ENV}: {error}") from None
                self._env, self._env_logged = (text, parsed), False
            return self._env[1]

    def log_env_once(self, contexts: ContextMap | None) -> None:
        """Logs the mappings of `contexts` if it is the variable's map, not logged yet."""
        with self._lock:  # Marked first: logging resolves, which reads the map again.
            if contexts is None or self._env is None or contexts is not self._env[1]:
                return
            if self._env_logged:
                return
            self._env_logged = True
        try:
            contexts.log_mappings()
        except DeviceError as error:
            # Raised only when that name is used, not on every unrelated lookup.
            _log.warning("%s: %s", CONTEXTS_ENV, error)


_active = _ActiveContexts()


def active_contexts() -> ContextMap | None:
    """The active context map, in this order: this thread's innermost
    `use_contexts`, else the process's `set_contexts`, else ``TFSHARD_CONTEXTS``,
    else None. Reading it does not start TensorFlow's runtime.

    Raises:
      ContextMapError: ``TFSHARD_CONTEXTS`` is set but malformed.
    """
    return _active.get()


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
    """Makes a context map active for every thread of the process (None: no map).

    This is how a ``--contexts`` flag is applied: ``set_contexts(FLAGS.contexts)``.
    It replaces the map set before and hides ``TFSHARD_CONTEXTS``; a
    `use_contexts` block, in any thread, still wins inside that block.

    Args:
      contexts: the map, its string form, a dict, or None.
      log: log each mapping (``Mapped name dev0 to device ...``) at INFO level;
        this resolves the devices, so it starts TensorFlow's runtime.

    Returns:
      The active map.

    Raises:
      ContextMapError: the map is malformed.
      DeviceError: a mapped device does not exist (checked when `log` is true).
    """
    parsed = _coerce_map(contexts)
    if parsed is not None and log:
        parsed.log_mappings()
    _active.set(parsed)
    return parsed


def reset_contexts() -> None:
    """Forgets every context map this process was given, as if tfshard were just imported.

    `set_contexts`' map is dropped (``TFSHARD_CONTEXTS`` counts again, and is
    read and logged afresh at the next lookup), and so is every thread's
    `use_contexts` block: a block still open keeps no map from then on, and
    closing it restores none. For a long-lived process that starts over (a
    notebook, a test suite giving each test no map).
    """
    _active.reset()


@contextlib.contextmanager
def use_contexts(
    contexts: ContextMap | str | Mapping[str, str] | None, *, log: bool = True
) -> Iterator[ContextMap | None]:
    """Makes a context map active inside a ``with`` block (None hides any map).

    Per thread, like `tf.device` scopes: other threads, and threads started
    inside the block, keep their own maps, else `set_contexts`' map.

    Args:
      contexts: the map, its string form, a dict, or None.
      log: log each mapping at INFO level when the block starts.

    Yields:
      The active map.
    """
    parsed = _coerce_map(contexts)
    if parsed is not None and log:
        parsed.log_mappings()
    maps = _active.blocks()
    maps.append(parsed)
    depth = len(maps)
    try:
        yield parsed
    finally:
        del maps[depth - 1 :]


# ------------------------------------------------------------ virtual devices


def virtual_devices(
    n: int, device_type: str = "CPU", memory_limit_mb: int | None = None
) -> list[str]:
    """Splits the first physical device of a type into ``n`` logical devices.

    This is how to test multi-device code without several GPUs: four logical
    CPU devices behave like four (slow) accelerators. It must run before the
    first TensorFlow op; calling it again with the same arguments is harmless.

    Args:
      n: how many logical devices, an int >= 1 (a NumPy integer is one).
      device_type: ``"CPU"`` or ``"GPU"`` (any case).
      memory_limit_mb: memory of each logical GPU in MiB, an int >= 1, required
        for GPUs (TF needs it to split one); not accepted for CPUs.

    Returns:
      The names of the new logical devices.

    Raises:
      ArgumentError: `n`, `device_type` or `memory_limit_mb` is invalid.
      DeviceError: there is no physical device of that type.
      DeviceSetupError: TensorFlow has already started with another split.
    """
    count = integer(n)
    if count is None or count < 1:
        raise ArgumentError(f"virtual_devices(n={n!r}): n is the number of devices, an int >= 1")
    n = count
    if not (isinstance(device_type, str) and device_type.strip().upper() in _SPLITTABLE):
        raise ArgumentError(
            f"virtual_devices({n}, device_type={device_type!r}): TensorFlow splits a 'CPU' "
            "or a 'GPU' into logical devices; give one of them"
        )
    kind = device_type.strip().upper()
    if kind == "GPU" and memory_limit_mb is None:
        raise ArgumentError(
            f"virtual_devices({n}, 'GPU'): splitting a GPU needs memory_limit_mb, "
            "the memory of each logical GPU (e.g. memory_limit_mb=2048)"
        )
    if kind == "GPU":
        limit = integer(memory_limit_mb)
        if limit is None or limit < 1:
            raise ArgumentError(
                f"virtual_devices({n}, 'GPU', memory_limit_mb={memory_limit_mb!r}): give the "
                "memory of each logical GPU in MiB, an int >= 1 (e.g. memory_limit_mb=2048)"
            )
        memory_limit_mb = limit
    if kind != "GPU" and memory_limit_mb is not None:
        raise ArgumentError(
            f"virtual_devices({n}, {device_type!r}, memory_limit_mb={memory_limit_mb}): "
            "a memory limit applies to GPUs only; drop memory_limit_mb"
        )
    physical = tf.config.get_visible_devices(kind)
    if not physical:
        raise DeviceError(
            f"virtual_devices({n}, {device_type!r}): this machine has no visible {kind}; "
            f"physical devices: {[d.name for d in tf.config.list_physical_devices()]}"
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

    Raises:
      ArgumentError: `x` is or holds something that is no tensor (None, a set,
        a function).
      DeviceError: as `resolve_device` raises.

    >>> x = tf.constant([1.0, 2.0])
    >>> tfshard.to_device(x, "cpu:0") is x
    True
    >>> tfshard.to_device(x, "cpu:1").device
    '/job:localhost/replica:0/task:0/device:CPU:1'
    """
    name = resolve_device(device)
    leaves = tf.nest.flatten(x, expand_composites=True)
    for leaf in leaves:
        if leaf is None or isinstance(leaf, set | frozenset) or (
            callable(leaf) and not isinstance(leaf, _TENSOR_LIKE)
        ):
            raise _no_tensor(x, leaf)
    if leaves and all(
        isinstance(leaf, (tf.Tensor, tf.Variable)) and same_device(leaf.device, name)
        for leaf in leaves
    ):
        return x

    def copy(leaf: Any) -> Any:
        if isinstance(leaf, tf.Tensor) and same_device(leaf.device, name):
            return leaf
        with tf.device(name):
            try:
                return tf.identity(leaf)
            except (TypeError, ValueError):
                if isinstance(leaf, _TENSOR_LIKE + _SCALARS):
                    raise  # about the value itself (a Python int too big for int32)
                raise _no_tensor(x, leaf) from None  # an object TF cannot convert

    return tf.nest.map_structure(copy, x, expand_composites=True)


def _no_tensor(x: Any, leaf: Any) -> ArgumentError:
    where = "x" if leaf is x else f"x holds {leaf!r}, which"
    return ArgumentError(
        f"to_device: {where} is of type {type(leaf).__name__}, which is no tensor; pass a "
        "tensor, a variable, a NumPy array, a Python number or string, or a nested list, "
        "tuple or dict of them"
    )


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
