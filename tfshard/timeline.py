"""A run's record: what ran where and when in one call, from TensorFlow's own step stats.

``f.timeline(x)`` (`tfshard.ShardedFunction.timeline`) answers "did my devices
run at once, and where did the time go?" without TensorBoard::

    >>> f = tfshard.parallelize(lambda s: tf.tanh(s) * 2.0, devices=["cpu:0", "cpu:1"])
    >>> timeline = f.timeline(np.ones([64, 8], np.float32))
    >>> [(s.device, s.rows) for s in timeline.shards]
    [('/device:CPU:0', 32), ('/device:CPU:1', 32)]
    >>> timeline.parallelism > 0
    True

How it records: the call's traced graph (`ShardedFunction.get_concrete_function`)
runs in a TF1 session of its own (`tf.compat.v1.Session`) with
``RunOptions(trace_level=FULL_TRACE)``, and the run's step stats give each op's
device, start and end after placement. The session gets this process's
devices and thread settings; the resources the function captures are copied
into it as they are now (a variable's value, a lookup table's contents, a
critical section's mutex), so the record's run reads the same weights and
tables and writes none of the user's. The graph runs once to warm up
(kernels, memory), then once recorded.

How ops are attributed to shards: an op traced in place carries its shard's
name scope (``tfshard_shard_k/``). Shards off the output device call one shared
trace, whose ops carry no scope: each goes to the shard whose call op
(``tfshard_shard_k/StatefulPartitionedCall``) ran on the op's device and was
running when the op started, or, when none ran there, to the one call running
anywhere at that time; ops that fit no single shard stay unattributed. The
gather is the ``tfshard_collect/`` scope.

What the numbers mean: a shard's busy time is the time at least one of its
ops was running (the union of their intervals; on a GPU, of its kernels on
the device's streams); an op that waits inside its kernel (a lock, a queue,
Python's GIL in `tf.py_function`) counts as busy. Parallelism is the shards'
busy times added up over the span from the first shard's start to the last
one's end: 1.0 when they ran one after another, K when all K ran at once the
whole time.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfshard import pinning
from tfshard._explain import format_bytes
from tfshard._step import COLLECT_SCOPE
from tfshard.errors import ArgumentError, TfshardError, shard_in

__all__ = ("Copies", "Shard", "Span", "Timeline", "record")

_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
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

    Bytes are the tensors the run sent between devices (the executed
    partition graphs' send/receive pairs), each tensor counted once per
    device it went to. Logical CPU devices share the host's
    memory, so there TF hands tensors over without copying and records no
    time (`ms` is None); on a GPU, `ms` is the time of the copies on its
    ``memcpy`` stream.

    Attributes:
      device: the device.
      bytes_in: bytes it received from other devices.
      bytes_out: bytes it sent to other devices.
      ms: copy time TF recorded on this device, or None where it records none.
    """

    device: str
    bytes_in: int
    bytes_out: int
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
            lines.append(f"  {'copies':<6}  {'device':<{width}}  {'in':>10}  {'out':>10}  time")
            for c in self.copies:
                ms = "none recorded (shared memory)" if c.ms is None else f"{c.ms:.2f} ms"
                lines.append(
                    f"  {'':<6}  {c.device:<{width}}  {format_bytes(c.bytes_in):>10}  "
                    f"{format_bytes(c.bytes_out):>10}  {ms}"
                )
        lines.append("  lanes: '#' a shard's ops ran, '.' waiting between its first and last op")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Writes a PNG with one lane per device: when each shard (and the gather) ran.

        Args:
          path: where to write the image.

        Raises:
          TfshardError: matplotlib is not installed (``pip install matplotlib``,
            or ``pip install 'tfshard[plot]'``).
        """
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
    concrete: Any,
    tensors: Sequence[Any],
    *,
    devices: Sequence[str],
    rows: Sequence[int] | None,
    name: str,
) -> Timeline:
    """Runs a parallelized function's traced graph once, recorded, and reads the record.

    Args:
      concrete: the call's concrete function (`ShardedFunction.get_concrete_function`).
      tensors: the graph's inputs for the call, in order (nested composites allowed).
      devices: the shards' devices, in shard order.
      rows: each shard's rows (`ShardedFunction.plan`), or None when unknown.
      name: the function's name, for the table.

    Returns:
      The `Timeline` of the run.

    Raises:
      ArgumentError: a device is on another machine, or the function captures
        a resource that is neither a variable, a lookup table nor a critical
        section (a queue, an iterator).
    """
    remote = [d for d in devices if pinning.is_remote(d)]
    if remote:
        raise ArgumentError(
            f"{name}.timeline(): {remote[0]} is on another machine; a timeline records "
            "this process's devices only (run it on the devices of one process)"
        )
    graph, feeds, setup = _replay(concrete, tensors, name)
    fetches = [graph.get_tensor_by_name(t.name) for t in concrete.outputs]
    options = tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE, output_partition_graphs=True
    )
    metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        if setup.ops:
            session.run(setup.ops, setup.feeds)
        session.run(fetches, feeds)  # warm-up: kernels made, memory allocated
        session.run(fetches, feeds, options, metadata)
    fed = {tensor: int(np.asarray(value).nbytes) for tensor, value in feeds.items()}
    return _read(metadata, fed, devices, rows, name)


@dataclasses.dataclass
class _Setup:
    """What a session runs once before the call: its copies of the captured resources.

    Attributes:
      ops: the copies' initializers (a variable's value, a table's contents).
      feeds: the values they are initialized from.
    """

    ops: list[Any] = dataclasses.field(default_factory=list)
    feeds: dict[Any, Any] = dataclasses.field(default_factory=dict)


def _replay(concrete: Any, tensors: Sequence[Any], name: str) -> tuple[Any, dict, _Setup]:
    """A graph to run the call in a session: the traced graph, its captures made local.

    A session has resources of its own, so each resource the function
    captures gets a copy there, made from the original's state now: a
    variable's value, a lookup table's contents (`_table_copy`), a critical
    section's mutex (it holds no state). Returns the graph, the feeds (inputs
    and captured tensors), and what makes the copies.
    """
    captured = list(concrete.captured_inputs)
    explicit = concrete.inputs[: len(concrete.inputs) - len(captured)]
    placeholders = concrete.inputs[len(explicit) :]
    values = [_to_numpy(v) for v in tf.nest.flatten(list(tensors), expand_composites=True)]
    if len(values) != len(explicit):
        raise TfshardError(
            f"{name}.timeline(): the call has {len(values)} input tensors but its graph "
            f"takes {len(explicit)}"
        )
    variables = {id(v.handle): v for v in concrete.variables}
    start_values = {id(v): v.numpy() for v in concrete.variables}
    graph_def = concrete.graph.as_graph_def()
    # A table's contents are read now, eagerly, before the session's graph is the default.
    tables = {
        placeholder.name: _table_contents(value, uses)
        for placeholder, value in zip(placeholders, captured)
        if value.dtype == tf.resource and id(value) not in variables
        and (uses := _uses(graph_def, placeholder.op.name))
        and all(use.op in _TABLE_OPS for use in uses)
    }
    graph = tf.Graph()
    input_map, feeds, setup = {}, {}, _Setup()
    with graph.as_default():
        for placeholder, value in zip(placeholders, captured):
            if value.dtype != tf.resource:
                feeds[placeholder.name] = _to_numpy(value)
                continue
            variable = variables.get(id(value))
            copy_name = f"tfshard_timeline_{len(input_map)}"
            if variable is not None:
                init = tf.compat.v1.placeholder(variable.dtype, variable.shape)
                with tf.device(variable.device):
                    copy = tf.Variable(init, name=copy_name)
                setup.ops.append(copy.initializer)
                setup.feeds[init] = start_values[id(variable)]
                input_map[placeholder.name] = copy.handle
                # A control input on the capture (a critical section's body waits for
                # the resources it runs on) waits for the copy's handle instead.
                input_map[f"^{placeholder.op.name}"] = copy.handle
                continue
            uses = _uses(graph_def, placeholder.op.name)
            if placeholder.name in tables:
                contents = tables[placeholder.name]
                input_map[placeholder.name] = _table_copy(value, contents, copy_name, setup)
                input_map[f"^{placeholder.op.name}"] = input_map[placeholder.name]
            elif uses and {use.op for use in uses} <= _MUTEX_OPS:
                with tf.device(value.device):
                    input_map[placeholder.name] = tf.raw_ops.MutexV2(shared_name=copy_name)
                input_map[f"^{placeholder.op.name}"] = input_map[placeholder.name]
            else:
                ops = sorted({use.op for use in uses}) or ["nothing"]
                raise ArgumentError(
                    f"{name}.timeline(): the function captures a resource that is neither "
                    f"a variable, a lookup table nor a critical section ({placeholder.name}, "
                    f"used by {', '.join(ops)}: a queue, iterator or the like); a timeline "
                    "copies those three into its session only"
                )
        tf.graph_util.import_graph_def(graph_def, input_map=input_map, name="")
    for placeholder, value in zip(explicit, values):
        feeds[placeholder.name] = value
    return graph, feeds, setup


# Ops that use a lookup table, and the attributes naming its key and value dtypes (None:
# none). Any table answers them as a mutable hash table with its contents does.
_TABLE_OPS: dict[str, tuple[str, str] | None] = {
    "LookupTableFindV2": ("Tin", "Tout"),
    "LookupTableInsertV2": ("Tin", "Tout"),
    "LookupTableImportV2": ("Tin", "Tout"),
    "LookupTableExportV2": ("Tkeys", "Tvalues"),
    "LookupTableRemoveV2": None,
    "LookupTableSizeV2": None,
}
_MUTEX_OPS = frozenset({"MutexLock"})
# Function-calling ops: the attributes holding the functions, and how many of the
# op's first inputs are not the functions' arguments (an If's predicate, a Case's index).
_CALLS = {
    "PartitionedCall": (("f",), 0),
    "StatefulPartitionedCall": (("f",), 0),
    "If": (("then_branch", "else_branch"), 1),
    "StatelessIf": (("then_branch", "else_branch"), 1),
    "While": (("cond", "body"), 0),
    "StatelessWhile": (("cond", "body"), 0),
    "Case": (("branches",), 1),
    "StatelessCase": (("branches",), 1),
}


def _uses(graph_def: Any, name: str) -> list[Any]:
    """The nodes that use the tensor `name` of the graph, followed into the functions that
    take it (a shared trace's call, a cond's branches, a loop's body): the ops at the end."""
    library = {f.signature.name: f for f in graph_def.library.function}
    found: list[Any] = []
    seen: set[tuple[str, str]] = set()

    def follow(nodes: Sequence[Any], source: str, where: str) -> None:
        if (where, source) in seen:
            return
        seen.add((where, source))
        for node in nodes:
            inputs = [i for i in node.input if not i.startswith("^")]
            for index, given in enumerate(inputs):
                if given != source and given.split(":")[0] != source:
                    continue
                calls = _CALLS.get(node.op)
                if calls is None:
                    found.append(node)
                    continue
                attrs, skipped = calls
                for attr in attrs:
                    value = node.attr[attr]
                    functions = [f.name for f in value.list.func] or [value.func.name]
                    for function in functions:
                        body = library.get(function)
                        if body is not None and index >= skipped:
                            arg = body.signature.input_arg[index - skipped].name
                            follow(body.node_def, arg, function)

    follow(graph_def.node, name, "")
    return found


def _table_contents(handle: Any, uses: Sequence[Any]) -> tuple[Any, Any, Any, Any]:
    """A captured lookup table's key and value dtypes, keys and values, now (eagerly).

    The dtypes are those the function's table ops name; the contents are read
    with `LookupTableExportV2`, which every kind of table answers.
    """
    typed = [use for use in uses if _TABLE_OPS[use.op] is not None]
    if not typed:  # only its size is asked: any contents of that size do
        with tf.device(handle.device):
            size = int(tf.raw_ops.LookupTableSizeV2(table_handle=handle))
        return tf.int64, tf.int64, np.arange(size, dtype=np.int64), np.zeros([size], np.int64)
    key_attr, value_attr = _TABLE_OPS[typed[0].op]
    key_dtype = tf.as_dtype(typed[0].attr[key_attr].type)
    value_dtype = tf.as_dtype(typed[0].attr[value_attr].type)
    with tf.device(handle.device):
        keys, values = tf.raw_ops.LookupTableExportV2(
            table_handle=handle, Tkeys=key_dtype, Tvalues=value_dtype
        )
    return key_dtype, value_dtype, keys.numpy(), values.numpy()


def _table_copy(handle: Any, contents: tuple[Any, ...], name: str, setup: _Setup) -> Any:
    """A mutable hash table in the session's graph, set up with a captured table's contents
    (`_table_contents`): the function finds what it would find, and what it inserts goes to
    the copy."""
    key_dtype, value_dtype, keys, values = contents
    with tf.device(handle.device):
        if values.ndim > 1:
            table = tf.raw_ops.MutableHashTableOfTensorsV2(
                key_dtype=key_dtype,
                value_dtype=value_dtype,
                value_shape=values.shape[1:],
                shared_name=name,
            )
        else:
            table = tf.raw_ops.MutableHashTableV2(
                key_dtype=key_dtype, value_dtype=value_dtype, shared_name=name
            )
        key_feed = tf.compat.v1.placeholder(key_dtype, keys.shape)
        value_feed = tf.compat.v1.placeholder(value_dtype, values.shape)
        setup.ops.append(
            tf.raw_ops.LookupTableImportV2(table_handle=table, keys=key_feed, values=value_feed)
        )
    setup.feeds[key_feed] = keys
    setup.feeds[value_feed] = values
    return table


def _to_numpy(value: Any) -> Any:
    if isinstance(value, tf.Variable):
        value = value.value()
    if getattr(value, "dtype", None) == tf.resource:
        raise ArgumentError(
            "timeline(): an argument is a resource (a variable handle); pass its value"
        )
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def _session_config() -> Any:
    """A TF1 session config matching this process's devices and thread settings.

    A session reads no `tf.config`: the CPU split, the GPUs' virtual devices,
    memory growth, soft placement and the thread pools are copied into it.
    """
    cpus = len(tf.config.list_logical_devices("CPU"))
    config = tf.compat.v1.ConfigProto(
        allow_soft_placement=tf.config.get_soft_device_placement(),
        device_count={"CPU": cpus},
        intra_op_parallelism_threads=tf.config.threading.get_intra_op_parallelism_threads(),
        inter_op_parallelism_threads=tf.config.threading.get_inter_op_parallelism_threads(),
    )
    physical = tf.config.list_physical_devices("GPU")
    visible = tf.config.get_visible_devices("GPU")
    if len(visible) != len(physical):
        config.gpu_options.visible_device_list = ",".join(str(physical.index(d)) for d in visible)
    for gpu in visible:
        split = tf.config.get_logical_device_configuration(gpu) or []
        if split:
            limits = config.gpu_options.experimental.virtual_devices.add()
            limits.memory_limit_mb.extend(c.memory_limit for c in split)
        if tf.config.experimental.get_memory_growth(gpu):
            config.gpu_options.allow_growth = True
    return config


# -------------------------------------------------------------------- reading


@dataclasses.dataclass
class _Op:
    """One op execution in the step stats (times in ms from the run's first op)."""

    name: str
    op: str
    device: str  # local canonical name
    start: float
    end: float
    kind: str  # "op" (the executor), "kernel" (a GPU stream), "memcpy"
    output_bytes: list[int]


def _local(name: str) -> str:
    spec = tf.DeviceSpec.from_string(name)
    return tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index).to_string()


