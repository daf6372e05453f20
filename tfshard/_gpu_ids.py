"""How ``nvidia-smi``, CUDA and TensorFlow number the same GPUs, and which GPUs a spec names.

``nvidia-smi`` numbers GPUs in PCI bus order. TensorFlow's ``GPU:N`` is CUDA's device N
(unless TensorFlow's configuration hides or splits GPUs, below), which follows
``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``.
`tfshard.utilization.GpuReading.device` is filled in by these rules (CUDA's):

- ``CUDA_VISIBLE_DEVICES`` unset: every GPU is visible, in CUDA order.
- Set: a comma-separated list, and the i-th entry that parses becomes ``GPU:i``. The kind of
  the first entry sets the kind of the list:

  - indices (``"2,0"``): read like C's ``strtoul`` (``"1gpu"`` is 1); an index refers to CUDA
    order, not to ``nvidia-smi``'s;
  - UUIDs (``"GPU-8f3a..."``): any prefix that starts with ``GPU-`` and names one GPU;
  - MIG instances (``"MIG-..."``): each takes a ``GPU:i`` slot but is a slice of a GPU, so no
    whole-GPU reading maps to it.

  Parsing stops at the first entry that is invalid (negative, out of range, an ambiguous or
  unknown UUID, an entry of another kind); a repeated GPU hides every GPU; an empty value
  hides every GPU.
- ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA order is ``nvidia-smi`` order.
- Otherwise CUDA orders ``FASTEST_FIRST``, by a heuristic NVIDIA does not specify, breaking
  ties in PCI order. When every GPU on the machine has the same name (one model), that is
  ``nvidia-smi`` order. With mixed models the order is not knowable from ``nvidia-smi``, so
  GPUs reached through an index (or through an unset ``CUDA_VISIBLE_DEVICES``) get
  ``device=None`` rather than a guess; UUID entries still map exactly. Set
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (or use UUIDs) to make the mapping exact.

Then TensorFlow: CUDA's device N is ``/physical_device:GPU:N``. When the process has imported
TensorFlow and TensorFlow lists GPUs, its configuration applies too (`logical_gpus`):

- ``tf.config.set_visible_devices`` hides physical GPUs; the visible ones are numbered on;
- a physical GPU split into logical GPUs (``tfshard.virtual_devices(n, "GPU", ...)`` or
  ``tf.config.set_logical_device_configuration``) has several names, ``GPU:k`` to
  ``GPU:k+n-1``. With GPU 0 of two split in two, nvidia-smi's GPU 0 is ``GPU:0`` and
  ``GPU:1``, and its GPU 1 is ``GPU:2``.

The other way, a child process sees this process's logical ``GPU:k`` when its
``CUDA_VISIBLE_DEVICES`` holds the entry of this process's list for k's physical GPU
(`cuda_visible_entries`).

What the mapping does not see: GPUs TensorFlow skips (too old a compute capability), which
shift later ``GPU:N`` names, and MIG mode with ``CUDA_VISIBLE_DEVICES`` unset. It assumes the
text lists every GPU on the machine.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tfshard.errors import ArgumentError

# A GPU named by nvidia-smi index (0, "0"), UUID or prefix ("GPU-8f3a"), or TensorFlow name.
DeviceSpec = int | str

_TF_GPU_NAME = re.compile(
    r"(?:/job:localhost(?:/replica:0)?(?:/task:0)?)?/?(?:device:)?GPU:([0-9]+)", re.IGNORECASE
)


class Gpu(Protocol):
    """A GPU as ``nvidia-smi`` lists it (`tfshard.utilization.GpuReading` is one)."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str | None: ...

    @property
    def name(self) -> str | None: ...

    @property
    def devices(self) -> tuple[str, ...]: ...


@dataclasses.dataclass(frozen=True)
class LogicalGpu:
    """One ``/device:GPU:k`` of a process, and the physical GPU it is (a part of).

    Attributes:
        physical: The CUDA ordinal of its physical GPU in that process: N of TensorFlow's
            ``/physical_device:GPU:N``.
        memory_limit_mb: Its memory limit from ``tf.config.set_logical_device_configuration``,
            or None when it may use the whole GPU.
    """

    physical: int
    memory_limit_mb: int | None = None


