"""How busy the GPUs are, read from ``nvidia-smi`` while your code runs.

Before adding GPUs, check that the function keeps one GPU busy: if its utilisation is well
under 90 %, a second GPU will mostly wait too. This module answers that from the
``nvidia-smi`` that ships with the NVIDIA driver; it imports no TensorFlow and needs only the
standard library (absl is used by the command line only).

- `query` runs ``nvidia-smi`` once and returns one `GpuReading` per GPU.
- `parse` reads the same CSV from text you paste (header lines and units are fine).
- `Monitor` samples in a background thread while a ``with`` block runs and summarises each
  GPU (`GpuSummary`).
- `check` runs a function under a `Monitor` and returns a `Verdict` per GPU: busy enough to
  scale out, or not, with the reason and what to change.
- `format_table` lays readings out as the table the command line prints.
- ``python -m tfshard.utilization`` prints that table (``--watch SECONDS`` to refresh,
  ``--threshold``, ``--json``); it exits 0 when every GPU meets the threshold, 1 when one
  does not, 2 when no reading could be taken, and 0 for ``--help``.

The ``nvidia-smi`` executable is, in order: the ``nvidia_smi=`` argument, the
``TFSHARD_NVIDIA_SMI`` environment variable, ``nvidia-smi`` on ``PATH``.

Which TensorFlow device is which GPU
------------------------------------
``nvidia-smi`` numbers GPUs in PCI bus order; TensorFlow's ``GPU:N`` is CUDA's device N, which
follows ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``. `GpuReading.devices` applies CUDA's
rules, written out in ``tfshard/_gpu_ids.py``, and, when this process has imported TensorFlow,
its configuration: GPUs hidden with ``tf.config.set_visible_devices`` have no name, and a GPU
split into logical GPUs has several. Where the rules cannot tell (mixed GPU models in CUDA's
default order) a GPU has no name rather than a guess. Set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or
list UUIDs in ``CUDA_VISIBLE_DEVICES`` to make the mapping exact.

Utilisation is ``nvidia-smi``'s ``utilization.gpu``: the share of the driver's last sample
period (1/6 s to 1 s) in which any kernel ran. It does not say how much of the GPU a kernel
used, so a GPU at 100 % may still have room; below the threshold it is certainly waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tfshard import _gpu_ids
from tfshard.errors import ArgumentError, UtilizationError

__all__ = (
    "GpuReading",
    "GpuSummary",
    "Monitor",
    "Verdict",
    "check",
    "format_table",
    "parse",
    "query",
)

_QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "utilization.gpu",
    "utilization.memory",
    "memory.used",
    "memory.total",
)
_QUERY_ARGS = (
    "--query-gpu=" + ",".join(_QUERY_FIELDS),
    "--format=csv,noheader,nounits",
)
_ENV_EXECUTABLE = "TFSHARD_NVIDIA_SMI"
# Without persistence mode every nvidia-smi call initialises the driver, which takes
# seconds on a machine with many GPUs; longer than this means it hangs.
_DEFAULT_TIMEOUT_S = 10.0
# Shared with the command line (tfshard/utilization/__main__.py).
DEFAULT_THRESHOLD = 90.0
_QUOTE_LIMIT = 1000
_THREAD_NAME = "tfshard-utilization-monitor"

_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")


@dataclasses.dataclass(frozen=True)
class GpuReading:
    """One GPU as ``nvidia-smi`` reported it at one moment.

    Field names follow ``nvidia-smi --query-gpu`` names. A field the driver reports as
    ``[N/A]`` or ``[Not Supported]`` (for example utilisation in MIG mode) is None.

    Attributes:
        index: ``nvidia-smi``'s index, in PCI bus order.
        uuid: The GPU's UUID, ``"GPU-..."``.
        name: The product name, for example ``"NVIDIA A100-SXM4-40GB"``.
        utilization_gpu: Percent of the last sample period in which a kernel ran.
        utilization_memory: Percent of the last sample period in which memory was read or
            written.
        memory_used_mib: Memory in use, in MiB.
        memory_total_mib: Memory on the GPU, in MiB.
        device: The TensorFlow device name of this GPU in this process, for example
            ``"/device:GPU:0"``, or None when TensorFlow cannot see it or the mapping is not
            knowable (see the module docstring). The first of ``devices``.
        devices: Every TensorFlow device name of this GPU in this process: one, or several
            when it is split into logical GPUs (``tfshard.virtual_devices(2, "GPU", ...)``
            makes one GPU ``/device:GPU:0`` and ``/device:GPU:1``); empty when ``device`` is
            None. Given one of ``device`` and ``devices``, the other is filled in.
    """

    index: int
    uuid: str | None
    name: str | None
    utilization_gpu: float | None
    utilization_memory: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    device: str | None = None
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.devices and self.device is None:
            object.__setattr__(self, "device", self.devices[0])
        elif self.device is not None and not self.devices:
            object.__setattr__(self, "devices", (self.device,))
        elif self.devices and self.device != self.devices[0]:
            raise ArgumentError(
                f"device={self.device!r} is not the first of devices={self.devices!r}; "
                "give one of them"
            )


@dataclasses.dataclass(frozen=True)
class GpuSummary:
    """What a `Monitor` saw of one GPU.

    Means, minima and maxima are over the samples in which the driver reported a value; they
    are None when it never did.

    Attributes:
        index: ``nvidia-smi``'s index.
        uuid: The GPU's UUID.
        name: The product name.
        device: The TensorFlow device name, or None (see `GpuReading.device`).
        samples: How many readings of this GPU were taken.
        utilization_gpu_mean: Mean of ``utilization.gpu``, in percent.
        utilization_gpu_min: Lowest ``utilization.gpu``.
        utilization_gpu_max: Highest ``utilization.gpu``.
        utilization_memory_mean: Mean of ``utilization.memory``, in percent.
        utilization_memory_max: Highest ``utilization.memory``.
        memory_used_peak_mib: Highest ``memory.used``, in MiB.
        memory_total_mib: ``memory.total``, in MiB.
        devices: Every TensorFlow device name (see `GpuReading.devices`).
    """

    index: int
    uuid: str | None
    name: str | None
    device: str | None
    samples: int
    utilization_gpu_mean: float | None
    utilization_gpu_min: float | None
    utilization_gpu_max: float | None
    utilization_memory_mean: float | None
    utilization_memory_max: float | None
    memory_used_peak_mib: int | None
    memory_total_mib: int | None
    devices: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether one GPU was busy enough that adding GPUs can help.

    Attributes:
        summary: What the `Monitor` saw of this GPU.
        busy: True when the mean utilisation met the threshold.
        reason: The numbers behind ``busy``.
        hint: What to do next.
    """

    summary: GpuSummary
    busy: bool
    reason: str
    hint: str

    def __str__(self) -> str:
        s = self.summary
        where = ", ".join(s.devices) or s.device or "no TensorFlow device in this process"
        state = "busy enough to scale out" if self.busy else "not busy enough to scale out"
        name = s.name or "unnamed GPU"
        return f"GPU {s.index} {name} ({where}): {state}\n  {self.reason}\n  hint: {self.hint}"


