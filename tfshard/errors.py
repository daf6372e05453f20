"""The one family of errors tfshard raises, and the one reader of TensorFlow's error text.

Every error derives from `TfshardError`. Errors caused by bad input also derive
from `ValueError`, so code that already catches `ValueError` keeps working;
errors about the state of the machine (no driver, TensorFlow already started)
derive from `RuntimeError`.

Every error TensorFlow raises becomes tfshard's message here, and nowhere else:
the other modules hand over what they know (function, devices, rows, workers,
what is on disk), and only this module reads TF's error text.

It imports no TensorFlow (`tfshard.utilization` uses it without TF) and no
other tfshard module: what it needs from one comes in as an argument.
"""

from __future__ import annotations

import errno as errnos
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

# Frames in this folder are tfshard's own: a shard's error leaves them out.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

# The name scope of shard k's ops (``tfshard_shard_k/...``); `shard_in` reads it back.
SHARD_SCOPE = "tfshard_shard_"
# Marks the in-graph check that a whole-shard function returned one row per row.
ROWS_DIFFER = "tfshard: per-row output with the wrong number of rows:"
# Marks the in-graph check that split arguments have the same rows (inside a tf.function).
INPUTS_DIFFER = "tfshard: split arguments with different numbers of rows:"
# Marks the in-graph check that a stream's batch fits the caps of its devices.
OVER_CAPS = "tfshard: a batch of more rows than the caps of its devices hold:"
# The name scope of that check's ops in a stream's loop (never inside a shard's scope).
CAPS_SCOPE = "tfshard_within_caps"
_CAPS_NODE_RE = re.compile(r"(?:[^/]+/)*" + CAPS_SCOPE + r"(?:_\d+)?/Assert(?:_\d+)?")

# Nodes an error names: the failing one ({{node N}}), then context ([[N]]).
_ERROR_NODE_RE = re.compile(r"\{\{node ([^}]+)\}\}|\[\[([^\]{}\s]+)\]\]")
_IN_SHARD_RE = re.compile(r"(?:^|/)" + SHARD_SCOPE + r"(\d+)/")
_RECEIVE_RE = re.compile(r".*/_\d+")  # a receive the partitioner added, aborted with the step
# Each of several root errors: "  (0) INVALID_ARGUMENT: ...".
_ROOT_ERROR_RE = re.compile(r"^\s*\(\d+\) ([A-Z_]+):", re.MULTILINE)
# A failed `host_assert` prints its data: "[message :end (...)] [1 4] [4 4]".
_ASSERT_VECTOR_RE = re.compile(r"(?<=\] )\[(-?\d+(?: -?\d+)*)\]")
# What a remote error says about the workers: the task it called, a peer's address,
# and gRPC's own reason.
_REMOTE_TARGET_RE = re.compile(
    r"remote target /job:(?P<job>[A-Za-z][A-Za-z0-9_]*)/replica:\d+/task:(?P<task>\d+)"
)
_PEER_RE = re.compile(r"ipv[46]:(?P<address>\[[^\]]+\]:\d+|[^\s:\"]+:\d+)")
_GRPC_MESSAGE_RE = re.compile(r"grpc_message:\s*\"(?P<message>[^\"\\]*)")
_GRPC_STATUS_RE = re.compile(r"grpc_status:\s*(\d+)")
# XLA could not compile a function (jit_compile=True): TF says so once per function
# it was converting, and once per root error, with the stack of each.
_XLA_FAILURE_RE = re.compile(
    r"tf2xla conversion failed while converting"
    r"|Detected unsupported operations when trying to compile graph"
)
# The op XLA has no kernel for: "... compile graph g on XLA_CPU_JIT: TensorListReserve (No ...".
_XLA_UNSUPPORTED_RE = re.compile(
    r"compile graph \S+ on (?P<device>\w+): (?P<op>[A-Za-z0-9_>.]+) \(No registered"
)
# An op XLA has a kernel for, but not for these attributes: a tfshard `cond` whose
# branches output strings is named for the cond, not for the op making them.
_XLA_ATTRIBUTES_RE = re.compile(r"attributes didn't match\)\s*Requested Attributes: (?P<attrs>.*)")
_FAILING_NODE_RE = re.compile(r"\{\{node ([^}]+)\}\}")
# A node of the map that stacks a shard's per-sample outputs one by one (tf.map_fn,
# `tfshard._shards.vectorized`): its TensorList ops are tfshard's, not the function's.
_STACKED_ONE_BY_ONE_RE = re.compile(r"(?:^|/)per_sample/")
# Where TF's text of a root error ends and its stacks, calls and counts begin.
_CAUSE_END_RE = re.compile(
    r"^\s*(?:\[\[|tf2xla conversion failed|The op is created at:|Stack trace for op definition:"
    r"|\d+ (?:successful operations|derived errors ignored))"
)
# Lines around a root error that are no part of it: TF's heading, each node's stack.
_NOT_CAUSE_RE = re.compile(
    r"^(?:Graph execution error:|Detected at node .*|\s*File .*|<stack traces unavailable>|\s*)$"
)
# gRPC's codes for a peer that could not be reached in time: UNAVAILABLE, DEADLINE_EXCEEDED
# (TensorFlow's `error_code`s of UnavailableError and DeadlineExceededError are the same).
_TRANSPORT_CODES = frozenset({14, 4})
# TensorFlow's code of `tf.errors.ResourceExhaustedError` (its `error_code`): out of memory.
_RESOURCE_EXHAUSTED = 8
# The gather's concatenation refusing shards' outputs of different shapes past the rows
# (its scope is `tfshard._step.COLLECT_SCOPE`): TF's reason, the line before the node.
_GATHER_SHAPES = re.compile(
    r"\n([^\n]*(?:ConcatOp|Incompatible shapes)[^\n]*)\n\s*\[\[\{\{node tfshard_collect/"
)


