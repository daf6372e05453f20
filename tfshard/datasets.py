"""How a `tf.data.Dataset` flows through a parallelized function.

Each dataset element is one global batch, split across the devices exactly as
a tensor argument would be. Elements are passed to the function the way
`tf.data.Dataset.map` passes them: a tuple element is spread over the
positional parameters, anything else is the first argument.

The loop over batches is a Python loop over ``dataset.prefetch(AUTOTUNE)``:
tf.data prepares the next batch on its own threads while the current one runs
on the devices, and every batch runs through the one traced graph of the
`ShardedFunction`. We measured this against a graph-side loop (one
`tf.function` iterating the dataset and accumulating results): with batches
big enough to occupy several devices the per-batch Python cost (~0.1 ms) is
noise, and the Python loop is the only one that can stream results
(`iterate`) and report progress, so we keep one loop for both.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

import tensorflow as tf

from tfshard import collect
from tfshard.errors import ArgumentError

if TYPE_CHECKING:
    from tfshard.parallel import ShardedFunction

# Keywords that belong to tfshard, not to the function, in a call on a dataset.
DATASET_OPTIONS = ("batch_size", "batched", "progress")


def _path_names(spec: Any) -> list[tuple[str, tf.TypeSpec]]:
    """(path, spec) for each leaf of an element spec, e.g. ("element['image']", ...)."""
    paths: list[tuple[str, Any]] = []
    _visit(spec, "element", paths)
    return paths


def _visit(value: Any, where: str, paths: list[tuple[str, Any]]) -> None:
    # Not a closure: a recursive closure is a reference cycle, and _inner_shapes
    # passes whole batches through here, which the cycle would keep alive until gc.
    if isinstance(value, dict):
        for key in sorted(value):
            _visit(value[key], f"{where}[{key!r}]", paths)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _visit(item, f"{where}[{i}]", paths)
    else:
        paths.append((where, value))


def prepare(
    dataset: tf.data.Dataset, batch_size: int | None, batched: bool | None
) -> tf.data.Dataset:
    """Checks the dataset's elements and batches them if asked to.

    Args:
      dataset: the input.
      batch_size: when given, the dataset holds one sample per element and is
        batched into global batches of this many samples (the last may be
        smaller).
      batched: whether elements are already batches; None to tell from the
        element spec (a batch dimension of unknown size, as `Dataset.batch`
        makes, means batched).

    Returns:
      A dataset of global batches, prefetching.

    Raises:
      ArgumentError: the dataset's elements have no batch dimension, or it is
        ambiguous whether they have one, or `batch_size` is invalid.
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ArgumentError(
            f"expected a tf.data.Dataset, got {type(dataset).__name__}; for tensors and "
            "arrays call the function itself, f(x)"
        )
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ArgumentError(
                f"batch_size={batch_size!r}: the number of samples per global batch, an int >= 1"
            )
        if batched:
            raise ArgumentError(
                "batch_size= batches a dataset of single samples, but batched=True says its "
                "elements are batches already; pass one or the other"
            )
        dataset = dataset.batch(batch_size)
    elif batched is False:
        raise ArgumentError(
            "batched=False: each element is one sample, so pass batch_size=N to let "
            "tfshard batch them"
        )
    elif batched is None:
        leaves = _path_names(dataset.element_spec)
        for where, spec in leaves:
            if spec.shape.rank == 0:
                raise ArgumentError(
                    f"{where} is a scalar, so the dataset has no batch dimension; pass "
                    "batch_size=N to let tfshard batch it (or call dataset.batch(N) first)"
                )
        if not all(spec.shape.rank is not None and spec.shape[0] is None for _, spec in leaves):
            shapes = ", ".join(f"{where}: {spec.shape}" for where, spec in leaves)
            raise ArgumentError(
                f"cannot tell whether the dataset's elements are batches ({shapes}); pass "
                "batch_size=N if each element is one sample, or batched=True if each is a "
                "batch (e.g. made by dataset.batch(N, drop_remainder=True))"
            )
    return dataset.prefetch(tf.data.AUTOTUNE)


def _rows(element: Any) -> int:
    leaf = tf.nest.flatten(element)[0]
    return int(leaf.nrows() if isinstance(leaf, tf.RaggedTensor) else leaf.shape[0])


class _Progress:
    """A one-line progress report, ``batch 12/40  3072 samples  1234.5 samples/s``."""

    def __init__(self, name: str, total: int | None, stream: TextIO | None) -> None:
        self._name = name
        self._total = total
        self._stream = stream or sys.stderr
        self._start = time.perf_counter()
        self._last = 0.0
        self._batches = 0
        self.samples = 0

    def update(self, rows: int) -> None:
        self._batches += 1
        self.samples += rows
        now = time.perf_counter()
        if now - self._last >= 0.5 or self._batches == self._total:
            self._last = now
            self._write(final=False)

    def close(self) -> None:
        self._write(final=True)

    def _write(self, final: bool) -> None:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        of = f"/{self._total}" if self._total is not None else ""
        line = (
            f"{self._name}: batch {self._batches}{of}  {self.samples} samples  "
            f"{self.samples / elapsed:.1f} samples/s  {elapsed:.1f} s"
        )
        tty = getattr(self._stream, "isatty", lambda: False)()
        if tty:
            self._stream.write("\r" + line + ("\n" if final else ""))
        elif final or self._batches == 1:
            self._stream.write(line + "\n")
        self._stream.flush()


