"""The traced body of a parallelized function: plan, split, one `tf.device` block per shard.

`Engine` holds what one `ShardedFunction` resolved (devices, options) and the
graphs it traced. Its body, traced once per trace key into one `tf.function`:

    [N, ...] --plan--> sizes --tf.split--> K x [n_k, ...]
      --tf.device(d_k): vectorized_map(fn) or fn(shard)--> K outputs
      --collect (tf.device(output))--> [N, ...] in input order, or reduced

A shard on the output device or the host traces `fn` in place; the others,
when two or more, call one shared trace of it (`Engine._shard_runs` says
when not): most of a first call's cost saved for every shard past the second.

The dataset loop (`tfshard.datasets`) runs the same body once per batch inside
its own loop, with ``gather=False`` to collect every batch's shards itself.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import re
import threading
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tfshard import _arguments, _trees, cluster, collect, pinning
from tfshard.errors import ArgumentError, TfshardError, shard_error, user_frames
from tfshard.replicas import Replicas, check_no_writes, keras_of, variable_reads

# Integer weights are used as they are; other weights are scaled to integers
# with this total, so a plan is exact integer arithmetic, the same in the graph
# and in `Engine.plan`.
WEIGHT_SCALE = 1 << 24
SHARD_SCOPE = "tfshard_shard_"
# Nodes an error names: the failing one ({{node N}}), then context ([[N]]).
_ERROR_NODE_RE = re.compile(r"\{\{node ([^}]+)\}\}|\[\[([^\]{}\s]+)\]\]")
_IN_SHARD_RE = re.compile(r"(?:^|/)" + SHARD_SCOPE + r"(\d+)/")
_RECEIVE_RE = re.compile(r".*/_\d+")  # a receive the partitioner added, aborted with the step
# Each of several root errors: "  (0) INVALID_ARGUMENT: ...".
_ROOT_ERROR_RE = re.compile(r"^\s*\(\d+\) ([A-Z_]+):", re.MULTILINE)
MAX_ROWS = _arguments.MAX_ROWS
# A shard's computation: its rows and their number (int32) in, its outputs out.
ShardFn = Callable[[Sequence[Any], tf.Tensor], Any]
# Marks the in-graph check that a whole-shard function returned one row per row.
ROWS_DIFFER = "tfshard: per-row output with the wrong number of rows:"
# Marks the in-graph check that split arguments have the same rows (inside a tf.function).
INPUTS_DIFFER = "tfshard: split arguments with different numbers of rows:"


# ------------------------------------------------------------------- plans


def integer_weights(weights: Sequence[float] | None) -> tuple[int, ...] | None:
    """Validated weights as non-negative integers with a positive sum."""
    if weights is None:
        return None
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence | np.ndarray):
        raise ArgumentError(f"weights={weights!r}: pass one number per device, e.g. [3, 1]")
    values = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating):
            raise ArgumentError(f"weights[{i}]={w!r} is not a number")
        if math.isnan(w) or math.isinf(w):
            raise ArgumentError(f"weights[{i}]={w!r}: weights must be finite")
        if w < 0:
            raise ArgumentError(f"weights[{i}]={w!r} is negative; weights are relative speeds >= 0")
        values.append(w)
    if not any(w > 0 for w in values):
        raise ArgumentError(
            f"weights={list(weights)!r}: at least one weight must be > 0 "
            "(they are relative device speeds, e.g. [3, 1])"
        )
    if all(float(w).is_integer() for w in values):
        exact = [int(w) for w in values]  # Python ints: their sum cannot overflow
        if sum(exact) <= WEIGHT_SCALE:
            return tuple(exact)
    # Scale by the largest first: a sum of finite floats can overflow to inf.
    top = float(max(values))
    total = math.fsum(float(w) / top for w in values)
    return tuple(round(float(w) / top / total * WEIGHT_SCALE) for w in values)


def plan_sizes(n: tf.Tensor, count: int, weights: tuple[int, ...] | None) -> tf.Tensor:
    """Shard sizes for `n` rows on `count` devices, as an int64 vector summing to n.

    Unweighted, sizes differ by at most one and the first ``n % count`` shards
    get the extra row. Weighted, each shard gets the floor of its quota
    ``n * w_k / sum(w)`` and the rows left over go one each to the largest
    remainders (ties to the lower index): largest-remainder rounding.
    """
    n = tf.cast(n, tf.int64)
    index = tf.range(count, dtype=tf.int64)
    if weights is None:
        return n // count + tf.cast(index < n % count, tf.int64)
    w = tf.constant(weights, tf.int64)
    total = sum(weights)
    quota = n * w  # Exact: n < 2**31 and total <= 2**24 + count.
    base = quota // total
    remainder = quota % total
    left = n - tf.reduce_sum(base)  # 0 <= left < count
    # rank[k]: how many shards beat shard k for a leftover row.
    beats = (remainder[None, :] > remainder[:, None]) | (
        (remainder[None, :] == remainder[:, None]) & (index[None, :] < index[:, None])
    )
    rank = tf.reduce_sum(tf.cast(beats, tf.int64), axis=1)
    return base + tf.cast(rank < left, tf.int64)


def plan_rows(n: int, count: int, weights: tuple[int, ...] | None) -> list[int]:
    """`plan_sizes` in Python, for `plan`, `explain` and messages (no TF ops: works in a graph)."""
    if weights is None:
        return [n // count + (1 if k < n % count else 0) for k in range(count)]
    total = sum(weights)
    base = [n * w // total for w in weights]
    remainder = [n * w % total for w in weights]
    # The rows left over go one each to the largest remainders, ties to the lower index.
    for k in sorted(range(count), key=lambda k: (-remainder[k], k))[: n - sum(base)]:
        base[k] += 1
    return base


def rows(t: Any) -> tf.Tensor:
    """The number of rows of a tensor or ragged tensor, as an int64 scalar tensor."""
    return t.nrows() if isinstance(t, tf.RaggedTensor) else tf.shape(t, out_type=tf.int64)[0]


def host_cpu(device: str) -> str:
    """The CPU of the machine (task) that holds `device`: where plans and checks run."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def row_count(t: Any, device: str | None, host: str) -> tf.Tensor:
    """The rows of `t` as an int64 scalar on `host`; only a Shape op runs on `device`.

    On a GPU the Shape kernel leaves its output in host memory, so the count
    reaches the host without waiting for `t`'s device; int64 arithmetic placed
    on a GPU would copy it back and forth, and a host read would sync.
    """
    part = t.row_splits if isinstance(t, tf.RaggedTensor) else t
    with tf.device(device):
        shape = tf.shape(part, out_type=tf.int64)
    with tf.device(host):
        return shape[0] - 1 if isinstance(t, tf.RaggedTensor) else shape[0]


