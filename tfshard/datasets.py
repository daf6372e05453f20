"""Running a dataset through a parallelized function: the traced loop, its guarded twin,
the Python loop, and the loop that feeds a write's store.

A dataset is taken in once (`tfshard._intake.take`: its global batches and how
each becomes a call); `Runner` runs it over the function's engine, whose steps
it asks for:

- ``f(dataset)`` runs a traced `tf.function` holding a `tf.while_loop` over
  the dataset's iterator (`_Loop`). Each iteration fetches the next batch,
  splits it on the host and copies each shard's rows to that shard's device
  (as MirroredStrategy's per-device prefetch does) while the current batch's
  shards run on rows fed the iteration before, and writes each shard's
  outputs into TensorArrays on the output device that are concatenated (or
  reduced) once after the last batch: no Python per batch, and each output
  row is copied once. Each call of the loop runs as many batches as take
  about `CALL_SECONDS` (half a second), so Ctrl-C and progress reach Python that often. Its
  shards run bare while every device has rows, and through the loop's guarded
  twin from the first batch that leaves a device none. It applies when the
  element spec fixes every per-sample shape (a `Dataset.batch` of fixed-shape
  samples, ragged batches) and results land on this machine; otherwise (e.g.
  `padded_batch`, whose per-sample shape may change from batch to batch, or
  an output device on another machine) ``f(dataset)`` uses the Python loop,
  one call of the engine per batch, which checks every batch.
- ``f.iterate(dataset)`` hands back each batch's result as it comes, and
  ``f.write(dataset, path)`` hands each to the store (`tfshard.writing.Store`):
  both are the Python loop over ``dataset.prefetch(AUTOTUNE)``, while tf.data
  prepares the next batch on its own threads.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from tfshard import _intake, _kinds, _stream, _trees, collect, pinning, writing
from tfshard._arguments import Arguments, Call, check_flag, type_spec
from tfshard._balance import Timing
from tfshard._engine import Engine
from tfshard._intake import Intake, split_element, zeros
from tfshard._plan import Planned, capped, host_cpu, rows, within_caps
from tfshard._step import Step
from tfshard.errors import CAPS_SCOPE, ArgumentError, TfshardError, WriteError, write_stopped

# This process's CPU: where datasets iterate, and where the loop splits each batch.
HOST = host_cpu()
# How long one call of a traced loop runs, in seconds, before Python gets control back
# (Ctrl-C, progress); 0 runs one batch per call. Set it (e.g. with pytest's monkeypatch)
# for a quicker Ctrl-C or to count calls.
CALL_SECONDS = 0.5
# Batches of the traced loop in flight at once: 1 runs batch i's shards while batch
# i + 1 is fed to the devices, and nothing further (memory: two batches per device).
_PARALLEL_ITERATIONS = 1


def _on_host_cpus(engine: Engine) -> bool:
    """Whether every shard runs on a CPU device of this process."""
    return all(
        tf.DeviceSpec.from_string(d).device_type == "CPU" and not pinning.is_remote(d)
        for d in engine.devices
    )


def _check_eager(name: str, how: str) -> None:
    """Refuses a stream inside a tf.function: it runs Python between calls of its loop."""
    if not tf.executing_eagerly():
        raise ArgumentError(
            f"{name}{how} inside a tf.function: streaming a dataset runs Python between "
            "its calls (progress, Ctrl-C, sizing), which a traced function cannot; there, "
            f"loop over the batches yourself, `for batch in dataset: {name}(batch)` (each "
            f"batch is split like a tensor), or call {name}{how} outside the tf.function"
        )


class Runner:
    """A parallelized function's streams: its traced loops, and the Python loop.

    One per `ShardedFunction`, over its engine, whose steps it composes; the
    loops' cache lives here, and goes when the engine's replicas change (its
    `traces_dropped` moves), as the engine's own graphs do (the Python loop's per-batch
    graphs are the engine's: `Engine.call`, `Engine.totals`). Each public method
    takes the dataset in once (`_intake.take`) and runs the `Intake`.

    Args:
      engine: the function's engine.

    Attributes:
      loops: the traced loops, by element spec and trace key.
      on_call: None, or a callable that hears each call of a traced loop just
        before it runs, as ``on_call(limit, guarded)``: the most batches the
        call runs, and whether its shards are guarded (`_Loop.graph`). It runs
        on the thread of the stream; what it raises stops the stream there.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.RLock()
        self.loops: dict[Any, _Loop] = {}
        self.on_call: Callable[[int, bool], None] | None = None
        self._symbolic_elements: dict[Any, Any] = {}  # a symbolic element of each loop's spec
        self._traces_dropped = engine.traces_dropped

    @property
    def trace_count(self) -> int:
        """Graphs traced for streams' traced loops (the Python loop's are the engine's)."""
        return sum(loop.trace_count for loop in self.loops.values())

    def _current(self) -> None:
        """Drops what was traced with replicas that have changed since."""
        dropped = self.engine.traces_dropped
        if self._traces_dropped != dropped:
            with self._lock:
                self.loops.clear()
                self._traces_dropped = dropped

    def _take(
        self,
        arguments: Arguments,
        dataset: tf.data.Dataset,
        args: tuple,
        kwargs: dict,
        how: str,
        **asked: Any,
    ) -> Intake:
        """The dataset taken in for a stream `how` names in an error (``"(dataset)"``),
        with tfshard's keywords of the call (`_intake.Asked`)."""
        engine = self.engine
        _check_eager(engine.name, how)
        cpu_only = _on_host_cpus(engine)
        return _intake.take(arguments, engine.fn, dataset, args, kwargs, cpu_only=cpu_only, **asked)

    def iterate(
        self,
        arguments: Arguments,
        dataset: tf.data.Dataset,
        args: tuple,
        kwargs: dict,
        **asked: Any,
    ) -> Iterator[tuple[Any, int]]:
        """``(result, rows)`` for each global batch, in order, as they are computed;
        `asked`: tfshard's keywords (`_intake.Asked`)."""
        intake = self._take(arguments, dataset, args, kwargs, ".iterate(dataset)", **asked)
        return self._stream(intake, intake.batches, intake.meter())

    def run(
        self,
        arguments: Arguments,
        dataset: tf.data.Dataset,
        args: tuple,
        kwargs: dict,
        **asked: Any,
    ) -> Any:
        """All of the dataset through the engine: outputs concatenated in order, or reduced;
        `asked`: tfshard's keywords (`_intake.Asked`)."""
        name = self.engine.name
        intake = self._take(arguments, dataset, args, kwargs, "(dataset)", **asked)
        intake.refuse_infinite(
            f"{name}(dataset)",
            "its results would never be complete",
            f"stream them with {name}.iterate(dataset), or take a finite part first "
            "(dataset.take(n))",
        )
        self._current()
        with _stream.ctrl_c() as interrupted:
            loop = self._graph_loop(intake, interrupted)
            if loop is None:
                loop = self._python_loop(intake)
        result, total = loop
        if total == 0:
            return self.engine.call(intake.empty())
        return result

    def write(
        self,
        arguments: Arguments,
        dataset: tf.data.Dataset,
        path: str | os.PathLike,
        args: tuple,
        kwargs: dict,
        *,
        overwrite: bool = False,
        **asked: Any,
    ) -> writing.Written:
        """The dataset's outputs into the store at `path`, one call per batch, resumed where
        it stopped; see `ShardedFunction.write`. `asked`: tfshard's keywords
        (`_intake.Asked`). Everything is checked before anything is made on disk, the first
        batch's outputs included: the store changes nothing before them (`writing.Store`)."""
        engine = self.engine
        name = engine.name
        path = writing.checked_path(path, dataset, f"{name}.write")
        call = f"{name}.write(dataset, {path!r})"
        check_flag(overwrite, "overwrite", call)
        try:
            _intake.Asked(**asked).checked()
        except ArgumentError as error:
            raise ArgumentError(f"{call}: {error}") from None
        if engine.options.reduce is not None:
            raise ArgumentError(
                f"{call}: reduce={engine.options.reduce.name!r} gives one value for the whole "
                f"dataset, not rows to write; call {name}(dataset) for it"
            )
        intake = self._take(arguments, dataset, args, kwargs, ".write(dataset, path)", **asked)
        intake.refuse_infinite(
            call, "the write would never end", "write a finite part of it (dataset.take(n))"
        )
        store = writing.opened(path, intake.batches, name, overwrite, call)
        try:
            return self._write(intake, store, call)
        finally:
            store.close()  # and with it the lock: held exactly while the write runs

    def _write(self, intake: Intake, store: writing.Store, call: str) -> writing.Written:
        """The write into an open store: checked against what it holds, then resumed to the end.

        What is on disk is trusted only once a batch of it is computed again and
        found equal (`writing.Store.verify`): the first batch of a finished write,
        the last committed one of a resumed write (read again from the dataset for
        this: `batches.skip(n - 1)`), so another function, changed weights or a
        changed dataset are refused before anything is appended.
        """
        name, batches = self.engine.name, intake.batches
        if store.complete:
            for result, _ in self._stream(intake, batches.take(1), None):
                store.verify(result, 0)
            meter = intake.meter(done_batches=store.batches)
            if meter:
                meter.say(
                    f"{name}: {store.path!r} holds all {store.rows} rows already; "
                    "nothing to compute"
                )
            return writing.Written(store.path, store.rows, store.batches, 0)
        again = 1 if store.batches else 0  # the last committed batch, computed again to check
        first_row = store.rows - store.last_batch_rows * again
        meter = intake.meter(done_batches=store.batches - again, done_rows=first_row)
        if meter and store.batches:
            meter.say(
                f"{name}: resuming after {store.rows} rows ({store.batches} batches) on disk in "
                f"{store.path!r}"
            )
        stream = self._stream(intake, batches.skip(store.batches - again), meter, first_row)
        computed = 0
        try:
            with _stream.ctrl_c() as interrupted:
                for result, rows in stream:
                    if again:
                        store.verify(result, first_row)
                        again = 0
                        continue
                    computed += rows
                    store.append(result, rows)
                    if interrupted():  # pressed where Python could not raise it (`ctrl_c`)
                        raise KeyboardInterrupt
                    store.commit(due=True)
            if again:
                raise ArgumentError(
                    f"{call}: the write there holds {store.batches} batches, but the dataset "
                    "has fewer now; pass overwrite=True to write it anew"
                )
            if store.leaves is None:  # no batch at all: outputs of zero rows say what they are
                empty = self.engine.call(intake.empty())
                store.append(empty, 0, empty=True)
            store.finish()
        except BaseException as error:
            failed = _write_stopped(store, error, meter, call)
            if failed is error:
                raise
            raise failed from error
        return writing.Written(store.path, store.rows, store.batches, computed)

    def one_batch(
        self,
        arguments: Arguments,
        dataset: tf.data.Dataset,
        args: tuple,
        kwargs: dict,
        batch_index: int,
        batch_size: int | None,
        batched: bool | None,
    ) -> Call:
        """Batch `batch_index` of the dataset as a call would take it (`f.timeline(dataset)`).

        The dataset is read as a call on it reads it (a Keras model's ``x``,
        `batch_size`, `batched`); the batch is then one call of its own.

        Raises:
          ArgumentError: `batch_index` is not an int >= 0, or the dataset has
            no batch of that index.
        """
        name = self.engine.name
        if isinstance(batch_index, bool) or not isinstance(batch_index, int) or batch_index < 0:
            raise ArgumentError(f"batch_index={batch_index!r}: the batch to record, an int >= 0")
        asked = {"batch_size": batch_size, "batched": batched}
        intake = self._take(arguments, dataset, args, kwargs, ".timeline(dataset)", **asked)
        with tf.device(HOST):
            element = next(iter(intake.batches.skip(batch_index).take(1)), None)
        if element is None and batch_index == 0:
            raise ArgumentError(
                f"{name}.timeline(dataset): the dataset is empty, so it has no batch to record"
            )
        if element is None:
            raise ArgumentError(
                f"{name}.timeline(dataset, batch_index={batch_index}): the dataset has no batch "
                f"{batch_index} (it has fewer than {batch_index + 1}); pick an earlier one"
            )
        return intake.call(element)

    def _stream(
        self,
        intake: Intake,
        batches: tf.data.Dataset,
        meter: _stream.Progress | None,
        first_row: int = 0,
    ) -> Iterator[tuple[Any, int]]:
        """``(result, rows)`` for each of `batches`, one call each, in order (`_per_batch_calls`),
        `first_row` the global row of the first batch's first row (`tfshard.row_index`)."""
        stream = _per_batch_calls(self.engine.call, intake, batches, meter, first_row)
        return _reported(stream, meter)

    def traced_loop(
        self,
        arguments: Arguments,
        dataset: tf.data.Dataset,
        args: tuple,
        kwargs: dict,
        **asked: Any,
    ) -> _Loop | None:
        """The traced loop `run` takes `dataset` through, traced but not run (its graphs:
        `_Loop.graph`); None where `run` takes it through the Python loop. `asked`:
        tfshard's keywords (`_intake.Asked`)."""
        intake = self._take(arguments, dataset, args, kwargs, "(dataset)", **asked)
        self._current()
        found = self._loop_of(intake)
        return None if found is None else found[0]

    def _graph_loop(
        self, intake: Intake, interrupted: Callable[[], bool]
    ) -> tuple[Any, int] | None:
        """The whole dataset through its traced loop (`_loop_of`); None where none applies.
        Returns the result and the number of rows."""
        found = self._loop_of(intake)
        if found is None:
            return None
        loop, broadcast = found
        engine = self.engine
        meter = intake.meter()
        try:
            result, total = loop.run(
                intake.batches, broadcast, meter, interrupted, engine, self.on_call
            )
        except TfshardError as error:  # a call of the loop failed: `_Loop.run` said why
            if meter:
                meter.stopped(error)
            raise
        except tf.errors.OpError as error:
            if meter:
                meter.stopped(error)
            raise engine.call_error(error, None, element=True) from None
        except BaseException as error:  # Ctrl-C between calls: say where it stopped
            if meter:
                meter.stopped(error)
            raise
        if meter:
            meter.close()
        return result, total

    def _loop_of(self, intake: Intake) -> tuple[_Loop, list[Any]] | None:
        """The traced loop of the dataset, made at first use, and the call's broadcast
        tensors; None where no traced loop applies.

        One applies when the element spec fixes every per-sample shape (so no
        batch can change one, and outputs of all batches concatenate), the
        element is exactly the split arguments (further arguments are
        broadcast or constants), and results land on this machine.
        """
        engine = self.engine
        spec = intake.batches.element_spec
        if not _static_inner_shapes(spec) or pinning.is_remote(engine.output):
            return None
        relaxed = _trees.map_leaves(_any_rows, spec)  # one loop for every batch size
        loop_spec = tf.data.DatasetSpec(relaxed)
        # The call of a batch as the loop holds it, from the iterator inside the loop:
        # Python knows neither its rows (an error names the shard's slice) nor its
        # device, nor whether its fields' rows agree (the step's plan checks them, as
        # in a tf.function).
        batch = self._symbolic_elements.get(loop_spec)
        if batch is None:
            batch = self._symbolic_elements.setdefault(loop_spec, _symbolic(relaxed))
        try:
            call = intake.call(batch)
        except ArgumentError:
            return None  # e.g. a further argument to split: the Python loop says what is wrong
        count = len(_trees.flatten(spec)[0])
        kinds = call.template.element_kinds(len(split_element(relaxed)))
        if call.template.split_count != count or kinds != ["split"] * count:
            return None
        # The caps in use as the stream starts (``weights="auto"``, learned from shards
        # out of memory): constants of its loop, traced again where they changed.
        caps = engine.in_use()[1]
        key = (loop_spec, call.key, caps)
        with self._lock:  # concurrent first calls trace one loop
            loop = self.loops.get(key)
            if loop is None:
                # Bare shards while every device has rows; guarded for a batch that
                # gives one none (the last, mostly), traced only if one comes. Guarded
                # from the start where a weight (or a cap) of 0 empties a device in
                # every batch, and with XLA, whose compiled shard is the guarded one
                # either way.
                steps = [
                    engine.step(call, beside_transfers=True, guarded=g, caps=caps)
                    for g in (False, True)
                ]
                weights = steps[0].weights
                emptied = (weights and 0 in weights) or (caps and 0 in caps)
                bare = not steps[0].options.jit_compile and not emptied
                broadcast_specs = [type_spec(t, split=False) for t in call.tensors[count:]]
                loop = _Loop(*steps, relaxed, broadcast_specs, engine.checked, bare=bare)
                for old in [k for k in self.loops if k[:2] == key[:2]]:
                    del self.loops[old]  # caps only go down: the loop of the old ones goes
                self.loops[key] = loop
        return loop, call.tensors[count:]

    def _python_loop(self, intake: Intake) -> tuple[Any, int]:
        """The batches one call each, for elements whose per-sample shapes may change."""
        engine = self.engine
        op = engine.options.reduce
        total = 0
        accumulated: list[Any] | None = None
        structure: Hashable = None
        pieces: list[Any] = []
        # A reduction's batches run as `collect.Total`s (a mean undivided, in the
        # accumulator dtype), finished once at the end.
        run = engine.call if op is None else engine.totals
        meter = intake.meter()
        stream = _reported(_per_batch_calls(run, intake, intake.batches, meter), meter)
        for result, batch_rows in stream:
            total += batch_rows
            if op is None:
                pieces.append(_trees.flatten(result))
                continue
            leaves, structure = _trees.flatten(result)
            with tf.device(engine.output):
                if accumulated is None:
                    accumulated = leaves
                else:
                    accumulated = collect.accumulate(accumulated, leaves, op)
        if total == 0:
            return None, 0
        if op is None:
            with tf.device(engine.output):
                # Eager tensors of each batch (dense or ragged): concatenated as they are.
                columns = zip(*(leaves for leaves, _ in pieces))
                gathered = [tf.concat(list(parts), axis=0) for parts in columns]
            return _trees.build(pieces[0][1], iter(gathered)), total
        with tf.device(engine.output):
            results = [collect.finished(t, total, op) for t in accumulated]
        return _trees.build(structure, iter(results)), total


