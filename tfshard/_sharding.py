"""How each shard runs: traced in place, calling one shared trace, or compiled with XLA.

A step (`tfshard._step`) runs K shards of one computation (`tfshard._shards.Shard`),
each under its own device scope. How each one runs is one choice, made by one pure
function (`choose`) from where the shards are and what the function is asked to
do, and settled once by what the shared trace learned (`settle`):

- `How.IN_PLACE`: the shard traces the function into the call's graph. A shard on
  the output device or the host runs so, and every shard where sharing is not
  right (below).
- `How.SHARED`: the shard calls one trace of the function that every such shard
  shares (`Trace`), not inlined, under its own scope and device, so the function
  (a vectorised one's pfor conversion above all) is traced once, not per shard.
- `How.COMPILED`: the shard calls one XLA-compiled trace; `How.COMPILED_PER_DEVICE`
  with replicas, where each device's trace reads its own copies.

`build` turns the choice into one computation per shard. Every call of a trace
takes a token (`unordered`), so TensorFlow does not run the shards one after
another.

In place on the output device and the host, because a failure inside a called
function would lose its error to the cancelled receives beside the call (the
gather's, the row checks'); in place, the failing op is the first the step sees.
For the same reason nothing is shared with replicas, beside other transfers (a
stream feeding its next batch ahead), in chunks (``max_rows``) or across
workers; nor where one shard alone would call the trace (nothing to save). A
trace that writes a resource is not shared (`settle`): TensorFlow orders a
call's writes to a resource as one, so the shards would run in turn. Under XLA,
shards that write one resource run in turn either way.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import tensorflow as tf

from tfshard import _arguments, _trees, pinning
from tfshard._graph import writes_resources
from tfshard.position import Position

# A shard's computation: its rows, their number (int32) and its position in, its
# outputs out. The position is an input, not a constant, so that shards can share it.
ShardFn = Callable[[Sequence[Any], tf.Tensor, Position], Any]
# The same, also taking a resource handle it never reads (`unordered`).
TokenShardFn = Callable[[Sequence[Any], tf.Tensor, Position, tf.Tensor], Any]


class How(enum.Enum):
    """How one shard runs (see the module docstring)."""

    IN_PLACE = "in place"
    SHARED = "shared"
    COMPILED = "compiled"
    COMPILED_PER_DEVICE = "compiled per device"


def choose(
    devices: Sequence[str],
    output: str,
    host: str,
    *,
    replicas: bool,
    jit_compile: bool,
    beside_transfers: bool,
    chunked: bool = False,
) -> list[How]:
    """How each shard runs, from where the shards are and what is asked (pure).

    Args:
      devices: the shards' devices.
      output: where results land; `host`, the CPU where the plan runs.
      replicas: whether shards read replicated variables (each its device's copy).
      beside_transfers: other copies are pending beside the shards (a stream
        feeding its next batch ahead).
      chunked: shards run in chunks (``max_rows``), in a loop that would call a
        shared trace once per chunk.
    """
    if jit_compile:
        return [How.COMPILED_PER_DEVICE if replicas else How.COMPILED] * len(devices)
    here = [pinning.same_device(d, output) or pinning.same_device(d, host) for d in devices]
    remote = any(pinning.is_remote(d) for d in (*devices, output))
    if beside_transfers or replicas or remote or chunked or here.count(False) < 2:
        return [How.IN_PLACE] * len(devices)
    return [How.IN_PLACE if at_home else How.SHARED for at_home in here]


def settle(how: Sequence[How], writes: bool) -> list[How]:
    """`choose`'s choice once the shared trace is known: a trace that writes a resource
    is not shared (the shards would run in turn), so its shards run in place."""
    return [How.IN_PLACE if h is How.SHARED and writes else h for h in how]


@dataclasses.dataclass(frozen=True)
class Trace:
    """One trace of a shard's computation that shards call, and what it learned.

    Traced with any number of rows, from its rows, their number, the shard's
    position (`tfshard.position.Position`, an input: each caller passes its own)
    and a token (`unordered`). A `tf.function` would trace again under each device scope
    (its cache keys on the scope), so calls go to this one concrete function.

    Attributes:
      concrete: the concrete function.
      structure: its outputs' structure (a `_trees` key: a defaultdict stays one,
        where TensorFlow gives back a dict).
      writes: whether it, or a function it calls, writes a resource.
    """

    concrete: Any
    structure: Hashable
    writes: bool

    @classmethod
    def of(cls, guarded: ShardFn, shards: Sequence[Sequence[Any]], **options: Any) -> Trace:
        """`guarded` traced once for the rows of each of `shards` (each shard's rows);
        options go to `tf.function`.

        The rows stay open unless every shard's are of one fully known shape
        (a graph traced for exactly its batch's rows, `Engine._exact_rows`).
        """

        # The position's inputs are named tfshard_position (`errors.POSITION_NAME`).
        def traced(
            rows_in: Sequence[Any], rows: tf.Tensor, tfshard_position: Position, token: tf.Tensor
        ) -> Any:
            del token  # its handle alone keeps a call out of the stateful chain
            return guarded(rows_in, rows, tfshard_position)

        first = shards[0]
        alike = all(
            t.shape.is_fully_defined() and all(t.shape == r[i].shape for r in shards)
            for i, t in enumerate(first)
        )
        specs = [_arguments.type_spec(r, split=not alike) for r in first]
        concrete = tf.function(traced, autograph=False, **options).get_concrete_function(
            specs, tf.TensorSpec([], tf.int32), Position.specs(), tf.TensorSpec([], tf.resource)
        )
        structure = _trees.flatten(concrete.structured_outputs, "outputs")[1]
        return cls(concrete, structure, writes_resources(concrete))

    def __call__(
        self, rows_in: Sequence[Any], rows: tf.Tensor, position: Position, token: tf.Tensor
    ) -> Any:
        result = self.concrete(list(rows_in), rows, position, token)
        return _trees.build(self.structure, iter(_trees.flatten(result)[0]))


def build(
    how: Sequence[How],
    guarded: ShardFn,
    shards: Sequence[Sequence[Any]],
    devices: Sequence[str],
    *,
    in_place: ShardFn | None = None,
) -> list[ShardFn]:
    """One computation per shard, as `how` says; a shared choice is settled here.

    Args:
      how: `choose`'s choice, one per shard.
      guarded: a shard's computation, from its rows, their number and its
        position (its empty shard handled, `tfshard._shards.skip_if_empty`):
        what the shared and compiled traces run.
      shards: each shard's rows, for the traces' signatures (`Trace.of`).
      devices: the shards' devices.
      in_place: what a shard traced in place runs (default `guarded`; bare where
        every shard has rows).
    """
    in_place = guarded if in_place is None else in_place
    if How.COMPILED in how:
        return unordered(Trace.of(guarded, shards, jit_compile=True), devices)
    if How.COMPILED_PER_DEVICE in how:  # a trace per device: tf.function keys on it
        compiled = tf.function(_taking_token(guarded), autograph=False, jit_compile=True)
        return unordered(compiled, devices)
    if How.SHARED not in how:
        return [in_place] * len(devices)
    sharing = [rows for rows, h in zip(shards, how) if h is How.SHARED]
    shared = Trace.of(guarded, sharing, experimental_attributes=_NOT_INLINED)
    how = settle(how, shared.writes)
    calls = iter(unordered(shared, [d for d, h in zip(devices, how) if h is How.SHARED]))
    return [next(calls) if h is How.SHARED else in_place for h in how]


# "_noinline" is a name the public `experimental_attributes` accepts (TF's
# spelling, not a private API). Not inlined, a shared trace is instantiated per
# device, and a failing op's error names the calling op (``tfshard_shard_k/...``),
# so the shard.
_NOT_INLINED = {"_noinline": True}


def unordered(function: TokenShardFn, devices: Sequence[str]) -> list[ShardFn]:
    """Calls of `function`, one per device in shard order, that TensorFlow does not
    chain one after another.

    Automatic control dependencies chain stateful ops that take no resource in
    trace order (a call is stateful when its body is), but order ops that take a
    resource only per resource. Each call takes a token (`token`), made before
    any shard, so the calls are ordered only by the resources they write; each
    keeps the order of the side effects inside it.
    """
    tokens = [token(device) for device in devices]
    return [functools.partial(_with_token, function, t) for t in tokens]


def token(device: str) -> tf.Tensor:
    """A resource handle on `device` that nothing reads or writes: an op taking it
    stays out of the chain of every shard's stateful ops (see `unordered`)."""
    with tf.device(device):
        return tf.raw_ops.VarHandleOp(
            dtype=tf.float32, shape=[], shared_name="tfshard_unordered_token"
        )


def _with_token(
    function: TokenShardFn,
    handle: tf.Tensor,
    rows_in: Sequence[Any],
    rows: tf.Tensor,
    position: Position,
) -> Any:
    return function(rows_in, rows, position, handle)


def _taking_token(guarded: ShardFn) -> TokenShardFn:
    def run(
        rows_in: Sequence[Any], rows: tf.Tensor, tfshard_position: Position, handle: tf.Tensor
    ) -> Any:
        del handle  # see `unordered`
        return guarded(rows_in, rows, tfshard_position)

    return run
