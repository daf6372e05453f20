"""The engine of one parallelized function: its steps and traced graphs, run, errors named.

`Engine` holds what a `ShardedFunction` resolved (devices, options) and, per
trace key, the `tfshard._step.Step` of that call and the graphs traced from it
(a call's, `per_shard`'s, a stream batch's). It runs a traced graph (`execute`)
and turns a TensorFlow error into a `ShardError` that names the shard, its
device and rows, and the remedy (`call_error`). A dataset stream
(`tfshard.datasets`) asks it for a step (`step`) and runs its own graphs
through `execute`.

Beside the call's tensors, a graph may take inputs of the step's own
(`Feed`): the global row of the batch's first row (a stream's batch run by
itself: its rows before), and with ``weights="auto"`` the plan's weights,
which the engine's `tfshard._balance.Balance` sets from the shards' timings
that a measured call's graph returns (`observe`). A call of ``weights="auto"``
runs one of two graphs of its trace key: the measured one, which times its
shards, when the balance says the call is due (`Balance.due`), alone among
the function's calls (`tfshard._balance.Turns`), which takes the weights
fed, so that a new plan needs no new trace; else the unmeasured one, the graph
static weights would run: the weights in use are its constants, traced once
per plan that calls run unmeasured (a settled plan stays settled). Where a
shard of a call ran out of its own device's memory, the balance caps that
device (`call_error`, `learned`): both graphs of every later call then plan
under the caps, constants of each (traced again per caps; a device capped at 0
is left out of them, as one weighted 0), and a call of more rows than the caps
hold raises before it runs (`check_caps`). A stream's traced loop plans under
the caps in use when it starts, as constants of its own graph, and learns from
a batch that ran alone in its call of the loop (`tfshard.datasets`); the Python
loop's batches are calls.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import tensorflow as tf

from tfshard import _arguments, _balance, _trees, cluster, collect, pinning
from tfshard._autograph import autographed
from tfshard._options import Options
from tfshard._plan import Caps, capacity, capped, host_cpu, plan_rows
from tfshard._step import Step
from tfshard.errors import (
    HOST_MEMORY,
    POSITION_NAME,
    ArgumentError,
    Failed,
    call_failure,
    failing_shard,
    memory_owner,
    over_caps,
    shard_error,
)
from tfshard.position import check_no_stale_position
from tfshard.replicas import Replicas, check_compiled_reads, check_no_writes

# A shard's position, as a placeholder that captured one is named (`_per_shard_here`).
_POSITION = re.compile(POSITION_NAME)


class Feed(NamedTuple):
    """The inputs a graph takes after the call's tensors, in this order.

    Attributes:
      offset: an int64 scalar, the global row of the batch's first row (a
        stream's batch run by itself, whose rows before it `row_index` counts).
      weights: an int64 ``[K]``, the plan's weights (``weights="auto"``).
    """

    offset: bool
    weights: bool

    def specs(self, count: int) -> list[tf.TensorSpec]:
        """The specs of these inputs, for `count` devices."""
        specs = [tf.TensorSpec([], tf.int64)] if self.offset else []
        return specs + ([tf.TensorSpec([count], tf.int64)] if self.weights else [])

    def split(self, flat: tuple[Any, ...], inputs: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A traced graph's inputs as the call's tensors and the step's keywords."""
        tensors, rest = flat[:inputs], list(flat[inputs:])
        extra = {}
        if self.offset:
            extra["offset"] = rest.pop(0)
        if self.weights:
            extra["weights"] = rest.pop(0)
        return tensors, extra


class Traced(NamedTuple):
    """A graph traced for one trace key, and the structure of its outputs.

    Attributes:
      graph: the concrete function.
      structure: its outputs' structure (a `_trees` key) where TensorFlow would not
        give them back as the function returned them (a defaultdict, which it
        makes a dict), else None.
      feed: the step's inputs it takes after the call's tensors.
      timed: it returns ``(outputs, timing)`` (``weights="auto"``).
      runs_python: it holds an op that runs Python (`runs_python`), so a call of
        the function may be made from inside it.
    """

    graph: Any
    structure: Hashable | None
    feed: Feed
    timed: bool
    runs_python: bool = False

    def rebuilt(self, result: Any) -> Any:
        """The graph's result in the structure the function returned."""
        if self.structure is None:
            return result
        return _trees.build(self.structure, iter(_trees.flatten(result)[0]))


# Ops that run Python (`tf.py_function`, `tf.numpy_function`).
_PYTHON_OPS = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})


def runs_python(concrete: Any) -> bool:
    """Whether a concrete function's graph, or a function it calls, holds an op that runs
    Python (`_PYTHON_OPS`): a call of it may call the function again, on a thread
    TensorFlow started (`tfshard._balance.Turns.running_python`)."""
    graph = concrete.graph.as_graph_def()
    nodes = [graph.node, *(function.node_def for function in graph.library.function)]
    return any(node.op in _PYTHON_OPS for defined in nodes for node in defined)


