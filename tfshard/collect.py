"""How results come back: gather shard outputs in order, or reduce them.

These functions run while `tfshard.parallelize` traces its graph. Gathering
writes each shard's output into a `tf.TensorArray` with ``infer_shape=False``
(shards have different row counts) and concatenates it under the caller's
device scope, the output device. Reductions are two-level: each shard reduces
its own rows on its own device (`shard_partial`), and only the small partials
cross to the output device (`combine`), so a ``reduce="sum"`` over a million
rows moves K values, not a million.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfshard.errors import ArgumentError

REDUCTIONS = ("sum", "mean", "max", "min")


def gather(values: Sequence[tf.Tensor | tf.RaggedTensor]) -> tf.Tensor | tf.RaggedTensor:
    """Concatenates per-shard outputs along axis 0, in shard order.

    Args:
      values: one output per shard, all dense or all ragged, with the same
        dtype and rank; row counts may differ (and may be 0).

    Returns:
      A tensor whose rows are shard 0's rows, then shard 1's, and so on.
    """
    if isinstance(values[0], tf.RaggedTensor):
        # A ragged tensor is its flat values plus one row-lengths vector per
        # ragged dimension; gathering each part in order gathers the whole.
        flat = _concat([v.flat_values for v in values])
        lengths = [
            _concat([v.nested_row_lengths()[level] for v in values])
            for level in range(values[0].ragged_rank)
        ]
        return tf.RaggedTensor.from_nested_row_lengths(flat, lengths, validate=False)
    return _concat(list(values))


def _concat(values: list[tf.Tensor]) -> tf.Tensor:
    # [n_k, *inner] x K -> [sum n_k, *inner]
    if any(value.shape.rank is None for value in values):
        return _concat_unknown_rank(values)
    inner = values[0].shape[1:]
    for value in values[1:]:
        inner = inner.most_specific_compatible_shape(value.shape[1:])
    array = tf.TensorArray(
        values[0].dtype,
        size=len(values),
        infer_shape=False,
        element_shape=tf.TensorShape([None]).concatenate(inner),
    )
    for k, value in enumerate(values):
        array = array.write(k, value)
    return array.concat()


def _concat_unknown_rank(values: list[tf.Tensor]) -> tf.Tensor:
    """`_concat` of outputs whose rank is not known until they run (a py_function's).

    An empty shard's output then cannot be told the others' shape (`empty`
    gives ``[0]``), so only shards with rows are written; with none, ``[0]``.
    """
    array = tf.TensorArray(values[0].dtype, size=0, dynamic_size=True, infer_shape=False)
    at = tf.constant(0)
    for value in values:
        has_rows = tf.shape(value)[0] > 0
        array = tf.cond(has_rows, lambda a=array, v=value, i=at: a.write(i, v), lambda a=array: a)
        at += tf.cast(has_rows, tf.int32)
    return tf.cond(array.size() > 0, array.concat, lambda: tf.zeros([0], values[0].dtype))


def empty(signature: object) -> object:
    """Outputs of zero samples for per-sample outputs of these specs (a nested structure).

    A dense leaf ``[...]`` gives ``[0, ...]`` (unknown dimensions 0); a ragged one
    an empty ragged tensor with its inner shape; a leaf of unknown rank gives
    ``[0]``, as nothing says more.
    """

    def zeros(spec: tf.TypeSpec) -> tf.Tensor | tf.RaggedTensor:
        if spec.shape.rank is None:
            return tf.zeros([0], spec.dtype)
        if isinstance(spec, tf.RaggedTensorSpec):
            # A sample [d_1, ...] stacks to [0, d_1, ...] with ragged_rank + 1 ragged
            # dimensions; the flat values keep the sample's dimensions after those.
            inner = [0 if d is None else d for d in spec.shape[spec.ragged_rank + 1 :]]
            lengths = [tf.zeros([0], spec.row_splits_dtype)] * (spec.ragged_rank + 1)
            return tf.RaggedTensor.from_nested_row_lengths(
                tf.zeros([0, *inner], spec.dtype), lengths, validate=False
            )
        return tf.zeros([0, *(0 if d is None else d for d in spec.shape)], spec.dtype)

    return tf.nest.map_structure(zeros, signature)


def check_reducible(value: tf.Tensor, op: str, path: str) -> None:
    """Raises ArgumentError when `op` cannot reduce outputs like `value`."""
    dtype = value.dtype
    if isinstance(value, tf.RaggedTensor):
        raise ArgumentError(
            f"{path} is ragged; reduce={op!r} needs outputs of one shape per sample "
            "(pad them, or drop reduce= and reduce the ragged result yourself)"
        )
    if dtype == tf.bool or dtype == tf.string:
        raise ArgumentError(
            f"{path} has dtype {dtype.name}, which reduce={op!r} cannot combine; "
            f"cast it (e.g. tf.cast({path.split('[')[0]}, tf.float32)) in the function"
        )
    if dtype.is_complex and op in ("max", "min"):
        raise ArgumentError(f"{path} is complex; reduce={op!r} needs an ordered dtype")


def identity(dtype: tf.DType, op: str) -> tf.Tensor:
    """The value that leaves `op` unchanged: 0 for sum/mean, -inf/+inf for max/min."""
    if op in ("sum", "mean"):
        return tf.zeros([], dtype)
    if dtype.is_floating:
        return tf.constant(float("-inf") if op == "max" else float("inf"), dtype)
    return tf.constant(dtype.min if op == "max" else dtype.max, dtype)


def shard_partial(value: tf.Tensor, size: tf.Tensor, op: str, per_sample: bool) -> tf.Tensor:
    """One shard's contribution to a reduction, computed on the shard's device.

    Args:
      value: with `per_sample`, the shard's stacked outputs ``[n_k, ...]``;
        without, the function's value for the whole shard (e.g. a shard mean).
      size: ``n_k``, the shard's row count (a scalar tensor).
      op: one of `REDUCTIONS`.
      per_sample: how to read `value`.

    Returns:
      For sum and mean the shard's sum over samples (a shard value is taken as
      the mean of its rows, so it counts ``n_k`` times); for max and min the
      shard's extreme. An empty shard gives the identity of `op`, so a function
      that returns NaN for an empty batch cannot spoil the result.
    """
    if per_sample:
        # [n_k, ...] -> [...]; empty shards give the identity by themselves.
        if op in ("sum", "mean"):
            return tf.reduce_sum(value, axis=0)
        return (tf.reduce_max if op == "max" else tf.reduce_min)(value, axis=0)
    neutral = tf.broadcast_to(identity(value.dtype, op), tf.shape(value))
    if op == "mean":
        value = value * tf.cast(size, value.dtype)
    return tf.where(size > 0, value, neutral)


def combine(partials: Sequence[tf.Tensor], total: tf.Tensor, op: str) -> tf.Tensor:
    """Combines the shards' partials into the reduction over all samples.

    Args:
      partials: one `shard_partial` per shard, same shape.
      total: the number of samples, N (a scalar tensor).
      op: one of `REDUCTIONS`.

    Returns:
      The sum, mean, max or min over all N samples. The mean divides the
      total sum by N, so it is the mean over samples, not the mean of shard
      means. With N == 0 a float mean is NaN (as `tf.reduce_mean` gives) and
      an integer mean is 0.
    """
    stacked = tf.stack(list(partials))  # K x [...] -> [K, ...]
    if op == "max":
        return tf.reduce_max(stacked, axis=0)
    if op == "min":
        return tf.reduce_min(stacked, axis=0)
    summed = tf.reduce_sum(stacked, axis=0)
    if op == "sum":
        return summed
    count = tf.cast(total, summed.dtype)
    if summed.dtype.is_integer:
        # tf.reduce_mean truncates integer means toward zero; so do we.
        return tf.truncatediv(summed, tf.maximum(count, 1))
    return summed / count
