"""_step: where each shard's ops are placed in the traced graph, and what shards return.

References are independent of tfshard: NumPy for round trips, the traced
graph's own op placement for devices.
"""

import collections
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfshard

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))


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
    # float32 outputs are gathered by one ConcatV2 (no TensorList).
    assert {op.type for op in gather} == {"ConcatV2", "Const"}


def _op_types(graph):
    """The types of a graph's ops, its functions' included, as a multiset."""
    definition = graph.as_graph_def()
    nodes = [*definition.node, *(n for f in definition.library.function for n in f.node_def)]
    return collections.Counter(node.op for node in nodes)


@pytest.mark.parametrize("per_sample", [True, False], ids=["per_sample", "whole_shard"])
def test_one_device_runs_what_a_tf_function_runs_and_the_rows_check(per_sample):
    """One device: no plan, split, gather or position in the graph, only the user's ops
    (as a plain tf.function of them has) and, for a whole shard, the check of its rows."""
    w = tf.constant(np.random.default_rng(7).standard_normal([4, 4]).astype(np.float32))

    def fn(x):
        return tf.tanh(tf.linalg.matvec(w, x, transpose_a=True) if per_sample else x @ w)

    f = tfshard.parallelize(fn, devices=["cpu:1"], per_sample=per_sample)
    x = np.ones([8, 4], np.float32)
    plain = (lambda x: tf.vectorized_map(fn, x)) if per_sample else fn
    with tf.device("/device:CPU:1"):
        oracle = tf.function(plain).get_concrete_function(tf.constant(x))
    np.testing.assert_array_equal(f(x).numpy(), oracle(tf.constant(x)).numpy())
    extra = _op_types(f.get_concrete_function(x).graph) - _op_types(oracle.graph)
    # Per sample: the rows (a constant for the first size's graph) as sizes (Pack) and
    # total (Cast), and the sample's outputs made ops of the map (Identity, and pfor's).
    # A whole shard: its rows and its output's (Shape, StridedSlice and its three
    # Consts), compared (Equal) and printed as vectors (Pack), the Assert and its
    # message (Const), the call's NoOp, and the total (Cast).
    if per_sample:
        assert extra == collections.Counter(Identity=2, Const=1, Pack=1, Cast=1), extra
    else:
        assert extra == collections.Counter(
            Shape=2, StridedSlice=2, Const=7, Pack=2, Cast=1, Equal=1, Assert=1, NoOp=1
        ), extra


# What the plan runs: the row count's arithmetic, the sizes and the empty-shard
# predicate. Its Shape op runs where the batch is (on a GPU its output is in
# host memory); tests/test_gpu_kernels.py checks the same graph built for GPUs.
_PLAN_OPS = {"FloorDiv", "FloorMod", "Range", "Less", "Unpack", "Cumsum", "AddV2"}


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int64"])  # SplitV, slices, bitcast
@pytest.mark.parametrize("per_sample", [True, False])
def test_when_run_the_plan_runs_where_the_batch_is_and_each_shard_on_its_device(
    dtype, per_sample, executed_nodes
):
    """Run, not just traced: the devices each node ran on, from the step stats.

    The output is CPU:1 so that its host, CPU:0, is a device no shard uses,
    as the host CPU is on a GPU machine; the batch lives on CPU:3, where the
    plan runs (in int32, which a GPU holds in host memory), and nothing runs
    on the host.
    """
    devices = CPUS[1:]
    fn = (lambda s: s[:2]) if per_sample else (lambda x: x[:, :2])
    f = tfshard.parallelize(fn, devices=devices, output_device="cpu:1", per_sample=per_sample)
    with tf.device("/device:CPU:3"):
        x = tf.cast(tf.reshape(tf.range(21), [7, 3]), dtype)
        f(x[:5])  # per sample, the first size has a graph of its own, its plan folded
    out = f(x)
    np.testing.assert_array_equal(out.numpy(), x.numpy()[:, :2])
    concrete = f.get_concrete_function(x)  # the graph of every other size
    ran = executed_nodes(concrete, x.numpy())
    top = {op.name for op in concrete.graph.get_operations()}
    # (A shard's own ops of these types, pfor's Range in place, are the shard's; the
    # gather's and the check's, counting the outputs' rows, theirs.)
    scoped = ("tfshard_shard_", "tfshard_collect/", "tfshard_rows/")
    plan = {
        d
        for name, op, d in ran
        if op in _PLAN_OPS and name in top and not name.startswith(scoped)
    }
    assert plan == {"/device:CPU:3"}, plan
    # The check of the outputs' rows where they land (the gather's counts are there).
    checks = {d for name, op, d in ran if name.startswith("tfshard_rows/") and op == "Assert"}
    assert checks == (set() if per_sample else {"/device:CPU:1"}), checks
    # Shards off the output device run one shared function, its nodes named as
    # in the function (cond/... for the empty-shard guard's branches) and run
    # once on each of their devices.
    shared = {d for name, _, d in ran if name.startswith("cond/")}
    assert shared == set(devices[1:]), shared
    for k, device in enumerate(devices):
        # A lowered cond's Switches and pivots run beside what they forward (the
        # predicate where the plan is, the rows where the batch is); they compute nothing.
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