def logical_gpus(tf: Any) -> tuple[LogicalGpu, ...]:
    """TensorFlow's logical GPUs in this process, entry k being ``/device:GPU:k``.

    Reads only the configuration, so it does not start the runtime. TensorFlow gives each
    visible physical GPU, in order, as many consecutive numbers as it has logical devices;
    ``experimental_device_ordinal`` reorderings are not followed. `tf` is passed in: this
    module imports no TensorFlow.

    >>> tfshard._gpu_ids.logical_gpus(tf)  # no GPU on the machine that runs the doctests
    ()
    """
    found = []
    for device in tf.config.get_visible_devices("GPU"):
        physical = int(device.name.rsplit(":", 1)[1])  # "/physical_device:GPU:N"
        configs = tf.config.get_logical_device_configuration(device) or [None]
        for config in configs:
            limit = None if config is None else config.memory_limit
            found.append(LogicalGpu(physical, None if limit is None else int(limit)))
    return tuple(found)


def this_process_logical_gpus() -> tuple[LogicalGpu, ...] | None:
    """`logical_gpus` of this process when it imported TensorFlow and TensorFlow lists a GPU.

    None otherwise (the CUDA rules alone then give the names): this never imports TensorFlow,
    which would start CUDA in a process that only reads ``nvidia-smi``.
    """
    tf = sys.modules.get("tensorflow")
    config = getattr(tf, "config", None)  # None too while another thread imports TensorFlow
    if config is None or not config.list_physical_devices("GPU"):
        return None
    return logical_gpus(tf)


def tf_device_names(
    gpus: Sequence[Gpu],
    environ: Mapping[str, str],
    logical: Sequence[LogicalGpu] | None = None,
) -> dict[int, tuple[str, ...]]:
    """Maps nvidia-smi index to TensorFlow device names by the rules in the module docstring.

    Args:
        gpus: Every GPU on the machine, as nvidia-smi lists them.
        environ: The environment of the process whose names are wanted.
        logical: That process's logical GPUs (`logical_gpus`), or None to take CUDA's device
            N as ``GPU:N`` (no split, no ``tf.config.set_visible_devices``).

    Returns:
        ``{nvidia-smi index: ("/device:GPU:k", ...)}`` for each GPU that process sees: one
        name, or several when the GPU is split into logical GPUs.
    """
    by_index = sorted(gpus, key=lambda r: r.index)
    pci_order = environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    one_model = len({r.name for r in by_index}) <= 1 and all(r.name for r in by_index)
    # CUDA's own order of the GPUs, or None when it cannot be known from nvidia-smi.
    cuda_order = by_index if pci_order or one_model else None
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        visible: list[Gpu | None] = list(cuda_order) if cuda_order is not None else []
    else:
        visible = _visible(spec, by_index, cuda_order)
    if logical is None:
        logical = [LogicalGpu(ordinal) for ordinal in range(len(visible))]
    names: dict[int, tuple[str, ...]] = {}
    for k, device in enumerate(logical):
        gpu = visible[device.physical] if device.physical < len(visible) else None
        if gpu is not None:
            names[gpu.index] = (*names.get(gpu.index, ()), f"/device:GPU:{k}")
    return names


