"""Running the shards: one `tf.device` block per shard, and what an empty shard returns.

`Engine` holds what one `ShardedFunction` resolved (devices, options) and the
graphs it traced. A call's body, traced once per trace key into one
`tf.function`, composes three steps:

    [N, ...] --plan and split (tfshard._plan)--> K x [n_k, ...]
      --Engine.run: tf.device(d_k): vectorized_map(fn) or fn(shard)--> K outputs
      --Engine.collect (tf.device(output))--> [N, ...] in input order, or reduced

A shard on the output device or the host traces `fn` in place; the others,
when two or more, call one shared trace of it (`shard_runs` says
when not): most of a first call's cost saved for every shard past the second.

A dataset stream (`tfshard.datasets`) composes the same steps in its own loop:
it plans and splits each batch ahead, runs the shards, and collects every
batch's outputs itself.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import tensorflow as tf

from tfshard import _arguments, _trees, cluster, collect, pinning
from tfshard._autograph import autographed
from tfshard._options import Options
from tfshard._plan import Planned, host_cpu, plan_and_split, plan_rows
from tfshard._shards import (
    Shard,
    ShardOutputs,
    check_outputs,
    check_rows,
    per_row,
    shard_of,
    skip_if_empty,
)
from tfshard.errors import (
    INPUTS_DIFFER,
    ROWS_DIFFER,
    SHARD_SCOPE,
    failing_shard,
    inputs_error,
    pfor_stack_failure,
    rows_error,
    shard_error,
    trimmed_remote,
    user_frames,
)
from tfshard.replicas import Replicas, check_compiled_reads, check_no_writes

# A shard's computation: its rows and their number (int32) in, its outputs out.
ShardFn = Callable[[Sequence[Any], tf.Tensor], Any]


# ----------------------------------------------------------------- engine


class Engine:
    """What one parallelized function resolved, and the graphs it traced.

    A call composes three steps, each its own piece: plan and split
    (`tfshard._plan`), run the shards (`run`), collect (`collect`, then
    `check_rows` for whole-shard outputs). A dataset stream composes the same
    steps its own way (`tfshard.datasets`).

    Args:
      fn: the user's function.
      options: what `parallelize` was asked for.
      name: the function's name, for messages.
      devices: canonical device names, one shard each.
      output: where results land.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        options: Options,
        *,
        name: str,
        devices: tuple[str, ...],
        output: str,
    ) -> None:
        self.fn = fn
        self.options = options
        self.name = name
        self.devices = devices
        self.output = output
        # The CPU of the output's machine: where plans and checks run.
        self.host = host_cpu(output)
        self.remote_output = pinning.is_remote(output)
        self.graphs: dict[Hashable, Any] = {}
        # Output structures of graphs whose outputs tf.function rebuilds otherwise.
        self.rebuilt: dict[Hashable, Hashable] = {}
        self.lock = threading.RLock()
        self._converted: Callable[..., Any] | None = None
        # Replicas of this engine's devices, as they were when its graphs were traced.
        self.replicas: Replicas | None = None
        self._generation = -1
        # Called with no arguments when replicas change and traced graphs go
        # (a dataset runner drops its loops).
        self.on_retrace: list[Callable[[], None]] = []

    @property
    def trace_count(self) -> int:
        """Graphs this engine traced for calls."""
        return len(self.graphs)

    def plan(self, n: int) -> list[int]:
        """The shard sizes for `n` rows, in Python (the graph's `plan_sizes`, exactly)."""
        return plan_rows(int(n), len(self.devices), self.options.weights)

    # ------------------------------------------------------------ calls

    def trace(self, call: _arguments.Call, per_shard: bool = False) -> Any:
        """The concrete function for this call's trace key, traced on first use.

        With `per_shard`, the graph returns each shard's outputs as they are
        (`per_shard_body`) instead of collecting them.
        """
        self.refresh_replicas()
        key = (call.key, "per_shard") if per_shard else call.key
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        with self.lock:
            graph = self.graphs.get(key)
            if graph is None:
                template, split_devices = call.template, call.key.split_devices
                step = self.per_shard_body if per_shard else self.body

                def body(*tensors: Any) -> Any:
                    return step(template, tensors, split_devices)

                graph = tf.function(body, autograph=False).get_concrete_function(*call.specs())
                if self.options.jit_compile:
                    check_compiled_reads(graph, self.devices, self.name)
                if self.replicas is not None:
                    check_no_writes(graph, self.replicas, self.name)
                outputs = _trees.flatten(graph.structured_outputs)[1]
                if _trees.has_defaultdict(outputs):
                    self.rebuilt[key] = outputs
                self.graphs[key] = graph
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
                for retrace in self.on_retrace:
                    retrace()
            self._generation = generation

    def call(self, call: _arguments.Call) -> Any:
        """Runs one call through its traced graph; results land on the output device.

        A call whose output device is on another server returns before its
        shards ran, and TF would raise a failure only where the value is read,
        naming no shard; a failed value left unread fails the next call ("Primary
        device is not remote"). So such a call waits for its shards here, and a
        failure leaves no error pending behind it.
        """
        result = self.execute(self.trace(call), call)
        structure = self.rebuilt.get(call.key)
        if structure is None:
            return result
        # As tf.nest would: the function's own defaultdicts, factories included.
        return _trees.build(structure, iter(_trees.flatten(result)[0]))

    def execute(self, graph: Any, call: _arguments.Call) -> Any:
        """Runs a traced graph on a call's tensors; a failure as `call_error` says.

        A call that needs a worker found down fails before it runs, with the
        error the call that found it raised (`cluster._Connection` says why).
        """
        eager = tf.executing_eagerly()
        # (Inside the user's tf.function, the outer call raises: nothing to wait for.)
        remote = self.remote_output and eager
        if eager and cluster.any_down():
            lost = self.lost_error(call.rows)
            if lost is not None:
                raise lost
        try:
            # The call op's device is where TF leaves the function's outputs.
            with tf.device(self.output):
                result = graph(*call.tensors)
            if remote:
                self._wait(result)
        except tf.errors.OpError as error:
            wrapped = self.call_error(error, call.rows)
            # Clearing waits, without a deadline, for every worker to answer, and a
            # dead one never does (the call hung for good): only when all answer.
            if remote and cluster.all_answer():
                tf.experimental.async_clear_error()
            raise wrapped from None
        return result

    def _wait(self, result: Any) -> None:
        """Waits for a call whose results stay on another server, raising its error.

        Reading a number that one result's op made waits for that op (every
        result comes from the one function call); only that number crosses.
        """
        leaves = tf.nest.flatten(result, expand_composites=True)
        if not leaves:  # nothing to read: wait for every pending op, local and remote
            with tf.experimental.async_scope():
                pass
            return
        with tf.device(self.output):
            tf.size(leaves[0]).numpy()

    def call_error(self, error: tf.errors.OpError, rows: int | None) -> Exception:
        """A failed call's error, naming the shard and, for a dead worker, the remedy.

        Shards on a worker found down come first, then the remedy, then TF's
        own text without gRPC's repetitions (`trimmed_remote`).
        """
        if ROWS_DIFFER in error.message:
            return rows_error(self.name, self.devices, error.message)
        if INPUTS_DIFFER in error.message:
            return inputs_error(self.name, error.message)
        hint = cluster.explain_remote_error(error)  # None unless a worker is down
        lost = self.lost_shards(rows, "failed") if hint is not None else None
        if lost is not None:
            trimmed = trimmed_remote(error.message)
            return shard_error(error, f"{lost}\n{hint}\nTensorFlow's error: {trimmed}")
        k = failing_shard(error.message)
        wrapped = error
        if k is not None:
            wrapped = shard_error(
                error,
                f"{self.name}: shard {k} on {self.devices[k]} ({self.rows_of(k, rows)}) failed: "
                f"{user_frames(error.message)}",
            )
        pfor_stack = pfor_stack_failure(error.message)
        per_sample, ragged = self.options.per_sample, self.options.ragged
        if hint is None and per_sample and not ragged and pfor_stack:
            hint = (
                "It failed inside tf.vectorized_map (pfor), which cannot vectorize every op "
                "(string ops and shapes that vary by sample among them): pass ragged=True "
                "to map the function over one sample at a time (tf.map_fn) instead"
            )
        if hint is not None:
            wrapped = shard_error(wrapped, f"{wrapped.message}\n{hint}")
        return wrapped

    def rows_of(self, k: int, rows: int | None) -> str:
        """Shard k's rows of a call of `rows` rows, in words (None: a batch of a stream)."""
        if rows is None:
            return "its slice of the batch"
        sizes = self.plan(rows)
        start = sum(sizes[:k])
        return f"rows [{start}:{start + sizes[k]}) of {rows}"

    def lost_shards(self, rows: int | None, verb: str) -> str | None:
        """The shards, and the output, on workers found down, as one line; None for none."""
        lost = [
            (f"shard {k} on {device} ({self.rows_of(k, rows)})", cluster.down_task(device))
            for k, device in enumerate(self.devices)
        ]
        lost.append((f"the output device {self.output}", cluster.down_task(self.output)))
        lost = [(what, task) for what, task in lost if task is not None]
        if not lost:
            return None
        if len(lost) == 1:
            where = "the worker it runs on is"
        elif len({task for _, task in lost}) == 1:
            where = "the worker they run on is"
        else:
            where = "the workers they run on are"
        return f"{self.name}: {' and '.join(what for what, _ in lost)} {verb}: {where} down"

    def lost_error(self, rows: int | None) -> Exception | None:
        """The error of a call that needs a worker found down, raised before it runs."""
        lost = self.lost_shards(rows, "did not run")
        if lost is None:
            return None
        message = f"{lost}\n{cluster.down_hint()}"
        return shard_error(tf.errors.UnavailableError(None, None, message), message)

    # ------------------------------------------------------------- steps

    def plan_and_split(
        self, template: _arguments.Template, tensors: Sequence[Any], split_devices: Sequence[str]
    ) -> tuple[Planned, Sequence[Any]]:
        """A call's first step (`_plan.plan_and_split`), and its broadcast tensors."""
        inputs, shared = tensors[: template.split_count], tensors[template.split_count :]
        count, paths = len(self.devices), template.split_paths()
        weights = self.options.weights
        return plan_and_split(inputs, split_devices, paths, count, weights, self.host), shared

    def body(
        self, template: _arguments.Template, tensors: Sequence[Any], split_devices: Sequence[str]
    ) -> Any:
        """A call's traced body: plan and split, run the shards, collect."""
        planned, shared = self.plan_and_split(template, tensors, split_devices)
        outputs = self.run(template, shared, planned.pieces, planned.sizes)
        if self.options.reduce is None:
            outputs.check_gatherable()
        with tf.name_scope("tfshard_collect"), tf.device(self.output):
            results, counted = self.collect(outputs, planned.sizes, planned.total)
        self.check_rows(outputs, planned.sizes, counted)
        return _trees.build(outputs.structure, iter(results))

    def check_rows(
        self, outputs: ShardOutputs, sizes: tf.Tensor, counted: dict[int, tf.Tensor]
    ) -> None:
        """`_shards.check_rows` for a whole-shard function (per-sample outputs have
        one row per row by construction)."""
        if not self.options.per_sample:
            reduced = self.options.reduce is not None
            check_rows(outputs, sizes, self.devices, self.host, counted, reduced)

    def per_shard_body(
        self, template: _arguments.Template, tensors: Sequence[Any], split_devices: Sequence[str]
    ) -> list[Any]:
        """A `per_shard` call's traced body: plan and split, run; each shard's outputs."""
        planned, shared = self.plan_and_split(template, tensors, split_devices)
        outputs = self.run(template, shared, planned.pieces, planned.sizes)
        return [_trees.build(outputs.structure, iter(leaves)) for leaves in outputs.flat]

    def per_shard(self, call: _arguments.Call) -> tuple[Any, ...]:
        """Runs one call; each shard's outputs as they are, on the shard's device."""
        results = self.execute(self.trace(call, per_shard=True), call)
        structure = self.rebuilt.get((call.key, "per_shard"))
        if structure is not None:  # the function's own defaultdicts, as `call` rebuilds them
            results = _trees.build(structure, iter(_trees.flatten(results)[0]))
        # A function's outputs come back on its caller's device (the output device);
        # each shard's go back to its own, a no-op for the output device's shard.
        return tuple(pinning.to_device(r, d) for r, d in zip(results, self.devices))

    def run(
        self,
        template: _arguments.Template,
        shared: Sequence[Any],
        pieces: Sequence[Sequence[Any]],
        sizes: tf.Tensor,
        share: bool = True,
    ) -> ShardOutputs:
        """Runs each shard under its device scope: their outputs, checked alike.

        Args:
          template: how the call's arguments are rebuilt from tensors.
          shared: the broadcast tensors, whole to every shard.
          pieces: ``pieces[i][k]``, split argument i's rows for shard k.
          sizes: each shard's rows (int64, on the host).
          share: let shards share one trace of the function (`shard_runs`);
            False where other transfers are pending beside the shards (a
            stream feeding its next batch ahead).
        """
        count = len(self.devices)
        with tf.device(self.host):
            # Each shard's rows as it takes them (`skip_if_empty`): an int32 scalar,
            # which a function on a GPU takes in host memory.
            shard_rows = [tf.cast(size, tf.int32) for size in tf.unstack(sizes, num=count)]
        if self._converted is None:
            self._converted = autographed(self.fn)
        shard = shard_of(
            self._converted,
            template,
            shared,
            [p[0] for p in pieces],
            name=self.name,
            per_sample=self.options.per_sample,
            ragged=self.options.ragged,
        )
        runs = shard_runs(
            shard,
            self.devices,
            self.output,
            self.host,
            self.replicas,
            jit_compile=self.options.jit_compile,
            share=share,
        )
        outputs = []
        for k, (device, run) in enumerate(zip(self.devices, runs)):
            # With replicas, the shard reads the copy of each variable on its device.
            replica = self.replicas.shard(device) if self.replicas else contextlib.nullcontext()
            with tf.name_scope(f"{SHARD_SCOPE}{k}"), tf.device(device), replica:
                outputs.append(run([p[k] for p in pieces], shard_rows[k]))
        return ShardOutputs(*check_outputs(outputs, self.devices))

    def collect(
        self, outputs: ShardOutputs, sizes: tf.Tensor, total: tf.Tensor, finish: bool = True
    ) -> tuple[list[Any], dict[int, tf.Tensor]]:
        """`collect.collect` of the shards' outputs under this function's options.

        Call it under the output device's scope. A whole-shard output is
        reduced by row when its first dimension is the shard's rows (`per_row`).
        """
        leaves = outputs.leaves()
        by_row = [self.options.per_sample or per_row(values[0]) for values in leaves]
        paths = [outputs.path(i) for i in range(len(leaves))]
        op = self.options.reduce
        return collect.collect(leaves, paths, self.devices, sizes, total, op, by_row, finish)


