"""One call's arguments: sorted into split, broadcast and static leaves, with a trace key.

This is the per-call hot path of a parallelized function: `Arguments.classify`
runs on every call, before any graph, so it checks bad input early and keeps
its Python work small (the signature binds once per arity; a dense tensor's
trace key is its dtype and shape, not a TensorSpec).

- split: tensors, arrays, variables and ragged tensors, split along axis 0;
  all of one call must have the same number of rows.
- broadcast: tensors of arguments named in ``broadcast=``, whole to each shard.
- static: Python numbers, strings, None and other hashable objects; part of
  the trace key, so a new value traces a new graph.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tfshard import _kinds, _trees
from tfshard.errors import ArgumentError

# tf.split's sizes and the plan's arithmetic are exact below this many rows.
MAX_ROWS = 2**31


def integer(value: Any) -> int | None:
    """`value` as a Python int where it is an integer, else None: tfshard's one rule for
    where an int is asked (a count, an index, a position, a GPU index). A NumPy integer
    is one (``np.int64(2)``); a bool is not (``True`` is no count of 1), nor an array
    or a tensor."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def check_flag(value: Any, name: str, call: str, *, none: str = "") -> None:
    """Refuses a flag that is not a bool or a NumPy bool (``overwrite="no"`` would read as
    true): tfshard's one rule for flags. With `none`, what None (the default) means
    there, None is taken too. `call` begins the message (none where it is "")."""
    if none and value is None:
        return
    if not isinstance(value, (bool, np.bool_)):
        start = f"{call}: " if call else ""
        kind = type(value).__name__
        kind = "None" if value is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
        if none:
            raise ArgumentError(
                f"{start}{name}={value!r} must be True, False or None, not {kind} "
                f"(None, the default: {none})"
            )
        raise ArgumentError(f"{start}{name}={value!r} must be True or False, not {kind}")


# Why a NumPy array's dtype can be no input (`_kinds.numpy_problem`), once per dtype: a
# call's every array leaf asks.
_numpy_problem = functools.lru_cache(maxsize=None)(_kinds.numpy_problem)


class LeafKey(NamedTuple):
    """What a trace depends on of one leaf."""

    kind: str  # "split", "broadcast" or "static"
    spec: Hashable  # a tensor's spec key; a static leaf's (type, value)
    device: str = ""  # a split tensor's device: the graph splits it there


class TraceKey(NamedTuple):
    """Everything a traced graph depends on; equal keys share a graph."""

    structures: tuple[Hashable, ...]  # one per top-level argument
    kwarg_names: tuple[str, ...]
    num_positional: int
    leaves: tuple[LeafKey, ...]

    @property
    def split_devices(self) -> list[str]:
        """Where each split tensor lives ("" when not known): the graph splits it there."""
        return [leaf.device for leaf in self.leaves if leaf.kind == "split"]


