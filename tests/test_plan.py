"""_plan: shard sizes (in the graph and in Python) and the split, against exact references.

References are independent of tfshard: exact fractions for plans, NumPy for
round trips.
"""

from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfshard
from tfshard import _plan

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))


# ----------------------------------------------------------- plans, property


@pytest.mark.parametrize(
    "n, count, expected",
    [(0, 4, [0, 0, 0, 0]), (3, 4, [1, 1, 1, 0]), (8, 3, [3, 3, 2]), (9, 3, [3, 3, 3])],
)
def test_even_plans(n, count, expected):
    f = tfshard.parallelize(tf.identity, devices=CPUS[:count])
    assert f.plan(n) == expected


@pytest.mark.parametrize(
    "weights, n, expected",
    [
        ([3, 1], 10, [8, 2]),  # quotas 7.5, 2.5: the tie goes to the first device
        ([3, 1], 4, [3, 1]),
        ([0.7, 0.3], 10, [7, 3]),
        ([1, 1, 1], 10, [4, 3, 3]),
        ([1, 0], 5, [5, 0]),
        ([1, 2, 3, 4], 1, [0, 0, 0, 1]),
        ([1, 2, 3, 4], 7, [1, 1, 2, 3]),  # quotas .7 1.4 2.1 2.8
    ],
)
def test_weighted_plans_use_largest_remainder(weights, n, expected):
    f = tfshard.parallelize(tf.identity, devices=CPUS[: len(weights)], weights=weights)
    assert f.plan(n) == expected


def _largest_remainder(n, weights):
    """Independent reference with exact fractions."""

    total = sum(Fraction(w) for w in weights)
    quotas = [n * Fraction(w) / total for w in weights]
    base = [int(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda k: (-(quotas[k] - base[k]), k))
    for k in order[: n - sum(base)]:
        base[k] += 1
    return base


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 300),
    weights=st.one_of(
        st.integers(1, 4).map(lambda k: None),
        st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(lambda w: sum(w) > 0),
    ),
    count=st.integers(1, 4),
)
def test_plans_sum_to_n_and_follow_the_weights(n, weights, count):
    devices = CPUS[: len(weights)] if weights else CPUS[:count]
    sizes = tfshard.parallelize(tf.identity, devices=devices, weights=weights).plan(n)
    assert sum(sizes) == n and len(sizes) == len(devices)
    if weights is None:
        assert max(sizes) - min(sizes) <= 1
    else:
        assert sizes == _largest_remainder(n, weights)


_ROUND_TRIP = {}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 300),
    count=st.integers(1, 4),
    weights=st.none() | st.lists(st.integers(0, 5), min_size=4, max_size=4),
)
def test_every_sample_comes_back_once_in_order(n, count, weights):
    if weights is not None:
        weights = weights[:count]
        if sum(weights) == 0:
            weights[0] = 1
    key = (count, tuple(weights) if weights else None)
    if key not in _ROUND_TRIP:
        _ROUND_TRIP[key] = tfshard.parallelize(
            lambda s: {"id": s * 10, "tag": tf.stack([s, -s])},
            devices=CPUS[:count],
            weights=weights,
        )
    f = _ROUND_TRIP[key]
    ids = np.arange(n, dtype=np.int64)
    out = f(ids)
    assert out["id"].numpy().tolist() == (ids * 10).tolist()
    assert out["tag"].numpy().tolist() == np.stack([ids, -ids], 1).tolist()


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 10_000),
    weights=st.none() | st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(any),
)
def test_the_python_plan_is_the_graphs(n, weights):
    count = len(weights) if weights else 3
    weights = tuple(weights) if weights else None
    in_graph = _plan.plan_sizes(tf.constant(n, tf.int64), count, weights).numpy().tolist()
    assert _plan.plan_rows(n, count, weights) == in_graph


