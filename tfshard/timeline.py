"""A run's record: what ran where and when in one call, from TensorFlow's own profiler.

``f.timeline(x)`` (`tfshard.ShardedFunction.timeline`) answers "did my devices
run at once, and where did the time go?" without TensorBoard::

    >>> f = tfshard.parallelize(lambda s: tf.tanh(s) * 2.0, devices=["cpu:0", "cpu:1"])
    >>> timeline = f.timeline(np.ones([64, 8], np.float32))
    >>> [(s.device, s.rows) for s in timeline.shards]
    [('/device:CPU:0', 32), ('/device:CPU:1', 32)]
    >>> timeline.parallelism > 0
    True

How it records: the call ``f(x)`` makes (its traced graph, on its tensors and
the resources it captures, where they live) runs once under TensorFlow's
profiler (`tf.profiler.experimental.start` with host and device tracing),
and the profile's XSpace gives each op its thread, start and end; on a GPU,
each kernel and copy on the device. Nothing is replayed: the record is of the
real call, so a function that updates a variable or a table updates it once,
as ``f(x)`` would. The graph is traced before the profiler starts; a call
whose graph never ran yet includes its first run's costs (memory allocated,
kernels made), so call ``f(x)`` once first to see a warm call.

How the XSpace is read: TensorFlow writes it as a protobuf but ships its
message classes only in a private module, so this module declares the few
XSpace messages it reads (field numbers of TSL's ``xplane.proto``) and decodes
them with the ``protobuf`` package TensorFlow itself depends on.

How ops are attributed: an op in a shard's name scope (``tfshard_shard_k/``)
is that shard's; an op of a function that a shard calls (the shared trace, a
cond's branch) is the shard's whose call op started it; the gather is the
``tfshard_collect/`` scope. A GPU's kernels are attributed through the ops
that launched them (`_host_ops`, `_device_ops`).

What the record may lack: with ``jit_compile=True``, TensorFlow's profiler
leaves a compiled shard's call out of some records (the XSpace holds the
send of its result but not the call); that shard then shows no ops.

What the numbers mean: a shard's busy time is the time at least one of its
ops was running (the union of their intervals; on a GPU, of its kernels on
the device's streams); an op that waits inside its kernel (a lock, a queue,
Python's GIL in `tf.py_function`) counts as busy. Parallelism is the shards'
busy times added up over the span from the first shard's start to the last
one's end: 1.0 when they ran one after another, K when all K ran at once the
whole time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from tfshard import pinning
from tfshard._explain import format_bytes
from tfshard._step import COLLECT_SCOPE
from tfshard.errors import ArgumentError, TfshardError, shard_in

__all__ = ("Copies", "Shard", "Span", "Timeline", "read", "record", "xspace_message")

# Ops that call functions (a call, a cond's If, a loop's While): each runs its function's
# ops, which the record lists in a run of their own, so the caller only waits.
_CALL_OPS = frozenset(
    {
        "PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While",
        "StatelessWhile", "Case", "StatelessCase",
    }
)  # fmt: skip
# The executor's plumbing, which computes nothing: markers, arguments, constants,
# forwarding, control flow, and the rendezvous (a receive waits for its sender).
_NOT_WORK = frozenset(
    {
        "NoOp", "_SOURCE", "_SINK", "_Arg", "_Retval", "Const", "Identity", "IdentityN",
        "Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond", "ControlTrigger",
        "_Send", "_Recv", "_HostSend", "_HostRecv",
    }
)  # fmt: skip
_LANE_WIDTH = 40  # characters of the text lanes in str(timeline)


@dataclasses.dataclass(frozen=True)
class Span:
    """What ran in one part of the call (a shard, or the gather), in ms from the call's start.

    Attributes:
      device: where it ran (a canonical local name, ``/device:CPU:1``).
      start_ms: when its first op started.
      end_ms: when its last op ended.
      busy_ms: how long at least one of its ops (on a GPU, kernels) ran.
      intervals: the busy intervals, ``(start_ms, end_ms)`` in order, disjoint.
      ops: how many op executions the record attributes to it.
    """

    device: str
    start_ms: float
    end_ms: float
    busy_ms: float
    intervals: tuple[tuple[float, float], ...]
    ops: int


@dataclasses.dataclass(frozen=True)
class Shard(Span):
    """One shard's part of the call (see `Span`).

    Attributes:
      index: the shard's position, as in `ShardedFunction.plan`.
      rows: its rows in this call (None when the row count was not known).
    """

    index: int = 0
    rows: int | None = None


@dataclasses.dataclass(frozen=True)
class Copies:
    """What crossed into and out of one device during the call.

    Tensors are counted from the call's sends (a tensor that two devices
    receive counts once for each); bytes and time are what a GPU's copy
    engine recorded (see `_copies` for which copies count). Logical CPU
    devices share the host's memory: TF hands tensors over without copying,
    so `bytes_in`, `bytes_out` and `ms` are None for them.

    Attributes:
      device: the device.
      tensors_in: tensors it received from other devices.
      tensors_out: tensors it sent to other devices.
      bytes_in: bytes copied into its memory (a GPU), or None (a CPU).
      bytes_out: bytes copied out of its memory (a GPU), or None (a CPU).
      ms: time of its copies, or None where the record has none (a CPU).
    """

    device: str
    tensors_in: int
    tensors_out: int
    bytes_in: int | None
    bytes_out: int | None
    ms: float | None


@dataclasses.dataclass(frozen=True)
class Timeline:
    """What ran where and when in one call of a parallelized function.

    Made by `tfshard.ShardedFunction.timeline`. ``str(timeline)`` is a table;
    `plot` draws one lane per device.

    Attributes:
      name: the function's name.
      shards: one `Shard` per shard, in shard order.
      gather: the gather on the output device (None when nothing was recorded
        there: a single shard on the output device needs none).
      copies: one `Copies` per device that sent or received a tensor.
      total_ms: the whole run, from its first op to its last.
      unattributed_ms: busy time of ops the record could give to no single
        shard, outside the gather (the split, the plan, and shared-trace ops
        that ran while several calls did).
    """

    name: str
    shards: tuple[Shard, ...]
    gather: Span | None
    copies: tuple[Copies, ...]
    total_ms: float
    unattributed_ms: float

    @property
    def parallelism(self) -> float:
        """The shards' busy times over the span from the first start to the last end.

        1.0 when the shards ran one after another, K when all K ran at once
        for the whole span; 0.0 when no shard recorded any work.
        """
        working = [s for s in self.shards if s.ops]
        if not working:
            return 0.0
        span = max(s.end_ms for s in working) - min(s.start_ms for s in working)
        busy = sum(s.busy_ms for s in working)
        return busy / span if span > 0 else 1.0

    def __str__(self) -> str:
        rows = sum(s.rows or 0 for s in self.shards)
        k = len(self.shards)
        scale = (
            f"1.00: one after another, {k:.2f}: all at once" if k > 1 else "one shard: 1.00 at most"
        )
        lines = [
            f"{self.name}: one call, {rows} rows on {k} device{'s' if k != 1 else ''}, "
            f"{self.total_ms:.2f} ms; parallelism {self.parallelism:.2f} ({scale})"
        ]
        width = max(len("device"), *(len(s.device) for s in self.shards))
        end = max(self.total_ms, 1e-9)
        lines.append(
            f"  {'shard':<6}  {'device':<{width}}  {'rows':>6}  {'start ms':>8}  "
            f"{'end ms':>8}  {'busy ms':>8}  |{'0':<{_LANE_WIDTH // 2}}"
            f"{f'{self.total_ms:.1f} ms':>{_LANE_WIDTH - _LANE_WIDTH // 2}}|"
        )
        parts: list[tuple[str, str, Span]] = [
            (str(s.index), "-" if s.rows is None else str(s.rows), s) for s in self.shards
        ]
        if self.gather is not None:
            parts.append(("gather", "", self.gather))
        for label, rows_cell, span in parts:
            lines.append(
                f"  {label:<6}  {span.device:<{width}}  {rows_cell:>6}  "
                f"{span.start_ms:>8.2f}  {span.end_ms:>8.2f}  {span.busy_ms:>8.2f}  "
                f"|{_lane(span, end)}|"
            )
        if self.unattributed_ms:
            lines.append(
                f"  other ops (split, plan, unattributed): {self.unattributed_ms:.2f} ms busy"
            )
        if self.copies:
            width = max(len("device"), *(len(c.device) for c in self.copies))
            lines.append(
                f"  {'copies':<6}  {'device':<{width}}  {'tensors in':>10}  {'out':>4}  "
                f"{'bytes in':>10}  {'out':>10}  time"
            )
            for c in self.copies:
                if c.ms is None:
                    sizes = f"{'-':>10}  {'-':>10}  none recorded (shared memory)"
                else:
                    sizes = (
                        f"{format_bytes(c.bytes_in or 0):>10}  "
                        f"{format_bytes(c.bytes_out or 0):>10}  {c.ms:.2f} ms"
                    )
                lines.append(
                    f"  {'':<6}  {c.device:<{width}}  {c.tensors_in:>10}  {c.tensors_out:>4}  "
                    + sizes
                )
        lines.append("  lanes: '#' a shard's ops ran, '.' waiting between its first and last op")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Writes a PNG with one lane per device: when each shard (and the gather) ran.

        Args:
          path: where to write the image, a str or ``os.PathLike``.

        Raises:
          ArgumentError: ``path`` is not a str or ``os.PathLike``.
          TfshardError: matplotlib is not installed (``pip install matplotlib``,
            or ``pip install 'tfshard[plot]'``).
        """
        if not isinstance(path, str | os.PathLike):
            raise ArgumentError(
                f"Timeline.plot: path={path!r} of type {type(path).__name__}; pass the file "
                "to write the PNG to, a str or os.PathLike such as 'timeline.png'"
            )
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            raise TfshardError(
                "Timeline.plot needs matplotlib, which is not installed: "
                "pip install matplotlib (or pip install 'tfshard[plot]')"
            ) from None
        devices = list(dict.fromkeys(s.device for s in self.shards))
        if self.gather is not None and self.gather.device not in devices:
            devices.append(self.gather.device)
        figure = Figure(figsize=(10, 1.0 + 0.6 * len(devices)))
        FigureCanvasAgg(figure)  # a canvas of its own: pyplot's global state stays untouched
        axes = figure.add_subplot()
        colors = [f"C{k % 10}" for k in range(len(self.shards))]
        for shard, color in zip(self.shards, colors):
            lane = devices.index(shard.device)
            bars = [(a, b - a) for a, b in shard.intervals]
            axes.broken_barh(bars, (lane - 0.35, 0.7), color=color, label=f"shard {shard.index}")
            if shard.ops:
                axes.plot([shard.start_ms, shard.end_ms], [lane, lane], color=color, lw=0.8)
        if self.gather is not None:
            lane = devices.index(self.gather.device)
            bars = [(a, b - a) for a, b in self.gather.intervals]
            axes.broken_barh(bars, (lane - 0.15, 0.3), color="black", label="gather")
        axes.set_yticks(range(len(devices)), devices)
        axes.invert_yaxis()
        axes.set_xlabel("ms from the call's start")
        axes.set_xlim(0, max(self.total_ms, 1e-6))
        axes.set_title(f"{self.name}: parallelism {self.parallelism:.2f} of {len(self.shards)}")
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        figure.tight_layout()
        figure.savefig(os.fspath(path), format="png", dpi=100)


