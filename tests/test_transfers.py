"""What crosses devices in one call, counted exactly from TensorFlow's partition graphs.

The bed of benchmarks/transfers.py: shards on CPU:1.., the input a tensor on CPU:1 and the
output landing there, CPU:0 standing for the host. The references are independent of
tfshard: a plain `tf.function` of the same function on the same device, run the same way
(its count includes the fetch of the result to the session's client, 2, as tfshard's does).
Two devices are held to the hand-written ``tf.device`` + ``tf.split`` + ``tf.concat`` graph
(its count and bytes at most), every call kind the benchmark counts; with replicas, to the
hand-written graph holding one copy of the variable per device. Also here: a device that
the weights give no rows is not in the call's graph at all, and what a call on one device still
promises (its shard index, its rows, `per_shard`).
"""

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tfshard

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))
HOST, ONE, TWO = CPUS[0], CPUS[1], CPUS[2]
WIDTH = 4


@pytest.fixture(scope="module")
def transfers():
    """benchmarks/transfers.py, imported as the scripts import each other."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
        yield importlib.import_module("transfers")
    sys.modules.pop("transfers", None)


@pytest.fixture(scope="module")
def batch():
    return np.random.default_rng(0).standard_normal([8, WIDTH]).astype(np.float32)


def _counts(transfers, concrete, batch):
    return transfers.count_partitions(transfers.call_graph(concrete, [batch], [ONE], HOST))


def _on_one(batch):
    with tf.device(ONE):
        return tf.constant(batch)


@pytest.fixture(scope="module")
def plain_function(transfers, batch):
    """A `tf.function` of the small function on its own, rows open: the reference."""
    small = transfers.batch_fn(tf, WIDTH)
    concrete = tf.function(small).get_concrete_function(tf.TensorSpec([None, WIDTH]))
    return _counts(transfers, concrete, batch)


def _any_size_graph(f, batch):
    """The graph that serves every batch size: after a first call of another size."""
    x = _on_one(batch)
    f(x[:1])
    return f.get_concrete_function(x)


@pytest.fixture(scope="module")
def counted_cases(transfers):
    """Every case of benchmarks/transfers.py, counted once (8 rows, width 4)."""
    return {(r["case"], r["tfshard"]): r for r in transfers.cases(list(CPUS), 8, WIDTH, 12)}


# (case, what): the cases at most their hand-written reference, in transfers and bytes.
AT_THE_REFERENCE = [
    ("two devices", "per_sample=False"),
    ("two devices, per sample", "first size"),
    ("two devices, per sample", "any size"),
    ("two devices, reduce='sum'", "any size"),
    ("two devices, in a tf.function", "rows unknown: guarded"),
    # The matrix a variable made in f.replicas(), against one copy per device by hand.
    ("two devices, replicas", "tf.Variable matmul"),
    ("two devices, per_shard", "graph mode"),
]


@pytest.mark.parametrize("case", AT_THE_REFERENCE, ids=lambda c: f"{c[0]} ({c[1]})")
def test_two_devices_cost_at_most_the_hand_written_graph(counted_cases, case):
    """No size to the host, no count back, no control edge: the plan and the checks
    where the batch and the results are, each shard's rows crossing once."""
    r = counted_cases[case]
    assert r["transfers"] <= r["reference_transfers"], (r["edges"], r["reference_edges"])
    assert r["bytes"] <= r["reference_bytes"], (r["edges"], r["reference_edges"])
    # The host (CPU:0) sends nothing and receives the fetched result alone.
    assert not [e for e in r["edges"] if e.startswith("device:CPU:0 ->")], r["edges"]
    fetched = [e for e in r["reference_edges"] if "-> device:CPU:0" in e]
    assert len([e for e in r["edges"] if "-> device:CPU:0" in e]) == len(fetched), r["edges"]


def test_per_shard_in_a_graph_leaves_each_result_on_its_device(counted_cases):
    """`per_shard` in a graph costs what the hand-written list written into that graph
    costs: shard 1's result never leaves CPU:2 but for the fetch (no function's outputs
    landing on the caller's device and crossing back)."""
    r = counted_cases[("two devices, per_shard", "graph mode")]
    assert r["transfers"] <= r["reference_transfers"], (r["edges"], r["reference_edges"])
    assert r["bytes"] <= r["reference_bytes"], (r["edges"], r["reference_edges"])
    assert not [e for e in r["edges"] if e.startswith("device:CPU:2 -> device:CPU:1")], r["edges"]
    assert not [e for e in r["edges"] if e.startswith("device:CPU:0 ->")], r["edges"]