class Engine:
    """What one parallelized function resolved, its steps and the graphs traced from them.

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
        self._output_on_cpu = tf.DeviceSpec.from_string(output).device_type == "CPU"
        self._graphs: dict[Hashable, Traced] = {}
        self._first_rows: dict[Hashable, int] = {}  # by trace key and body (`_exact_rows`)
        self._steps: dict[Hashable, Step] = {}  # by trace key, and beside transfers or not
        self._lock = threading.RLock()
        self._converted: Callable[..., Any] | None = None
        # Replicas of this engine's devices, as they were when its graphs were traced,
        # and the `Replicas.generation` they were looked up at (`refresh`).
        self._replicas: Replicas | None = None
        self._replicas_seen = -1  # `Replicas.generation` when the replicas were last looked up
        self._traces_dropped = 0  # how many times this engine dropped what it traced
        # weights="auto": the measured weights, and the graphs that ran once (warmed up).
        self.balance = _balance.Balance(len(devices)) if options.balanced else None
        self._fed: dict[tuple[int, ...], tf.Tensor] = {}  # `_fed_weights`
        self._warm: set[int] = set()

    @property
    def traces_dropped(self) -> int:
        """How many times this engine dropped what it traced, because the replicas its
        steps read changed (only then): what was traced from an older step (a stream's
        loop) must be traced again when this count moves."""
        self.refresh()
        return self._traces_dropped

    @property
    def trace_count(self) -> int:
        """Graphs this engine traced for calls (and `per_shard`)."""
        return len(self._graphs)

    @property
    def weights(self) -> tuple[float, ...] | None:
        """The weights in use: as given, measured (``weights="auto"``), or None for even."""
        if self.balance is not None:
            return self.balance.weights
        return self.options.given_weights

    def in_use(self) -> tuple[tuple[int, ...] | None, Caps | None]:
        """What a plan uses now, read at once (one plan's both): the integer weights
        (`_plan.integer_weights`; None for even), and each device's most rows
        (``weights="auto"``, learned from shards that ran out of memory:
        `tfshard._balance.Balance.cap`; None: no caps)."""
        if self.balance is not None:
            return self.balance.in_use()
        return self.options.weights, None

    def plan(
        self, n: int, weights: tuple[int, ...] | None = None, caps: Caps | None = None
    ) -> list[int]:
        """The shard sizes for `n` rows, in Python (the graph's `plan_sizes`, exactly),
        by these integer weights and caps (weights None: those in use, and the caps in
        use, which `n` rows must fit: else the `ArgumentError` a call of them raises)."""
        if weights is None:
            weights, caps = self.in_use()
            self.check_caps(int(n), weights, caps)
        return plan_rows(int(n), len(self.devices), weights, caps)

    def check_caps(self, rows: int, weights: tuple[int, ...] | None, caps: Caps | None) -> None:
        """Raises the `ArgumentError` of a call of more `rows` than the devices that these
        weights give rows hold under their caps together (`tfshard._plan.capacity`)."""
        error = self.caps_error(rows, weights, caps)
        if error is not None:
            raise error

    def caps_error(
        self, rows: int, weights: tuple[int, ...] | None, caps: Caps | None, batch: bool = False
    ) -> ArgumentError | None:
        """`check_caps`'s error, or None where the rows fit; `batch`: the rows are a
        stream's batch (the remedy is smaller batches)."""
        fits = capacity(weights, caps)
        if fits is None or rows <= fits:
            return None
        weights = (1,) * len(caps) if weights is None else weights
        held = ", ".join(f"{d}: {c}" for d, c, w in zip(self.devices, caps, weights) if w)
        if self.options.limits(len(self.devices)) is None:
            smaller = "max_rows=N to run each shard's function on at most N rows at a time"
        else:
            smaller = "a smaller max_rows= (its shards run in chunks of at most max_rows rows)"
        what, fix = (
            ("a batch", f"Batch the dataset by at most {fits} rows")
            if batch
            else ("a call", f"Call it with at most {fits} rows at a time")
        )
        return ArgumentError(
            f"{self.name}: {what} of {rows} rows needs more memory than its devices hold "
            f"at once: weights='auto' learned from shards that ran out of memory that "
            f"they hold at most {fits} rows together ({held}). {fix}, or make it with "
            f"{smaller} (a new function: its caps start anew)"
        )

    # ------------------------------------------------------------ steps

    def holding(
        self, weights: tuple[int, ...] | None, caps: Caps | None = None
    ) -> tuple[int, ...] | None:
        """The devices a call's graph holds, by index: those `weights` give rows and
        `caps` do not hold to 0 (None: every device). A device weighted 0, or capped at
        0, gets no ops, guard or copies in the graph (where every device is capped at 0,
        the weights alone say: no call of rows gets past `check_caps`)."""
        if caps is not None and 0 in caps:
            w = (1,) * len(caps) if weights is None else weights
            kept = tuple(k for k, (x, c) in enumerate(zip(w, caps)) if x > 0 and c != 0)
            if kept:
                return None if len(kept) == len(caps) else kept
        if weights is None or all(weights):
            return None
        return tuple(k for k, w in enumerate(weights) if w > 0)

    def step(
        self,
        call: _arguments.Call,
        *,
        beside_transfers: bool = False,
        guarded: bool = True,
        shards: tuple[int, ...] | None = None,
        measured: bool = True,
        weights: tuple[int, ...] | None = None,
        caps: Caps | None = None,
    ) -> Step:
        """The step of a call with this trace key (see `tfshard._step.Step`), built once.

        Args:
          call: the classified call (its trace key and template).
          beside_transfers: the step's shards run while other copies are pending
            beside them (a stream feeding its next batch ahead, or `per_shard`,
            every shard's outputs crossing to the output device): each runs in
            place (`tfshard._sharding.choose`), so a failure keeps its error.
          guarded: a shard may have no rows (`Step.guarded`).
          shards: the devices the step holds (`holding`), or None for every one.
          measured: with ``weights="auto"``, the step times its shards (`Step.balanced`)
            and plans by weights fed at run time (a stream's is measured).
          weights: the integer weights of every device, as the plan's constants (an
            unmeasured call of ``weights="auto"``), or None: the options' weights.
          caps: each device's most rows (`in_use`), the plan's constants, or None.
        """
        self.refresh()
        key = (call.key, beside_transfers, guarded, shards, measured, weights, caps)
        step = self._steps.get(key)
        if step is not None:
            return step
        if self._converted is None:
            self._converted = autographed(self.fn)
        options = self.options
        devices, weights = self.devices, options.weights if weights is None else weights
        limits = options.limits(len(self.devices))
        if shards is not None:
            devices = tuple(devices[k] for k in shards)
            weights = None if weights is None else tuple(weights[k] for k in shards)
            limits = None if limits is None else tuple(limits[k] for k in shards)
            caps = None if caps is None else tuple(caps[k] for k in shards)
        step = Step(
            fn=self._converted,
            name=self.name,
            options=options,
            weights=weights,
            devices=devices,
            output=self.output,
            host=self.host,
            replicas=self._replicas,
            template=call.template,
            split_devices=tuple(call.key.split_devices),
            beside_transfers=beside_transfers,
            # Weights to measure where there is more than one device to weigh.
            balanced=options.balanced and len(devices) > 1 and measured,
            max_rows=limits,
            guarded=guarded,
            shards=shards,
            listed=None if shards is None else len(self.devices),
            caps=caps,
        )
        self._steps[key] = step
        return step

    def refresh(self) -> None:
        """Picks up replicas, or replicated variables, made since the last trace.

        The graphs traced before go: one that captured a plain variable would
        not read the replicated one that a new model put in its place. Anything
        else traced from this engine's steps (a stream's loops) compares
        `traces_dropped` with the count it was traced at.
        """
        if self._replicas_seen == Replicas.generation:
            return
        with self._lock:
            generation = Replicas.generation
            found = Replicas.find(self.devices)
            if found is not None or self._replicas is not None:
                self._replicas = found
                self._graphs.clear()
                self._first_rows.clear()
                self._steps.clear()
                self._traces_dropped += 1
            self._replicas_seen = generation

    def _checks(self) -> bool:
        """A graph of this function may break a promise of its devices, which `checked`
        checks: it runs replicas' shards, or compiled ones."""
        return self.options.jit_compile or self._replicas is not None

    def checked(self, graph: Any) -> Any:
        """A traced graph, once refused if a shard writes a replicated variable or,
        compiled, reads a variable on another device (XLA cannot), or if it holds a
        position of another trace (`position.check_no_stale_position`)."""
        check_no_stale_position(graph, self.name)
        if self.options.jit_compile:
            check_compiled_reads(graph, self.devices, self.name)
        if self._replicas is not None:
            check_no_writes(graph, self._replicas, self.name)
        return graph

    # ------------------------------------------------------------ calls

    def trace(self, call: _arguments.Call, measured: bool = False) -> Any:
        """The concrete function a call with this trace key runs, traced on first use:
        it takes the call's tensors (the weights in use its constants), or `measured`,
        the graph a measured call runs (`_run_graph`): it also takes the plan's weights
        (`feeds`) and returns ``(outputs, timing)``: the split's (`Balance.plan_for`,
        also while one device holds every row); None where no call is measured (not
        ``weights="auto"``, or every other device useless)."""
        if measured and self.balance is not None:
            weights, caps = self.balance.plan_for("split")
        else:
            weights, caps = self.in_use()
        held = self._held(call.rows, weights, caps)
        if measured and not self._weighs(held["shards"]):
            return None
        return self._traced(call, "call", offset=False, measured=measured, **held).graph

    def _held(
        self, rows: int | None, weights: tuple[int, ...] | None, caps: Caps | None = None
    ) -> dict[str, Any]:
        """The devices a call of `rows` rows holds (`holding`), whether it is guarded, and
        the integer `weights` and `caps` it plans by (those in use, read once by the
        caller)."""
        shards = self.holding(weights, caps)
        guarded = self._may_be_empty(rows, weights, shards, caps)
        return {"shards": shards, "guarded": guarded, "weights": weights, "caps": caps}

    def _may_be_empty(
        self,
        rows: int | None,
        weights: tuple[int, ...] | None,
        shards: tuple[int, ...] | None,
        caps: Caps | None = None,
    ) -> bool:
        """Whether a shard of a call of `rows` rows (None: not known) may have none, so
        the call needs the graph with the empty-shard guard (`Step.guarded`)."""
        if rows is None:
            return True
        if caps is not None:
            sizes = plan_rows(rows, len(self.devices), weights, caps)
            return any(sizes[k] == 0 for k in (range(len(sizes)) if shards is None else shards))
        if weights is None:
            return rows < len(self.devices)
        # A shard of weight w gets at least floor(rows * w / total) rows (`plan_rows`).
        # (filter(None, ...): the weights above 0, without a Python frame per weight.)
        if rows * min(filter(None, weights)) >= sum(weights):
            return False
        sizes = plan_rows(rows, len(self.devices), weights)
        return any(sizes[k] == 0 for k in (range(len(sizes)) if shards is None else shards))

    def _weighs(self, shards: tuple[int, ...] | None) -> bool:
        """A graph holding these devices takes the plan's weights (``weights="auto"``,
        more than one device to weigh)."""
        count = len(self.devices) if shards is None else len(shards)
        return self.balance is not None and count > 1

    def _constants(
        self, shards: tuple[int, ...] | None, weights: tuple[int, ...] | None, measured: bool
    ) -> tuple[int, ...] | None:
        """The integer weights of every device that a graph holding `shards` plans by as
        constants: `weights` where ``weights="auto"`` weighs them unmeasured and the kept
        devices' differ, else None (measured: fed; not weighed, or alike: the options')."""
        if not self._weighs(shards) or measured:
            return None
        kept = weights if shards is None else [weights[k] for k in shards]
        return weights if len(set(filter(None, kept))) > 1 else None

    def feeds(
        self,
        offset: int | None = None,
        shards: tuple[int, ...] | None = None,
        weights: tuple[int, ...] | None = None,
        measured: bool = True,
    ) -> list[tf.Tensor]:
        """The step's inputs a call's graph takes after its tensors (`Feed`), now.

        Args:
          offset: the batch's first row in its stream, for a graph that takes it.
          shards: the devices the graph holds (`holding`), or None for every one.
          weights: the integer weights of every device that the call plans by
            (those `shards` came from), or None: those in use now.
          measured: the graph is a measured one, which takes the weights
            (``weights="auto"``; a stream's loop is); an unmeasured one holds them.
        """
        weighs = measured and self._weighs(shards)
        if offset is None and not weighs:
            return []  # a plain call's graph takes none: no device scope on its path
        values = []
        if offset is not None:
            with tf.device(self.host):  # where the plan reads them
                values.append(tf.constant(offset, tf.int64))
        if weighs:
            weights = self.balance.integer() if weights is None else weights
            if shards is not None:
                weights = tuple(weights[k] for k in shards)
            values.append(self._fed_weights(weights))
        return values

    def _fed_weights(self, weights: tuple[int, ...]) -> tf.Tensor:
        """`weights` as the int64 tensor a measured graph takes, on the host; made once per
        weights when eager (a tensor is immutable), so a measured call copies nothing new."""
        fed = self._fed.get(weights)
        if fed is not None and tf.executing_eagerly():
            return fed
        with tf.device(self.host):  # where the plan reads them
            fed = tf.constant(weights, tf.int64)
        if tf.executing_eagerly():
            if len(self._fed) >= 64:  # one per plan measured: a few
                self._fed.clear()
            self._fed[weights] = fed
        return fed

    @contextlib.contextmanager
    def turn(self) -> Any:
        """A turn among this function's calls (`tfshard._balance.Turns`) for a call of a
        stream's traced loop, a context manager: a measured call waits for it, and a shard
        of it out of memory caps its device only where it ran alone (`learned`); without
        ``weights="auto"``, a null context. The loop's dataset may run Python (a
        `tf.py_function` in a map) that calls the function: it counts as a call that
        runs Python (`Turns.running_python`)."""
        if self.balance is None:
            yield
            return
        turns = self.balance.turns
        turn, python = turns.call(False), turns.running_python()
        try:  # taken inside: an interrupt anywhere after `take` begins still gives it back
            turns.take(turn)
            python.enter()
            yield
        finally:
            interrupted = None
            while True:  # until both end uninterrupted: a repeat gives nothing back twice
                try:
                    python.leave()
                    turns.done(turn)
                    break
                except KeyboardInterrupt as error:
                    interrupted = error
            if interrupted is not None:
                raise interrupted

    def alone(self) -> bool:
        """Whether this thread's call in flight (a turn taken) has run alone among the
        function's calls so far (`tfshard._balance.Turns.alone`); True without
        ``weights="auto"``."""
        return self.balance is None or self.balance.turns.alone()

    def call(self, call: _arguments.Call, offset: int | None = None) -> Any:
        """Runs one call; results land on the output device. `offset`: the global row
        of its first row in a stream (`tfshard.row_index` counts it); None: 0."""
        return self._run(call, "call", offset)

    def totals(self, call: _arguments.Call, offset: int | None = None) -> Any:
        """Runs one batch of a stream under a reduction: its undivided totals (`Step.totals`)."""
        return self._run(call, "totals", offset)

    def per_shard(self, call: _arguments.Call) -> tuple[Any, ...]:
        """Runs one call, never measured; each shard's outputs as they are, on its device.

        Eagerly it runs the step's traced `per_shard` graph, whose outputs come back
        on its caller's device (the output device): each shard's go back to its own.
        In a graph (a user's tf.function) the step is traced into the caller's graph
        (`_per_shard_here`), so each result stays where its shard made it.
        """
        if tf.executing_eagerly():
            results = self._run(call, "per_shard", None, measure=False)
        else:
            results = self._per_shard_here(call)
        # A no-op for a result already on its shard's device.
        return tuple(pinning.to_device(r, d) for r, d in zip(results, self.devices))

    def _per_shard_here(self, call: _arguments.Call) -> list[Any]:
        """Each shard's result of the step of `per_shard`, traced into the caller's graph.

        It is traced for any rows, as that graph is: with a batch's rows known in
        the caller's graph, a whole shard's output of as many rows would look like
        an output per row. A function that may break a promise of its devices
        (`checked`), or whose trace made the caller's graph capture a position
        (named so: one made in another trace, stale, or a shard's around the
        caller, its own), is traced once more by itself, to be checked; the
        caller's graph gets no op for it.
        """
        held = self._held(call.rows, *self.in_use())
        step = self.step(
            call,
            beside_transfers=True,
            guarded=held["guarded"],
            shards=held["shards"],
            measured=False,
            weights=self._constants(held["shards"], held["weights"], measured=False),
            caps=held["caps"],
        )
        def check() -> None:
            traced = tf.function(lambda *t: step.per_shard(t), autograph=False)
            self.checked(traced.get_concrete_function(*call.specs()))

        if self._checks():
            check()
        tensors = []
        for t, spec in zip(call.tensors, call.specs()):
            if isinstance(t, tf.Tensor) and t.shape != spec.shape:
                with tf.device(t.device) if t.device else contextlib.nullcontext():
                    t = tf.compat.v1.placeholder_with_default(t, spec.shape)
            tensors.append(t)
        graph = tf.compat.v1.get_default_graph()
        known = len(graph.get_operations())  # in the order they were made
        results = step.per_shard(tensors)
        captured = (
            op.type == "Placeholder" and _POSITION.fullmatch(op.outputs[0].name)
            for op in graph.get_operations()[known:]
        )
        if not self._checks() and any(captured):
            check()
        return results

    def _run(
        self, call: _arguments.Call, body: str, offset: int | None, measure: bool = True
    ) -> Any:
        """Runs a step's traced `body` on this call; with ``weights="auto"``, measured when
        the balance says it is due (`Balance.due`; `measure` False: never), alone among this
        function's calls. Every call of ``weights="auto"`` takes a turn (`Turns`): a shard
        out of memory caps its device only where its call ran alone (`learned`)."""
        balance = self.balance
        if balance is None:
            return self._run_graph(call, body, offset, None)
        # One device left (or per_shard): not measured; its turn waits only for a measured call.
        kind = None if balance.one_left or not measure else balance.due()
        if kind is not None and not tf.executing_eagerly():
            # Inside a user's tf.function there is nothing to read: never measured (the
            # call due to be is one that is not, traced once).
            return self._run_graph(call, body, offset, None)
        if kind == "alone" and (body != "call" or call.rows is None):
            kind = "split"  # a whole call's rows are needed to weigh it against the split
        turns = balance.turns
        turn = turns.call(kind is not None)
        try:  # taken inside: an interrupt anywhere after `take` begins still gives it back
            measured = turns.take(turn)
            return self._run_graph(call, body, offset, kind if measured else None)
        finally:
            interrupted = None
            while True:  # until one `done` ends uninterrupted: a repeat does nothing
                try:
                    turns.done(turn)
                    break
                except KeyboardInterrupt as error:
                    interrupted = error
            if interrupted is not None:
                raise interrupted

    def _run_graph(
        self, call: _arguments.Call, body: str, offset: int | None, kind: str | None
    ) -> Any:
        """Runs `body`'s graph for a measured call of this `kind` (`Balance.due`: the split
        timed, or the fastest device alone) or, None, the unmeasured graph of the plan in
        use; what a measured call took goes to the balance, where the call ran alone
        (`Turns.alone`; else it is dropped, `Balance.drop`)."""
        # Read once: the graph, its feeds and errors agree.
        balance = self.balance
        if balance is None:
            weights, caps = self.options.weights, None
        elif kind is None:
            weights, caps = balance.in_use()
        else:
            weights, caps = balance.plan_for(kind)
        if caps is not None and call.rows is not None:
            # (A call at an offset is a stream's batch, whose remedy is smaller batches.)
            error = self.caps_error(call.rows, weights, caps, batch=offset is not None)
            if error is not None:
                raise error
        held = self._held(call.rows, weights, caps)
        measured = kind == "split"
        traced = self._traced(call, body, offset=offset is not None, measured=measured, **held)
        feeds = self.feeds(offset, held["shards"], weights, traced.feed.weights)
        inputs = [*call.tensors, *feeds]
        began = time.perf_counter()
        if traced.runs_python and balance is not None and not balance.one_left:
            # A call of the function from inside this one must not wait for it (`Turns`).
            # (Once one device is left no call is measured, so none waits: not counted.)
            python = balance.turns.running_python()
            try:  # entered inside, and left as `Turns` says a turn is given back
                python.enter()
                result = self.execute(traced.graph, inputs, call.rows, weights, caps)
            finally:
                interrupted = None
                while True:
                    try:
                        python.leave()
                        break
                    except KeyboardInterrupt as error:
                        interrupted = error
                if interrupted is not None:
                    raise interrupted
        else:
            result = self.execute(traced.graph, inputs, call.rows, weights, caps)
        result = traced.rebuilt(result)
        timing = None
        if traced.timed:
            result, timing = result
        if kind is None:
            return result
        self._finished(result)
        took = time.perf_counter() - began
        if not balance.turns.alone():
            # A call of the function ran beside it (one made from inside its shards on a
            # thread TensorFlow started): its seconds may hold that call's. Its graph ran.
            self._warm.add(id(traced.graph))
            balance.drop()
            return result
        if timing is not None:
            self.observe(timing, id(traced.graph), held["shards"], took)
        elif kind == "alone" and held["shards"] is not None and len(held["shards"]) == 1:
            warm_up = id(traced.graph) not in self._warm
            self._warm.add(id(traced.graph))
            self.balance.observe_alone(held["shards"][0], int(call.rows), took, warm_up)
        return result

    def _finished(self, result: Any) -> None:
        """Waits for a measured call's outputs: one element of one of them read on the host
        (on a GPU a call returns once its kernels are queued). Outputs on a CPU are there
        when the call returns (a CPU of this process, as TensorFlow executes eagerly by
        default; another server's, `execute` waited for them): nothing to wait for."""
        synchronous = tf.config.experimental.get_synchronous_execution()
        if self._output_on_cpu and (self.remote_output or synchronous):
            return
        for leaf in tf.nest.flatten(result, expand_composites=True):
            if isinstance(leaf, tf.Tensor) and leaf.dtype.is_numpy_compatible:
                with tf.device(self.output):
                    tf.reshape(leaf, [-1])[:1].numpy()
                return

    def observe(
        self,
        timing: Any,
        graph: int,
        shards: tuple[int, ...] | None = None,
        seconds: float | None = None,
        *,
        alone: bool = True,
    ) -> None:
        """Gives the shards' timing of a run of a graph to `balance` (eager values only),
        or, where it did not run `alone`, drops it (`Balance.drop`).

        Args:
          timing: a `_balance.Timing` of eager tensors (inside a user's
            tf.function there is nothing to read: it is left alone).
          graph: which graph ran (its first run warms up, `Balance.observe`).
          shards: the devices the graph holds (`holding`), or None for every one;
            a device left out counts as a shard of no rows.
          seconds: the whole call's seconds, to its outputs ready, or None: not
            known (a stream's loop).
          alone: no other call of the function ran beside it (`alone`): else its
            seconds may hold that call's, and it is not counted.
        """
        if self.balance is None or not tf.executing_eagerly():
            return
        warm_up = graph not in self._warm
        self._warm.add(graph)
        if not alone:
            self.balance.drop()
            return
        rows, times = timing.rows.numpy().tolist(), timing.seconds.numpy().tolist()
        # tf.timestamp reads the wall clock, which may step back between a shard's two
        # stamps: that shard's time is 0, too short to count (`Balance.observe` refuses < 0).
        times = [max(t, 0.0) for t in times]
        if shards is not None:
            count = len(self.devices)
            rows, times = _spread(rows, shards, count), _spread(times, shards, count)
        self.balance.observe(rows, times, warm_up, seconds)

    def _traced(
        self,
        call: _arguments.Call,
        body: str,
        *,
        offset: bool,
        guarded: bool,
        shards: tuple[int, ...] | None = None,
        weights: tuple[int, ...] | None = None,
        measured: bool = False,
        caps: Caps | None = None,
    ) -> Traced:
        """The graph of a step's traced `body` ("call", "per_shard", "totals") for this
        call's key, taking a row offset or not, its shards guarded or not (`Step.guarded`),
        holding the devices `shards` (`holding`; None: every one).

        With ``weights="auto"`` and devices to weigh, a `measured` graph times its
        shards and takes the plan's weights (fed); an unmeasured one holds
        `weights` (the integer weights of every device) as constants, as static
        weights' graph does, one graph per plan. `caps`, each device's most rows, are
        constants of either (one graph per caps: they change only where a shard ran out
        of memory).
        """
        self.refresh()
        measured = measured and self._weighs(shards)
        feed = Feed(offset=offset, weights=measured)
        exact = self._exact_rows(call, body, measured)
        held = self._constants(shards, weights, measured)
        key = (call.key, body, feed, guarded, exact, shards, measured, held, caps)
        traced = self._graphs.get(key)
        if traced is not None:
            return traced
        with self._lock:
            traced = self._graphs.get(key)
            if traced is None:
                # per_shard returns every shard's outputs: each crosses beside the shards.
                step = self.step(
                    call,
                    beside_transfers=body == "per_shard",
                    guarded=guarded,
                    shards=shards,
                    measured=measured,
                    weights=held,
                    caps=caps,
                )
                run = getattr(step, body)
                count = len(call.tensors)

                def traced_body(*flat: Any) -> Any:
                    tensors, extra = feed.split(flat, count)
                    return run(tensors, **extra)

                specs = [*call.specs(exact is not None), *feed.specs(len(step.devices))]
                graph = tf.function(traced_body, autograph=False).get_concrete_function(*specs)
                structure = _trees.flatten(graph.structured_outputs)[1]
                kept = structure if _trees.has_defaultdict(structure) else None
                graph = self.checked(graph)
                traced = Traced(graph, kept, feed, step.balanced, runs_python(graph))
                self._graphs[key] = traced
            return traced

    def _exact_rows(self, call: _arguments.Call, body: str, measured: bool) -> int | None:
        """The rows a call's graph is traced for exactly, or None: any rows.

        The first batch size of a per-sample function's trace key gets a graph for
        exactly its rows, because `tf.vectorized_map` traces faster for a known
        number of samples; a second size traces one graph with the rows open for
        every size after it (as `tf.function(reduce_retracing=True)`).

        Not for a whole-shard function (exact rows would make a loss of 2 values
        on a shard of 2 rows look per row, `_shards.per_row`), nor for a `measured`
        graph of ``weights="auto"`` (fed weights leave the rows open: the graph
        between measured calls holds its weights, as static weights' does), nor
        ragged rows.
        """
        if call.rows is None or not self.options.per_sample or measured:
            return None
        split = call.tensors[: call.template.split_count]
        if not all(isinstance(t, tf.Tensor) for t in split):
            return None
        first = self._first_rows.setdefault((call.key, body), call.rows)
        return call.rows if first == call.rows else None

    def execute(
        self,
        graph: Any,
        tensors: Any,
        rows: int | None,
        weights: tuple[int, ...] | None = None,
        caps: Caps | None = None,
    ) -> Any:
        """Runs a traced graph on these tensors; a failure as `call_error` says.

        A call whose output device is on another server returns before its
        shards ran, and TF would raise a failure only where the value is read,
        naming no shard; a failed value left unread fails the next call ("Primary
        device is not remote"). So such a call waits for its shards here, and a
        failure leaves no error pending behind it.

        Args:
          graph: a concrete function traced from this engine's steps.
          tensors: its inputs.
          rows: the batch's rows when known (to name a failing shard's rows).
          weights: the integer weights its plan was fed (None: those in use).
          caps: the caps its plan was made under (`in_use`), or None.
        """
        eager = tf.executing_eagerly()
        # (Inside the user's tf.function, the outer call raises: nothing to wait for.)
        remote = self.remote_output and eager
        if eager and cluster.any_down():
            # A call that needs a worker found down fails before it runs, with the
            # error the call that found it raised (`cluster.Connection` says why).
            lost = self.lost_error(rows, weights, caps)
            if lost is not None:
                raise lost
        try:
            # The call op's device is where TF leaves the function's outputs.
            with tf.device(self.output):
                result = graph(*tensors)
            if remote:
                self._wait(result)
        except tf.errors.OpError as error:
            wrapped = self.call_error(error, rows, weights, caps=caps)
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

    def call_error(
        self,
        error: tf.errors.OpError,
        rows: int | None,
        weights: tuple[int, ...] | None = None,
        *,
        caps: Caps | None = None,
        element: bool = False,
    ) -> Exception:
        """A failed call's error, as `errors.call_failure` words what the engine knows.

        The engine knows the function, its devices, each shard's rows and
        memory limit, and asks the cluster whether a worker is down. With
        ``weights="auto"``, a shard of known rows that ran out of memory caps
        its device (`learned`), and the error says so; the call is not run
        again (a function may have side effects): the next call plans within
        the cap. A stream's batch that the in-graph check of the caps refused
        (`tfshard._plan.within_caps`) is `check_caps`'s error.

        Args:
          error: what TensorFlow raised.
          rows: the call's rows when known (a stream's batch: where its call of
            the traced loop ran that one batch; None: not known).
          weights: the integer weights its plan used (None: those in use).
          caps: the caps its plan was made under, or None.
          element: the split arguments are a dataset element's fields (a stream).
        """
        # Only a capped loop holds the caps' check (`over_caps` knows its node).
        over = over_caps(error.message) if element and capped(caps) else None
        if over is not None:  # a stream's batch over the caps, found before it ran
            return self.caps_error(over, weights, caps, batch=True) or ArgumentError(
                f"{self.name}: a batch of {over} rows needs more memory than its devices "
                "hold at once (weights='auto' learned caps from shards that ran out of "
                "memory): batch the dataset by fewer rows"
            )
        hint = cluster.explain_remote_error(error)  # None unless a worker is down
        learned = self.learned(error, rows, weights, caps) if hint is None else None
        failed = Failed(
            name=self.name,
            devices=self.devices,
            rows_of=lambda k: self.rows_of(k, rows, weights, caps),
            memory_hint=lambda k: self.memory_hint(k, learned, rows),
            reductions=tuple(collect.REDUCTIONS),
            vectorized=self.options.per_sample and not self.options.ragged,
            element=element,
            remote=hint,
            lost=self.lost_shards(rows, "failed", weights, caps) if hint is not None else None,
        )
        return call_failure(error, failed)

    def learned(
        self,
        error: tf.errors.OpError,
        rows: int | None,
        weights: tuple[int, ...] | None,
        caps: Caps | None,
    ) -> tuple[int, int, int] | None:
        """With ``weights="auto"``, a call of known `rows` whose shard k ran out of its own
        device's memory caps device k (`tfshard._balance.Balance.cap`) by the rows it ran
        at once: those its plan gave it, or its chunk's (``max_rows``) where fewer.
        Returns ``(k, those rows, its cap)``; else None, nothing learned: another error,
        rows not known (a stream's batch in a call of its loop of several), a shard of
        no rows, memory that was not the device's own (TF's
        allocator names another device, or a Python function's MemoryError: the host's,
        `tfshard.errors.memory_owner`), or a call that did not run alone (another call
        of the function in flight beside it: `tfshard._balance.Turns.alone`), whose
        memory may have been taken by the others."""
        if self.balance is None or rows is None:
            return None
        if not isinstance(error, tf.errors.ResourceExhaustedError):
            return None
        k = failing_shard(error.message)
        if k is None or not 0 <= k < len(self.devices):
            return None
        owner = memory_owner(error.message)
        if owner == HOST_MEMORY or (owner is not None and not _same_device(owner, self.devices[k])):
            return None
        if not self.balance.turns.alone():
            return None
        had = plan_rows(int(rows), len(self.devices), weights, caps)[k]
        limits = self.options.limits(len(self.devices))
        if limits is not None and limits[k] is not None:
            had = min(had, limits[k])  # it ran in chunks: the rows at once are a chunk's
        if had == 0:
            return None
        return k, had, self.balance.cap(k, had)

    def memory_hint(
        self, k: int, learned: tuple[int, int, int] | None = None, rows: int | None = None
    ) -> str:
        """What to do about shard k running out of memory: fewer rows at once, or fewer rows;
        with ``weights="auto"``, the cap it learned (`learned`) and what the next call
        does: a call of as many `rows` as this one, where the caps no longer hold them,
        cannot run."""
        device = self.devices[k]
        limits = self.options.limits(len(self.devices))
        limit = None if limits is None else limits[k]
        if learned is not None and learned[0] == k:
            _, had, cap = learned
            at_once = f"with {had} rows at once" if limit is not None else f"with {had}"
            said = (
                f"weights='auto' learned from it: from the next call or stream on, "
                f"{device} gets at most {cap} rows (it ran out of memory "
                f"{at_once}), the rows over that going to the other devices by their "
                "weights. This call returned nothing and is not run again (a function may "
                "have side effects)"
            )
            fits = capacity(*self.in_use())
            if rows is not None and fits is not None and rows > fits:
                return (
                    f"{said}, and a call of {rows} rows no longer fits its devices: calls of "
                    f"at most {fits} rows from now on. Split the batch, or make the "
                    "function with max_rows=N to run each shard's function on at most N "
                    "rows at a time (a new function: its caps start anew)"
                )
            if limit is not None:
                return (
                    f"{said}: call it again. Or, as it ran in chunks of at most {limit} "
                    f"rows, make it with a smaller max_rows= for {device} (a new function: "
                    "its caps start anew)"
                )
            return (
                f"{said}: call it again. Or pass max_rows=N to run each shard's function "
                "on at most N rows at a time (on its device, results as one run's)"
            )
        at_once = (
            f"It ran in chunks of at most {limit} rows: pass a smaller max_rows= for {device}"
            if limit is not None
            else "Pass max_rows=N to run each shard's function on at most N rows at a time "
            "(on its device, results as one run's; a list gives one limit per device)"
        )
        learns = (
            "from a call"
            if self.balance is None
            # What it did not learn from: another device's memory, or calls side by side.
            else "from a call that ran alone out of the device's own memory, or a "
            "stream's batch alone in its call of the loop"
        )
        return (
            f"{at_once}, or weights= to give {device} fewer rows (weights='auto' learns "
            f"that {learns}). Nothing else changed: the call returned nothing, and the "
            "next call runs as usual"
        )

    def rows_of(
        self,
        k: int,
        rows: int | None,
        weights: tuple[int, ...] | None = None,
        caps: Caps | None = None,
    ) -> str:
        """Shard k's rows of a call of `rows` rows (None: not known, a stream's batch), in words,
        by the integer weights and caps of the call's plan (weights None: those in use)."""
        if rows is None:
            return "its slice of the batch"
        if weights is None:
            weights, caps = self.in_use()
        sizes = plan_rows(int(rows), len(self.devices), weights, caps)
        start = sum(sizes[:k])
        return f"rows [{start}:{start + sizes[k]}) of {rows}"

    def lost_shards(
        self,
        rows: int | None,
        verb: str,
        weights: tuple[int, ...] | None = None,
        caps: Caps | None = None,
    ) -> str | None:
        """The shards, and the output, on workers found down, as one line; None for none."""
        lost = [
            (
                f"shard {k} on {device} ({self.rows_of(k, rows, weights, caps)})",
                cluster.down_task(device),
            )
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

    def lost_error(
        self, rows: int | None, weights: tuple[int, ...] | None = None, caps: Caps | None = None
    ) -> Exception | None:
        """The error of a call that needs a worker found down, raised before it runs."""
        lost = self.lost_shards(rows, "did not run", weights, caps)
        if lost is None:
            return None
        message = f"{lost}\n{cluster.down_hint()}"
        return shard_error(tf.errors.UnavailableError(None, None, message), message)


def _same_device(named: str, device: str) -> bool:
    """Whether a device TF names in full is `device` (a canonical name, which may leave
    out its job, replica and task: then any)."""
    a, b = tf.DeviceSpec.from_string(named), tf.DeviceSpec.from_string(device)
    fields = ("job", "replica", "task", "device_type", "device_index")
    return all(getattr(b, f) is None or getattr(a, f) == getattr(b, f) for f in fields)


def _spread(values: list[Any], shards: tuple[int, ...], count: int) -> list[Any]:
    """Values of the devices `shards`, as one per device of `count`, 0 for the others."""
    spread = [0] * count
    for k, value in zip(shards, values):
        spread[k] = value
    return spread