def _beside_input(op: tf.Operation) -> str:
    """A device function: an op's device where no scope gave it one, for an identity
    its input's (the identities `tf.while_loop` puts on its body's results, so each
    loop variable stays on the device that makes it)."""
    if op.device or op.type != "Identity" or not op.inputs:
        return op.device
    return op.inputs[0].device


def _on_host(optional: Any) -> Any:
    """`optional` through an identity on the host, the device its ops then take (an
    optional's own ops follow the iterator's, which a traced function does not name)."""
    with tf.device(HOST):
        return tf.nest.map_structure(tf.identity, optional, expand_composites=True)


def _counts(n: tf.Tensor, more: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """A loop call's counts as one int32 vector, read on the host at once (`_read_counts`):
    its batches, whether a batch is left, and its rows (int64, in two 31-bit halves)."""
    rows = tf.cast(rows, tf.int64)
    halves = [rows // 2**31, rows % 2**31]
    return tf.stack([n, tf.cast(more, tf.int32), *(tf.cast(h, tf.int32) for h in halves)])


def _read_counts(counts: tf.Tensor) -> tuple[int, bool, int]:
    """`_counts` on the host: (batches, whether a batch is left, rows)."""
    n, more, high, low = counts.numpy().tolist()
    return n, bool(more), high * 2**31 + low


def _per_batch_calls(
    run: Callable[[Call, int], Any],
    intake: Intake,
    batches: tf.data.Dataset,
    meter: _stream.Progress | None,
    first_row: int = 0,
) -> Iterator[tuple[Any, int]]:
    """The Python loop: `run` once per batch of `batches`, checking per-sample shapes.

    `run` takes the batch's call and its first row's global index (which
    `tfshard.row_index` counts): `first_row` plus the rows of the batches
    before it.
    """
    first: list[Any] | None = None
    before = first_row
    for element in batches:
        leaves, structure = _trees.flatten(element)
        shapes = [_kinds.of(t).sample_shape(t) for t in leaves]
        if first is None:
            first = shapes
        elif shapes != first:  # paths only now, for the message
            paths = _trees.paths("element", structure)
            for where, now, was in zip(paths, shapes, first):
                if now != was:
                    raise ArgumentError(
                        f"{where} has per-sample shape {list(now)} in this batch but "
                        f"{list(was)} in the first; every batch must keep its per-sample "
                        "shapes (pad to one length, or use ragged tensors)"
                    )
        call = intake.call(element)  # checks that the fields have the same rows
        # An eager batch's rows are static (its shape's first dimension).
        batch_rows = call.rows if call.rows is not None else int(rows(leaves[0]))
        result = run(call, before)
        before += batch_rows
        if meter:
            meter.update(batch_rows)
        yield result, batch_rows
    if meter:
        meter.close()


def _write_stopped(
    store: writing.Store, error: BaseException, meter: _stream.Progress | None, call: str
) -> BaseException:
    """The error to raise for a write stopped by `error`, once what was written is committed.

    An ArgumentError says what to change (resuming as it is would not help):
    it is raised as it is, with what is on disk appended where the write
    changed nothing there (`errors.OnDisk.state`: the path as it was). A
    WriteError is worded already (another write took the path while the first
    batch was computed) and raised as it is. Any other is worded by
    `errors.write_stopped` with where the write stands on disk, which the meter
    says too.
    """
    with contextlib.suppress(OSError):  # the disk may refuse this too: the last commit stands
        store.commit(due=False)
    if meter:
        meter.stopped(error)
    disk = store.on_disk()
    if isinstance(error, ArgumentError) and disk.as_it_was:
        error.args = (f"{error}; {disk.state()}",)  # the same error, its traceback kept
    if isinstance(error, ArgumentError | WriteError):
        return error
    if meter:
        meter.say(disk.resume(call))
    return write_stopped(error, call, disk)


def _reported(items: Iterator[Any], meter: _stream.Progress | None) -> Iterator[Any]:
    """`items`; where they stop with an error (Ctrl-C included), the meter says where."""
    try:
        yield from items
    except BaseException as error:
        if meter:
            meter.stopped(error)
        raise


def _any_rows(leaf: tf.TypeSpec) -> tf.TypeSpec:
    """`leaf` with its batch dimension unknown."""
    return _kinds.of(leaf).any_rows(leaf)


def _symbolic(spec: Any) -> Any:
    """Symbolic tensors of a tiny graph that fit `spec` (no rows, no device known)."""
    leaves, structure = _trees.flatten(spec)
    values = (
        tf.function(lambda *values: values, autograph=False)
        .get_concrete_function(*leaves)
        .structured_outputs
    )
    return _trees.build(structure, iter(values))


def _stand_ins(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """Symbolic tensors of a tiny graph with the specs of `leaves`: what collect reads of
    them, without keeping the graph of `leaves` alive."""
    return tuple(_symbolic([tf.type_spec_from_value(leaf) for leaf in leaves]))


def _static_inner_shapes(spec: Any) -> bool:
    """Whether every leaf (a TensorSpec or RaggedTensorSpec) fixes its per-sample shape."""
    return all(_kinds.of(leaf).fixed_sample_shape(leaf) for leaf in _trees.flatten(spec)[0])


class _Loop:
    """Traced loops over the batches of datasets with one element spec.

    `run` iterates the dataset in calls of a traced `tf.function` (`_call_graph`),
    each a `tf.while_loop` over up to ``limit`` batches, sized so a call lasts
    about half a second: Python gets control back that often, for Ctrl-C and
    progress, while the batches themselves run with no Python between them.
    Each iteration fetches the next batch and feeds it to the devices
    (`_feed`: split on the host, each piece copied to its shard's device)
    while the current batch's shards run on the pieces fed the iteration
    before; one iteration at a time (``parallel_iterations=1``), so each
    device holds at most the batch it computes and the next.

    Without a reduction, each shard's outputs are written straight into
    TensorArrays that stay in TensorFlow between calls (their TensorList
    handles are the calls' inputs and outputs) and are concatenated once
    after the last batch (`collect.concat_all`): every output row is copied
    once, and the lists and the result are alive together at the end, about
    twice the result on the output device at peak (`ShardedFunction.iterate`
    holds one batch's result at a time).
    The lists are carried on the output device, between calls too. With a
    reduction, each batch is reduced as a call would be, and a running sum (or
    max, or min) is carried from batch to batch as a `collect.Total`, in its
    accumulator dtype (float32 for float16 outputs, int64 for int32's) between
    calls too, and finished once after the last batch.

    The loop's body calls one traced graph of a batch's shards (`_batch_graph`), which
    is traced before the loop and tells the outputs' specs that the loop's
    state needs: each such graph traces the function once per device, as
    MirroredStrategy does (a stream traces a second one, guarded, only when a
    batch leaves a device no rows), and TensorFlow inlines the call when it runs
    the loop (the shards' ops and their names, which errors read, are as if
    traced in the body).

    Each call takes the rows of the stream before it (the global row of its first
    batch's first row, which `tfshard.row_index` counts on from) and, with
    ``weights="auto"``, the plan's weights: the loop carries each shard's rows and
    seconds over its batches, which the engine's balance reads after the call (one
    measurement per call), and the next call plans by what it decided. The caps a
    ``weights="auto"`` function learned from shards out of memory are constants of its
    loop (`Runner._loop_of` traces one per caps): each batch is planned within them, and
    one they cannot hold together stops before its split (`tfshard._plan.within_caps`).
    Each call takes a turn among the function's calls (`Engine.turn`); a call of one batch
    that runs out of a device's memory caps that device (`_call_error`).

    Attributes:
      leaves: stand-ins of one shard's output leaves (or of the batch's
        `collect.Total`s): symbolic tensors of a tiny graph of their own.
    """

    def __init__(
        self,
        step: Step,
        guarded: Step,
        spec: Any,
        broadcast_specs: Sequence[tf.TypeSpec],
        checked: Callable[[Any], Any],
        *,
        bare: bool = True,
    ) -> None:
        self._step = step
        self._steps = {False: step, True: guarded}
        self._bare = bare  # whether a stream starts with bare shards (`_run_call`)
        self._tracing = threading.Lock()  # threads that need a loop trace it once
        self._count = len(step.devices)
        self._op = step.options.reduce
        self._last_limit = 1  # batches per call that last took about CALL_SECONDS
        self._broadcast_specs = list(broadcast_specs)
        self._batch_graphs: dict[bool, Any] = {}  # `_batch_graph`, bare and guarded
        self._checked = checked
        # One batch's specs as `_feed` leaves it: planned, split, on its devices.
        element_specs = _trees.flatten(spec)[0]
        fed = tf.function(
            lambda *tensors: self._step.onto_devices(self._step.plan(tensors)[0]),
            autograph=False,
        ).get_concrete_function(*element_specs, *broadcast_specs)
        self._fed_spec = tf.nest.map_structure(tf.type_spec_from_value, fed.structured_outputs)
        # The graph of one batch's shards (the function traced once per device; the loop calls it)
        # tells the outputs' structure, dtypes and shapes, which the loop's state needs
        # before the loop is traced.
        first = self._batch_graph(guarded=not bare)
        like, per_batch, _ = first.structured_outputs
        self._structure = _trees.flatten(like)[1]
        # One shard's output leaves (or the batch's `collect.Total`s), and entries per
        # batch: shards, or 1.
        self.leaves = _stand_ins(per_batch[0])
        self._slots = self._count if self._op is None else 1
        # `first` stays alive in the loop's graph that calls it; only the stand-ins are ours.
        del first, like, per_batch
        self._state_specs = (
            [tf.TensorSpec([], tf.variant)] * collect.array_count(self.leaves)
            if self._op is None
            else [collect.running_spec(self._op, leaf.output_dtype) for leaf in self.leaves]
        )
        # The rows before the call; with weights="auto", the plan's weights (`Engine.feeds`).
        feed_specs = [tf.TensorSpec([], tf.int64)]
        if step.balanced:
            feed_specs.append(tf.TensorSpec([self._count], tf.int64))
        self._call_specs = (
            tf.data.IteratorSpec(spec),
            tf.OptionalSpec(spec),
            tf.TensorSpec([], tf.int32),
            tf.TensorSpec([], tf.int32),
            feed_specs,
            self._state_specs,
            self._broadcast_specs,
        )
        self._call_graphs: dict[bool, Any] = {}
        self._call_graph(guarded=not bare)
        if self._op is None:
            with tf.device(step.output):
                leaves = self.leaves
                self._start = tf.function(
                    lambda: collect.new_arrays(leaves), autograph=False
                ).get_concrete_function()
                self._finish = tf.function(
                    lambda flows: collect.concat_all(flows, leaves), autograph=False
                ).get_concrete_function(self._state_specs)

    @property
    def trace_count(self) -> int:
        """The loop's graphs: bare shards, and guarded ones once a batch needed them."""
        return len(self._call_graphs)

    def graph(self, guarded: bool) -> tf.Graph:
        """The graph of the loop's calls (`_run_call`), with bare or guarded shards."""
        return self._call_graph(guarded).graph

    def _call_graph(self, guarded: bool) -> Any:
        """The loop's graph (`_run_call`) with bare or guarded shards, traced on first use."""
        graph = self._call_graphs.get(guarded)
        if graph is not None:
            return graph
        with self._tracing:
            graph = self._call_graphs.get(guarded)
            if graph is None:
                run = functools.partial(self._run_call, guarded)
                graph = tf.function(run, autograph=False).get_concrete_function(*self._call_specs)
                self._call_graphs[guarded] = graph
        return graph

    def _batch_graph(self, guarded: bool) -> Any:
        """The graph of one batch's shards (`_run_batch`), bare or guarded, traced once.

        The loop's body calls it (TensorFlow inlines the call when it runs the
        loop), so each graph traces the function once per device, and the loop
        learns its outputs' specs from the same trace before it is traced.
        """
        batch = self._batch_graphs.get(guarded)
        if batch is None:
            step = self._steps[guarded]

            def tfshard_batch(fed: Planned, broadcast: list, offset: tf.Tensor) -> tuple:
                return self._run_batch(step, fed, broadcast, offset)  # named so in errors

            batch = tf.function(tfshard_batch, autograph=False).get_concrete_function(
                self._fed_spec, self._broadcast_specs, tf.TensorSpec([], tf.int64)
            )
            # The loop nests its shards where the engine's checks cannot read them; this
            # graph holds them at its top level, each on its device, under its replica: a
            # shard that writes a replicated variable (or, compiled, reads one on another
            # device) is refused here, before anything runs.
            self._batch_graphs[guarded] = self._checked(batch)
        return batch

    @staticmethod
    def _run_batch(step: Step, fed: Planned, broadcast: list, offset: tf.Tensor) -> tuple:
        """One batch's shards on the pieces `_feed` put on their devices, at `offset` (its
        first row in the stream): its outputs as the function returns them (for their
        structure), its entries (each shard's output leaves, checked, or the batch's
        totals) and, where the step times its shards, ``(rows, seconds)``."""
        outputs = step.run(fed, broadcast, offset)
        like = _trees.build(outputs.structure, iter(outputs.flat[0]))
        if step.options.reduce is None:
            step.check(outputs, fed)
            per_batch = outputs.flat
        else:
            per_batch = [step.collect(outputs, fed)]
        timing = None if outputs.timing is None else tuple(outputs.timing)
        return like, per_batch, timing

    def _feed(
        self, batch: Any, wanted: tf.Tensor, broadcast: Sequence[Any], weights: tf.Tensor | None
    ) -> tuple[Planned, tuple[tf.Tensor, tf.Tensor]]:
        """The batch in the optional `batch`, planned, split and on its devices; and its
        rows and each shard's, on the host (where the loop reads them).

        Runs ahead of the batch's shards (`_run_call`): the plan (which checks
        that the element's fields have the same rows) and the split run on the
        host, where the iterator leaves the batch, and each piece is copied to
        its shard's device (`Step.onto_devices`), so a GPU receives its rows
        while it still computes the batch before. A batch that is not `wanted`
        (none left, or the call ends first) feeds zero rows.
        """
        with tf.name_scope("tfshard_feed"):
            with tf.device(HOST):
                tensors = tf.cond(
                    tf.logical_and(batch.has_value(), wanted),
                    lambda: _trees.flatten(batch.get_value())[0],
                    lambda: _trees.flatten(zeros(batch.element_spec))[0],
                )
                caps = self._step.caps
                checks = []
                if capped(caps):  # a batch the caps cannot hold stops before its split
                    n = tf.cast(rows(tensors[0]), tf.int64)
                    planned_by = self._step.weights if weights is None else weights
                    with tf.name_scope(CAPS_SCOPE):  # how its error is known (`over_caps`)
                        checks.append(within_caps(n, self._count, planned_by, caps))
                # [B, ...] -> K x [B_k, ...]
                with tf.control_dependencies(checks):
                    planned, _ = self._step.plan([*tensors, *broadcast], weights)
            with tf.device(HOST):
                # Counted here again: a device alone counts its rows on the device.
                sizes = (tf.cast(rows(tensors[0]), tf.int64), tf.identity(planned.sizes))
            return self._step.onto_devices(planned), sizes

    def _run_call(
        self,
        guarded: bool,
        iterator: Any,
        current: Any,
        i: tf.Tensor,
        limit: tf.Tensor,
        feeds: list,
        state: list,
        broadcast: list,
    ) -> tuple:
        """Up to `limit` batches; `state` holds the TensorList flows or the running totals.

        The loop carries the batch to run next twice: as the iterator's
        optional, on the host, and as its pieces already on the devices
        (`_feed`). Between calls only the optional crosses (a function's
        outputs land on its caller's device), and each call feeds its first
        batch before the loop. `feeds` holds the rows before this call and,
        with ``weights="auto"``, the plan's weights; then each shard's rows
        and seconds over the call's batches come back too (zeros otherwise).

        Each loop variable lives where it is made (`_beside_input`): the
        counters, the optional and the batch's sizes on the host, read there
        (the loop's condition, the next feed, the offset), the pieces on their
        devices, the state on the output device. So no iteration waits for a
        device: nothing crosses back to the host but the loop's condition and
        int32 sizes (which a GPU holds in host memory), control edges and, with
        ``weights="auto"``, the shards' timing. What the host reads of the call
        is one int32 vector (`_counts`).

        Unless `guarded`, the shards run bare (`Step.guarded`), and the loop
        stops before a batch that would give a device no rows: `run` runs the
        rest of the stream through the guarded loop.
        """
        op, output, batch = self._op, self._step.output, self._batch_graph(guarded)
        before, weights = feeds[0], (feeds[1] if len(feeds) > 1 else None)

        def body(i, n, total, more, current, fed, state, rows, seconds):  # noqa: ANN001, ANN202
            fed, (fed_rows, _) = fed
            with tf.device(HOST):
                following = _on_host(iterator.get_next_as_optional())  # prepared meanwhile
                more = tf.cast(following.has_value(), tf.int32)
                wanted = n + 1 < limit  # none past this call's last batch
                offset = before + total
            # The next batch onto the devices while this one runs.
            fed_next = self._feed(following, wanted, broadcast, weights)
            _, per_batch, timing = batch(fed, broadcast, offset)
            with tf.device(output):
                if op is None:
                    state = collect.write_shards(state, self.leaves, i * self._slots, per_batch)
                else:
                    state = collect.accumulate(state, per_batch[0], op)
            with tf.device(HOST):
                if timing is not None:
                    rows, seconds = rows + timing[0], seconds + timing[1]
                rows, seconds = tf.identity(rows), tf.identity(seconds)
                i, n, total = i + 1, n + 1, total + fed_rows
            return i, n, total, more, following, fed_next, state, rows, seconds

        with tf.device(HOST):
            # The caller's device holds `current` between calls; in the loop it is the host's.
            current = _on_host(current)
            rows = tf.zeros([self._count], tf.int64)
            seconds = tf.zeros([self._count], tf.float64)
        fed = self._feed(current, tf.constant(True), broadcast, weights)

        def going(i, n, total, more, current, fed, state, rows, seconds):  # noqa: ANN001, ANN202
            with tf.device(HOST):
                on = tf.logical_and(n < limit, more > 0)
                if guarded:
                    return on
                # bare shards: every device must have rows
                return tf.logical_and(on, tf.reduce_all(fed[1][1] > 0))

        with tf.device(HOST):
            i, n, total = tf.identity(i), tf.constant(0), tf.constant(0, tf.int64)
            more = tf.cast(current.has_value(), tf.int32)
        # Each loop variable stays where it is made (`_beside_input`): the host's
        # counters and batch, the devices' pieces, the output device's state.
        with tf.compat.v1.device(_beside_input):
            # The accumulators come in with unknown shapes: nothing to hold invariant.
            i, n, total, more, current, _, state, rows, seconds = tf.while_loop(
                going,
                body,
                (i, n, total, more, current, fed, list(state), rows, seconds),
                parallel_iterations=_PARALLEL_ITERATIONS,
            )
        with tf.device(HOST):
            counts = _counts(n, more, total)
        return current, i, counts, state, rows, seconds

    def run(
        self,
        batches: tf.data.Dataset,
        broadcast: list[Any],
        meter: _stream.Progress | None,
        interrupted: Callable[[], bool],
        engine: Engine,
        on_call: Callable[[int, bool], None] | None = None,
    ) -> tuple[Any, int]:
        """All of `batches` through the loop: the result, and how many rows.

        `interrupted` says whether Ctrl-C was pressed (`_stream.ctrl_c`); it is read
        before each call of the loop, and `on_call` (`Runner.on_call`) hears each call
        just before it runs. `engine` gives each call its feeds
        (`Engine.feeds`) and takes its shards' timing (`Engine.observe`), or drops it
        where another call of the function ran beside it (`Engine.alone`). The
        host reads one int32 vector per call (`_counts`: in host memory on a
        GPU). Each stream's first call runs one batch; a stream whose batches
        all run in `CALL_SECONDS` then runs the rest in one call once the loop
        has measured them.
        """
        with tf.device(HOST):
            iterator = iter(batches)
            current = iterator.get_next_as_optional()
        # A function's outputs land on its caller's device: the loop's state (TensorLists
        # of every output row so far) stays on the output device from call to call.
        with tf.device(self._step.output):
            if self._op is None:
                state = self._start()
            else:
                state = [collect.no_rows(self._op, leaf.output_dtype) for leaf in self.leaves]
        # The first call runs one batch: this stream's batches may cost more than the last
        # stream's (the loop serves every batch size). Its time may then take the next call
        # back to the size the last stream reached; after that, a call at most doubles.
        i, total, limit = tf.constant(0), 0, 1
        reached, first = self._last_limit, True
        guarded = not self._bare
        while True:
            if interrupted():  # pressed while Python could not raise it (`_stream.ctrl_c`)
                raise KeyboardInterrupt
            if on_call is not None:
                on_call(limit, guarded)
            began = time.perf_counter()
            feeds = engine.feeds(total)
            graph = self._call_graph(guarded)
            with engine.turn():  # so a shard out of memory knows whether it ran alone
                try:
                    with tf.device(self._step.output):
                        current, i, counts, state, rows, seconds = graph(
                            iterator, current, i, tf.constant(limit), feeds, state, broadcast
                        )
                except tf.errors.OpError as error:
                    raise self._call_error(engine, error, current, limit, feeds) from None
                # Another call of the function ran beside it (its shards on the same
                # devices): its timing is not its own, and is not counted (`Engine.observe`).
                alone = engine.alone()
            # The call's one read on the host (int32: in host memory on a GPU).
            n, more, batch_rows = _read_counts(counts)
            if self._step.balanced and n:
                engine.observe(Timing(rows, seconds), id(graph), alone=alone)
            total += batch_rows
            if meter and n:
                meter.update(batch_rows, n)
            if n:
                # The next call runs about CALL_SECONDS, by this one's time per batch; at
                # most twice this one's batches: batches can get slower, and a call cannot
                # be stopped.
                per_batch = (time.perf_counter() - began) / n
                cap = max(2 * limit, reached) if first else 2 * limit
                grown = int(min(max(CALL_SECONDS / max(per_batch, 1e-9), 1), cap))
                self._last_limit = max(grown, 1) if n == limit or grown > limit else limit
                first = False
            if not more:
                break
            if n < limit:  # the next batch gives a device no rows: guarded from now on
                guarded = True
            limit = self._last_limit
        if total == 0:
            return None, 0
        if self._op is None:
            with tf.device(self._step.output):
                results = self._finish(state)
        else:
            results = self._step.finish(state, total)
        return _trees.build(self._structure, iter(results)), total

    def _call_error(
        self, engine: Engine, error: tf.errors.OpError, current: Any, limit: int, feeds: list
    ) -> Exception:
        """A failed call of the loop's error (`Engine.call_error`), by the weights fed and
        the loop's caps. A call of one batch (each stream's first; with `CALL_SECONDS` 0,
        every one) ran `current`'s, whose rows Python reads now, after the failure, so a
        shard of it out of its device's memory caps that device; in a call of several,
        which batch failed is not known."""
        batch_rows = None
        if limit == 1 and current.has_value():
            batch_rows = int(rows(_trees.flatten(current.get_value())[0][0]))
        weights = tuple(int(w) for w in feeds[1].numpy()) if len(feeds) > 1 else None
        return engine.call_error(error, batch_rows, weights, caps=self._step.caps, element=True)