# The dtypes whose GPU SplitV kernels hold their data in device memory (TF
# 2.16-2.21; int32's kernel keeps it in host memory). The other numbers and
# bools would be split on the CPU and copied back (soft placement), so `split`
# moves them through a same-size float by Bitcast (it shares the buffer: free,
# exact, GPU kernels for every dtype); 1-byte dtypes have no such float and are
# cut with StridedSlice, whose GPU kernels hold them in device memory.
# tests/test_gpu_kernels.py checks both against the installed kernel registry.
SPLIT_DTYPES = frozenset(
    {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128}
)
SLICED_DTYPES = frozenset({tf.int8, tf.uint8, tf.bool})
_SAME_SIZE_FLOAT = {2: tf.float16, 4: tf.float32, 8: tf.float64}


def split(t: Any, sizes: tf.Tensor, count: int, host: str) -> list[Any]:
    """`t` split along axis 0 into `count` pieces of `sizes` rows, where `t` lives.

    Offsets are computed on `host`, where `sizes` is, so nothing the split
    reads waits for `t`'s device.
    """
    # [N, ...] -> count x [n_k, ...]
    if isinstance(t, tf.RaggedTensor):
        with tf.device(host):
            ends = tf.cumsum(tf.cast(sizes, t.row_splits.dtype))
            starts = ends - tf.cast(sizes, t.row_splits.dtype)
        return [t[starts[k] : ends[k]] for k in range(count)]
    if t.dtype in SLICED_DTYPES:
        with tf.device(host):
            ends = tf.cumsum(sizes)
            starts = ends - sizes
            bounds = [(starts[k : k + 1], ends[k : k + 1]) for k in range(count)]
        return [tf.strided_slice(t, begin, end) for begin, end in bounds]
    if t.dtype in SPLIT_DTYPES or not (t.dtype.is_integer and t.dtype.size in _SAME_SIZE_FLOAT):
        return tf.split(t, sizes, num=count, axis=0)
    pieces = tf.split(tf.bitcast(t, _SAME_SIZE_FLOAT[t.dtype.size]), sizes, num=count, axis=0)
    return [tf.bitcast(piece, t.dtype) for piece in pieces]


# ----------------------------------------------------------------- engine


