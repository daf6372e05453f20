"""One worker process per device, for work that cannot live in one graph.

`tfshard.parallelize` runs one traced graph across devices. Some work does not
fit in one graph: independent models with their own optimizers, Python-side
loops, libraries that hold a device for themselves. `run_per_device` runs such
work in one process per device instead::

    def train(seed, steps):             # runs in a fresh process; its GPU is GPU:0
        ...
        return final_loss

    losses = tfshard.processes.run_per_device(
        train, [0, 1, 2, 3], shared={"steps": 1000}, devices=["gpu:0", "gpu:1", "cpu", "cpu"]
    )

How it works, and why:

- Workers start with the ``spawn`` method, never ``fork``: a forked copy of a
  process that has imported TensorFlow inherits its threads' locks and its
  CUDA state half-made, and hangs or crashes.
- Each worker sees only its own GPU: ``CUDA_VISIBLE_DEVICES`` is set in the
  worker's environment before it starts, so before it imports TensorFlow, and
  its GPU is ``GPU:0`` inside the worker. A ``"cpu"`` worker gets
  ``CUDA_VISIBLE_DEVICES=""`` and sees no GPU.
- ``"gpu:k"`` is the parent's logical GPU k, as ``tf.config`` describes it
  before the runtime starts: after ``tfshard.virtual_devices`` splits a GPU or
  ``tf.config.set_visible_devices`` hides some, logical GPU k is mapped to its
  physical GPU and that GPU's entry in the parent's ``CUDA_VISIBLE_DEVICES``
  (its CUDA index when the variable is unset). A worker whose logical GPU has
  a memory limit gives its ``GPU:0`` that limit before ``fn`` runs (importing
  TensorFlow to do so). When two or more workers share a physical GPU and
  have no memory limit, each gets ``TF_FORCE_GPU_ALLOW_GROWTH=true``, so each
  TensorFlow takes memory as it needs it instead of nearly all of the GPU at
  start, which would leave the next worker none.
- Each worker finds the packages this process found, however it found them,
  and so do the Python processes it starts (`child_environ`).
- Each worker sends back its result, or its exception and traceback, through
  its own pipe. The first failure, an exit without a result, or the timeout
  stops every other worker (SIGTERM, then SIGKILL ``grace`` seconds later)
  and raises `WorkerError` naming the worker's device. No worker outlives the
  call, also on Ctrl-C, and neither does a process a worker started: each
  worker leads its own session (``os.setsid``), out of reach of a terminal's
  Ctrl-C, and the parent signals its whole process group (POSIX only).

`fn`, the arguments and the results travel by pickle: `fn` must be a function
defined at the top level of an importable module (or of the script being run,
under ``if __name__ == "__main__":``), not a lambda or a nested function.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from tfshard import _device_names, _gpu_ids, pinning
from tfshard.errors import ArgumentError, DeviceError, WorkerError

__all__ = (
    "Placement",
    "WorkerError",
    "child_environ",
    "limit_gpu_memory",
    "placements",
    "run_per_device",
)

_log = logging.getLogger("tfshard")

_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
_PYTHONPATH_ENV = "PYTHONPATH"
_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"
# How long a stopped (SIGTERM) worker may take to exit before it is killed, and
# how long a worker that reported its result may take to exit by itself: the default of
# run_per_device's grace=.
_GRACE_S = 5.0
# Workers are spawned one at a time while CUDA_VISIBLE_DEVICES is swapped. Module
# state because what it guards is: os.environ is the process's, and a spawned
# worker inherits it, so two threads calling run_per_device share this lock.
_spawn_lock = threading.Lock()


class Placement(NamedTuple):
    """Where one worker of `run_per_device` runs, and the environment that shows it
    only its device (`placements` lists them)."""

    label: str  # what the user gave, for messages
    visible: str  # the worker's CUDA_VISIBLE_DEVICES
    # Variables set in the worker's environment, CUDA_VISIBLE_DEVICES among them.
    environ: Mapping[str, str]
    # The memory limit the worker gives its GPU:0: that of the logical GPU it was given.
    memory_limit_mb: int | None = None


def placements(
    count: int, devices: Sequence[_device_names.DeviceSpecLike] | None = None
) -> list[Placement]:
    """Where `run_per_device` runs `count` workers on `devices`, without starting any.

    Args:
      count: the number of workers, an int >= 1 (a NumPy integer is one).
      devices: as `run_per_device` takes them: None, or one device per worker.

    Returns:
      One `Placement` per worker, in order.

    Raises:
      ArgumentError: `count` or `devices` has the wrong type or length.
      DeviceError: a device is not a local GPU or the CPU, or does not exist.
    """
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
        raise ArgumentError(f"count={count!r}: give the number of workers, an int >= 1")
    count = int(count)
    _check_devices(devices, count, "count is")
    return _placements(devices, count)


def _placements(devices: Sequence[Any] | None, count: int) -> list[Placement]:
    """Where each worker runs, and the environment that shows it only its device.

    ``devices`` is None or has ``count`` entries (`_check_devices` saw to it).
    """
    layout = _gpu_ids.logical_gpus(tf)
    gpus = len(layout)
    if devices is None:
        if not gpus:
            _log.info("no GPU: the %d worker(s) run on the CPU", count)
            return [Placement("cpu", "", {_VISIBLE_ENV: ""})] * count
        if gpus < count:
            raise DeviceError(
                f"{count} workers but this process has {gpus} GPU(s); pass devices= with "
                "one device per worker (a GPU may be named twice, or use 'cpu')"
            )
        devices = [f"gpu:{i}" for i in range(count)]
    indices: list[int | None] = []
    for position, spec in enumerate(devices):
        name = pinning.context_name(spec)
        text = spec if name is None else pinning.active_contexts()[name]
        index = _gpu_index(text, position, spec)
        if index is not None and index >= gpus:
            raise DeviceError(
                f"devices[{position}]={spec!r}: this process has {gpus} GPU(s); use 'cpu' "
                "for a worker on the CPU"
            )
        indices.append(index)
    return _gpu_placements(devices, indices, layout)


def _gpu_placements(
    devices: Sequence[Any], indices: Sequence[int | None], layout: Sequence[_gpu_ids.LogicalGpu]
) -> list[Placement]:
    """Maps logical GPU k to its physical GPU, then to the parent's entry for it."""
    entries = _gpu_ids.cuda_visible_entries(os.environ)
    physical = [None if i is None else layout[i].physical for i in indices]
    placements = []
    for spec, index, ordinal in zip(devices, indices, physical):
        if index is None or ordinal is None:
            placements.append(Placement(str(spec), "", {_VISIBLE_ENV: ""}))
            continue
        visible = entries[ordinal] if entries is not None else str(ordinal)
        environ = {_VISIBLE_ENV: visible}
        limit = layout[index].memory_limit_mb
        if limit is None and physical.count(ordinal) > 1:
            # Each TensorFlow takes nearly all of a GPU's memory at start; the second
            # worker on it would fail to allocate.
            environ[_GROWTH_ENV] = "true"
        placements.append(Placement(str(spec), visible, environ, limit))
    return placements