# --- reading nvidia-smi output ---------------------------------------------------------


def parse(text: str, environ: Mapping[str, str] | None = None) -> list[GpuReading]:
    """Reads the output of ``nvidia-smi --query-gpu=...`` into one reading per GPU.

    Accepts what `query` runs (``--format=csv,noheader,nounits``) and what users paste:
    header lines and units (``93 %``, ``15012 MiB``) are fine. The columns must be
    ``index, uuid, name, utilization.gpu, utilization.memory, memory.used, memory.total``.

    >>> text = '''
    ... index, uuid, name, utilization.gpu, utilization.memory, memory.used, memory.total
    ... 0, GPU-8f3a2c1e, NVIDIA A100-SXM4-40GB, 93 %, 41 %, 15012 MiB, 40960 MiB
    ... 1, GPU-1b2c3d4e, NVIDIA A100-SXM4-40GB, [N/A], [Not Supported], 0 MiB, 40960 MiB
    ... '''
    >>> gpu0, gpu1 = parse(text, environ={"CUDA_VISIBLE_DEVICES": "1"})
    >>> gpu0.utilization_gpu, gpu0.memory_used_mib, gpu0.device
    (93.0, 15012, None)
    >>> gpu1.utilization_gpu, gpu1.utilization_memory, gpu1.device
    (None, None, '/device:GPU:0')

    Args:
        text: The output, one GPU per line.
        environ: The environment whose ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``
            decide `GpuReading.device`; defaults to this process's ``os.environ``, and then,
            when this process has imported TensorFlow and it lists GPUs, its configuration
            (``tf.config.set_visible_devices``, logical GPUs) applies too.

    Returns:
        The readings, in the order of the text.

    Raises:
        ArgumentError: ``text`` is not a str or ``environ`` not a mapping, a line does not
            have the seven columns, a value is not a number, or a GPU index appears twice.
    """
    if not isinstance(text, str):
        fix = "decode it first (text.decode())" if isinstance(text, bytes | bytearray) else (
            "pass nvidia-smi's output as one str"
        )
        raise ArgumentError(f"text={_short(text)} is of type {type(text).__name__}; {fix}")
    if environ is not None and not isinstance(environ, Mapping):
        raise ArgumentError(
            f"environ={environ!r} is of type {type(environ).__name__}; pass a mapping of "
            "environment variables (os.environ or a dict), or None for this process's"
        )
    readings: list[GpuReading] = []
    seen: set[int] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            reading = _parse_line(line)
        except ValueError as err:
            raise ArgumentError(f"line {number} {err}: {_quote(line)}") from None
        if reading is None:
            continue
        if reading.index in seen:
            raise ArgumentError(
                f"line {number} repeats GPU index {reading.index}: {_quote(line)}; "
                "pass the output of one nvidia-smi call"
            )
        seen.add(reading.index)
        readings.append(reading)
    if environ is None:
        names = _gpu_ids.tf_device_names(readings, os.environ, _gpu_ids.this_process_logical_gpus())
    else:
        names = _gpu_ids.tf_device_names(readings, environ)
    return [dataclasses.replace(r, device=None, devices=names.get(r.index, ())) for r in readings]