class TfshardError(Exception):
    """Base class of every error tfshard raises.

    Every one round-trips through `pickle` and `copy.copy` (a worker process sends
    it back whole): the same type, message and attributes, notes included.
    """

    # Autograph re-raises an error from inside a user's tf.function as its own type
    # only when that type's constructor is Exception's (else as a StagingError, which
    # no `except ArgumentError` catches); ValueError's would be found first.
    __init__ = Exception.__init__


class DeviceError(TfshardError, ValueError):
    """A device name or spec that does not resolve to a device that exists."""


class ContextMapError(TfshardError, ValueError):
    """A malformed context map such as ``"dev0->GPU:0;dev1->GPU:1"``."""


class ArgumentError(TfshardError, ValueError):
    """Bad arguments to a tfshard function or to a parallelized function."""


class DeviceSetupError(TfshardError, RuntimeError):
    """Devices cannot be configured now (for example after TensorFlow started)."""


class ShardError(TfshardError):
    """A shard failed while running; the message names its device and rows.

    The error raised is also an instance of the TensorFlow error the shard
    raised (for example `tf.errors.InvalidArgumentError`), so existing
    ``except tf.errors.OpError`` handlers keep working. Its class is made when
    first needed (one per TF error type); pickle makes it again from the TF
    type.
    """

    def __reduce__(self) -> tuple:
        tf_type = getattr(type(self), "tf_type", None)
        if tf_type is None:  # ShardError itself, or a subclass bound in a module
            return super().__reduce__()
        return (_shard_error_rebuilt, (tf_type, self.args, self.__dict__))


class UtilizationError(TfshardError, RuntimeError):
    """``nvidia-smi`` is missing, failed, hung, or printed something unreadable."""


class ClusterError(TfshardError, RuntimeError):
    """A TensorFlow cluster is unreachable, or a worker in it went away.

    The message names the worker's job, task and address, and how to bring it
    back (``python -m tfshard.worker ...``, then ``tfshard.connect(...)`` again).
    """


class WriteError(TfshardError, OSError):
    """``f.write(dataset, path)`` could not write (a full disk, a file size limit,
    no permission); the message says how much is on disk and that calling it
    again resumes. It keeps the OSError's ``errno``, ``strerror`` and ``filename``.
    """

    # The message as written: OSError's own would print only "[Errno 28] ...: 'file'".
    __str__ = Exception.__str__

    def __reduce__(self) -> tuple:
        # OSError's own gives its errno, strerror and filename as the arguments, which
        # would replace the message; they are attributes here, set after it.
        os_error = {"errno": self.errno, "strerror": self.strerror, "filename": self.filename}
        return (type(self), self.args, {**self.__dict__, **os_error})


class WorkerError(TfshardError, RuntimeError):
    """A worker process failed, exited without a result, or outlived the timeout.

    Attributes:
      index: the worker's position in `per_device_args`.
      device: the worker's device, as given (``"gpu:1"``, ``"cpu"``).
      traceback: the worker's formatted traceback when it raised, else None.
    """

    def __init__(
        self, message: str, *, index: int, device: str, traceback: str | None = None
    ) -> None:
        super().__init__(message)
        self.index = index
        self.device = device
        self.traceback = traceback

    def __reduce__(self) -> tuple:
        keywords = {"index": self.index, "device": self.device, "traceback": self.traceback}
        return (_with_keywords, (type(self), self.args, keywords), self.__dict__)


def _with_keywords(cls: type, args: tuple, keywords: dict[str, Any]) -> Any:
    """``cls(*args, **keywords)``: how pickle rebuilds an error whose constructor needs
    keywords."""
    return cls(*args, **keywords)