def _gpu_index(text: Any, position: int, spec: Any) -> int | None:
    """The GPU index a worker device names, or None for the CPU."""
    if isinstance(text, tf.config.LogicalDevice):
        text = text.name
    elif isinstance(text, tf.DeviceSpec):
        text = text.to_string()
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ArgumentError(
            f"devices[{position}]={spec!r} is a {type(spec).__name__}; give a GPU ('gpu:1', "
            "'cuda1', 1), 'cpu', or a context name"
        )
    if isinstance(text, int):
        if text < 0:
            raise ArgumentError(
                f"devices[{position}]={spec!r}: a GPU index is >= 0; use 'cpu' for the CPU"
            )
        return text
    # Read as resolve_device reads it, but only the local spellings.
    parsed = _device_names.parse_spec(text.strip())
    if parsed is not None and _device_names.is_local_job(parsed.job):
        if parsed.device_type == "CPU":
            return None
        if parsed.device_type == "GPU":
            return parsed.device_index
    raise DeviceError(
        f"devices[{position}]={spec!r} is not a local device for a worker; use a GPU "
        "('gpu:1', 'cuda1', 1), 'cpu', or a context name that maps to one"
    )


def _worker_main(
    conn: multiprocessing.connection.Connection,
    fn: Callable[..., Any],
    arg: Any,
    shared: Mapping[str, Any],
    memory_limit_mb: int | None = None,
) -> None:
    """The body of a worker process: run, then send one pickled report.

    It first leads a new session, so its process group holds every process
    it starts and the parent can end them all (`_stop`).
    """
    os.setsid()
    try:
        if memory_limit_mb is not None:
            limit_gpu_memory(memory_limit_mb)
        report = pickle.dumps(("ok", fn(arg, **shared)))
    except BaseException as error:  # noqa: BLE001 - every failure goes to the parent.
        summary = f"{type(error).__name__}: {error}"
        report = pickle.dumps(("error", summary, traceback.format_exc()))
    conn.send_bytes(report)
    conn.close()