_INT32_PLANS = {}


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 10_000) | st.integers(2**31 - 10_000, 2**31 - 1),
    weights=st.none()
    | st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(any)
    | st.lists(st.integers(0, 20_000), min_size=2, max_size=3).filter(
        lambda w: any(w) and _plan.int32_weights(tuple(w)) is not None
    ),
)
def test_the_int32_plan_where_the_batch_is_is_the_pythons(n, weights):
    """`plan_sizes_int32` (even, or small-total static weights, reduced by their gcd)
    is `plan_rows` for every row count an int32 holds, the largest included."""
    count = len(weights) if weights else 3
    weights = tuple(weights) if weights else None
    reduced = _plan.int32_weights(weights)
    assert _plan.planned_where_the_batch_is(weights)
    plan = _INT32_PLANS.get((count, reduced))
    if plan is None:  # one trace per device count and weights: the rows are an input
        plan = _INT32_PLANS[(count, reduced)] = tf.function(
            lambda n: _plan.plan_sizes_int32(n, count, reduced), autograph=False
        ).get_concrete_function(tf.TensorSpec([], tf.int32))
    sizes = plan(tf.constant(n, tf.int32))
    assert sizes.dtype == tf.int32
    assert sizes.numpy().tolist() == _plan.plan_rows(n, count, weights)


def test_weights_of_a_large_total_and_fed_weights_are_planned_on_the_host():
    assert _plan.int32_weights((3, 6)) == (1, 2)
    assert _plan.int32_weights((2**23, 2**23 + 1)) is None  # a total of 2**24 + 1
    assert not _plan.planned_where_the_batch_is((2**23, 2**23 + 1))
    assert not _plan.planned_where_the_batch_is(tf.constant([1, 1], tf.int64))
    assert _plan.planned_where_the_batch_is(None)


_FED_PLANS = {}


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(0, 10_000),
    weights=st.lists(st.floats(0.0, 60.0), min_size=1, max_size=6).filter(any),
)
def test_weights_fed_at_run_time_plan_as_the_same_weights_traced(n, weights):
    """weights="auto" feeds its weights to the traced graph: the plan is the one of constants."""
    integer = _plan.integer_weights(weights)
    count = len(weights)
    plan = _FED_PLANS.get(count)
    if plan is None:  # one trace per device count: the weights are an input
        plan = _FED_PLANS[count] = tf.function(
            lambda n, w: _plan.plan_sizes(n, count, w), autograph=False
        ).get_concrete_function(tf.TensorSpec([], tf.int64), tf.TensorSpec([count], tf.int64))
    fed = plan(tf.constant(n, tf.int64), tf.constant(integer, tf.int64))
    assert fed.numpy().tolist() == _plan.plan_rows(n, count, integer)
    even = plan(tf.constant(n, tf.int64), tf.ones([count], tf.int64))
    assert even.numpy().tolist() == _plan.plan_rows(n, count, None)  # equal weights: even


# ------------------------------------------------------ plans under caps, property


def _water_filled(n, weights, caps):
    """Independent reference for a plan under caps, in exact fractions: the water level
    found by taking the devices in order of cap per weight (the first to fill first),
    each at its cap while its share of the rows left at that level passes it; the rest
    share the rows left by their weights (none left: every device by its weight, past
    the caps); then largest-remainder rounding of those real shares."""
    count = len(caps)
    w = weights or (1,) * count
    real = [Fraction(0)] * count
    open_ = [k for k in range(count) if w[k] > 0]
    left = Fraction(n)
    capped = [k for k in open_ if caps[k] is not None]
    for k in sorted(capped, key=lambda k: Fraction(caps[k], w[k])):
        if left * w[k] / sum(w[j] for j in open_) <= caps[k]:
            break
        real[k] = Fraction(caps[k])
        left -= caps[k]
        open_.remove(k)
    sharing = open_ or [k for k in range(count) if w[k] > 0]
    total = sum(w[j] for j in sharing)
    for j in sharing:
        real[j] += left * w[j] / total
    base = [int(r) for r in real]
    order = sorted(range(count), key=lambda k: (-(real[k] - base[k]), k))
    for k in order[: n - sum(base)]:
        base[k] += 1
    return base


