"""What one shard computes and returns: the user's function per sample or per shard.

`shard_of` wraps the user's function into a `Shard`: a vectorized map over the
rows (`vectorized`) or one call on the whole shard (`whole_shard`), and what a
shard with no rows returns instead (`skip_if_empty`). The outputs of all
shards come back as `ShardOutputs`, checked alike (`check_outputs`), and
every output that is one value per row (`by_row`) is checked to have one row
per row of its shard (`check_rows`, the one check of that rule).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tfshard import _arguments, _graph, _kinds, _trees, collect
from tfshard._autograph import is_keras_layer
from tfshard._plan import host_assert, row_count, rows
from tfshard.errors import (
    ROWS_DIFFER,
    STALE_POSITION_FIX,
    ArgumentError,
    TfshardError,
    Traced,
    reads_a_stale_position,
    trace_error,
)
from tfshard.position import Lazy, Position, Reads, seen


def shard_of(
    fn: Callable[..., Any],
    template: _arguments.Template,
    shared: Sequence[Any],
    example: Sequence[Any],
    *,
    name: str,
    per_sample: bool,
    ragged: bool,
) -> Shard:
    """The computation of one shard, and what a shard without rows returns instead.

    The function sees where its shard is (`tfshard.position`) while it is
    traced: `Shard.run` takes the shard's `Position` beside its rows. Every call
    of it must read its own (`tfshard.position.Reads`: a `TfshardError` for a
    call that a `tf.function`'s cache gave an earlier call's).

    Args:
      fn: the user's function (autograph applied).
      template: how the call's arguments are rebuilt from a shard's tensors.
      shared: the broadcast tensors, whole to every shard.
      example: one shard's split tensors, for the per-sample signature.
      name: the function's name, for messages.
      per_sample: map `fn` over rows, or call it on the whole shard.
      ragged: stack per-sample outputs as ragged tensors.
    """

    reads = Reads(name)

    def call(rows_in: Sequence[Any], position: Position, count: tf.Tensor | None) -> Any:
        args, kwargs = template.rebuild(rows_in, shared)
        try:
            with seen(position, count, reads):
                outputs = fn(*args, **kwargs)
        except TfshardError:
            raise
        except (ValueError, TypeError) as error:
            if reads.read and reads_a_stale_position(str(error)):
                raise TfshardError(f"{name}: {STALE_POSITION_FIX.format(name=name)}") from error
            traced = trace_facts(fn, template, rows_in, name=name, per_sample=per_sample)
            raise trace_error(error, traced) from error
        return to_tensors(outputs, name)

    return vectorized(call, example, ragged) if per_sample else whole_shard(call)


def trace_facts(
    fn: Callable[..., Any],
    template: _arguments.Template,
    rows_in: Sequence[Any],
    *,
    name: str,
    per_sample: bool,
) -> Traced:
    """What a shard's trace knows when the function fails in it, for `errors.trace_error`.

    Whether an argument is a Python list of arrays (samples meant as one
    batch), whether a Keras model was given one sample without its batch
    dimension, what tfshard gave the function, and whether ``broadcast=``
    applies.
    """
    listed = template.listed()
    listing = None
    if listed:
        arg, count = listed[0]
        arg, code = _plainly(arg) if is_keras_layer(fn) else (arg, arg)
        listing = (arg, code, count)
    expected = _model_input_shape(fn)
    sample = None if expected is None or len(rows_in) != 1 else rows_in[0].shape
    one_sample = None
    if sample is not None and not per_sample and sample[1:] == expected[2:]:
        arg, code = _plainly(template.split_paths()[0])
        one_sample = (arg, code, list(expected), list(sample[1:]))
    return Traced(
        name=name,
        per_sample=per_sample,
        shapes=[r.shape for r in rows_in],
        listed=listing,
        one_sample=one_sample,
        several=template.split_count > 1 or len(template.names) > 1,
    )


def _plainly(arg: str) -> tuple[str, str]:
    """An argument's name for a hint's prose and for its code: a Keras model's call
    takes ``*args``, so its ``args[0]`` is "the input", and ``x`` in code."""
    return ("the input", "x") if arg.startswith("args[") else (arg, arg)


def _model_input_shape(fn: Any) -> tf.TensorShape | None:
    """The input shape of a Keras model with one input (batch dimension first), else None."""
    inputs = getattr(fn, "inputs", None) if is_keras_layer(fn) else None
    if not isinstance(inputs, list) or len(inputs) != 1:
        return None
    try:
        return tf.TensorShape(inputs[0].shape)
    except (TypeError, ValueError):
        return None


def check_rows(
    outputs: ShardOutputs,
    sizes: tf.Tensor,
    devices: Sequence[str],
    where: str,
    counted: dict[int, tf.Tensor],
    *,
    per_sample: bool,
    reduce: collect.Reduction | None,
) -> None:
    """Checks, on `where`, that every output that is one value per row (`by_row`) has one
    row per row of its shard: the rule's one check, for every path of a call.

    A per-sample function's outputs have by construction (one stacked per
    sample): nothing is checked. A gathered output's counts come from its
    gather, where it lands (`counted`: int32, nothing more crosses); others get
    a Shape op per shard. `sizes` are the plan's, int32. The check's message
    starts with `ROWS_DIFFER` (`tfshard.errors.rows_error` names it).
    """
    if per_sample:
        return
    with tf.name_scope("tfshard_rows"):
        for i, per_shard in enumerate(outputs.leaves()):
            if not by_row(per_shard[0], per_sample=per_sample, reduce=reduce):
                continue
            got = counted.get(i)
            if got is None:
                counts = [row_count(t, d) for t, d in zip(per_shard, devices)]
                with tf.device(where):
                    got = tf.stack(counts)
            with tf.device(where):  # one check per output, all shards at once
                host_assert(
                    got,
                    sizes,
                    f"{ROWS_DIFFER} {outputs.path(i)} :end (each shard's, then its input "
                    "rows: with per_sample=False an output needs one row per input row, "
                    "or a fixed shape under reduce=)",
                )


def by_row(value: Any, *, per_sample: bool, reduce: collect.Reduction | None) -> bool:
    """Whether an output holds one value per row of its shard (gathered, chunked and reduced
    row by row, and checked by `check_rows`) rather than the shard's own value."""
    return per_sample or reduce is None or per_row(value)