def limit_gpu_memory(memory_limit_mb: int) -> None:
    """Gives this process's GPU:0 a memory limit; nothing when it sees no GPU.

    A worker started from a `Placement` calls it with the placement's
    ``memory_limit_mb`` before ``fn`` runs. Like `tfshard.virtual_devices`, it
    must run before TensorFlow starts its runtime.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        config = tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
        tf.config.set_logical_device_configuration(gpus[0], [config])


def run_per_device(
    fn: Callable[..., Any],
    per_device_args: Sequence[Any],
    *,
    shared: Mapping[str, Any] | None = None,
    devices: Sequence[_device_names.DeviceSpecLike] | None = None,
    timeout: float | None = None,
    grace: float = _GRACE_S,
    on_start: Callable[[int, int], Any] | None = None,
) -> list[Any]:
    """Runs ``fn(per_device_args[i], **shared)`` in one new process per device.

    Worker ``i`` runs on ``devices[i]``. It is a fresh Python process (``spawn``)
    whose ``CUDA_VISIBLE_DEVICES`` shows it only its own GPU, which it sees as
    ``GPU:0`` (``tfshard.try_gpu()`` returns it); a CPU worker sees no GPU.
    The workers run at the same time and are independent: each imports
    TensorFlow itself (seconds each) and builds its own models.

    Args:
      fn: a picklable function (defined at the top level of a module) of one
        worker's argument and the shared keyword arguments. Its return value
        must be picklable.
      per_device_args: one argument per worker; their number is the number of
        workers.
      shared: keyword arguments passed to every worker.
      devices: one device per worker: a GPU (``"gpu:1"``, ``"cuda1"``, ``1``,
        or a context name mapped to one), or ``"cpu"``. A device may appear
        more than once. Default: GPU ``i`` for worker ``i``, or the CPU for
        every worker on a machine without GPUs.
      timeout: seconds the workers may take once every one has started (and
        `on_start` returned), a finite number > 0; None for no limit.
      grace: seconds a worker gets to exit by itself, after it reported its
        result and again after SIGTERM, before it is killed; a finite number >= 0.
      on_start: called in this process as each worker starts, with the
        worker's index and process id (to log it, or find it in
        ``nvidia-smi``'s list of processes); it may wait for what the worker
        does first. What it raises stops every worker and is raised.

    Returns:
      The workers' return values, in `per_device_args` order.

    Raises:
      ArgumentError: an argument has the wrong type or value (the message names
        it and the fix), checked before any worker starts; or `fn` or the
        arguments cannot be pickled.
      DeviceError: a device is not a local GPU or the CPU, or does not exist.
      WorkerError: a worker raised (the message has its device and traceback),
        exited without a result, or the timeout passed. Every other worker has
        been stopped by then.
      KeyboardInterrupt: Ctrl-C; every worker has been stopped by then (a
        second Ctrl-C kills those still running at once).
    """
    shared, timeout = _check_arguments(fn, per_device_args, shared, devices, timeout, grace)
    if on_start is not None and not callable(on_start):
        raise ArgumentError(
            f"on_start={on_start!r} is not callable; pass a function of (index, pid), or None"
        )
    count = len(per_device_args)
    placements = _placements(devices, count)
    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    readers: list[multiprocessing.connection.Connection] = []
    finished = False
    try:
        for i, (arg, placement) in enumerate(zip(per_device_args, placements)):
            reader, writer = context.Pipe(duplex=False)
            readers.append(reader)
            process = context.Process(
                target=_worker_main,
                args=(writer, fn, arg, shared, placement.memory_limit_mb),
                name=f"tfshard-worker-{i}",
            )
            processes.append(process)
            try:
                _start(process, placement, i)
            finally:
                writer.close()  # The worker holds the other end; EOF then means it died.
            if on_start is not None:
                on_start(i, process.pid)
        deadline = None if timeout is None else time.monotonic() + timeout
        results = _collect(processes, readers, placements, deadline, timeout, grace)
        finished = True
        return results
    finally:
        try:
            _stop(processes, wait=finished, grace=grace)
        finally:
            for reader in readers:
                reader.close()


def _check_arguments(
    fn: Any, per_device_args: Any, shared: Any, devices: Any, timeout: Any, grace: Any
) -> tuple[dict[str, Any], float | None]:
    """Checks run_per_device's arguments before any worker starts: ``shared`` (a dict), timeout."""
    if not callable(fn):
        raise ArgumentError(
            f"fn={fn!r} is not callable; pass a function defined at the top level of a module"
        )
    if isinstance(per_device_args, str | bytes) or not isinstance(per_device_args, Sequence):
        raise ArgumentError(
            f"per_device_args={per_device_args!r} is a {type(per_device_args).__name__}; "
            "pass a list with one argument per worker (list(x) for an array or a generator)"
        )
    if not per_device_args:
        raise ArgumentError("per_device_args is empty; give one argument per worker")
    if shared is not None and not isinstance(shared, Mapping):
        raise ArgumentError(
            f"shared={shared!r} is a {type(shared).__name__}; pass a dict of the keyword "
            "arguments every worker gets, e.g. shared={'steps': 100}"
        )
    shared = dict(shared or {})
    bad_keys = [k for k in shared if not isinstance(k, str) or not k.isidentifier()]
    if bad_keys:
        raise ArgumentError(
            f"shared has keys {bad_keys!r}; its keys are keyword-argument names of fn, like 'steps'"
        )
    _check_devices(devices, len(per_device_args), "per_device_args has")
    if isinstance(grace, bool) or not isinstance(grace, numbers.Real) or not 0 <= grace < math.inf:
        raise ArgumentError(
            f"grace={grace!r}: give the seconds a worker gets to exit before it is killed, "
            "a finite number >= 0"
        )
    if timeout is None:
        return shared, None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ArgumentError(
            f"timeout={timeout!r} is a {type(timeout).__name__}; give the seconds as a "
            "number > 0, or None for no limit"
        )
    if not 0 < timeout < math.inf:
        raise ArgumentError(
            f"timeout={timeout!r}: give a finite number of seconds > 0, or None for no limit"
        )
    return shared, timeout


