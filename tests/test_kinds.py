"""_kinds: the dense and ragged adapters, each against NumPy / Python lists.

Every member a step uses is exercised for both kinds: split then gather
round-trips every row in order, rows and row counts agree with the value,
an empty batch has the spec's kind and inner shape, and specs open rows.
"""

import re

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfshard import _kinds, collect

HOST = "/device:CPU:0"


def _value(kind: str, rows: list[int]):
    """A batch with len(rows) rows: dense [n, 2], or ragged rows of these lengths."""
    if kind == "dense":
        return tf.reshape(tf.range(len(rows) * 2, dtype=tf.float32), [len(rows), 2])
    values, start = [], 0
    for length in rows:
        values.append(list(range(start, start + length)))
        start += length
    return tf.ragged.constant(values, dtype=tf.int32, ragged_rank=1, row_splits_dtype=tf.int64)


def _listed(t):
    return t.to_list() if isinstance(t, tf.RaggedTensor) else t.numpy().tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["dense", "ragged"]),
    rows=st.lists(st.integers(0, 3), max_size=9),
    cuts=st.lists(st.integers(0, 9), min_size=1, max_size=4),
)
def test_split_then_gather_gives_every_row_back_in_order(kind, rows, cuts):
    t = _value(kind, rows)
    adapter = _kinds.of(t)
    assert adapter is (_kinds.Ragged if kind == "ragged" else _kinds.Dense)
    # Shard sizes summing to the rows: the cut points, clipped and sorted.
    bounds = sorted(min(c, len(rows)) for c in cuts)
    sizes = np.diff([0, *bounds, len(rows)]).astype(np.int32)  # the plan's: int32

    @tf.function(autograph=False)
    def round_trip(t):
        pieces = adapter.split(t, tf.constant(sizes), len(sizes), HOST)
        return pieces, collect.gather_counted(pieces)

    pieces, (gathered, counts) = round_trip(t)
    assert [int(adapter.rows(p)) for p in pieces] == sizes.tolist()
    assert counts.numpy().tolist() == sizes.tolist()
    assert _listed(gathered) == _listed(t)
    assert int(adapter.row_count(t, None)) == len(rows)


@pytest.mark.parametrize("kind", ["dense", "ragged"])
def test_an_empty_batch_has_the_kind_and_inner_shape_of_its_spec(kind):
    t = _value(kind, [2, 0, 1])
    adapter = _kinds.of(t)
    spec = adapter.batch_spec(t, split=True)
    assert spec.shape[0] is None and spec.shape[1:] == t.shape[1:]
    assert adapter.any_rows(tf.type_spec_from_value(t)) == spec
    empty = adapter.empty(adapter.stacked_spec(spec))
    assert _kinds.of(empty) is adapter and int(adapter.rows(empty)) == 0
    assert adapter.batch_spec(empty, split=True).is_compatible_with(spec)


def test_a_row_of_a_ragged_batch_is_dense_one_rank_down():
    t = _value("ragged", [2, 0])
    assert _kinds.Ragged.row_spec(t) == tf.TensorSpec([None], tf.int32)
    assert _kinds.Ragged.sample_shape(t) is None
    assert _kinds.Dense.sample_shape(_value("dense", [1, 1])) == (2,)
    assert _kinds.Ragged.fixed_sample_shape(tf.type_spec_from_value(t))
    assert not _kinds.Dense.fixed_sample_shape(tf.TensorSpec([None, None]))


def _numpy_dtypes():
    """Every NumPy dtype this process knows (ml_dtypes' included), with units and fields."""
    found = {np.dtype(t) for t in np.sctypeDict.values()}
    found |= {np.dtype("datetime64[D]"), np.dtype("timedelta64[ms]"), np.dtype("U3")}
    found |= {np.dtype("S3"), np.dtype([("a", np.float32), ("b", np.int64)])}
    return sorted(found - {np.dtype(object)}, key=str)


@pytest.mark.parametrize("dtype", _numpy_dtypes(), ids=str)
def test_numpy_problem_names_exactly_the_dtypes_no_tensor_holds(dtype):
    try:
        tf.convert_to_tensor(np.zeros([2], dtype))  # the oracle: TensorFlow itself
    except ValueError:
        held = False
    else:
        held = True
    problem = _kinds.numpy_problem(dtype)
    assert (problem is None) == held, (dtype, problem)
    if problem is not None:
        assert problem.startswith("is a ")
        assert "; pass " in problem or "; convert it to " in problem


@pytest.mark.parametrize(
    "dtype, message",
    [
        (object, r"^is a NumPy array of Python objects; use a numeric dtype"),
        ("datetime64[D]", r"^is a NumPy array of datetime64\[D\], which TensorFlow cannot "
         r"hold; pass x\.astype\(np\.int64\), the time since 1970-01-01 in its unit$"),
        ("timedelta64[s]", r"of timedelta64\[s\], .*x\.astype\(np\.int64\), counts of its unit"),
        (np.longdouble, r"of float128, which TensorFlow cannot hold; pass x\.astype\(np\.float64"),
        (np.clongdouble, r"of complex256, .*; pass x\.astype\(np\.complex128\)$"),
        ([("a", np.float32)], r"^is a structured NumPy array \(fields a\), .*pass its fields"),
    ],
)
def test_numpy_problem_says_the_fix(dtype, message):
    if np.dtype(dtype) in (np.dtype(np.float64), np.dtype(np.complex128)):
        pytest.skip("long double is double on this platform")
    assert re.search(message, _kinds.numpy_problem(dtype))