# ------------------------------------------------------------------ recording


def record(
    call: Callable[[], Any],
    concrete: Any,
    *,
    devices: Sequence[str],
    rows: Sequence[int] | None,
    output: str,
    name: str,
) -> Timeline:
    """Runs one call under TensorFlow's profiler and reads the record into a `Timeline`.

    The call runs once, as it would without the record: whatever it writes
    (a variable, a table) is written.

    Args:
      call: makes the call, ``f(x)``'s own: the traced graph `concrete` on the
        call's tensors and the resources it captures.
      concrete: the concrete function the call runs, traced already (no trace
        is recorded). With ``weights="auto"`` a call may run another graph of
        the function (measured, or one device alone): the record's eager
        function call is the call then.
      devices: the shards' devices, in shard order.
      rows: each shard's rows (`ShardedFunction.plan`), or None when unknown.
      output: the output device, where the graph's ops without a device run.
      name: the function's name, for the table and the errors.

    Returns:
      The `Timeline` of the call.

    Raises:
      ArgumentError: a device is on another machine.
      TfshardError: TensorFlow's profiler is running already (a trace of the
        user's), or it wrote no record of the call.
    """
    remote = [d for d in devices if pinning.is_remote(d)]
    if remote:
        raise ArgumentError(
            f"{name}.timeline(): {remote[0]} is on another machine; a timeline records "
            "this process's devices only (run it on the devices of one process)"
        )
    function = concrete.function_def.signature.name
    # Every op of the call's graph, with its device where the graph placed it (else "").
    placed = {
        op.name: _local(op.device) if op.device else "" for op in concrete.graph.get_operations()
    }
    with tempfile.TemporaryDirectory(prefix="tfshard_timeline_") as logdir:
        try:
            # The default options record what a timeline reads: TF's ops on the host
            # (host_tracer_level 2), a GPU's kernels and copies (device_tracer_level 1),
            # and no Python (python_tracer_level 0).
            tf.profiler.experimental.start(logdir)
        except tf.errors.AlreadyExistsError:
            raise TfshardError(
                f"{name}.timeline(): TensorFlow's profiler is already running (a trace of "
                "your own: tf.profiler.experimental.start, a TensorBoard callback's "
                "profile_batch); a timeline records with that profiler, so stop your trace "
                f"first (tf.profiler.experimental.stop()) and call {name}.timeline again"
            ) from None
        try:
            call()
            tf.test.experimental.sync_devices()  # a GPU's kernels end inside the record
        finally:
            tf.profiler.experimental.stop()
        planes = _load(Path(logdir), name)
    return _read(planes, function, placed, devices, rows, _local(output), name, any_graph=True)