def _check_devices(devices: Any, count: int, counted: str) -> None:
    """`devices` is None or a sequence of `count` entries (`counted` says whose count)."""
    if devices is None:
        return
    if isinstance(devices, str | bytes | int) or not isinstance(devices, Sequence):
        raise ArgumentError(
            f"devices={devices!r}: pass a list with one device per worker, e.g. ['gpu:0', 'cpu']"
        )
    if len(devices) != count:
        raise ArgumentError(
            f"devices has {len(devices)} entries but {counted} {count}; give one device per worker"
        )


def child_environ(
    first: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """`environ` (default: this process's) for a Python child that imports what this one does.

    A child started with ``sys.executable`` finds its interpreter's own packages (a venv's
    site-packages, a ``pip install -e`` through its ``.pth``) by itself, and PYTHONPATH's
    entries while it inherits the variable. It does not find what this process added to
    ``sys.path`` at run time (a script's ``sys.path.insert``, a test runner's root), nor a
    PYTHONPATH entry that a caller's own PYTHONPATH replaced. So the child's PYTHONPATH is
    `first`, then every entry of this process's ``sys.path`` outside its interpreter's own
    prefixes (made absolute: ``''`` is this process's working directory), then the
    PYTHONPATH `environ` had, each entry once. The interpreter's own directories stay out: a
    child running another Python must not import this one's standard library.

    Args:
      first: entries to put first (a test puts its checkout there).
      environ: the variables to start from; default ``os.environ``.

    Returns:
      A new dict: `environ` with PYTHONPATH set.
    """
    environ = dict(os.environ if environ is None else environ)
    prefixes = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    }
    entries = [os.path.abspath(p) for p in first]
    for entry in sys.path:
        path = os.path.abspath(entry or os.curdir)
        real = os.path.realpath(path)
        if not any(real == p or real.startswith(p.rstrip(os.sep) + os.sep) for p in prefixes):
            entries.append(path)
    entries += environ.get(_PYTHONPATH_ENV, "").split(os.pathsep)
    environ[_PYTHONPATH_ENV] = os.pathsep.join(dict.fromkeys(e for e in entries if e))
    return environ