def cuda_visible_entries(environ: Mapping[str, str]) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``, entry N naming CUDA device N (what a child
    must be given to see it); None if unset (then ``str(N)``)."""
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    return None if spec is None else [entry.strip() for entry in spec.split(",")]


def _visible(spec: str, gpus: Sequence[Gpu], cuda_order: Sequence[Gpu] | None) -> list[Gpu | None]:
    """Applies CUDA_VISIBLE_DEVICES: entry i is the GPU that becomes GPU:i (None: unknown)."""
    visible: list[Gpu | None] = []
    seen: set[object] = set()
    kind = "GPU-" if spec.startswith("GPU-") else "MIG-" if spec.startswith("MIG-") else None
    for raw in spec.split(","):
        key: object
        if kind is None:
            ordinal = _strtoul(raw.strip())
            if ordinal < 0 or ordinal >= len(gpus):
                break
            key = ordinal
            gpu = cuda_order[ordinal] if cuda_order is not None else None
        elif not raw.startswith(kind):
            break
        elif kind == "MIG-":
            # A MIG instance is its own CUDA device, not the whole GPU nvidia-smi reports.
            key, gpu = raw, None
        else:
            matches = [g for g in gpus if g.uuid is not None and g.uuid.startswith(raw)]
            if len(matches) != 1:
                break
            gpu = matches[0]
            key = gpu.index
        if key in seen:
            return []
        seen.add(key)
        visible.append(gpu)
    return visible


def _strtoul(text: str) -> int:
    """The leading integer of text, sign included (as CUDA's strtoul: "1gpu" is 1), or -1."""
    match = re.match(r"[+-]?[0-9]+", text)
    return int(match.group()) if match else -1


# --- which GPUs a user names ------------------------------------------------------------


def device_specs(devices: Any) -> tuple[DeviceSpec, ...]:
    """Checks the ``devices=`` of a Monitor: one spec or a sequence of them, or None (all).

    A spec is a str or an integer (a NumPy integer is one, a bool is not); bytes are refused
    rather than read as a sequence of integers. Integers come back as Python ints.
    """
    if devices is None:
        return ()
    one = _spec(devices)
    if one is not None:
        return (one,)
    if isinstance(devices, bytes | bytearray | Mapping) or not _iterable(devices):
        raise ArgumentError(
            f"devices={devices!r} is of type {type(devices).__name__}; {_SPECS}, one or a "
            "list of them"
        )
    specs = []
    for entry in devices:
        spec = _spec(entry)
        if spec is None:
            raise ArgumentError(
                f"devices={devices!r} holds {entry!r} of type {type(entry).__name__}; {_SPECS}"
            )
        specs.append(spec)
    if not specs:
        raise ArgumentError("devices=[] follows no GPU; pass None to follow every GPU")
    return tuple(specs)


_SPECS = "give nvidia-smi indices (0), UUIDs ('GPU-8f3a...') or TensorFlow names ('GPU:1')"


def _spec(value: Any) -> DeviceSpec | None:
    """value as a spec (a str, or an integer as a Python int), or None when it is not one."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):  # NumPy's bool is no integer to operator.index either
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def select(readings: Sequence[Gpu], specs: Sequence[DeviceSpec]) -> frozenset[int]:
    """The nvidia-smi indices the specs name; every GPU when there are no specs."""
    if not specs:
        return frozenset(r.index for r in readings)
    chosen = set()
    for spec in specs:
        matches = [r for r in readings if _matches(r, spec)]
        if len(matches) != 1:
            seen = "; ".join(
                f"{r.index} {r.uuid} ({', '.join(r.devices) or 'no TF device'})" for r in readings
            )
            problem = "names no GPU" if not matches else "names several GPUs"
            raise ArgumentError(
                f"devices entry {spec!r} {problem}; nvidia-smi sees: {seen or 'no GPU'}"
            )
        chosen.add(matches[0].index)
    return frozenset(chosen)


def _matches(reading: Gpu, spec: DeviceSpec) -> bool:
    if isinstance(spec, int) or (spec.isascii() and spec.isdigit()):
        return reading.index == int(spec)
    if spec.startswith("GPU-"):
        return reading.uuid is not None and reading.uuid.startswith(spec)
    match = _TF_GPU_NAME.fullmatch(spec)
    if match is None:
        raise ArgumentError(
            f"cannot read device spec {spec!r}; give an nvidia-smi index (0), a UUID "
            "('GPU-8f3a...') or a TensorFlow name ('GPU:1', '/device:GPU:1')"
        )
    return f"/device:GPU:{int(match.group(1))}" in reading.devices