def _ops(step_stats: Any) -> list[_Op]:
    raw = []
    for stats in step_stats.dev_stats:
        device, kind = stats.device, "op"
        if "/memcpy" in device:
            device, kind = device.split("/memcpy")[0], "memcpy"
        elif "/stream:" in device:
            if device.endswith("/stream:all"):
                continue  # every stream's kernels again, merged
            device, kind = device.split("/stream:")[0], "kernel"
        local = _local(device)
        for node in stats.node_stats:
            start = (
                node.all_start_nanos / 1e6 if node.all_start_nanos else node.all_start_micros / 1e3
            )
            length = (
                node.all_end_rel_nanos / 1e6
                if node.all_end_rel_nanos
                else node.all_end_rel_micros / 1e3
            )
            op = node.timeline_label.split(" = ", 1)[-1].split("(", 1)[0].strip()
            sizes = [_tensor_bytes(o.tensor_description) for o in node.output]
            name = node.node_name.split(":", 1)[0]
            raw.append(_Op(name, op, local, start, start + length, kind, sizes))
    if raw:
        base = min(o.start for o in raw)
        for o in raw:
            o.start -= base
            o.end -= base
    return raw


def _tensor_bytes(description: Any) -> int:
    """A recorded output's size: its shape times its dtype's, else what was allocated.

    Not the allocation alone: a slice (each piece of a split) reports the
    buffer it shares with its parent.
    """
    dims = [d.size for d in description.shape.dim]
    if not description.shape.unknown_rank and all(d >= 0 for d in dims):
        dtype = tf.as_dtype(description.dtype)
        if dtype.is_numpy_compatible and dtype not in (tf.string, tf.resource, tf.variant):
            return int(np.prod(dims, dtype=np.int64)) * dtype.size
    return int(description.allocation_description.requested_bytes)


