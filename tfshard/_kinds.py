"""Kinds of value tfshard splits and gathers: one adapter each, dense, ragged and sparse.

Every step that treats a value by its kind asks the adapter of that value
(`of`) rather than testing for `tf.RaggedTensor` or `tf.SparseTensor` itself:
its spec as a graph input, the spec of one row, its rows, its split, an empty
batch, its parts for a gather (a ragged tensor is its flat values plus one
row-lengths vector per ragged dimension; gathering each part in order gathers
the whole), whether a vectorised map can stack its rows, the spec a sample's
output of its kind stacks to, and what it cannot do (be split, be reduced). A
sparse tensor is broadcast whole only. A new kind is one more adapter with
these members, and a line in `of`.

The dtypes that travel differently on a GPU, because TensorFlow lacks their
kernels there, are here too: `SPLIT_DTYPES` and `SLICED_DTYPES` for the split,
`CARRIERS` for gathers and maps; and the NumPy dtypes no tensor holds
(`numpy_problem`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfshard.errors import ArgumentError

# The dtypes whose GPU SplitV kernels hold their data in device memory (TF
# 2.16-2.21; int32's kernel keeps it in host memory). The other numbers and
# bools would be split on the CPU and copied back (soft placement), so `split`
# moves them through a same-size float by Bitcast (it shares the buffer: free,
# exact, GPU kernels for every dtype); 1-byte dtypes have no such float and are
# cut with StridedSlice, whose GPU kernels hold them in device memory.
# tests/test_gpu_kernels.py checks both against the installed kernel registry.
SPLIT_DTYPES = frozenset(
    {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128}
)
SLICED_DTYPES = frozenset({tf.int8, tf.uint8, tf.bool})
_SAME_SIZE_FLOAT = {2: tf.float16, 4: tf.float32, 8: tf.float64}

# Integer dtypes whose GPU kernels for TensorLists (the gather's TensorArray,
# tf.map_fn's) and GatherV2 (tf.vectorized_map's) are missing in TensorFlow
# 2.16-2.21, or Tile's (how pfor stacks an output the same for every sample):
# on a GPU, soft placement would quietly run those ops on the CPU and copy the
# values there and back. Each travels instead as a dtype those
# kernels cover, through a Cast that holds every value exactly (|int16| < 2**24
# in float32; 2**64 - 1 as int64 -1, cast back bit for bit) and has GPU kernels
# both ways. Every other dtype has the kernels and takes no extra op; strings
# never live on a GPU. tests/test_gpu_kernels.py checks this table against
# the installed TensorFlow's kernel registry.
CARRIERS = {
    tf.int8: tf.float16,
    tf.uint8: tf.float16,
    tf.int16: tf.float32,
    tf.uint16: tf.float32,
    tf.uint32: tf.int64,
    tf.uint64: tf.int64,
}


def carried(value: tf.Tensor) -> tf.Tensor:
    """`value` as its `CARRIERS` dtype (itself when it has none), on the caller's device."""
    carrier = CARRIERS.get(value.dtype)
    return value if carrier is None else tf.cast(value, carrier)