class ShardOutputs(NamedTuple):
    """What the shards of one call returned, checked alike (`check_outputs`).

    Attributes:
      structure: the output structure (a `_trees` key) every shard returned.
      flat: ``flat[k]``, shard k's output leaves.
      timing: what each shard took (a `tfshard._balance.Timing`), where the
        step times its shards (``weights="auto"``), else None.
    """

    structure: Hashable
    flat: list[list[Any]]
    timing: Any = None

    def leaves(self) -> list[list[Any]]:
        """For each output leaf, its value from every shard, in shard order."""
        return [list(per_shard) for per_shard in zip(*self.flat)]

    def path(self, i: int) -> str:
        """Leaf i's path, for messages (``outputs['loss']``)."""
        return _trees.path("outputs", self.structure, i)

    def check_gatherable(self, name: str, *, chunks: bool = False) -> None:
        """Raises ArgumentError for a scalar per shard, or shards' values whose shapes
        past the rows differ where the trace knows them: a gather concatenates rows.
        `name` is the parallelized function's, for the message; `chunks`: these are
        the outputs of a shard's first chunk (``max_rows``), whose chunks'
        values are concatenated as a shard's rows are, also for `f.per_shard`."""
        for i, leaf in enumerate(self.flat[0]):
            if leaf.shape.rank == 0 and chunks:
                raise ArgumentError(
                    f"{name}: {self.path(i)} is a scalar per chunk; with max_rows a shard "
                    "runs in chunks whose values are concatenated along axis 0 (as shards' "
                    "are, also for f.per_shard), so return a [rows, ...] tensor, pass "
                    f"reduce={collect.reduction_names()} to combine the chunks' and shards' "
                    "values, or drop max_rows to take each shard's value as it is with "
                    "f.per_shard(...)"
                )
            if leaf.shape.rank == 0:
                raise ArgumentError(
                    f"{name}: {self.path(i)} is a scalar per shard; with per_sample=False outputs "
                    "are concatenated along axis 0, so return a [rows, ...] tensor, pass "
                    f"reduce={collect.reduction_names()} to combine the shards' values, or "
                    "take each shard's value as it is with f.per_shard(...)"
                )
            inner = [tf.TensorShape(values[i].shape)[1:] for values in self.flat]
            differ = next(
                (k for k in range(1, len(inner)) if not inner[k].is_compatible_with(inner[0])),
                None,
            )
            if differ is not None:
                raise ArgumentError(
                    f"{name}: {self.path(i)} cannot be gathered in order: shard 0's is "
                    f"[rows, {', '.join(map(str, inner[0].as_list()))}] and shard {differ}'s "
                    f"[rows, {', '.join(map(str, inner[differ].as_list()))}]; each output "
                    "must have one row per input row and the same shape past the rows on "
                    "every shard (pad it to one shape, or pass ragged=True for outputs whose "
                    "length varies by sample)"
                )