def _start(process: Any, placement: Placement, index: int) -> None:
    variables = {_PYTHONPATH_ENV: child_environ()[_PYTHONPATH_ENV], **placement.environ}
    with _spawn_lock:
        saved = {name: os.environ.get(name) for name in variables}
        os.environ.update(variables)
        try:
            process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise ArgumentError(
                f"worker {index}: fn, its argument and shared= must be picklable (fn a "
                f"function at the top level of a module, not a lambda or nested "
                f"function): {error}"
            ) from None
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value


def _where(i: int, count: int, placement: Placement) -> str:
    return f"worker {i} of {count} on {placement.label} ({_VISIBLE_ENV}={placement.visible!r})"


def _collect(
    processes: list[Any],
    readers: list[multiprocessing.connection.Connection],
    placements: list[Placement],
    deadline: float | None,
    timeout: float | None,
    grace: float,
) -> list[Any]:
    count = len(processes)
    results: list[Any] = [None] * count
    waiting = {id(reader): i for i, reader in enumerate(readers)}
    alive = {processes[i].sentinel: i for i in range(count)}
    while waiting:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            late = sorted(waiting.values())
            names = ", ".join(f"{i} ({placements[i].label})" for i in late)
            raise WorkerError(
                f"worker(s) {names} of {count} did not finish within timeout={timeout} s; "
                "all workers were stopped",
                index=late[0],
                device=placements[late[0]].label,
            )
        ready = multiprocessing.connection.wait(
            [readers[i] for i in waiting.values()] + list(alive), timeout=remaining
        )
        for obj in ready:
            if obj in alive:
                i = alive.pop(obj)
                if id(readers[i]) in waiting and not readers[i].poll():
                    raise _died(processes[i], i, count, placements[i], grace)
                continue  # Its report is in the pipe; read below or on the next turn.
            i = waiting.get(id(obj))
            if i is None:
                continue
            try:
                report = pickle.loads(readers[i].recv_bytes())
            except EOFError:
                raise _died(processes[i], i, count, placements[i], grace) from None
            except Exception as error:  # noqa: BLE001 - unpickling runs user code.
                raise WorkerError(
                    f"{_where(i, count, placements[i])} returned a result this process "
                    f"cannot unpickle: {type(error).__name__}: {error}",
                    index=i,
                    device=placements[i].label,
                ) from None
            del waiting[id(obj)]
            if report[0] == "error":
                _, summary, trace = report
                raise WorkerError(
                    f"{_where(i, count, placements[i])} failed: {summary}; the other "
                    f"workers were stopped. Worker traceback:\n{trace}",
                    index=i,
                    device=placements[i].label,
                    traceback=trace,
                )
            results[i] = report[1]
    return results


