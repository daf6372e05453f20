"""_arguments: sorting one call's arguments into split, broadcast and static leaves."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfshard
from tfshard import _arguments, _trees
from tfshard.errors import ArgumentError


def fn(x, y=None, *rest, scale=1.0, **extra):
    return x


def arrays(rows):
    return st.sampled_from([np.float32, np.int64]).flatmap(
        lambda dtype: st.integers(0, 3).map(
            lambda width: np.arange(rows * width, dtype=dtype).reshape(rows, width)
        )
    )


def arguments_of(rows):
    """A nested argument whose leaves are arrays of `rows` rows and hashable constants."""
    leaf = arrays(rows) | st.integers() | st.text(max_size=2) | st.none()
    return st.recursive(
        leaf,
        lambda children: (
            st.lists(children, max_size=3)
            | st.lists(children, max_size=3).map(tuple)
            | st.dictionaries(st.sampled_from("abc"), children, max_size=3)
        ),
        max_leaves=6,
    )


def _same(a, b):
    a_leaves, a_key = _trees.flatten(a)
    b_leaves, b_key = _trees.flatten(b)
    assert a_key == b_key
    for u, v in zip(a_leaves, b_leaves):
        if isinstance(u, np.ndarray):
            np.testing.assert_array_equal(np.asarray(v), u)
        else:
            assert u == v and type(u) is type(v)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 5).flatmap(lambda n: st.tuples(st.just(n), arrays(n), arguments_of(n))))
def test_classify_then_rebuild_gives_the_arguments_back(case):
    rows, x, y = case
    arguments = _arguments.Arguments(fn, (), "fn")
    call = arguments.classify((x, y), {"scale": 2.0})
    count = call.template.split_count
    args, kwargs = call.template.rebuild(call.tensors[:count], call.tensors[count:])
    _same((x, y), tuple(args))
    assert kwargs == {"scale": 2.0}
    assert call.rows == rows
    assert all(leaf.kind == "split" for leaf in call.key.leaves if leaf.kind != "static")


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 6), st.integers(0, 6))
def test_the_trace_key_ignores_the_batch_size_only(a, b):
    arguments = _arguments.Arguments(fn, (), "fn")
    key_a = arguments.classify((np.zeros([a, 3], np.float32),), {}).key
    key_b = arguments.classify((np.zeros([b, 3], np.float32),), {}).key
    other = arguments.classify((np.zeros([a, 4], np.float32),), {}).key
    assert key_a == key_b != other
    assert hash(key_a) == hash(key_b)


def test_broadcast_by_name_or_position_goes_whole():
    table = np.ones([7, 2], np.float32)
    for broadcast in (("y",), (1,), "y", 1):
        arguments = _arguments.Arguments(fn, broadcast, "fn")
        for call in (
            arguments.classify((np.zeros([3, 2]), table), {}),
            arguments.classify((np.zeros([3, 2]),), {"y": table}),
        ):
            assert call.template.split_count == 1
            assert [leaf.kind for leaf in call.key.leaves] == ["split", "broadcast"]
            assert call.tensors[1].shape == [7, 2]


def test_split_devices_are_where_the_inputs_live():
    with tf.device("/device:CPU:2"):
        x = tf.zeros([4, 2])
    call = _arguments.Arguments(fn, (), "fn").classify((x, np.zeros([4])), {})
    assert call.key.split_devices[0].endswith("/device:CPU:2")
    assert len(call.key.split_devices) == 2


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((np.zeros([3, 2]), np.zeros([4])), {}, r"y has 4 rows but x has 3"),
        ((np.zeros([]),), {}, r"x is a scalar .*broadcast=\('x',\)"),
        ((tf.sparse.eye(3),), {}, r"x is a tf.SparseTensor.*to_dense"),
        ((np.zeros([3]), [np.zeros(3), {"a": {1}}]), {}, r"y\[1\]\['a'\] is a set.*hashable"),
        ((1, 2), {}, r"no tensor or array to split.*np.asarray"),
        ((np.zeros([3]),), {"nope": 1, "scale": {1: 2, "a": 3}}, r"scale is a dict with keys"),
        ((), {}, r"fn\(\.\.\.\): missing a required argument: 'x'"),
    ],
)
def test_bad_arguments_name_the_path_and_the_fix(args, kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        _arguments.Arguments(fn, (), "fn").classify(args, kwargs)


@pytest.mark.parametrize(
    "broadcast, message",
    [
        (("z",), r"broadcast names 'z', but g has no such parameter"),
        ((2,), r"broadcast=2: a position must be 0\.\.1"),
        ((True,), r"broadcast entry True: name an argument"),
        (object(), r"broadcast=<object.*pass a tuple of argument names"),
        (b"y", r"broadcast=b'y' is bytes; name arguments with str, e\.g\. broadcast=\('y',\)"),
    ],
)
def test_bad_broadcast_names_the_fix(broadcast, message):
    def g(x, y):
        return x

    with pytest.raises(ArgumentError, match=message):
        _arguments.Arguments(g, broadcast, "g")


def test_an_unknown_keyword_is_named_beside_a_missing_argument():
    def g(a, b):
        return a

    # Python's own call names the unknown keyword (TypeError: g() got an unexpected ...).
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'c'"):
        g(np.zeros([3]), c=np.zeros([3]))
    with pytest.raises(
        ArgumentError,
        match=r"^g\(\.\.\.\): got an unexpected keyword argument 'c'; missing a required "
        r"argument: 'b' \(its parameters: a, b\)$",
    ):
        _arguments.Arguments(g, (), "g").classify((np.zeros([3]),), {"c": np.zeros([3])})


def test_broadcasting_the_only_tensor_says_broadcast_took_it():
    def g(x, scale=1.0):
        return x

    with pytest.raises(
        ArgumentError,
        match=r"no tensor or array to split across devices: broadcast= sends 'x' whole to "
        r"every shard, so no argument is left to split; keep the batch out of broadcast=",
    ):
        _arguments.Arguments(g, 0, "g").classify((np.zeros([3]),), {"scale": 2.0})


@pytest.mark.parametrize("broadcast", [np.int64(1), (np.int32(1),), [np.uint8(1)]])
def test_a_numpy_integer_broadcasts_the_position_it_holds(broadcast):
    arguments = _arguments.Arguments(fn, broadcast, "fn")
    assert arguments.broadcast == frozenset({1})
    call = arguments.classify((np.zeros([3, 2]), np.ones([7, 2])), {})
    assert [leaf.kind for leaf in call.key.leaves] == ["split", "broadcast"]


@pytest.mark.parametrize("broadcast", [np.True_, (np.True_,), [["y"]]])
def test_a_broadcast_entry_that_is_no_name_or_position_is_refused(broadcast):
    with pytest.raises(ArgumentError, match=r"broadcast.*(name an argument|pass a tuple)"):
        _arguments.Arguments(fn, broadcast, "fn")


@pytest.mark.parametrize(
    "value, want",
    [(2, 2), (np.int64(2), 2), (np.uint8(0), 0), (True, None), (np.True_, None), (2.0, None),
     ("2", None), (np.array(2), None), (None, None)],
)  # fmt: skip
def test_integer_is_a_python_or_numpy_integer_and_never_a_bool(value, want):
    got = _arguments.integer(value)
    assert got == want and type(got) is type(want)


def test_broadcast_none_broadcasts_nothing():
    assert _arguments.Arguments(fn, None, "fn").broadcast == frozenset()


def test_row_spec():
    ragged = tf.ragged.constant([[[1.0]], [[2.0], [3.0]]], ragged_rank=1)
    assert _arguments.row_spec(ragged) == tf.TensorSpec([None, 1], tf.float32)
    deeper = tf.ragged.constant([[[1], [2, 3]], [[4]]])
    assert _arguments.row_spec(deeper) == tf.RaggedTensorSpec([None, None], tf.int32, 1)
    assert _arguments.row_spec(tf.zeros([5, 2])) == tf.TensorSpec([2], tf.float32)


@pytest.mark.parametrize(
    "batch", [[np.str_("ab"), np.str_("c")], [np.float32(1), np.float32(2)], list(tf.range(2))]
)
def test_a_list_of_scalars_says_to_stack_it(batch):
    with pytest.raises(
        ArgumentError,
        match=r"x\[0\] is a scalar \(rank 0\): x is a Python list of scalars.*"
        r"np\.asarray\(x\) \(or tf\.stack\(x\)\) to split it as a batch of 2 rows",
    ):
        _arguments.Arguments(fn, (), "fn").classify((batch,), {})


def test_a_star_args_argument_is_named_by_position_in_the_broadcast_hint():
    def g(x, *rest):
        return x

    arguments = _arguments.Arguments(g, (), "g")
    with pytest.raises(ArgumentError, match=r"args\[1\] has 4 rows .* broadcast=\(1,\)"):
        arguments.classify((np.zeros([3]), np.zeros([4])), {})
    with pytest.raises(ArgumentError, match=r"args\[1\] is a scalar .* broadcast=\(1,\)"):
        arguments.classify((np.zeros([3]), np.float32(2)), {})
    # ... and that hint is accepted.
    call = _arguments.Arguments(g, (1,), "g").classify((np.zeros([3]), np.zeros([4])), {})
    assert [leaf.kind for leaf in call.key.leaves] == ["split", "broadcast"]


def test_an_object_array_is_named_by_its_path():
    with pytest.raises(ArgumentError, match=r"x\['a'\]\[1\] is a NumPy array of Python objects"):
        _arguments.Arguments(fn, (), "fn").classify(
            ({"a": [np.zeros(3), np.array([object()] * 3)]},), {}
        )


@pytest.mark.parametrize(
    "array, says",
    [
        (np.array(["2026-11-27"] * 4, "datetime64[D]"), r"datetime64\[D\].*x.astype\(np.int64\)"),
        (np.array([1, 2, 3, 4], "timedelta64[s]"), r"timedelta64\[s\].*x.astype\(np.int64\)"),
        (np.zeros(4, [("a", np.float32), ("b", np.int32)]), r"fields a, b"),
    ]
    + (
        [(np.zeros(4, np.longdouble), r"cannot hold")]
        if np.dtype(np.longdouble).itemsize > 8
        else []
    ),
)
def test_an_array_no_tensor_holds_is_refused_by_its_path_with_the_fix(array, says):
    f = tfshard.parallelize(lambda x, y: y, devices=["cpu:0", "cpu:1"], per_sample=False)
    with pytest.raises(ArgumentError, match=r"^y is .*" + says):
        f(np.zeros(4, np.float32), array)
    with pytest.raises((TypeError, ValueError)):  # TensorFlow itself takes none of them
        tf.convert_to_tensor(array)


def test_a_list_of_arrays_of_different_sizes_says_to_stack_them_not_only_to_broadcast():
    images = [np.zeros([8, 8, 3]), np.zeros([9, 9, 3])]
    with pytest.raises(ArgumentError) as raised:
        _arguments.Arguments(fn, (), "fn").classify((images,), {})
    message = str(raised.value)
    assert message.startswith("x[1] has 9 rows but x[0] has 8: x is a Python list of arrays")
    assert "np.stack(x)" in message and "tf.ragged.stack" in message
    # Two arguments of different rows keep the broadcast remedy alone.
    with pytest.raises(ArgumentError, match=r"^y has 4 rows but x has 3; .*broadcast=\('y',\)"):
        _arguments.Arguments(fn, (), "fn").classify((np.zeros([3]), np.zeros([4])), {})