def _cardinality(dataset: tf.data.Dataset) -> int | None:
    count = int(dataset.cardinality())
    return count if count >= 0 else None


def _split_element(element: Any) -> tuple[Any, ...]:
    # Dataset.map's convention: a tuple is spread over the positional parameters.
    return element if type(element) is tuple else (element,)


def _check_specs(fn: ShardedFunction, dataset: tf.data.Dataset, args: tuple, kwargs: dict) -> None:
    """Fails early when the element structure does not fit the function."""
    params = fn._params
    if params is None:
        return
    element = _split_element(dataset.element_spec)
    try:
        params.bind(*element, *args, **kwargs)
    except TypeError as error:
        raise ArgumentError(
            f"{fn.__name__}: dataset elements are {dataset.element_spec}, passed as "
            f"{len(element)} positional argument(s) (a tuple element is spread over the "
            f"parameters, as Dataset.map does), which does not fit {fn.__name__}{params}: "
            f"{error}"
        ) from None


def _inner_shapes(element: Any) -> list[tuple[str, Any]]:
    return [
        (where, None if isinstance(t, tf.RaggedTensor) else tuple(t.shape[1:]))
        for (where, _), t in zip(_path_names(element), tf.nest.flatten(element))
    ]


def iterate(
    fn: ShardedFunction,
    dataset: tf.data.Dataset,
    args: tuple,
    kwargs: dict,
    *,
    batch_size: int | None = None,
    batched: bool | None = None,
    progress: bool | TextIO = False,
) -> Iterator[tuple[Any, int]]:
    """Yields ``(result, rows)`` for each global batch, in order."""
    _check_specs(fn, dataset, args, kwargs)
    dataset = prepare(dataset, batch_size, batched)
    meter = (
        _Progress(fn.__name__, _cardinality(dataset), None if progress is True else progress)
        if progress
        else None
    )
    first: list[tuple[str, Any]] | None = None
    for element in dataset:
        shapes = _inner_shapes(element)
        if first is None:
            first = shapes
        elif shapes != first:
            for (where, now), (_, before) in zip(shapes, first):
                if now != before:
                    raise ArgumentError(
                        f"{where} has per-sample shape {list(now)} in this batch but "
                        f"{list(before)} in the first; every batch must keep its per-sample "
                        "shapes (pad to one length, or use ragged tensors)"
                    )
        rows = _rows(element)
        result = fn(*_split_element(element), *args, **kwargs)
        if meter:
            meter.update(rows)
        yield result, rows
    if meter:
        meter.close()


def run(
    fn: ShardedFunction,
    dataset: tf.data.Dataset,
    args: tuple,
    kwargs: dict,
    **options: Any,
) -> Any:
    """All of the dataset through `fn`: outputs concatenated in order, or reduced."""
    op = fn._reduce
    # A per-sample mean over batches is the sum over all samples / N, so run the
    # batches with a sum and divide once; a per-shard mean is weighted by rows.
    batch_fn = fn._with_reduce("sum") if op == "mean" and fn._per_sample else fn
    total = 0
    accumulated: Any = None
    pieces: list[Any] = []
    for result, rows in iterate(batch_fn, dataset, args, kwargs, **options):
        total += rows
        if op is None:
            pieces.append(result)
            continue
        if op == "mean" and not fn._per_sample:
            result = tf.nest.map_structure(lambda v, n=rows: v * tf.cast(n, v.dtype), result)
        accumulated = (
            result
            if accumulated is None
            else tf.nest.map_structure(lambda a, b: _accumulate(a, b, op), accumulated, result)
        )
    if not pieces and accumulated is None:
        return _empty(fn, dataset, args, kwargs, options)
    if op is None:
        with tf.device(fn.output_device):
            return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *pieces)
    if op != "mean":
        return accumulated
    with tf.device(fn.output_device):
        return tf.nest.map_structure(
            lambda value: collect.combine([value], tf.constant(total, tf.int64), "mean"),
            accumulated,
        )


def _accumulate(a: tf.Tensor, b: tf.Tensor, op: str) -> tf.Tensor:
    if op == "max":
        return tf.maximum(a, b)
    if op == "min":
        return tf.minimum(a, b)
    return a + b


def _empty(
    fn: ShardedFunction, dataset: tf.data.Dataset, args: tuple, kwargs: dict, options: dict
) -> Any:
    """The result for a dataset with no elements: `fn` on a batch of zero rows.

    Dimensions the element spec leaves unknown are taken as 0.
    """
    spec = dataset.element_spec
    if options.get("batch_size") is not None:
        spec = dataset.batch(1).element_spec

    def zeros(leaf: tf.TypeSpec) -> Any:
        inner = [d if d is not None else 0 for d in leaf.shape[1:]]
        if isinstance(leaf, tf.RaggedTensorSpec):
            dense_inner = inner[leaf.ragged_rank :]
            values = tf.zeros([0, *dense_inner], leaf.dtype)
            return tf.RaggedTensor.from_nested_row_lengths(
                values,
                [tf.zeros([0], leaf.row_splits_dtype)] * leaf.ragged_rank,
            )
        return tf.zeros([0, *inner], leaf.dtype)

    element = tf.nest.map_structure(zeros, spec)
    return fn(*_split_element(element), *args, **kwargs)