def _attribute(
    ops: list[_Op], count: int, outer: frozenset[str] = frozenset()
) -> tuple[list[list[_Op]], list[_Op], list[_Op]]:
    """Each op to its shard, the gather, or neither (see the module docstring).

    An op of the call's own graph (`outer`: the names in the partition graphs
    that ran) outside every shard's scope belongs to no shard, whenever it
    runs; only an op inside a called function (not in `outer`) goes to the
    shard whose call was running on its device.
    """
    shards: list[list[_Op]] = [[] for _ in range(count)]
    gather, other = [], []
    calls = [(k, o) for o in ops if o.op in _CALL_OPS and (k := shard_in(o.name)) is not None]
    for o in ops:
        k = shard_in(o.name)
        if k is None and o.name.startswith(f"{COLLECT_SCOPE}/"):
            gather.append(o)
            continue
        if k is None and o.name not in outer:
            running = [(j, c) for j, c in calls if c.start <= o.start <= c.end]
            here = {j for j, c in running if c.device == o.device}
            anywhere = {j for j, _ in running}
            if len(here) == 1:
                k = here.pop()
            elif not here and len(anywhere) == 1:
                k = anywhere.pop()
        if k is not None and k < count:
            shards[k].append(o)
        else:
            other.append(o)
    return shards, gather, other


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