def read(
    path: str | os.PathLike[str],
    function: str,
    *,
    devices: Sequence[str],
    output: str,
    rows: Sequence[int] | None = None,
    placed: dict[str, str] | None = None,
    name: str = "f",
) -> Timeline:
    """The `Timeline` of the calls of one traced function in a profile TensorFlow wrote.

    `record` reads its own profile with it; it reads one you made with
    ``tf.profiler.experimental`` around calls of a parallelized function as
    well (every call in the profile counts as one).

    Args:
      path: the profile's log directory (``plugins/profile/*/*.xplane.pb``
        under it), or one ``.xplane.pb`` file.
      function: the traced function's name in the record
        (``concrete.function_def.signature.name``: ``__inference_...``).
      devices: the shards' devices, in shard order.
      output: the output device, where the graph's ops without a device run.
      rows: each shard's rows, or None when unknown.
      placed: the call's graph's ops and the devices the graph placed them on
        (``""`` where none); None when unknown (ops are then placed by
        what the record shows).
      name: the function's name, for the table and the errors.

    Raises:
      ArgumentError: `path` does not exist.
      TfshardError: the path holds no profile, or the profile holds no op of
        `function`.
    """
    if not os.path.exists(path):
        raise ArgumentError(
            f"tfshard.timeline.read({str(path)!r}): no such file or directory; pass a profile's "
            "log directory (tf.profiler.experimental.start's) or one of its .xplane.pb files"
        )
    planes = _load(Path(path), name)
    return _read(planes, function, placed or {}, devices, rows, _local(output), name, False)


