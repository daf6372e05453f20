"""_trees: the one tree walker, checked against tf.nest (the rules it matches)."""

import collections
from typing import NamedTuple

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from tfshard import _trees
from tfshard.errors import ArgumentError

Point = collections.namedtuple("Point", "x y")


class _Field(NamedTuple):
    name: str


class Pair:
    """An attrs class as tf.nest sees one (the `__attrs_attrs__` protocol), without attrs."""

    __attrs_attrs__ = (_Field("first"), _Field("second"))

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __eq__(self, other):
        return type(other) is Pair and (self.first, self.second) == (other.first, other.second)


def _zero():
    return 0


leaves = st.integers() | st.text(max_size=3) | st.none() | st.floats(allow_nan=False)
trees = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=2), children, max_size=3)
        | st.dictionaries(st.text(max_size=2), children, max_size=3).map(
            lambda d: collections.OrderedDict(reversed(d.items()))
        )
        | st.builds(
            collections.defaultdict,
            st.sampled_from([None, int, list, _zero]),
            st.dictionaries(st.text(max_size=2), children, max_size=3),
        )
        | st.builds(Point, children, children)
        | st.builds(Pair, children, children)
    ),
    max_leaves=12,
)


@given(trees)
def test_flatten_matches_tf_nest_and_build_inverts_it(value):
    leaves_, key = _trees.flatten(value)
    assert leaves_ == tf.nest.flatten(value)
    rebuilt = _trees.build(key, iter(leaves_))
    assert rebuilt == value
    # The same types all the way down, as tf.nest rebuilds them (a defaultdict
    # with its factory, dicts in written order), not merely equal values.
    assert _types(rebuilt) == _types(value) == _types(tf.nest.pack_sequence_as(value, leaves_))


def _types(value):
    """`value`'s structure as types, factories and key orders, for exact comparison."""
    if isinstance(value, list | tuple):
        return (type(value), [_types(v) for v in value])
    if isinstance(value, dict):
        factory = getattr(value, "default_factory", "none")
        return (type(value), factory, [(k, _types(v)) for k, v in value.items()])
    if isinstance(value, Pair):
        return (Pair, _types(value.first), _types(value.second))
    return type(value)


@given(trees)
def test_paths_name_every_leaf_in_order(value):
    leaves_, key = _trees.flatten(value)
    paths = _trees.paths("x", key)
    assert len(paths) == len(leaves_) == len(set(paths))
    for path, leaf in zip(paths, leaves_):
        # Each path, read as Python, finds its leaf.
        found = eval(path, {"x": value})  # noqa: S307 - paths are our own subscripts
        assert found is leaf or found == leaf


@given(trees, trees)
def test_equal_keys_mean_equal_structures(a, b):
    same = _trees.flatten(a)[1] == _trees.flatten(b)[1]
    try:
        tf.nest.assert_same_structure(a, b, check_types=True)
        nest_same = True
    except (ValueError, TypeError):
        nest_same = False
    if same:
        assert nest_same


def test_dict_keeps_written_order_and_types():
    value = collections.OrderedDict([("b", 1), ("a", 2)])
    leaves_, key = _trees.flatten(value)
    assert leaves_ == [2, 1]
    rebuilt = _trees.build(key, iter([20, 10]))
    assert isinstance(rebuilt, collections.OrderedDict)
    assert list(rebuilt.items()) == [("b", 10), ("a", 20)]


def test_defaultdict_rebuilds_with_its_factory_as_tf_nest_does():
    counts = collections.defaultdict(list, b=1, a=2)
    leaves_, key = _trees.flatten(counts)
    rebuilt = _trees.build(key, iter([20, 10]))
    expected = tf.nest.pack_sequence_as(counts, [20, 10])
    assert type(rebuilt) is type(expected) is collections.defaultdict
    assert rebuilt.default_factory is expected.default_factory is list
    assert list(rebuilt.items()) == list(expected.items()) == [("b", 10), ("a", 20)]
    # The factory is part of the structure: another one is another trace.
    assert _trees.flatten(collections.defaultdict(int, b=1, a=2))[1] != key


def test_tensors_and_composites_are_leaves():
    ragged = tf.ragged.constant([[1], [2, 3]])
    value = {"r": ragged, "t": tf.zeros([2]), "n": np.ones(3)}
    leaves_, _ = _trees.flatten(value)
    assert leaves_[1] is ragged and len(leaves_) == 3  # sorted keys: n, r, t


def test_mixed_key_types_name_the_path_and_the_fix():
    with pytest.raises(ArgumentError, match=r"x\[0\] is a dict with keys of mixed types"):
        _trees.flatten([{1: 1, "a": 2}], "x")


def test_map_leaves():
    assert _trees.map_leaves(lambda v: v * 2, Point(1, [2, 3])) == Point(2, [4, 6])


def test_first_difference():
    _, a = _trees.flatten({"a": 1, "b": 2})
    _, b = _trees.flatten({"a": 1})
    assert _trees.first_difference("outputs", a, b) == "outputs['b']"


@given(trees)
def test_fold_meets_every_leaf_in_order_with_the_labels_that_reach_it(value):
    leaves_, key = _trees.flatten(value)
    counter = iter(range(len(leaves_)))
    # Each leaf folded to (its number, the labels from the root to it).
    folded = _trees.fold(
        key,
        lambda: [(next(counter), ())],
        lambda node, children: [
            (n, (label, *labels))
            for label, found in zip(_trees.labels(node), children, strict=True)
            for n, labels in found
        ],
    )
    assert [n for n, _ in folded] == list(range(len(leaves_)))
    for (_, labels), leaf in zip(folded, leaves_):
        found = value  # the oracle: the value itself, read by each label
        for label in labels:
            found = getattr(found, label) if isinstance(label, str) and not isinstance(
                found, collections.abc.Mapping
            ) else found[label]
        assert found is leaf or found == leaf
