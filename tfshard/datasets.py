"""How a `tf.data.Dataset` flows through a parallelized function.

Each dataset element is one global batch, split across the devices exactly as
a tensor argument would be. Elements are passed to the function the way
`tf.data.Dataset.map` passes them: a tuple element is spread over the
positional parameters, anything else is the first argument.

Two loops run the batches, chosen by measurement (on 2 logical CPU devices,
``python benchmarks/scaling.py --case=dataset``: ``tfshard_dataset`` against
``tfshard_python_loop``; BENCHMARKS.md has the numbers):

- ``f(dataset)`` runs a traced `tf.function` holding a `tf.while_loop` over
  the dataset's iterator (`_Loop`). Each iteration fetches the next batch
  before computing the current one, so tf.data prepares it while the devices
  work, splits the batch and runs one shard per device as a call on a tensor
  would, and writes each shard's outputs into TensorArrays that are
  concatenated (or reduced) once after the last batch: no Python per batch,
  and each output row is copied once. Each call of the function runs as many
  batches as take about half a second, so Ctrl-C and progress reach Python
  that often. Against the Python loop below over the same batches, calling
  the same traced graph, it reached 0.84x of the in-memory call where the
  Python loop reached 0.78x with batches of 2048 rows, and tied (0.84x,
  0.83x) with batches of 4096: its gain is the per-batch cost. It
  applies when the element spec fixes every per-sample shape (a
  `Dataset.batch` of fixed-shape samples, ragged batches) and results land on
  this machine; otherwise (e.g. `padded_batch`, whose per-sample shape may
  change from batch to batch, or an output device on another machine)
  ``f(dataset)`` uses the Python loop, which checks every batch.
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
    for where, spec in _path_names(dataset.element_spec):
        if not isinstance(spec, tf.TensorSpec | tf.RaggedTensorSpec):
            fix = (
                "flat_map each window into a batch first: ds.flat_map(lambda w: w.batch(n))"
                if isinstance(spec, tf.data.DatasetSpec)
                else "map it to a tensor first (e.g. tf.sparse.to_dense)"
            )
            raise ArgumentError(
                f"{where} is a {type(spec).__name__}; tfshard splits tensors and ragged "
                f"tensors along their first dimension: {fix}"
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

    def update(self, rows: int, batches: int = 1) -> None:
        self._batches += batches
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
    """``(result, rows)`` for each global batch, in order, as they are computed."""
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
    """The whole dataset through a traced loop; None where it does not apply.

    It applies when the element spec fixes every per-sample shape (so no batch
    can change one, and outputs of all batches concatenate), the element is
    exactly the split arguments (further arguments are broadcast or
    constants), and results land on this machine. Returns the result and the
    number of rows.
    """
    spec = batches.element_spec
    if not _static_inner_shapes(spec) or pinning.is_remote(fn.output_device):
        return None
    with tf.device(_HOST):  # where the iterator leaves each batch: split there
        element = _split_element(_zeros(spec))
    try:
        call = fn._classify((*element, *args), kwargs)
    except ArgumentError:
        return None  # e.g. a further argument to split: the Python loop says what is wrong
    # Rows vary by batch: None, so an error names the shard's slice.
    call = call._replace(rows=None)
    count = len(tf.nest.flatten(spec))
    element_kinds = [kind for kinds in call.template.kinds[: len(element)] for kind in kinds]
    if call.template.split_count != count or element_kinds != ["split"] * count:
        return None
    relaxed = tf.nest.map_structure(_any_rows, spec)  # one loop for every batch size
    key = (tf.data.DatasetSpec(relaxed), call.key)
    loop = fn._loops.get(key)
    if loop is None:
        loop = fn._loops.setdefault(key, _Loop(fn, relaxed, call, op))
    meter = _meter(fn, batches, progress)
    try:
        result, total = loop.run(batches, call.tensors[count:], meter)
    except tf.errors.InvalidArgumentError as error:
        if _ROWS_DIFFER in error.message:
            raise ArgumentError(
                f"{fn.__name__}: the fields of one dataset element have different numbers "
                f"of rows ({', '.join(path for path, _ in _path_names(spec))}); every field "
                "is split along its first dimension, so they must match (batch zipped "
                "datasets alike)"
            ) from None
        raise fn._call_error(error, call) from None
    except tf.errors.OpError as error:
        raise fn._call_error(error, call) from None
    if meter:
        meter.close()
    return result, total


# The host's CPU: where datasets iterate, and where the loop splits each batch.
_HOST = "/device:CPU:0"
# Marks the in-graph check of an element's row counts, to turn it into an ArgumentError.
_ROWS_DIFFER = "tfshard: the fields of one element differ in rows"
# How long one call of a loop runs before Python gets control back (Ctrl-C, progress).
_CHUNK_SECONDS = 0.5


def _any_rows(leaf: tf.TypeSpec) -> tf.TypeSpec:
    """`leaf` with its batch dimension unknown."""
    shape = tf.TensorShape([None]).concatenate(leaf.shape[1:])
    if isinstance(leaf, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec(shape, leaf.dtype, leaf.ragged_rank, leaf.row_splits_dtype)
    return tf.TensorSpec(shape, leaf.dtype)


def _static_inner_shapes(spec: Any) -> bool:
    """Whether every leaf of an element spec fixes its per-sample (dense) shape.

    The leaves are TensorSpecs and RaggedTensorSpecs (`prepare` refuses others).
    """
    for leaf in tf.nest.flatten(spec):
        if not leaf.shape.rank:  # unknown, or a scalar with no rows
            return False
        ragged = leaf.ragged_rank if isinstance(leaf, tf.RaggedTensorSpec) else 0
        if not leaf.shape[ragged + 1 :].is_fully_defined():
            return False
    return True


class _Loop:
    """Traced loops over the batches of datasets with one element spec.

    `run` iterates the dataset in calls of a traced `tf.function` (`chunk`),
    each a `tf.while_loop` over up to ``limit`` batches, sized so a call lasts
    about half a second: Python gets control back that often, for Ctrl-C and
    progress, while the batches themselves run with no Python between them.
    Each iteration fetches the next batch before computing the current one,
    so tf.data prepares it, and the executor can start on it, while the
    current batch runs; the batch is split and runs one shard per device as a
    call on a tensor would.

    Without a reduction, each shard's outputs are written straight into
    TensorArrays that stay in TensorFlow between calls (their TensorList
    handles are the calls' inputs and outputs) and are concatenated once
    after the last batch (`finish`): every output row is copied once. With
    a reduction, each batch is reduced as a call would be, and a running
    sum (or max, or min) is carried from batch to batch.
    """

    def __init__(self, fn: ShardedFunction, spec: Any, call: Any, op: str | None) -> None:
        template = call.template
        count = template.split_count
        shared = [parallel._type_spec(t, False) for t in call.tensors[count:]]
        split_devices = [key[2] for key in call.key[3] if key[0] == "split"]
        devices, output = fn.devices, fn.output_device
        per_sample = fn._per_sample
        paths = [path for path, _ in _path_names(spec)]

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
        per_shard_leaves, self._structure = probe.structured_outputs
        leaves = self._leaves = per_shard_leaves[0]
        slots = len(per_shard_leaves)  # entries per batch: one per shard, or one partial
        self._op = op
        self._output = output
        self._last_limit = 1  # batches per call that last took about _CHUNK_SECONDS

        def checked(tensors: list[Any]) -> list[Any]:
            """The batch's fields, once their row counts are checked equal."""
            if len(tensors) == 1:
                return tensors
            rows = [tf.cast(parallel._rows(t), tf.int64) for t in tensors]
            checks = [
                tf.debugging.assert_equal(
                    r, rows[0], message=f"{_ROWS_DIFFER}: {paths[i]} and {paths[0]}"
                )
                for i, r in enumerate(rows[1:], start=1)
            ]
            with tf.control_dependencies(checks):
                return [
                    tf.nest.map_structure(tf.identity, t, expand_composites=True) for t in tensors
                ]

        def chunk(
            iterator: Any,
            current: Any,
            i: tf.Tensor,
            limit: tf.Tensor,
            state: list,
            broadcast: list,
        ) -> tuple:
            """Up to `limit` batches; `state` holds the TensorList handles or the accumulators."""

            def body(i, n, rows, current, state):  # noqa: ANN001, ANN202
                with tf.device(_HOST):
                    following = iterator.get_next_as_optional()  # prepared while this one runs
                tensors = checked(tf.nest.flatten(current.get_value()))
                batch_rows = tf.cast(parallel._rows(tensors[0]), tf.int64)
                per_shard, _ = run_batch(tensors, tuple(broadcast))
                with tf.device(output):
                    if op is None:
                        state = _write_shards(state, leaves, i * slots, per_shard)
                    else:
                        state = [
                            _accumulate(acc, _partial(value, batch_rows, op, per_sample), op)
                            for acc, value in zip(state, per_shard[0])
                        ]
                return i + 1, n + 1, rows + batch_rows, following, state

            # The accumulators come in with unknown shapes: nothing to hold invariant.
            i, n, rows, current, state = tf.while_loop(
                lambda i, n, rows, current, state: tf.logical_and(n < limit, current.has_value()),
                body,
                (i, tf.constant(0), tf.constant(0, tf.int64), current, list(state)),
            )
            return current, i, n, rows, state

        state_specs = (
            [tf.TensorSpec([], tf.variant)] * sum(_parts(leaf) for leaf in leaves)
            if op is None
            else [tf.TensorSpec(None, leaf.dtype) for leaf in leaves]
        )
        self._chunk = tf.function(chunk, autograph=False).get_concrete_function(
            tf.data.IteratorSpec(spec),
            tf.OptionalSpec(spec),
            tf.TensorSpec([], tf.int32),
            tf.TensorSpec([], tf.int32),
            state_specs,
            shared,
        )
        if op is None:
            with tf.device(output):
                self._start = tf.function(
                    lambda: [a.flow for leaf in leaves for a in _new_arrays(leaf)],
                    autograph=False,
                ).get_concrete_function()
                self._finish = tf.function(
                    lambda handles: _concat_all(handles, leaves), autograph=False
                ).get_concrete_function(state_specs)

    def run(
        self, batches: tf.data.Dataset, broadcast: list[Any], meter: _Progress | None
    ) -> tuple[Any, int]:
        """All of `batches` through the loop: the result, and how many rows."""
        with tf.device(_HOST):
            iterator = iter(batches)
            current = iterator.get_next_as_optional()
        if self._op is None:
            state = self._start()
        else:
            with tf.device(self._output):
                state = [collect.identity(leaf.dtype, self._op) for leaf in self._leaves]
        # Start from half the last run's size (one batch at first), then adapt.
        i, total, limit = tf.constant(0), 0, max(self._last_limit // 2, 1)
        while True:
            began = time.perf_counter()
            with tf.device(_HOST):
                current, i, n, rows, state = self._chunk(
                    iterator, current, i, tf.constant(limit), state, broadcast
                )
            n, rows = int(n), int(rows)
            total += rows
            if meter and n:
                meter.update(rows, n)
            if n < limit:
                break
            # The next call runs about _CHUNK_SECONDS, by this one's time per batch.
            per_batch = (time.perf_counter() - began) / n
            # At most double it: batches can get slower, and a call cannot be stopped.
            limit = int(min(max(_CHUNK_SECONDS / max(per_batch, 1e-9), 1), 2 * limit))
            self._last_limit = limit
        if total == 0:
            return None, 0
        with tf.device(self._output):
            if self._op is None:
                results = self._finish(state)
            else:  # The loop left the totals on the host.
                results = _reduced([tf.identity(acc) for acc in state], total, self._op)
        return tf.nest.pack_sequence_as(self._structure, list(results)), total


def _parts(leaf: Any) -> int:
    """TensorArrays per output leaf: its flat values, and row lengths per ragged dimension."""
    return 1 + leaf.ragged_rank if isinstance(leaf, tf.RaggedTensor) else 1


def _partial(value: tf.Tensor, rows: tf.Tensor | int, op: str, per_sample: bool) -> tf.Tensor:
    """A batch's reduced value as it enters the running total."""
    if op == "mean" and not per_sample:
        # A batch's mean counts rows times; an empty batch's (NaN) counts not at all.
        return tf.where(rows > 0, value * tf.cast(rows, value.dtype), tf.zeros_like(value))
    return value


def _write_shards(handles: list, leaves: list, first: tf.Tensor, per_shard: list) -> list:
    """Writes each shard's output leaves at entries first, first + 1, ..."""
    handles = list(handles)
    for k, values in enumerate(per_shard):
        at = 0
        for leaf, value in zip(leaves, values):
            parts = (
                [value.flat_values, *value.nested_row_lengths()]
                if isinstance(leaf, tf.RaggedTensor)
                else [value]
            )
            for part in parts:
                array = tf.TensorArray(
                    part.dtype, dynamic_size=True, infer_shape=False, flow=handles[at]
                )
                handles[at] = array.write(first + k, part).flow
                at += 1
    return handles


def _concat_all(handles: list, leaves: list) -> list:
    """Each output leaf over all batches, concatenated in order."""
    results, at = [], 0
    for leaf in leaves:
        parts = []
        for dtype, inner in _part_shapes(leaf):
            array = tf.TensorArray(dtype, dynamic_size=True, infer_shape=False, flow=handles[at])
            at += 1
            empty = [0, *(0 if d is None else d for d in inner)] if inner.rank is not None else [0]
            parts.append(
                tf.cond(array.size() > 0, array.concat, lambda e=empty, d=dtype: tf.zeros(e, d))
            )
        if isinstance(leaf, tf.RaggedTensor):
            results.append(
                tf.RaggedTensor.from_nested_row_lengths(parts[0], parts[1:], validate=False)
            )
        else:
            results.append(parts[0])
    return results


def _part_shapes(leaf: Any) -> list[tuple[tf.DType, tf.TensorShape]]:
    """(dtype, per-row shape) of each TensorArray that collects `leaf`."""
    if isinstance(leaf, tf.RaggedTensor):
        lengths = [(leaf.row_splits.dtype, tf.TensorShape([]))] * leaf.ragged_rank
        return [(leaf.flat_values.dtype, leaf.flat_values.shape[1:]), *lengths]
    return [(leaf.dtype, leaf.shape[1:])]


def _new_arrays(leaf: Any) -> list[tf.TensorArray]:
    """Empty TensorArrays to collect one output leaf, one entry per shard and batch."""
    return [
        tf.TensorArray(
            dtype,
            size=0,
            dynamic_size=True,
            infer_shape=False,
            element_shape=tf.TensorShape([None]).concatenate(inner),
        )
        for dtype, inner in _part_shapes(leaf)
    ]


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
        result = tf.nest.map_structure(lambda v, n=rows: _partial(v, n, op, fn._per_sample), result)
        with tf.device(fn.output_device):
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
        return _reduced(accumulated, total, op), total


def _reduced(totals: Any, rows: int, op: str) -> Any:
    """The running totals of a reduction over `rows` rows as its result: a mean divides."""
    if op != "mean":
        return totals
    count = tf.constant(rows, tf.int64)
    return tf.nest.map_structure(lambda total: collect.combine([total], count, "mean"), totals)


def _accumulate(a: tf.Tensor, b: tf.Tensor, op: str) -> tf.Tensor:
    if op == "max":
        return tf.maximum(a, b)
    if op == "min":
        return tf.minimum(a, b)
    return a + b


def _zeros(spec: Any) -> Any:
    """An element of zero rows that fits `spec`; unknown inner dimensions are 0."""
    return collect.empty(tf.nest.map_structure(_sample_spec, spec))


def _sample_spec(leaf: tf.TypeSpec) -> tf.TypeSpec:
    """The spec of one row of a batch of `leaf`."""
    if leaf.shape.rank is None:
        return leaf
    if isinstance(leaf, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec(
            leaf.shape[1:], leaf.dtype, leaf.ragged_rank - 1, leaf.row_splits_dtype
        )
    return tf.TensorSpec(leaf.shape[1:], leaf.dtype)


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