def _load(path: Path, name: str) -> list[_Plane]:
    """The planes of the XSpaces at `path`: one file, or a log directory (one file per host)."""
    paths = [path] if path.is_file() else sorted(path.glob("plugins/profile/*/*.xplane.pb"))
    if not paths:
        raise TfshardError(
            f"{name}.timeline(): TensorFlow's profiler wrote no record of the call; "
            "a timeline needs TensorFlow's profiler (tf.profiler.experimental)"
        )
    planes = []
    for path in paths:
        space = xspace_message()()
        space.ParseFromString(path.read_bytes())
        planes.extend(_plane(p) for p in space.planes)
    return planes


# -------------------------------------------------------------------- XSpace


@functools.cache
def xspace_message() -> Any:
    """The message class this module reads a profile's XSpace with (``*.xplane.pb``).

    It declares the fields a timeline reads, with the numbers of TSL's
    ``xplane.proto`` (``tensorflow.profiler.XSpace``); other fields are
    skipped when parsing. A map field (a plane's event and stat metadata) is
    its repeated entries on the wire, declared so: ``key`` and ``value``.
    """
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="tfshard_xplane.proto", package="tfshard_xplane", syntax="proto3"
    )
    scalars = {
        "int64": field.TYPE_INT64,
        "uint64": field.TYPE_UINT64,
        "double": field.TYPE_DOUBLE,
        "string": field.TYPE_STRING,
        "bytes": field.TYPE_BYTES,
    }

    def message(name: str, fields: Sequence[tuple[str, int, str, bool]], oneof: str = "") -> None:
        proto = file.message_type.add(name=name)
        if oneof:
            proto.oneof_decl.add(name=oneof)
        for field_name, number, kind, repeated in fields:
            added = proto.field.add(
                name=field_name,
                number=number,
                label=field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL,
            )
            if kind in scalars:
                added.type = scalars[kind]
                if oneof and field_name.endswith("_value"):
                    added.oneof_index = 0
            else:
                added.type = field.TYPE_MESSAGE
                added.type_name = f".tfshard_xplane.{kind}"

    message("XSpace", [("planes", 1, "XPlane", True)])
    message(
        "XPlane",
        [
            ("id", 1, "int64", False),
            ("name", 2, "string", False),
            ("lines", 3, "XLine", True),
            ("event_metadata", 4, "EventMetadataEntry", True),
            ("stat_metadata", 5, "StatMetadataEntry", True),
        ],
    )
    message("EventMetadataEntry", [("key", 1, "int64", False), ("value", 2, "XMetadata", False)])
    message("StatMetadataEntry", [("key", 1, "int64", False), ("value", 2, "XMetadata", False)])
    # XEventMetadata and XStatMetadata alike: id 1, name 2.
    message("XMetadata", [("id", 1, "int64", False), ("name", 2, "string", False)])
    message(
        "XLine",
        [
            ("id", 1, "int64", False),
            ("name", 2, "string", False),
            ("timestamp_ns", 3, "int64", False),
            ("events", 4, "XEvent", True),
        ],
    )
    message(
        "XEvent",
        [
            ("metadata_id", 1, "int64", False),
            ("offset_ps", 2, "int64", False),
            ("duration_ps", 3, "int64", False),
            ("stats", 4, "XStat", True),
        ],
    )
    message(
        "XStat",
        [
            ("metadata_id", 1, "int64", False),
            ("double_value", 2, "double", False),
            ("uint64_value", 3, "uint64", False),
            ("int64_value", 4, "int64", False),
            ("str_value", 5, "string", False),
            ("bytes_value", 6, "bytes", False),
            ("ref_value", 7, "uint64", False),
        ],
        oneof="value",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    descriptor = pool.FindMessageTypeByName("tfshard_xplane.XSpace")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)  # protobuf < 4.21


@dataclasses.dataclass
class _Event:
    """One event of a plane: its name, times in ns since the epoch, stats by name."""

    name: str
    start: float
    end: float
    stats: dict[str, Any]
    line: int