class Shard(NamedTuple):
    """What one shard computes.

    Attributes:
      run: its outputs, from its rows and its `Position` (guarded against an
        empty shard by `skip_if_empty`, and run in place or through a shared
        trace as `_sharding.choose` decides).
      empty: the outputs of a shard with no rows instead, from what `run`
        returned when traced (None if not known), or None to run it after all
        (`skip_if_empty`).
    """

    run: Callable[[Sequence[Any], Position], Any]
    empty: Callable[[Any], Any]


def skip_if_empty(
    shard: Shard, rows_in: Sequence[Any], position: Position, has_rows: tf.Tensor
) -> Any:
    """`shard.run(rows_in, position)` where the shard has rows, `shard.empty` where not,
    as one `tf.cond`.

    tfshard makes the empty shards (fewer rows than devices), so it must not
    make them fail or return outputs of the wrong shape. The predicate is the
    planned size, known before the shard's rows are. The cond has a cost (no
    buffer forwarding into its branch), so shards run bare where all have rows.
    """
    # A whole shard's empty outputs copy the structure and shapes of what the
    # function returned in the branch with rows, which tf.cond traces first; were it
    # ever traced second, the branch without rows would run the function instead.
    returned: list[Any] = []

    def with_rows() -> Any:
        outputs = shard.run(rows_in, position)
        returned.append(outputs)
        return outputs

    def without() -> Any:
        outputs = shard.empty(returned[0] if returned else None)
        return shard.run(rows_in, position) if outputs is None else outputs

    return tf.cond(has_rows, with_rows, without)


def vectorized(
    call: Callable[[Sequence[Any], Position, tf.Tensor | None], Any],
    example: Sequence[Any],
    ragged_outputs: bool,
) -> Shard:
    """`call` of one sample, mapped over the rows of a shard.

    Each sample's global row (`tfshard.row_index`, a scalar per sample) is
    mapped with it (`Position.rows`) only where the function reads it
    (`sample_trace` says): mapping the rows costs ops on every call.

    An empty shard returns empty outputs of the per-sample signature: a map
    over nothing gives outputs of the wrong inner shape, or fails. A shard of
    one row is reshaped to ``[1, *sample]``: pfor can squeeze its batch
    dimension away.

    A function that writes a variable (a Keras metric's ``update_state``) or
    asserts runs sample by sample (`tf.map_fn`, as ``ragged=True`` does): pfor
    refuses the write or applies it once for all samples, and drops the check
    for all rows but the first. A tf.random.Generator's draws vectorise (pfor
    advances it sample by sample itself).
    """
    sample = sample_trace(call, example, ragged_outputs)
    signature, reads_rows = sample.signature, sample.reads_rows
    leaves, _ = _trees.flatten(signature)
    # Rows of different lengths in or out: vectorize cannot stack them.
    one_by_one = (
        ragged_outputs
        or sample.sequential
        or not all(_kinds.of(t).VECTORIZES for t in example)
        or not all(_kinds.of(s).VECTORIZES for s in leaves)
    )

    def each(rows_in: Sequence[Any], position: Position) -> Any:
        # Rows of a dtype without GPU GatherV2/TensorList kernels (what both maps
        # take rows with) enter as their carrier and are cast back per sample.
        dtypes = [r.dtype for r in rows_in]
        entering = tuple(_kinds.of(r).entering(r) for r in rows_in)
        positions = []
        if reads_rows:
            # The rows' shape, not their planned number: static where XLA compiles the map.
            positions.append(position.rows(rows(rows_in[0])))  # [n] int64, a global row each

        def one(row: Sequence[Any]) -> Any:
            values, at = (row[:-1], row[-1]) if reads_rows else (row, None)
            outputs = call(
                [_kinds.of(r).leaving(r, d) for r, d in zip(values, dtypes)],
                Position(position.index, at),
                None,
            )
            # An output that is a tensor from outside the map (a broadcast argument
            # returned as it is) must still be an op of the map: pfor fails on it
            # otherwise, and map_fn stacks it alike.
            outputs = tf.nest.map_structure(tf.identity, outputs, expand_composites=True)
            # Outputs leave as their carrier too: pfor stacks an output that is the
            # same for every sample (a constant, any output of a shard of one static
            # row) with Tile, and map_fn stacks outputs in a TensorList; neither has
            # GPU kernels for these dtypes.
            return tf.nest.map_structure(_carried, outputs)

        elements = (*entering, *positions)
        if one_by_one:
            carriers = tf.nest.map_structure(_carrier_spec, signature)
            stacked = tf.map_fn(one, elements, fn_output_signature=carriers, name="per_sample")
            return tf.nest.map_structure(_uncarried, stacked, signature)
        stacked = tf.vectorized_map(one, elements, fallback_to_while_loop=True)
        stacked = tf.nest.map_structure(_uncarried, stacked, signature)
        n = Lazy(lambda: rows(rows_in[0])), rows_in[0].shape[0]
        return tf.nest.map_structure(functools.partial(_with_rows, *n), stacked, signature)

    return Shard(each, lambda outputs: collect.empty(signature))


