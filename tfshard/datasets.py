"""How a `tf.data.Dataset` flows through a parallelized function.

Each dataset element is one global batch, split across the devices exactly as
a tensor argument would be. Elements are passed to the function the way
`tf.data.Dataset.map` passes them: a tuple element is spread over the
positional parameters, anything else is the first argument.

Two loops run the batches, chosen by measurement (``python benchmarks/scaling.py
--case=dataset``, on 2 logical CPU devices: BENCHMARKS.md has the numbers):

- ``f(dataset)`` runs one traced `tf.function` holding a `tf.while_loop` over
  the dataset's iterator (`_Loop`). Each iteration fetches the next batch
  before computing the current one, so tf.data prepares it while the devices
  work, splits the batch and runs one shard per device as a call on a tensor
  would, and writes each shard's outputs into TensorArrays that are
  concatenated (or reduced) once after the last batch. There is no Python
  per batch and each output row is copied once. It reached 0.87-0.90x of the
  in-memory call where the Python loop below reached 0.73-0.79x, on the same
  dataset in the same runs. It applies when the element spec fixes every
  per-sample shape (a `Dataset.batch` of fixed-shape samples, ragged batches);
  otherwise (e.g. `padded_batch`, whose per-sample shape may change from batch
  to batch) ``f(dataset)`` uses the Python loop, which checks every batch.
- `ShardedFunction.iterate` must hand back each batch's result as it comes,
  so it is a Python loop over ``dataset.prefetch(AUTOTUNE)``: one call of the
  traced graph per batch, while tf.data prepares the next on its own threads.

When every shard runs on this machine's CPU, tf.data's autotuning is turned
off for the stream unless the dataset's options set it
(``options.autotune.enabled``): its background tuning thread competes with the
shards for the same cores, and in our runs it made one pass in three run about
40 % slower. Parallel `map` calls and prefetching keep their default
parallelism and buffers. On GPUs it stays on.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

import tensorflow as tf

from tfshard import collect, parallel, pinning
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
    dataset: tf.data.Dataset,
    batch_size: int | None,
    batched: bool | None,
    *,
    cpu_only: bool = False,
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
      cpu_only: the shards run on the host's own CPU cores, so tf.data's
        autotuning is turned off unless the dataset's options set it (see the
        module docstring).

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
    if cpu_only and dataset.options().autotune.enabled is None:
        options = tf.data.Options()
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
    return dataset.prefetch(tf.data.AUTOTUNE)


def _on_host_cpus(fn: ShardedFunction) -> bool:
    """Whether every device of `fn` is a CPU device of this process."""
    return all(
        tf.DeviceSpec.from_string(d).device_type == "CPU" and not pinning.is_remote(d)
        for d in fn.devices
    )


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
    batches = prepare(dataset, batch_size, batched, cpu_only=_on_host_cpus(fn))
    return _batches(fn, batches, args, kwargs, progress)


def _batches(
    fn: ShardedFunction,
    batches: tf.data.Dataset,
    args: tuple,
    kwargs: dict,
    progress: bool | TextIO,
) -> Iterator[tuple[Any, int]]:
    """The Python loop: one call of `fn` per batch, checking per-sample shapes."""
    meter = _meter(fn, batches, progress)
    first: list[tuple[str, Any]] | None = None
    for element in batches:
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


def _meter(fn: ShardedFunction, batches: tf.data.Dataset, progress: bool | TextIO) -> Any:
    if not progress:
        return None
    return _Progress(fn.__name__, _cardinality(batches), None if progress is True else progress)


def run(
    fn: ShardedFunction,
    dataset: tf.data.Dataset,
    args: tuple,
    kwargs: dict,
    *,
    batch_size: int | None = None,
    batched: bool | None = None,
    progress: bool | TextIO = False,
) -> Any:
    """All of the dataset through `fn`: outputs concatenated in order, or reduced."""
    _check_specs(fn, dataset, args, kwargs)
    if int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise ArgumentError(
            f"{fn.__name__}(dataset): the dataset is infinite (it repeats), so its results "
            f"would never be complete; stream them with {fn.__name__}.iterate(dataset), or "
            "take a finite part first (dataset.take(n))"
        )
    batches = prepare(dataset, batch_size, batched, cpu_only=_on_host_cpus(fn))
    op = fn._reduce
    # A per-sample mean over batches is the sum over all samples / N, so run the
    # batches with a sum and divide once; a per-shard mean is weighted by rows.
    batch_fn = fn._with_reduce("sum") if op == "mean" and fn._per_sample else fn
    loop = _graph_loop(batch_fn, batches, args, kwargs, op, progress)
    if loop is not None:
        result, total = loop
    else:
        result, total = _python_loop(batch_fn, batches, args, kwargs, op, progress)
    if total == 0:
        return _empty(fn, dataset, args, kwargs, batch_size)
    return result


def _graph_loop(
    fn: ShardedFunction,
    batches: tf.data.Dataset,
    args: tuple,
    kwargs: dict,
    op: str | None,
    progress: bool | TextIO,
) -> tuple[Any, int] | None:
    """The whole dataset in one call of a traced loop; None where it does not apply.

    It applies when the element spec fixes every per-sample shape (so no batch
    can change one, and outputs of all batches concatenate) and the element
    is exactly the split arguments (further arguments are broadcast or
    constants). Returns the result and the number of rows.
    """
    spec = batches.element_spec
    if not _static_inner_shapes(spec):
        return None
    with tf.device("/device:CPU:0"):  # where the iterator leaves each batch: split there
        element = _split_element(_zeros(spec))
    # Rows vary by batch: None, so an error names the shard's slice, not rows of 0.
    call = fn._classify((*element, *args), kwargs)._replace(rows=None)
    count = len(tf.nest.flatten(spec))
    element_kinds = [kind for kinds in call.template.kinds[: len(element)] for kind in kinds]
    if call.template.split_count != count or element_kinds != ["split"] * count:
        return None
    key = (tf.data.DatasetSpec(spec), call.key, bool(progress))
    loop = fn._loops.get(key)
    if loop is None:
        loop = fn._loops.setdefault(key, _Loop(fn, spec, call, op, bool(progress)))
    meter = _meter(fn, batches, progress)
    token = loop.register(meter)
    try:
        with tf.device(fn.output_device):
            result, total = loop.function(
                batches, tf.constant(token, tf.int64), *call.tensors[count:]
            )
    except tf.errors.OpError as error:
        raise fn._call_error(error, call) from None
    finally:
        loop.meters.pop(token, None)
    if meter:
        meter.close()
    return result, int(total)


def _static_inner_shapes(spec: Any) -> bool:
    """Whether every leaf of an element spec fixes its per-sample (dense) shape."""
    for leaf in tf.nest.flatten(spec):
        if isinstance(leaf, tf.RaggedTensorSpec):
            inner = leaf.shape[leaf.ragged_rank + 1 :]
        elif isinstance(leaf, tf.TensorSpec):
            inner = leaf.shape[1:]
        else:
            return False
        if leaf.shape.rank is None or leaf.shape.rank == 0 or not inner.is_fully_defined():
            return False
    return True


class _Loop:
    """A traced loop over every batch of a dataset with one element spec.

    One `tf.function` holds a `tf.while_loop` over the dataset's iterator. Each
    iteration runs the ShardedFunction's body on one batch (split, one shard
    per device) and writes each shard's outputs straight into TensorArrays,
    which are concatenated once after the last batch: the rows are copied
    once, not once per batch and again at the end. With a reduction, each
    batch is reduced as a call would be and the partials are combined at the
    end. The next batch is fetched before the current one is computed, so
    tf.data prepares it, and the executor can start on it, while the current
    batch runs.
    """

    def __init__(
        self, fn: ShardedFunction, spec: Any, call: Any, op: str | None, progress: bool
    ) -> None:
        self.meters: dict[int, _Progress | None] = {}
        self._tokens = itertools.count()
        template = call.template
        count = template.split_count
        shared = [parallel._type_spec(t, False) for t in call.tensors[count:]]
        split_devices = [key[2] for key in call.key[3] if key[0] == "split"]
        devices, output = fn.devices, fn.output_device
        per_sample = fn._per_sample
        meters = self.meters

        def report(token: tf.Tensor, rows: tf.Tensor) -> None:
            meter = meters.get(int(token))
            if meter is not None:
                meter.update(int(rows))

        def run_batch(tensors: list[Any], broadcast: tuple) -> tuple[list[Any], Any]:
            """One batch: a list of output leaves per shard (or one, reduced), and the structure."""
            tensors = [*tensors, *broadcast]
            result = fn._graph(
                template, tensors, split_devices, devices, output, gather=op is not None
            )
            per_shard = result if op is None else [result]
            return [tf.nest.flatten(r) for r in per_shard], per_shard[0]

        # The outputs' structure, dtypes and shapes, from a trace of one batch on its own.
        specs = [parallel._type_spec(t, True) for t in call.tensors[:count]]
        probe = tf.function(
            lambda *t: run_batch(list(t[:count]), t[count:]), autograph=False
        ).get_concrete_function(*specs, *shared)
        per_shard_leaves, structure = probe.structured_outputs
        leaves = per_shard_leaves[0]
        slots = len(per_shard_leaves)  # array entries per batch: one per shard, or one partial

        def loop(dataset: tf.data.Dataset, token: tf.Tensor, *broadcast: Any) -> Any:
            iterator = iter(dataset)
            arrays = [_new_arrays(leaf, op) for leaf in leaves]

            def body(i: tf.Tensor, total: tf.Tensor, current: Any, arrays: list) -> tuple:
                following = iterator.get_next_as_optional()  # prepared while this one runs
                tensors = tf.nest.flatten(current.get_value())
                rows = parallel._rows(tensors[0])
                per_shard, _ = run_batch(tensors, broadcast)
                for k, values in enumerate(per_shard):
                    arrays = [
                        _write(a, i * slots + k, value, rows, op, per_sample)
                        for a, value in zip(arrays, values)
                    ]
                if progress:
                    tf.py_function(report, [token, rows], [])
                return i + 1, total + rows, following, arrays

            _, total, _, arrays = tf.while_loop(
                lambda i, total, current, arrays: current.has_value(),
                body,
                (tf.constant(0), tf.constant(0, tf.int64), iterator.get_next_as_optional(), arrays),
            )
            with tf.device(output):
                results = [_finish(a, leaf, total, op) for a, leaf in zip(arrays, leaves)]
            return tf.nest.pack_sequence_as(structure, results), total

        self.function = tf.function(loop, autograph=False).get_concrete_function(
            tf.data.DatasetSpec(spec), tf.TensorSpec([], tf.int64), *shared
        )

    def register(self, meter: _Progress | None) -> int:
        token = next(self._tokens)
        self.meters[token] = meter
        return token


def _array(dtype: tf.DType, inner: tf.TensorShape) -> tf.TensorArray:
    # One entry per batch: [rows_b, *inner]; batches differ in rows.
    return tf.TensorArray(
        dtype,
        size=0,
        dynamic_size=True,
        infer_shape=False,
        element_shape=tf.TensorShape([None]).concatenate(inner),
    )


def _new_arrays(leaf: Any, op: str | None) -> list[tf.TensorArray]:
    """The TensorArrays that collect one output leaf over the batches."""
    if op is not None:  # One partial per batch, all of one shape.
        return [tf.TensorArray(leaf.dtype, size=0, dynamic_size=True, element_shape=leaf.shape)]
    if isinstance(leaf, tf.RaggedTensor):
        # Its flat values and one row-lengths vector per ragged dimension.
        return [_array(leaf.flat_values.dtype, leaf.flat_values.shape[1:])] + [
            _array(leaf.row_splits.dtype, tf.TensorShape([])) for _ in range(leaf.ragged_rank)
        ]
    return [_array(leaf.dtype, leaf.shape[1:])]


def _write(
    arrays: list[tf.TensorArray],
    i: tf.Tensor,
    value: Any,
    rows: tf.Tensor,
    op: str | None,
    per_sample: bool,
) -> list[tf.TensorArray]:
    if op == "mean" and not per_sample:
        # A batch's mean counts rows times; an empty batch's (NaN) counts not at all.
        value = tf.where(rows > 0, value * tf.cast(rows, value.dtype), tf.zeros_like(value))
    if isinstance(value, tf.RaggedTensor):
        parts = [value.flat_values, *value.nested_row_lengths()]
    else:
        parts = [value]
    return [a.write(i, part) for a, part in zip(arrays, parts)]


def _finish(arrays: list[tf.TensorArray], leaf: Any, total: tf.Tensor, op: str | None) -> Any:
    """One output leaf over all batches: concatenated, or reduced."""
    if op is not None:
        # [batches, ...] -> [...]; per-sample means arrive as sums.
        return collect.combine_stacked(_read(arrays[0], stack=True), total, op)
    parts = [_read(a, stack=False) for a in arrays]
    if isinstance(leaf, tf.RaggedTensor):
        return tf.RaggedTensor.from_nested_row_lengths(parts[0], parts[1:], validate=False)
    return parts[0]


def _read(array: tf.TensorArray, stack: bool) -> tf.Tensor:
    """`array` stacked or concatenated; with no entries (no batches), zeros of that shape.

    An empty TensorArray can only be read when its shape is fully known, and
    the caller answers an empty dataset with `_empty` anyway.
    """
    shape = array.element_shape
    empty = [0, *(0 if d is None else d for d in shape)] if stack else [0, *shape[1:]]
    empty = [0 if d is None else d for d in empty]
    return tf.cond(
        array.size() > 0,
        lambda: array.stack() if stack else array.concat(),
        lambda: tf.zeros(empty, array.dtype),
    )


def _python_loop(
    fn: ShardedFunction,
    batches: tf.data.Dataset,
    args: tuple,
    kwargs: dict,
    op: str | None,
    progress: bool | TextIO,
) -> tuple[Any, int]:
    """The batches one call each, for elements whose per-sample shapes may change."""
    total = 0
    accumulated: Any = None
    pieces: list[Any] = []
    for result, rows in _batches(fn, batches, args, kwargs, progress):
        total += rows
        if op is None:
            pieces.append(result)
            continue
        if rows == 0:
            continue  # nothing to reduce (a per-shard mean of no rows is NaN)
        if op == "mean" and not fn._per_sample:
            result = tf.nest.map_structure(lambda v, n=rows: v * tf.cast(n, v.dtype), result)
        accumulated = (
            result
            if accumulated is None
            else tf.nest.map_structure(lambda a, b: _accumulate(a, b, op), accumulated, result)
        )
    if total == 0:
        return None, 0
    with tf.device(fn.output_device):
        if op is None:
            return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *pieces), total
        if op != "mean":
            return accumulated, total
        count = tf.constant(total, tf.int64)
        return tf.nest.map_structure(
            lambda value: collect.combine([value], count, "mean"), accumulated
        ), total


def _accumulate(a: tf.Tensor, b: tf.Tensor, op: str) -> tf.Tensor:
    if op == "max":
        return tf.maximum(a, b)
    if op == "min":
        return tf.minimum(a, b)
    return a + b


def _zeros(spec: Any) -> Any:
    """An element of zero rows that fits `spec`; unknown inner dimensions are 0."""

    def zeros(leaf: tf.TypeSpec) -> Any:
        inner = [d if d is not None else 0 for d in leaf.shape[1:]]
        if isinstance(leaf, tf.RaggedTensorSpec):
            values = tf.zeros([0, *inner[leaf.ragged_rank :]], leaf.dtype)
            return tf.RaggedTensor.from_nested_row_lengths(
                values, [tf.zeros([0], leaf.row_splits_dtype)] * leaf.ragged_rank
            )
        return tf.zeros([0, *inner], leaf.dtype)

    return tf.nest.map_structure(zeros, spec)


def _empty(
    fn: ShardedFunction,
    dataset: tf.data.Dataset,
    args: tuple,
    kwargs: dict,
    batch_size: int | None,
) -> Any:
    """The result for a dataset with no elements: `fn` on a batch of zero rows.

    Dimensions the element spec leaves unknown are taken as 0.
    """
    spec = dataset.batch(1).element_spec if batch_size is not None else dataset.element_spec
    return fn(*_split_element(_zeros(spec)), *args, **kwargs)