@dataclasses.dataclass
class _Plane:
    name: str
    lines: dict[int, str]  # line id -> name
    events: list[_Event]


def _plane(plane: Any) -> _Plane:
    """A decoded plane: each event with its name and stats resolved, in ns."""
    names = {entry.key: entry.value.name for entry in plane.event_metadata}
    stat_names = {entry.key: entry.value.name for entry in plane.stat_metadata}
    events = []
    for line in plane.lines:
        base = float(line.timestamp_ns)
        for event in line.events:
            stats = {}
            for stat in event.stats:
                kind = stat.WhichOneof("value")
                value = getattr(stat, kind) if kind else None
                if kind == "ref_value":  # a string kept once, in the stat metadata
                    value = stat_names.get(value, "")
                stats[stat_names.get(stat.metadata_id, "")] = value
            start = base + event.offset_ps / 1e3
            events.append(
                _Event(
                    names.get(event.metadata_id, ""),
                    start,
                    start + event.duration_ps / 1e3,
                    stats,
                    line.id,
                )
            )
    return _Plane(plane.name, {line.id: line.name for line in plane.lines}, events)


# -------------------------------------------------------------------- reading

_OP_EVENT = re.compile(r"([^\s:]+):([A-Za-z0-9_]+)")  # "tfshard_shard_1/Tanh:Tanh"
_ASYNC_START = "ExecutorState::ProcessAsync::Start"
_ASYNC_DONE = "ExecutorState::ProcessAsync::Done"
_PROCESS = "ExecutorState::Process"
_RUN = "FunctionRun"
_SENDS = frozenset({"_Send", "_HostSend"})
_MEMCPY_IN = frozenset({"MemcpyH2D", "MemcpyD2D", "MemcpyP2P"})
_MEMCPY_OUT = frozenset({"MemcpyD2H"})
_SIZE = re.compile(r"\bsize:(\d+)")


@dataclasses.dataclass
class _Op:
    """One op execution of the call (times in ns until `_read` makes them ms from its start)."""

    name: str
    op: str
    device: str  # local canonical name
    start: float
    end: float
    kind: str  # "op" (the executor), "kernel" (a GPU stream), "memcpy"
    part: tuple[str, int] | None = None  # ("shard", k), ("gather", 0) or None
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Run:
    """One run of one partition (or of a function an op called), and where it ran."""

    parent: str | None  # the run whose op started it; None for the call's partitions
    caller: str  # the op that called it ("" for the call's partitions)
    votes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    device: str = ""
    part: tuple[str, int] | None = None


def _local(name: str) -> str:
    spec = tf.DeviceSpec.from_string(name)
    return tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index).to_string()


def _part(name: str) -> tuple[str, int] | None:
    """The part of the call a node's name puts it in: a shard's scope, the gather's, or none."""
    k = shard_in(name)
    if k is not None:
        return ("shard", k)
    if name.startswith(f"{COLLECT_SCOPE}/"):
        return ("gather", 0)
    return None


def _nest(events: list[_Event]) -> list[tuple[_Event, list[_Event]]]:
    """Each event with the events of its thread it runs inside (outermost first)."""
    by_line: dict[int, list[_Event]] = collections.defaultdict(list)
    for event in events:
        by_line[event.line].append(event)
    nested = []
    for line in by_line.values():
        line.sort(key=lambda e: (e.start, -e.end))
        stack: list[_Event] = []
        for event in line:
            while stack and stack[-1].end <= event.start:
                stack.pop()
            nested.append((event, list(stack)))
            stack.append(event)
    return nested


