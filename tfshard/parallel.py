"""How work is split: the `parallelize` decorator.

``@parallelize`` turns a function of one sample (or one batch) into a function
of a batch that runs on several devices at once::

    @tfshard.parallelize
    def embed(sample):                  # [F] -> [D]
        return tf.tanh(tf.linalg.matvec(W, sample))

    out = embed(x)                      # [N, F] -> [N, D], rows in input order

One call traces (once per input signature) a single `tf.function` in which the
batch is split with `tf.split` into one shard per device, each shard runs under
its own `tf.device` scope, and the outputs come back through `tfshard.collect`.
The TensorFlow executor runs the shards concurrently; there are no Python
threads and no Python in the per-shard path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
import threading
import types
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tfshard import collect, datasets, pinning
from tfshard.errors import ArgumentError, ShardError, TfshardError

__all__ = ("ShardedFunction", "parallelize")

# Integer weights are used as they are; other weights are scaled to integers
# with this total, so a plan is exact integer arithmetic, the same in the graph
# and in `plan`.
_WEIGHT_SCALE = 1 << 24
_SHARD_SCOPE = "tfshard_shard_"
_SHARD_NODE_RE = re.compile(_SHARD_SCOPE + r"(\d+)/")


# ------------------------------------------------------------------- plans


def _integer_weights(weights: Sequence[float] | None) -> tuple[int, ...] | None:
    """Validated weights as non-negative integers with a positive sum."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence | np.ndarray):
        raise ArgumentError(f"weights={weights!r}: pass one number per device, e.g. [3, 1]")
    values = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating):
            raise ArgumentError(f"weights[{i}]={w!r} is not a number")
        if math.isnan(w) or math.isinf(w):
            raise ArgumentError(f"weights[{i}]={w!r}: weights must be finite")
        if w < 0:
            raise ArgumentError(f"weights[{i}]={w!r} is negative; weights are relative speeds >= 0")
        values.append(w)
    if not values or sum(values) <= 0:
        raise ArgumentError(
            f"weights={list(weights)!r}: at least one weight must be > 0 "
            "(they are relative device speeds, e.g. [3, 1])"
        )
    if all(float(w).is_integer() for w in values) and sum(values) <= _WEIGHT_SCALE:
        return tuple(int(w) for w in values)
    total = float(sum(values))
    return tuple(round(w / total * _WEIGHT_SCALE) for w in values)


def _plan_sizes(n: tf.Tensor, count: int, weights: tuple[int, ...] | None) -> tf.Tensor:
    """Shard sizes for `n` rows on `count` devices, as an int64 vector summing to n.

    Unweighted, sizes differ by at most one and the first ``n % count`` shards
    get the extra row. Weighted, each shard gets the floor of its quota
    ``n * w_k / sum(w)`` and the rows left over go one each to the largest
    remainders (ties to the lower index): largest-remainder rounding.
    """
    n = tf.cast(n, tf.int64)
    index = tf.range(count, dtype=tf.int64)
    if weights is None:
        return n // count + tf.cast(index < n % count, tf.int64)
    w = tf.constant(weights, tf.int64)
    total = sum(weights)
    quota = n * w  # Exact: n < 2**31 and total <= 2**24 + count.
    base = quota // total
    remainder = quota % total
    left = n - tf.reduce_sum(base)  # 0 <= left < count
    # rank[k]: how many shards beat shard k for a leftover row.
    beats = (remainder[None, :] > remainder[:, None]) | (
        (remainder[None, :] == remainder[:, None]) & (index[None, :] < index[:, None])
    )
    rank = tf.reduce_sum(tf.cast(beats, tf.int64), axis=1)
    return base + tf.cast(rank < left, tf.int64)


# ------------------------------------------------------------ argument trees

_LEAF = None  # The structure key of a leaf; its spec is keyed separately.


def _walk(value: Any, leaves: list[Any]) -> Hashable:
    """Flattens `value` in `tf.nest` order into `leaves`; returns a structure key.

    Tuples, lists, dicts and namedtuples are structures; everything else is a
    leaf.
    """
    if isinstance(value, Mapping):
        # Leaves in sorted key order (as tf.nest); the written order is kept to rebuild.
        keys = sorted(value)
        children = tuple(_walk(value[k], leaves) for k in keys)
        return (type(value), tuple(keys), children, tuple(value))
    if isinstance(value, list | tuple):
        return (type(value), tuple(_walk(v, leaves) for v in value))
    leaves.append(value)
    return _LEAF


def _build(key: Hashable, leaves: Iterator[Any]) -> Any:
    """The inverse of `_walk`: rebuilds a structure from its key and leaves."""
    if key is _LEAF:
        return next(leaves)
    kind = key[0]
    if issubclass(kind, Mapping):
        built = {k: _build(sub, leaves) for k, sub in zip(key[1], key[2])}
        items = [(k, built[k]) for k in key[3]]
        try:
            return kind(items)
        except TypeError:  # e.g. defaultdict: no (key, value) constructor
            return dict(items)
    items = [_build(sub, leaves) for sub in key[1]]
    if hasattr(kind, "_fields"):
        return kind(*items)
    return kind(items)


def _path(prefix: str, key: Hashable, index: int) -> str:
    """The readable path (``x['a'][1]``) of leaf number `index` under `key`."""
    return _paths(prefix, key)[index]


def _paths(prefix: str, key: Hashable) -> list[str]:
    """The readable paths of every leaf under `key`, in leaf order."""
    paths: list[str] = []
    _visit_key(key, prefix, paths)
    return paths