def _copies(ops: list[_Op], partitions: Sequence[Any], fed: dict[str, int]) -> tuple[Copies, ...]:
    """Bytes sent between devices, and each device's memcpy time.

    The executed partition graphs list every tensor that crossed: a ``_Recv``
    on the receiving device for each (tensor, device) pair, whose ``_Send``
    names the tensor's producer, whose size the step stats give. `fed` gives
    the sizes of the tensors fed to the session (the call's inputs, captured
    tensors), which arrive on the host. Control edges carry no data.
    """
    produced = {(o.name, o.device): o.output_bytes for o in ops if o.kind == "op"}
    sends: dict[str, tuple[str, Any]] = {}  # tensor_name -> (device, the _Send's input)
    client: dict[str, str] = {}  # node name -> the fed tensor it receives
    receives = []
    for partition in partitions:
        for node in partition.node:
            attr = node.attr
            if node.op in ("_Send", "_HostSend"):
                sends[attr["tensor_name"].s.decode()] = (_local(node.device), node.input[0])
            elif node.op in ("_Recv", "_HostRecv"):
                if attr["client_terminated"].b:
                    client[node.name] = attr["tensor_name"].s.decode()
                else:
                    receives.append(node)
    moved: list[tuple[str, str, int]] = []
    for node in receives:
        sent = sends.get(node.attr["tensor_name"].s.decode())
        if sent is None:
            continue
        source, producer = sent
        name, _, slot = producer.partition(":")
        if "/ctrl/" in name or name.startswith("^"):
            continue  # a control edge's dummy value
        if name in client:
            size = fed.get(client[name], 0)
        else:
            sizes = produced.get((name, source), [])
            index = int(slot or 0)
            size = sizes[index] if index < len(sizes) else 0
        moved.append((source, _local(node.attr["recv_device"].s.decode()), size))
    bytes_in: dict[str, int] = {}
    bytes_out: dict[str, int] = {}
    for source, destination, size in moved:
        bytes_in[destination] = bytes_in.get(destination, 0) + size
        bytes_out[source] = bytes_out.get(source, 0) + size
    memcpy: dict[str, float] = {}
    for o in ops:
        if o.kind == "memcpy":
            memcpy[o.device] = memcpy.get(o.device, 0.0) + (o.end - o.start)
    devices = sorted(set(bytes_in) | set(bytes_out) | set(memcpy), key=_device_order)
    return tuple(Copies(d, bytes_in.get(d, 0), bytes_out.get(d, 0), memcpy.get(d)) for d in devices)