def _parse_line(line: str) -> GpuReading | None:
    """Parses one CSV line; returns None for a header line."""
    fields = [f.strip() for f in line.split(",")]
    if fields[0].lower() == "index":
        return None
    if len(fields) < len(_QUERY_FIELDS):
        raise ValueError(
            f"has {len(fields)} comma-separated fields, expected {len(_QUERY_FIELDS)} "
            f"({', '.join(_QUERY_FIELDS)})"
        )
    # A product name could hold a comma; the numeric columns cannot.
    name = ", ".join(fields[2:-4])
    index_text, uuid = fields[0], fields[1]
    if not (index_text.isascii() and index_text.isdigit()):
        raise ValueError(f"has GPU index {index_text!r}, expected a whole number")
    gpu, mem, used, total = fields[-4:]
    return GpuReading(
        index=int(index_text),
        uuid=None if _missing(uuid) else uuid,
        name=None if _missing(name) else name,
        utilization_gpu=_number(gpu, "%", "utilization.gpu"),
        utilization_memory=_number(mem, "%", "utilization.memory"),
        memory_used_mib=_whole(_number(used, "MiB", "memory.used")),
        memory_total_mib=_whole(_number(total, "MiB", "memory.total")),
    )


def _missing(value: str) -> bool:
    # The driver writes "[N/A]", "[Not Supported]", "[Unknown Error]", ... for values it
    # cannot give; older drivers wrote "N/A" without brackets.
    return (value.startswith("[") and value.endswith("]")) or value == "N/A"


def _number(value: str, unit: str, field: str) -> float | None:
    if _missing(value):
        return None
    if value.endswith(unit):
        value = value[: -len(unit)].rstrip()
    if not _NUMBER.fullmatch(value):
        raise ValueError(f"has {field} {value!r}, expected a number (in {unit}) or [N/A]")
    return float(value)


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


# --- running nvidia-smi ----------------------------------------------------------------