def _host_ops(
    host: list[_Event], function: str, placed: dict[str, str], output: str, any_graph: bool
) -> tuple[list[_Op], float | None, dict[Any, tuple[str, Any]]]:
    """The executor's ops of the call of `function`, each with its device and part.

    The call's partitions are the ``FunctionRun`` events inside its eager
    execution (returned with its start; with `any_graph`, the eager
    execution of any function where none of `function` is: the call that
    ``weights="auto"`` ran as a measured graph); a function an op calls runs as a
    ``FunctionRun`` inside that op's event; an op runs in the run whose id
    (``_p``) its enclosing ``ExecutorState::Process`` event consumes (``_c``).
    A run's device is the one its sends name as their source (a rendezvous key
    names both devices) or the graph placed its ops on, else its parent's (the
    output device for a partition).
    A GPU kernel's launch is an event of the host thread that ran its op,
    inside that run, with the kernel's ``correlation_id``: returned too, as
    the device and part of the run each launch happened in (None for a run
    of another call).
    """
    nested = _nest(host)
    window = [
        e for e in host if e.stats.get("eager_op") == function or e.name.endswith(f": {function}")
    ]
    if not window and any_graph:  # the call ran another graph (weights="auto" measuring)
        window = [e for e in host if e.stats.get("is_func") and e.name == "EagerExecute"]
    runs: dict[Any, _Run] = {}
    raw: list[tuple[str, str, Any, float, float, dict[str, Any], Any]] = []
    done: dict[Any, float] = {}
    pending_runs: list[tuple[_Event, list[_Event]]] = []
    launches: list[tuple[Any, Any]] = []  # (correlation id, run)
    for event, outer in nested:
        if event.name == _RUN:
            pending_runs.append((event, outer))
            continue
        if event.name == _ASYNC_DONE:
            done[event.stats.get("_c")] = event.end
            continue
        if "correlation_id" in event.stats:  # a GPU kernel's or copy's launch
            process = next((e for e in reversed(outer) if e.name == _PROCESS), None)
            if process is not None:
                launches.append((event.stats["correlation_id"], process.stats.get("_c")))
            continue
        if event.name == _ASYNC_START:
            op_name, op = str(event.stats.get("name", "")), str(event.stats.get("kernel_type", ""))
        else:
            match = _OP_EVENT.fullmatch(event.name)
            if match is None:
                continue
            op_name, op = match.groups()
        process = next((e for e in reversed(outer) if e.name == _PROCESS), None)
        run = None if process is None else process.stats.get("_c")
        raw.append((op_name, op, run, event.start, event.end, event.stats, event))
    # The call's partitions, then the functions their ops call, in the order they started.
    op_of = {id(entry[6]): entry for entry in raw}
    for event, outer in sorted(pending_runs, key=lambda pair: pair[0].start):
        caller = next((e for e in reversed(outer) if id(e) in op_of), None)
        if caller is None:
            inside = any(w.line == event.line and w.start <= event.start <= w.end for w in window)
            if inside or (not window and any_graph and event.stats.get("_r")):
                runs[event.stats.get("_p")] = _Run(None, "")
            continue
        op_name, _, parent, *_ = op_of[id(caller)]
        if parent in runs:
            runs[event.stats.get("_p")] = _Run(parent, op_name)
    # An op the record shows outside any executor's Process event (seen under load) is the
    # call's if it ran during the call: its device is its placement, its part its name's.
    during = [(w.start, w.end) for w in window]
    ops, ran_in = [], []
    for op_name, op, run, start, end, stats, event in raw:
        if run not in runs and not (
            run is None and any(a <= start <= b for a, b in during)
        ):
            continue
        if event.name == _ASYNC_START:
            end = max(end, done.get(stats.get("_p"), end))
        key = stats.get("key")
        if run is None:
            pass
        elif op in _SENDS and isinstance(key, str) and ";" in key:
            runs[run].votes[_local(key.split(";")[0])] += 1
        elif placed.get(op_name):
            runs[run].votes[placed[op_name]] += 1
        ops.append(_Op(op_name, op, "", start, end, "op", stats=stats))
        ran_in.append(runs.get(run))
    for run in runs.values():  # parents were added first
        parent = runs.get(run.parent)
        inherited = parent.device if parent is not None else output
        run.device = run.votes.most_common(1)[0][0] if run.votes else inherited
        if parent is not None:
            run.part = _part(run.caller) or parent.part
    for o, run in zip(ops, ran_in):
        o.device = run.device if run is not None else placed.get(o.name) or output
        o.part = _part(o.name) or (run.part if run is not None else None)
    # A launch in a run of another call: its kernel is not the call's (None).
    launched = {c: (runs[r].device, runs[r].part) if r in runs else None for c, r in launches}
    return ops, min((w.start for w in window), default=None), launched