def _visit_key(sub: Hashable, where: str, paths: list[str]) -> None:
    # Not a recursive closure, which would be a reference cycle on every call.
    if sub is _LEAF:
        paths.append(where)
    elif issubclass(sub[0], Mapping):
        for k, s in zip(sub[1], sub[2]):
            _visit_key(s, f"{where}[{k!r}]", paths)
    else:
        for i, s in enumerate(sub[1]):
            _visit_key(s, f"{where}[{i}]", paths)


class _Call(NamedTuple):
    """One call's arguments, classified."""

    key: Hashable  # everything a trace depends on
    tensors: list[Any]  # split tensors, then broadcast tensors (the graph's inputs)
    rows: int | None  # the leading dimension, when known in Python
    template: Any  # rebuilds the arguments inside the graph


class _Template(NamedTuple):
    names: tuple[str, ...]  # one per top-level argument, for messages
    keys: tuple[Hashable, ...]  # structure keys, one per top-level argument
    kinds: tuple[tuple[str, ...], ...]  # leaf kinds, per top-level argument
    statics: tuple[tuple[Any, ...], ...]  # static leaf values, per argument
    num_positional: int
    kwarg_names: tuple[str, ...]
    split_count: int


def _as_tensor(value: Any, where: str) -> Any:
    if isinstance(value, tf.Tensor | tf.RaggedTensor):
        return value
    if isinstance(value, tf.Variable):
        return tf.convert_to_tensor(value)
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype == object:
            raise ArgumentError(f"{where} is a NumPy array of Python objects; use a numeric dtype")
        return tf.convert_to_tensor(value)
    if isinstance(value, tf.SparseTensor):
        return value  # Broadcast whole; refused as a split argument.
    return None


def _type_spec(t: Any, split: bool) -> tf.TypeSpec:
    shape = t.shape
    if split:
        shape = tf.TensorShape([None]).concatenate(shape[1:])
    if isinstance(t, tf.RaggedTensor):
        return tf.RaggedTensorSpec(
            shape, t.dtype, ragged_rank=t.ragged_rank, row_splits_dtype=t.row_splits.dtype
        )
    if isinstance(t, tf.SparseTensor):
        return tf.SparseTensorSpec(shape, t.dtype)
    return tf.TensorSpec(shape, t.dtype)


def _spec_key(t: Any, split: bool) -> Hashable:
    """What a trace depends on of `t`: `_type_spec`, cheaper for a dense tensor.

    Building a TensorSpec costs ~6 us, a third of a call's Python work; a
    dense tensor's dtype and shape say the same.
    """
    if isinstance(t, tf.Tensor) and t.shape.rank is not None:
        dims = tuple(t.shape)
        return (t.dtype, dims[1:] if split else dims)
    return _type_spec(t, split)


def _rows(t: Any) -> tf.Tensor:
    return t.nrows() if isinstance(t, tf.RaggedTensor) else tf.shape(t, out_type=tf.int64)[0]


def _split(t: Any, sizes: tf.Tensor, count: int) -> list[Any]:
    # [N, ...] -> count x [n_k, ...]
    if isinstance(t, tf.RaggedTensor):
        ends = tf.cumsum(tf.cast(sizes, t.row_splits.dtype))
        starts = ends - tf.cast(sizes, t.row_splits.dtype)
        return [t[starts[k] : ends[k]] for k in range(count)]
    return tf.split(t, sizes, num=count, axis=0)


def _retype_error(error: tf.errors.OpError, message: str) -> tf.errors.OpError:
    """`error` with a new message, as a ShardError that is still its TF type."""
    cls = type(error) if isinstance(error, ShardError) else _SHARD_ERROR_TYPES.get(type(error))
    if cls is None:
        cls = type(f"Shard{type(error).__name__}", (ShardError, type(error)), {})
        _SHARD_ERROR_TYPES[type(error)] = cls
    return cls(error.node_def, error.op, message)


_SHARD_ERROR_TYPES: dict[type, type] = {}


# --------------------------------------------------------- the decorated fn