def query(
    nvidia_smi: str | os.PathLike[str] | None = None, *, timeout: float = _DEFAULT_TIMEOUT_S
) -> list[GpuReading]:
    """Runs ``nvidia-smi`` once and returns one reading per GPU.

    Args:
        nvidia_smi: The executable to run; defaults to ``$TFSHARD_NVIDIA_SMI``, then
            ``nvidia-smi`` on ``PATH``.
        timeout: Seconds to wait before ``nvidia-smi`` is killed and counted as hung. It
            runs in its own session, and the kill reaches every process it (or a wrapper
            script given as ``nvidia_smi``) started.

    Returns:
        The readings in ``nvidia-smi`` order, with `GpuReading.device` set for this
        process's ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``. Empty when the driver
        lists no GPU.

    Raises:
        ArgumentError: ``nvidia_smi`` is not a str or ``os.PathLike`` path, or ``timeout``
            is not a positive number.
        UtilizationError: No ``nvidia-smi`` was found (no NVIDIA driver), it failed, hung or
            printed something that is not the expected CSV. The message quotes its output.
    """
    check_executable(nvidia_smi)
    check_positive("timeout", timeout)
    command = [_find_executable(nvidia_smi), *_QUERY_ARGS]
    shown = shlex.join(command)
    try:
        done = _run(command, timeout)
    except subprocess.TimeoutExpired as err:
        raise UtilizationError(
            f"`{shown}` did not answer within {timeout:g} s and was killed; the driver may be "
            f"stuck (a GPU in a bad state, or a driver being reloaded){_outputs(err)}"
        ) from None
    except OSError as err:
        raise UtilizationError(f"could not run `{shown}`: {err}") from None
    if done.returncode != 0:
        output = f"{done.stdout}\n{done.stderr}"
        remedy = ""
        if "version mismatch" in output.lower():
            remedy = (
                "; the kernel module and the user-space driver differ, usually after a driver "
                "upgrade: reboot, or reload the nvidia kernel modules"
            )
        raise UtilizationError(
            f"`{shown}` failed with exit status {done.returncode}{remedy}{_outputs(done)}"
        )
    try:
        return parse(done.stdout)
    except ArgumentError as err:
        raise UtilizationError(
            f"`{shown}` printed output tfshard cannot read ({err}){_outputs(done)}"
        ) from None


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs ``command`` in a new session; on timeout kills all of it and reaps ``command``.

    A wrapper script around nvidia-smi, or nvidia-smi's own helpers, would survive a kill of
    the direct child alone, one per failed call; the session's process group holds them all.
    """
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="replace",
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException:  # the timeout, or KeyboardInterrupt while waiting
            # Gone already when it and all it started ended in between.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _find_executable(nvidia_smi: str | os.PathLike[str] | None) -> str:
    if nvidia_smi is not None:
        candidate, source = os.fspath(nvidia_smi), "the nvidia_smi argument"
    elif os.environ.get(_ENV_EXECUTABLE):
        candidate, source = os.environ[_ENV_EXECUTABLE], f"${_ENV_EXECUTABLE}"
    else:
        candidate, source = "nvidia-smi", None
    found = shutil.which(candidate)
    if found is not None:
        return found
    if source is None:
        raise UtilizationError(
            "no NVIDIA driver found: `nvidia-smi` is not on PATH. Install the NVIDIA driver "
            "for your GPU (it ships nvidia-smi; in a container, run it with --gpus all and "
            f"the NVIDIA Container Toolkit), or set {_ENV_EXECUTABLE} to the path of "
            "nvidia-smi. Without an NVIDIA GPU there is no GPU utilisation to measure."
        )
    raise UtilizationError(
        f"{source} is {candidate!r}, which is not an executable file on this machine; "
        "give the path of nvidia-smi (it comes with the NVIDIA driver)"
    )


def _outputs(result: subprocess.CompletedProcess[str] | subprocess.TimeoutExpired) -> str:
    parts = []
    for label, value in (("stdout", result.stdout), ("stderr", result.stderr)):
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if value and value.strip():
            parts.append(f"{label}: {_quote(value)}")
    return ". It printed " + "; ".join(parts) if parts else ". It printed nothing"


def _short(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:80] + "..."


def _quote(text: str) -> str:
    text = text.strip()
    if len(text) > _QUOTE_LIMIT:
        text = text[:_QUOTE_LIMIT] + "..."
    return repr(text)


# --- sampling in the background --------------------------------------------------------


class _Running:
    """Mean, min and max of the values seen so far, ignoring the driver's None."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.low: float | None = None
        self.high: float | None = None

    def add(self, value: float | None) -> None:
        if value is None:
            return
        self.total += value
        self.count += 1
        self.low = value if self.low is None else min(self.low, value)
        self.high = value if self.high is None else max(self.high, value)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