class _ShardTypes:
    """One ShardError subclass per TF error type, made on first use, so that
    ``except tf.errors.InvalidArgumentError`` still catches a `shard_error`.

    Each knows its TF type (``tf_type``), which is how pickle finds it again
    (`ShardError.__reduce__`): it is bound in no module.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._types: dict[type, type] = {}

    def of(self, error_type: type) -> type:
        if issubclass(error_type, ShardError):
            return error_type
        with self._lock:
            cls = self._types.get(error_type)
            if cls is None:
                # The TF error's constructor, not TfshardError's plain one.
                namespace = {"__init__": error_type.__init__, "tf_type": error_type}
                cls = type(f"Shard{error_type.__name__}", (ShardError, error_type), namespace)
                cls.__module__ = __name__
                self._types[error_type] = cls
            return cls


_shard_types = _ShardTypes()


def _shard_error_rebuilt(tf_type: type, args: tuple, state: dict[str, Any]) -> Any:
    """A pickled ShardError of `tf_type`, rebuilt: its class, then its arguments and
    attributes as they were (TF's node_def, op, message, error code and payloads).

    The TF error's constructor is not called: its arguments differ by type, and
    every value it sets is in `state`.
    """
    cls = _shard_types.of(tf_type)
    error = cls.__new__(cls, *args)
    error.__setstate__(state)
    return error


def shard_error(error: Any, message: str) -> Any:
    """`error` (a `tf.errors.OpError`) with a new message, as a ShardError of its TF type."""
    return _shard_types.of(type(error))(error.node_def, error.op, message)


def user_frames(message: str) -> str:
    """A TF graph error's message without tfshard's own frames, each node's stack once.

    TensorFlow prints "Detected at node N defined at (most recent call last):"
    and the stack that built N once per root error; tfshard's frames in it
    (its trace, body and shard functions) say nothing to the user. The user's
    frames, the failing op and TF's own summary stay. An XLA compile failure is
    `xla_failure`'s text.
    """
    xla = xla_failure(message)
    if xla is not None:
        return xla
    lines = message.split("\n")
    kept: list[str] = []
    seen: set[tuple[str, ...]] = set()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("Detected at node "):
            kept.append(lines[i])
            i += 1
            continue
        end = i + 1
        while end < len(lines) and (lines[end].startswith("  File ") or not lines[end]):
            end += 1
        frames = [
            line
            for line in lines[i + 1 : end]
            if line.startswith("  File ") and _OWN_DIR not in line
        ]
        section = (lines[i], *frames)
        if section not in seen:
            seen.add(section)
            kept.extend([lines[i], *frames, ""])
        i = end
    return "\n".join(kept)


# ------------------------------------------------ what the other rooms hand over


class Failed(NamedTuple):
    """What the engine knows of a call that TensorFlow failed; `call_failure` words it.

    Attributes:
      name: the parallelized function's name.
      devices: the shards' devices, in shard order.
      rows_of: shard k's rows, in words (``rows [2:4) of 8``, or a stream's
        ``its slice of the batch``).
      memory_hint: what to do about shard k running out of memory.
      reductions: the names ``reduce=`` takes (`tfshard.collect.REDUCTIONS`).
      vectorized: the shards mapped the function with `tf.vectorized_map`
        (``per_sample=True``, ``ragged=False``), where ``ragged=True`` is the fix
        for what pfor cannot stack.
      element: the split arguments are the fields of a dataset's element (a
        stream's batch), whose fix is in the dataset.
      remote: what the cluster says of the error (a worker down and the way
        back), or None when it is not about the cluster.
      lost: the shards on workers found down, one line, or None.
    """

    name: str
    devices: Sequence[str]
    rows_of: Callable[[int], str]
    memory_hint: Callable[[int], str]
    reductions: Sequence[str]
    vectorized: bool
    element: bool = False
    remote: str | None = None
    lost: str | None = None


def call_failure(error: Any, failed: Failed) -> Exception:
    """The error to raise for a call TensorFlow failed with `error` (a `tf.errors.OpError`).

    tfshard's own in-graph checks (rows, inputs, the gather's shapes) become an
    `ArgumentError` with the fix. Otherwise a `ShardError` of TF's type names
    what is known (shards on workers found down first, else the failing shard,
    its device and rows) and the remedy that applies (fewer rows at once for a
    shard out of memory, ``ragged=True`` where pfor cannot stack), before TF's
    text without tfshard's frames. An error none of this applies to is
    returned as it is.
    """
    message = error.message
    if ROWS_DIFFER in message:
        return rows_error(failed.name, failed.devices, message, failed.reductions)
    if INPUTS_DIFFER in message:
        if failed.element:
            return fields_differ(failed.name, inputs_differ(message))
        return inputs_error(failed.name, message)
    shapes = _GATHER_SHAPES.search(message)
    if shapes is not None:
        return ArgumentError(
            f"{failed.name}: the shards' outputs cannot be gathered in order: each output "
            "must have one row per input row and the same shape past the rows on every "
            "shard (pad it to one shape, or pass ragged=True for outputs whose length "
            "varies by sample); TensorFlow's error: " + shapes.group(1).strip()
        )
    hint = failed.remote
    if hint is not None and failed.lost is not None:
        return shard_error(
            error, f"{failed.lost}\n{hint}\nTensorFlow's error: {trimmed_remote(message)}"
        )
    k = failing_shard(message)
    wrapped = error
    if k is not None:
        shard = f"{failed.name}: shard {k} on {failed.devices[k]} ({failed.rows_of(k)})"
        text = f"failed: {user_frames(message)}"
        if getattr(error, "error_code", None) == _RESOURCE_EXHAUSTED:
            # The remedy first: TensorFlow's text runs to dozens of lines.
            text = (
                f"failed: it ran out of memory. {failed.memory_hint(k)}\n"
                f"TensorFlow's error: {user_frames(message)}"
            )
        wrapped = shard_error(error, f"{shard} {text}")
    elif xla_failure(message):  # TF cut its text before a shard was named
        wrapped = shard_error(error, f"{failed.name} failed: {user_frames(message)}")
    if hint is None and failed.vectorized and pfor_stack_failure(message):
        hint = (
            "It failed inside tf.vectorized_map (pfor), which cannot vectorize every op "
            "(string ops and shapes that vary by sample among them): pass ragged=True "
            "to map the function over one sample at a time (tf.map_fn) instead"
        )
    if hint is not None:
        wrapped = shard_error(wrapped, f"{wrapped.message}\n{hint}")
    return wrapped


def fields_differ(name: str, differ: str) -> ArgumentError:
    """The fields of a dataset's element have different rows (`differ` says which): the
    fix is in the dataset."""
    return ArgumentError(
        f"{name}: the fields of one dataset element have different numbers of rows "
        f"({differ}); every field is split along its first dimension, so they must match: "
        "batch zipped datasets alike"
    )


class Traced(NamedTuple):
    """What a shard's trace knew when the user's function raised; `trace_error` words it.

    Attributes:
      name: the parallelized function's name.
      per_sample: the function ran on one sample (else on one shard's rows).
      shapes: each split argument's shape as the function got it.
      listed: an argument that is a Python list of arrays, as ``(name in prose,
        name in code, count)``, or None.
      one_sample: a Keras model's one input given as one sample without its
        batch dimension, as ``(name in prose, name in code, the model's input
        shape, the sample's shape)``, or None.
      several: the call has several arguments (``broadcast=`` applies).
    """

    name: str
    per_sample: bool
    shapes: Sequence[Any]
    listed: tuple[str, str, int] | None
    one_sample: tuple[str, str, list[Any], list[Any]] | None
    several: bool


def trace_error(error: Exception, traced: Traced) -> ArgumentError:
    """The user's function raised `error` (a ValueError or TypeError) while traced on a
    shard: what failed, on what, and the first remedy that applies (a variable made at
    each trace, a list of arrays, one sample without its batch dimension, else
    ``per_sample``/``broadcast``)."""
    name = traced.name
    what = "one sample" if traced.per_sample else "one shard"
    shapes = ", ".join(str(shape) for shape in traced.shapes)
    return ArgumentError(
        f"{name} failed while being traced on {what} (split argument shapes "
        f"{shapes}): {type(error).__name__}: {error}\n{_trace_hint(error, traced)}"
    )


def _trace_hint(error: Exception, traced: Traced) -> str:
    name = traced.name
    if reads_a_stale_position(str(error)):
        return STALE_POSITION_FIX.format(name=name)
    if creates_variables(str(error)):
        return (
            f"{name} makes a variable each time it is traced: a Keras layer created inside "
            "the function (keras.layers.Dropout(0.1)(x)) or a tf.Variable. Create it once, "
            "outside the function, and call it inside (dropout = keras.layers.Dropout(0.1) "
            "before; dropout(x, training=True) in the function)"
        )
    if traced.listed is not None:
        arg, code, count = traced.listed
        return (
            f"{arg} is a Python list of {count} arrays, which tfshard takes as {count} "
            "separate arguments, each split along its first axis. If they are samples, "
            f"stack them into one batch first: np.stack({code}) (or tf.stack({code}))"
        )
    if traced.one_sample is not None:
        arg, code, expected, sample = traced.one_sample
        return (
            f"{arg} looks like one sample without its batch dimension: {name} takes "
            f"batches of shape {expected}, and tfshard split {arg} along its first "
            f"axis into rows of {sample}. Add the batch dimension: {code}[None] "
            f"(np.expand_dims({code}, 0)), or pass a batch of samples"
        )
    hints = []
    if traced.per_sample:
        hints.append(
            f"{name} ran on one sample at a time (one row of each split argument, shapes "
            f"{', '.join(str(list(shape)) for shape in traced.shapes)}). If it expects a whole "
            "batch, pass per_sample=False; if an argument is itself one sample, give it a "
            "batch dimension (x[None])"
        )
    else:
        hints.append(
            f"{name} ran on one shard: a block of rows of each split argument (the first "
            "dimension, None, is the shard's rows)"
        )
    if traced.several:
        hints.append("if an argument must reach every shard whole, name it in broadcast=(...)")
    return "; ".join(hints)


class RemoteCause(NamedTuple):
    """What a TF error says of the cluster's workers (`remote_cause`).

    Attributes:
      tasks: the ``(job, task)`` of each worker of the cluster it names.
      reason: gRPC's own reason, or None.
    """

    tasks: frozenset[tuple[str, int]]
    reason: str | None


def remote_cause(
    error: BaseException,
    addresses: Mapping[str, tuple[str, int]],
    tasks: Sequence[tuple[str, int]] | frozenset[tuple[str, int]],
) -> RemoteCause | None:
    """The workers a failed call's TF error names and gRPC's reason; None when the
    error is not TensorFlow's or says nothing of the network.

    Args:
      error: what the call raised (a `tf.errors.OpError` is read; anything else is None).
      addresses: ``host:port`` -> ``(job, task)`` of the connected cluster.
      tasks: the cluster's tasks (a message also names this client, /job:localhost).
    """
    message, code = getattr(error, "message", None), getattr(error, "error_code", None)
    if not isinstance(message, str) or not isinstance(code, int):
        return None  # not a TensorFlow error
    unavailable = code in _TRANSPORT_CODES
    named = frozenset(task for task in remote_tasks(message, addresses) if task in tasks)
    if not unavailable and (not named or peer_answered(message)):
        return None  # a shard's own error that crossed from a worker says nothing of the network
    return RemoteCause(named, grpc_reason(message))


def lost_contact(
    cause: RemoteCause,
    *,
    down: str | None,
    addresses: Mapping[tuple[str, int], str],
    reconnect: str,
) -> str:
    """What a call that lost contact with the cluster means, and what to do.

    Args:
      cause: what its error said (`remote_cause`).
      down: the cluster's words for the workers found down now and how to
        restart them, or None when every worker answers.
      addresses: each task's ``host:port``.
      reconnect: how to connect again.
    """
    if down:
        return (
            f"{down} and run the call again (it returned nothing; a function that updates "
            "variables may have updated them on the shards that finished)"
        )
    where = (
        ", ".join(f"/job:{j}/task:{t} at {addresses[j, t]}" for j, t in sorted(cause.tasks))
        or "a worker"
    )
    detail = f" ({cause.reason})" if cause.reason else ""
    return (
        f"the call lost contact with {where}{detail}, but every worker answers now: if it "
        f"restarted, its state from before is gone, so call {reconnect} and retry the call"
    )


def join_failed(error: BaseException, *, cluster: str, client: str) -> ClusterError:
    """`connect`'s error when TensorFlow (raising `error`) would not make this process, at
    address `client`, a client of `cluster` (as ``--cluster=`` spells it)."""
    return ClusterError(
        f"connect: TensorFlow could not connect to {cluster} as {client}: {_tf_text(error)}"
    )


def links_failed(error: BaseException, *, cluster: str, client: str) -> ClusterError:
    """`connect`'s error when every worker answers but a value cannot go round the cluster
    (`error`: what the round trip raised); arguments as `join_failed`'s."""
    return ClusterError(
        f"connect: the workers of {cluster} answer, but a value could not go from this "
        f"client ({client}) to every worker, between every two workers, and back. Every "
        f"worker must reach every other worker's address and this client's address {client} "
        "(firewalls, or 'localhost' in the cluster where another machine needs a real "
        f"address). TensorFlow's error: {_tf_text(error)}"
    )


def _tf_text(error: BaseException) -> str:
    """A TF error's own text, gRPC's repetitions left out; any other error as it prints."""
    message = getattr(error, "message", None)
    return trimmed_remote(message) if isinstance(message, str) else str(error)


class OnDisk(NamedTuple):
    """Where a stopped write stands (`write_stopped`).

    Attributes:
      path: the write's directory.
      rows: the rows committed.
      batches: the batches committed.
      next_row: the dataset's row the batch being computed starts at.
      next_batch: that batch's index in the dataset.
      as_it_was: whether the path is as it was before the write (it changed
        nothing yet: a missing directory is missing, a write it resumes or
        replaces is whole).
    """

    path: str
    rows: int
    batches: int
    next_row: int
    next_batch: int
    as_it_was: bool = False

    def state(self) -> str:
        """What is on disk, and whether this call changed it."""
        if self.as_it_was and not self.rows:
            return f"nothing was written ({self.path!r} is as it was before this call)"
        on_disk = f"{self.rows} rows ({self.batches} batches) are on disk in {self.path!r}"
        return f"{on_disk}, as before this call" if self.as_it_was else on_disk

    def resume(self, call: str, joint: str = "; ") -> str:
        """What is on disk, and that calling `call` again resumes after it (where rows are
        on disk: where none are, the error says what to change, and calling again as it
        is would write from the start, as this call did)."""
        if self.as_it_was and not self.rows:
            return self.state()
        return f"{self.state()}{joint}call {call} again to resume after them"


def write_stopped(error: BaseException, call: str, disk: OnDisk) -> BaseException:
    """The error to raise for a write `call` that `error` stopped, once its rows are committed.

    An OSError (a full disk, a file size limit, a file that cannot be
    written) becomes a `WriteError` saying what failed and how to go on; an
    error of the function (a `ShardError`) is raised again with the dataset's
    rows it was computing and how to resume; any other error is raised as it
    is, with a note saying how much is on disk.
    """
    if isinstance(error, OSError):
        return write_error(error, call, disk.resume(call, ": "))
    if isinstance(error, ShardError) and hasattr(error, "node_def"):  # a tf.errors.OpError
        where = f"batch {disk.next_batch} of the dataset, whose rows start at row {disk.next_row}"
        then = disk.resume(call, ": ")
        return shard_error(error, f"{error.message}\n{call} stopped in {where}; {then}")
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"tfshard: {disk.resume(call)}")
    return error


# What to do about the OSErrors a write meets, by errno.
_OS_REASONS = {
    errnos.ENOSPC: ": the disk is full; free some space",
    errnos.EDQUOT: ": the disk quota is used up; free some space",
    errnos.EFBIG: ": the file size limit (ulimit -f) is reached; raise it",
    errnos.EACCES: ": no permission to write there; choose another path",
    errnos.EROFS: ": the file system is read-only; choose another path",
}


def write_error(error: OSError, call: str, then: str) -> WriteError:
    """`error` as a WriteError (its errno, strerror, filename): what failed, the fix, `then`."""
    reason = _OS_REASONS.get(error.errno, "")
    where = f" ({error.filename})" if error.filename else ""
    failed = WriteError(f"{call}: {error.strerror or error}{where}{reason}; {then}")
    failed.errno, failed.strerror, failed.filename = error.errno, error.strerror, error.filename
    return failed


# ------------------------------------------------------ reading TF's messages


def failing_shard(message: str) -> int | None:
    """The shard a TF error's message says failed, or None.

    The cause is the first root error (`_root_errors`) whose failing node
    (``{{node N}}``) lies in a shard: in shard k's scope (traced in place), or
    inside a function called there, which the calls after it name, innermost
    first (``[[tfshard_shard_k/StatefulPartitionedCall]]``, the shared trace).
    A receive (``.../_12``) that TF aborted with the step names no shard.

    >>> failing_shard("boom\\n\\t [[{{node tfshard_shard_2/cond/Assert}}]]")
    2
    >>> failing_shard("out of memory") is None
    True
    """
    for block in _root_errors(message):
        found = _shard_of_root(block)
        if found is not None:
            return found
    return None


# Whose memory ran out: TF's allocator names its device; a Python function's MemoryError
# (tf.py_function) is the host process's.
_OOM_DEVICE_RE = re.compile(r"OOM when allocating [^\n]*? on (/\S+) by allocator")
_PYTHON_OOM_RE = re.compile(r"(?:^|RESOURCE_EXHAUSTED:\s+)MemoryError\b", re.MULTILINE)
HOST_MEMORY = "host"


def memory_owner(message: str) -> str | None:
    """Whose memory a TF out-of-memory error's first root error says ran out: the device
    TF's allocator names (``OOM when allocating ... on D by allocator``), `HOST_MEMORY`
    for a MemoryError that a Python function raised (``tf.py_function``: the host
    process's memory, whatever device its op is on), or None where it names neither.

    >>> memory_owner("OOM when allocating tensor with shape[9] and type float on "
    ...              "/job:localhost/replica:0/task:0/device:GPU:1 by allocator GPU_1_bfc")
    '/job:localhost/replica:0/task:0/device:GPU:1'
    >>> memory_owner("  (0) RESOURCE_EXHAUSTED:  MemoryError: 8 rows"), memory_owner("OOM")
    ('host', None)
    """
    for block in _root_errors(message):
        found = _OOM_DEVICE_RE.search(block)
        if found is not None:
            return found.group(1)
        if _PYTHON_OOM_RE.search(block):
            return HOST_MEMORY
    return None


def shard_in(name: str) -> int | None:
    """The shard whose scope (`SHARD_SCOPE`) a node's name lies in, or None.

    The outermost scope counts: a parallelized function called inside a shard
    names its own shards inside it.

    >>> shard_in("tfshard_shard_2/cond/tfshard_shard_0/Sin")
    2
    >>> shard_in("tfshard_collect/TensorListConcatV2") is None
    True
    """
    found = _IN_SHARD_RE.search(name)
    return None if found is None else int(found.group(1))


def _shard_of_root(block: str) -> int | None:
    """The shard one root error's failing node lies in; None for no node or no shard."""
    names = [(failing, failing or call) for failing, call in _ERROR_NODE_RE.findall(block)]
    while names and not names[0][0]:
        names.pop(0)  # calls before any failing node name nothing
    if not names or _RECEIVE_RE.fullmatch(names[0][1]):
        return None  # no node, or an aborted receive: the cause is another root error
    found = None
    for i, (failing, name) in enumerate(names):
        if i and failing and failing != names[0][0]:
            break  # the next node's report: the failing node's calls ended
        shard = shard_in(name)
        if shard is not None and not _RECEIVE_RE.fullmatch(name):
            found = shard  # the outermost call wins (nested tfshard)
    return found


def _root_errors(message: str) -> list[str]:
    """The root errors a TF message lists, consequences left out (all of it if one).

    Each starts with its code (``INVALID_ARGUMENT: ...``). A root error
    CANCELLED or ABORTED is the step being stopped because another op failed;
    it never names the cause.
    """
    starts = list(_ROOT_ERROR_RE.finditer(message))
    if not starts:
        return [message]
    ends = [m.start() for m in starts[1:]] + [len(message)]
    return [
        message[m.start(1) : end]
        for m, end in zip(starts, ends)
        if m.group(1) not in ("CANCELLED", "ABORTED")
    ]


def xla_failure(message: str) -> str | None:
    """What XLA could not compile, and the remedy, then TF's root cause once; None if
    the error is not XLA's compile failure.

    TensorFlow reports it once per root error (one per shard), each with the
    stack of every function it was converting (``Stack trace for op
    definition``): dozens of lines, a cause in one. This keeps the root error
    that names a shard (else the first), its failing node and, when XLA has no
    kernel for it, the op.

    >>> what, cause = xla_failure(
    ...     "  (0) INVALID_ARGUMENT:  Reading input as constant from a dynamic tensor"
    ...     "\\n\\nStack trace for op definition: \\nFile \\"a.py\\", line 6"
    ...     "\\n\\t [[{{node loop_body/pfor/DynamicStitch}}]]"
    ...     "\\n\\ttf2xla conversion failed while converting cond_true_70[]."
    ... ).split("\\n")
    >>> print(what.replace("; ", ";\\n"))
    XLA could not compile the function (jit_compile=True) at node loop_body/pfor/DynamicStitch;
    pass jit_compile=False to run it without XLA
    >>> print(cause)
    TensorFlow's error: INVALID_ARGUMENT: Reading input as constant from a dynamic tensor
    >>> xla_failure("out of memory") is None
    True
    """
    if not _XLA_FAILURE_RE.search(message):
        return None
    blocks = _root_errors(message)
    block = next((b for b in blocks if _shard_of_root(b) is not None), blocks[0])
    node = _FAILING_NODE_RE.search(block)
    unsupported = _XLA_UNSUPPORTED_RE.search(block)
    what = "XLA could not compile the function (jit_compile=True)"
    if unsupported:
        what += f": {unsupported['device']} has no kernel for op {unsupported['op']}"
        attributes = _XLA_ATTRIBUTES_RE.search(block)
        if attributes and "DT_STRING" in attributes["attrs"]:
            what += " on string tensors (XLA has no string type: an op in the function makes them)"
    if node:
        what += f" at node {node[1]}"
    stacking = unsupported and unsupported["op"].startswith("TensorList")
    if node and stacking and _STACKED_ONE_BY_ONE_RE.search(node[1]):
        # tfshard's own map (`_shards.vectorized`), not an op of the function.
        what += (
            ", where tfshard stacks the function's per-sample outputs one sample at a time "
            "(their shape varies by sample or is unknown), which XLA cannot compile: give "
            "each output a fixed shape (pad it, or tf.ensure_shape), or run it without XLA "
            "(jit_compile=False; for a tf.function's own jit_compile, ragged=True does it)"
        )
    else:
        what += "; pass jit_compile=False to run it without XLA"
        if unsupported:
            what += ", or keep ops XLA has no kernel for out of the function"
    cause: list[str] = []
    for line in block.split("\n"):
        if _CAUSE_END_RE.match(line):
            if cause:
                break
        elif not _NOT_CAUSE_RE.match(line):
            cause.append(line.rstrip())
    text = re.sub(r"^([A-Z_]+):\s+", r"\1: ", "\n".join(cause).strip())
    return f"{what}\nTensorFlow's error: {_FUNCTION_NODE_RE.sub('', text)}"


def pfor_stack_failure(message: str) -> bool:
    """Whether a TF error is pfor's own: stacking per-sample results whose shapes differ.

    The node that failed is read where TF names it (``{{node ...}}``), not
    where a result was only forwarded: an op pfor runs in a loop of its own
    (``loop_body/CheckNumerics``) fails on its own, though a pfor stack
    downstream is named too.

    >>> pfor_stack_failure("Incompatible shapes [[{{node loop_body/pfor/Add}}]]")
    True
    >>> pfor_stack_failure("NaN [[{{node loop_body/Check}}]] [[loop_body/pfor/TensorListStack]]")
    False
    """
    if _XLA_FAILURE_RE.search(message):
        return False  # XLA could not compile what pfor made: jit_compile=False, not ragged=True
    failed = re.findall(r"\{\{node ([^}]+)\}\}", message) or [message]
    in_pfor = any("/pfor/" in name for name in failed)
    return in_pfor and ("TensorList" in message or "Incompatible shapes" in message)


# What to do when a tf.function that the parallelized function calls reads its
# position (`tfshard.position.Reads`, `reads_a_stale_position`).
STALE_POSITION_FIX = (
    "tfshard.shard_index() or tfshard.row_index() is read inside a tf.function that "
    "{name} calls, in that tf.function's first trace only: its cache gives every later "
    "shard or chunk that trace, with the first one's position in it. Read the position "
    "outside the tf.function and pass it in as an argument, call its Python function "
    "instead (g.python_function(...) for a tf.function g), or parallelize the tf.function "
    "itself, with no decorator above it (tfshard calls its Python function; a decorator "
    "above it, such as tf.Module.with_name_scope, calls the tf.function: put it below "
    "@tf.function)"
)


def reads_a_stale_position(message: str) -> bool:
    """Whether a trace failed on a shard's position made in another graph: a
    tf.function's trace, cached, that read it (`STALE_POSITION_FIX`).

    >>> reads_a_stale_position("<tf.Tensor 'tfshard_shard_1/tfshard_position/Const:0' "
    ...                        "shape=() dtype=int32> is out of scope and cannot be used here")
    True
    """
    return "is out of scope" in message and bool(_POSITION_TENSOR_RE.search(message))


# A shard's position tensor, or one made from it where the function reads it: made
# in place (in its scope, `tfshard._step`; a read's, `tfshard.position`), or a
# trace's input (`tfshard._sharding`, `tfshard._shards.sample_trace`). A scope or
# input used again in one graph gets a suffix: tfshard_position_1.
POSITION_NAME = r"(?:[^'\s]*/)?tfshard_position(?:_\d+)?(?:/[^'\s]*|:\d+)"
_POSITION_TENSOR_RE = re.compile(rf"<tf\.Tensor '{POSITION_NAME}'")


def creates_variables(message: str) -> bool:
    """Whether a trace failed because the function makes a `tf.Variable` each time it runs
    (as a Keras layer made inside it does).

    >>> creates_variables("tf.function only supports singleton tf.Variables created on ...")
    True
    """
    return "only supports singleton tf.Variables" in message


def inputs_differ(message: str) -> str:
    """What the failed in-graph check of the split arguments' rows (`INPUTS_DIFFER`)
    found, in words: ``"y has 4 rows but x has 3"``."""
    paths = _assert_text(message, INPUTS_DIFFER).split(", ")
    got, want, k = _assert_vectors(message)
    if k is None or k >= len(paths):
        return "the split arguments have different numbers of rows"
    return f"{paths[k]} has {got[k]} rows but {paths[0]} has {want[k]}"


def over_caps(message: str) -> int | None:
    """The rows of a stream's batch that the failed in-graph check of the caps
    (`OVER_CAPS`) found more than its devices hold, or None for another error.

    The check is known by the node that failed: its Assert, under `CAPS_SCOPE`
    and outside every shard's scope; any other op's error is not it, whatever
    its text (the function's own assertion, say)."""
    if OVER_CAPS not in message:
        return None
    failing = next((name for name, _ in _ERROR_NODE_RE.findall(message) if name), "")
    if not _CAPS_NODE_RE.fullmatch(failing) or _IN_SHARD_RE.search(failing):
        return None
    got, _, _ = _assert_vectors(message)
    return got[0] if got else None


def inputs_error(name: str, message: str) -> ArgumentError:
    """The failed check of a call's split arguments' rows (`INPUTS_DIFFER`), with the fix."""
    return ArgumentError(
        f"{name}: {inputs_differ(message)}; every split argument needs the same leading "
        "dimension (name an argument in broadcast=(...) to copy it whole to each device)"
    )


def rows_error(
    name: str, devices: Sequence[str], message: str, reductions: Sequence[str]
) -> ArgumentError:
    """The failed check that whole shards return one row per row (`ROWS_DIFFER`), named;
    `reductions` are the names ``reduce=`` takes (`tfshard.collect.REDUCTIONS`)."""
    path = _assert_text(message, ROWS_DIFFER)
    got, want, k = _assert_vectors(message)
    where = ""
    if k is not None:
        where = f" on shard {k} ({devices[k]}) has {got[k]} rows for {want[k]}"
    return ArgumentError(
        f"{name}: {path}{where or ' has the wrong number of rows'}; with "
        "per_sample=False each output must have one row per input row to be gathered "
        "in order (return a [rows, ...] tensor), or be of fixed shape under reduce= "
        f"(a shard's value: pass reduce={'/'.join(map(repr, reductions))})"
    )


def _assert_text(message: str, marker: str) -> str:
    """The text after `marker` in a failed assert's message (TF escapes its quotes)."""
    return message.split(marker, 1)[1].split(" :end", 1)[0].strip().replace("\\'", "'")


def _assert_vectors(message: str) -> tuple[list[int], list[int], int | None]:
    """The two vectors a failed `host_assert` printed, and their first differing index."""
    vectors = _ASSERT_VECTOR_RE.findall(message)
    if len(vectors) < 2:
        return [], [], None
    got, want = ([int(v) for v in vector.split()] for vector in vectors[:2])
    k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return got, want, k


def remote_tasks(message: str, addresses: Mapping[str, tuple[str, int]]) -> set[tuple[str, int]]:
    """The ``(job, task)`` of every worker a TF error's message names, by the task a call
    went to (``remote target /job:worker/replica:0/task:1``) or by its address as a gRPC
    peer (``ipv4:127.0.0.1:2223``, looked up in `addresses`: ``host:port`` -> task).

    >>> sorted(remote_tasks("from remote target /job:worker/replica:0/task:1 while", {}))
    [('worker', 1)]
    """
    named = {(m["job"], int(m["task"])) for m in _REMOTE_TARGET_RE.finditer(message)}
    for match in _PEER_RE.finditer(message):
        if match["address"] in addresses:
            named.add(addresses[match["address"]])
    return named


def grpc_reason(message: str) -> str | None:
    """gRPC's own reason in a TF error's message (``grpc_message:"..."``), or None.

    >>> grpc_reason('{grpc_message:"Socket closed", grpc_status:14}')
    'Socket closed'
    """
    reason = _GRPC_MESSAGE_RE.search(message)
    return reason["message"] if reason else None


# Lines of a remote error that repeat what its first line and the hint say: gRPC's
# status of the same failure, TF's counts, and the stacks that built each node.
_REMOTE_NOISE_RE = re.compile(
    r"^(?::UNKNOWN:Error received from peer.*"
    r"|\d+ (?:successful operations|derived errors ignored)\."
    r"|Graph execution error:"
    r"|Detected at node .*|  File .*|)$"
)
_FUNCTION_NODE_RE = re.compile(r"\{\{function_node [^}]*\}\}\s*")
_GRPC_INFO_RE = re.compile(
    r"^Additional GRPC error information from remote target (\S+) while calling \S*?/?(\w+):$"
)


def trimmed_remote(message: str, limit: int = 600) -> str:
    """A remote TF error's message without gRPC's repetitions, at most about `limit` characters.

    TF repeats each root error's gRPC status after it, and the stacks that built
    each node. This keeps each root error's line, the target it called and the
    nodes it names.

    >>> print(trimmed_remote(
    ...     "{{function_node f}} Socket closed\\nAdditional GRPC error information from "
    ...     "remote target /job:worker/replica:0/task:1 while calling "
    ...     "/tensorflow.WorkerService/RecvTensor:"
    ...     '\\n:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}'
    ...     "\\n0 successful operations."))
    Socket closed
      (from /job:worker/replica:0/task:1, RecvTensor)
    """
    kept = []
    for line in message.replace("\r", "").split("\n"):
        if _REMOTE_NOISE_RE.match(line):
            continue
        info = _GRPC_INFO_RE.match(line.strip())
        if info:
            line = f"  (from {info[1]}, {info[2]})"
        kept.append(_FUNCTION_NODE_RE.sub("", line).rstrip())
    text = "\n".join(kept).strip("\n")
    if len(text) > limit:
        text = f"{text[:limit].rstrip()} ... ({len(text) - limit} more characters)"
    return text


def peer_answered(message: str) -> bool:
    """Whether every gRPC status in a TF error's message is a peer's own answer.

    A shard's error that crossed from a worker carries its code
    (``grpc_status:3`` for INVALID_ARGUMENT): the worker was there to send it.
    UNAVAILABLE (14) or DEADLINE_EXCEEDED (4) mean a peer was not reached, and
    a message without a status says nothing either way (False).

    >>> peer_answered('{grpc_status:3, grpc_message:"log of a negative"}')
    True
    >>> peer_answered('{grpc_message:"Socket closed", grpc_status:14}')
    False
    """
    codes = {int(code) for code in _GRPC_STATUS_RE.findall(message)}
    return bool(codes) and not codes & _TRANSPORT_CODES