def _device_order(name: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(name)
    return (spec.device_type or "", spec.device_index or 0)


def _read(
    metadata: Any,
    fed: dict[str, int],
    devices: Sequence[str],
    rows: Sequence[int] | None,
    name: str,
) -> Timeline:
    ops = _ops(metadata.step_stats)
    outer = frozenset(n.name for g in metadata.partition_graphs for n in g.node)
    per_shard, gathered, other = _attribute(ops, len(devices), outer)
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
        gather = Span(**_span(gathered, gathered[0].device))
    leftover = _span(other, "")
    return Timeline(
        name=name,
        shards=shards,
        gather=gather,
        copies=_copies(ops, metadata.partition_graphs, fed),
        total_ms=max((o.end for o in ops), default=0.0),
        unattributed_ms=leftover["busy_ms"],
    )


# ---------------------------------------------------------------- formatting


def _lane(span: Span, end: float) -> str:
    """`span` as characters over [0, end]: '#' busy, '.' idle inside its span, ' ' outside."""
    cells = []
    step = end / _LANE_WIDTH
    for i in range(_LANE_WIDTH):
        a, b = i * step, (i + 1) * step
        covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in span.intervals)
        if span.ops and covered >= 0.25 * step:
            cells.append("#")
        elif span.ops and span.start_ms < b and a < span.end_ms:
            cells.append(".")
        else:
            cells.append(" ")
    return "".join(cells)
