"""_sharding: plans, splits and where each shard's ops are placed in the traced graph.

References are independent of tfshard: exact fractions for plans, NumPy for
round trips, the traced graph's own op placement for devices.
"""

import collections
import threading
from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfshard
from tfshard import _sharding
from tfshard.errors import ArgumentError

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


# -------------------------------------------------------------- placement


def test_each_shard_runs_on_its_device():
    f = tfshard.parallelize(lambda s: tf.sin(s) * 3.0, devices=["cpu:1", "cpu:3"])
    x = np.zeros([4, 2], np.float32)
    f(x)
    graph = f.get_concrete_function(x)
    devices = collections.defaultdict(set)
    for op in graph.graph.get_operations():
        if op.name.startswith("tfshard_shard_"):
            devices[op.name.split("/")[0]].add(op.device)
    assert devices == {
        "tfshard_shard_0": {"/device:CPU:1"},
        "tfshard_shard_1": {"/device:CPU:3"},
    }
    gather = [op for op in graph.graph.get_operations() if op.name.startswith("tfshard_collect/")]
    assert gather and {op.device for op in gather} == {"/device:CPU:1"}
    # A TensorArray in a TF2 graph is a TensorList.
    assert {"TensorListReserve", "TensorListConcatV2"} <= {op.type for op in gather}


# What the plan runs: the row count's arithmetic, the sizes and the empty-shard
# predicate. Its Shape op runs where the batch is (on a GPU its output is in
# host memory); tests/test_gpu_kernels.py checks the same graph built for GPUs.
_PLAN_OPS = {"FloorDiv", "FloorMod", "Range", "Less", "Unpack", "Cumsum"}


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int64"])  # SplitV, slices, bitcast
@pytest.mark.parametrize("per_sample", [True, False])
def test_when_run_the_plan_runs_on_the_host_and_each_shard_on_its_device(
    dtype, per_sample, executed_nodes
):
    """Run, not just traced: the devices each node ran on, from the step stats.

    The output is CPU:1 so that its host, CPU:0, is a device no shard uses,
    as the host CPU is on a GPU machine; the batch lives on CPU:3.
    """
    devices = CPUS[1:]
    fn = (lambda s: s[:2]) if per_sample else (lambda x: x[:, :2])
    f = tfshard.parallelize(fn, devices=devices, output_device="cpu:1", per_sample=per_sample)
    with tf.device("/device:CPU:3"):
        x = tf.cast(tf.reshape(tf.range(21), [7, 3]), dtype)
    out = f(x)
    np.testing.assert_array_equal(out.numpy(), x.numpy()[:, :2])
    concrete = f.get_concrete_function(x)
    ran = executed_nodes(concrete, x.numpy())
    top = {op.name for op in concrete.graph.get_operations()}
    plan = {d for name, op, d in ran if op in _PLAN_OPS and name in top}
    assert plan == {"/device:CPU:0"}, plan
    # Shards off the output device run one shared function, its nodes named as
    # in the function (cond/... for the empty-shard guard's branches) and run
    # once on each of their devices.
    shared = {d for name, _, d in ran if name.startswith("cond/")}
    assert shared == set(devices[1:]), shared
    for k, device in enumerate(devices):
        # A lowered cond's Switches and pivots run beside what they forward (the
        # predicate on the host, the rows where the batch is); they compute nothing.
        shard = {
            d
            for name, op, d in ran
            if f"tfshard_shard_{k}/" in name and op not in ("Switch", "Identity")
        }
        assert shard == {device}, (k, shard)
    assert {d for name, _, d in ran if name.startswith("tfshard_collect/")} == {"/device:CPU:1"}
    split = {d for _, op, d in ran if op in ("SplitV", "StridedSlice", "Bitcast")}
    assert "/device:CPU:3" in split


def test_split_runs_where_the_input_lives():
    f = tfshard.parallelize(lambda s: s + 1.0, devices=["cpu:0", "cpu:1"])
    with tf.device("/device:CPU:2"):
        x = tf.zeros([4, 2])
    f(x)
    graph = f.get_concrete_function(x)
    splits = [op for op in graph.graph.get_operations() if op.type == "SplitV"]
    assert [op.device for op in splits] == ["/job:localhost/replica:0/task:0/device:CPU:2"]