class _Stats:
    """Running aggregates of one GPU, so a long run does not keep every reading."""

    def __init__(self, first: GpuReading) -> None:
        self.last = first
        self.samples = 0
        self.gpu = _Running()
        self.mem = _Running()
        self.used = _Running()

    def add(self, reading: GpuReading) -> None:
        self.last = reading
        self.samples += 1
        self.gpu.add(reading.utilization_gpu)
        self.mem.add(reading.utilization_memory)
        self.used.add(reading.memory_used_mib)

    def summary(self) -> GpuSummary:
        last = self.last
        return GpuSummary(
            index=last.index,
            uuid=last.uuid,
            name=last.name,
            device=last.device,
            devices=last.devices,
            samples=self.samples,
            utilization_gpu_mean=self.gpu.mean,
            utilization_gpu_min=self.gpu.low,
            utilization_gpu_max=self.gpu.high,
            utilization_memory_mean=self.mem.mean,
            utilization_memory_max=self.mem.high,
            memory_used_peak_mib=_whole(self.used.high),
            memory_total_mib=last.memory_total_mib,
        )


class Monitor:
    """Samples GPU utilisation in a background thread while a ``with`` block runs.

    On entry it runs ``nvidia-smi`` once, so a missing driver or an unknown entry in
    ``devices`` fails before the body starts; that reading predates the body and is not
    counted. The thread then samples every ``interval`` seconds (at most; a slow
    ``nvidia-smi`` stretches it), and one last sample is taken on exit, so every GPU has at
    least one sample. On exit the thread is stopped and joined, also when the body raises.
    A sampling failure in the thread is raised on exit as `UtilizationError`; when the body
    raised too, the body's exception propagates with a note about the sampling failure.

    >>> monitor = Monitor(interval=0.5, devices=["GPU:0"])
    >>> monitor.summaries  # filled in while a with-block runs, readable afterwards
    []

    Usage::

        with tfshard.utilization.Monitor() as monitor:
            train(steps=1000)
        for summary in monitor.summaries:
            print(summary.device, summary.utilization_gpu_mean)

    Args:
        interval: Seconds between samples.
        devices: The GPUs to follow, default all: ``nvidia-smi`` indices (``0``, ``"0"``),
            UUIDs or UUID prefixes (``"GPU-8f3a"``), or TensorFlow names (``"GPU:1"``,
            ``"/device:GPU:1"``). One spec or a sequence of them.
        nvidia_smi: The executable, as in `query`.
        timeout: Seconds before one ``nvidia-smi`` call counts as hung, as in `query`.

    Raises:
        ArgumentError: ``interval`` or ``timeout`` is not positive, ``nvidia_smi`` is not a
            path (as in `query`), or ``devices`` is or holds something that is not a device
            spec (bytes included). On entry: a spec that names no GPU.
        UtilizationError: On entry or exit, as `query` raises, or the Monitor is already
            running.
    """

    def __init__(
        self,
        interval: float = 0.5,
        devices: _gpu_ids.DeviceSpec | Sequence[_gpu_ids.DeviceSpec] | None = None,
        *,
        nvidia_smi: str | os.PathLike[str] | None = None,
        timeout: float = _DEFAULT_TIMEOUT_S,
    ) -> None:
        check_positive("interval", interval)
        check_positive("timeout", timeout)
        check_executable(nvidia_smi)
        self._interval = float(interval)
        self._specs = _gpu_ids.device_specs(devices)
        self._nvidia_smi = nvidia_smi
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        self._stats: dict[int, _Stats] = {}
        # Bumped by _discard_samples, so a reading already in flight then is dropped too.
        self._generation = 0
        self._selected: frozenset[int] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def summaries(self) -> list[GpuSummary]:
        """One summary per followed GPU, in ``nvidia-smi`` order; live while running."""
        with self._lock:
            return [self._stats[i].summary() for i in sorted(self._stats)]

    def __enter__(self) -> Monitor:
        if self._thread is not None:
            raise UtilizationError("this Monitor is already running; use a new Monitor to nest")
        probe = query(self._nvidia_smi, timeout=self._timeout)
        selected = _gpu_ids.select(probe, self._specs)
        with self._lock:
            self._stats = {}
            self._selected = selected
        self._error = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join()
        if exc is not None:
            # The body's error is the one to see; the sampling failure rides along as a note
            # (notes exist from Python 3.11; on 3.10 it is dropped).
            if self._error is not None and sys.version_info >= (3, 11):
                exc.add_note(f"tfshard.utilization.Monitor: sampling also failed: {self._error}")
            return
        if self._error is None:
            try:
                self._sample()
            except UtilizationError as err:
                self._error = err
        if self._error is not None:
            taken = sum(s.samples for s in self._stats.values())
            raise UtilizationError(
                f"sampling GPU utilisation failed after {taken} readings: {self._error}"
            ) from self._error

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._sample()
            except Exception as err:  # any failure, kept for __exit__ to raise, not lost
                self._error = err
                return

    def _sample(self) -> None:
        generation = self._generation
        readings = query(self._nvidia_smi, timeout=self._timeout)
        with self._lock:
            if generation != self._generation:
                return
            for reading in readings:
                if reading.index in self._selected:
                    self._stats.setdefault(reading.index, _Stats(reading)).add(reading)

    def _discard_samples(self) -> None:
        """Forgets what was sampled so far (check() drops its warm-up this way)."""
        with self._lock:
            self._stats = {}
            self._generation += 1