def shard_runs(
    shard: Shard,
    devices: Sequence[str],
    output: str,
    host: str,
    replicas: Replicas | None,
    *,
    jit_compile: bool,
    share: bool,
) -> list[ShardFn]:
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

    Args:
      shard: what one shard computes.
      devices: the shards' devices; `output` and `host` as the engine's.
      replicas: the replicas the shards read, or None.
      jit_compile: compile each shard with XLA.
      share: let shards share one trace (False where transfers are pending
        beside the shards, as in a stream's feed-ahead loop).
    """
    count = len(devices)

    def guarded(rows_in: Sequence[Any], rows: tf.Tensor) -> Any:
        return skip_if_empty(shard, rows_in, rows > 0)

    if jit_compile:
        if replicas is not None:  # a trace per device: tf.function keys on it
            compiled = tf.function(_taking_token(guarded), autograph=False, jit_compile=True)
            return unordered(compiled, devices)
        return unordered(one_trace(guarded, jit_compile=True), devices)
    in_place = [pinning.same_device(d, output) or pinning.same_device(d, host) for d in devices]
    remote = any(pinning.is_remote(d) for d in (*devices, output))
    if not share or replicas is not None or remote or in_place.count(False) < 2:
        return [guarded] * count
    # "_noinline" reaches TF through the public `experimental_attributes`,
    # which accepts it by name (its allowlist for `tf.function`); the
    # underscore is TF's spelling, not a private API. Pinned by
    # test_shards_off_the_output_device_call_one_shared_trace_each_on_its_device.
    shared = one_trace(guarded, experimental_attributes={"_noinline": True})
    off = [d for d, here in zip(devices, in_place) if not here]
    calls = iter(unordered(shared, off))
    writes: list[bool] = []  # whether the shared trace writes a resource, once known

    def in_place_if_writing(call: ShardFn) -> ShardFn:
        def run(rows_in: Sequence[Any], rows: tf.Tensor) -> Any:
            if not writes:
                writes.append(writes_resources(shared.traced(rows_in)))
            return guarded(rows_in, rows) if writes[0] else call(rows_in, rows)

        return run

    return [guarded if here else in_place_if_writing(next(calls)) for here in in_place]


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