def _device_ops(
    planes: list[_Plane],
    ops: list[_Op],
    since: float,
    launched: dict[Any, tuple[str, Any] | None],
    devices: Sequence[str],
    placed: dict[str, str],
    output: str,
) -> list[_Op]:
    """A GPU's kernels of the call (the op each one's ``tf_op`` stat names) and its copies.

    An op that runs on a GPU leaves no event of its own on the host (its
    executor annotates its kernels instead), so a kernel is attributed, in
    this order: by its op's name (a shard's scope: that shard's, on its
    device; the gather's scope: the gather's); by the run its launch
    happened in (`launched`: an op of the function a shard's call op called,
    the shared trace, is that shard's); by an op of that name the host
    recorded; by the call's graph (an op of the plan, where the graph placed
    it). A kernel known by none of these, launched by another call, or
    started before the call did (`since`) is not the call's. A copy is the
    call's if it started after the call did; its device is the one whose
    known kernels or named copies ran on its stream (one card split into
    logical GPUs has one plane, with streams of its own for each logical
    device), else the plane's (the card's first logical device).
    """
    local = [_local(d) for d in devices]
    where: dict[str, set[tuple[str, Any]]] = collections.defaultdict(set)
    for o in ops:
        where[o.name].add((o.device, o.part))

    def known(name: str, correlation: Any) -> set[tuple[str, Any]]:
        if correlation in launched and launched[correlation] is None:
            return set()  # launched by another call
        part = _part(name)
        run = launched.get(correlation)
        if part is None and run is not None:
            part = run[1]
        if part is not None and part[0] == "shard" and part[1] < len(local):
            return {(local[part[1]], part)}
        if part is not None:
            return {(output, part)}
        if run is not None:
            return {(run[0], None)}
        if name in where:
            return where[name]
        if name in placed:
            return {(placed[name] or output, None)}
        return set()

    found: list[tuple[_Op, set[tuple[str, Any]], tuple[int, int], str]] = []
    for plane in planes:
        match = re.fullmatch(r"/device:GPU:(\d+)", plane.name)
        if match is None:
            continue
        own = f"/device:GPU:{match.group(1)}"
        for event in plane.events:
            named = str(event.stats.get("tf_op", ""))
            if event.start < since:
                continue
            if event.name in _MEMCPY_IN or event.name in _MEMCPY_OUT:
                kind = "memcpy"
            elif named:
                kind = "kernel"
            else:
                continue
            o = _Op(named or event.name, event.name, own, event.start, event.end, kind)
            o.stats = event.stats
            correlation = event.stats.get("correlation_id")
            candidates = known(named.rsplit(":", 1)[0], correlation) if kind == "kernel" else set()
            if kind == "kernel" and not candidates:
                continue  # not the call's
            found.append((o, candidates, (id(plane), event.line), own))
    # Each stream's device: the one its kernels of a known device ran for.
    votes: dict[tuple[int, int], collections.Counter] = collections.defaultdict(
        collections.Counter
    )
    for o, candidates, line, _ in found:
        if o.kind == "kernel" and len({c[0] for c in candidates}) == 1:
            votes[line][next(iter(candidates))[0]] += 1
        ends = _ends(o.stats.get("key")) if o.kind == "memcpy" else None
        if ends is not None:  # a copy's key names the GPU whose stream made it
            votes[line][ends[1] if o.op == "MemcpyH2D" else ends[0]] += 1
    device_ops = []
    for o, candidates, line, own in found:
        stream = votes[line].most_common(1)[0][0] if votes[line] else None
        o.device = stream or own
        if o.kind == "memcpy":
            device_ops.append(o)
            continue
        mine = [c for c in candidates if c[0] == o.device] or list(candidates)
        if len(mine) == 1:
            o.device, o.part = mine[0]
        device_ops.append(o)
    return device_ops


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _span(ops: list[_Op], device: str) -> dict[str, Any]:
    """The fields of a `Span` for these ops.

    Its work is its ops that compute something (not the executor's plumbing,
    `_NOT_WORK`), or its kernels where a GPU recorded any; start and end are
    those of its work, as plumbing (a cond's Merge, a control edge's receive)
    runs whenever its inputs resolve, often long after the work.
    """
    kernels = [o for o in ops if o.kind == "kernel"]
    inner = [o for o in ops if o.kind == "op" and o.op not in _NOT_WORK | _CALL_OPS]
    # A call whose ops the record does not list (an XLA cluster runs as one
    # kernel) is itself the work; otherwise its ops are, and the call only waits.
    calls = [o for o in ops if o.kind == "op" and o.op in _CALL_OPS]
    opaque = [c for c in calls if not any(c.start <= o.start <= c.end for o in inner)]
    work = kernels or inner + opaque
    timed = work or [o for o in ops if o.kind == "op"]
    intervals = _union((o.start, o.end) for o in work)
    return dict(
        device=device,
        start_ms=min((o.start for o in timed), default=0.0),
        end_ms=max((o.end for o in timed), default=0.0),
        busy_ms=sum(b - a for a, b in intervals),
        intervals=tuple(intervals),
        ops=len(work),
    )


def _ends(key: Any) -> tuple[str, str] | None:
    """The source and destination devices a rendezvous key names (``src;n;dst;edge;frame``)."""
    if not isinstance(key, str) or key.count(";") < 2:
        return None
    source, _, destination = key.split(";")[:3]
    return _local(source), _local(destination)