class Engine:
    """What one parallelized function resolved, and the graphs it traced.

    Args:
      fn: the user's function.
      name: its name, for messages.
      devices: canonical device names, one shard each.
      output: where results land.
      weights: integer weights (`integer_weights`), or None for an even split.
      per_sample: vectorise `fn` over rows, or call it on each shard.
      reduce: None to gather, else one of `collect.REDUCTIONS`.
      reduce_label: the reduction the user asked for, for messages (a dataset
        mean runs its batches with a twin that sums).
      ragged: stack per-sample outputs as ragged tensors.
      jit_compile: compile each shard with XLA.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        devices: tuple[str, ...],
        output: str,
        weights: tuple[int, ...] | None,
        per_sample: bool,
        reduce: str | None,
        reduce_label: str | None,
        ragged: bool,
        jit_compile: bool,
    ) -> None:
        self.fn = fn
        self.name = name
        self.devices = devices
        self.output = output
        self.weights = weights
        self.per_sample = per_sample
        self.reduce = reduce
        self.reduce_label = reduce_label
        self.ragged = ragged
        self.jit_compile = jit_compile
        self.graphs: dict[Hashable, Any] = {}
        self.loops: dict[Hashable, Any] = {}  # traced loops over datasets (tfshard.datasets)
        # Output structures of graphs whose outputs tf.function rebuilds otherwise.
        self.rebuilt: dict[Hashable, Hashable] = {}
        self.lock = threading.RLock()
        self._twins: dict[str | None, Engine] = {}
        self._converted: Callable[..., Any] | None = None
        # Replicas of this engine's devices, as they were when its graphs were traced.
        self.replicas: Replicas | None = None
        self._generation = -1

    @property
    def trace_count(self) -> int:
        """Graphs traced so far: calls, dataset loops, and those of reduction twins."""
        twins = sum(twin.trace_count for twin in self._twins.values())
        return len(self.graphs) + len(self.loops) + twins

    def with_reduce(self, reduce: str | None) -> Engine:
        """This engine with another reduction (cached: it traces its own graphs)."""
        with self.lock:
            twin = self._twins.get(reduce)
            if twin is None:
                twin = Engine(
                    self.fn,
                    name=self.name,
                    devices=self.devices,
                    output=self.output,
                    weights=self.weights,
                    per_sample=self.per_sample,
                    reduce=reduce,
                    reduce_label=self.reduce_label,
                    ragged=self.ragged,
                    jit_compile=self.jit_compile,
                )
                self._twins[reduce] = twin
            return twin

    def plan(self, n: int) -> list[int]:
        """The shard sizes for `n` rows, in Python (the graph's `plan_sizes`, exactly)."""
        return plan_rows(int(n), len(self.devices), self.weights)

    # ------------------------------------------------------------ calls

    def trace(self, call: _arguments.Call) -> Any:
        """The concrete function for this call's trace key, traced on first use."""
        self.refresh_replicas()
        graph = self.graphs.get(call.key)
        if graph is not None:
            return graph
        with self.lock:
            graph = self.graphs.get(call.key)
            if graph is None:
                template, split_devices = call.template, call.key.split_devices

                def body(*tensors: Any) -> Any:
                    return self.body(template, tensors, split_devices)

                graph = tf.function(body, autograph=False).get_concrete_function(*call.specs())
                if self.jit_compile:
                    self._check_compiled_reads(graph)
                if self.replicas is not None:
                    check_no_writes(graph, self.replicas, self.name)
                outputs = _trees.flatten(graph.structured_outputs)[1]
                if _trees.has_defaultdict(outputs):
                    self.rebuilt[call.key] = outputs
                self.graphs[call.key] = graph
            return graph

    def refresh_replicas(self) -> None:
        """Picks up replicas, or replicated variables, made since the last trace.

        The graphs traced before go: one that captured a plain variable would
        not read the replicated one that a new model put in its place.
        """
        if self._generation == Replicas.generation:
            return
        with self.lock:
            generation = Replicas.generation
            found = Replicas.find(self.devices)
            if found is not None or self.replicas is not None:
                self.replicas = found
                self.graphs.clear()
                self.rebuilt.clear()
                self.loops.clear()
            self._generation = generation

    def _check_compiled_reads(self, graph: Any) -> None:
        """XLA cannot read a variable on another device: say so before the call fails."""
        for k, reads in enumerate(variable_reads(graph, self.devices)):
            remote = [r for r in reads if r.remote]
            if remote:
                names = ", ".join(f"{r.name} (on {r.device})" for r in remote[:3])
                more = f" and {len(remote) - 3} more" if len(remote) > 3 else ""
                raise ArgumentError(
                    f"{self.name}: with jit_compile=True, shard {k} on {self.devices[k]} "
                    f"reads {names}{more}, and XLA cannot read a variable on another "
                    "device. Create the variables inside `with f.replicas():` (a copy per "
                    "device; f.replicate(model) copies a built Keras model), or pass "
                    "jit_compile=False"
                )

    def call(self, call: _arguments.Call) -> Any:
        """Runs one call through its traced graph; results land on the output device."""
        graph = self.trace(call)
        try:
            # The call op's device is where TF leaves the function's outputs.
            with tf.device(self.output):
                result = graph(*call.tensors)
        except tf.errors.OpError as error:
            raise self.call_error(error, call.rows) from None
        structure = self.rebuilt.get(call.key)
        if structure is None:
            return result
        # As tf.nest would: the function's own defaultdicts, factories included.
        return _trees.build(structure, iter(_trees.flatten(result)[0]))

    def call_error(self, error: tf.errors.OpError, rows: int | None) -> Exception:
        """A failed call's error, naming the shard and, for a dead worker, the remedy."""
        if ROWS_DIFFER in error.message:
            return rows_error(self.name, self.devices, error.message)
        if INPUTS_DIFFER in error.message:
            return inputs_error(self.name, error.message)
        k = failing_shard(error.message)
        wrapped = error
        if k is not None:
            if rows is not None:
                sizes = self.plan(rows)
                start = sum(sizes[:k])
                where = f"rows [{start}:{start + sizes[k]}) of {rows}"
            else:
                where = "its slice of the batch"
            wrapped = shard_error(
                error,
                f"{self.name}: shard {k} on {self.devices[k]} ({where}) failed: "
                f"{user_frames(error.message)}",
            )
        hint = cluster.explain_remote_error(error)  # None unless a worker is down
        # pfor's own failures: stacking per-sample results whose shapes differ.
        pfor_stack = "/pfor/" in error.message and (
            "TensorList" in error.message or "Incompatible shapes" in error.message
        )
        if hint is None and self.per_sample and not self.ragged and pfor_stack:
            hint = (
                "It failed inside tf.vectorized_map (pfor), which cannot vectorize every op "
                "(string ops and shapes that vary by sample among them): pass ragged=True "
                "to map the function over one sample at a time (tf.map_fn) instead"
            )
        if hint is not None:
            wrapped = shard_error(wrapped, f"{wrapped.message}\n{hint}")
        return wrapped

    # ------------------------------------------------------------- body

    def body(
        self,
        template: _arguments.Template,
        tensors: Sequence[Any],
        split_devices: Sequence[str],
        gather: bool = True,
        presplit: tuple[tf.Tensor, tf.Tensor, list[list[Any]]] | None = None,
        share: bool = True,
    ) -> Any:
        """The traced body: split, one shard per device, then collect.

        With `gather` False, the shards' outputs are returned as they are, one
        structure per shard (checked alike), for a caller that collects them
        itself (the dataset loop, which gathers every batch's shards at once).

        `presplit` is ``(rows, sizes, pieces)`` of inputs planned and split
        already, ``pieces[i][k]`` input i's rows for shard k (the dataset loop
        copies them to their devices a batch ahead); the split slots of
        `tensors` are then not read.

        With `share`, shards share one trace of the function where they can;
        without it (the dataset loop), each traces its own unless XLA compiles
        them (`_shard_runs`).
        """
        count = len(self.devices)
        inputs, shared = tensors[: template.split_count], tensors[template.split_count :]
        host = host_cpu(self.output)
        if presplit is None:
            total, sizes = self._plan(inputs, split_devices, template.split_paths(), host)
        else:
            total, sizes, pieces = presplit
        with tf.device(host):
            per_shard = tf.unstack(sizes, num=count)
            # Each shard's rows as it takes them (`skip_if_empty`): an int32 scalar,
            # which a function on a GPU takes in host memory.
            shard_rows = [tf.cast(size, tf.int32) for size in per_shard]
        if presplit is None:
            pieces = []
            for tensor, device in zip(inputs, split_devices):
                # Split where the input lives, so each shard crosses to its device once.
                with tf.device(device or None):
                    pieces.append(split(tensor, sizes, count, host))
        runs = self._shard_runs(self._shard_fn(template, shared, [p[0] for p in pieces]), share)
        outputs = []
        for k, (device, run) in enumerate(zip(self.devices, runs)):
            # With replicas, the shard reads the copy of each variable on its device.
            replica = self.replicas.shard(device) if self.replicas else contextlib.nullcontext()
            with tf.name_scope(f"{SHARD_SCOPE}{k}"), tf.device(device), replica:
                outputs.append(run([p[k] for p in pieces], shard_rows[k]))
        structure, flat = check_outputs(outputs, self.devices, concatenated=self.reduce is None)
        counted: dict[int, tf.Tensor] = {}
        if gather:
            with tf.name_scope("tfshard_collect"), tf.device(self.output):
                results, counted = self._collect(structure, flat, per_shard, total)
        if not self.per_sample:
            with tf.name_scope("tfshard_rows"):
                self._check_rows(structure, flat, sizes, host, counted)
        if not gather:
            return outputs
        return _trees.build(structure, iter(results))

    def _plan(
        self, inputs: Sequence[Any], split_devices: Sequence[str], paths: list[str], host: str
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The rows and the shard sizes, on the host (int64 arithmetic never runs on a GPU).

        Inside a tf.function the split arguments' rows are unknown to Python, so
        there the plan waits for a check that they are equal.
        """
        counts = [row_count(t, d or None, host) for t, d in zip(inputs, split_devices)]
        with tf.device(host):
            checks = []
            # Python checked them already unless an input came from a graph (device "").
            if len(counts) > 1 and not all(split_devices):
                checks.append(
                    host_assert(
                        tf.stack(counts),
                        tf.fill([len(counts)], counts[0]),
                        f"{INPUTS_DIFFER} {', '.join(paths)} :end (their rows, then the "
                        "first's: every split argument needs the same leading dimension; "
                        "name one in broadcast=(...) to copy it whole to each device)",
                    )
                )
            with tf.control_dependencies(checks):
                return counts[0], plan_sizes(counts[0], len(self.devices), self.weights)

    def _check_rows(
        self,
        structure: Hashable,
        flat: list[list[Any]],
        sizes: tf.Tensor,
        host: str,
        counted: dict[int, tf.Tensor],
    ) -> None:
        """Checks, on the host, that per-row outputs of whole shards have one row per row.

        Gathered outputs are all per-row; under a reduction, those whose first
        dimension is unknown when traced (as the shard's rows are) are. A
        gathered output's counts come from its gather (`counted`); others get
        a Shape op per shard.
        """
        for i, first in enumerate(flat[0]):
            if self.reduce is not None and not per_row(first):
                continue
            path = _trees.path("outputs", structure, i)
            got = counted.get(i)
            if got is None:
                got = tf.stack([row_count(flat[k][i], d, host) for k, d in enumerate(self.devices)])
            with tf.device(host):  # one check per output, all shards at once
                host_assert(
                    got,
                    sizes,
                    f"{ROWS_DIFFER} {path} :end (each shard's, then its input rows: with "
                    "per_sample=False an output needs one row per input row, or a fixed "
                    "shape under reduce=)",
                )

    def _collect(
        self, structure: Hashable, flat: list[list[Any]], sizes: list[tf.Tensor], total: tf.Tensor
    ) -> tuple[list[Any], dict[int, tf.Tensor]]:
        """Each output leaf gathered in shard order, or reduced over all samples.

        Returns:
          The results, and for gathered leaves the row count of each shard's
          output as the gather saw it (by leaf index; none for unknown rank).
        """
        results, counted = [], {}
        for i in range(len(flat[0])):
            per_shard = [leaves[i] for leaves in flat]
            if self.reduce is None:
                result, lengths = collect.gather_counted(per_shard)
                results.append(result)
                if lengths is not None:
                    counted[i] = lengths
                continue
            path = _trees.path("outputs", structure, i)
            collect.check_reducible(per_shard[0], self.reduce_label or self.reduce, path)
            by_row = self.per_sample or per_row(per_shard[0])
            partials = []
            for k, device in enumerate(self.devices):
                # Each shard reduces its own rows where they are.
                with tf.device(device):
                    partials.append(
                        collect.shard_partial(per_shard[k], sizes[k], self.reduce, by_row)
                    )
            results.append(collect.combine(partials, total, self.reduce))
        return results, counted

    def _shard_fn(
        self,
        template: _arguments.Template,
        shared: Sequence[Any],
        example: Sequence[Any],
    ) -> Shard:
        """The computation of one shard, and what a shard without rows returns instead."""
        if self._converted is None:
            self._converted = autographed(self.fn)
        fn, name, per_sample = self._converted, self.name, self.per_sample

        def call(rows_in: Sequence[Any]) -> Any:
            args, kwargs = template.rebuild(rows_in, shared)
            try:
                outputs = fn(*args, **kwargs)
            except TfshardError:
                raise
            except (ValueError, TypeError) as error:
                what = "one sample" if per_sample else "one shard"
                shapes = ", ".join(str(r.shape) for r in rows_in)
                raise ArgumentError(
                    f"{name} failed while being traced on {what} (split argument shapes "
                    f"{shapes}): {type(error).__name__}: {error}\nIf it expects a whole "
                    "batch, pass per_sample=False; if an argument must reach every shard "
                    "whole, name it in broadcast=(...)"
                ) from error
            return to_tensors(outputs, name)

        return vectorized(call, example, self.ragged) if per_sample else whole_shard(call)

    def _shard_runs(self, shard: Shard, share: bool) -> list[ShardFn]:
        """How each shard runs: traced in place, or one trace the shards share.

        Tracing is most of a first call (a vectorized function's pfor
        conversion above all), so shards share one trace where that is right:
        a function (`one_trace`) each calls under its own scope and device. It
        is not inlined, so a failing op's error carries the calling op's name
        (``tfshard_shard_k/...``) as context, which names the shard.

        A shard on the output device or the host traces in place: a failure
        inside a called function cancels the step, and the receives pending
        beside its call (the gather's, the row checks') can then report their
        cancellation first, so the error itself would be lost (measured: 3 to
        14 of 20 failures of shard 0 came back as a bare CancelledError). In
        place, the failing op is the first the step sees.

        No sharing: with replicas (each shard captures its own device's
        copies), without `share`, across workers (a failing call loses its
        error to the cancelled receives from other tasks: 7 of 18 failures
        came back as a bare CancelledError), or where one shard would call the
        shared trace (two devices): a trace called once saves no tracing, and
        the call's instantiation cost ~15 % of a two-device first call
        (measured, benchmarks/first_call.py). With XLA every shard calls one compiled
        function: a compiled call runs as one kernel, not a nested step.

        Calls run at once whatever the function does (`unordered`): no order
        of side effects across shards is promised, and none is imposed. A
        trace that writes a resource (`writes_resources`: a variable, a
        Generator's state) is not shared: TensorFlow orders the writes to one
        resource in graph order, and for a call that means the whole call, so
        the shards would run in turn. Traced in place, only the writes are
        ordered (TensorFlow inlines in-place shards into the step), and the
        shards' work overlaps. A compiled shard is one call either way: under
        XLA, shards that write one resource run in turn.
        """
        count = len(self.devices)

        def guarded(rows_in: Sequence[Any], rows: tf.Tensor) -> Any:
            return skip_if_empty(shard, rows_in, rows > 0)

        if self.jit_compile:
            if self.replicas is not None:  # a trace per device: tf.function keys on it
                compiled = tf.function(_taking_token(guarded), autograph=False, jit_compile=True)
                return unordered(compiled, self.devices)
            return unordered(one_trace(guarded, jit_compile=True), self.devices)
        host = host_cpu(self.output)
        in_place = [
            pinning.same_device(d, self.output) or pinning.same_device(d, host)
            for d in self.devices
        ]
        remote = any(pinning.is_remote(d) for d in (*self.devices, self.output))
        if not share or self.replicas is not None or remote or in_place.count(False) < 2:
            return [guarded] * count
        # "_noinline" reaches TF through the public `experimental_attributes`,
        # which accepts it by name (its allowlist for `tf.function`); the
        # underscore is TF's spelling, not a private API. Pinned by
        # test_shards_off_the_output_device_call_one_shared_trace_each_on_its_device.
        shared = one_trace(guarded, experimental_attributes={"_noinline": True})
        off = [d for d, here in zip(self.devices, in_place) if not here]
        calls = iter(unordered(shared, off))
        writes: list[bool] = []  # whether the shared trace writes a resource, once known

        def in_place_if_writing(call: ShardFn) -> ShardFn:
            def run(rows_in: Sequence[Any], rows: tf.Tensor) -> Any:
                if not writes:
                    writes.append(writes_resources(shared.traced(rows_in)))
                return guarded(rows_in, rows) if writes[0] else call(rows_in, rows)

            return run

        return [guarded if here else in_place_if_writing(next(calls)) for here in in_place]


def failing_shard(message: str) -> int | None:
    """The shard a TF error's message says failed, or None.

    A message holds one error, or several root errors of which the first that
    is not a cancellation is the cause. An error names its failing node
    (``{{node N}}``), then the calls it ran in (``[[N]]``), innermost first.
    The node is shard k's when it is in shard k's scope (traced in place), or
    when it is inside a function called in shard k's scope
    (``[[tfshard_shard_k/StatefulPartitionedCall]]``, the shared trace); the
    outermost such name counts, as a parallelized function inside a shard
    names its own shards too. A receive (``.../_12``) that TF aborted with the
    step failed because something else did: it names no shard.
    """
    for block in _root_errors(message):
        names = [(failing, failing or call) for failing, call in _ERROR_NODE_RE.findall(block)]
        while names and not names[0][0]:
            names.pop(0)  # calls before any failing node name nothing
        if not names:
            continue
        if _RECEIVE_RE.fullmatch(names[0][1]):
            continue  # an aborted receive: the cause is another root error
        found = None
        for i, (failing, name) in enumerate(names):
            if i and failing:
                break  # the next node's report: the failing node's calls ended
            shard = _IN_SHARD_RE.search(name)
            if shard is not None and not _RECEIVE_RE.fullmatch(name):
                found = int(shard.group(1))  # the outermost call wins (nested tfshard)
        return found  # None: a node outside every shard failed
    return None


def _root_errors(message: str) -> list[str]:
    """The root errors a TF message lists, cancellations left out (all of it if one)."""
    starts = list(_ROOT_ERROR_RE.finditer(message))
    if not starts:
        return [message]
    ends = [m.start() for m in starts[1:]] + [len(message)]
    return [message[m.end() : end] for m, end in zip(starts, ends) if m.group(1) != "CANCELLED"]


# A shard's computation that also takes a resource handle it never reads (`unordered`).
TokenShardFn = Callable[[Sequence[Any], tf.Tensor, tf.Tensor], Any]
# Op types that write a resource they are given (prefixes): variables, Generator states.
_RESOURCE_WRITES = (
    "Assign",
    "ResourceApply",
    "ResourceScatter",
    "ResourceSparseApply",
    "ResourceStridedSliceAssign",
    "RngReadAndSkip",
    "RngSkip",
    "StatefulRandomBinomial",
    "StatefulStandardNormal",
    "StatefulTruncatedNormal",
    "StatefulUniform",
)


class OneTrace:
    """`guarded` as one `tf.function`, traced on first use; every later call runs that trace.

    A `tf.function` would trace again under each device scope (its cache keys
    on the scope), so every call goes to the first call's concrete function,
    traced with any number of rows. Outputs leave it flat and are rebuilt
    with the traced structure, so a defaultdict stays one. A call also takes
    a token, a resource handle the trace never reads (`unordered`).

    Args:
      guarded: a shard's computation, from its rows and their number.
      **options: for `tf.function` (``jit_compile``, ``experimental_attributes``).
    """

    def __init__(self, guarded: ShardFn, **options: Any) -> None:
        self._structure: list[Hashable] = []

        def flat(rows_in: Sequence[Any], rows: tf.Tensor, token: tf.Tensor) -> list[Any]:
            del token  # its handle alone keeps this call out of the stateful chain
            leaves, key = _trees.flatten(guarded(rows_in, rows), "outputs")
            self._structure.append(key)
            return leaves

        self._function = tf.function(flat, autograph=False, **options)
        self._traced: Any = None

    def traced(self, rows_in: Sequence[Any]) -> Any:
        """The concrete function, traced on first use for rows like `rows_in`, any number."""
        if self._traced is None:
            specs = [_arguments.type_spec(r, split=True) for r in rows_in]
            self._traced = self._function.get_concrete_function(
                specs, tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.resource)
            )
        return self._traced

    def __call__(self, rows_in: Sequence[Any], rows: tf.Tensor, token: tf.Tensor) -> Any:
        flat = self.traced(rows_in)(list(rows_in), rows, token)
        return _trees.build(self._structure[0], iter(flat))


def one_trace(guarded: ShardFn, **options: Any) -> OneTrace:
    """`guarded` as one trace every shard calls (`OneTrace`)."""
    return OneTrace(guarded, **options)


def unordered(function: TokenShardFn, devices: Sequence[str]) -> list[ShardFn]:
    """Calls of `function`, one per device, that TensorFlow does not chain one after another.

    Inside a `tf.function`, automatic control dependencies chain every
    stateful op that takes no resource in the order it was traced, and a
    call of a function is stateful when its body is (a random op, dropout,
    `tf.print`, an assertion). A non-inlined call is one kernel, so a shard
    would wait for the whole of the shard before it. Ops that take a resource
    are ordered per resource instead, and reads of one resource not against
    each other: each call here takes a token, a variable handle on its own
    device that nothing reads or writes, so the calls are ordered only by the
    resources they write (`writes_resources`). The tokens are made here,
    before any shard, so they wait for nothing the shards do. Every call still
    runs (a stateful call is an output of the step), and each keeps the order
    of side effects inside it.

    Args:
      function: a shard's computation from its rows, their number and a token.
      devices: the device of each call, in shard order.

    Returns:
      One computation per device, from its rows and their number.
    """
    tokens = []
    for device in devices:
        with tf.device(device):
            tokens.append(
                tf.raw_ops.VarHandleOp(
                    dtype=tf.float32, shape=[], shared_name="tfshard_unordered_token"
                )
            )
    return [functools.partial(_with_token, function, token) for token in tokens]


def _with_token(
    function: TokenShardFn, token: tf.Tensor, rows_in: Sequence[Any], rows: tf.Tensor
) -> Any:
    return function(rows_in, rows, token)


def _taking_token(guarded: ShardFn) -> TokenShardFn:
    def run(rows_in: Sequence[Any], rows: tf.Tensor, token: tf.Tensor) -> Any:
        del token  # see `unordered`
        return guarded(rows_in, rows)

    return run


def writes_resources(concrete: Any) -> bool:
    """Whether a traced function, or one it calls, writes a resource (`_RESOURCE_WRITES`)."""
    graph = concrete.graph.as_graph_def()
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return any(node.op.startswith(_RESOURCE_WRITES) for node in nodes)


def autographed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with autograph applied, as `tf.function` would apply it.

    A function converts; a method (bound, or a `WeakMethod`) converts as its
    function and binds again; a callable object converts its class's
    ``__call__``, bound to it (`tf.autograph.to_graph` takes no objects). A
    Keras layer is left as it is (Keras converts its own ``call``), and so is a
    `tf.function` (it converts itself). Anything that does not convert is
    called as written.
    """
    if isinstance(fn, types.MethodType):
        return types.MethodType(_converted(fn.__func__), fn.__self__)
    if isinstance(fn, WeakMethod):
        return fn.with_func(_converted(fn.__func__))
    if is_keras_layer(fn):
        return fn
    call = inspect.getattr_static(type(fn), "__call__", None)  # a function's: a slot wrapper
    if isinstance(call, types.FunctionType) and not hasattr(fn, "get_concrete_function"):
        return types.MethodType(_converted(call), fn)
    return _converted(fn)


def _converted(fn: Callable[..., Any]) -> Callable[..., Any]:
    if hasattr(fn, "get_concrete_function"):  # a tf.function, or a ShardedFunction
        return fn
    try:
        return tf.autograph.to_graph(fn)
    except Exception:  # no source to read, a builtin: call it as written
        return fn


def is_keras_layer(fn: Any) -> bool:
    """Whether `fn` is a Keras layer or model (which takes batches, and converts itself)."""
    return keras_of(fn) is not None


class WeakMethod:
    """A method that holds its instance weakly and looks it up at each call.

    What a method decorated with `parallelize` runs as: its engine (and the
    graphs it traces) is cached per instance, as `tf.function` caches them,
    and that cache must not keep the instance alive. The caller holds the
    instance for the length of each call (`tfshard.parallel`'s bound
    function), so the function's ``self`` is always the instance itself.

    Args:
      func: the function of the class, taking the instance first.
      instance: the instance to call it with.
    """

    def __init__(self, func: Callable[..., Any], instance: Any) -> None:
        self.__func__ = func
        self._instance = weakref.ref(instance)
        functools.update_wrapper(self, func, updated=())
        # Without self, as a bound method's; it also stops inspect's unwrapping here.
        with contextlib.suppress(TypeError, ValueError):  # a builtin may have none
            self.__signature__ = inspect.signature(types.MethodType(func, instance))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        instance = self._instance()
        if instance is None:
            raise ReferenceError(
                f"{self.__name__}: the instance this method was bound to no longer exists"
            )
        return self.__func__(instance, *args, **kwargs)

    def with_func(self, func: Callable[..., Any]) -> WeakMethod:
        """This method with another function (its converted form), bound to the same instance."""
        other = copy.copy(self)
        other.__func__ = func
        return other


class Shard(NamedTuple):
    """What one shard computes.

    Attributes:
      run: its outputs, from its rows (traced in place or shared, `Engine._shard_runs`).
      empty: the outputs of a shard with no rows instead, from what `run`
        returned when traced, or None to run it after all (`skip_if_empty`).
    """

    run: Callable[[Sequence[Any]], Any]
    empty: Callable[[Any], Any]


def skip_if_empty(shard: Shard, rows_in: Sequence[Any], has_rows: tf.Tensor) -> Any:
    """`shard.run(rows_in)` where the shard has rows, `shard.empty` where not, as one `tf.cond`.

    tfshard makes the empty shards (fewer rows than devices), so it must not
    make them fail or return outputs of the wrong shape. The predicate is the
    planned size, known before the shard's rows are. The cond costs a
    per-sample call on 2 CPU devices ~1.5 % at 8 rows and ~5 % at 1024 (no
    buffer forwarding into its branch).
    """
    traced: list[Any] = []

    def with_rows() -> Any:
        traced.append(shard.run(rows_in))
        return traced[0]

    def without() -> Any:  # traced after with_rows, so it sees its outputs
        outputs = shard.empty(traced[0])
        return shard.run(rows_in) if outputs is None else outputs

    return tf.cond(has_rows, with_rows, without)


def vectorized(
    call: Callable[[Sequence[Any]], Any], example: Sequence[Any], ragged_outputs: bool
) -> Shard:
    """`call` of one sample, mapped over the rows of a shard.

    An empty shard returns empty outputs of the per-sample signature:
    vectorized_map over nothing gives outputs of the wrong inner shape (a
    per-sample matmul's [0, 2, 1] for [0, 2, 3]), and some conversions fail
    on it outright (pfor's tf.print reads row 0). A reshape to the per-sample
    shape would fix the shapes for free, but not the failures, which nothing
    in the graph announces.
    """
    signature = sample_signature(call, example, ragged_outputs)
    leaves, _ = _trees.flatten(signature)
    # Rows of different lengths in or out: vectorize cannot stack them.
    ragged = (
        ragged_outputs
        or any(isinstance(t, tf.RaggedTensor) for t in example)
        or any(isinstance(s, tf.RaggedTensorSpec) for s in leaves)
    )

    def each(rows_in: Sequence[Any]) -> Any:
        # Rows of a dtype without GPU GatherV2/TensorList kernels (what both maps
        # take rows with) enter as their carrier and are cast back per sample.
        dtypes = [r.dtype for r in rows_in]
        entering = tuple(r if is_ragged(r) else collect.carried(r) for r in rows_in)

        def one(rows: Sequence[Any]) -> Any:
            return call(
                [r if is_ragged(r) else collect.uncarried(r, d) for r, d in zip(rows, dtypes)]
            )

        if ragged:
            return tf.map_fn(one, entering, fn_output_signature=signature, name="per_sample")
        return tf.vectorized_map(one, entering, fallback_to_while_loop=True)

    return Shard(each, lambda outputs: collect.empty(signature))


def whole_shard(call: Callable[[Sequence[Any]], Any]) -> Shard:
    """`call` of a whole shard.

    Many batch functions fail on an empty batch (TF's CPU Conv2D returns its
    input unchanged, so a Keras CNN fails at its bias add), so an empty shard
    gives, for each output of the traced shard, zeros with 0 rows where the
    output is per row (`per_row`) and the output's own shape otherwise (a
    reduction ignores an empty shard's value). Where an output's shape is not
    known well enough for that (unknown rank or inner dimensions, ragged), the
    empty shard calls the function after all.
    """

    def empty(outputs: Any) -> Any:
        leaves, structure = _trees.flatten(outputs)
        if not all(isinstance(t, tf.Tensor) and _known_but_rows(t.shape) for t in leaves):
            return None
        return _trees.build(structure, iter([_no_rows(t) for t in leaves]))

    return Shard(call, empty)


def _known_but_rows(shape: tf.TensorShape) -> bool:
    """Known rank, and every dimension but the first known: zeros can stand in."""
    return shape.rank is not None and all(d is not None for d in shape[1:])


def _no_rows(t: tf.Tensor) -> tf.Tensor:
    dims = [0 if d is None else d for d in t.shape]
    if per_row(t):
        dims[0] = 0
    return tf.zeros(dims, t.dtype)


def is_ragged(t: Any) -> bool:
    return isinstance(t, tf.RaggedTensor)


def inputs_error(name: str, message: str) -> ArgumentError:
    """The failed in-graph check of the split arguments' rows as an ArgumentError."""
    paths = _assert_text(message, INPUTS_DIFFER).split(", ")
    got, want, k = _assert_vectors(message)
    if k is None or k >= len(paths):
        differ = "the split arguments have different numbers of rows"
    else:
        differ = f"{paths[k]} has {got[k]} rows but {paths[0]} has {want[k]}"
    return ArgumentError(
        f"{name}: {differ}; every split argument needs the same leading dimension "
        "(name an argument in broadcast=(...) to copy it whole to each device)"
    )


def rows_error(name: str, devices: Sequence[str], message: str) -> ArgumentError:
    """The failed check of `_check_rows` as an ArgumentError naming shard and fix."""
    path = _assert_text(message, ROWS_DIFFER)
    got, want, k = _assert_vectors(message)
    where = ""
    if k is not None:
        where = f" on shard {k} ({devices[k]}) has {got[k]} rows for {want[k]}"
    return ArgumentError(
        f"{name}: {path}{where or ' has the wrong number of rows'}; with "
        "per_sample=False each output must have one row per input row to be gathered "
        "in order (return a [rows, ...] tensor), or be of fixed shape under reduce= "
        "(a shard's value: pass reduce='sum'/'mean'/'max'/'min')"
    )


def _assert_text(message: str, marker: str) -> str:
    """The text after `marker` in a failed assert's message (TF escapes its quotes)."""
    return message.split(marker, 1)[1].split(" :end", 1)[0].strip().replace("\\'", "'")


def host_assert(got: tf.Tensor, want: tf.Tensor, message: str) -> tf.Operation:
    """An Assert that `got` equals `want` (small int vectors), printing both if not.

    `tf.debugging.assert_equal` guards its Assert with a tf.cond (an If op, ~20 us
    a call here) so that costly data is only computed on failure; these vectors
    cost nothing, so the Assert runs unguarded.
    """
    return tf.raw_ops.Assert(
        condition=tf.reduce_all(tf.equal(got, want)),
        data=[tf.constant(message), got, want],
        summarize=int(want.shape[0]),  # K: a row count per shard
    )


def _assert_vectors(message: str) -> tuple[list[int], list[int], int | None]:
    """The two vectors a failed `host_assert` printed, and their first differing index."""
    # It prints its data: "[message :end (...)] [1 4] [4 4]".
    vectors = re.findall(r"(?<=\] )\[(-?\d+(?: -?\d+)*)\]", message)
    if len(vectors) < 2:
        return [], [], None
    got, want = ([int(v) for v in vector.split()] for vector in vectors[:2])
    k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return got, want, k


def per_row(value: Any) -> bool:
    """Whether a whole-shard function's output holds one value per row of the shard.

    Its first dimension is then unknown when traced, as the shard's rows are;
    an output of fixed shape (a loss, a gradient) is the shard's own value.
    """
    return value.shape.rank is not None and value.shape.rank >= 1 and value.shape[0] is None


def sample_signature(call: Callable[..., Any], example: Sequence[Any], ragged: bool) -> Any:
    """Output specs of the function on one sample; ragged where shapes vary."""
    specs = tuple(_arguments.row_spec(t) for t in example)
    probe = tf.function(lambda *rows_in: call(rows_in), autograph=False)
    outputs = probe.get_concrete_function(*specs).structured_outputs

    def to_spec(value: Any, path: str) -> tf.TypeSpec:
        if isinstance(value, tf.RaggedTensor):
            return tf.RaggedTensorSpec(value.shape, value.dtype, value.ragged_rank)
        if value.shape.rank is None:
            # Nothing to stack ragged by (e.g. a py_function): assume one shape.
            if ragged:
                raise ArgumentError(
                    f"{path} has unknown rank, so ragged=True cannot stack it; give it "
                    "a shape in the function (tf.ensure_shape(value, [None]))"
                )
            return tf.TensorSpec(value.shape, value.dtype)
        if value.shape.rank > 0 and (ragged or not value.shape.is_fully_defined()):
            # Per-sample shapes that can vary are stacked as a ragged tensor; a scalar
            # per sample has one shape and stacks to a dense [N], ragged=True or not.
            return tf.RaggedTensorSpec(value.shape, value.dtype, ragged_rank=0)
        return tf.TensorSpec(value.shape, value.dtype)

    leaves, key = _trees.flatten(outputs, "outputs")
    specs = [to_spec(leaf, _trees.path("outputs", key, i)) for i, leaf in enumerate(leaves)]
    return _trees.build(key, iter(specs))


def check_outputs(
    outputs: list[Any], devices: Sequence[str], concatenated: bool
) -> tuple[Hashable, list[list[Any]]]:
    """Checks that every shard returned the same structure, ranks and dtypes.

    Args:
      outputs: one output structure per shard.
      devices: the shards' devices, for messages.
      concatenated: the outputs are concatenated along axis 0 (no reduction),
        so a scalar per shard is an error.

    Returns:
      The structure key and each shard's flat output leaves.
    """
    reference_leaves, reference = _trees.flatten(outputs[0], "outputs")
    flat = [reference_leaves]
    for k, result in enumerate(outputs[1:], start=1):
        leaves, structure = _trees.flatten(result, "outputs")
        if structure != reference:
            ours = _trees.paths("outputs", structure)
            theirs = _trees.paths("outputs", reference)
            raise ArgumentError(
                f"{_trees.first_difference('outputs', structure, reference)} differs between "
                f"shards: on {devices[k]} the function returned {', '.join(ours)} but on "
                f"{devices[0]} {', '.join(theirs)}; every shard must return the same structure"
            )
        for i, (leaf, first) in enumerate(zip(leaves, reference_leaves)):
            if leaf.shape.rank != first.shape.rank or leaf.dtype != first.dtype:
                raise ArgumentError(
                    f"{_trees.path('outputs', reference, i)} has rank {leaf.shape.rank} "
                    f"({leaf.dtype.name}) on {devices[k]} but rank {first.shape.rank} "
                    f"({first.dtype.name}) on {devices[0]}; every shard must return the same "
                    "ranks and dtypes"
                )
        flat.append(leaves)
    if concatenated:
        for i, leaf in enumerate(reference_leaves):
            if leaf.shape.rank == 0:
                raise ArgumentError(
                    f"{_trees.path('outputs', reference, i)} is a scalar per shard; with "
                    "per_sample=False outputs are concatenated along axis 0, so return a "
                    "[rows, ...] tensor, or pass reduce='sum'/'mean'/'max'/'min' to "
                    "combine the shards' values"
                )
    return reference, flat


def to_tensors(outputs: Any, where: str) -> Any:
    """The function's outputs with numbers and arrays made tensors; else an error."""
    leaves, key = _trees.flatten(outputs, "outputs")
    converted = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, tf.Tensor | tf.RaggedTensor):
            converted.append(leaf)
        elif isinstance(leaf, int | float | np.ndarray | np.generic) and not isinstance(leaf, bool):
            converted.append(tf.convert_to_tensor(leaf))
        else:
            hint = " (did the function forget to return?)" if leaf is None else ""
            raise ArgumentError(
                f"{where}: {_trees.path('outputs', key, i)} is {type(leaf).__name__} "
                f"{leaf!r}{hint}; a parallelized function must return tensors (or a tuple, "
                "list, dict or namedtuple of them)"
            )
    return _trees.build(key, iter(converted))