class Template(NamedTuple):
    """Rebuilds a call's arguments from the graph's tensors."""

    names: tuple[str, ...]  # one per top-level argument, for messages
    structures: tuple[Hashable, ...]
    kinds: tuple[tuple[str, ...], ...]  # leaf kinds, per top-level argument
    statics: tuple[tuple[Any, ...], ...]  # static leaf values, per argument
    num_positional: int
    kwarg_names: tuple[str, ...]
    split_count: int

    def rebuild(
        self, split: Sequence[Any], shared: Sequence[Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """The positional and keyword arguments, with these split and broadcast leaves."""
        split_it, shared_it = iter(split), iter(shared)
        sources = {"split": split_it, "broadcast": shared_it}
        built = []
        for structure, kinds, statics in zip(self.structures, self.kinds, self.statics):
            static_it = iter(statics)
            leaves = [next(sources.get(kind, static_it)) for kind in kinds]
            built.append(_trees.build(structure, iter(leaves)))
        args = built[: self.num_positional]
        return args, dict(zip(self.kwarg_names, built[self.num_positional :]))

    def split_paths(self) -> list[str]:
        """The readable path of every split leaf, in the graph's input order."""
        return [
            path
            for name, structure, kinds in zip(self.names, self.structures, self.kinds)
            for path, kind in zip(_trees.paths(name, structure), kinds)
            if kind == "split"
        ]

    def listed(self) -> list[tuple[str, int]]:
        """Arguments given as a plain list or tuple of two or more arrays: (name, how many).

        tfshard reads such a list as a structure of separate arguments and
        splits each array along its first axis; a list of samples meant as one
        batch (``f([image1, image2])``) is the usual reason a call fails then.
        """
        return [
            (name, len(kinds))
            for name, structure, kinds in zip(self.names, self.structures, self.kinds)
            if listed_arrays(structure) and set(kinds) == {"split"}
        ]

    def element_kinds(self, count: int) -> list[str]:
        """The leaf kinds of the first `count` top-level arguments, flattened."""
        return [kind for kinds in self.kinds[:count] for kind in kinds]


class Call(NamedTuple):
    """One call's arguments, classified."""

    key: TraceKey
    tensors: list[Any]  # split tensors, then broadcast tensors (the graph's inputs)
    rows: int | None  # the leading dimension, when known in Python
    template: Template

    def specs(self, exact: bool = False) -> list[tf.TypeSpec]:
        """The graph's input specs: split tensors with any number of rows, or with
        exactly theirs (`exact`)."""
        count = 0 if exact else self.template.split_count
        return [type_spec(t, split=i < count) for i, t in enumerate(self.tensors)]


# Words the error for split tensors whose rows differ (`Arguments.classify`).
RowsDiffer = Callable[[str, str, str], Exception | None]


class _Sorted:
    """The leaves of one call as they are sorted (a scratch pad for `classify`)."""

    def __init__(self, rows_differ: RowsDiffer | None) -> None:
        self.rows_differ = rows_differ
        self.split: list[Any] = []
        self.shared: list[Any] = []
        self.keys: list[LeafKey] = []
        self.rows: int | None = None
        self.rows_from = ""  # the path of the first leaf with known rows
        self.rows_name = ""  # and its argument's name


class Arguments:
    """The parameters of a function, and how each call's arguments are sorted.

    Args:
      fn: the user's function (its signature names the arguments).
      broadcast: names or positions of arguments that go whole to every shard.
      name: the function's name, for messages.
    """

    def __init__(self, fn: Callable[..., Any], broadcast: Any, name: str) -> None:
        if broadcast is None:
            broadcast = ()
        if isinstance(broadcast, str) or integer(broadcast) is not None:
            broadcast = (broadcast,)
        if isinstance(broadcast, bytes | bytearray):  # not a sequence of positions
            raise ArgumentError(
                f"broadcast={broadcast!r} is bytes; name arguments with str, e.g. "
                f"broadcast=({bytes(broadcast).decode(errors='replace')!r},), or give "
                "their positions as ints"
            )
        if not isinstance(broadcast, Sequence | set | frozenset):
            raise ArgumentError(
                f"broadcast={broadcast!r}: pass a tuple of argument names or positions, "
                "e.g. broadcast=('weights',) or broadcast=(1,); () broadcasts nothing"
            )
        self.name = name
        self.signature = _signature(fn)
        params = self.signature.parameters.values() if self.signature else ()
        self.positional = tuple(
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
        # A NumPy integer is the position it holds; entries are checked before hashing.
        entries = [entry if integer(entry) is None else integer(entry) for entry in broadcast]
        self._check_broadcast(fn, entries)
        self.broadcast = frozenset(entries)
        # A position also names its parameter, so passing it by keyword still broadcasts.
        self._broadcast_names = self.broadcast | {
            self.positional[b]
            for b in self.broadcast
            if isinstance(b, int) and b < len(self.positional)
        }
        self._bindable: set[tuple[int, tuple[str, ...]]] = set()

    def _check_broadcast(self, fn: Callable[..., Any], entries: Sequence[Any]) -> None:
        params = self.signature.parameters if self.signature else None
        fn_name = getattr(fn, "__name__", "fn")
        for entry in entries:
            if isinstance(entry, bool) or not isinstance(entry, str | int):
                raise ArgumentError(
                    f"broadcast entry {entry!r}: name an argument (str) or position (int)"
                )
            if params is None:
                continue
            kinds = {p.kind for p in params.values()}
            if isinstance(entry, int):
                if entry < 0 or (
                    entry >= len(self.positional) and inspect.Parameter.VAR_POSITIONAL not in kinds
                ):
                    raise ArgumentError(
                        f"broadcast={entry!r}: a position must be 0..{len(self.positional) - 1} "
                        f"(the parameters of {fn_name}: {', '.join(params) or 'none'})"
                    )
            elif entry not in params and inspect.Parameter.VAR_KEYWORD not in kinds:
                raise ArgumentError(
                    f"broadcast names {entry!r}, but {fn_name} has no such parameter (it has "
                    f"{', '.join(params) or 'none'})"
                )

    def check_binds(self, args: Sequence[Any], kwarg_names: tuple[str, ...], kwargs: dict) -> None:
        """Raises ArgumentError when these arguments do not fit the signature.

        Whether arguments bind depends only on how many and which names, so
        each arity is checked once.
        """
        arity = (len(args), kwarg_names)
        if self.signature is None or arity in self._bindable:
            return
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as error:
            # bind names one problem, a missing argument before an unknown keyword; Python's
            # own call names the unknown keyword, so it is named first here too.
            params = self.signature.parameters
            takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
            unknown = [k for k in kwarg_names if k not in params and not takes_any]
            problems = [f"got an unexpected keyword argument {k!r}" for k in unknown]
            if "unexpected keyword" not in str(error):
                problems.append(str(error))
            raise ArgumentError(
                f"{self.name}(...): {'; '.join(problems)} (its parameters: "
                f"{', '.join(params) or 'none'})"
            ) from None
        self._bindable.add(arity)

    def names(self, count: int, kwarg_names: Sequence[str]) -> list[str]:
        """The names of `count` positional arguments, then the keyword ones."""
        positional = [
            self.positional[i] if i < len(self.positional) else f"args[{i}]" for i in range(count)
        ]
        return positional + list(kwarg_names)

    def classify(
        self, args: Sequence[Any], kwargs: dict[str, Any], rows_differ: RowsDiffer | None = None
    ) -> Call:
        """Sorts the arguments' leaves into split, broadcast and static.

        `rows_differ`, where given, may word the error for split tensors of
        different row counts: ``rows_differ(differ, name, first)`` hears what
        differs (``"b has 4 rows but a has 3"``) and the two arguments' names,
        and returns the error to raise, or None for the call's own.

        Raises:
          ArgumentError: arguments that do not bind, leaves that are neither
            tensors nor hashable, split tensors of different row counts,
            scalars or sparse tensors to split, or nothing to split.
        """
        kwarg_names = tuple(sorted(kwargs))
        self.check_binds(args, kwarg_names, kwargs)
        names = self.names(len(args), kwarg_names)
        values = [*args, *(kwargs[k] for k in kwarg_names)]
        found = _Sorted(rows_differ)
        structures, kinds, statics = [], [], []
        for position, (name, value) in enumerate(zip(names, values)):
            leaves, structure = _trees.flatten(value, name)
            structures.append(structure)
            broadcast = name in self._broadcast_names or (
                position < len(args) and position in self.broadcast
            )
            leaf_kinds, leaf_statics = [], []
            for i, leaf in enumerate(leaves):
                kind = self._sort_leaf(leaf, broadcast, found, name, structure, i)
                leaf_kinds.append(kind)
                if kind == "static":
                    leaf_statics.append(leaf)
            kinds.append(tuple(leaf_kinds))
            statics.append(tuple(leaf_statics))
        if found.rows is not None and found.rows >= MAX_ROWS:
            raise ArgumentError(
                f"{found.rows_from} has {found.rows} rows; tfshard splits batches of fewer "
                f"than 2**31 rows: call {self.name} on parts of it (or stream it as a "
                "tf.data.Dataset of batches)"
            )
        if not found.split:
            given = [*args, *kwargs.values()]
            if any(isinstance(v, Iterator) and as_tensor(v) is None for v in given):
                raise ArgumentError(
                    f"{self.name}() got a Python generator or iterator, which tfshard cannot "
                    "split; wrap it as a dataset, tf.data.Dataset.from_generator(gen, "
                    "output_signature=...), and pass that (each element one batch, or "
                    "single samples with batch_size=N)"
                )
            shared = [n for n, k in zip(names, kinds) if "broadcast" in k]
            if shared:
                listed = ", ".join(repr(_entry(n)) for n in shared)
                raise ArgumentError(
                    f"{self.name}() got no tensor or array to split across devices: "
                    f"broadcast= sends {listed} whole to every shard, so no argument is left "
                    "to split; keep the batch out of broadcast= (broadcast only what every "
                    "shard needs whole, such as weights or a table)"
                )
            raise ArgumentError(
                f"{self.name}() got no tensor or array to split across devices; pass "
                "a tf.Tensor or NumPy array with a batch dimension (a Python list is a "
                "structure of constants: use np.asarray(...)), or a tf.data.Dataset"
            )
        key = TraceKey(tuple(structures), kwarg_names, len(args), tuple(found.keys))
        try:
            hash(key)
        except TypeError:
            raise ArgumentError(
                f"{self.name}(): a constant argument is not hashable; pass tensors or "
                "hashable values"
            ) from None
        template = Template(
            tuple(names),
            tuple(structures),
            tuple(kinds),
            tuple(statics),
            len(args),
            kwarg_names,
            len(found.split),
        )
        return Call(key, found.split + found.shared, found.rows, template)

    def _sort_leaf(
        self, leaf: Any, broadcast: bool, found: _Sorted, name: str, structure: Hashable, i: int
    ) -> str:
        """Files one leaf in `found`; returns its kind."""
        if isinstance(leaf, np.ndarray | np.generic) and (problem := _numpy_problem(leaf.dtype)):
            raise ArgumentError(f"{_trees.path(name, structure, i)} {problem}")
        tensor = as_tensor(leaf)
        if tensor is None:
            if isinstance(leaf, tf.data.Dataset):
                raise ArgumentError(
                    f"{_trees.path(name, structure, i)} is a tf.data.Dataset; to stream it, "
                    f"pass a dataset as the first positional argument of a call, "
                    f"{self.name}(dataset, ...); anywhere else pass tensors or arrays"
                )
            if not isinstance(leaf, Hashable):
                raise ArgumentError(
                    f"{_trees.path(name, structure, i)} is a {type(leaf).__name__}, which is "
                    "neither a tensor nor a hashable constant; pass a tensor or array, or a "
                    "hashable value"
                )
            found.keys.append(LeafKey("static", (type(leaf), leaf)))
            return "static"
        if broadcast:
            found.shared.append(tensor)
            found.keys.append(LeafKey("broadcast", spec_key(tensor, split=False)))
            return "broadcast"
        _kinds.of(tensor).check_split(_trees.path(name, structure, i), _entry(name))
        if tensor.shape.rank == 0:
            where = _trees.path(name, structure, i)
            if _is_sequence(structure):
                raise ArgumentError(
                    f"{where} is a scalar (rank 0): {name} is a Python {structure.kind.__name__} "
                    "of scalars, which tfshard reads as a structure of separate values, not a "
                    f"batch; pass np.asarray({name}) (or tf.stack({name})) to split it as a "
                    f"batch of {len(structure.children)} rows"
                )
            raise ArgumentError(
                f"{where} is a scalar (rank 0), so it has no rows to split; pass it in "
                f"broadcast=({_entry(name)!r},) to give every shard the same value, or as a Python "
                "number"
            )
        n = tensor.shape[0]
        if n is not None:
            if found.rows is None:
                found.rows, found.rows_from = n, _trees.path(name, structure, i)
                found.rows_name = name
            elif n != found.rows:
                where = _trees.path(name, structure, i)
                differ = f"{where} has {n} rows but {found.rows_from} has {found.rows}"
                worded = found.rows_differ and found.rows_differ(differ, name, found.rows_name)
                if worded is not None:
                    raise worded
                if found.rows_name == name and listed_arrays(structure):
                    # A list of arrays of different sizes: samples, most likely.
                    raise ArgumentError(
                        f"{where} has {n} rows but {found.rows_from} has {found.rows}: {name} "
                        "is a Python list of arrays, which tfshard takes as separate "
                        "arguments, each split along its first axis. If they are samples, "
                        "make them one batch: resize or pad them to one shape and "
                        f"np.stack({name}) (or tf.ragged.stack for lengths that vary); to "
                        f"give every shard the whole list, pass broadcast=({_entry(name)!r},)"
                    )
                raise ArgumentError(
                    f"{where} has {n} rows but {found.rows_from} has "
                    f"{found.rows}; every split argument needs the same leading dimension (pass "
                    f"{name} in broadcast=({_entry(name)!r},) to copy it whole to each device)"
                )
        found.split.append(tensor)
        found.keys.append(LeafKey("split", spec_key(tensor, split=True), device_of(tensor)))
        return "split"


def _entry(name: str) -> str | int:
    """What names argument `name` in broadcast=: its name, or its position if it came in *args."""
    return int(name[5:-1]) if name.startswith("args[") else name


def _is_sequence(structure: Hashable) -> bool:
    """Whether a structure key is a plain list or tuple (not a namedtuple)."""
    return isinstance(structure, _trees.SequenceNode) and not hasattr(structure.kind, "_fields")


def listed_arrays(structure: Hashable) -> bool:
    """Whether a structure key is a plain list or tuple of two or more leaves."""
    return (
        _is_sequence(structure)
        and len(structure.children) >= 2
        and all(child is _trees.LEAF for child in structure.children)
    )


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def as_tensor(value: Any) -> Any:
    """`value` as a tensor when it is tensor-like; None for anything else."""
    if isinstance(value, tf.Tensor | tf.RaggedTensor | tf.SparseTensor):
        return value  # A SparseTensor is broadcast whole; refused as a split argument.
    if isinstance(value, tf.Variable):
        return tf.convert_to_tensor(value)
    if isinstance(value, np.ndarray | np.generic):
        return tf.convert_to_tensor(value)
    return None


def type_spec(t: Any, split: bool) -> tf.TypeSpec:
    """The spec of `t` as a graph input; a split tensor's rows are left open."""
    return _kinds.of(t).batch_spec(t, split)


def spec_key(t: Any, split: bool) -> Hashable:
    """What a trace depends on of `t`: `type_spec`, or for a dense tensor its dtype and
    shape, which say the same without building a TensorSpec on every call."""
    if isinstance(t, tf.Tensor) and t.shape.rank is not None:
        dims = tuple(t.shape)
        return (t.dtype, dims[1:] if split else dims)
    return type_spec(t, split)


def device_of(t: Any) -> str:
    """Where an eager tensor lives; "" inside a graph, where it is not known yet."""
    if not tf.executing_eagerly():
        return ""
    return _kinds.of(t).device(t)


def row_spec(t: Any) -> tf.TypeSpec:
    """The spec of one row of `t` (a tensor or a batch's TypeSpec), as a function sees it."""
    return _kinds.of(t).row_spec(t)