def _copies(ops: list[_Op], device_ops: list[_Op], gpus: bool) -> tuple[Copies, ...]:
    """Tensors each device sent and received, and a GPU's copies.

    A tensor crossing between devices is one send the host recorded (its
    rendezvous key names both devices), or a GPU's copy between devices
    whose key no send of the host's names (the send was the GPU's): each
    counts once, out for its source and in for its destination, as do its
    bytes. A copy between the host's memory and a GPU (an eager input, a
    tensor kept in host memory) counts in or out for that GPU, its bytes
    only; a copy inside one GPU's memory, not at all.
    """
    tensors_in: collections.Counter = collections.Counter()
    tensors_out: collections.Counter = collections.Counter()
    sent = set()
    for o in ops:
        ends = _ends(o.stats.get("key"))
        if o.op in _SENDS and ends is not None and ends[0] != ends[1]:
            sent.add(o.stats["key"])
            tensors_out[ends[0]] += 1
            tensors_in[ends[1]] += 1
    bytes_in: collections.Counter = collections.Counter()
    bytes_out: collections.Counter = collections.Counter()
    ms: collections.Counter = collections.Counter()
    for o in device_ops:
        if o.kind != "memcpy":
            continue
        size = _SIZE.search(str(o.stats.get("memcpy_details", "")))
        moved = int(size.group(1)) if size else 0
        ends = _ends(o.stats.get("key"))
        if ends is not None and ends[0] != ends[1]:
            source, destination = ends
            if o.stats["key"] not in sent:
                tensors_out[source] += 1
                tensors_in[destination] += 1
        elif o.op in _MEMCPY_IN - {"MemcpyD2D", "MemcpyP2P"}:
            source, destination = "", ends[1] if ends else o.device
        elif o.op in _MEMCPY_OUT:
            source, destination = ends[0] if ends else o.device, ""
        else:
            continue
        if source:
            bytes_out[source] += moved
        if destination:
            bytes_in[destination] += moved
        gpu = destination if _device_order(destination)[0] == "GPU" else source
        ms[gpu] += o.end - o.start  # the GPU's copy engine's time
    devices = set(tensors_in) | set(tensors_out) | set(ms)
    copies = []
    for d in sorted(devices, key=_device_order):
        recorded = gpus and tf.DeviceSpec.from_string(d).device_type == "GPU"
        copies.append(
            Copies(
                device=d,
                tensors_in=tensors_in[d],
                tensors_out=tensors_out[d],
                bytes_in=bytes_in[d] if recorded else None,
                bytes_out=bytes_out[d] if recorded else None,
                ms=float(ms[d]) if recorded else None,
            )
        )
    return tuple(copies)


def _device_order(name: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(name)
    return (spec.device_type or "", spec.device_index or 0)


def _read(
    planes: list[_Plane],
    function: str,
    placed: dict[str, str],
    devices: Sequence[str],
    rows: Sequence[int] | None,
    output: str,
    name: str,
    any_graph: bool,
) -> Timeline:
    host = [e for p in planes if p.name == "/host:CPU" for e in p.events]
    ops, since, launched = _host_ops(host, function, placed, output, any_graph)
    if since is None and ops:
        since = min(o.start for o in ops)
    device_ops = (
        [] if since is None else _device_ops(planes, ops, since, launched, devices, placed, output)
    )
    if not ops and not any(o.kind == "kernel" for o in device_ops):
        raise TfshardError(
            f"{name}.timeline(): TensorFlow's profile holds no op of the call "
            f"({function}); a timeline needs the profiler's trace of TensorFlow ops "
            "(on the host, and a GPU's kernels)"
        )
    everything = ops + device_ops
    base = min(o.start for o in everything)
    for o in everything:
        o.start, o.end = (o.start - base) / 1e6, (o.end - base) / 1e6
    timed = ops + [o for o in device_ops if o.kind == "kernel"]
    per_shard: list[list[_Op]] = [[] for _ in devices]
    gathered, other = [], []
    for o in timed:
        if o.part is not None and o.part[0] == "shard" and o.part[1] < len(devices):
            per_shard[o.part[1]].append(o)
        elif o.part is not None and o.part[0] == "gather":
            gathered.append(o)
        else:
            other.append(o)
    shards = tuple(
        Shard(
            **_span(mine, _local(device)),
            index=k,
            rows=None if rows is None else int(rows[k]),
        )
        for k, (device, mine) in enumerate(zip(devices, per_shard))
    )
    gather = None
    if gathered:
        places = collections.Counter(o.device for o in gathered if o.kind == "op")
        gather = Span(**_span(gathered, places.most_common(1)[0][0] if places else output))
    gpus = any(re.fullmatch(r"/device:GPU:\d+", p.name) for p in planes)
    return Timeline(
        name=name,
        shards=shards,
        gather=gather,
        copies=_copies(ops, device_ops, gpus),
        total_ms=max((o.end for o in everything), default=0.0),
        unattributed_ms=_span(other, "")["busy_ms"],
    )


# ---------------------------------------------------------------- formatting


def _lane(span: Span, end: float) -> str:
    """`span` as characters over [0, end]: '#' busy, '.' idle inside its span, ' ' outside.

    A cell is busy when a quarter of it was; a span whose work is shorter than that
    anywhere still shows one '#', where most of it ran.
    """
    cells = []
    step = end / _LANE_WIDTH
    covered = [
        sum(max(0.0, min((i + 1) * step, y) - max(i * step, x)) for x, y in span.intervals)
        for i in range(_LANE_WIDTH)
    ]
    most = max(range(_LANE_WIDTH), key=covered.__getitem__)
    for i in range(_LANE_WIDTH):
        a, b = i * step, (i + 1) * step
        if span.ops and (covered[i] >= 0.25 * step or (i == most and covered[i] > 0)):
            cells.append("#")
        elif span.ops and span.start_ms < b and a < span.end_ms:
            cells.append(".")
        else:
            cells.append(" ")
    return "".join(cells)
