"""Nested values: flatten to leaves and a hashable structure key, rebuild, name paths.

The one tree walker of tfshard: arguments, outputs, dataset element specs and
signatures all go through it, so a leaf has one order and one readable path
(``x['a'][1]``) everywhere.

Structures are what `tf.nest` takes for structures: tuples, lists, namedtuples,
mappings (leaves in sorted key order; rebuilt in their written order as their
own type, an OrderedDict as one, a defaultdict with its default_factory) and
attrs classes (fields in declaration order). Everything else, tensors and
composite tensors included, is a leaf.

A hand-written walker rather than `tf.nest`, because every call needs a
hashable key of the structure for its trace key, and `tf.nest` would take a
second pass for it. The walk builds no path strings: a path is built only for
an error, by a second walk.

Its rules are tf.nest's (tests/test_trees.py checks them against tf.nest), and
a mapping whose keys cannot be sorted (mixed types) is refused with the path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from tfshard.errors import ArgumentError

# The structure key of a leaf. Any other value's key is one of the nodes below:
# hashable, and equal exactly when two values have the same structure.
LEAF = None


class SequenceNode(NamedTuple):
    """A list, tuple or namedtuple: its type and its items' keys."""

    kind: type
    children: tuple[Hashable, ...]


class MappingNode(NamedTuple):
    """A mapping: its type, its keys sorted (the leaf order), their children's keys,
    its keys in written order (how it is rebuilt), and a defaultdict's factory."""

    kind: type
    keys: tuple[Any, ...]
    children: tuple[Hashable, ...]
    written: tuple[Any, ...]
    factory: Any


class AttrsNode(NamedTuple):
    """An attrs class: its type, its field names in order, their children's keys."""

    kind: type
    keys: tuple[str, ...]
    children: tuple[Hashable, ...]


def flatten(value: Any, where: str = "value") -> tuple[list[Any], Hashable]:
    """The leaves of `value` in `tf.nest` order, and a hashable key of its structure.

    Args:
      value: any nested value.
      where: its name, for the path in an error (``"x"`` gives ``x['a']``).

    Raises:
      ArgumentError: a mapping's keys cannot be sorted (keys of mixed types).

    >>> leaves, key = flatten({"b": 1, "a": (2, 3)})
    >>> leaves
    [2, 3, 1]
    >>> build(key, iter("xyz"))
    {'b': 'z', 'a': ('x', 'y')}
    """
    leaves: list[Any] = []
    try:
        return leaves, _walk(value, leaves)
    except _UnsortableKeys as error:
        # Only now is the path worth building: a second walk, to the bad mapping.
        raise ArgumentError(
            f"{_path_to(value, error.mapping, where)} is a dict with keys of mixed types "
            f"({_key_types(error.mapping)}); tfshard orders a dict's leaves by sorted key, "
            "as tf.nest does, so use keys of one type (e.g. all str)"
        ) from None


class _UnsortableKeys(Exception):
    def __init__(self, mapping: Mapping[Any, Any]) -> None:
        super().__init__()
        self.mapping = mapping


def _walk(value: Any, leaves: list[Any]) -> Hashable:
    # A plain recursive function, not a closure: a recursive closure is a
    # reference cycle on every call, which keeps whole batches alive until gc.
    # No paths here: this runs on every call; `_path_to` builds one for an error.
    if isinstance(value, list | tuple):
        return SequenceNode(type(value), tuple(_walk(v, leaves) for v in value))
    if isinstance(value, Mapping):
        try:
            keys = sorted(value)
        except TypeError:
            raise _UnsortableKeys(value) from None
        children = tuple(_walk(value[k], leaves) for k in keys)
        # A defaultdict's factory is part of it (tf.nest rebuilds with it), and so of
        # the trace key: a new factory traces again, as any Python constant does.
        factory = value.default_factory if isinstance(value, defaultdict) else None
        return MappingNode(type(value), tuple(keys), children, tuple(value), factory)
    fields = getattr(type(value), "__attrs_attrs__", None)
    if fields is not None:
        names = tuple(f.name for f in fields)
        children = tuple(_walk(getattr(value, n), leaves) for n in names)
        return AttrsNode(type(value), names, children)
    leaves.append(value)
    return LEAF


