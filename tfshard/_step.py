"""One call of a function on these devices: plan, run the shards, collect.

A `Step` is what tfshard knows of one call of a parallelized function with one
trace key: where its arguments go (plan and split, `tfshard._plan`), how each
shard runs (one `tf.device` block each, as `tfshard._sharding` chooses), and how
the outputs come back (`tfshard.collect`). Every path is a composition of its
parts, in one traced graph::

    f(x):          plan -> run -> collect -> finish      [N, ...] in input order, or reduced
    f.per_shard:   plan -> run                           each shard's outputs
    a stream:      plan -> onto_devices (ahead) -> run -> collect or check, batch after batch

    [N, ...] --plan (host)--> sizes --split--> K x [n_k, ...]
      --run: tf.device(d_k): vectorized_map(fn) or fn(shard)--> K outputs
      --collect (tf.device(output))--> [N, ...], or totals --finish--> the reduction

What a trace learns comes back as values: `run` returns the shards' outputs
with their structure (`ShardOutputs`), and a shared trace its structure and
whether it writes a resource (`tfshard._sharding.Trace`). This module alone
names the scopes a call's ops live in: ``tfshard_shard_k/`` for shard k
(`errors.SHARD_SCOPE`, which errors and `tfshard._graph` read back) and
``tfshard_collect/`` for the gather or reduction.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfshard import _arguments, _sharding, _trees, collect
from tfshard._plan import Planned, onto_devices, plan_and_split
from tfshard._shards import (
    ShardOutputs,
    check_outputs,
    check_rows,
    per_row,
    shard_of,
    skip_if_empty,
)
from tfshard.errors import SHARD_SCOPE
from tfshard.replicas import Replicas

# The name scope of the gather or reduction's ops.
COLLECT_SCOPE = "tfshard_collect"


@dataclasses.dataclass(frozen=True)
class Step:
    """One call of a function on these devices, for one trace key (module docstring).

    Attributes:
      fn: the user's function, autograph applied.
      name: its name, for messages.
      per_sample: map it over rows, or call it on whole shards.
      ragged: stack per-sample outputs as ragged tensors.
      reduce: the reduction record, or None to gather.
      weights: integer weights for the plan, or None for an even split.
      jit_compile: compile each shard with XLA.
      devices: the shards' devices; `output` where results land, `host` the CPU
        where the plan and checks run.
      replicas: the replicated variables the shards read, or None.
      template: how the call's arguments are rebuilt from its tensors.
      split_devices: where each split tensor lives ("" when not known).
      beside_transfers: the shards run while the next batch is copied beside
        them (a stream's), which `tfshard._sharding.choose` takes into account.
    """

    fn: Callable[..., Any]
    name: str
    per_sample: bool
    ragged: bool
    reduce: collect.Reduction | None
    weights: tuple[int, ...] | None
    jit_compile: bool
    devices: tuple[str, ...]
    output: str
    host: str
    replicas: Replicas | None
    template: _arguments.Template
    split_devices: tuple[str, ...]
    beside_transfers: bool = False

    # ------------------------------------------------------------ the parts

    def plan(self, tensors: Sequence[Any]) -> tuple[Planned, list[Any]]:
        """The call's tensors planned and split (`_plan.plan_and_split`), and its broadcast ones."""
        count = self.template.split_count
        inputs, shared = tensors[:count], list(tensors[count:])
        paths = self.template.split_paths()
        planned = plan_and_split(
            inputs, self.split_devices, paths, len(self.devices), self.weights, self.host
        )
        return planned, shared

    def onto_devices(self, planned: Planned) -> Planned:
        """Each shard's rows copied to its device now, ahead of its run (a stream's feed)."""
        return onto_devices(planned, self.devices)

    def run(self, planned: Planned, shared: Sequence[Any]) -> ShardOutputs:
        """Each shard under its device scope; their outputs, checked alike.

        Args:
          planned: the split, ``planned.pieces[i][k]`` argument i's rows for shard k.
          shared: the broadcast tensors, whole to every shard.
        """
        count = len(self.devices)
        with tf.device(self.host):
            # Each shard's rows as it takes them (`skip_if_empty`): an int32 scalar,
            # which a function on a GPU takes in host memory.
            rows = [tf.cast(n, tf.int32) for n in tf.unstack(planned.sizes, num=count)]
        example = [p[0] for p in planned.pieces]
        shard = shard_of(
            self.fn,
            self.template,
            shared,
            example,
            name=self.name,
            per_sample=self.per_sample,
            ragged=self.ragged,
        )

        def guarded(rows_in: Sequence[Any], n: tf.Tensor) -> Any:
            return skip_if_empty(shard, rows_in, n > 0)

        how = _sharding.choose(
            self.devices,
            self.output,
            self.host,
            replicas=self.replicas is not None,
            jit_compile=self.jit_compile,
            beside_transfers=self.beside_transfers,
        )
        runs = _sharding.build(how, guarded, example, self.devices)
        outputs = []
        for k, (device, run) in enumerate(zip(self.devices, runs)):
            # With replicas, the shard reads the copy of each variable on its device.
            replica = self.replicas.shard(device) if self.replicas else contextlib.nullcontext()
            with tf.name_scope(f"{SHARD_SCOPE}{k}"), tf.device(device), replica:
                outputs.append(run([p[k] for p in planned.pieces], rows[k]))
        return ShardOutputs(*check_outputs(outputs, self.devices))

    def collect(self, outputs: ShardOutputs, planned: Planned) -> list[Any]:
        """The outputs gathered in input order, or the reduction's running totals.

        Gathered outputs are checked to have one row per row (a whole-shard
        function's), with the counts the gather saw; a reduction's totals are
        undivided (`finish` divides a mean), so a stream can add up batches.
        """
        leaves = outputs.leaves()
        with tf.name_scope(COLLECT_SCOPE), tf.device(self.output):
            if self.reduce is None:
                outputs.check_gatherable()
                results, counted = collect.gather_leaves(leaves)
            else:
                by_row = [self.per_sample or per_row(values[0]) for values in leaves]
                paths = [outputs.path(i) for i in range(len(leaves))]
                sizes, op = planned.sizes, self.reduce
                results = collect.reduce_leaves(leaves, paths, self.devices, sizes, op, by_row)
                counted = {}
        self._check_rows(outputs, planned, counted)
        return results

    def check(self, outputs: ShardOutputs, planned: Planned) -> None:
        """The checks `collect` makes, for outputs a stream gathers itself."""
        if self.reduce is None:
            outputs.check_gatherable()
        self._check_rows(outputs, planned, {})

    def finish(self, totals: Sequence[Any], rows: Any) -> list[Any]:
        """`collect`'s results as the call's: a reduction's totals over `rows` divided
        (a mean) and in the outputs' dtypes; gathered outputs as they are."""
        if self.reduce is None:
            return list(totals)
        with tf.device(self.output):
            return [collect.finished(t, rows, self.reduce) for t in totals]

    def _check_rows(
        self, outputs: ShardOutputs, planned: Planned, counted: dict[int, tf.Tensor]
    ) -> None:
        # Per-sample outputs have one row per row by construction.
        if not self.per_sample:
            reduced = self.reduce is not None
            check_rows(outputs, planned.sizes, self.devices, self.host, counted, reduced)

    # ------------------------------------------------------ traced bodies

    def call(self, *tensors: Any) -> Any:
        """The traced body of a call: plan, run, collect, finish; outputs as returned."""
        planned, shared = self.plan(tensors)
        outputs = self.run(planned, shared)
        results = self.finish(self.collect(outputs, planned), planned.total)
        return _trees.build(outputs.structure, iter(results))

    def per_shard(self, *tensors: Any) -> list[Any]:
        """The traced body of `per_shard`: plan, run; each shard's outputs as they are."""
        planned, shared = self.plan(tensors)
        outputs = self.run(planned, shared)
        return [_trees.build(outputs.structure, iter(leaves)) for leaves in outputs.flat]