def _carried(value: Any) -> Any:
    """A dense output of a map as its `_kinds.CARRIERS` dtype (others as they are)."""
    return _kinds.carried(value) if isinstance(value, tf.Tensor) else value


def _carrier_spec(spec: Any) -> Any:
    """The spec `_carried` gives an output of `spec`."""
    carrier = _kinds.CARRIERS.get(spec.dtype) if isinstance(spec, tf.TensorSpec) else None
    return spec if carrier is None else tf.TensorSpec(spec.shape, carrier)


def _uncarried(stacked: Any, spec: Any) -> Any:
    """A stacked output of a map back in its own dtype (`_carried` undone)."""
    return _kinds.uncarried(stacked, spec.dtype) if isinstance(stacked, tf.Tensor) else stacked


def _with_rows(n: Lazy, known: int | None, stacked: tf.Tensor, spec: tf.TypeSpec) -> tf.Tensor:
    """A vectorised output as ``[n, *sample]``, where the sample's shape is fixed
    (`known`: n where it is static; `n` is made only where it is not)."""
    if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
        return stacked
    static = known is not None and stacked.shape.is_fully_defined()
    if static and stacked.shape.as_list() == [known, *spec.shape.as_list()]:
        return stacked  # static rows (a graph traced for its batch's rows): as it is
    return tf.reshape(stacked, tf.concat([tf.reshape(n(), [1]), spec.shape.as_list()], 0))


def whole_shard(call: Callable[[Sequence[Any], Position, tf.Tensor | None], Any]) -> Shard:
    """`call` of a whole shard.

    Many batch functions fail on an empty batch (a Keras CNN does), so an empty shard
    gives, for each output of the traced shard, zeros with 0 rows where the
    output is per row (`per_row`) and the output's own shape otherwise (a
    reduction ignores an empty shard's value). Where an output's shape is not
    known well enough for that (unknown rank or inner dimensions, ragged), the
    empty shard calls the function after all.
    """

    def empty(outputs: Any) -> Any:
        if outputs is None:
            return None
        leaves, structure = _trees.flatten(outputs)
        if not all(isinstance(t, tf.Tensor) and _known_but_rows(t.shape) for t in leaves):
            return None
        return _trees.build(structure, iter([_no_rows(t) for t in leaves]))

    def run(rows_in: Sequence[Any], position: Position) -> Any:
        # The rows `row_index` counts, made only where the function reads it.
        return call(rows_in, position, Lazy(lambda: rows(rows_in[0])))

    return Shard(run, empty)


def no_rows_like(value: Any, per_sample: bool) -> Any:
    """What a shard without rows returns for an output leaf another shard returned as `value`:
    no rows shaped as `value`'s rows (per sample, per row or ragged), else zeros of
    its shape. Made from the static spec alone, so it needs no op on a left-out device."""
    spec = tf.type_spec_from_value(value)
    if spec.shape.rank is None:
        return tf.zeros([0], value.dtype)
    if per_sample or per_row(value) or not isinstance(value, tf.Tensor):
        return collect.empty(collect.stacked_spec(spec))
    return _no_rows(value)


def _known_but_rows(shape: tf.TensorShape) -> bool:
    """Known rank, and every dimension but the first known: zeros can stand in."""
    return shape.rank is not None and all(d is not None for d in shape[1:])


