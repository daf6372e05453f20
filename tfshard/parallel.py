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

`ShardedFunction` is the object users hold: it checks the options, resolves
the devices on first use, and hands each call to its engine
(`tfshard._engine.Engine`), which owns the traced graphs; arguments are
sorted by `tfshard._arguments`, datasets run through `tfshard.datasets`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from tfshard import _arguments, _autograph, _engine, _explain, _intake, _options, datasets, pinning
from tfshard import replicas as replicas_lib
from tfshard import timeline as timeline_lib
from tfshard import writing as writing_lib
from tfshard._balance import Balance
from tfshard.errors import ArgumentError

__all__ = ("ShardedFunction", "parallelize")

# A user's tf.function converts what it calls with autograph, tfshard's own
# methods too; they are plain Python that traces graphs, so they opt out.
_not_converted = tf.autograph.experimental.do_not_convert
_STREAM_KEYWORDS = frozenset(_intake.DATASET_OPTIONS)


class ShardedFunction:
    """A function that splits its batch across devices; made by `parallelize`.

    It is not a `tf.function`: `tf.saved_model.save` does not export one stored
    on a module. Export a `tf.function` that calls it instead, e.g.
    ``module.serve = tf.function(f, input_signature=[tf.TensorSpec([None, 3])])``.
    """

    def __init__(self, fn: Callable[..., Any], options: _options.Options) -> None:
        name = getattr(fn, "__name__", type(fn).__name__)
        self._parts = _Parts(fn, options, _arguments.Arguments(fn, options.broadcast, name))
        self.__name__ = name
        # Not updated=("__dict__",): the wrapped object's attributes (a Keras layer's
        # _lock, a tf.function's _jit_compile) must not replace ours.
        functools.update_wrapper(self, fn, updated=())

    # -------------------------------------------------------------- public

    @property
    def devices(self) -> tuple[str, ...]:
        """The canonical names of the devices, one shard each, in order."""
        return self._engine().devices

    @property
    def output_device(self) -> str:
        """Where results land: `output_device`, else the first device."""
        return self._engine().output

    @property
    def weights(self) -> tuple[float, ...] | None:
        """The weights the plan uses now: as given, measured, or None for an even split.

        With ``weights="auto"`` they are each device's measured speed, the
        slowest device with rows at 1 (``(2.95, 1.0)``), or None while the split
        stays even: not every device measured yet, or no other split predicted
        5 % and 0.25 ms faster (`explain` says which); pass them as ``weights=`` to plan the
        same way without measuring. Static weights read back as given.

        >>> tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1"], weights=[3, 1]).weights
        (3, 1)
        >>> print(tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1"]).weights)
        None
        """
        return self._engine().weights

    @property
    def balance(self) -> Balance | None:
        """With ``weights="auto"``, the record of measurements that sets `weights`; else None.

        It says where measuring stands (``measured``: measurements counted,
        ``changes`` of plan, ``settled``, ``one_left``: every other device
        weighted 0 for good, ``per_row()``: each device's seconds per row), and
        takes measurements made elsewhere, as a measured call gives them
        (``observe(rows, seconds, warm_up=False, call_seconds=None)``: each
        shard's rows and seconds in one call; ``observe_alone(device, rows,
        seconds, warm_up=False)``: a whole call on one device): the next call
        plans by the weights they give.

        One record per function, fed by every call whatever its arguments'
        shapes and dtypes: ``weights="auto"`` assumes the function's calls cost
        alike per row. For inputs that cost differently per row (another width
        or dtype, a costlier path through the function), parallelize a separate
        function for each.

        Its measurements come from the calls made eagerly, each taking a turn
        (a measured one alone among them). Calls made inside a `tf.function`
        or traced into a `tf.data` map run in that graph and take no turn: a
        measured call beside them is not known to overlap them, and counts
        their work in its seconds.

        >>> f = tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1"], weights="auto")
        >>> for _ in range(3):
        ...     f.balance.observe([4, 4], [0.001, 0.06], warm_up=False)
        >>> f.weights
        (1.0, 0.0)
        """
        return self._engine().balance

    @property
    def trace_count(self) -> int:
        """Graphs traced so far (dataset loops included): one per argument signature, one more
        per sample for exactly the first batch size, one for fewer rows than devices."""
        streams = 0 if self._parts.runner is None else self._parts.runner.trace_count
        return (0 if self._parts.engine is None else self._parts.engine.trace_count) + streams

    @property
    def streams(self) -> datasets.Runner:
        """What runs datasets through the function (`tfshard.datasets.Runner`): its traced
        loops (``loops``, one per element spec and call signature, none where a stream ran
        in the Python loop) and their traces; made at first use."""
        return self._runner()

    @_not_converted
    def plan(self, n: int) -> list[int]:
        """The shard sizes for a batch of `n` rows, one per device, summing to `n`.

        With ``weights="auto"``, the plan of the weights in use now (`weights`),
        within the caps learned from shards that ran out of memory
        (``balance.caps()``): an `ArgumentError` where `n` is more rows than they
        hold together, as a call of `n` rows raises. That is what the next
        unmeasured call runs; a measured call (`balance`) runs what it measures,
        the split by its own weights or the fastest device alone, which may
        differ from it.

        >>> f = tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1", "cpu:2"])
        >>> f.plan(8)
        [3, 3, 2]
        >>> tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1"], weights=[3, 1]).plan(10)
        [8, 2]
        """
        rows = _arguments.integer(n)
        if rows is None or rows < 0:
            raise ArgumentError(f"plan(n={n!r}): n is a number of rows, an int >= 0")
        if rows >= _arguments.MAX_ROWS:
            raise ArgumentError(f"plan(n={n}): batches of 2**31 rows or more are not supported")
        return self._engine().plan(rows)

    @_not_converted
    def explain(self, *args: Any, **kwargs: Any) -> str:
        """A readable plan for a call with these arguments: which rows go where.

        Args:
          *args: the arguments you would call the function with.
          **kwargs: likewise.

        Returns:
          A table with one line per shard: device, slice of the input, size,
          and where the output lands. When the function reads variables, a
          second table gives each shard's count of them and the bytes it reads
          from other devices per call, and the remedy (`replicas`). To see its
          variables, explain traces the call's graph (which the call reuses).
          The plan is `plan`'s: what the next unmeasured call runs (with
          ``weights="auto"`` a measured call runs what it measures, `plan`).

        >>> f = tfshard.parallelize(tf.identity, devices=["cpu:0", "cpu:1"])
        >>> print(f.explain(np.zeros([5, 3])))
        identity: 5 rows on 2 devices, per sample, gathered on /device:CPU:0
          shard  device         rows    size  output
          0      /device:CPU:0  [0:3)      3  /device:CPU:0
          1      /device:CPU:1  [3:5)      2  -> /device:CPU:0
        """
        name = self.__name__
        self._refuse_dataset(
            "explain",
            args,
            f"explain one of its batches, {name}.explain(next(iter(dataset))), or record one "
            f"as it runs with {name}.timeline(dataset)",
        )
        call = self._parts.arguments.classify(args, kwargs)
        if call.rows is None:
            raise ArgumentError("explain() needs arguments whose row count is known")
        engine = self._engine()
        return _explain.table(engine, call, self.plan(call.rows), self.__name__, self._parts.fn)

    def replicas(self) -> contextlib.AbstractContextManager[Any]:
        """A scope in which new variables get one copy on each of this function's devices.

        Each shard then reads the copy on its own device, so no call moves
        weights between devices. The copies belong to the devices, not to this
        function: every parallelized function on the same devices reads them.
        Assignments outside the function (``set_weights``, ``load_weights``,
        `tfshard.replicas.apply_gradients` for an optimizer step) write every
        copy.

        >>> f = tfshard.parallelize(lambda x: x * scale, devices=["cpu:0", "cpu:1"])
        >>> with f.replicas():
        ...     scale = tf.Variable(2.0)
        >>> f(tf.range(4.0)).numpy()
        array([0., 2., 4., 6.], dtype=float32)
        >>> print(f.explain(tf.range(4.0)).splitlines()[-1])
          each call reads 0 B of variables from other devices
        """
        return replicas_lib.Replicas.of(self.devices).scope()

    def replicate(self, model: Any) -> Any:
        """A copy of a built Keras model with one copy of its weights per device.

        For a model that exists already (loaded, or trained on one device):
        ``model = f.replicate(model)`` before the first call. Anything that is
        not a Keras `Sequential` or functional model is built inside
        ``with f.replicas():`` instead.
        """
        return replicas_lib.replicate(model, replicas_lib.Replicas.of(self.devices))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the function on the batch, split across the devices.

        A `tf.data.Dataset` as the first argument streams every element (one
        global batch each) through the function and concatenates (or reduces)
        the results; the keywords ``batch_size``, ``batched`` and ``progress``
        then belong to tfshard, as in `iterate`.
        """
        # Autograph only converts what a tf.function traces, never eagerly (and
        # run_functions_eagerly calls the Python function unconverted): only in a
        # graph does the call need do_not_convert's wrapper, which costs every call.
        if tf.executing_eagerly():
            return self._call(args, kwargs)
        return self._call_unconverted(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args and isinstance(args[0], tf.data.Dataset):
            options = {k: kwargs.pop(k) for k in _intake.DATASET_OPTIONS if k in kwargs}
            return self._runner().run(self._parts.arguments, args[0], args[1:], kwargs, **options)
        if kwargs and not _STREAM_KEYWORDS.isdisjoint(kwargs):
            _intake.refuse_stream_options(self._parts.arguments, kwargs)
        call = self._parts.arguments.classify(args, kwargs)
        return self._engine().call(call)

    _call_unconverted = _not_converted(_call)

    @_not_converted
    def per_shard(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Runs the function on the batch as a call does; each shard's result as it is.

        As MirroredStrategy's ``experimental_local_results``: no gather, no
        reduction (``reduce=`` does not apply), so a shard's value may have any
        shape. The batch is split as a call splits it (`plan`); per sample, a
        shard's result is its rows' outputs, stacked.

        Args:
          *args: as for a call (tensors and arrays; not a dataset).
          **kwargs: likewise.

        Returns:
          A tuple with one result per shard, in device order (`devices`), each
          on its shard's device. Eagerly the call runs a traced graph, and
          TensorFlow returns a function's outputs on the output device: the
          others are copied back to theirs. In a graph (a user's `tf.function`)
          the shards are traced into the caller's graph, so each result stays
          where its shard made it, as a hand-written ``tf.device`` graph's do;
          a function that may break a promise of its devices (writing a
          replicated variable; under XLA, reading a variable on another
          device) is traced once more by itself to be checked. A device the
          weights give no rows is not in the call's graph; its result is what a
          shard without rows returns (no rows per row, zeros of a fixed shape),
          made where results land and copied to it.

        Raises:
          ArgumentError: bad arguments, or a dataset (stream it with `iterate`).

        >>> f = tfshard.parallelize(
        ...     tf.reduce_sum, devices=["cpu:0", "cpu:1"], per_sample=False)
        >>> [s.numpy().tolist() for s in f.per_shard(np.arange(5.0))]
        [3.0, 7.0]
        """
        self._refuse_dataset("per_shard", args, f"stream one with {self.__name__}.iterate(dataset)")
        return self._engine().per_shard(self._parts.arguments.classify(args, kwargs))

    @_not_converted
    def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        """The traced `tf.function` graph a call with these arguments runs, as in `tf.function`.

        Its ``.graph`` shows where each op is placed: ops of shard k are named
        ``tfshard_shard_k/...``, the gather ``tfshard_collect/...``. Where two or
        more shards are off the output device and the host CPU, each of them
        calls one trace they share: it shows one call op on its device
        (``tfshard_shard_k/StatefulPartitionedCall``), whose ops are in
        ``.graph.as_graph_def().library``, placed by the call. With
        ``weights="auto"`` it is the graph of the calls between measured ones:
        the weights in use are its constants, as static weights' graph holds
        them (a measured call runs a twin that times its shards and takes the
        weights fed). A device weighted 0 has no op in it, and a call
        that one device holds every row of is a plain trace of the function there.

        >>> f = tfshard.parallelize(tf.sin, devices=["cpu:0", "cpu:1"])
        >>> graph = f.get_concrete_function(np.zeros([4], np.float32)).graph
        >>> sorted({op.device for op in graph.get_operations() if "shard_1/" in op.name})
        ['/device:CPU:1']
        """
        self._refuse_dataset("get_concrete_function", args)
        return self._engine().trace(self._parts.arguments.classify(args, kwargs))

    @_not_converted
    def get_measured_function(self, *args: Any, **kwargs: Any) -> Any:
        """The traced graph a measured call with these arguments runs (``weights="auto"``).

        It is `get_concrete_function`'s graph with each shard timed: a
        timestamp before and after the shard, each taking that shard's own
        token, so no shard waits for another. It takes the call's tensors, then
        the plan's integer weights (int64, one per device it holds, on the
        host) instead of holding them, and returns ``(outputs, timing)``.

        Returns:
          The concrete function (the split's, also while one device alone
          holds every row and calls in turn still time the split), or None
          where no call is measured: weights other than ``"auto"``, or every
          other device found useless.
        """
        self._refuse_dataset("get_measured_function", args)
        return self._engine().trace(self._parts.arguments.classify(args, kwargs), measured=True)

    @_not_converted
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
        stream = self._runner().iterate(
            self._parts.arguments,
            dataset,
            args,
            kwargs,
            batch_size=batch_size,
            batched=batched,
            progress=progress,
        )
        # Not a generator itself: bad arguments fail here, at the call, not at next().
        return (result for result, _ in stream)

    @_not_converted
    def write(
        self,
        dataset: tf.data.Dataset,
        path: str | os.PathLike,
        *args: Any,
        batch_size: int | None = None,
        batched: bool | None = None,
        progress: bool | Any = False,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> writing_lib.Written:
        """Streams a dataset through the function and writes every output to `path`, in order.

        For results larger than memory, and for long jobs: each global batch's
        outputs go to files as they are computed (one call per batch, as
        `iterate`), so memory holds the batches in flight, not the result.
        `path` is a directory of ``.npy`` files, one per output leaf (a ragged
        leaf: its values and row lengths), and a ``manifest.json``;
        `tfshard.load` reads it back as the outputs' structure, memory-mapped,
        and NumPy reads a finished file without tfshard
        (``np.load(path + "/output.npy", mmap_mode="r")``).

        Calling it again after the process died (Ctrl-C, SIGKILL, a power cut,
        a full disk) resumes after the last batch committed to disk (commits
        come about once a second, `tfshard.writing.COMMIT_SECONDS`): nothing is
        lost, nothing written twice, a batch never half visible, and
        ``tfshard.row_index()`` counts on from the rows on disk. A resume
        assumes the same dataset in the same order and the same function; it
        checks the dataset's element spec, number of batches and first batch,
        the files against the manifest, and computes the last committed batch
        again and compares it with the disk before appending (a finished
        write: its first batch, then it returns) (`tfshard.writing`). Nothing
        on disk changes before the first batch's outputs are computed and
        checked: a function that fails to trace or run, or returns outputs no
        file holds, leaves `path` as it was (a write there whole, also with
        ``overwrite=True``).

        Args:
          dataset: batches, or single samples with `batch_size`; finite.
          path: the directory to write (made at the first batch if missing; a
            new or empty one, or one this method wrote).
          *args: further arguments, passed with every batch, as for `iterate`.
          batch_size: as for `iterate`.
          batched: as for `iterate`.
          progress: True for progress lines on stderr (or a stream to print
            them to); on a log file or pipe a line every 10 s, with the time
            left, and where it stopped on Ctrl-C or an error.
          overwrite: replace what `path` holds instead of resuming it (only the
            files of a write there, never others).
          **kwargs: further keyword arguments, passed with every batch.

        Returns:
          A `tfshard.writing.Written`: ``path``, ``rows`` and ``batches`` on
          disk, and ``computed_rows``, those this call computed.

        Raises:
          ArgumentError: a bad argument (checked before anything is made on
            disk: a dataset as for `iterate`, an infinite one, a `path` that is
            not a non-empty str or PathLike, flags that are not bools,
            `batch_size` on batches), ``reduce=`` set (there are no rows to
            write), outputs that are not dense or ragged numbers, or a `path`
            holding another function's or dataset's write, or one whose batch
            computed again differs (the message names the difference).
          WriteError: a full disk, a file size limit or an unwritable path (what
            was committed stays, and calling again resumes); or files that are
            not what the write left there (damaged, edited by hand).

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "squares")
        >>> f = tfshard.parallelize(lambda s: s * s, devices=["cpu:0", "cpu:1"])
        >>> f.write(tf.data.Dataset.range(5), path, batch_size=2)
        Written(path='...squares', rows=5, batches=3, computed_rows=5)
        >>> tfshard.load(path).tolist()
        [0, 1, 4, 9, 16]
        >>> f.write(tf.data.Dataset.range(5), path, batch_size=2).computed_rows  # finished
        0
        """
        return self._runner().write(
            self._parts.arguments,
            dataset,
            path,
            args,
            kwargs,
            batch_size=batch_size,
            batched=batched,
            progress=progress,
            overwrite=overwrite,
        )

    def __repr__(self) -> str:
        devices = self._parts.options.devices or "all devices"
        return f"<tfshard.ShardedFunction {self.__name__} on {devices}>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # Decorating a method: one engine per instance, as tf.function traces per
        # instance, cached without keeping the instance alive; what the attribute
        # gives is that instance's function holding the instance, as Python's
        # bound methods do, so ``self`` is the instance itself for the whole call.
        if instance is None:
            return self
        if any(isinstance(b, int) for b in self._parts.arguments.broadcast):
            raise ArgumentError(
                f"{self.__name__} is a method decorated with broadcast="
                f"{tuple(self._parts.arguments.broadcast)!r}: a method's positions shift by self, "
                "so name its arguments instead, e.g. broadcast=('weights',)"
            )
        parts = self._parts
        bound = parts.bound.get(instance)
        if bound is None:
            # Names only for methods (checked above): positions would shift by self.
            broadcast = tuple(parts.arguments.broadcast)
            options = dataclasses.replace(parts.options, broadcast=broadcast)
            bound = ShardedFunction(_autograph.WeakMethod(parts.fn, instance), options)
            parts.bound[instance] = bound
        return _BoundMethod(bound, instance)

    def _refuse_dataset(self, method: str, args: tuple[Any, ...], fix: str = "") -> None:
        """ArgumentError where `method`, which takes tensors and arrays, got a dataset first;
        `fix` says what to do instead (by default: pass one of its batches)."""
        if args and isinstance(args[0], tf.data.Dataset):
            fix = fix or f"pass one of its batches, {self.__name__}.{method}(next(iter(dataset)))"
            raise ArgumentError(
                f"{self.__name__}.{method}() takes tensors and arrays, not a tf.data.Dataset; "
                f"{fix}"
            )

    # ------------------------------------------------------------ devices

    def _engine(self) -> _engine.Engine:
        """The engine, made when the devices are first needed (they resolve then)."""
        parts = self._parts
        if parts.engine is None:
            with parts.lock:
                if parts.engine is None:
                    devices, output = parts.options.resolve()
                    # jit_compile=None becomes what the function is (a Keras model's own).
                    options = parts.options.for_function(parts.fn, devices)
                    parts.engine = _engine.Engine(
                        parts.fn, options, name=self.__name__, devices=devices, output=output
                    )
        return parts.engine

    def _runner(self) -> datasets.Runner:
        """What runs datasets through the engine, with its own caches."""
        engine = self._engine()
        parts = self._parts
        if parts.runner is None:
            with parts.lock:
                if parts.runner is None:
                    parts.runner = datasets.Runner(engine)
        return parts.runner

    # ------------------------------------------------------------ timeline

    @_not_converted
    def timeline(
        self,
        *args: Any,
        batch_index: int | None = None,
        batch_size: int | None = None,
        batched: bool | None = None,
        **kwargs: Any,
    ) -> timeline_lib.Timeline:
        """Makes one call with these arguments and returns what ran where and when.

        The record is TensorFlow's own (its profiler's trace of the call; see
        `tfshard.timeline`), so it answers "did my devices run at once, and
        where did the time go?" without TensorBoard. The call is the one
        ``f(x)`` makes, with the inputs and resources where they live, run
        once: what it writes (a variable, a lookup table) it writes, as
        ``f(x)`` would; its results are not returned. Call ``f(x)`` once
        before to record a warm call (a first call's record holds its first
        run's costs).

        Args:
          *args: the arguments you would call the function with; a
            `tf.data.Dataset` first records one of its batches, run as a call.
          batch_index: with a dataset, which batch (None: 0, the first).
          batch_size: with a dataset of single samples, the batch size, as
            for a call on it.
          batched: with a dataset, whether its elements are batches, as for a
            call on it.
          **kwargs: likewise.

        Returns:
          A `tfshard.Timeline`: ``.shards`` (device, rows, start_ms,
          end_ms, busy_ms), ``.parallelism``, ``.copies``, ``.gather``;
          ``print`` it for a table, ``.plot(path)`` for a PNG.

        Raises:
          ArgumentError: a device on another machine, or a dataset with fewer
            batches than `batch_index`.
          TfshardError: TensorFlow's profiler is running already (a trace of
            your own: stop it first).

        >>> f = tfshard.parallelize(tf.sin, devices=["cpu:0", "cpu:1"])
        >>> print(f.timeline(np.zeros([6], np.float32)))  # doctest: +ELLIPSIS
        sin: one call, 6 rows on 2 devices, ... ms; parallelism ...
          shard   device         rows  start ms    end ms   busy ms  |0 ...
          0       /device:CPU:0     3  ...
          1       /device:CPU:1     3  ...
        """
        arguments = self._parts.arguments
        if args and isinstance(args[0], tf.data.Dataset):
            # A NumPy integer is the index it holds; anything else not an int is refused there.
            index = 0 if batch_index is None else _arguments.integer(batch_index)
            index = batch_index if index is None else index
            call = self._runner().one_batch(
                arguments, args[0], args[1:], kwargs, index, batch_size, batched
            )
        else:
            for key, value in (
                ("batch_index", batch_index),
                ("batch_size", batch_size),
                ("batched", batched),
            ):
                if value is not None:
                    raise ArgumentError(
                        f"{self.__name__}.timeline(..., {key}=...): {key}= is for a "
                        "tf.data.Dataset; with tensors the whole argument is one batch"
                    )
            call = arguments.classify(args, kwargs)
        engine = self._engine()
        concrete = engine.trace(call)  # traced before the record starts
        return timeline_lib.record(
            lambda: engine.call(call),
            concrete,
            devices=self.devices,
            rows=None if call.rows is None else engine.plan(call.rows),
            output=engine.output,
            name=self.__name__,
        )


class _BoundMethod(ShardedFunction):
    """A decorated method of one instance: its ShardedFunction, holding the instance.

    Made at each attribute access (`ShardedFunction.__get__`), as Python makes a
    bound method. It shares the `_Parts` of the ShardedFunction cached for the
    instance, which holds the instance only weakly (`_autograph.WeakMethod`);
    this object holds it strongly, so ``Model().apply(x)`` keeps its temporary
    alive through the call (and ``iterate`` through the stream), and a cached
    instance is freed once nothing else holds it.

    Attributes:
      __func__: the instance's ShardedFunction, as on a bound method.
      __self__: the instance, as on a bound method.
    """

    def __init__(self, function: ShardedFunction, instance: Any) -> None:
        # Not ShardedFunction.__init__: the cached function's parts, shared, not copied.
        self._parts = function._parts
        self.__name__ = function.__name__
        functools.update_wrapper(self, function._parts.fn, updated=())
        self.__func__ = function
        self.__self__ = instance

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self  # bound already, as a bound method stays bound

    @_not_converted
    def iterate(self, dataset: tf.data.Dataset, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return _holding(self.__self__, super().iterate(dataset, *args, **kwargs))

    iterate.__doc__ = ShardedFunction.iterate.__doc__

    def __eq__(self, other: object) -> bool:
        # As bound methods compare: the same function of the same instance.
        return (
            isinstance(other, _BoundMethod)
            and other._parts is self._parts
            and other.__self__ is self.__self__
        )

    def __hash__(self) -> int:
        return hash((id(self._parts), id(self.__self__)))

    def __repr__(self) -> str:
        return f"<bound tfshard.ShardedFunction {self.__qualname__} of {self.__self__!r}>"


@dataclasses.dataclass(eq=False)
class _Parts:
    """What one parallelized function is made of, shared with its bound methods.

    `lock` guards making `engine` (when the devices are first needed) and `runner`
    (at the first stream); `bound` is a decorated method's function per instance,
    weakly keyed.
    """

    fn: Callable[..., Any]
    options: _options.Options
    arguments: _arguments.Arguments
    lock: Any = dataclasses.field(default_factory=threading.Lock)
    engine: _engine.Engine | None = None
    runner: datasets.Runner | None = None
    bound: weakref.WeakKeyDictionary[Any, ShardedFunction] = dataclasses.field(
        default_factory=weakref.WeakKeyDictionary
    )


def _holding(instance: Any, items: Iterator[Any]) -> Iterator[Any]:
    """`items`, as a generator whose frame holds `instance` until the stream is done."""
    yield from items


def parallelize(
    fn: Callable[..., Any] | None = None,
    *,
    devices: Sequence[pinning.DeviceSpecLike] | None = None,
    weights: Sequence[float] | str | None = None,
    per_sample: bool | None = None,
    reduce: str | None = None,
    output_device: pinning.DeviceSpecLike | None = None,
    broadcast: Sequence[str | int] = (),
    ragged: bool = False,
    jit_compile: bool | None = None,
    allow_duplicate_devices: bool = False,
    max_rows: int | Sequence[int | None] | None = None,
) -> Any:
    """Runs a function on every device at once, splitting its batch between them.

    Usable bare (``@parallelize``) or with arguments (``@parallelize(devices=...)``).

    Every tensor-like argument (tensor, NumPy array, variable, ragged tensor,
    nested in tuples, lists, dicts or namedtuples) is split along axis 0; all of
    them must have the same number of rows N. Arguments named in `broadcast` go
    whole to every shard. Python numbers, strings, None and other hashable
    objects are constants of the trace: a new value traces a new graph.

    Shard sizes come from ``tf.shape(x)[0]`` inside the graph, so one trace
    serves every batch size that gives each device a row, and one more every
    smaller batch (see `ShardedFunction.trace_count`): N may be smaller than the
    number of devices, even 0, and empty shards give empty outputs. A
    per-sample function's first batch size is traced for exactly its rows
    first (static shapes vectorize faster), as `tf.function` does; the first
    other size traces the graph that serves all sizes.

    Devices are resolved (`tfshard.resolve_device`) on first use, so the
    decorator can run before `tfshard.virtual_devices`; the active context map
    at that moment decides what context names mean.

    Args:
      fn: with `per_sample`, a function of one sample (one row of each split
        argument); otherwise a function of one shard (a block of rows). Any
        callable: a function, a `tf.function`, a `tf.Module`, a Keras layer or
        model (``parallelize(model)``, as ``nn.DataParallel(model)`` in
        PyTorch); its attributes are left alone, and only its name and
        docstring are copied. Python control flow on tensors is converted with
        autograph as `tf.function` converts it: in a function, a method, and
        the ``__call__`` of a callable object or `tf.Module` (a Keras layer
        converts its own ``call``). A `tf.function` is called as its Python
        function (``python_function``, converted with autograph, also where it
        was made with ``autograph=False``) inside tfshard's one trace, so each
        shard's call sees its own
        `shard_index` and `row_index` (its cache would hand every shard the
        first shard's trace); a variable it makes on its first call is made
        once, as the `tf.function` makes it. A method
        decorated in a class traces per instance, as with `tf.function`, in a
        cache that does not keep the instance alive; its ``self`` is the
        instance itself, held for the call (``Model().apply(x)`` works, where
        `tf.function` would give ``self=None``).
      devices: where to run, one shard each (anything `resolve_device` takes).
        Default: every GPU, else every logical CPU device.
      weights: relative speeds, one per device; shard sizes follow them with
        largest-remainder rounding (``[3, 1]`` splits 10 rows 8:2). ``"auto"``:
        measure them on the function itself: each shard of a measured call
        (every call until the plan has held over 9 measurements, then one in
        25; every batch of a stream) is timed in the graph, and each device's
        weight is its speed from the lower quartile of its last 9 times per
        row; the plan starts even and changes only when that is predicted to
        end a call at least 5 % sooner, and a device keeps rows unless it is over
        50x slower per row than the fastest (`ShardedFunction.weights` shows
        them; `tfshard._balance` has the rules). Default: even split, sizes
        differing by at most one, extra rows to the first shards.
      per_sample: True to vectorise `fn` over the rows with `tf.vectorized_map`
        (falling back to a `tf.while_loop` where an op has no vectorised form);
        False to call `fn` on each shard as a batch. Default: False for a Keras
        layer or model, which takes batches; True for anything else.
      reduce: None to gather outputs in input order; ``"sum"``, ``"mean"``,
        ``"max"`` or ``"min"`` to reduce them over all samples. Each shard
        reduces on its own device and only the partials travel, totalled in
        a wider dtype until the end (batch after batch for a dataset):
        float16 and bfloat16 in float32, returned in their own dtype and
        right to its rounding for any row count, as NumPy and JAX give them.
        An integer mean totals in int64 (exact for fewer than 2**31 rows of
        8- to 32-bit integers), or for int64 and uint64 in float64, which
        cannot wrap around (exact while the total stays below 2**53), and is
        the float `tf.math.truediv` gives (float32 for 8- and 16-bit
        integers, float64 for 32- and 64-bit), not truncated. An integer sum
        wraps around in its own dtype, as `tf.reduce_sum` does. With
        `per_sample=False`, an output whose first dimension is the shard's
        rows (unknown when traced, as the rows are: e.g. one loss per
        example) is reduced over all rows; an output of fixed shape is the
        shard's value, weighted by the shard's size, so a shard-mean loss or
        gradient reduces to exactly the full-batch mean; empty shards are
        left out. Without a reduction, a whole-shard function's outputs must
        have one row per input row (checked where the outputs land; an
        ArgumentError names the output and shard otherwise).
      output_device: where results land. Default: the first device.
      broadcast: names (or positions) of arguments passed whole to every shard,
        such as weights or a lookup table.
      ragged: True when per-sample outputs differ in shape; the result is then a
        `tf.RaggedTensor` in input order (also chosen by itself when the output
        shape of one sample is not fully known); a scalar per sample still
        stacks to a dense ``[N]``. Uses `tf.map_fn`, which is slower than
        vectorising.
      jit_compile: True to compile each shard with XLA, False to run it
        without. Each new shard size compiles again (seconds each on first
        use), so it pays off for repeated calls at a few fixed batch sizes;
        functions with ops XLA cannot compile (strings, ragged tensors, most
        data-dependent shapes) fail on the first call. Default (None): what the
        function is. A Keras model runs as `predict` runs it, with the model's
        own ``model.jit_compile`` (Keras 3: XLA on a machine with a GPU when
        every layer supports it, none on a CPU-only machine or for a model
        made in a `tf.distribute` scope, else what ``model.compile(
        jit_compile=...)`` set), read when the function first runs; where a
        shard would read the model's weights from another device (a model not
        replicated, on several devices: XLA cannot), or the model is not built
        yet, it runs without XLA. A `tf.function` made with ``jit_compile=True``
        has each shard compiled, as it would compile itself (not with
        ``ragged=True``: XLA cannot compile its stacking). Anything else runs
        without XLA.
      allow_duplicate_devices: let two shards share a device (as when a context
        map aliases two names to one card). Otherwise that is an error.
      max_rows: the most rows the function takes at once on a device, for a
        batch larger than a device's memory: an int for every device, or one
        per device (None: no limit there). A shard with more rows runs the
        function on consecutive chunks of at most that many, in a loop on its
        device, and its outputs are gathered or reduced exactly as if it had
        run once (a whole-shard mean stays the batch's mean).

    Inside the function, `tfshard.shard_index` is the shard's index and
    `tfshard.row_index` the global row of the sample (or of each row of the
    shard), counted over the whole input (`tfshard.position`).

    Returns:
      A `ShardedFunction`; calling it returns the function's outputs for all
      rows, in input order (or reduced), on `output_device`.

    Raises:
      ArgumentError: bad options, here or at the first call (when devices are
        resolved); bad arguments at a call, before anything runs.
      DeviceError: a device does not exist.
      ShardError: a shard failed while running; the message names its device
        and rows (and, out of memory, the remedies: ``max_rows=``,
        ``weights=``). It is also the TensorFlow error type the shard raised.

    >>> @tfshard.parallelize(devices=["cpu:0", "cpu:1"])
    ... def double(sample):
    ...     return 2.0 * sample
    >>> double(np.arange(5, dtype=np.float32)).numpy()
    array([0., 2., 4., 6., 8.], dtype=float32)
    """
    given = dict(
        devices=devices,
        weights=weights,
        per_sample=per_sample,
        reduce=reduce,
        output_device=output_device,
        broadcast=broadcast,
        ragged=ragged,
        jit_compile=jit_compile,
        allow_duplicate_devices=allow_duplicate_devices,
        max_rows=max_rows,
    )
    if fn is None:
        return functools.partial(parallelize, **given)
    if not callable(fn):
        raise ArgumentError(f"parallelize(fn={fn!r}): fn must be callable")
    if per_sample is None:
        given["per_sample"] = not _autograph.is_keras_layer(fn)  # it takes batches
    return ShardedFunction(fn, _options.Options.validated(**given))