# ------------------------------------------------------- dtypes, routed

# Every dtype tfshard splits and gathers. Some have no GPU kernel for SplitV,
# GatherV2 or TensorLists and travel as another dtype (`_kinds.Dense.split`,
# `_kinds.CARRIERS`); tests/test_gpu_kernels.py shows where each op lands on
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


def test_a_plan_under_caps_runs_on_the_host_and_only_once_a_device_is_capped():
    """weights="auto" with a device capped (`Balance.cap`): the graph plans under the cap
    (water-filling's selects, on the host CPU), and held none of it before."""
    f = tfshard.parallelize(lambda s: s * 2.0, devices=["cpu:1", "cpu:2"], weights="auto")
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    uncapped = _op_types(f.get_concrete_function(x).graph)
    f.balance.cap(1, 4)  # device 1: at most 2 rows
    graph = f.get_concrete_function(x).graph
    assert "SelectV2" not in uncapped and _op_types(graph)["SelectV2"] > 0

    def plan_selects(graph):  # the plan's ops are at the top, outside tfshard's scopes
        return {
            op.device
            for op in graph.get_operations()
            if op.type == "SelectV2" and not op.name.startswith("tfshard_")
        }

    # On the host (the output's machine's CPU), in the graph between measured calls and
    # in the measured one.
    assert plan_selects(graph) == {"/device:CPU:0"}
    assert plan_selects(f.get_measured_function(x).graph) == {"/device:CPU:0"}
    assert f.plan(6) == [4, 2]
    np.testing.assert_array_equal(f(x).numpy(), x * 2.0)


def test_a_device_capped_at_0_is_not_in_the_calls_graph():
    """weights="auto" with a device capped at 0 (`Balance.cap` of a shard of 1 row): no op
    of the call's graph, measured or not, is on it, as with a device weighted 0; explain
    says so, and the call gives its rows to the others."""
    f = tfshard.parallelize(lambda s: s * 2.0, devices=["cpu:1", "cpu:2", "cpu:3"], weights="auto")
    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    f.balance.cap(1, 1)
    assert f.balance.caps() == (None, 0, None) and f.plan(12) == [6, 0, 6]

    def devices(graph):
        definition = graph.as_graph_def()
        nodes = [*definition.node, *(n for g in definition.library.function for n in g.node_def)]
        return {node.device for node in nodes}

    for graph in (f.get_concrete_function(x).graph, f.get_measured_function(x).graph):
        used = devices(graph)
        assert CPUS[1] in used and CPUS[3] in used and CPUS[2] not in used
    assert f"{CPUS[2]} is capped at 0 rows: not in the call's graph" in f.explain(x)
    np.testing.assert_array_equal(f(x).numpy(), x * 2.0)
