"""Where a shard is: its index, and the global rows it holds, as the user's function sees them.

Inside a parallelized function, `shard_index` is the shard's index and
`row_index` the global row of the sample (per sample) or of each row of the
shard (whole shard), counted over the whole input: the call's batch, or the
whole stream of a dataset. They are what ``replica_id_in_sync_group`` and JAX's
``axis_index`` give, and row ids make a per-row random stream one line, the
same whatever the device count::

    >>> @tfshard.parallelize(devices=["cpu:0", "cpu:1"])
    ... def where(sample):
    ...     return tf.stack([tf.cast(tfshard.shard_index(), tf.int64), tfshard.row_index()])
    >>> where(np.zeros([3, 2])).numpy().tolist()
    [[0, 0], [0, 1], [1, 2]]

How: one trace of a shard's computation may serve several shards (a shared
trace, an XLA compile), so a shard's index and its first global row are
runtime inputs of that computation (`Position`, tensors the step passes per
shard), never constants of its trace. A shard traced in place makes them only
where the function reads them (`Lazy`): a function that never asks costs no
op. The function reads them through a context that tfshard enters around its
trace of the function (`seen`) and leaves after it: nothing is left behind,
and outside a parallelized function both raise a `TfshardError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import tensorflow as tf

from tfshard.errors import TfshardError

__all__ = ("Position", "row_index", "seen", "shard_index")


class Lazy:
    """A tensor made where the function first reads it, not before: a function that
    never calls `shard_index` or `row_index` gets no op of its position.

    `make` builds the tensor (under its own device scope where that matters) in
    the graph that reads it, once per graph: a read inside a `tf.cond` branch or
    a loop body makes it there (taking what it needs from the graph around it),
    and a later read in the graph around makes its own. It is made outside any
    control dependencies, so a read under `tf.control_dependencies` orders
    nothing else.
    """

    def __init__(self, make: Callable[[], tf.Tensor]) -> None:
        self._make = make
        self._made: weakref.WeakKeyDictionary[Any, tf.Tensor] = weakref.WeakKeyDictionary()

    def __call__(self) -> tf.Tensor:
        graph = tf.compat.v1.get_default_graph()
        value = self._made.get(graph)
        if value is None:
            with tf.control_dependencies(None):
                value = self._made[graph] = self._make()
        return value


def made(value: Any) -> Any:
    """`value`'s tensor: a `Lazy` made now (in the current graph), anything else as it is."""
    return value() if isinstance(value, Lazy) else value


class Position(NamedTuple):
    """Where one shard (or one chunk of its rows) is, as tensors of the graph that runs it.

    Each field is a tensor, or a `Lazy` one made only where the function reads
    it (a shard traced in place); `tensors` makes both, for a trace that takes
    them as inputs (a shared or compiled trace, `tfshard._sharding`).

    Attributes:
      index: the shard's index, an int32 scalar.
      first: the global row of its first row, an int64 scalar: the call's or
        the stream's row offset plus the rows of the shards before it.
    """

    index: tf.Tensor
    first: tf.Tensor

    @staticmethod
    def specs() -> Position:
        """The specs of a `Position`, for a trace that takes one."""
        return Position(tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int64))

    def tensors(self) -> Position:
        """This position with both fields made tensors (in the current graph)."""
        return Position(made(self.index), made(self.first))

    def rows(self, count: tf.Tensor) -> tf.Tensor:
        """The global rows of `count` rows from `first`: ``[count]`` int64."""
        return made(self.first) + tf.range(tf.cast(made(count), tf.int64), dtype=tf.int64)

    def after(self, rows: tf.Tensor) -> Position:
        """The position `rows` rows further on (a chunk's, inside its shard), as lazy
        as this one."""
        first = self.first
        if isinstance(first, Lazy):
            return Position(self.index, Lazy(lambda: first() + tf.cast(rows, tf.int64)))
        return Position(self.index, first + tf.cast(rows, tf.int64))


class _Seen(NamedTuple):
    """What one trace of the user's function sees: its shard, and its rows' first row.

    `count` is the number of rows the function takes at once (whole shard), or
    None for one sample, whose global row is `first` itself. Each may be a `Lazy`.
    """

    index: tf.Tensor | Lazy
    first: tf.Tensor | Lazy | None  # None: a sample whose row was not mapped (`row_index`)
    count: tf.Tensor | Lazy | None


# The traces under way in this thread, innermost last (a parallelized function
# called inside a shard sees its own shards).
_SEEN: contextvars.ContextVar[tuple[_Seen, ...]] = contextvars.ContextVar(
    "tfshard_seen", default=()
)


@contextlib.contextmanager
def seen(position: Position, count: tf.Tensor | Lazy | None) -> Iterator[None]:
    """A context in which the function being traced sees `position`.

    Args:
      position: the shard's index and the global row of the first row the
        function takes (for one sample, that sample's row).
      count: the rows the function takes at once (int64), or None for one sample.
    """
    token = _SEEN.set((*_SEEN.get(), _Seen(position.index, position.first, count)))
    try:
        yield
    finally:
        _SEEN.reset(token)


def _innermost(name: str) -> _Seen:
    found = _SEEN.get()
    if not found:
        raise TfshardError(
            f"tfshard.{name}() was called outside a parallelized function: it is the "
            "position of the shard whose trace calls it, so call it inside a function "
            "given to tfshard.parallelize (for the same value on one device, parallelize "
            "the function with devices=[one device])"
        )
    return found[-1]


@tf.autograph.experimental.do_not_convert
def shard_index() -> tf.Tensor:
    """The index of the shard running the function: an int32 scalar, 0 to K - 1.

    Shard k runs on ``f.devices[k]`` and holds the k-th block of rows of the
    plan (`tfshard.ShardedFunction.plan`). It is a tensor of the shard's graph,
    fed at run time: one trace may serve several shards.

    Returns:
      An int32 scalar tensor.

    Raises:
      TfshardError: called outside a function run by `tfshard.parallelize`.
    """
    return made(_innermost("shard_index").index)


@tf.autograph.experimental.do_not_convert
def row_index() -> tf.Tensor:
    """The global row index of the current sample, or of each row of the shard.

    Counted over the whole input: the rows of the call's batch, or of the whole
    stream for a `tf.data.Dataset` (the rows of the batches before this one,
    then this batch's). Per sample it is a scalar; for a whole-shard function
    (``per_sample=False``) a ``[n]`` vector, one per row of the shard (of the
    chunk, with ``max_rows=``). Keyed by it, a stateless random op gives every
    row its own numbers, the same whatever the device count or weights:
    ``tf.random.stateless_normal([3], seed=tf.stack([tf.constant(7, tf.int64),
    tfshard.row_index()]))``.

    Returns:
      An int64 tensor: a scalar per sample, ``[n]`` for a whole shard.

    Raises:
      TfshardError: called outside a function run by `tfshard.parallelize`.
    """
    seen_now = _innermost("row_index")
    if seen_now.first is None:  # `tfshard._shards.vectorized` mapped no rows
        raise TfshardError(
            "tfshard.row_index() was called in a trace of the function on one sample, but "
            "not in the trace tfshard made first to learn its outputs, so no sample's row "
            "was mapped with it; read it in every trace (not behind a Python condition)"
        )
    if seen_now.count is None:
        return made(seen_now.first)
    return Position(seen_now.index, seen_now.first).rows(seen_now.count)