def uncarried(value: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """A `carried` value back as `dtype`."""
    return value if value.dtype == dtype else tf.cast(value, dtype)


def prefix_sums(sizes: tf.Tensor, count: int, exclusive: bool) -> tf.Tensor:
    """The running sums of an int32 ``[count]`` vector (each shard's first row, or end),
    by a constant triangle, not Cumsum, whose GPU kernel holds int32 in device memory."""
    lower = [[1 if (j < k if exclusive else j <= k) else 0 for j in range(count)]
             for k in range(count)]  # fmt: skip
    return tf.reduce_sum(sizes[None, :] * tf.constant(lower, tf.int32), axis=1)


def placed(device: str | None) -> contextlib.AbstractContextManager:
    """`tf.device(device)`, or where `device` is None or "" (unknown: a stream's batch),
    the caller's scope; ``tf.device(None)`` would clear it, and a stream's batch would
    cross to the loop's device to be split."""
    return tf.device(device) if device else contextlib.nullcontext()


def _open_rows(shape: tf.TensorShape) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(shape[1:])


def _dims(shape: Any) -> list[int]:
    return [0 if d is None else d for d in shape]


class Dense:
    """A `tf.Tensor` (and its `tf.TensorSpec`): rows along axis 0."""

    # Of `parts`, the one whose rows are the value's rows.
    ROWS_PART = 0

    @staticmethod
    def batch_spec(t: Any, split: bool) -> tf.TypeSpec:
        """The spec of `t` as a graph input; a split tensor's rows are left open."""
        return tf.TensorSpec(_open_rows(t.shape) if split else t.shape, t.dtype)

    @staticmethod
    def row_spec(t: Any) -> tf.TypeSpec:
        """The spec of one row of `t` (a tensor or a batch's spec), as a function sees it."""
        return tf.TensorSpec(t.shape[1:], t.dtype)

    @staticmethod
    def stacked_spec(batch: tf.TypeSpec) -> tf.TypeSpec:
        """The per-sample spec that `empty` stacks into a batch of `batch`'s spec."""
        return tf.TensorSpec(batch.shape[1:], batch.dtype)

    @staticmethod
    def any_rows(spec: tf.TypeSpec) -> tf.TypeSpec:
        """`spec` with its batch dimension unknown."""
        return tf.TensorSpec(_open_rows(spec.shape), spec.dtype)

    @staticmethod
    def fixed_sample_shape(spec: tf.TypeSpec) -> bool:
        """Whether a batch of `spec` fixes each sample's shape (its inner dimensions)."""
        return bool(spec.shape.rank) and spec.shape[1:].is_fully_defined()

    @staticmethod
    def sample_shape(t: Any) -> tuple[int, ...] | None:
        """A batch's per-sample shape, which every batch of a stream must keep."""
        return tuple(t.shape[1:])

    @staticmethod
    def device(t: Any) -> str:
        return t.device

    @staticmethod
    def rows(t: Any) -> tf.Tensor:
        """The number of rows, as an int64 scalar tensor."""
        return tf.shape(t, out_type=tf.int64)[0]

    @staticmethod
    def row_count(t: Any, device: str | None) -> tf.Tensor:
        """The rows as an int32 scalar, from a Shape op on `device` (held in host memory
        on a GPU), or a constant where the rows are static."""
        if t.shape.rank and t.shape[0] is not None:
            with placed(device):
                return tf.constant(t.shape[0], tf.int32)
        with placed(device):
            return tf.shape(t, out_type=tf.int32)[0]

    @staticmethod
    def split(t: Any, sizes: tf.Tensor, count: int, where: str) -> list[Any]:
        """`t` cut into `count` pieces of `sizes` rows where it lives (bounds on `where`)."""
        # [N, ...] -> count x [n_k, ...]
        if t.dtype in SLICED_DTYPES:
            # A GPU StridedSlice reads its bounds and strides from host memory: all made
            # in int32 with the plan's ops, where its sizes are (a stride made in device
            # memory would cross back to the host for every piece).
            with placed(where):
                ends = prefix_sums(sizes, count, exclusive=False)
                # [K] -> K x [1]
                begins = tf.unstack(tf.reshape(ends - sizes, [count, 1]), num=count)
                ends = tf.unstack(tf.reshape(ends, [count, 1]), num=count)
                strides = tf.ones([1], tf.int32)
            return [tf.strided_slice(t, b, e, strides) for b, e in zip(begins, ends)]
        same_size = t.dtype.is_integer and t.dtype.size in _SAME_SIZE_FLOAT
        if t.dtype in SPLIT_DTYPES or not same_size:
            return tf.split(t, sizes, num=count, axis=0)
        pieces = tf.split(tf.bitcast(t, _SAME_SIZE_FLOAT[t.dtype.size]), sizes, num=count, axis=0)
        return [tf.bitcast(piece, t.dtype) for piece in pieces]

    @staticmethod
    def empty(sample: tf.TypeSpec) -> Any:
        """A batch of zero samples of spec `sample` (unknown dimensions 0)."""
        return tf.zeros([0, *_dims(sample.shape)], sample.dtype)

    @staticmethod
    def parts(t: Any) -> list[tf.Tensor]:
        """The dense tensors a gather concatenates, in order."""
        return [t]

    @staticmethod
    def part_shapes(t: Any) -> list[tuple[tf.DType, tf.TensorShape]]:
        """(dtype, per-row shape) of each of `parts`."""
        return [(t.dtype, t.shape[1:])]

    @staticmethod
    def from_parts(parts: Sequence[tf.Tensor], shape: tf.TensorShape | None = None) -> Any:
        """The value whose `parts` these are (each concatenated over shards); a dense
        part keeps its own static shape, so `shape` (see `Ragged.from_parts`) adds nothing."""
        return parts[0]

    # tf.vectorized_map can stack its rows (each row one shape).
    VECTORIZES = True

    @staticmethod
    def entering(t: Any) -> Any:
        """`t` as a map takes its rows on a GPU (`carried`); `leaving` undoes it per row."""
        return carried(t)

    @staticmethod
    def leaving(t: Any, dtype: tf.DType) -> Any:
        return uncarried(t, dtype)

    @staticmethod
    def sample_output(value: Any, ragged: bool, path: str) -> tf.TypeSpec:
        """The spec a sample's output of this kind stacks to (over a shard's samples).

        Per-sample shapes that can vary (``ragged=True``, or a dimension not
        known when traced) stack as a ragged tensor; a scalar per sample has one
        shape and stacks to a dense ``[N]`` either way.
        """
        if value.shape.rank is None:
            # Nothing to stack ragged by (e.g. a py_function): assume one shape.
            if ragged:
                raise ArgumentError(
                    f"{path} has unknown rank, so ragged=True cannot stack it; give it "
                    "a shape in the function (tf.ensure_shape(value, [None]))"
                )
            return tf.TensorSpec(value.shape, value.dtype)
        if value.shape.rank > 0 and (ragged or not value.shape.is_fully_defined()):
            return tf.RaggedTensorSpec(value.shape, value.dtype, ragged_rank=0)
        return tf.TensorSpec(value.shape, value.dtype)

    @staticmethod
    def check_reducible(path: str, op: str) -> None:
        """Raises ArgumentError when outputs of this kind cannot be reduced (dense can)."""

    @staticmethod
    def check_split(where: str, entry: Any) -> None:
        """Raises ArgumentError when values of this kind cannot be split (dense can)."""


class Ragged:
    """A `tf.RaggedTensor` (and its `tf.RaggedTensorSpec`): rows along its outer dimension."""

    ROWS_PART = 1  # the outer row lengths: one entry per row

    @staticmethod
    def batch_spec(t: Any, split: bool) -> tf.TypeSpec:
        shape = _open_rows(t.shape) if split else t.shape
        return tf.RaggedTensorSpec(shape, t.dtype, t.ragged_rank, t.row_splits.dtype)

    @staticmethod
    def row_spec(t: Any) -> tf.TypeSpec:
        """A row of ``[N, (r), ...]`` is a dense ``[r, ...]``; of a deeper ragged
        tensor, a ragged tensor of one rank less."""
        if t.ragged_rank == 1:
            return tf.TensorSpec(_open_rows(t.shape[1:]), t.dtype)
        return tf.RaggedTensorSpec(t.shape[1:], t.dtype, t.ragged_rank - 1, _splits_dtype(t))

    @staticmethod
    def stacked_spec(batch: tf.TypeSpec) -> tf.TypeSpec:
        """Unlike the row a function sees, a row stays ragged here (one ragged rank
        less), so its empty batch is ragged as the batch is."""
        return tf.RaggedTensorSpec(
            batch.shape[1:], batch.dtype, batch.ragged_rank - 1, batch.row_splits_dtype
        )

    @staticmethod
    def any_rows(spec: tf.TypeSpec) -> tf.TypeSpec:
        shape = _open_rows(spec.shape)
        return tf.RaggedTensorSpec(shape, spec.dtype, spec.ragged_rank, spec.row_splits_dtype)

    @staticmethod
    def fixed_sample_shape(spec: tf.TypeSpec) -> bool:
        """Whether the dimensions after the ragged ones are known (those a batch fixes)."""
        return bool(spec.shape.rank) and spec.shape[spec.ragged_rank + 1 :].is_fully_defined()

    @staticmethod
    def sample_shape(t: Any) -> tuple[int, ...] | None:
        return None  # samples differ in shape by design

    @staticmethod
    def device(t: Any) -> str:
        return t.flat_values.device

    @staticmethod
    def rows(t: Any) -> tf.Tensor:
        return tf.cast(t.nrows(), tf.int64)

    @staticmethod
    def row_count(t: Any, device: str | None) -> tf.Tensor:
        with placed(device):
            return tf.shape(t.row_splits, out_type=tf.int32)[0] - 1

    @staticmethod
    def split(t: Any, sizes: tf.Tensor, count: int, where: str) -> list[Any]:
        with placed(where):
            ends = prefix_sums(sizes, count, exclusive=False)
            starts = ends - sizes
        return [t[starts[k] : ends[k]] for k in range(count)]

    @staticmethod
    def empty(sample: tf.TypeSpec) -> Any:
        # A sample [d_1, ...] stacks to [0, d_1, ...] with ragged_rank + 1 ragged
        # dimensions (those of the d_i the sample knows uniform, as a map stacks
        # them); the flat values keep the sample's dimensions after those.
        inner = _dims(sample.shape[sample.ragged_rank + 1 :])
        lengths = [tf.zeros([0], sample.row_splits_dtype)] * (sample.ragged_rank + 1)
        shape = tf.TensorShape([0]).concatenate(sample.shape)
        return _nested(tf.zeros([0, *inner], sample.dtype), lengths, shape)

    @staticmethod
    def parts(t: Any) -> list[tf.Tensor]:
        return [t.flat_values, *t.nested_row_lengths()]

    @staticmethod
    def part_shapes(t: Any) -> list[tuple[tf.DType, tf.TensorShape]]:
        lengths = [(t.row_splits.dtype, tf.TensorShape([]))] * t.ragged_rank
        return [(t.flat_values.dtype, t.flat_values.shape[1:]), *lengths]

    @staticmethod
    def from_parts(parts: Sequence[tf.Tensor], shape: tf.TensorShape | None = None) -> Any:
        """The ragged tensor of these flat values and row lengths (outermost first).

        A ragged dimension that `shape` knows (the static shape every gathered
        value has, as a map stacks a sample of known shape under ``ragged=True``)
        stays a uniform one of that length, so the result's static shape is the
        same however the rows were split."""
        return _nested(parts[0], list(parts[1:]), shape)

    # Rows of different lengths: tf.vectorized_map cannot stack them (tf.map_fn can).
    VECTORIZES = False

    @staticmethod
    def entering(t: Any) -> Any:
        return t

    @staticmethod
    def leaving(t: Any, dtype: tf.DType) -> Any:
        return t

    @staticmethod
    def sample_output(value: Any, ragged: bool, path: str) -> tf.TypeSpec:
        return tf.RaggedTensorSpec(value.shape, value.dtype, value.ragged_rank)

    @staticmethod
    def check_reducible(path: str, op: str) -> None:
        raise ArgumentError(
            f"{path} is ragged; reduce={op!r} needs outputs of one shape per sample "
            "(pad them, or drop reduce= and reduce the ragged result yourself)"
        )

    @staticmethod
    def check_split(where: str, entry: Any) -> None:
        """Ragged values split along their rows."""


class Sparse:
    """A `tf.SparseTensor` (and its spec): passed whole to every shard, never split."""

    @staticmethod
    def batch_spec(t: Any, split: bool) -> tf.TypeSpec:
        return tf.SparseTensorSpec(t.shape, t.dtype)

    @staticmethod
    def check_split(where: str, entry: Any) -> None:
        """Raises ArgumentError: a sparse tensor has no rows tfshard can cut."""
        raise ArgumentError(
            f"{where} is a tf.SparseTensor, which tfshard cannot split; pass "
            f"tf.sparse.to_dense({where}), or pass {entry!r} in broadcast=(...) to give "
            "every shard all of it"
        )


def _nested(
    flat_values: tf.Tensor, lengths: Sequence[tf.Tensor], shape: tf.TensorShape | None
) -> tf.RaggedTensor:
    """`tf.RaggedTensor.from_nested_row_lengths`, each dimension `shape` knows uniform."""
    known = shape is not None and shape.rank is not None
    dims = list(shape[1 : len(lengths) + 1]) if known else [None] * len(lengths)
    result = flat_values
    for row_lengths, dim in reversed(list(zip(lengths, dims))):
        if dim is None:
            result = tf.RaggedTensor.from_row_lengths(result, row_lengths, validate=False)
        else:
            rows = tf.size(row_lengths, out_type=row_lengths.dtype)
            length = tf.constant(dim, row_lengths.dtype)
            result = tf.RaggedTensor.from_uniform_row_length(result, length, rows, validate=False)
    return result


def _splits_dtype(t: Any) -> tf.DType:
    return t.row_splits.dtype if isinstance(t, tf.RaggedTensor) else t.row_splits_dtype


Kind = type[Dense] | type[Ragged] | type[Sparse]


def of(value: Any) -> Kind:
    """The adapter of a value or its spec."""
    if isinstance(value, tf.RaggedTensor | tf.RaggedTensorSpec):
        return Ragged
    if isinstance(value, tf.SparseTensor | tf.SparseTensorSpec):
        return Sparse
    return Dense


def numpy_problem(dtype: np.dtype) -> str | None:
    """Why a NumPy array of ``dtype`` can be no call's input, and the fix; None when it can.

    The text follows the argument's path (``"x is a NumPy array of ..."``). A dtype is
    held when `tf.as_dtype` knows it, as a tensor converted from such an array has it
    (datetime64, timedelta64, long double and structured arrays are not); an array of
    Python objects is refused too, where TensorFlow would read it as strings at best.
    """
    dtype = np.dtype(dtype)
    if dtype.kind == "O":
        return (
            "is a NumPy array of Python objects; use a numeric dtype (np.asarray(x, "
            "np.float32)), or strings as dtype str"
        )
    try:
        tf.as_dtype(dtype)
    except TypeError:
        pass
    else:
        return None
    cannot = f"is a NumPy array of {dtype}, which TensorFlow cannot hold"
    if dtype.names:
        return (
            f"is a structured NumPy array (fields {', '.join(dtype.names)}), which TensorFlow "
            "cannot hold; pass its fields as a dict, {name: x[name] for name in x.dtype.names}"
        )
    if dtype.kind == "M":
        return f"{cannot}; pass x.astype(np.int64), the time since 1970-01-01 in its unit"
    if dtype.kind == "m":
        return (
            f"{cannot}; pass x.astype(np.int64), counts of its unit, or x / np.timedelta64(1, "
            "'s'), seconds as float64"
        )
    if dtype.kind == "f":
        return f"{cannot}; pass x.astype(np.float64)"
    if dtype.kind == "c":
        return f"{cannot}; pass x.astype(np.complex128)"
    return f"{cannot}; convert it to a dtype TensorFlow has (tf.dtypes), e.g. x.astype(np.float32)"


def splittable(spec: Any) -> bool:
    """Whether tfshard splits values of this spec along their rows (dense or ragged)."""
    return isinstance(spec, tf.TensorSpec | tf.RaggedTensorSpec)
