"""How results come back: gather shard outputs in order, or reduce them.

These functions run while `tfshard.parallelize` traces its graph. Gathering
concatenates the shards' outputs (of any row counts) under the caller's device
scope, the output device: one ConcatV2 for the dtypes whose GPU kernel keeps
them in device memory (`CONCATENATED`), else through a `tf.TensorArray` with
``infer_shape=False``. Reductions are two-level: each shard reduces
its own rows on its own device (`shard_partial`), and only the small partials
cross to the output device (`combine`), so a ``reduce="sum"`` over a million
rows moves K values, not a million.

Streams (`tfshard.datasets`) collect over many batches: `new_arrays` /
`write_shards` / `concat_all` keep each output leaf in TensorArrays whose
handles live from call to call and concatenate once at the end; reductions
carry a running `Total` (`no_rows`, `reduce_leaves` per batch, `accumulate`, then
`finished`). A total stays in its accumulator dtype (float32 for float16 and
bfloat16, int64 or float64 for integers: `Reduction.accumulator`) from each
shard's partial to `finished`, the one place it is divided and cast back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfshard import _kinds, _trees
from tfshard.errors import ArgumentError


def gather(values: Sequence[tf.Tensor | tf.RaggedTensor]) -> tf.Tensor | tf.RaggedTensor:
    """Concatenates per-shard outputs along axis 0, in shard order.

    Args:
      values: one output per shard, all dense or all ragged, with the same
        dtype and rank; row counts may differ (and may be 0).

    Returns:
      A tensor whose rows are shard 0's rows, then shard 1's, and so on.
    """
    return gather_counted(values, counts=False)[0]


def gather_counted(values: Sequence[Any], counts: bool = True) -> tuple[Any, tf.Tensor | None]:
    """`gather`, and each shard's row count as the gather itself saw it (where `counts`).

    The counts are int32 Shapes of the values where they are gathered (the
    caller's scope, the output device), read from the copies the gather takes
    anyway, so nothing more crosses between devices for them (on a GPU they are
    in host memory); None for outputs of unknown rank, or not asked for.
    """
    kind = _kinds.of(values[0])
    shape = values[0].shape  # what every value's static shape knows: [?, ...]
    for value in values[1:]:
        shape = shape.most_specific_compatible_shape(value.shape)
    # Each part of a value (a ragged tensor's flat values, then its row lengths),
    # gathered in order; the counts are those of the part that holds the rows.
    parts = [
        _concat(list(part), counts and i == kind.ROWS_PART)
        for i, part in enumerate(zip(*(kind.parts(v) for v in values)))
    ]
    return kind.from_parts([part for part, _ in parts], shape), parts[kind.ROWS_PART][1]


# The dtypes gathered by one ConcatV2: those whose GPU kernel holds them in device
# memory (int32's holds it in host memory); the others through a TensorList.
CONCATENATED = frozenset({*_kinds.SPLIT_DTYPES, tf.int64})


def _concat(values: list[tf.Tensor], counts: bool) -> tuple[tf.Tensor, tf.Tensor | None]:
    # [n_k, *inner] x K -> [sum n_k, *inner], and the n_k (int32) where `counts`
    dtype = values[0].dtype
    if dtype in _kinds.CARRIERS:
        # Each shard's values cross in their own dtype and are cast where they land.
        result, lengths = _concat([_kinds.carried(value) for value in values], counts)
        return _kinds.uncarried(result, dtype), lengths
    if any(value.shape.rank is None for value in values):
        return _concat_unknown_rank(values), None
    # Not a TensorList's second output, the rows of each entry: int64, which the int32
    # check (`tfshard._plan.host_assert`) would Cast, in device memory on a GPU. Each
    # count is read from the value's copy here (an Identity where the gather is): where
    # the optimizer knows the shape, the Shape becomes a constant that waits for that
    # copy here, not for its producer on another device (a second transfer).
    lengths = None
    if counts:
        lengths = tf.stack([_rows_of(tf.identity(value)) for value in values])
    if dtype in CONCATENATED:
        return tf.concat(values, axis=0), lengths
    inner = values[0].shape[1:]
    for value in values[1:]:
        inner = inner.most_specific_compatible_shape(value.shape[1:])
    element_shape = tf.TensorShape([None]).concatenate(inner)
    array = tf.TensorArray(
        values[0].dtype, size=len(values), infer_shape=False, element_shape=element_shape
    )
    for k, value in enumerate(values):
        array = array.write(k, value)
    result, _ = tf.raw_ops.TensorListConcatV2(
        input_handle=array.flow,
        element_dtype=values[0].dtype,
        element_shape=tf.constant([-1 if d is None else d for d in element_shape], tf.int64),
        leading_dims=tf.zeros([0], tf.int64),
    )
    result.set_shape(element_shape)
    return result, lengths


def _rows_of(value: tf.Tensor) -> tf.Tensor:
    """The rows of a tensor of known rank, int32: its Shape unpacked (no slice's constants)."""
    return tf.unstack(tf.shape(value, out_type=tf.int32), num=value.shape.rank)[0]


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


def empty(signature: Any) -> Any:
    """Outputs of zero samples for per-sample outputs of these specs (a nested structure).

    A dense leaf ``[...]`` gives ``[0, ...]`` (unknown dimensions 0); a ragged one
    an empty ragged tensor with its inner shape; a leaf of unknown rank gives
    ``[0]``, as nothing says more.
    """

    def zeros(spec: tf.TypeSpec) -> tf.Tensor | tf.RaggedTensor:
        if spec.shape.rank is None:
            return tf.zeros([0], spec.dtype)
        return _kinds.of(spec).empty(spec)

    return _trees.map_leaves(zeros, signature)


def gather_leaves(
    leaves: Sequence[Sequence[Any]], counts: bool = True
) -> tuple[list[Any], dict[int, tf.Tensor]]:
    """Each output leaf gathered in shard order (`gather_counted`).

    Args:
      leaves: for each output leaf, its value from every shard, in shard order.
      counts: whether to count each shard's rows (for a check of them).

    Returns:
      The gathered leaves, and the row count of each shard's output as the
      gather saw it (by leaf index; none for unknown rank, or not `counts`).
    """
    results, counted = [], {}
    for i, per_shard in enumerate(leaves):
        result, lengths = gather_counted(per_shard, counts)
        results.append(result)
        if lengths is not None:
            counted[i] = lengths
    return results, counted


def reduce_leaves(
    leaves: Sequence[Sequence[Any]],
    paths: Sequence[str],
    devices: Sequence[str],
    sizes: tf.Tensor,
    op: Reduction,
    by_row: Sequence[bool],
) -> list[Total]:
    """Each output leaf reduced over all samples, as a `Total` (`finished` gives the result).

    Args:
      leaves: for each output leaf, its value from every shard, in shard order.
      paths: each leaf's path, for messages.
      devices: the shards' devices (each reduces its own rows there).
      sizes: each shard's rows (an int64 vector).
      op: the reduction.
      by_row: for each leaf, whether its first dimension is the shard's rows
        (reduced over rows) or it is the shard's own value (`shard_partial`).
    """
    totals = []
    per_shard_sizes = tf.unstack(sizes, num=len(devices))
    for path, per_shard, rows in zip(paths, leaves, by_row):
        check_reducible(per_shard[0], op, path)
        partials = []
        for value, size, device in zip(per_shard, per_shard_sizes, devices):
            with tf.device(device):  # each shard reduces its own rows where they are
                partials.append(shard_partial(value, size, op, rows))
        totals.append(combine(partials, op))
    return totals


def stacked_spec(batch: tf.TypeSpec) -> tf.TypeSpec:
    """The per-sample spec that `empty` stacks into a batch of `batch`'s spec.

    Unlike the row a function sees (`_arguments.row_spec`), a row of a ragged
    batch stays ragged here (one ragged rank less), so its empty batch is
    ragged as the batch is.
    """
    if batch.shape.rank is None:
        return batch
    return _kinds.of(batch).stacked_spec(batch)


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One way to reduce outputs over all samples: all tfshard knows of it, in one place.

    Every reduction runs in two levels, each shard over its rows on its own
    device, then the shards' partials on the output device (and, for a
    dataset, batch after batch); only `divides` tells a mean from a sum.
    Partials and running totals are `Total`s, held in the `accumulator`
    dtype from the shard to the end, where `finished` divides a mean and
    gives the result in the outputs' dtype (`result_dtype`).

    Attributes:
      name: what ``reduce=`` takes.
      over_rows: the reduction over axis 0 of a (widened) tensor.
      accumulate: two partials into one (a running total across batches).
      neutral: the value that leaves it unchanged, for a dtype (an empty
        shard's partial).
      ordered: it compares values (max, min): integers widen to an
        order-keeping key, and complex numbers cannot take part. Otherwise
        integers add modulo 2**64, as in their own dtype.
      divides: the result is the total divided by the number of samples.
    """

    name: str
    over_rows: Callable[[tf.Tensor], tf.Tensor]
    accumulate: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
    neutral: Callable[[tf.DType], tf.Tensor]
    ordered: bool = False
    divides: bool = False

    def accumulator(self, dtype: tf.DType) -> tf.DType:
        """The dtype outputs of `dtype` are totalled in, from each shard to the result.

        float16 and bfloat16 total in float32, as NumPy and JAX do: in their
        own dtype a sum sticks once its spacing passes the values added, and a
        row count above 65,504 is infinite in float16. Integers total in int64,
        the only integer the GPU kernels of Sum, Max, Min and Pack hold in
        device memory: a sum wraps there as in the dtype itself, once cast
        back, and a mean of integers up to 32 bits is exact for fewer than
        2**31 rows. A mean of int64 or uint64 totals in float64, which cannot
        wrap where an int64 total would: exact while the total stays below
        2**53 in magnitude, rounded as float64 beyond. Other dtypes total in
        their own.
        """
        if dtype in (tf.float16, tf.bfloat16):
            return tf.float32
        if not dtype.is_integer:
            return dtype
        return tf.float64 if self.divides and dtype.size == 8 else tf.int64

    def result_dtype(self, dtype: tf.DType) -> tf.DType:
        """The dtype of the reduction of outputs of `dtype`: the outputs' own,
        but an integer mean, a float as `tf.math.truediv` gives it (float32 for
        8- and 16-bit integers, float64 for 32- and 64-bit)."""
        if self.divides and dtype.is_integer:
            return tf.float32 if dtype.size <= 2 else tf.float64
        return dtype


class Total(tf.experimental.ExtensionType):
    """A reduction over some rows, not yet finished: a shard's partial, or a running total.

    A value of TensorFlow's own (an extension type), so a stream carries it
    through its traced loop and from call to call, and it knows the dtype it
    finishes as: a float32 total may be one of float16, bfloat16 or float32
    outputs.

    Attributes:
      value: the sum (a mean undivided), or the extreme, in
        `Reduction.accumulator`'s dtype; an integer extreme as its
        order-keeping key (see `_widened`).
      output_dtype: the dtype of the outputs it reduces.
    """

    value: tf.Tensor
    output_dtype: tf.DType


def _min_over_rows(value: tf.Tensor) -> tf.Tensor:
    # GPU Min has no int64 kernel in device memory: the max of the bitwise complement.
    if value.dtype == tf.int64:
        return tf.bitwise.invert(tf.reduce_max(tf.bitwise.invert(value), axis=0))
    return tf.reduce_min(value, axis=0)


def _extreme(dtype: tf.DType, lowest: bool) -> tf.Tensor:
    if dtype.is_floating:
        return tf.constant(float("-inf") if lowest else float("inf"), dtype)
    return tf.constant(dtype.min if lowest else dtype.max, dtype)


def _sum_over_rows(value: tf.Tensor) -> tf.Tensor:
    total = tf.reduce_sum(value, axis=0)
    if value.dtype.is_integer:
        return total
    # TF sums no rows to +0.0, which would turn another shard's -0.0 into +0.0.
    return tf.where(tf.shape(value)[0] > 0, total, _zero(value.dtype))


def _zero(dtype: tf.DType) -> tf.Tensor:
    """The neutral value of a sum: -0.0 for floats (x + -0.0 is x for every x, -0.0 too,
    where +0.0 turns -0.0 into +0.0), -0.0 in both parts for complex, 0 for integers."""
    if dtype.is_complex:
        return tf.constant(complex(-0.0, -0.0), dtype)
    return tf.constant(-0.0 if dtype.is_floating else 0, dtype)


# The table every ``reduce=`` name is looked up in; messages list its names.
REDUCTIONS: dict[str, Reduction] = {
    r.name: r
    for r in (
        Reduction("sum", _sum_over_rows, tf.add, _zero),
        Reduction("mean", _sum_over_rows, tf.add, _zero, divides=True),
        Reduction(
            "max",
            lambda value: tf.reduce_max(value, axis=0),
            tf.maximum,
            lambda dtype: _extreme(dtype, lowest=True),
            ordered=True,
        ),
        Reduction(
            "min",
            _min_over_rows,
            tf.minimum,
            lambda dtype: _extreme(dtype, lowest=False),
            ordered=True,
        ),
    )
}


def reduction_names() -> str:
    """The names ``reduce=`` takes, for messages: ``'sum'/'mean'/'max'/'min'``."""
    return "/".join(map(repr, REDUCTIONS))


def reduction(name: str | None) -> Reduction | None:
    """The record of ``reduce=name`` (None for None); an unknown name raises ArgumentError."""
    if name is None:
        return None
    found = REDUCTIONS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ArgumentError(
            f"reduce={name!r}: choose one of {', '.join(map(repr, REDUCTIONS))} "
            "or None (gather the outputs in order)"
        )
    return found


def check_reducible(value: tf.Tensor, op: Reduction, path: str) -> None:
    """Raises ArgumentError when `op` cannot reduce outputs like `value`."""
    dtype = value.dtype
    _kinds.of(value).check_reducible(path, op.name)
    if dtype == tf.bool or dtype == tf.string:
        raise ArgumentError(
            f"{path} has dtype {dtype.name}, which reduce={op.name!r} cannot combine; "
            f"cast it (e.g. tf.cast({path.split('[')[0]}, tf.float32)) in the function"
        )
    if dtype.is_complex and op.ordered:
        raise ArgumentError(f"{path} is complex; reduce={op.name!r} needs an ordered dtype")


def no_rows(op: Reduction, dtype: tf.DType) -> Total:
    """The `Total` of no outputs of `dtype`: `op`'s neutral value (a stream's start)."""
    return Total(_widened(op.neutral(dtype), op), dtype)


def shard_partial(value: tf.Tensor, size: tf.Tensor, op: Reduction, per_sample: bool) -> Total:
    """One shard's contribution to a reduction, computed on the shard's device.

    Args:
      value: with `per_sample`, the shard's stacked outputs ``[n_k, ...]``;
        without, the function's value for the whole shard (e.g. a shard mean).
      size: ``n_k``, the shard's row count (a scalar tensor).
      op: the reduction.
      per_sample: how to read `value`.

    Returns:
      For sum and mean the shard's sum over samples (a shard value is taken as
      the mean of its rows, so it counts ``n_k`` times); for max and min the
      shard's extreme; in the accumulator dtype either way. An empty shard
      gives the neutral value of `op`, so a function that returns NaN for an
      empty batch cannot spoil the result.
    """
    dtype = value.dtype
    value = _widened(value, op)
    if per_sample:
        # [n_k, ...] -> [...]; empty shards give the neutral value by themselves.
        return Total(op.over_rows(value), dtype)
    neutral = tf.broadcast_to(no_rows(op, dtype).value, tf.shape(value))
    if op.divides:
        value = value * tf.cast(size, value.dtype)
    return Total(tf.where(size > 0, value, neutral), dtype)


def shard_value(total: Total, size: tf.Tensor, op: Reduction) -> tf.Tensor:
    """A whole shard's value of fixed shape from its chunks' accumulated `shard_partial`s
    (``max_rows=``, `tfshard._chunks`): what one run over all `size` rows gives (a mean:
    the chunks' means weighted by their rows, divided once), in the outputs' dtype.
    """
    value = total.value
    if not op.divides:
        return _narrowed(value, total.output_dtype, op)
    # An integer total divides as a float (as truediv), cast back as the run's value would be.
    return tf.cast(_divided(value, tf.maximum(size, 1)), total.output_dtype)


def combine(partials: Sequence[Total], op: Reduction) -> Total:
    """The shards' partials combined into one `Total` over all their samples; a mean stays
    undivided (`finished` divides it by the samples once: not a mean of shard means).

    A float sum adds the partials in shard order (`Reduction.accumulate`), as a
    stream adds its batches: TF's Sum over them would start from +0.0 and lose the
    sign of a lone -0.0 (`finished` gives zeros TF's sign)."""
    values = [p.value for p in partials]
    if op.ordered or values[0].dtype.is_integer:
        total = op.over_rows(tf.stack(values))  # K x [...] -> [K, ...] -> [...]
    else:
        total = functools.reduce(op.accumulate, values)
    return Total(total, partials[0].output_dtype)


def finished(reduced: Total, total: tf.Tensor | int, op: Reduction) -> tf.Tensor:
    """A `Total` over `total` samples as the reduction's result: a mean divides.

    The one place a total leaves its accumulator dtype: a mean is the total
    divided by the count, rounded once (`_divided`; an integer total in
    float64), then cast to `Reduction.result_dtype`, so a float16 mean over a million rows is the
    true mean rounded once to float16, and an integer mean is not truncated
    as `tf.reduce_mean` truncates it. With no samples a mean is NaN (complex:
    NaN in both parts, as NumPy's; TensorFlow's CPU kernel gives 0 there). An
    integer sum wraps as `tf.reduce_sum` does in the dtype itself. A float sum
    or mean that is zero has the sign `tf.reduce_sum` gives it: a lone row's
    own, else +0.0 (`_zeros_signed_as_tf`).
    """
    value = reduced.value
    if not op.ordered and not value.dtype.is_integer:
        value = _zeros_signed_as_tf(value, total)
    if not op.divides:
        return _narrowed(value, reduced.output_dtype, op)
    mean = _divided(value, total)
    mean = tf.where(tf.cast(total, tf.int64) > 0, mean, _nan(mean.dtype))
    dtype = op.result_dtype(reduced.output_dtype)
    return mean if mean.dtype == dtype else tf.cast(mean, dtype)


def _zeros_signed_as_tf(total: tf.Tensor, count: tf.Tensor | int) -> tf.Tensor:
    """A float sum of `count` rows with the sign of zero `tf.reduce_sum` gives it: one row's
    own (a lone -0.0 stays -0.0), else +0.0 (TF's Sum starts from +0.0), part by part
    for complex. Not ``total + 0.0``: Grappler folds an addition of a constant 0 away."""
    if total.dtype.is_complex:
        real = _zeros_signed_as_tf(tf.math.real(total), count)
        return tf.complex(real, _zeros_signed_as_tf(tf.math.imag(total), count))
    several = tf.not_equal(tf.cast(count, tf.int64), 1)
    return tf.where(tf.logical_and(several, tf.equal(total, 0)), tf.zeros_like(total), total)


def _nan(dtype: tf.DType) -> tf.Tensor:
    """The mean of no samples: NaN, for a complex dtype NaN in both parts (NumPy's nan+nanj)."""
    nan = float("nan")
    return tf.constant(complex(nan, nan) if dtype.is_complex else nan, dtype)


def _divided(total: tf.Tensor, count: tf.Tensor | int) -> tf.Tensor:
    """`total / count`, one true division (0 where `count` is 0), an integer total in float64.

    Not `tf.math.truediv`: where the count is known when the graph is
    optimized (a batch of static shape, a plan from static sizes), Grappler's
    constant folding rewrites a RealDiv by a constant into a multiply by the
    constant's reciprocal, rounded twice, one ulp off an exact mean (84 / 7 in
    float32 would be 12.000001, not 12). It leaves
    DivNoNan alone, which divides as RealDiv does wherever the count is not 0.
    """
    if total.dtype.is_integer:  # as tf.math.truediv divides an int64 total
        total = tf.cast(total, tf.float64)
    if total.dtype.is_complex:
        # Part by part: a complex division by (count + 0j) rounds twice, and its
        # imaginary part of -0.0 / 1 is +0.0.
        real, imag = _divided(tf.math.real(total), count), _divided(tf.math.imag(total), count)
        return tf.complex(real, imag)
    return tf.math.divide_no_nan(total, tf.cast(count, total.dtype))


def accumulate(totals: Sequence[Total], values: Sequence[Total], op: Reduction) -> list[Total]:
    """Running totals (one per output leaf) with one more batch's partials."""
    return [
        Total(op.accumulate(total.value, value.value), total.output_dtype)
        for total, value in zip(totals, values)
    ]


def running_spec(op: Reduction, dtype: tf.DType) -> tf.TypeSpec:
    """The spec of a running `Total` of outputs of `dtype`, of any shape (it starts a scalar):
    a stream's traced loop carries its totals in it, in the accumulator dtype."""
    return Total.Spec(value=tf.TensorSpec(None, op.accumulator(dtype)), output_dtype=dtype)


# GPU kernels of Sum, Max, Min and Pack (tf.stack) hold no integer but int64 in
# device memory (int32's stay in host memory, Min has no integer one, smaller
# integers have none), so integers reduce as int64 on the device
# they are on: sums modulo 2**64 cast back at the end (the same wrap-around as
# summing in the dtype), max and min on an order-keeping key (uint64 with its
# top bit flipped), min as the max of the bitwise complement. A mean of 64-bit
# integers totals in float64 instead (`Reduction.accumulator`); float16 and
# bfloat16 in float32. Other dtypes take no extra op.
_TOP_BIT = -(2**63)


def _widened(value: tf.Tensor, op: Reduction) -> tf.Tensor:
    """`value` in `op`'s accumulator dtype (an integer extreme as its order-keeping key)."""
    accumulator = op.accumulator(value.dtype)
    if accumulator == value.dtype:
        return value
    if value.dtype != tf.uint64 or accumulator.is_floating:
        return tf.cast(value, accumulator)
    value = tf.bitcast(value, tf.int64)
    return tf.bitwise.bitwise_xor(value, _TOP_BIT) if op.ordered else value


def _narrowed(value: tf.Tensor, dtype: tf.DType, op: Reduction) -> tf.Tensor:
    """A sum, max or min in the accumulator dtype back in the outputs' `dtype`."""
    if dtype == value.dtype:
        return value
    if dtype != tf.uint64:
        if op.ordered and dtype.is_integer:
            # No rows: int64's neutral value, which is the dtype's once clamped.
            value = tf.clip_by_value(value, dtype.min, dtype.max)
        return tf.cast(value, dtype)
    if op.ordered:
        value = tf.bitwise.bitwise_xor(value, _TOP_BIT)
    return tf.bitcast(value, tf.uint64)


# ------------------------------------------------------------------ streams


def _part_shapes(leaf: Any) -> list[tuple[tf.DType, tf.TensorShape]]:
    """(dtype, per-row shape) of each TensorArray that collects `leaf`: one per part."""
    return _kinds.of(leaf).part_shapes(leaf)


def array_count(leaves: Sequence[Any]) -> int:
    """How many TensorArrays collect these output leaves (see `new_arrays`)."""
    return sum(len(_part_shapes(leaf)) for leaf in leaves)


def new_arrays(leaves: Sequence[Any]) -> list[tf.Tensor]:
    """The flows of empty TensorArrays that collect these output leaves, one entry per write."""
    return [
        tf.TensorArray(
            _kinds.CARRIERS.get(dtype, dtype),  # a GPU TensorList holds the carrier
            size=0,
            dynamic_size=True,
            infer_shape=False,
            element_shape=tf.TensorShape([None]).concatenate(inner),
        ).flow
        for leaf in leaves
        for dtype, inner in _part_shapes(leaf)
    ]


def write_shards(
    flows: Sequence[tf.Tensor], leaves: Sequence[Any], first: tf.Tensor, per_shard: Sequence[Any]
) -> list[tf.Tensor]:
    """Writes each shard's output leaves at entries first, first + 1, ...; the new flows."""
    flows = list(flows)
    for k, values in enumerate(per_shard):
        at = 0
        for leaf, value in zip(leaves, values):
            for part in _kinds.of(leaf).parts(value):
                part = _kinds.carried(part)
                array = tf.TensorArray(
                    part.dtype, dynamic_size=True, infer_shape=False, flow=flows[at]
                )
                flows[at] = array.write(first + k, part).flow
                at += 1
    return flows


def concat_all(flows: Sequence[tf.Tensor], leaves: Sequence[Any]) -> list[Any]:
    """Each output leaf over all writes, concatenated in order (zero rows if none)."""
    results, at = [], 0
    for leaf in leaves:
        parts = []
        for dtype, inner in _part_shapes(leaf):
            carrier = _kinds.CARRIERS.get(dtype, dtype)
            array = tf.TensorArray(carrier, dynamic_size=True, infer_shape=False, flow=flows[at])
            at += 1
            zero = [0, *(0 if d is None else d for d in inner)] if inner.rank is not None else [0]
            concat = tf.cond(
                array.size() > 0, array.concat, lambda e=zero, d=carrier: tf.zeros(e, d)
            )
            if inner.rank is not None:  # the arrays forget it (infer_shape=False)
                concat.set_shape([None, *inner])
            parts.append(_kinds.uncarried(concat, dtype))
        results.append(_kinds.of(leaf).from_parts(parts, leaf.shape))
    return results