class ShardedFunction:
    """A function that splits its batch across devices; made by `parallelize`.

    Attributes:
      devices: the canonical device names, one shard each, in shard order.
      trace_count: how many graphs have been traced (one per distinct argument
        signature; the batch size is not part of it).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        devices: Sequence[pinning.DeviceSpecLike] | None,
        weights: Sequence[float] | None,
        per_sample: bool,
        reduce: str | None,
        output_device: pinning.DeviceSpecLike | None,
        broadcast: Sequence[str | int],
        ragged: bool,
        jit_compile: bool,
        allow_duplicate_devices: bool,
    ) -> None:
        if not callable(fn):
            raise ArgumentError(f"parallelize(fn={fn!r}): fn must be callable")
        if reduce is not None and reduce not in collect.REDUCTIONS:
            raise ArgumentError(
                f"reduce={reduce!r}: choose one of {', '.join(map(repr, collect.REDUCTIONS))} "
                "or None (gather the outputs in order)"
            )
        if ragged and reduce is not None:
            raise ArgumentError(
                f"ragged=True with reduce={reduce!r}: ragged outputs have no common shape "
                "to reduce; drop one of them"
            )
        if ragged and not per_sample:
            raise ArgumentError(
                "ragged=True needs per_sample=True: with per_sample=False the function "
                "returns its shard's rows itself (return a tf.RaggedTensor to get one)"
            )
        if devices is not None:
            if isinstance(devices, str | int) or not isinstance(devices, Sequence):
                devices = [devices]
            devices = tuple(devices)
            if not devices:
                raise ArgumentError(
                    "devices=[]: give at least one device, or devices=None for every "
                    "GPU (else every CPU device)"
                )
        self._weights = _integer_weights(weights)
        if devices is not None and self._weights is not None and len(devices) != len(self._weights):
            raise ArgumentError(
                f"weights has {len(self._weights)} entries but devices has {len(devices)}; "
                "give one weight per device"
            )
        if isinstance(broadcast, str | int):
            broadcast = (broadcast,)
        self._broadcast = frozenset(broadcast)
        self._fn = fn
        self._params = self._parameters(fn)
        self._positional = tuple(
            p.name
            for p in (self._params.parameters.values() if self._params else ())
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
        self._check_broadcast_names()
        # A position also names its parameter, so passing it by keyword still broadcasts.
        self._broadcast |= {
            self._positional[b]
            for b in self._broadcast
            if isinstance(b, int) and b < len(self._positional)
        }
        self._device_specs = devices
        self._output_spec = output_device
        self._per_sample = bool(per_sample)
        self._reduce = reduce
        self._reduce_asked = reduce  # what the user wrote; a twin may reduce otherwise
        self._ragged = bool(ragged)
        self._jit_compile = bool(jit_compile)
        self._allow_duplicates = bool(allow_duplicate_devices)
        self._placement: tuple[tuple[str, ...], str] | None = None
        self._graphs: dict[Hashable, Any] = {}
        self._bindable: set[tuple[int, tuple[str, ...]]] = set()
        self._loops: dict[Hashable, Any] = {}  # traced loops over datasets (tfshard.datasets)
        self._twins: dict[str | None, ShardedFunction] = {}
        self._bound: weakref.WeakKeyDictionary[Any, ShardedFunction] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._converted: Callable[..., Any] | None = None
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        functools.update_wrapper(self, fn)

    # -------------------------------------------------------------- public

    @property
    def devices(self) -> tuple[str, ...]:
        """The canonical names of the devices, one shard each, in order."""
        return self._resolve()[0]

    @property
    def output_device(self) -> str:
        """Where results land: `output_device`, else the first device."""
        return self._resolve()[1]

    @property
    def trace_count(self) -> int:
        """How many graphs have been traced so far (loops over datasets included)."""
        twins = sum(twin.trace_count for twin in self._twins.values())
        return len(self._graphs) + len(self._loops) + twins

    def plan(self, n: int) -> list[int]:
        """The shard sizes for a batch of `n` rows, one per device, summing to `n`.

        >>> f = tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1", "cpu:2"])
        >>> f.plan(8)
        [3, 3, 2]
        >>> tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1"], weights=[3, 1]).plan(10)
        [8, 2]
        """
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise ArgumentError(f"plan(n={n!r}): n is a number of rows, an int >= 0")
        if n >= 2**31:
            raise ArgumentError(f"plan(n={n}): batches of 2**31 rows or more are not supported")
        sizes = _plan_sizes(tf.constant(int(n), tf.int64), len(self.devices), self._weights)
        return [int(s) for s in sizes.numpy()]

    def explain(self, *args: Any, **kwargs: Any) -> str:
        """A readable plan for a call with these arguments: which rows go where.

        Args:
          *args: the arguments you would call the function with.
          **kwargs: likewise.

        Returns:
          A table with one line per shard: device, slice of the input, size,
          and where the output lands.

        >>> f = tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1"])
        >>> print(f.explain(np.zeros([5, 3])))
        identity: 5 rows on 2 devices, per sample, gathered on /device:CPU:0
          shard  device         rows    size  output
          0      /device:CPU:0  [0:3)      3  /device:CPU:0
          1      /device:CPU:1  [3:5)      2  -> /device:CPU:0
        """
        call = self._classify(args, kwargs)
        if call.rows is None:
            raise ArgumentError("explain() needs arguments whose row count is known")
        sizes = self.plan(call.rows)
        devices, output = self._resolve()
        how = "per sample" if self._per_sample else "per shard"
        result = f"reduced with {self._reduce!r}" if self._reduce else "gathered"
        lines = [
            f"{self.__name__}: {call.rows} rows on {len(devices)} devices, {how}, "
            f"{result} on {output}"
        ]
        rows_cells, start = [], 0
        for size in sizes:
            rows_cells.append(f"[{start}:{start + size})")
            start += size
        width = max(len(d) for d in devices)
        rows_width = max(len("rows"), *(len(r) for r in rows_cells))
        size_width = max(len("size"), *(len(str(n)) for n in sizes))
        remote = [pinning.is_remote(d) for d in devices]
        lines.append(
            f"  {'shard':<5}  {'device':<{width}}  {'rows':<{rows_width}}  "
            f"{'size':>{size_width}}  output"
        )
        for k, (device, size) in enumerate(zip(devices, sizes)):
            lands = output if device == output else f"-> {output}"
            if remote[k] or pinning.is_remote(output):
                # Rows go out to the shard and results come back, once per call.
                lands += f"  (network: {pinning.host_of(device) or pinning.host_of(output)})"
            lines.append(
                f"  {k:<5}  {device:<{width}}  {rows_cells[k]:<{rows_width}}  "
                f"{size:>{size_width}}  {lands}"
            )
        crossing = sum(
            r or (d != output and pinning.is_remote(output)) for r, d in zip(remote, devices)
        )
        if crossing:
            lines.append(
                f"  {crossing} of {len(devices)} shards cross the network: each call sends "
                "each its rows and every broadcast argument, and its result comes back to "
                f"{output}"
            )
        return "\n".join(line.rstrip() for line in lines)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the function on the batch, split across the devices.

        A `tf.data.Dataset` as the first argument streams every element (one
        global batch each) through the function and concatenates (or reduces)
        the results; the keywords ``batch_size``, ``batched`` and ``progress``
        then belong to tfshard, as in `iterate`.
        """
        if args and isinstance(args[0], tf.data.Dataset):
            options = {k: kwargs.pop(k) for k in datasets.DATASET_OPTIONS if k in kwargs}
            return datasets.run(self, args[0], args[1:], kwargs, **options)
        call = self._classify(args, kwargs)
        graph = self._graphs.get(call.key)
        if graph is None:
            graph = self._trace(call)
        try:
            # The call op's device is where TF leaves the function's outputs.
            with tf.device(self._placement[1]):
                return graph(*call.tensors)
        except tf.errors.OpError as error:
            raise self._call_error(error, call) from None

    def iterate(
        self,
        dataset: tf.data.Dataset,
        *args: Any,
        batch_size: int | None = None,
        batched: bool | None = None,
        progress: bool | Any = False,
        **kwargs: Any,
    ) -> Iterator[Any]:
        """Streams a dataset through the function, yielding one result per global batch.

        For datasets too large to hold, or infinite ones. Each element is a
        global batch split across the devices like a tensor (the last, smaller
        batch included); a tuple element is spread over the positional
        parameters, as `tf.data.Dataset.map` does. The next batch is prepared
        by tf.data while the current one runs.

        Args:
          dataset: batches, or single samples with `batch_size`.
          *args: further arguments, passed with every batch (name them in
            `broadcast` if they are tensors).
          batch_size: batch a dataset of single samples into global batches of
            this many (the last may be smaller).
          batched: True when elements are batches whose size the element spec
            states (``batch(n, drop_remainder=True)``); None to tell by the
            element spec.
          progress: True to print a progress line with samples/s to stderr
            (or a stream to print it to).
          **kwargs: further keyword arguments, passed with every batch.

        Yields:
          The function's result for each batch, in order.

        Raises:
          ArgumentError: `dataset` is not a dataset, has no batch dimension,
            its elements do not fit the function, or a batch changes the
            per-sample shapes.

        >>> f = tfshard.parallelize(lambda s: s * 10, devices=["cpu:0", "cpu:1"])
        >>> ds = tf.data.Dataset.range(5)
        >>> [r.numpy().tolist() for r in f.iterate(ds, batch_size=2)]
        [[0, 10], [20, 30], [40]]
        """
        if not isinstance(dataset, tf.data.Dataset):
            raise ArgumentError(
                f"{self.__name__}.iterate() takes a tf.data.Dataset, got "
                f"{type(dataset).__name__}; call {self.__name__}(x) for tensors and arrays"
            )
        for result, _ in datasets.iterate(
            self, dataset, args, kwargs, batch_size=batch_size, batched=batched, progress=progress
        ):
            yield result

    def _with_reduce(self, reduce: str | None) -> ShardedFunction:
        """This function with another reduction (cached: it traces its own graph)."""
        twin = self._twins.get(reduce)
        if twin is None:
            twin = self._with(reduce=reduce)
            twin._reduce_asked = self._reduce_asked
            self._twins[reduce] = twin
        return twin

    def _with(self, **changes: Any) -> ShardedFunction:
        """A new ShardedFunction with these options changed (it traces its own graphs)."""
        options = dict(
            fn=self._fn,
            devices=self._device_specs,
            weights=self._weights,
            per_sample=self._per_sample,
            reduce=self._reduce,
            output_device=self._output_spec,
            # Positions would shift in a bound method: names only there.
            broadcast=tuple(
                b for b in self._broadcast if "fn" not in changes or isinstance(b, str)
            ),
            ragged=self._ragged,
            jit_compile=self._jit_compile,
            allow_duplicate_devices=self._allow_duplicates,
        )
        options.update(changes)
        return ShardedFunction(options.pop("fn"), **options)

    def __repr__(self) -> str:
        return f"<tfshard.ShardedFunction {self.__name__} on {self._device_specs or 'all devices'}>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # Decorating a method: one ShardedFunction per instance, as tf.function
        # does, holding the instance weakly so the cache does not keep it alive.
        if instance is None:
            return self
        bound = self._bound.get(instance)
        if bound is None:
            bound = self._with(fn=types.MethodType(self._fn, weakref.proxy(instance)))
            self._bound[instance] = bound
        return bound

    # ------------------------------------------------------------ devices

    def _resolve(self) -> tuple[tuple[str, ...], str]:
        placement = self._placement
        if placement is not None:
            return placement
        if self._device_specs is None:
            devices = tuple(pinning.list_devices("GPU") or pinning.list_devices("CPU"))
        else:
            devices = tuple(pinning.resolve_device(d) for d in self._device_specs)
        if not self._allow_duplicates and len(set(devices)) != len(devices):
            seen: dict[str, int] = {}
            for i, name in enumerate(devices):
                if name in seen:
                    raise ArgumentError(
                        f"devices[{seen[name]}]={self._device_specs[seen[name]]!r} and "
                        f"devices[{i}]={self._device_specs[i]!r} are both {name}; two shards "
                        "on one device run one after the other. Remove one, or pass "
                        "allow_duplicate_devices=True if that is what you want (e.g. a "
                        "context map that aliases two names to one card)"
                    )
                seen[name] = i
        if self._weights is not None and len(self._weights) != len(devices):
            raise ArgumentError(
                f"weights has {len(self._weights)} entries but there are {len(devices)} "
                f"devices ({', '.join(devices)}); give one weight per device"
            )
        output = pinning.resolve_device(self._output_spec) if self._output_spec else devices[0]
        self._placement = (devices, output)
        return self._placement

    # ---------------------------------------------------------- arguments

    @staticmethod
    def _parameters(fn: Callable[..., Any]) -> inspect.Signature | None:
        try:
            return inspect.signature(fn)
        except (TypeError, ValueError):
            return None

    def _check_broadcast_names(self) -> None:
        params = self._params.parameters if self._params else None
        if params is None:
            return
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for name in self._broadcast:
            if isinstance(name, int) and not isinstance(name, bool):
                var_pos = any(p.kind is p.VAR_POSITIONAL for p in params.values())
                if name < 0 or (name >= len(self._positional) and not var_pos):
                    raise ArgumentError(
                        f"broadcast={name!r}: a position must be 0..{len(self._positional) - 1} "
                        f"(the parameters of {getattr(self._fn, '__name__', 'fn')}: "
                        f"{', '.join(params) or 'none'})"
                    )
                continue
            if not isinstance(name, str):
                raise ArgumentError(
                    f"broadcast entry {name!r}: name an argument (str) or position (int)"
                )
            if name not in params and not var_kw:
                raise ArgumentError(
                    f"broadcast names {name!r}, but {getattr(self._fn, '__name__', 'fn')} has "
                    f"no such parameter (it has {', '.join(params) or 'none'})"
                )

    def _arg_name(self, position: int) -> str:
        if position < len(self._positional):
            return self._positional[position]
        return f"args[{position}]"

    def _classify(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        """Sorts the arguments' leaves into split, broadcast and static."""
        kwarg_names = tuple(sorted(kwargs))
        # Whether arguments bind depends only on how many and which names: checked once.
        arity = (len(args), kwarg_names)
        if self._params is not None and arity not in self._bindable:
            try:
                self._params.bind(*args, **kwargs)
            except TypeError as error:
                raise ArgumentError(f"{self.__name__}(...): {error}") from None
            self._bindable.add(arity)
        names = [self._arg_name(i) for i in range(len(args))]
        names.extend(kwarg_names)
        values = list(args) + [kwargs[k] for k in kwarg_names]
        keys, kinds, statics, key_specs = [], [], [], []
        split: list[Any] = []
        shared: list[Any] = []
        rows: int | None = None
        rows_from = ""
        for position, (name, value) in enumerate(zip(names, values)):
            leaves: list[Any] = []
            key = _walk(value, leaves)
            keys.append(key)
            is_broadcast = name in self._broadcast or (
                position < len(args) and position in self._broadcast
            )
            leaf_kinds, leaf_statics = [], []
            for i, leaf in enumerate(leaves):
                tensor = _as_tensor(leaf, name)
                if isinstance(leaf, tf.data.Dataset):
                    raise ArgumentError(
                        f"{_path(name, key, i)} is a tf.data.Dataset; pass a dataset as the "
                        f"first positional argument, {self.__name__}(dataset, ...)"
                    )
                if tensor is None:
                    if not isinstance(leaf, Hashable) or isinstance(leaf, tf.SparseTensor):
                        raise ArgumentError(
                            f"{_path(name, key, i)} is a {type(leaf).__name__}, which is "
                            "neither a tensor nor a hashable constant; pass a tensor or "
                            "array, or a hashable value"
                        )
                    leaf_kinds.append("static")
                    leaf_statics.append(leaf)
                    key_specs.append(("static", type(leaf), leaf))
                    continue
                if is_broadcast:
                    leaf_kinds.append("broadcast")
                    shared.append(tensor)
                    key_specs.append(("broadcast", _spec_key(tensor, False)))
                    continue
                if isinstance(tensor, tf.SparseTensor):
                    where = _path(name, key, i)
                    raise ArgumentError(
                        f"{where} is a tf.SparseTensor, which tfshard cannot split; pass "
                        f"tf.sparse.to_dense({where}), or name {name!r} in broadcast=(...) "
                        "to give every shard all of it"
                    )
                if tensor.shape.rank == 0:
                    where = _path(name, key, i)
                    raise ArgumentError(
                        f"{where} is a scalar (rank 0), so it has no rows to split; "
                        f"pass it in broadcast=({name!r},) to give every shard the same "
                        "value, or as a Python number"
                    )
                n = tensor.shape[0]
                if n is not None:
                    if rows is None:
                        rows, rows_from = n, _path(name, key, i)
                    elif n != rows:
                        where = _path(name, key, i)
                        raise ArgumentError(
                            f"{where} has {n} rows but {rows_from} has {rows}; every split "
                            "argument needs the same leading dimension (pass "
                            f"{name!r} in broadcast=({name!r},) to copy it whole to each "
                            "device)"
                        )
                leaf_kinds.append("split")
                split.append(tensor)
                key_specs.append(("split", _spec_key(tensor, True), _device_of(tensor)))
            kinds.append(tuple(leaf_kinds))
            statics.append(tuple(leaf_statics))
        if not split:
            raise ArgumentError(
                f"{self.__name__}() got no tensor or array to split across devices; pass "
                "a tf.Tensor or NumPy array with a batch dimension (Python lists are "
                "structures of constants: use np.asarray(...)), or a tf.data.Dataset"
            )
        template = _Template(
            tuple(names),
            tuple(keys),
            tuple(kinds),
            tuple(statics),
            len(args),
            kwarg_names,
            len(split),
        )
        try:
            key = (tuple(keys), kwarg_names, len(args), tuple(key_specs))
            hash(key)
        except TypeError:
            raise ArgumentError(
                f"{self.__name__}(): a constant argument is not hashable; pass tensors or "
                "hashable values"
            ) from None
        return _Call(key, split + shared, rows, template)

    def _rebuild(
        self, template: _Template, split: Sequence[Any], shared: Sequence[Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        split_it, shared_it = iter(split), iter(shared)
        built = []
        for key, kinds, statics in zip(template.keys, template.kinds, template.statics):
            static_it = iter(statics)
            leaves = [
                next(split_it)
                if kind == "split"
                else next(shared_it)
                if kind == "broadcast"
                else next(static_it)
                for kind in kinds
            ]
            built.append(_build(key, iter(leaves)))
        args = built[: template.num_positional]
        kwargs = dict(zip(template.kwarg_names, built[template.num_positional :]))
        return args, kwargs

    # -------------------------------------------------------------- trace

    def _user_fn(self) -> Callable[..., Any]:
        """The function with autograph applied, as `tf.function` would apply it."""
        if self._converted is None:
            fn = self._fn
            # A bound method converts as its function, then binds again.
            bound_to = fn.__self__ if isinstance(fn, types.MethodType) else None
            plain = fn.__func__ if bound_to is not None else fn
            if not hasattr(plain, "get_concrete_function"):
                # Not convertible: call it as written.
                with contextlib.suppress(Exception):
                    plain = tf.autograph.to_graph(plain)
            self._converted = plain if bound_to is None else types.MethodType(plain, bound_to)
        return self._converted

    def _trace(self, call: _Call) -> Any:
        with self._lock:
            graph = self._graphs.get(call.key)
            if graph is not None:
                return graph
            devices, output = self._resolve()
            template = call.template
            specs = [_type_spec(t, i < template.split_count) for i, t in enumerate(call.tensors)]
            split_devices = [spec[2] for spec in call.key[3] if spec[0] == "split"]

            def body(*tensors: Any) -> Any:
                return self._graph(template, tensors, split_devices, devices, output)

            graph = tf.function(body, autograph=False).get_concrete_function(*specs)
            self._graphs[call.key] = graph
            return graph

    def _graph(
        self,
        template: _Template,
        tensors: Sequence[Any],
        split_devices: Sequence[str],
        devices: tuple[str, ...],
        output: str,
        gather: bool = True,
    ) -> Any:
        """The traced body: split, one shard per device, then collect.

        With `gather` False, the shards' outputs are returned as they are, one
        structure per shard (checked alike), for a caller that collects them
        itself (the dataset loop, which gathers every batch's shards at once).
        """
        count = len(devices)
        split, shared = tensors[: template.split_count], tensors[template.split_count :]
        total = _rows(split[0])
        sizes = _plan_sizes(total, count, self._weights)
        pieces = []
        for tensor, device in zip(split, split_devices):
            # Split where the input lives, so each shard crosses to its device once.
            with tf.device(device or None):
                pieces.append(_split(tensor, sizes, count))
        shard = self._shard_fn(template, shared, [p[0] for p in pieces])
        outputs = []
        for k, device in enumerate(devices):
            with tf.name_scope(f"{_SHARD_SCOPE}{k}"), tf.device(device):
                outputs.append(shard([p[k] for p in pieces]))
        if not gather:
            self._check_outputs(outputs, devices)
            return outputs
        with tf.name_scope("tfshard_collect"), tf.device(output):
            return self._collect(outputs, sizes, total, devices)

    def _shard_fn(
        self, template: _Template, shared: Sequence[Any], example: Sequence[Any]
    ) -> Callable[[Sequence[Any]], Any]:
        """The computation of one shard: rows in, structure of outputs out."""
        fn = self._user_fn()

        def call(rows: Sequence[Any]) -> Any:
            args, kwargs = self._rebuild(template, rows, shared)
            try:
                outputs = fn(*args, **kwargs)
            except TfshardError:
                raise
            except (ValueError, TypeError) as error:
                what = "one sample" if self._per_sample else "one shard"
                shapes = ", ".join(str(r.shape) for r in rows)
                raise ArgumentError(
                    f"{self.__name__} failed while being traced on {what} (split "
                    f"argument shapes {shapes}): {type(error).__name__}: {error}\nIf it "
                    "expects a whole batch, pass per_sample=False; if an argument must "
                    "reach every shard whole, name it in broadcast=(...)"
                ) from error
            return _to_tensors(outputs, self.__name__)

        if self._per_sample:
            signature = self._sample_signature(call, example)
            # Rows of different lengths in or out: vectorize cannot stack them.
            ragged = (
                self._ragged
                or any(isinstance(t, tf.RaggedTensor) for t in example)
                or any(isinstance(s, tf.RaggedTensorSpec) for s in tf.nest.flatten(signature))
            )

            def each(rows: Sequence[Any]) -> Any:
                if ragged:
                    return tf.map_fn(
                        call, tuple(rows), fn_output_signature=signature, name="per_sample"
                    )
                return tf.vectorized_map(call, tuple(rows), fallback_to_while_loop=True)

            # A shard with no rows must give empty outputs of the signature's shapes,
            # but map_fn over nothing loses a ragged output's inner shape, and
            # vectorized_map's while-loop fallback cannot stack nothing of unknown
            # shape. Only those need the guard (a cond costs a few percent here).
            guarded = ragged or any(spec.shape.rank is None for spec in tf.nest.flatten(signature))

            def per_shard(rows: Sequence[Any]) -> Any:
                if not guarded:
                    return each(rows)
                return tf.cond(
                    _rows(rows[0]) > 0, lambda: each(rows), lambda: collect.empty(signature)
                )

        else:

            def per_shard(rows: Sequence[Any]) -> Any:
                return call(rows)

        if self._jit_compile:
            return tf.function(per_shard, autograph=False, jit_compile=True)
        return per_shard

    def _sample_signature(self, call: Callable[..., Any], example: Sequence[Any]) -> Any:
        """Output specs of the function on one sample; ragged where shapes vary."""
        specs = tuple(_element_spec(t) for t in example)
        probe = tf.function(lambda *rows: call(rows), autograph=False)
        outputs = probe.get_concrete_function(*specs).structured_outputs

        def to_spec(value: Any, path: str) -> tf.TypeSpec:
            if isinstance(value, tf.RaggedTensor):
                return tf.RaggedTensorSpec(value.shape, value.dtype, value.ragged_rank)
            if value.shape.rank is None:
                # Nothing to stack ragged by (e.g. a py_function): assume one shape.
                if self._ragged:
                    raise ArgumentError(
                        f"{path} has unknown rank, so ragged=True cannot stack it; give it "
                        "a shape in the function (tf.ensure_shape(value, [None]))"
                    )
                return tf.TensorSpec(value.shape, value.dtype)
            if self._ragged or not value.shape.is_fully_defined():
                # Per-sample shapes that can vary are stacked as a ragged tensor.
                return tf.RaggedTensorSpec(value.shape, value.dtype, ragged_rank=0)
            return tf.TensorSpec(value.shape, value.dtype)

        leaves: list[Any] = []
        key = _walk(outputs, leaves)
        specs = [to_spec(leaf, _path("outputs", key, i)) for i, leaf in enumerate(leaves)]
        return _build(key, iter(specs))

    def _collect(
        self, outputs: list[Any], sizes: tf.Tensor, total: tf.Tensor, devices: tuple[str, ...]
    ) -> Any:
        reference, flat = self._check_outputs(outputs, devices)
        results = []
        for i in range(len(flat[0])):
            path = _path("outputs", reference, i)
            per_shard = [leaves[i] for leaves in flat]
            if self._reduce is not None:
                collect.check_reducible(per_shard[0], self._reduce_asked, path)
                partials = []
                for k, device in enumerate(devices):
                    # Each shard reduces its own rows where they are.
                    with tf.device(device):
                        partials.append(
                            collect.shard_partial(
                                per_shard[k], sizes[k], self._reduce, self._per_sample
                            )
                        )
                results.append(collect.combine(partials, total, self._reduce))
                continue
            results.append(collect.gather(per_shard))
        return _build(reference, iter(results))

    def _check_outputs(
        self, outputs: list[Any], devices: tuple[str, ...]
    ) -> tuple[Hashable, list[list[Any]]]:
        """Checks that every shard returned the same structure, ranks and dtypes.

        Returns:
          The structure key and each shard's flat output leaves.
        """
        reference_leaves: list[Any] = []
        reference = _walk(outputs[0], reference_leaves)
        flat = [reference_leaves]
        for k, result in enumerate(outputs[1:], start=1):
            leaves: list[Any] = []
            structure = _walk(result, leaves)
            if structure != reference:
                ours = _paths("outputs", structure)
                theirs = _paths("outputs", reference)
                only = [p for p in ours if p not in theirs] or [p for p in theirs if p not in ours]
                differ = only[0] if only else "outputs"
                raise ArgumentError(
                    f"{differ} differs between shards: on {devices[k]} the function returned "
                    f"{', '.join(ours)} but on {devices[0]} {', '.join(theirs)}; every shard "
                    "must return the same structure"
                )
            for i, (leaf, first) in enumerate(zip(leaves, reference_leaves)):
                if leaf.shape.rank != first.shape.rank or leaf.dtype != first.dtype:
                    path = _path("outputs", reference, i)
                    raise ArgumentError(
                        f"{path} has rank {leaf.shape.rank} ({leaf.dtype.name}) on {devices[k]} "
                        f"but rank {first.shape.rank} ({first.dtype.name}) on {devices[0]}; "
                        "every shard must return the same ranks and dtypes"
                    )
            flat.append(leaves)
        if self._reduce is None:
            for i, leaf in enumerate(reference_leaves):
                if leaf.shape.rank == 0:
                    raise ArgumentError(
                        f"{_path('outputs', reference, i)} is a scalar per shard; with "
                        "per_sample=False outputs are concatenated along axis 0, so return a "
                        "[rows, ...] tensor, or pass reduce='sum'/'mean'/'max'/'min' to "
                        "combine the shards' values"
                    )
        return reference, flat

    # ------------------------------------------------------------- errors

    def _call_error(self, error: tf.errors.OpError, call: _Call) -> tf.errors.OpError:
        """A failed call's error, naming the shard and, for a dead worker, the remedy."""
        wrapped = self._shard_error(error, call)
        hint = pinning.explain_remote_error(error)  # None unless a worker is down
        if hint is not None:
            wrapped = _retype_error(wrapped, f"{wrapped.message}\n{hint}")
        return wrapped

    def _shard_error(self, error: tf.errors.OpError, call: _Call) -> tf.errors.OpError:
        match = _SHARD_NODE_RE.search(error.message)
        if match is None:
            return error
        k = int(match.group(1))
        devices = self.devices
        if call.rows is not None:
            sizes = self.plan(call.rows)
            start = sum(sizes[:k])
            where = f"rows [{start}:{start + sizes[k]}) of {call.rows}"
        else:
            where = "its slice of the batch"
        return _retype_error(
            error,
            f"{self.__name__}: shard {k} on {devices[k]} ({where}) failed: {error.message}",
        )


def _device_of(t: Any) -> str:
    """Where an eager tensor lives; "" inside a graph, where it is not known yet."""
    if not tf.executing_eagerly():
        return ""
    return (t.flat_values if isinstance(t, tf.RaggedTensor) else t).device


def _element_spec(t: Any) -> tf.TypeSpec:
    """The spec of one row of `t`."""
    if not isinstance(t, tf.RaggedTensor):
        return tf.TensorSpec(t.shape[1:], t.dtype)
    if t.ragged_rank == 1:  # A row of [N, (r), ...] is a dense [r, ...].
        return tf.TensorSpec(tf.TensorShape([None]).concatenate(t.shape[2:]), t.dtype)
    return tf.RaggedTensorSpec(
        t.shape[1:], t.dtype, t.ragged_rank - 1, row_splits_dtype=t.row_splits.dtype
    )


def _to_tensors(outputs: Any, where: str) -> Any:
    """The function's outputs with numbers and arrays made tensors; else an error."""
    leaves: list[Any] = []
    key = _walk(outputs, leaves)
    converted = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, tf.Tensor | tf.RaggedTensor):
            converted.append(leaf)
        elif isinstance(leaf, int | float | np.ndarray | np.generic) and not isinstance(leaf, bool):
            converted.append(tf.convert_to_tensor(leaf))
        else:
            hint = " (did the function forget to return?)" if leaf is None else ""
            raise ArgumentError(
                f"{where}: {_path('outputs', key, i)} is {type(leaf).__name__} {leaf!r}{hint}; "
                "a parallelized function must return tensors (or a tuple, list, dict or "
                "namedtuple of them)"
            )
    return _build(key, iter(converted))


def parallelize(
    fn: Callable[..., Any] | None = None,
    *,
    devices: Sequence[pinning.DeviceSpecLike] | None = None,
    weights: Sequence[float] | None = None,
    per_sample: bool = True,
    reduce: str | None = None,
    output_device: pinning.DeviceSpecLike | None = None,
    broadcast: Sequence[str | int] = (),
    ragged: bool = False,
    jit_compile: bool = False,
    allow_duplicate_devices: bool = False,
) -> Any:
    """Runs a function on every device at once, splitting its batch between them.

    Usable bare (``@parallelize``) or with arguments (``@parallelize(devices=...)``).

    Every tensor-like argument (tensor, NumPy array, variable, ragged tensor,
    nested in tuples, lists, dicts or namedtuples) is split along axis 0; all of
    them must have the same number of rows N. Arguments named in `broadcast` go
    whole to every shard. Python numbers, strings, None and other hashable
    objects are constants of the trace: a new value traces a new graph.

    Shard sizes come from ``tf.shape(x)[0]`` inside the graph, so one trace
    serves every batch size (see `ShardedFunction.trace_count`). N may be smaller
    than the number of devices, even 0: empty shards give empty outputs.

    Devices are resolved (`tfshard.resolve_device`) on first use, so the
    decorator can run before `tfshard.virtual_devices`; the active context map
    at that moment decides what context names mean.

    Args:
      fn: with `per_sample`, a function of one sample (one row of each split
        argument); otherwise a function of one shard (a block of rows).
      devices: where to run, one shard each (anything `resolve_device` takes).
        Default: every GPU, else every logical CPU device.
      weights: relative speeds, one per device; shard sizes follow them with
        largest-remainder rounding (``[3, 1]`` splits 10 rows 8:2). Default: even
        split, sizes differing by at most one, extra rows to the first shards.
      per_sample: True to vectorise `fn` over the rows with `tf.vectorized_map`
        (falling back to a `tf.while_loop` where an op has no vectorised form);
        False to call `fn` on each shard as a batch.
      reduce: None to gather outputs in input order; ``"sum"``, ``"mean"``,
        ``"max"`` or ``"min"`` to reduce them over all samples. Each shard
        reduces on its own device and only the partials travel. With
        `per_sample=False` the function's value for a shard is weighted by the
        shard's size, so a shard-mean loss or gradient reduces to exactly the
        full-batch mean; empty shards are left out.
      output_device: where results land. Default: the first device.
      broadcast: names (or positions) of arguments passed whole to every shard,
        such as weights or a lookup table.
      ragged: True when per-sample outputs differ in shape; the result is then a
        `tf.RaggedTensor` in input order (also chosen by itself when the output
        shape of one sample is not fully known). Uses `tf.map_fn`, which is
        slower than vectorising.
      jit_compile: compile each shard with XLA. Each new shard size compiles
        again (seconds each on first use), so it pays off for repeated calls at
        a few fixed batch sizes; functions with ops XLA cannot compile (strings,
        ragged tensors, most data-dependent shapes) fail on the first call.
      allow_duplicate_devices: let two shards share a device (as when a context
        map aliases two names to one card). Otherwise that is an error.

    Returns:
      A `ShardedFunction`; calling it returns the function's outputs for all
      rows, in input order (or reduced), on `output_device`.

    Raises:
      ArgumentError: bad options, here or at the first call (when devices are
        resolved); bad arguments at a call, before anything runs.
      DeviceError: a device does not exist.
      ShardError: a shard failed while running; the message names its device
        and rows. It is also the TensorFlow error type the shard raised.

    >>> @tfshard.parallelize(devices=["cpu:0", "cpu:1"])
    ... def double(sample):
    ...     return 2.0 * sample
    >>> double(np.arange(5, dtype=np.float32)).numpy()
    array([0., 2., 4., 6., 8.], dtype=float32)
    """
    options = dict(
        devices=devices,
        weights=weights,
        per_sample=per_sample,
        reduce=reduce,
        output_device=output_device,
        broadcast=broadcast,
        ragged=ragged,
        jit_compile=jit_compile,
        allow_duplicate_devices=allow_duplicate_devices,
    )
    if fn is None:
        return functools.partial(parallelize, **options)
    return ShardedFunction(fn, **options)