@pytest.mark.parametrize(
    "weights, per_sample",
    [(None, False), (None, True), ([1, 0], False), ([1, 3], True)],
    ids=["even", "per_sample", "dropped", "weighted"],
)
def test_per_shard_in_a_tf_function_is_the_eager_one_each_on_its_device(weights, per_sample):
    fn = (lambda s: tf.sin(s) * 2.0) if per_sample else (lambda b: tf.cumsum(b, axis=0))
    f = tfshard.parallelize(fn, devices=[ONE, TWO], weights=weights, per_sample=per_sample)
    x = np.random.default_rng(2).standard_normal([7, 3]).astype(np.float32)
    placed = []

    @tf.function
    def in_graph(t):
        results = f.per_shard(t)
        placed.extend(tf.DeviceSpec.from_string(r.device).to_string() for r in results)
        return results

    got = in_graph(tf.constant(x))
    want = f.per_shard(x)
    assert placed == [tf.DeviceSpec.from_string(d).to_string() for d in (ONE, TWO)]
    # The oracle: the function on each planned slice of the batch, in NumPy's slicing.
    bounds = np.cumsum([0, *f.plan(7)])
    for k, (g, w) in enumerate(zip(got, want)):
        piece = x[bounds[k] : bounds[k + 1]]
        expected = np.sin(piece) * 2.0 if per_sample else np.cumsum(piece, axis=0)
        np.testing.assert_allclose(g.numpy(), expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_no_weights_cross_in_a_guarded_call_with_replicas(counted_cases):
    """Inside a user's tf.function (rows unknown, each shard guarded) each shard reads
    the copy on its device, as the hand-written graph does: the same bytes, and the one
    edge more is the guard's control token (its cond reads a variable: a stateful cond
    the function's control outputs wait for), which carries no data."""
    r = counted_cases[("replicas, in a tf.function", "rows unknown: guarded")]
    assert r["bytes"] <= r["reference_bytes"], (r["edges"], r["reference_edges"])
    extra = [e for e in r["edges"] if "branch_executed" in e]
    assert len(extra) == 1 and extra[0].startswith("device:CPU:2 -> device:CPU:1"), r["edges"]
    assert r["transfers"] == r["reference_transfers"] + 2, (r["edges"], r["reference_edges"])


def test_the_reference_is_one_fetch(plain_function):
    # The result crosses to the session's client, and nothing else crosses.
    assert plain_function["transfers"] == 2, plain_function["edges"]


@pytest.mark.parametrize("per_sample", [False, True], ids=["whole_shard", "per_sample"])
def test_one_device_costs_what_a_tf_function_on_it_costs(transfers, batch, plain_function,
                                                         per_sample):  # fmt: skip
    fn = transfers.sample_fn(tf, WIDTH) if per_sample else transfers.batch_fn(tf, WIDTH)
    f = tfshard.parallelize(fn, devices=[ONE], per_sample=per_sample)
    counted = _counts(transfers, _any_size_graph(f, batch), batch)
    assert counted["transfers"] == plain_function["transfers"], counted["edges"]
    assert counted["bytes"] == plain_function["bytes"]


@pytest.mark.parametrize("weights", [[1, 0], [1, 0, 0]], ids=["two", "three"])
def test_a_device_weighted_0_costs_nothing(transfers, batch, plain_function, weights):
    devices = list(CPUS[1 : 1 + len(weights)])
    f = tfshard.parallelize(transfers.batch_fn(tf, WIDTH), devices=devices, weights=weights,
                            per_sample=False)  # fmt: skip
    counted = _counts(transfers, _any_size_graph(f, batch), batch)
    assert counted["transfers"] == plain_function["transfers"], counted["edges"]
    assert counted["bytes"] == plain_function["bytes"]


def _graph_devices(concrete):
    """Every device an op of the graph (and of the functions it calls) is placed on."""
    graph = concrete.graph.as_graph_def()
    nodes = list(graph.node)
    for function in graph.library.function:
        nodes.extend(function.node_def)
    return {tf.DeviceSpec.from_string(n.device).to_string() for n in nodes if n.device}


def test_a_device_weighted_0_is_not_in_the_calls_graph(batch):
    f = tfshard.parallelize(lambda s: tf.sin(s), devices=CPUS[1:4], weights=[2, 0, 1])
    x = _on_one(batch)
    got = f(x)
    np.testing.assert_allclose(got.numpy(), np.sin(batch), rtol=1e-6)
    assert tf.DeviceSpec.from_string(CPUS[2]).to_string() not in _graph_devices(
        f.get_concrete_function(x)
    )
    explained = f.explain(x)
    assert f"{CPUS[2]} is weighted 0: not in the call's graph" in explained
    (line,) = [line for line in explained.splitlines() if line.startswith("  1 ")]
    assert line.split()[1:] == [CPUS[2], "[5:5)", "0", "-"]  # no output: it has none


def test_one_device_left_knows_its_shard_and_rows():
    # The device with rows is the second: its shard index is 1, its rows the batch's.
    f = tfshard.parallelize(
        lambda s: tf.stack([tf.cast(tfshard.shard_index(), tf.int64), tfshard.row_index()]),
        devices=[ONE, TWO],
        weights=[0, 1],
    )
    got = f(np.zeros([5, 1], np.float32)).numpy()
    np.testing.assert_array_equal(got, [[1, i] for i in range(5)])
    assert f.plan(5) == [0, 5]
    assert "holds every row: the function runs there as a plain tf.function does" in (
        f.explain(np.zeros([5, 1], np.float32))
    )


@pytest.mark.parametrize("per_sample", [False, True], ids=["whole_shard", "per_sample"])
def test_per_shard_gives_a_device_weighted_0_an_empty_result_on_it(per_sample):
    f = tfshard.parallelize(
        lambda x: {"rows": x * 2.0, "total": tf.reduce_sum(x, 0)} if not per_sample else x * 2.0,
        devices=[ONE, TWO],
        weights=[1, 0],
        per_sample=per_sample,
    )
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    held, empty = f.per_shard(x)
    if per_sample:
        np.testing.assert_array_equal(held.numpy(), x * 2)
        assert empty.shape == (0, 3) and empty.device.endswith(TWO)
        return
    np.testing.assert_array_equal(held["rows"].numpy(), x * 2)
    np.testing.assert_array_equal(held["total"].numpy(), x.sum(0))
    # What a shard without rows returns: no rows per row, zeros of a fixed shape.
    assert empty["rows"].shape == (0, 3) and empty["total"].numpy().tolist() == [0, 0, 0]
    assert empty["rows"].device.endswith(TWO)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_a_reduction_on_the_devices_with_rows_is_the_whole_batchs(reduce):
    x = np.random.default_rng(1).standard_normal([9, 3]).astype(np.float32)
    want = {"sum": x.sum(0), "mean": x.mean(0), "max": x.max(0)}[reduce]
    for weights in ([1, 0, 0], [2, 0, 1]):
        f = tfshard.parallelize(tf.identity, devices=CPUS[1:4], weights=weights, reduce=reduce)
        np.testing.assert_allclose(f(x).numpy(), want, rtol=1e-5)


def test_auto_leaves_a_useless_device_out_of_the_next_calls_graph(batch):
    f = tfshard.parallelize(tf.sin, devices=[ONE, TWO], per_sample=False, weights="auto")
    x = _on_one(batch)
    f(x)
    traced = f.trace_count
    # Measurements fed through `f.balance`: device 1, 60 times slower per row.
    for _ in range(3):
        f.balance.observe([4, 4], [0.001, 0.06], warm_up=False)
    assert f.weights == (1.0, 0.0)
    np.testing.assert_allclose(f(x).numpy(), np.sin(batch), rtol=1e-6)
    assert f.trace_count == traced + 1  # one retrace, without the device
    assert tf.DeviceSpec.from_string(TWO).to_string() not in _graph_devices(
        f.get_concrete_function(x)
    )
    assert f"{TWO} is weighted 0: not in the call's graph" in f.explain(x)