# --- the verdict -----------------------------------------------------------------------


def check(
    fn: Callable[..., Any] | None = None,
    *args: Any,
    threshold: float = DEFAULT_THRESHOLD,
    duration: float = 5.0,
    interval: float = 0.5,
    devices: _gpu_ids.DeviceSpec | Sequence[_gpu_ids.DeviceSpec] | None = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
) -> list[Verdict]:
    """Measures whether ``fn`` keeps each GPU busy enough that more GPUs can help.

    With ``fn``, calls ``fn(*args)`` once to warm up (tracing and autotuning are not the
    steady state; that call is not measured), then again and again for ``duration`` seconds
    (at least once) under a `Monitor`. Without ``fn``, samples for ``duration`` seconds
    whatever already runs on the GPUs (another process, a training job). A GPU is busy when
    its mean utilisation is at least ``threshold``. Use ``functools.partial`` for keyword
    arguments of ``fn``.

    Args:
        fn: The function to measure, or None to only sample.
        *args: Positional arguments of ``fn``.
        threshold: Percent of mean utilisation that counts as busy, 0 to 100.
        duration: Seconds to measure for; a few seconds or more gives a stable mean.
        interval: Seconds between samples.
        devices: The GPUs to judge, as in `Monitor`; default all.
        nvidia_smi: The executable, as in `query`.

    Returns:
        One verdict per GPU, in ``nvidia-smi`` order.

    Raises:
        ArgumentError: ``fn`` is not callable, ``threshold`` is outside 0..100,
            ``duration`` is negative, or as `Monitor` raises.
        UtilizationError: As `query` raises, before ``fn`` first runs when no driver is
            found.
    """
    if fn is not None and not callable(fn):
        raise ArgumentError(f"fn={fn!r} is not callable; pass a function, or None to sample")
    if fn is None and args:
        raise ArgumentError(f"arguments {args!r} were given without fn; pass fn first")
    check_threshold(threshold)
    if isinstance(duration, bool) or not (
        isinstance(duration, int | float) and 0 <= duration < math.inf
    ):
        raise ArgumentError(f"duration={duration!r}; give the seconds to measure, >= 0")
    with Monitor(interval, devices, nvidia_smi=nvidia_smi) as monitor:
        if fn is None:
            time.sleep(duration)
        else:
            fn(*args)
            monitor._discard_samples()
            end = time.monotonic() + duration
            fn(*args)
            while time.monotonic() < end:
                fn(*args)
    return [_verdict(summary, threshold) for summary in monitor.summaries]