_CAPPED_PLANS = {}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 3000),
    weights=st.none() | st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(any),
    caps=st.lists(st.none() | st.integers(0, 600), min_size=5, max_size=5),
    fed=st.booleans(),
)
def test_a_plan_under_caps_is_water_filling(n, weights, caps, fed):
    """Python's plan and the graph's (weights as constants or fed, caps constants) are
    the exact water-filling reference: within the caps wherever they hold the rows,
    the rows over them shared by the weights of the devices under theirs."""
    count = len(weights) if weights else 3
    weights = tuple(weights) if weights else None
    caps = tuple(caps[:count])
    want = _water_filled(n, weights, caps)
    assert _plan.plan_rows(n, count, weights, caps) == want
    fits = _plan.capacity(weights, caps)
    if fits is None or n <= fits:
        assert all(c is None or size <= c for size, c in zip(want, caps))
    assert sum(want) == n
    if fed and weights is not None:
        key = (count, caps)
        plan = _CAPPED_PLANS.get(key)
        if plan is None:  # one trace per device count and caps: rows and weights are inputs
            plan = _CAPPED_PLANS[key] = tf.function(
                lambda n, w: _plan.plan_sizes(n, count, w, caps), autograph=False
            ).get_concrete_function(
                tf.TensorSpec([], tf.int64), tf.TensorSpec([count], tf.int64)
            )
        in_graph = plan(tf.constant(n, tf.int64), tf.constant(weights, tf.int64))
    else:
        in_graph = _plan.plan_sizes(tf.constant(n, tf.int64), count, weights, caps)
    assert in_graph.numpy().tolist() == want


@pytest.mark.parametrize(
    "n, weights, caps, expected",
    [
        (0, (3, 1), (2, None), [0, 0]),  # no rows
        (8, (3, 1), (2, None), [2, 6]),  # the rows over device 0's cap go to device 1
        (8, (3, 1), (6, None), [6, 2]),  # 6 of 8 is its quota exactly: not over
        (12, (1, 1, 1), (2, None, None), [2, 5, 5]),
        (12, (2, 1, 1), (3, 4, None), [3, 4, 5]),  # two rounds: device 0, then device 1
        (7, (1,), (10,), [7]),  # one device, under its cap
        (7, (1,), (3,), [7]),  # one device over its cap: every row by the weights
        (9, (1, 1), (4, 3), [5, 4]),  # all capped, 2 rows over: by the weights, past both
        (5, (1, 0), (2, None), [5, 0]),  # a device weighted 0 takes nothing, capped or not
        (5, None, (0, None, None), [0, 3, 2]),  # a cap of 0: no rows at all
    ],
)
def test_plans_under_caps(n, weights, caps, expected):
    count = len(caps)
    assert _plan.plan_rows(n, count, weights, caps) == expected == _water_filled(n, weights, caps)
    in_graph = _plan.plan_sizes(tf.constant(n, tf.int64), count, weights, caps)
    assert in_graph.numpy().tolist() == expected


def test_capacity_is_what_the_caps_hold_and_no_caps_add_no_ops():
    assert _plan.capacity((3, 1), (2, None)) is None  # device 1 takes any rows
    assert _plan.capacity((3, 1), (2, 5)) == 7
    assert _plan.capacity((1, 0), (2, None)) == 2  # device 1 takes no rows
    assert _plan.capacity(None, (2, 5, 1)) == 8
    assert _plan.capacity((3, 1), None) is None and not _plan.capped((None, None))
    assert not _plan.planned_where_the_batch_is((3, 1), (2, None))
    assert _plan.planned_where_the_batch_is((3, 1), (None, None))

    def ops(caps):
        graph = tf.function(
            lambda n: _plan.plan_sizes(n, 2, (3, 1), caps), autograph=False
        ).get_concrete_function(tf.TensorSpec([], tf.int64))
        return sorted(op.type for op in graph.graph.get_operations())

    assert ops(None) == ops((None, None)) != ops((2, None))


def test_plan_and_explain_work_inside_a_tf_function():
    f = tfshard.parallelize(tf.identity, devices=CPUS[:3], weights=[2, 1, 1])
    seen = []

    @tf.function
    def outer(x):
        seen.append((f.plan(5), f.explain(x).splitlines()[0]))
        return f(x)

    outer(tf.zeros([5, 2]))
    assert seen[0][0] == f.plan(5) == [3, 1, 1]
    assert seen[0][1].startswith("identity: 5 rows on 3 devices")


# ------------------------------------------------------------- the split, property

