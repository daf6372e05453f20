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

A `tf.function` given to `tfshard.parallelize` is traced as its Python function
(`tfshard._autograph.autographed`), so it reads its shard's position like any
function. One that the function calls keeps, in its cache, the trace of its
first call, with that call's position in it: a later call (another shard or
chunk, another trace) reads nothing, and gets a `TfshardError` naming the fix
(`Reads`, `check_no_stale_position`), never the first call's position.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import tensorflow as tf

from tfshard.errors import POSITION_NAME, STALE_POSITION_FIX, TfshardError

__all__ = (
    "Position",
    "Reads",
    "check_no_stale_position",
    "row_index",
    "seen",
    "shard_index",
    "tracing",
)


class Lazy:
    """A tensor made where the function first reads it, not before: a function that
    never calls `shard_index` or `row_index` gets no op of its position.

    `make` builds the tensor (under its own device scope where that matters) in
    the current graph, once per graph: `shard_index` and `row_index` make it in
    the graph the function is traced in, also for a read inside a `tf.cond`
    branch, a loop body or a `tf.function`, which capture it from there
    (`_made_at_home`). It is made outside any control dependencies, so a read
    under `tf.control_dependencies` orders nothing else.
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


class Reads:
    """Whether the calls of one function in one trace of a call read their position:
    the check that each call reads its own.

    A plain function reads it each time it is called. A `tf.function` that the
    function calls reads it in its first trace only: its cache hands every
    later call (another shard, a shared trace, the next chunk) that trace,
    with the first call's position in it, and the later call reads nothing.
    `seen` raises a `TfshardError` for such a call, naming the fix.

    Args:
      name: the parallelized function's name, for the message.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.read = False

    def after(self, read: bool) -> None:
        """Takes note of one call that read its position (`read`) or did not."""
        if read:
            self.read = True
        elif self.read:
            raise TfshardError(f"{self.name}: {STALE_POSITION_FIX.format(name=self.name)}")


def check_no_stale_position(graph: Any, name: str) -> None:
    """Raises TfshardError where a call's traced graph (a concrete function) captured
    a shard's position made in another trace.

    A `tf.function` the function calls, traced in an earlier trace of a call
    (another parallelized function's, another batch size's) holds that trace's
    position (`_made_at_home`); its cache hands it to this trace, whose call
    reads nothing and would fail when run, naming a tensor of no use to the user.
    A tensor of a trace still under way (the graph this call is traced in, or a
    shard's trace around it) is the caller's own: a parallelized function called
    inside a shard may close over that shard's position.
    """
    under_way = [tf.compat.v1.get_default_graph(), *(s.graph for s in _SEEN.get())]
    for captured in graph.captured_inputs:
        if not tf.is_symbolic_tensor(captured) or not _POSITION.fullmatch(captured.name):
            continue
        if not any(captured.graph is g for g in under_way):
            raise TfshardError(f"{name}: {STALE_POSITION_FIX.format(name=name)}")


_POSITION = re.compile(POSITION_NAME)
# The name scope of what a read makes (`_made_at_home`), as `tfshard._step` names
# the position it makes.
POSITION_SCOPE = "tfshard_position"


class _Call:
    """Whether one call of the function read its position (`Reads`)."""

    read = False


class _Seen(NamedTuple):
    """What one trace of the user's function sees: its shard, and its rows' first row.

    `count` is the number of rows the function takes at once (whole shard), or
    None for one sample, whose global row is `first` itself. Each may be a `Lazy`.
    `call` notes whether the function read them; `graph` is the graph the
    function is traced in, where they are made (`_made_at_home`).
    """

    index: tf.Tensor | Lazy
    first: tf.Tensor | Lazy | None  # None: a sample whose row was not mapped (`row_index`)
    count: tf.Tensor | Lazy | None
    call: _Call
    graph: Any


# The traces under way in this thread, innermost last (a parallelized function
# called inside a shard sees its own shards).
_SEEN: contextvars.ContextVar[tuple[_Seen, ...]] = contextvars.ContextVar(
    "tfshard_seen", default=()
)


@contextlib.contextmanager
def seen(
    position: Position, count: tf.Tensor | Lazy | None, reads: Reads | None = None
) -> Iterator[None]:
    """A context in which the function being traced sees `position`.

    Args:
      position: the shard's index and the global row of the first row the
        function takes (for one sample, that sample's row).
      count: the rows the function takes at once (int64), or None for one sample.
      reads: the record of the function's earlier calls in this trace, told
        whether this one read its position (`Reads.after`), or None.

    Raises:
      TfshardError: (on leaving) this call read no position where an earlier
        one did (`Reads`).
    """
    call = _Call()
    graph = tf.compat.v1.get_default_graph()
    token = _SEEN.set((*_SEEN.get(), _Seen(position.index, position.first, count, call, graph)))
    try:
        yield
    finally:
        _SEEN.reset(token)
    if reads is not None:
        reads.after(call.read)


def tracing() -> bool:
    """Whether tfshard is tracing a parallelized function in this thread (`seen`)."""
    return bool(_SEEN.get())


def _innermost(name: str) -> _Seen:
    found = _SEEN.get()
    if not found:
        raise TfshardError(
            f"tfshard.{name}() was called outside a parallelized function: it is the "
            "position of the shard whose trace calls it, so call it inside a function "
            "given to tfshard.parallelize (for the same value on one device, parallelize "
            "the function with devices=[one device])"
        )
    found[-1].call.read = True
    return found[-1]


@contextlib.contextmanager
def _made_at_home(seen_now: _Seen) -> Iterator[None]:
    """Makes a read's tensors in the graph the function is traced in, not in a graph
    inside it: a `tf.cond` branch or a loop body captures them from there, and a
    `tf.function`'s trace that read them (cached, handed to another shard or chunk)
    holds a tensor of this shard's graph, never a constant of its position: another
    graph cannot use it (an error, `errors.reads_a_stale_position`), and a later call
    in this graph reads nothing (`Reads`). What it makes is named in the position's
    scope (`errors.POSITION_NAME`), which `check_no_stale_position` recognises."""
    if tf.compat.v1.get_default_graph() is seen_now.graph:
        with tf.name_scope(POSITION_SCOPE):
            yield
        return
    with seen_now.graph.as_default(), tf.control_dependencies(None), tf.name_scope(POSITION_SCOPE):
        yield


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
    seen_now = _innermost("shard_index")
    with _made_at_home(seen_now):
        return made(seen_now.index)


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
    with _made_at_home(seen_now):
        if seen_now.count is None:
            return made(seen_now.first)
        return Position(seen_now.index, seen_now.first).rows(seen_now.count)