def _died(process: Any, i: int, count: int, placement: Placement, grace: float) -> WorkerError:
    process.join(grace)
    code = process.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        if code == -signal.SIGKILL:
            how += " (out of memory?)"
    else:
        how = f"exited with code {code}"
    return WorkerError(
        f"{_where(i, count, placement)} {how} before reporting a result (its stderr, "
        "above, may say why); the other workers were stopped",
        index=i,
        device=placement.label,
    )


def _stop(processes: list[Any], wait: bool, grace: float) -> None:
    """Ends every worker and what it started: SIGTERM, then SIGKILL.

    Each worker leads its own process group (`_worker_main`), so signalling
    the group also reaches the processes the worker started, which outlive
    the worker itself otherwise. With `wait` (every worker reported), the
    workers first get `grace` seconds to exit by themselves; what they leave
    running is ended all the same.

    A Ctrl-C while it waits skips the rest of that wait: during the workers'
    own exit it moves on to SIGTERM, during the grace after SIGTERM to
    SIGKILL at once. Whatever happens, every worker is killed, reaped and
    closed before it returns or raises, so nothing is left for
    multiprocessing's exit handler to join, which would block the exit of
    the interpreter on a worker that ignores SIGTERM.

    Raises:
      KeyboardInterrupt: a Ctrl-C came while it waited (after the kill).
    """
    started = [p for p in processes if p.pid is not None]
    groups = [p.pid for p in started]  # a group keeps its id while a member lives
    interrupted = False
    try:
        if wait:
            try:
                _wait_for_exit(started, [], time.monotonic() + grace)
            except KeyboardInterrupt:
                interrupted = True  # the user is done waiting: on to SIGTERM
        for process in started:
            if process.is_alive():
                process.terminate()  # also before the worker made its group
        for group in groups:
            _signal_group(group, signal.SIGTERM)
        _wait_for_exit(started, groups, time.monotonic() + grace)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        interrupted |= _kill(started, groups)
    if interrupted:
        raise KeyboardInterrupt


def _wait_for_exit(started: list[Any], groups: list[int], deadline: float) -> None:
    """Waits until the workers and every running member of `groups` exited, or the deadline."""
    for process in started:
        process.join(max(0.0, deadline - time.monotonic()))
    while _running_groups(groups) and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill(started: list[Any], groups: list[int]) -> bool:
    """SIGKILLs every worker and its group, then reaps and closes the workers.

    A Ctrl-C here starts it over rather than leave a worker unreaped: every
    step is quick, and repeating one is harmless.

    Returns:
      Whether a Ctrl-C came meanwhile, for the caller to raise it.
    """
    pending = list(started)
    interrupted = False
    while True:
        try:
            for process in pending:
                if process.is_alive():
                    process.kill()  # also a worker that has not made its group yet
            for group in groups:
                _signal_group(group, signal.SIGKILL)
            while pending:
                pending[0].join()  # reaped: multiprocessing forgets it
                pending.pop(0).close()
            return interrupted
        except KeyboardInterrupt:
            interrupted = True


def _signal_group(group: int, signum: int) -> bool:
    """Sends a signal to a process group; False when the group is gone."""
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _running_groups(groups: list[int]) -> list[int]:
    """The process groups among `groups` that have a member not yet exited.

    A member that exits after its worker becomes a zombie until init reaps
    it, which may take a while, or never happen in a container whose init
    does not reap, and a signal still reaches a zombie:
    `os.killpg(group, 0)` would keep a stopped group waiting the whole grace
    period. On Linux the members' states are read from ``/proc`` instead;
    elsewhere a zombie counts as running.
    """
    if not groups:
        return []
    if not sys.platform.startswith("linux"):
        return [g for g in groups if _signal_group(g, 0)]
    wanted = set(groups)
    running = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited while we looked
        group = int(fields[2])
        if group in wanted and fields[0] not in (b"Z", b"X"):
            running.add(group)
    return [g for g in groups if g in running]