# One dtype per way `_kinds.Dense.split` cuts: SplitV as it is, SplitV of a same-size
# float by Bitcast, StridedSlice (1-byte dtypes), SplitV with no float of its size.
_SPLIT_ROUTES = ("float32", "int32", "uint64", "uint8", "bool", "int8", "complex128")


def _extremes(dtype: str, n: int) -> np.ndarray:
    """[n, 2] of `dtype`, its extremes among them: a cast on the way would show."""
    if dtype == "bool":
        return (np.arange(2 * n) % 3 == 0).reshape(n, 2)
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        cycle = np.array([info.min, info.max, 0, 1, info.max - 1], dtype)
        return np.resize(cycle, [n, 2])
    return (np.arange(2 * n) * 0.1 + 1e30).astype(dtype).reshape(n, 2)


_SPLITS = {}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    dtype=st.sampled_from(_SPLIT_ROUTES),
)
def test_every_dtype_is_split_into_numpys_slices(sizes, dtype):
    count = len(sizes)
    split = _SPLITS.get((count, dtype))
    if split is None:  # one trace per device count and dtype: rows and sizes are open
        split = _SPLITS[(count, dtype)] = tf.function(
            lambda t, s: _plan.split(t, s, count, CPUS[0]), autograph=False
        ).get_concrete_function(tf.TensorSpec([None, 2], dtype), tf.TensorSpec([count], tf.int32))
    x = _extremes(dtype, sum(sizes))
    with tf.device(CPUS[1]):
        pieces = split(tf.constant(x), tf.constant(sizes, tf.int32))
    ends = np.cumsum(sizes)
    for piece, start, end in zip(pieces, ends - sizes, ends):
        assert piece.dtype == tf.as_dtype(dtype)
        np.testing.assert_array_equal(piece.numpy(), x[start:end])


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int16"])
def test_a_tensor_of_a_graph_is_split_where_the_callers_scope_says(dtype):
    """Device "" (a graph's tensor: a stream's batch) keeps the caller's scope.

    A stream feeds each batch on the host: its row count and its split run
    there, each piece then crossing once to its shard. ``tf.device(None)``
    would clear that scope, and the split would run where the loop is called
    (the output device), the whole batch crossing there first.
    """

    def plan_on_the_host(x):
        with tf.device(CPUS[0]):
            return _plan.plan_and_split([x], [""], ["x"], 3, None, CPUS[0]).pieces[0]

    graph = (
        tf.function(plan_on_the_host, autograph=False)
        .get_concrete_function(tf.TensorSpec([None, 2], dtype))
        .graph
    )
    # Every op reads the batch or computes from its rows: all on the host (but the
    # function's inputs and outputs, which tf.function makes outside the scope).
    ends = {"Placeholder"} | {t.op.name for t in graph.outputs}
    placed = {
        (op.type, op.device) for op in graph.get_operations() if not {op.type, op.name} & ends
    }
    assert {device for _, device in placed} == {CPUS[0]}, placed


# ------------------------------------------- the rows check inside a tf.function


def _rows_check_message(x_rows, y_rows):
    """What TensorFlow says when the split arguments' rows differ inside the caller's own
    tf.function (rows unknown to Python): the check in its graph, as the user sees it."""
    f = tfshard.parallelize(lambda x, y: x + y, devices=CPUS[:2])

    @tf.function(input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None, 3])])
    def outer(x, y):
        return f(x, y)

    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        outer(np.zeros([x_rows, 3], np.float32), np.zeros([y_rows, 3], np.float32))
    return caught.value.message


def test_the_rows_check_in_a_graph_reads_as_words_and_names_the_argument():
    from tfshard import errors

    message = _rows_check_message(7, 8)
    assert (
        "assertion failed: [tfshard: split arguments with different numbers of rows: x, y, "
        "and every split argument needs the same leading dimension (name one in "
        "broadcast=(...) to copy it whole to each device); their rows, then the rows they "
        "need:] [7 8] [7 7]"
    ) in message
    assert ":end" not in message and "\\'" not in message
    # Where tfshard rewrites it (a stream's loop), the paths read back whole.
    assert errors.inputs_differ(message) == "y has 8 rows but x has 7"
    assert errors.inputs_differ(_rows_check_message(5, 4)) == "y has 4 rows but x has 5"
