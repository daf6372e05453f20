"""One call of a function on these devices: plan, run the shards, collect.

A `Step` is what tfshard knows of one call of a parallelized function with one
trace key: where its arguments go (plan and split, `tfshard._plan`), how each
shard runs (one `tf.device` block each, as `tfshard._sharding` chooses), and how
the outputs come back (`tfshard.collect`). Every path is a composition of its
parts, in one traced graph::

    f(x):          plan -> run -> collect -> finish      [N, ...] in input order, or reduced
    f.per_shard:   plan -> run                           each shard's outputs
    a stream:      plan -> onto_devices (ahead) -> run -> collect or check, batch after batch

    [N, ...] --plan (where the batch is, int32)--> sizes --split (there)--> K x [n_k, ...]
      --run: tf.device(d_k): vectorized_map(fn) or fn(shard), in chunks of max_rows--> K outputs
      --collect (tf.device(output))--> [N, ...], or totals --finish--> the reduction

Each shard runs at its `tfshard.position.Position`: its index and the global
row of its first row (the call's or stream's row offset, fed at run time,
plus the rows of the shards before it), inputs of its computation, which
`tfshard.shard_index` and `tfshard.row_index` read while it is traced. With
``weights="auto"`` the plan's weights are an input too, and every shard is
timed (`tfshard._balance`): the step's bodies then return a `Timing` beside
their results.

What a trace learns comes back as values: `run` returns the shards' outputs
with their structure and timing (`ShardOutputs`), and a shared trace its structure and
whether it writes a resource (`tfshard._sharding.Trace`). One exception, in
`tfshard._shards.skip_if_empty`: a whole shard's empty outputs copy what the
branch with rows returned, which `tf.cond` traces first (with a fallback if it
did not). This module alone writes the two scopes a call's ops are read by:
``tfshard_shard_k/`` for shard k (`errors.SHARD_SCOPE`, read back by
`errors.shard_in`) and ``tfshard_collect/`` for the gather or reduction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfshard import _arguments, _balance, _chunks, _kinds, _sharding, _trees, collect, pinning
from tfshard._kinds import prefix_sums
from tfshard._options import Options
from tfshard._plan import (
    Planned,
    agreed_rows,
    onto_devices,
    plan_and_split,
    plan_device,
    row_count,
)
from tfshard._shards import (
    ShardOutputs,
    by_row,
    check_outputs,
    check_rows,
    no_rows_like,
    shard_of,
    skip_if_empty,
)
from tfshard.errors import SHARD_SCOPE
from tfshard.position import Lazy, Position
from tfshard.replicas import Replicas

# The name scope of the gather or reduction's ops.
COLLECT_SCOPE = "tfshard_collect"
# The name scope of the ops of a shard's position, made where the function reads it.
POSITION_SCOPE = "tfshard_position"


@dataclasses.dataclass(frozen=True)
class Step:
    """One call of a function on these devices, for one trace key (module docstring).

    Attributes:
      fn: the user's function, autograph applied.
      name: its name, for messages.
      options: the function's options (`tfshard._options.Options`, with
        `jit_compile` decided), read for what is the same in every step of it:
        `per_sample`, `ragged`, `reduce`, `jit_compile`.
      weights: integer weights for the plan, or None for an even split (or,
        `balanced`, until the call feeds its own).
      devices: the shards' devices; `output` where results land (and the
        outputs' rows are checked), `host` the CPU where a plan of weights fed at
        run time runs (others run where the batch is: `tfshard._plan`).
      replicas: the replicated variables the shards read, or None.
      template: how the call's arguments are rebuilt from its tensors.
      split_devices: where each split tensor lives ("" when not known).
      beside_transfers: the shards run while the next batch is copied beside
        them (a stream's), which `tfshard._sharding.choose` takes into account.
      balanced: ``weights="auto"`` with more than one device in the step: each
        call feeds the plan's weights, and every shard is timed
        (`tfshard._balance.timed`). A device alone has nothing to weigh.
      max_rows: the most rows each shard's function takes at once (None: all
        of them), one per device, or None for no limit anywhere.
      guarded: a shard may have no rows (a batch smaller than the devices, a
        device weighted 0, rows unknown when traced), so each skips the
        function where it has none (`skip_if_empty`, a `tf.cond`). Unguarded,
        every shard runs the function on its rows: the engine picks it for a
        call whose plan gives every device a row, and saves the cond's cost
        in tracing and running.
      shards: each device's index among the function's devices, where the
        step holds only those the weights give rows (`tfshard._engine.Engine.holding`),
        or None: `devices` are the function's, in order. Its shards keep their
        index (`tfshard.shard_index`, the ``tfshard_shard_k/`` scope, errors).
      listed: how many devices the function has (`per_shard` gives each a
        result), or None: as many as `devices`.
      caps: each device's most rows (None: no cap), constants of the plan, which
        then runs on `host` (``weights="auto"`` after a shard ran out of memory:
        `tfshard._plan`, water-filling), or None: no caps, no ops of them.
    """

    fn: Callable[..., Any]
    name: str
    options: Options
    weights: tuple[int, ...] | None
    devices: tuple[str, ...]
    output: str
    host: str
    replicas: Replicas | None
    template: _arguments.Template
    split_devices: tuple[str, ...]
    beside_transfers: bool = False
    balanced: bool = False
    max_rows: tuple[int | None, ...] | None = None
    guarded: bool = True
    shards: tuple[int, ...] | None = None
    listed: int | None = None
    caps: tuple[int | None, ...] | None = None

    @property
    def alone(self) -> bool:
        """One device holds every row (weights ``[1, 0]`` too): no plan, split, gather
        or timing, the function traced on the call's tensors under the device's scope,
        its outputs landing on `output`."""
        return len(self.devices) == 1

    def index(self, k: int) -> int:
        """The index of the step's k-th device among the function's devices."""
        return k if self.shards is None else self.shards[k]

    def _checks_on(self) -> str:
        """Where the outputs' rows are checked: where results land (the gather's rows
        are there), or, for a device alone, where its first split argument lives (its
        own device where that is not known)."""
        if not self.alone:
            return self.output
        return (self.split_devices[0] if self.split_devices else "") or self.devices[0]

    def _planned_on(self) -> str:
        """Where `plan` plans a call of several devices (`_plan.plan_device`): where
        the batch is, or the host for weights fed at run time (``weights="auto"``)."""
        if self.balanced:
            return self.host
        return plan_device(self.split_devices, self.weights, self.host, self.caps)

    # ------------------------------------------------------------ the parts

    def plan(
        self, tensors: Sequence[Any], weights: tf.Tensor | None = None
    ) -> tuple[Planned, list[Any]]:
        """The call's tensors planned and split (`_plan.plan_and_split`), and its broadcast ones.

        Args:
          tensors: the call's split tensors, then its broadcast ones.
          weights: the plan's integer weights fed at run time (int64 ``[K]``,
            ``weights="auto"``), or None for the step's own.
        """
        count = self.template.split_count
        inputs, shared = tensors[:count], list(tensors[count:])
        paths = self.template.split_paths()
        if self.alone:
            return self._whole(inputs, paths), shared
        plan_weights = self.weights if weights is None else weights
        planned = plan_and_split(
            inputs,
            self.split_devices,
            paths,
            len(self.devices),
            plan_weights,
            self.host,
            self.caps,
        )
        return planned, shared

    def _whole(self, inputs: Sequence[Any], paths: Sequence[str]) -> Planned:
        """Every row to the one device (`alone`): nothing to plan or split.

        The rows are counted where the first argument lives (`_checks_on`: a
        Shape op, none where they are static), and where an argument came from
        a graph, the check that the arguments' rows agree runs there too
        (`tfshard._plan.agreed_rows`, the one `plan_and_split` makes).
        """
        device = self._checks_on()
        n = agreed_rows(inputs, self.split_devices, paths, device)
        with tf.device(device):
            sizes = tf.stack([n])
            total = tf.cast(n, tf.int64)
        return Planned(total, sizes, [[t] for t in inputs])

    def onto_devices(self, planned: Planned) -> Planned:
        """Each shard's rows copied to its device now, ahead of its run (a stream's feed)."""
        return onto_devices(planned, self.devices)

    def run(
        self, planned: Planned, shared: Sequence[Any], offset: tf.Tensor | None = None
    ) -> ShardOutputs:
        """Each shard under its device scope; their outputs, checked alike.

        Args:
          planned: the split, ``planned.pieces[i][k]`` argument i's rows for shard k.
          shared: the broadcast tensors, whole to every shard.
          offset: the global row of the batch's first row (int64: a stream's
            rows before it), or None for 0.
        """
        count = len(self.devices)
        how = _sharding.choose(
            self.devices,
            self.output,
            self.host,
            replicas=self.replicas is not None,
            jit_compile=self.options.jit_compile,
            beside_transfers=self.beside_transfers,
            chunked=self.max_rows is not None,
        )
        all_in_place = all(h is _sharding.How.IN_PLACE for h in how)
        # Each shard's rows as it takes them (`skip_if_empty`, chunks, a trace's input):
        # an int32 scalar where the plan is, which a function on a GPU takes in host
        # memory. A guarded shard of several counts its own (below); a bare shard in
        # place takes none.
        rows: list[Any] = [None] * count
        counts_its_own = self.guarded and not self.alone
        chunked = self.max_rows is not None
        if not counts_its_own and (self.guarded or chunked or not all_in_place):
            with _kinds.placed(self.devices[0] if self.alone else self._planned_on()):
                rows = tf.unstack(planned.sizes, num=count)

        def befores() -> list[tf.Tensor]:
            # The rows before each shard, where the plan is, once a shard reads its row:
            # named outside every shard's scope, as the plan is (not a shard's op).
            top = tf.compat.v1.get_default_graph().name_scope(None)
            with top, tf.name_scope(POSITION_SCOPE), _kinds.placed(self._planned_on()):
                return tf.unstack(prefix_sums(planned.sizes, count, exclusive=True), num=count)

        before = Lazy(befores)  # one for every shard
        positions = [self._position(k, before, offset) for k in range(count)]
        example = [p[0] for p in planned.pieces]
        shard = shard_of(
            self.fn,
            self.template,
            shared,
            example,
            name=self.name,
            per_sample=self.options.per_sample,
            ragged=self.options.ragged,
        )

        def guarded(rows_in: Sequence[Any], n: tf.Tensor, position: Position) -> Any:
            return skip_if_empty(shard, rows_in, position, n > 0)

        def bare(rows_in: Sequence[Any], n: tf.Tensor, position: Position) -> Any:
            return shard.run(rows_in, position)

        # Unguarded (every shard has rows), in-place shards run the function bare. A
        # shared trace keeps its guard: inside a cond branch its nodes keep the user's
        # frames in an error (TF loses them for a function's top-level nodes once it
        # specialises the function for its scalar arguments).
        in_place = guarded if self.guarded else bare
        each = [[p[k] for p in planned.pieces] for k in range(count)]
        runs = _sharding.build(how, guarded, each, self.devices, in_place=in_place)
        clock = _balance.stamp() if self.balanced else None
        outputs, seconds = [], []
        for k, (device, run) in enumerate(zip(self.devices, runs)):
            # With replicas, the shard reads the copy of each variable on its device.
            replica = self.replicas.shard(device) if self.replicas else contextlib.nullcontext()
            pieces, n = each[k], rows[k]
            with tf.name_scope(f"{SHARD_SCOPE}{self.index(k)}"), tf.device(device), replica:
                if self.guarded and not self.alone:
                    # The guard's predicate (`skip_if_empty`) reads the rows where the
                    # shard runs (a Shape of its pieces copied here: int32 in host memory
                    # on a GPU), and its cond takes the pieces from here: nothing of the
                    # guard crosses between devices, and the rows cross once, as a bare
                    # shard's do (the cond would take them where the batch is, with the
                    # predicate sent there).
                    pieces = [_moved(piece) for piece in pieces]
                    n = row_count(pieces[0], device)
                # In place, the position is made only where the function reads it; a
                # shared or compiled trace takes it as inputs.
                position = positions[k] if all_in_place else positions[k].tensors()
                compute = functools.partial(
                    self._shard, run, pieces, n, position, device, self._limit(k)
                )
                if clock is None:
                    outputs.append(compute())
                else:
                    result, took = _balance.timed(compute, pieces, device, clock)
                    outputs.append(result)
                    seconds.append(took)
        timing = None
        if clock is not None:
            with tf.device(self.host):
                timing = _balance.Timing(tf.cast(planned.sizes, tf.int64), tf.stack(seconds))
        return ShardOutputs(*check_outputs(outputs, self.devices), timing)

    def _position(self, k: int, befores: Lazy, offset: tf.Tensor | None) -> Position:
        """Shard k's `Position`, each field made where the function first reads it
        (`tfshard.position.Lazy`): its index, and its global first row, the rows of
        the shards before it (`befores`: int32 where the plan is) cast to int64 on its
        device (a GPU's Cast holds both in device memory: the int32 crosses once, as
        the shard's rows do), plus a stream's `offset`."""
        index = self.index(k)
        device = self.devices[k]

        def shard_index() -> tf.Tensor:
            with tf.name_scope(POSITION_SCOPE):
                return tf.constant(index, tf.int32)

        def first() -> tf.Tensor:
            made = befores()[k] if k else None
            with tf.name_scope(POSITION_SCOPE), tf.device(device):
                start = tf.constant(0, tf.int64) if made is None else tf.cast(made, tf.int64)
                return start if offset is None else start + tf.cast(offset, tf.int64)

        return Position(Lazy(shard_index), Lazy(first))

    def _limit(self, k: int) -> int | None:
        return None if self.max_rows is None else self.max_rows[k]

    def _shard(
        self,
        run: _sharding.ShardFn,
        pieces: list[Any],
        rows: tf.Tensor,
        position: Position,
        device: str,
        limit: int | None,
    ) -> Any:
        """One shard's outputs: `run` on all its rows, or in chunks of `limit` (`_chunks`)."""
        if limit is None:
            return run(pieces, rows, position)
        return _chunks.in_chunks(
            run,
            pieces,
            rows,
            position,
            limit,
            reduce=self.options.reduce,
            per_sample=self.options.per_sample,
            device=device,
            name=self.name,
        )

    def collect(self, outputs: ShardOutputs, planned: Planned) -> list[Any]:
        """The outputs gathered in input order, or the reduction's running totals.

        Outputs are checked as `check` says, the gathered ones' rows with the
        counts the gather saw; a reduction's totals are undivided (`finish`
        divides a mean), so a stream can add up batches.
        """
        leaves = outputs.leaves()
        with tf.name_scope(COLLECT_SCOPE), tf.device(self.output):
            if self.options.reduce is None and self.alone:
                outputs.check_gatherable(self.name)
                # One shard's outputs are the call's: no gather (a copy where they
                # land elsewhere, as a tf.function's outputs are copied).
                here = pinning.same_device(self.devices[0], self.output)
                results = [v[0] if here else _moved(v[0]) for v in leaves]
                counted = {}
            elif self.options.reduce is None:
                outputs.check_gatherable(self.name)
                # Each shard's rows counted where they land, for the check of a whole
                # shard's outputs (a per-sample function's are one per row by construction).
                results, counted = collect.gather_leaves(leaves, not self.options.per_sample)
            else:
                per_sample, sizes, op = self.options.per_sample, planned.sizes, self.options.reduce
                rowed = [by_row(values[0], per_sample=per_sample, reduce=op) for values in leaves]
                paths = [outputs.path(i) for i in range(len(leaves))]
                results = collect.reduce_leaves(leaves, paths, self.devices, sizes, op, rowed)
                counted = {}
        self._check_rows(outputs, planned, counted)
        return results

    def check(self, outputs: ShardOutputs, planned: Planned) -> None:
        """The checks `collect` makes, for outputs a stream gathers itself: gathered
        outputs are not a scalar per shard, and each output of one value per row has
        one row per row (`tfshard._shards.check_rows`)."""
        if self.options.reduce is None:
            outputs.check_gatherable(self.name)
        self._check_rows(outputs, planned, {})

    def finish(self, totals: Sequence[Any], rows: Any) -> list[Any]:
        """`collect`'s results as the call's: a reduction's totals over `rows` divided
        (a mean) and in the outputs' dtypes; gathered outputs as they are."""
        if self.options.reduce is None:
            return list(totals)
        with tf.device(self.output):
            return [collect.finished(t, rows, self.options.reduce) for t in totals]

    def _check_rows(
        self, outputs: ShardOutputs, planned: Planned, counted: dict[int, tf.Tensor]
    ) -> None:
        """`check_rows` with this step's plan, devices and options, where it checks."""
        options = self.options
        check_rows(
            outputs, planned.sizes, self.devices, self._checks_on(), counted,
            per_sample=options.per_sample, reduce=options.reduce,
        )  # fmt: skip

    # ------------------------------------------------------ traced bodies

    def call(
        self,
        tensors: Sequence[Any],
        offset: tf.Tensor | None = None,
        weights: tf.Tensor | None = None,
    ) -> Any:
        """The traced body of a call: plan, run, collect, finish; outputs as returned.

        Args:
          tensors: the call's tensors (split, then broadcast).
          offset: the global row of its first row (a stream's batch), or None for 0.
          weights: the plan's weights, fed (``weights="auto"``), or None.

        Returns:
          The outputs; with `balanced`, ``(outputs, timing)``.
        """
        planned, shared = self.plan(tensors, weights)
        outputs = self.run(planned, shared, offset)
        results = self.finish(self.collect(outputs, planned), planned.total)
        built = _trees.build(outputs.structure, iter(results))
        return built if outputs.timing is None else (built, outputs.timing)

    def totals(
        self,
        tensors: Sequence[Any],
        offset: tf.Tensor | None = None,
        weights: tf.Tensor | None = None,
    ) -> Any:
        """The traced body of a stream's batch under a reduction: `collect`'s totals,
        undivided (a stream adds batches up), in the outputs' structure; with
        `balanced`, ``(totals, timing)``."""
        planned, shared = self.plan(tensors, weights)
        outputs = self.run(planned, shared, offset)
        built = _trees.build(outputs.structure, iter(self.collect(outputs, planned)))
        return built if outputs.timing is None else (built, outputs.timing)

    def per_shard(
        self,
        tensors: Sequence[Any],
        offset: tf.Tensor | None = None,
        weights: tf.Tensor | None = None,
    ) -> list[Any]:
        """The traced body of `per_shard`: plan, run; each shard's outputs as they are.

        One result per device of the function: a device the weights give no rows
        (not in the step, `shards`) gets what a shard without rows returns
        (`no_rows_like`), made where results land, so nothing runs on it.
        """
        planned, shared = self.plan(tensors, weights)
        outputs = self.run(planned, shared, offset)
        results = [_trees.build(outputs.structure, iter(leaves)) for leaves in outputs.flat]
        if self.shards is None:
            return results
        with tf.device(self.output):
            empties = [no_rows_like(leaf, self.options.per_sample) for leaf in outputs.flat[0]]
            empty = _trees.build(outputs.structure, iter(empties))
        held = dict(zip(self.shards, results))
        return [held.get(k, empty) for k in range(self.listed or len(self.devices))]


def _moved(value: Any) -> Any:
    """`value` copied under the caller's device scope (a ragged one part by part)."""
    return tf.nest.map_structure(tf.identity, value, expand_composites=True)