def _path_to(value: Any, target: Any, where: str) -> str | None:
    """The path of `target` (by identity) inside `value`, or None."""
    if value is target:
        return where
    if isinstance(value, list | tuple):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(value, Mapping):
        children = [(f"{where}[{k!r}]", v) for k, v in value.items()]
    elif getattr(type(value), "__attrs_attrs__", None) is not None:
        children = [(f"{where}.{f.name}", getattr(value, f.name)) for f in value.__attrs_attrs__]
    else:
        return None
    for path, child in children:
        found = _path_to(child, target, path)
        if found is not None:
            return found
    return None


def _key_types(mapping: Mapping[Any, Any]) -> str:
    return ", ".join(sorted({type(k).__name__ for k in mapping}))


def build(key: Hashable, leaves: Iterator[Any]) -> Any:
    """The inverse of `flatten`: the structure of `key` with these leaves, in order."""
    if key is LEAF:
        return next(leaves)
    kind = key.kind
    if isinstance(key, SequenceNode):
        items = [build(sub, leaves) for sub in key.children]
        return kind(*items) if hasattr(kind, "_fields") else kind(items)
    built = {name: build(sub, leaves) for name, sub in zip(key.keys, key.children)}
    if isinstance(key, AttrsNode):  # its fields in order, as tf.nest rebuilds it
        return kind(*built.values())
    items = [(k, built[k]) for k in key.written]
    try:
        if issubclass(kind, defaultdict):  # as tf.nest: the same type, the same factory
            return kind(key.factory, items)
        return kind(items)
    except TypeError:  # a mapping with another constructor
        return dict(items)


def fold(key: Hashable, leaf: Callable[[], Any], node: Callable[[Hashable, list[Any]], Any]) -> Any:
    """`key` folded bottom up: ``leaf()`` at each leaf, ``node(key, results)`` at
    each node (`results` its children's), in leaf order.

    >>> fold(flatten({"b": 1, "a": (2, 3)})[1], lambda: 1, lambda key, counts: sum(counts))
    3
    """
    if key is LEAF:
        return leaf()
    return node(key, [fold(child, leaf, node) for child in key.children])


def labels(key: Hashable) -> tuple[Any, ...]:
    """A node's child labels in leaf order: indices (a namedtuple's fields),
    sorted keys, or attrs fields.

    >>> labels(flatten({"b": 1, "a": 2})[1])
    ('a', 'b')
    """
    if isinstance(key, SequenceNode):
        return tuple(getattr(key.kind, "_fields", range(len(key.children))))
    return key.keys


def has_defaultdict(key: Hashable) -> bool:
    """Whether `key` holds a defaultdict (a `tf.function` returns one as a plain dict)."""
    if key is LEAF:
        return False
    mine = isinstance(key, MappingNode) and issubclass(key.kind, defaultdict)
    return mine or any(has_defaultdict(sub) for sub in key.children)


def map_leaves(fn: Any, value: Any) -> Any:
    """`value` with `fn` applied to each leaf (`tf.nest.map_structure` of one value)."""
    leaves, key = flatten(value)
    return build(key, map(fn, leaves))


def paths(prefix: str, key: Hashable) -> list[str]:
    """The readable path of every leaf under `key`, in leaf order.

    >>> paths("x", flatten({"a": [1, 2], "b": 3})[1])
    ["x['a'][0]", "x['a'][1]", "x['b']"]
    """
    found: list[str] = []
    _visit(key, prefix, found)
    return found


def path(prefix: str, key: Hashable, index: int) -> str:
    """The readable path of leaf number `index` under `key`."""
    return paths(prefix, key)[index]


def _visit(key: Hashable, where: str, found: list[str]) -> None:
    if key is LEAF:
        found.append(where)
    elif isinstance(key, SequenceNode):
        for i, sub in enumerate(key.children):
            _visit(sub, f"{where}[{i}]", found)
    else:
        attrs = isinstance(key, AttrsNode)
        for name, sub in zip(key.keys, key.children):
            _visit(sub, f"{where}.{name}" if attrs else f"{where}[{name!r}]", found)


def first_difference(prefix: str, ours: Hashable, theirs: Hashable) -> str:
    """The path of a leaf in one structure but not the other (else `prefix`)."""
    a, b = paths(prefix, ours), paths(prefix, theirs)
    only: Iterable[str] = [p for p in a if p not in b] or [p for p in b if p not in a]
    return next(iter(only), prefix)