def _verdict(summary: GpuSummary, threshold: float) -> Verdict:
    mean = summary.utilization_gpu_mean
    if mean is None:
        return Verdict(
            summary,
            busy=False,
            reason="the driver reports no utilisation for this GPU ([N/A] or [Not Supported], "
            "as in MIG mode)",
            hint="measure SM activity with NVIDIA DCGM (dcgmi dmon) or Nsight Systems instead",
        )
    spread = (
        f"(min {summary.utilization_gpu_min:g} %, max {summary.utilization_gpu_max:g} %, "
        f"{summary.samples} samples)"
    )
    if mean >= threshold:
        return Verdict(
            summary,
            busy=True,
            reason=f"mean utilisation {mean:.1f} % meets the {threshold:g} % threshold {spread}",
            hint="one GPU is kept busy, so more GPUs can take real work: shard the batch "
            "across them with tfshard.parallelize",
        )
    reason = f"mean utilisation {mean:.1f} % is below the {threshold:g} % threshold {spread}"
    assert summary.utilization_gpu_max is not None  # set whenever the mean is
    if summary.utilization_gpu_max >= threshold:
        hint = (
            "the GPU works in bursts and waits in between, so a second GPU would wait too: "
            "move input preprocessing off the critical path (tf.data with "
            ".prefetch(tf.data.AUTOTUNE)) and keep logs and metrics on the device instead of "
            "calling .numpy() every step"
        )
    else:
        hint = (
            "each step is too small to fill the GPU, so a second GPU would mostly wait too: "
            "raise the per-device batch size, and keep logs and metrics on the device"
        )
    return Verdict(summary, busy=False, reason=reason, hint=hint)


# The three checks below are shared with the command line.


def check_executable(nvidia_smi: object) -> None:
    if nvidia_smi is None or isinstance(nvidia_smi, str):
        return
    if isinstance(nvidia_smi, os.PathLike) and isinstance(os.fspath(nvidia_smi), str):
        return
    raise ArgumentError(
        f"nvidia_smi={nvidia_smi!r} is of type {type(nvidia_smi).__name__}; give the path of "
        "nvidia-smi as a str or os.PathLike (a bytes path decoded to str), or None for "
        f"${_ENV_EXECUTABLE}, then PATH"
    )


def check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, int | float) and 0 < value < math.inf):
        raise ArgumentError(f"{name}={value!r}; give a positive number of seconds")


def check_threshold(threshold: float) -> None:
    if isinstance(threshold, bool) or not (
        isinstance(threshold, int | float) and 0 <= threshold <= 100
    ):
        raise ArgumentError(f"threshold={threshold!r}; give a percentage from 0 to 100")


# --- the table ----------------------------------------------------------------------


def format_table(readings: Iterable[GpuReading], threshold: float = DEFAULT_THRESHOLD) -> str:
    """Formats readings as the table ``python -m tfshard.utilization`` prints.

    >>> reading = GpuReading(0, "GPU-8f3a", "NVIDIA A100-SXM4-40GB", 93.0, 41.0, 15012, 40960,
    ...                      "/device:GPU:0")
    >>> print(format_table([reading]))
    gpu  tf device      name                   util %  mem util %  memory MiB     vs 90 %
      0  /device:GPU:0  NVIDIA A100-SXM4-40GB      93          41  15012 / 40960  ok

    Args:
        readings: The readings to show.
        threshold: The utilisation bar, in percent, for the last column.

    Returns:
        The table, one line per GPU under a header line, without a final newline.

    Raises:
        ArgumentError: ``readings`` is not an iterable of `GpuReading`, or ``threshold`` is
            not a percentage from 0 to 100.
    """
    check_threshold(threshold)
    if isinstance(readings, str | bytes | Mapping | GpuReading) or not _iterable(readings):
        raise ArgumentError(
            f"readings={readings!r} is of type {type(readings).__name__}; pass a list of "
            "GpuReading (what query or parse returns)"
        )
    readings = list(readings)
    for reading in readings:
        if not isinstance(reading, GpuReading):
            raise ArgumentError(
                f"readings holds {reading!r} of type {type(reading).__name__}; pass a list of "
                "GpuReading (what query or parse returns)"
            )
    rows = [
        ("gpu", "tf device", "name", "util %", "mem util %", "memory MiB", f"vs {threshold:g} %")
    ]
    for r in readings:
        if r.utilization_gpu is None:
            status = "n/a"
        else:
            status = "ok" if r.utilization_gpu >= threshold else "below"
        rows.append(
            (
                str(r.index),
                ", ".join(r.devices) or "-",
                r.name or "?",
                _show(r.utilization_gpu),
                _show(r.utilization_memory),
                f"{_show(r.memory_used_mib)} / {_show(r.memory_total_mib)}",
                status,
            )
        )
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    right = {0, 3, 4}  # numbers line up on the right
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if col in right else cell.ljust(width)
            for col, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _iterable(value: object) -> bool:
    try:
        iter(value)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def _show(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"
