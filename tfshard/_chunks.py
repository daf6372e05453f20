"""A shard's rows in chunks of at most ``max_rows``: one loop on its device, outputs as one run's.

With ``max_rows=`` a shard's computation (`tfshard._sharding.ShardFn`, as
`_sharding.build` made it: in place, shared or compiled) runs on consecutive
chunks of its rows instead of all of them at once, so a batch larger than a
small device's memory runs there::

    [n_k, ...] --chunks of <= m rows, in order, on the shard's device--> outputs of each
      --per-row outputs: TensorArray, concatenated--> [n_k, ...]   (as one run's)
      --a fixed-shape output under reduce=: combined as shards are--> the shard's value

The first chunk runs before the loop, exactly as an unchunked shard runs (a
shard with no rows returns its empty outputs, and what it returns gives the
loop its dtypes and shapes); the rest run in a `tf.while_loop`. The function
never sees more than ``max_rows`` rows. Per-row outputs (`_shards.by_row`) are
written chunk by chunk into TensorArrays and concatenated in order: they equal
one run's. A whole-shard output of fixed shape under a reduction (a shard's
mean loss or gradient) is weighted chunk by chunk as `collect.shard_partial`
weights a shard, and `collect.shard_value` turns the total back into one run's
value, so a whole-batch mean stays the whole batch's.

The loop takes the shard's token (`_sharding.token`): a loop whose body is
stateful (a random op, a print) would otherwise be chained after every other
shard's stateful ops, and the shards would run in turn. Under XLA each chunk
is one compiled call (the loop stays outside the compiled function, whose
shapes must be static): ``max_rows`` and the last chunk's size compile once
each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfshard import _sharding, _trees, collect
from tfshard._shards import ShardOutputs, by_row
from tfshard.position import Position


def in_chunks(
    run: _sharding.ShardFn,
    rows_in: Sequence[Any],
    count: tf.Tensor,
    position: Position,
    limit: int,
    *,
    reduce: collect.Reduction | None,
    per_sample: bool,
    device: str,
    name: str,
) -> Any:
    """`run` on `rows_in` in chunks of at most `limit` rows; outputs as one run's.

    Args:
      run: a shard's computation, from its rows, their number and its position.
      rows_in: the shard's rows of each split argument.
      count: the shard's rows, an int32 scalar.
      position: the shard's position (each chunk's is its own first row's).
      limit: the most rows one chunk takes.
      reduce: the call's reduction, or None to gather.
      per_sample: the function is mapped over rows (its outputs are all per row).
      device: the shard's device, where the loop runs.
      name: the function's name, for messages.

    Raises:
      ArgumentError: without a reduction, an output that cannot be gathered
        (`ShardOutputs.check_gatherable`, the check a call without chunks makes
        when it gathers): a chunk's rows are concatenated as a shard's are.
    """
    size = tf.constant(limit, tf.int32)
    head = tf.minimum(count, size)
    first = run([t[:head] for t in rows_in], head, position)
    leaves, structure = _trees.flatten(first)
    if reduce is None:  # a scalar cannot go into the rows' TensorArray: the gather's error
        ShardOutputs(structure, [leaves]).check_gatherable(name, chunks=True)
    # Which outputs are one value per row (concatenated), which a shard's value.
    rowed_at = [by_row(leaf, per_sample=per_sample, reduce=reduce) for leaf in leaves]
    rowed = [leaf for leaf, r in zip(leaves, rowed_at) if r]
    fixed = [leaf for leaf, r in zip(leaves, rowed_at) if not r]
    flows = collect.write_shards(collect.new_arrays(rowed), rowed, tf.constant(0), [rowed])
    totals = [collect.shard_partial(v, head, reduce, per_sample=False) for v in fixed]
    handle = _sharding.token(device)

    def body(i, start, flows, totals, handle):  # noqa: ANN001, ANN202
        n = tf.minimum(count - start, size)
        chunk = run([t[start : start + n] for t in rows_in], n, position.after(start))
        values = _trees.flatten(chunk)[0]
        rowed_now = [v for v, r in zip(values, rowed_at) if r]
        fixed_now = [v for v, r in zip(values, rowed_at) if not r]
        flows = collect.write_shards(flows, rowed, i, [rowed_now])
        partials = [collect.shard_partial(v, n, reduce, per_sample=False) for v in fixed_now]
        totals = collect.accumulate(totals, partials, reduce)
        return i + 1, start + n, flows, totals, handle

    invariants = (
        tf.TensorShape([]),
        tf.TensorShape([]),
        [tf.TensorShape([])] * len(flows),
        [collect.running_spec(reduce, v.dtype) for v in fixed],
        tf.TensorShape([]),
    )
    _, _, flows, totals, _ = tf.while_loop(
        lambda i, start, flows, totals, handle: start < count,
        body,
        (tf.constant(1), head, flows, totals, handle),
        shape_invariants=invariants,
    )
    gathered = iter(collect.concat_all(flows, rowed))
    reduced = iter(collect.shard_value(total, count, reduce) for total in totals)
    results = []
    for leaf, r in zip(leaves, rowed_at):
        value = next(gathered) if r else next(reduced)
        if not r:
            value.set_shape(leaf.shape)
        results.append(value)
    return _trees.build(structure, iter(results))