def test_shards_run_concurrently():
    """Two devices, each blocked until the other has started: only parallel shards finish."""
    barrier = threading.Barrier(2, timeout=20)

    def wait(x):
        barrier.wait()
        return x

    def block(x):
        # stateful=True would make TF serialize the two calls.
        return tf.numpy_function(wait, [x], tf.float32, stateful=False)

    f = tfshard.parallelize(block, devices=["cpu:0", "cpu:1"], per_sample=False)
    out = f(np.arange(4, dtype=np.float32).reshape(4, 1))
    assert out.numpy().ravel().tolist() == [0, 1, 2, 3]


# ------------------------------------------------------- output checks


def _outputs(*structures):
    """Symbolic per-shard outputs, as the traced body has them."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None])
        return [s(x) for s in structures]


def test_check_outputs_names_a_rank_that_differs_between_shards():
    outputs = _outputs(lambda x: {"loss": x}, lambda x: {"loss": tf.reduce_mean(x)})
    with pytest.raises(
        ArgumentError, match=r"outputs\['loss'\] has rank 0 .* on /device:CPU:1 but rank 1"
    ):
        _sharding.check_outputs(outputs, CPUS[:2], concatenated=True)


def test_check_outputs_names_a_key_that_differs_between_shards():
    outputs = _outputs(lambda x: {"loss": x}, lambda x: {"loss": x, "extra": x})
    with pytest.raises(ArgumentError, match=r"outputs\['extra'\] differs between shards"):
        _sharding.check_outputs(outputs, CPUS[:2], concatenated=True)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 10_000),
    weights=st.none() | st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(any),
)
def test_the_python_plan_is_the_graphs(n, weights):
    count = len(weights) if weights else 3
    weights = tuple(weights) if weights else None
    in_graph = _sharding.plan_sizes(tf.constant(n, tf.int64), count, weights).numpy().tolist()
    assert _sharding.plan_rows(n, count, weights) == in_graph


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


# ------------------------------------------------------- dtypes, routed

# Every dtype tfshard splits and gathers. Some have no GPU kernel for SplitV,
# GatherV2 or TensorLists and travel as another dtype (`_sharding.split`,
# `collect.CARRIERS`); tests/test_gpu_kernels.py shows where each op lands on
# GPUs. Here the round trip must give every value back, bit for bit.
DTYPES = (
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16",
    "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)  # fmt: skip


def _extremes(dtype: tf.DType, n: int) -> np.ndarray:
    """[n, 3] values of `dtype` with its extremes (bit patterns that are NaNs as floats)."""
    if dtype == tf.bool:
        return (np.arange(3 * n).reshape(n, 3) % 3 == 0).astype(bool)
    if dtype.is_integer:
        info = np.iinfo(dtype.as_numpy_dtype)
        values = [int(info.min), int(info.max), -1 if info.min else 0, 1, 2]
        return np.resize(np.array(values, dtype.as_numpy_dtype), 3 * n).reshape(n, 3)
    values = np.array([-np.inf, np.inf, 0.0, -0.0, 1.5, 65504.0, -3.0], np.float64)
    real = np.resize(values, 3 * n).reshape(n, 3)
    out = np.zeros([n, 3], dtype.as_numpy_dtype)
    if dtype.is_complex:
        out.real, out.imag = real, real[::-1]
    else:
        out[...] = real
    return out


@pytest.mark.parametrize("per_sample", [True, False], ids=["per_sample", "whole_shard"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_comes_back_bit_for_bit(dtype, per_sample):
    dtype = tf.as_dtype(dtype)
    seen = []

    def fn(x):
        seen.append(x.dtype)  # the function sees its own dtype, never a carrier
        return {"x": x, "first": x[..., :1] if per_sample else x[:, :1]}

    f = tfshard.parallelize(fn, devices=CPUS, per_sample=per_sample)
    for n in (0, 3, 9):  # no rows, fewer rows than devices, uneven shards
        x = _extremes(dtype, n)
        out = f(x)
        assert out["x"].dtype == dtype and out["x"].shape == x.shape
        assert out["x"].numpy().tobytes() == x.tobytes()
        assert out["first"].numpy().tobytes() == np.ascontiguousarray(x[:, :1]).tobytes()
    assert set(seen) == {dtype}