def _no_rows(t: tf.Tensor) -> tf.Tensor:
    dims = [0 if d is None else d for d in t.shape]
    if per_row(t):
        dims[0] = 0
    return tf.zeros(dims, t.dtype)


def per_row(value: Any) -> bool:
    """Whether a whole-shard function's output holds one value per row of the shard:
    its first dimension unknown when traced, as the shard's rows are."""
    return value.shape.rank is not None and value.shape.rank >= 1 and value.shape[0] is None


class SampleTrace(NamedTuple):
    """What the function's trace on one sample says.

    Attributes:
      signature: its output specs (ragged where shapes vary).
      reads_rows: whether it reads its sample's global row (`tfshard.row_index`).
      sequential: whether it must run sample by sample: it writes a variable
        or asserts, which `tf.vectorized_map` gets wrong (`vectorized`).
    """

    signature: Any
    reads_rows: bool
    sequential: bool


def sample_trace(call: Callable[..., Any], example: Sequence[Any], ragged: bool) -> SampleTrace:
    """The function traced on one sample, and what that trace says (`SampleTrace`).

    The sample traced here sees a position, an input of the probe: the row is
    read where that input has a user in the probe's graph.
    """
    specs = tuple(_arguments.row_spec(t) for t in example)

    def one(tfshard_position: Position, *rows_in: Any) -> Any:  # `errors.POSITION_NAME`
        return call(rows_in, tfshard_position, None)

    probe = tf.function(one, autograph=False).get_concrete_function(Position.specs(), *specs)
    outputs = probe.structured_outputs
    reads_rows = bool(probe.inputs[1].consumers())  # Position(index, first): first's users
    sequential = _graph.writes_variables(probe) or _graph.asserts(probe)

    def to_spec(value: Any, path: str) -> tf.TypeSpec:
        return _kinds.of(value).sample_output(value, ragged, path)

    leaves, key = _trees.flatten(outputs, "outputs")
    specs = [to_spec(leaf, _trees.path("outputs", key, i)) for i, leaf in enumerate(leaves)]
    return SampleTrace(_trees.build(key, iter(specs)), reads_rows, sequential)


def check_outputs(outputs: list[Any], devices: Sequence[str]) -> tuple[Hashable, list[list[Any]]]:
    """Checks that every shard returned the same structure, ranks and dtypes.

    Args:
      outputs: one output structure per shard.
      devices: the shards' devices, for messages.

    Returns:
      The structure key and each shard's flat output leaves.
    """
    reference_leaves, reference = _trees.flatten(outputs[0], "outputs")
    flat = [reference_leaves]
    for k, result in enumerate(outputs[1:], start=1):
        leaves, structure = _trees.flatten(result, "outputs")
        if structure != reference:
            ours = _trees.paths("outputs", structure)
            theirs = _trees.paths("outputs", reference)
            raise ArgumentError(
                f"{_trees.first_difference('outputs', structure, reference)} differs between "
                f"shards: on {devices[k]} the function returned {', '.join(ours)} but on "
                f"{devices[0]} {', '.join(theirs)}; every shard must return the same structure"
            )
        for i, (leaf, first) in enumerate(zip(leaves, reference_leaves)):
            if leaf.shape.rank != first.shape.rank or leaf.dtype != first.dtype:
                raise ArgumentError(
                    f"{_trees.path('outputs', reference, i)} has rank {leaf.shape.rank} "
                    f"({leaf.dtype.name}) on {devices[k]} but rank {first.shape.rank} "
                    f"({first.dtype.name}) on {devices[0]}; every shard must return the same "
                    "ranks and dtypes"
                )
        flat.append(leaves)
    return reference, flat


def to_tensors(outputs: Any, where: str) -> Any:
    """The function's outputs with numbers and arrays made tensors; else an error."""
    leaves, key = _trees.flatten(outputs, "outputs")
    converted = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, tf.Tensor | tf.RaggedTensor):
            converted.append(leaf)
        elif isinstance(leaf, int | float | np.ndarray | np.generic) and not isinstance(leaf, bool):
            converted.append(tf.convert_to_tensor(leaf))
        else:
            hint = " (did the function forget to return?)" if leaf is None else ""
            raise ArgumentError(
                f"{where}: {_trees.path('outputs', key, i)} is {type(leaf).__name__} "
                f"{leaf!r}{hint}; a parallelized function must return tensors (or a tuple, "
                "list, dict or namedtuple of them)"
            )
    return _trees.build(key, iter(converted))
