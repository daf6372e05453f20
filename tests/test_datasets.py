"""Streaming tf.data datasets through @parallelize.

References: the tensor path of the same ShardedFunction, and a single-device
`dataset.map` over the same elements.
"""

import collections
import io
import threading
from fractions import Fraction

import children
import numerics
import numpy as np
import pytest
import rounding
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfshard
from tfshard.errors import ArgumentError

CPUS = [f"/device:CPU:{i}" for i in range(4)]
W = tf.constant(np.random.default_rng(3).normal(size=[4, 3]).astype(np.float32))


def embed_one(sample):
    return tf.tanh(tf.linalg.matvec(W, sample, transpose_a=True))


@pytest.fixture(scope="module")
def embed():
    return tfshard.parallelize(embed_one, devices=CPUS[:3])


def single_device_map(fn, dataset):
    """Reference: each batch through dataset.map on one device, concatenated."""
    with tf.device("/device:CPU:0"):
        return tf.concat(list(dataset.map(lambda b: tf.vectorized_map(fn, b))), axis=0)


def test_batched_dataset_equals_tensor_path_and_dataset_map(embed):
    x = np.random.default_rng(31).normal(size=[22, 4]).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(8)  # 8, 8, 6 rows
    out = embed(ds)
    numerics.assert_close(out.numpy(), embed(x).numpy(), embed.devices)
    reference = single_device_map(embed_one, ds).numpy()
    numerics.assert_close(out.numpy(), reference, (*embed.devices, "/device:CPU:0"))


def test_last_batch_smaller_than_the_device_count(embed):
    x = np.random.default_rng(32).normal(size=[9, 4]).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(4)  # 4, 4, 1: one row on 3 devices
    numerics.assert_close(embed(ds).numpy(), embed(x).numpy(), embed.devices)


def test_unbatched_dataset_with_batch_size(embed):
    x = np.random.default_rng(33).normal(size=[13, 4]).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(x)
    numerics.assert_close(embed(ds, batch_size=5).numpy(), embed(x).numpy(), embed.devices)


def test_no_retracing_across_batch_sizes():
    f = tfshard.parallelize(lambda s: s + 1.0, devices=CPUS[:2])
    ds = tf.data.Dataset.from_tensor_slices(np.zeros([50, 2], np.float32))
    for batch in (7, 16, 50):
        assert f(ds.batch(batch)).shape == (50, 2)
    # One loop with bare shards, and one with guarded shards for the last batch of 7s,
    # whose 1 row leaves a device none (50 = 7 * 7 + 1): traced then, for every size after.
    assert f.trace_count == 2
    g = tfshard.parallelize(lambda s: s + 1.0, devices=CPUS[:2])
    for batch in (10, 16, 25):  # no batch leaves a device without rows
        assert g(ds.batch(batch)).shape == (50, 2)
    assert g.trace_count == 1


@pytest.mark.parametrize("options", [{"weights": [1, 0]}, {"jit_compile": True}])
def test_a_stream_whose_shards_are_guarded_anyway_traces_one_loop(options):
    # A weight of 0 empties a device in every batch; XLA compiles the guarded shard.
    f = tfshard.parallelize(lambda s: s + 1.0, devices=CPUS[:2], **options)
    x = np.arange(14, dtype=np.float32).reshape(7, 2)
    for batch in (2, 3):  # 3s leave a last batch of 1 row
        got = f(tf.data.Dataset.from_tensor_slices(x).batch(batch))
        np.testing.assert_array_equal(got.numpy(), x + 1.0)
    assert f.trace_count == 1


def test_a_compiled_stream_that_reads_a_variable_on_another_device_is_refused():
    # XLA cannot read it; the loop's batch graph is checked before anything runs, as a
    # call's graph is (the loop nests the shards where the check cannot read them).
    with tf.device(CPUS[0]):
        scale = tf.Variable(2.0)
    f = tfshard.parallelize(lambda s: s * scale, devices=CPUS[:2], jit_compile=True)
    ds = tf.data.Dataset.from_tensor_slices(np.ones([4, 2], np.float32)).batch(2)
    with pytest.raises(ArgumentError, match=r"jit_compile=True, shard 1 .* reads .*replicas"):
        f(ds)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 40), batch=st.integers(1, 12))
def test_every_sample_once_in_order(n, batch):
    f = _ID
    ids = np.arange(n, dtype=np.int64)
    out = f(tf.data.Dataset.from_tensor_slices(ids), batch_size=batch)
    assert out.numpy().tolist() == ids.tolist()


_ID = tfshard.parallelize(lambda s: s, devices=CPUS[:3])


def test_iterate_yields_one_result_per_batch_in_order():
    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])
    ds = tf.data.Dataset.range(7)
    got = [r.numpy().tolist() for r in f.iterate(ds, batch_size=3)]
    assert got == [[0, 2, 4], [6, 8, 10], [12]]


def test_iterate_is_lazy_on_an_infinite_dataset():
    f = tfshard.parallelize(lambda s: s + 1, devices=CPUS[:2])
    stream = f.iterate(tf.data.Dataset.range(10**12).repeat(), batch_size=4)
    first = [next(stream).numpy().tolist() for _ in range(2)]
    assert first == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_a_call_or_a_write_of_an_infinite_dataset_is_refused_before_it_starts(tmp_path):
    f = tfshard.parallelize(lambda s: s + 1, devices=CPUS[:2])
    forever = tf.data.Dataset.range(8).repeat()
    with pytest.raises(ArgumentError, match=r"is infinite \(it repeats\), so its results would "):
        f(forever, batch_size=4)
    path = tmp_path / "out"
    with pytest.raises(ArgumentError, match=r"is infinite \(it repeats\), so the write would "):
        f.write(forever, path, batch_size=4)
    assert not path.exists()


def test_tuple_elements_are_spread_like_dataset_map():
    f = tfshard.parallelize(lambda a, b: a * b, devices=CPUS[:2])
    rng = np.random.default_rng(34)
    a = rng.normal(size=[10]).astype(np.float32)
    b = rng.normal(size=[10]).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((a, b)).batch(4)
    # One float32 product per element, rounded once on every side: exact.
    np.testing.assert_array_equal(f(ds).numpy(), a * b)
    reference = tf.concat(list(ds.map(lambda x, y: x * y)), 0)
    np.testing.assert_array_equal(f(ds).numpy(), reference.numpy())


Example = collections.namedtuple("Example", "image label")


def test_dict_and_namedtuple_elements_are_one_argument():
    f = tfshard.parallelize(lambda e: {"y": e["x"] + 1, "n": e["n"]}, devices=CPUS[:2])
    x = np.arange(6, dtype=np.float32)
    out = f(tf.data.Dataset.from_tensor_slices({"x": x, "n": np.arange(6)}).batch(4))
    assert out["y"].numpy().tolist() == (x + 1).tolist()
    assert out["n"].numpy().tolist() == list(range(6))
    g = tfshard.parallelize(lambda e: e.image * tf.cast(e.label, tf.float32), devices=CPUS[:2])
    ds = tf.data.Dataset.from_tensor_slices(Example(x, np.arange(6))).batch(4)
    assert g(ds).numpy().tolist() == (x * np.arange(6)).tolist()


def test_extra_arguments_go_with_every_batch():
    f = tfshard.parallelize(lambda s, table: tf.gather(table, s), broadcast=("table",))
    table = tf.constant([10.0, 20.0, 30.0])
    ds = tf.data.Dataset.from_tensor_slices(np.array([2, 0, 1, 1, 2]))
    assert f(ds, table, batch_size=2).numpy().tolist() == [30, 10, 20, 20, 30]


def test_ragged_outputs_across_batches():
    f = tfshard.parallelize(lambda n: tf.range(n), devices=CPUS[:3])
    out = f(tf.data.Dataset.range(6), batch_size=4)
    assert out.to_list() == [list(range(n)) for n in range(6)]


def test_ragged_elements_work_as_tensors_do():
    f = tfshard.parallelize(lambda row: tf.reduce_sum(row), devices=CPUS[:2])
    rt = tf.ragged.constant([[1, 2], [], [3], [4, 5, 6], [7]])
    ds = tf.data.Dataset.from_tensor_slices(rt).ragged_batch(2)
    assert f(ds).numpy().tolist() == [3, 0, 3, 15, 7] == f(rt).numpy().tolist()


@pytest.mark.parametrize(
    "op, np_op", [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min)]
)
def test_reductions_over_the_whole_dataset(op, np_op):
    f = tfshard.parallelize(lambda s: s * s, reduce=op, devices=CPUS[:3])
    x = np.random.default_rng(35).normal(size=[17, 2]).astype(np.float32)
    out = f(tf.data.Dataset.from_tensor_slices(x).batch(5))
    # x * x >= 0: nothing cancels, so the result is the magnitude of its terms.
    numerics.assert_close(out.numpy(), np_op(x * x, axis=0), f.devices)


def test_integer_mean_over_batches_is_the_mean_over_samples():
    f = tfshard.parallelize(lambda s: s, reduce="mean", devices=CPUS[:2])
    # Truncated per batch (1 and 3) the mean would be 2; over the samples it is 2.25.
    out = f(tf.data.Dataset.from_tensor_slices(np.array([1, 2, 3, 3])).batch(2))
    assert out.dtype == tf.float64 and out.numpy() == np.mean([1, 2, 3, 3]) == 2.25


def test_per_batch_mean_over_the_dataset_is_size_weighted():
    f = tfshard.parallelize(
        lambda b: tf.reduce_mean(b, 0), per_sample=False, reduce="mean", devices=CPUS[:3]
    )
    x = np.random.default_rng(36).normal(size=[11, 2]).astype(np.float32)
    out = f(tf.data.Dataset.from_tensor_slices(x).batch(4))
    # A mean of signed values can cancel to near 0: judged against the terms' magnitude.
    numerics.assert_close(out.numpy(), x.mean(0), f.devices, scale=np.abs(x).max())


def test_empty_dataset_gives_an_empty_result_of_the_right_type(embed):
    empty = tf.data.Dataset.from_tensor_slices(np.zeros([0, 4], np.float32))
    out = embed(empty, batch_size=8)
    assert out.shape == (0, 3) and out.dtype == tf.float32
    out = embed(empty.batch(8))
    assert out.shape == (0, 3)


def test_empty_dataset_with_a_reduction():
    f = tfshard.parallelize(lambda s: s, reduce="sum", devices=CPUS[:2])
    out = f(tf.data.Dataset.from_tensor_slices(np.zeros([0, 2], np.float32)), batch_size=3)
    assert out.numpy().tolist() == [0.0, 0.0]


def test_progress_reports_samples_per_second():
    f = tfshard.parallelize(lambda s: s, devices=CPUS[:2])
    stream = io.StringIO()
    f(tf.data.Dataset.range(10), batch_size=4, progress=stream)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("<lambda>: batch 1/3  4 samples")
    assert lines[-1].startswith("<lambda>: batch 3/3  10 samples") and "samples/s" in lines[-1]


def test_batched_true_for_fixed_size_batches():
    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])
    ds = tf.data.Dataset.from_tensor_slices(np.arange(8.0)).batch(4, drop_remainder=True)
    assert f(ds, batched=True).numpy().tolist() == [0, 2, 4, 6, 8, 10, 12, 14]


# ------------------------------------------------------------------ errors


def test_scalar_elements_need_a_batch_size():
    f = tfshard.parallelize(lambda s: s)
    with pytest.raises(ArgumentError, match=r"element is a scalar.*pass batch_size=N"):
        f(tf.data.Dataset.range(3))


def test_fixed_shape_elements_are_ambiguous():
    f = tfshard.parallelize(lambda s: s)
    ds = tf.data.Dataset.from_tensor_slices({"x": np.zeros([4, 3])})
    with pytest.raises(ArgumentError, match=r"element\['x'\]: \(3,\).*batch_size=N.*batched=True"):
        f(ds)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_batch_size(bad):
    f = tfshard.parallelize(lambda s: s)
    with pytest.raises(ArgumentError, match=rf"batch_size={bad!r}: .*an int >= 1"):
        f(tf.data.Dataset.range(3), batch_size=bad)


def test_batch_size_takes_a_numpy_integer():
    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])
    got = [r.numpy().tolist() for r in f.iterate(tf.data.Dataset.range(5), batch_size=np.int64(2))]
    assert got == [[0, 2], [4, 6], [8]]
    with pytest.raises(ArgumentError, match=r"batch_size=np.True_: .*an int >= 1"):
        f(tf.data.Dataset.range(3), batch_size=np.True_)


def test_iterate_needs_a_dataset():
    f = tfshard.parallelize(lambda s: s)
    with pytest.raises(ArgumentError, match=r"iterate\(\) takes a tf.data.Dataset, got ndarray"):
        next(f.iterate(np.zeros([3])))


def test_element_structure_that_does_not_fit_the_function():
    f = tfshard.parallelize(lambda x: x)
    ds = tf.data.Dataset.from_tensor_slices((np.zeros([4]), np.zeros([4]))).batch(2)
    with pytest.raises(ArgumentError, match=r"passed as 2 positional argument\(s\).*<lambda>\(x\)"):
        f(ds)


def test_changing_per_sample_shapes_name_the_field():
    f = tfshard.parallelize(lambda e: e["tokens"])
    ds = tf.data.Dataset.range(1, 6).map(lambda n: {"tokens": tf.range(n)}).padded_batch(2)
    with pytest.raises(
        ArgumentError,
        match=r"element\['tokens'\] has per-sample shape \[4\] in this batch but \[2\]",
    ):
        f(ds)


def test_dataset_elsewhere_than_first():
    f = tfshard.parallelize(lambda x, d: x)
    with pytest.raises(ArgumentError, match="pass a dataset as the first positional argument"):
        f(np.zeros([2]), tf.data.Dataset.range(2))


def test_batched_false_asks_for_a_batch_size():
    f = tfshard.parallelize(lambda s: tf.reduce_sum(s))
    ds = tf.data.Dataset.from_tensor_slices(np.arange(8.0).reshape(2, 4))
    with pytest.raises(ArgumentError, match=r"batched=False: .*pass batch_size=N"):
        f(ds, batched=False)


def test_an_infinite_dataset_asks_for_iterate():
    f = tfshard.parallelize(lambda s: s)
    with pytest.raises(ArgumentError, match=r"infinite.*\.iterate\(dataset\).*take"):
        f(tf.data.Dataset.range(3).repeat(), batch_size=2)


# ------------------------------------------------- the two loops of f(dataset)


def test_unknown_per_sample_shapes_take_the_python_loop_with_the_same_result():
    # A generator's spec leaves the row length unknown, so f(dataset) checks
    # every batch from Python; a fixed spec runs the traced loop. Same rows.
    x = np.random.default_rng(37).normal(size=[10, 4]).astype(np.float32)
    batches = [x[:4], x[4:8], x[8:]]
    loose = tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=tf.TensorSpec([None, None], tf.float32)
    )
    fixed = tf.data.Dataset.from_tensor_slices(x).batch(4)
    f = tfshard.parallelize(lambda s: s * 2.0 + 1.0, devices=CPUS[:3])
    # float32 on both sides: x * 2 is exact and + 1 rounds once, so the results are equal.
    np.testing.assert_array_equal(f(loose).numpy(), x * 2 + 1)
    np.testing.assert_array_equal(f(fixed).numpy(), x * 2 + 1)


def test_the_traced_loop_runs_each_sample_once():
    # Side effects count the rows each shard computed: no batch runs twice,
    # none is skipped (the loop traces the function more than once, but runs
    # it once per shard per batch).
    seen = tf.Variable(0, dtype=tf.int64)

    def count(block):
        seen.assign_add(tf.shape(block, out_type=tf.int64)[0])
        return block + 1

    f = tfshard.parallelize(count, per_sample=False, devices=CPUS[:2])
    out = f(tf.data.Dataset.range(11).batch(3))
    assert out.numpy().tolist() == list(range(1, 12))
    assert int(seen.numpy()) == 11


def test_the_traced_loops_output_leaves_keep_no_graph_of_the_function():
    # The loop learns its outputs' specs from the graph of one batch's shards, and keeps
    # stand-ins from a graph of a few ops: no leaf keeps a graph of the function alive.
    def deep(block):
        for _ in range(20):
            block = tf.tanh(block * 0.5)
        return block, tf.RaggedTensor.from_tensor(
            block, lengths=tf.ones_like(block[:, 0], tf.int64)
        )

    f = tfshard.parallelize(deep, per_sample=False, devices=CPUS[:2])
    x = np.random.default_rng(38).normal(size=[9, 3]).astype(np.float32)
    dense, ragged = f(tf.data.Dataset.from_tensor_slices(x).batch(4))
    want = x
    for _ in range(20):
        want = np.tanh(want * 0.5)
    numerics.assert_close(dense.numpy(), want, f.devices)
    numerics.assert_close(ragged.flat_values.numpy(), want[:, :1].ravel(), f.devices)
    (loop,) = f.streams.loops.values()
    for leaf in loop.leaves:
        graph = (leaf.flat_values if isinstance(leaf, tf.RaggedTensor) else leaf).graph
        assert len(graph.get_operations()) < 10, [op.type for op in graph.get_operations()]


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 40),
    batch=st.integers(1, 12),
    op=st.sampled_from(["sum", "mean", "max", "min"]),
    per_sample=st.booleans(),
)
def test_reductions_over_batches_equal_numpy(n, batch, op, per_sample):
    x = np.random.default_rng(n * 100 + batch).normal(size=[n, 2]).astype(np.float32)
    f = _REDUCERS[(op, per_sample)]
    out = f(tf.data.Dataset.from_tensor_slices(x).batch(batch))
    expected = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op](x, axis=0)
    # A sum of signed values can cancel: judged against the magnitude of the terms summed.
    scale = np.abs(x).sum(0).max() if op == "sum" else np.abs(x).max()
    numerics.assert_close(out.numpy(), expected, f.devices, scale=scale)


def _shard_value(op):
    # per_sample=False: the shard's own reduction over its rows.
    reduce = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max}.get(
        op, tf.reduce_min
    )
    return lambda block: reduce(block, axis=0)


_REDUCERS = {
    (op, per_sample): tfshard.parallelize(
        (lambda s: s) if per_sample else _shard_value(op),
        per_sample=per_sample,
        reduce=op,
        devices=CPUS[:3],
    )
    for op in ("sum", "mean", "max", "min")
    for per_sample in (True, False)
}


def _stream(x, batch, loop):
    """`x` in batches of `batch` rows, for the traced loop (the spec fixes the per-sample
    shape) or the Python loop (it leaves it unknown, as `padded_batch` can)."""
    inner = list(x.shape[1:]) if loop == "traced" else [None] * (x.ndim - 1)
    return tf.data.Dataset.from_generator(
        lambda: (x[i : i + batch] for i in range(0, len(x), batch)),
        output_signature=tf.TensorSpec([None, *inner], tf.as_dtype(x.dtype)),
    )


LOOPS = ["traced", "python"]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("dtype", rounding.LOW_PRECISION)
def test_low_precision_streams_of_a_million_rows(dtype, loop, one_batch_per_call):
    """Running totals stay float32 from batch to batch and call to call (one batch a call
    here): no sum sticks, the row count is no float16, the result is in the dtype."""
    # In [0, 1/16): a float16 sum of a million rows stays finite (about 31,250).
    x = rounding.values(np.random.default_rng(1), [10**6, 4], dtype, high=1 / 16)
    for op in ("sum", "mean", "max", "min"):
        f = tfshard.parallelize(lambda s: s, reduce=op, devices=CPUS[:3], weights=[2, 1, 1])
        out = f(_stream(x, 50_000, loop))
        assert len(f.streams.loops) == (loop == "traced")
        rounding.assert_rounded(out, rounding.reference(op, rounding.exact(x)), dtype)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("dtype", rounding.LOW_PRECISION)
def test_low_precision_shard_means_over_a_stream_are_weighted_by_size(dtype, loop):
    def shard_mean(b):  # in float32, as a mixed-precision loss is; its value in the dtype
        return tf.cast(tf.reduce_mean(tf.cast(b, tf.float32), 0), b.dtype)

    f = tfshard.parallelize(shard_mean, per_sample=False, reduce="mean", devices=CPUS[:3])
    # 300,000 rows in 100 batches of 3,000 (3 shards of 1,000 each); centred on 0, so the
    # shard means nearly cancel and a total rounded to the dtype shows in the mean.
    x = rounding.values(np.random.default_rng(4), [300_000, 2], dtype, low=-1.0)
    out = f(_stream(x, 3_000, loop))
    assert len(f.streams.loops) == (loop == "traced")
    means = [rounding.exact(shard_mean(tf.constant(s)).numpy()) for s in np.split(x, 300)]
    rounding.assert_rounded(out, np.mean(means, 0), dtype)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    "dtype, low, high",
    [("int32", 0, 10**6), ("uint32", 2**31, 2**32), ("int64", 2**61, 2**62)],
    ids=["int32", "uint32", "int64"],
)
def test_integer_means_over_a_stream_total_past_the_dtypes_range(dtype, low, high, loop):
    # 5,000 values: the total passes the dtype's range (int64's for int64) by far.
    x = np.random.default_rng(3).integers(low, high, size=[5_000, 1], dtype=dtype)
    f = tfshard.parallelize(lambda s: s, reduce="mean", devices=CPUS[:3])
    out = f(_stream(x, 512, loop))
    assert len(f.streams.loops) == (loop == "traced")
    assert out.dtype == tf.float64  # as tf.math.truediv gives for 32- and 64-bit integers
    want = sum(int(v) for v in x[:, 0]) / len(x)  # exact in Python, rounded once
    numerics.assert_close(out.numpy(), np.array([want]), f.devices)


def test_a_failing_shard_in_a_stream_names_its_device():
    def log_minus_5(block):  # NaN for the rows below 5: the first shard of each batch of 10
        return tf.debugging.check_numerics(tf.math.log(block - 5.0), "log of a negative")

    f = tfshard.parallelize(log_minus_5, per_sample=False, devices=CPUS[:2])
    ds = tf.data.Dataset.range(10).map(lambda n: tf.cast(n, tf.float32))
    # A stream's first call of its loop runs one batch, whose rows Python then knows.
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"(?s)shard 0 on /device:CPU:0 \(rows \[0:5\) of 10\) failed.*log of a negative",
    ) as raised:
        f(ds, batch_size=10)
    assert isinstance(raised.value, tfshard.TfshardError)


@pytest.mark.parametrize("spec", [[None, 2], [None, None]], ids=["traced_loop", "python_loop"])
def test_an_empty_batch_in_the_stream_does_not_spoil_a_mean(spec):
    batches = [np.ones([3, 2], np.float32), np.zeros([0, 2], np.float32), 3 * np.ones([1, 2])]
    ds = tf.data.Dataset.from_generator(
        lambda: (b.astype(np.float32) for b in batches),
        output_signature=tf.TensorSpec(spec, tf.float32),
    )
    f = tfshard.parallelize(
        lambda b: tf.reduce_mean(b, 0), per_sample=False, reduce="mean", devices=CPUS[:2]
    )
    assert f(ds).numpy().tolist() == [1.5, 1.5]


def test_fields_with_different_rows_in_one_element_are_an_error():
    f = tfshard.parallelize(lambda u, v: u + v, devices=CPUS[:2])
    ds = tf.data.Dataset.zip(
        (
            tf.data.Dataset.from_tensor_slices(np.arange(9.0)).batch(3),
            tf.data.Dataset.from_tensor_slices(np.arange(12.0)).batch(4),
        )
    )
    with pytest.raises(
        ArgumentError, match=r"different numbers of rows \(v has 4 rows but u has 3\); every field"
    ):
        f(ds)
    g = tfshard.parallelize(lambda u, v: u + tf.reduce_sum(v), devices=CPUS[:2])
    rt = tf.ragged.constant([[float(i)] for i in range(12)])
    ragged = tf.data.Dataset.zip(
        (
            tf.data.Dataset.from_tensor_slices(np.arange(9, dtype=np.float32)).batch(3),
            tf.data.Dataset.from_tensor_slices(rt).ragged_batch(4),
        )
    )
    with pytest.raises(ArgumentError, match="different numbers of rows"):
        g(ragged)


def test_ragged_elements_with_int32_row_splits():
    rt = tf.ragged.constant([[1.0, 2], [3], [4, 5, 6]], row_splits_dtype=tf.int32)
    f = tfshard.parallelize(tf.reduce_sum, devices=CPUS[:3])
    ds = tf.data.Dataset.from_tensor_slices(rt).ragged_batch(2, row_splits_dtype=tf.int32)
    assert f(ds).numpy().tolist() == [3.0, 3.0, 15.0] == f(rt).numpy().tolist()


@pytest.mark.parametrize("reduce", [None, "sum"])
def test_outputs_of_unknown_rank(reduce):
    # A py_function's output has no static shape. Per shard: the rows doubled, or their sum.
    def twice(block):
        if reduce is None:
            return tf.py_function(lambda t: t * 2, [block], tf.float32)
        return tf.py_function(lambda t: tf.reduce_sum(t, 0) * 2, [block], tf.float32)

    f = tfshard.parallelize(twice, per_sample=False, reduce=reduce, devices=CPUS[:2])
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    out = f(tf.data.Dataset.from_tensor_slices(x).batch(4))
    # Small integers in float32: doubled and summed exactly in any order.
    np.testing.assert_array_equal(out.numpy(), x * 2 if reduce is None else 2 * x.sum(0))


def test_a_further_argument_to_split_with_every_batch():
    g = tfshard.parallelize(lambda s, b: s + b, devices=CPUS[:2])
    bias = np.arange(4, dtype=np.float32).reshape(2, 2)
    ds = tf.data.Dataset.from_tensor_slices(np.ones([6, 2], np.float32))
    out = g(ds.batch(2, drop_remainder=True), bias, batched=True)
    assert out.numpy().tolist() == np.tile(1 + bias, [3, 1]).tolist()


def test_one_trace_for_every_batch_size_and_for_the_mean_twin():
    f = tfshard.parallelize(lambda s: s * 2.0, reduce="mean", devices=CPUS[:2])
    rows = tf.data.Dataset.from_tensor_slices(np.arange(24, dtype=np.float32))
    for size in (3, 4, 6):
        assert f(rows.batch(size, drop_remainder=True), batched=True).numpy() == 23.0
    assert f.trace_count == 1


def test_broadcast_positions_reach_the_mean_twin():
    def scaled(sample, *extra):
        return sample * extra[0]

    f = tfshard.parallelize(scaled, reduce="mean", broadcast=(1,), devices=CPUS[:2])
    ds = tf.data.Dataset.from_tensor_slices(np.arange(4, dtype=np.float32)).batch(3)
    assert f(ds, tf.constant([2.0, 4.0])).numpy().tolist() == [3.0, 6.0]


@pytest.fixture
def one_batch_per_call(monkeypatch):
    """Every call of the traced loop runs one batch: state crosses every boundary."""
    from tfshard import datasets

    monkeypatch.setattr(datasets, "CALL_SECONDS", 0.0)


def _host_reads(monkeypatch, run) -> int:
    """How many times `run()` reads an eager tensor's value into Python: on a GPU each
    read of a value the device computed waits for it."""
    kind = type(tf.constant(0))
    count = [0]

    def counted(method):
        def read(self, *args, **kwargs):
            count[0] += 1
            return method(self, *args, **kwargs)

        return read

    with monkeypatch.context() as patch:
        for name in ("numpy", "__int__", "__index__", "__bool__", "__float__", "__array__"):
            patch.setattr(kind, name, counted(getattr(kind, name)))
        run()
    return count[0]


def test_a_plain_stream_reads_one_value_on_the_host_per_call_of_its_loop(monkeypatch):
    from tfshard import datasets

    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])

    def stream(batches):
        return tf.data.Dataset.range(4 * batches).batch(4)

    monkeypatch.setattr(datasets, "CALL_SECONDS", 0.0)  # one batch per call
    f(stream(1))
    one = _host_reads(monkeypatch, lambda: f(stream(1)))
    nine = _host_reads(monkeypatch, lambda: f(stream(9)))
    assert nine - one == 8  # one read per call, whatever the stream reads once
    # Batches that fit in a call's time: once measured, a stream is two calls, its first
    # batch (a stream's batches may cost more than the last one's), then the rest.
    monkeypatch.setattr(datasets, "CALL_SECONDS", 1e9)
    f(stream(9))
    assert _host_reads(monkeypatch, lambda: f(stream(9))) == one + 1
    np.testing.assert_array_equal(f(stream(9)).numpy(), np.arange(36) * 2)


@pytest.mark.parametrize("reduce", [None, "sum", "mean", "max"])
def test_results_cross_call_boundaries_of_the_loop(one_batch_per_call, reduce):
    f = tfshard.parallelize(lambda s: {"y": s * 2, "r": tf.range(s)}, devices=CPUS[:3])
    if reduce is not None:
        f = tfshard.parallelize(lambda s: s * 2, reduce=reduce, devices=CPUS[:3])
    ds = tf.data.Dataset.range(10).batch(3)
    out = f(ds)
    if reduce is None:
        assert out["y"].numpy().tolist() == [2 * n for n in range(10)]
        assert out["r"].to_list() == [list(range(n)) for n in range(10)]
    else:
        expected = {"sum": 90, "mean": 9, "max": 18}[reduce]
        assert out.numpy() == expected


INTERRUPTED_STREAM = """
import sys, time
import numpy as np
import tfshard
tfshard.virtual_devices(2)
import tensorflow as tf

def slow(block):  # 20 ms a shard: the whole stream would take ~20 s
    return tf.py_function(lambda t: (time.sleep(0.02), t)[1], [block], tf.float32)

f = tfshard.parallelize(slow, per_sample=False, devices=["cpu:0", "cpu:1"])
ds = tf.data.Dataset.from_tensor_slices(np.zeros([2000, 1], np.float32)).batch(2)
print("started", flush=True)
start = time.monotonic()
try:
    f(ds)
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.1f} s", flush=True)
"""


def test_ctrl_c_stops_a_long_stream_promptly():
    # The traced loop gives Python control back every half second or so.
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_STREAM],
        stdout=subprocess.PIPE,
        text=True,
        env=children.environ(),
        preexec_fn=children.as_in_a_terminal,
    )
    try:
        assert child.stdout.readline().strip() == "started"
        time.sleep(2.0)
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=120)  # ends a wait that would never end
    finally:
        child.kill()
    assert out.startswith("interrupted after"), out
    assert float(out.split()[2]) < 6.0, out


def test_reduced_results_land_on_the_output_device():
    ds = tf.data.Dataset.from_tensor_slices(np.ones([6, 2], np.float32)).batch(2)
    loose = tf.data.Dataset.from_generator(  # per-sample shape unknown: the Python loop
        lambda: iter([np.ones([2, 2], np.float32)] * 3),
        output_signature=tf.TensorSpec([None, None], tf.float32),
    )
    for reduce in ("sum", "max", "mean"):
        f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[1:3], reduce=reduce)
        assert f(ds).device.endswith("/device:CPU:1")
        assert f(loose).device.endswith("/device:CPU:1")


def test_a_reduction_error_names_the_reduction_asked_for():
    f = tfshard.parallelize(lambda s: s > 3, devices=CPUS[:2], reduce="mean")
    with pytest.raises(ArgumentError, match="reduce='mean' cannot combine"):
        f(tf.data.Dataset.range(6).batch(4))


def test_elements_that_are_not_tensors_are_an_error():
    f = tfshard.parallelize(lambda s: s)
    with pytest.raises(ArgumentError, match=r"element is a DatasetSpec.*flat_map"):
        f(tf.data.Dataset.range(6).window(3))


def _batches_per_call(f):
    """The most batches each call of f's traced loop runs, in order, as the calls come
    (`f.streams.on_call`)."""
    limits = []
    f.streams.on_call = lambda limit, guarded: limits.append(limit)
    return limits


def test_a_call_of_the_loop_grows_at_most_twofold():
    # Batches that turn slow after fast ones must not make one long, uninterruptible call.
    f = tfshard.parallelize(lambda s: s + 1, devices=CPUS[:2])
    limits = _batches_per_call(f)
    assert f(tf.data.Dataset.range(300), batch_size=2).numpy().tolist() == list(range(1, 301))
    assert limits[0] == 1
    assert all(b <= 2 * a for a, b in zip(limits, limits[1:])), limits
    # The next run measures one batch first, may then go back to where this one got
    # to, and grows at most twofold from there.
    grown = max(limits)
    limits.clear()
    f(tf.data.Dataset.range(300), batch_size=2)
    assert limits[0] == 1 and limits[1] <= max(2, 2 * grown), limits
    assert all(b <= 2 * a for a, b in zip(limits[1:], limits[2:])), limits


def test_a_stream_of_heavier_batches_starts_with_one_batch_per_call():
    # The loop serves every batch size: a stream of big batches after many small ones
    # must not run the size the small ones reached in one uninterruptible call.
    f = tfshard.parallelize(lambda s: s + 1, devices=CPUS[:2])
    limits = _batches_per_call(f)
    f(tf.data.Dataset.range(400), batch_size=2)
    assert max(limits) > 1
    limits.clear()
    big = tf.data.Dataset.range(4000).batch(400)
    assert f(big).numpy().tolist() == list(range(1, 4001))
    assert limits[0] == 1, limits


@pytest.mark.parametrize(
    "spec, inner", [([None, None], (0,)), (None, ())], ids=["unknown_dims", "unknown_rank"]
)
def test_an_empty_stream_of_loose_specs(spec, inner):
    # Nothing in the spec fixes the per-sample shape: unknown dimensions count as 0.
    ds = tf.data.Dataset.from_generator(
        lambda: iter([]), output_signature=tf.TensorSpec(spec, tf.float32)
    )
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:2])
    out = f(ds, batched=True)
    assert out.shape == (0, *inner) and out.dtype == tf.float32


def test_a_failing_shard_in_a_reduced_stream_names_its_device():
    def log_minus_5(block):
        return tf.reduce_sum(tf.debugging.check_numerics(tf.math.log(block - 5.0), "log"))

    f = tfshard.parallelize(log_minus_5, per_sample=False, reduce="sum", devices=CPUS[:2])
    ds = tf.data.Dataset.range(10).map(lambda n: tf.cast(n, tf.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"shard 0 on /device:CPU:0"):
        f(ds, batch_size=10)


def test_a_dataset_inside_a_tf_function_is_refused_with_the_working_form():
    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])
    ds = tf.data.Dataset.range(6).batch(4)

    @tf.function
    def whole():
        return f(ds)

    with pytest.raises(
        ArgumentError,
        match=r"<lambda>\(dataset\) inside a tf.function: .*"
        r"`for batch in dataset: <lambda>\(batch\)`",
    ):
        whole()

    @tf.function
    def per_batch():
        total = tf.constant(0, tf.int64)
        for batch in ds:
            total += tf.reduce_sum(f(batch))
        return total

    assert per_batch().numpy() == 2 * sum(range(6))


def test_concurrent_first_calls_on_a_dataset_trace_one_loop():
    f = tfshard.parallelize(lambda s: s + 1, devices=CPUS[:2])
    ds = tf.data.Dataset.range(40).batch(8)
    results = []
    threads = [threading.Thread(target=lambda: results.append(f(ds).numpy())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(r.tolist() == list(range(1, 41)) for r in results)
    assert f.trace_count == 1


def test_iterate_refuses_bad_arguments_at_the_call_not_at_the_first_batch():
    f = tfshard.parallelize(lambda s: s, devices=CPUS[:2])
    with pytest.raises(ArgumentError, match=r"iterate\(\) takes a tf.data.Dataset, got ndarray"):
        f.iterate(np.zeros([4]))
    with pytest.raises(ArgumentError, match=r"batch_size=0"):
        f.iterate(tf.data.Dataset.range(4), batch_size=0)


# ------------------------------------------- feeding the devices a batch ahead


def _loop_body(f, guarded=False):
    """The traced loop's body (a FunctionDef) and its While node, from the public GraphDef,
    of the loop with bare shards, or with guarded ones; and the graph's function library."""
    (loop,) = f.streams.loops.values()
    graph = loop.graph(guarded).as_graph_def()
    (node,) = [n for n in graph.node if n.op in ("While", "StatelessWhile")]
    library = {fn.signature.name: fn for fn in graph.library.function}
    return library[node.attr["body"].func.name], node, library


def _batch_call(body, library):
    """The body's call of the batch's shards (`_Loop._batch_graph`), and that function."""
    (call,) = [
        n
        for n in body.node_def
        if n.op in ("StatefulPartitionedCall", "PartitionedCall")
        and any("tfshard_shard_" in m.name for m in library[n.attr["f"].func.name].node_def)
    ]
    return call, library[call.attr["f"].func.name]


def _ancestors(nodes, name):
    """Every node and argument `name` waits for (data and control inputs), within one function."""
    seen, todo = set(), [name]
    while todo:
        node = nodes.get(todo.pop())  # None for an argument of the function
        for source in node.input if node is not None else ():
            source = source.lstrip("^").split(":")[0]
            if source not in seen:
                seen.add(source)
                todo.append(source)
    return seen


def test_each_shards_next_rows_reach_its_device_while_the_current_batch_runs():
    """Batch i + 1's rows are on shard k's device before shard k runs on them.

    On a GPU a shard's first op needs its rows in that GPU's memory. Split on
    the host and read straight by the shard (as a call on a tensor does), the
    host-to-device copy starts only when the shard is ready to run and lies on
    that batch's critical path: the GPU waits for its rows. MirroredStrategy
    avoids this with a prefetch buffer on each device (MultiDeviceIterator's
    per-device ``prefetch``). The loop does it in its own graph: iteration i
    splits batch i + 1 on the host and copies piece k to device k (an Identity
    there), which depends on nothing of batch i's shards, so the executor
    issues the copy while they compute; the pieces are loop variables, and
    iteration i + 1's shard k reads its piece from them, nothing from the
    host. The graph is what the runtime executes, so this holds on GPUs by
    construction; on logical CPU devices the copy is by reference and costs
    nothing, which is why this is checked on the graph and not by timing.
    """
    devices = CPUS[1:4]
    rng = np.random.default_rng(39)
    w = tf.constant(rng.normal(size=[4, 3]).astype(np.float32))
    f = tfshard.parallelize(lambda b: tf.matmul(b, w), per_sample=False, devices=devices)
    x = rng.normal(size=[10, 4]).astype(np.float32)
    want = x @ w.numpy()  # NumPy: `x @ w` would run on TensorFlow's default device (a GPU)
    got = f(tf.data.Dataset.from_tensor_slices(x).batch(4))
    terms = np.abs(x) @ np.abs(w.numpy())  # a dot product can cancel: its terms' magnitude
    numerics.assert_close(got, want, f.devices, scale=terms.max())
    for guarded in (False, True):  # the last batch's 2 rows leave a device none: both ran
        body, _, library = _loop_body(f, guarded)
        _check_feeds_ahead(body, library, devices)


def _check_feeds_ahead(body, library, devices):
    nodes = {n.name: n for n in body.node_def}
    arguments = [arg.name for arg in body.signature.input_arg]
    returned = [body.ret[arg.name].split(":")[0] for arg in body.signature.output_arg]
    # The shards run in one function the body calls: what shard k's ops read of its
    # arguments, traced back to the body's nodes and arguments that the call passes.
    call, batch = _batch_call(body, library)
    inner = {n.name: n for n in batch.node_def}
    parameters = [arg.name for arg in batch.signature.input_arg]
    passed = [i.split(":")[0] for i in call.input if not i.startswith("^")]
    assert len(passed) == len(parameters)
    shard_ops = {k: [n for n in inner if f"tfshard_shard_{k}/" in n] for k in range(3)}
    assert all(shard_ops.values())

    def reads(k):  # the body's nodes and arguments shard k reads through the call
        names = {
            passed[parameters.index(a)]
            for op in shard_ops[k]
            for a in _ancestors(inner, op)
            if a in parameters
        }
        return names | {a for name in names for a in _ancestors(nodes, name)}

    feeds = {}  # shard -> the Identity that copies its rows of the next batch
    for name, node in nodes.items():
        if "tfshard_feed/shard_" in name and node.op == "Identity":
            k = int(name.split("tfshard_feed/shard_")[1].split("/")[0])
            assert node.device == devices[k], (name, node.device)
            feeds[k] = name
    assert sorted(feeds) == [0, 1, 2]
    for k, feed in feeds.items():
        # The copy waits for nothing of this batch's shards, nor the shards for it ...
        assert call.name not in _ancestors(nodes, feed), feed
        assert not any("tfshard_feed" in a for a in _ancestors(nodes, call.name)), k
        # ... and becomes the loop variable that the next iteration's shard k reads.
        (position,) = [j for j, r in enumerate(returned) if feed in _ancestors(nodes, r)]
        waits_for = reads(k)
        assert not any("tfshard_feed" in a for a in waits_for), k
        carried = waits_for & set(arguments)
        assert arguments[position] in carried
        others = {arguments[j] for j, r in enumerate(returned) if r in feeds.values()} - {
            arguments[position]
        }
        assert not carried & others, (k, carried & others)


PLACEMENT = """
import tfshard
tfshard.virtual_devices(4)
import numpy as np
import tensorflow as tf
tf.debugging.set_log_device_placement(True)
f = tfshard.parallelize(lambda b: b * 2.0, per_sample=False,
                        devices=["cpu:1", "cpu:2", "cpu:3"], output_device="cpu:2")
print(f(tf.data.Dataset.from_tensor_slices(np.ones([10, 2], np.float32)).batch(4)).device)
"""


def test_the_runtime_keeps_fed_rows_on_their_devices_and_results_on_the_output_device():
    """Where TF's placer puts the lowered loop's carriers (its log, in a fresh process).

    A loop variable travels through Enter/Merge/Switch/NextIteration nodes that
    TF adds when it lowers the loop; they are placed like their inputs. Each
    shard's piece is carried on its own device (a piece carried on the host
    would cross to the device and back every batch), the TensorLists of the
    results on the output device (on a GPU, a list carried elsewhere would be
    copied whole, every batch), and the iterator's next element on the host.
    """
    import re

    proc = children.python(PLACEMENT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].endswith("/device:CPU:2")
    log = proc.stdout + proc.stderr  # the placer's log lines; where they go varies
    switches = re.findall(r"\bwhile/(\S+)_switch/_\d+: \(Switch\): \S+device:CPU:(\d)", log)
    placed = dict(switches)
    assert placed, proc.stderr[-3000:]
    for k in range(3):
        assert placed[f"tfshard_feed/shard_{k}/Identity"] == str(k + 1), placed
    assert placed["state"] == "2", placed
    assert placed["Identity"] == "0", placed  # the next element, re-placed on the host


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=0, max_size=6),
    devices=st.integers(1, 4),
    one_batch_per_call=st.booleans(),
)
def test_streams_equal_the_in_memory_call(sizes, devices, one_batch_per_call):
    # Any batch sizes, 0-row batches and batches smaller than the device count among them.
    x = np.random.default_rng(sum(sizes) + 7 * len(sizes)).normal(size=[sum(sizes), 4])
    x = x.astype(np.float32)
    starts = np.cumsum([0, *sizes])
    batches = [x[a:b] for a, b in zip(starts[:-1], starts[1:])]
    ds = tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=tf.TensorSpec([None, 4], tf.float32)
    )
    f = _STREAMED[devices]
    with pytest.MonkeyPatch.context() as patch:
        if one_batch_per_call:
            from tfshard import datasets

            patch.setattr(datasets, "CALL_SECONDS", 0.0)
        out = f(ds)
    want = f(x)
    assert out["y"].shape == want["y"].shape == (len(x), 3)
    # Other batch sizes, other kernels: float32's last bits may differ (numerics).
    numerics.assert_close(out["y"], want["y"], f.devices)
    assert out["n"].numpy().tolist() == want["n"].numpy().tolist()
    numerics.assert_close(out["y"], np.tanh(x @ W.numpy()), f.devices)


_STREAMED = {
    k: tfshard.parallelize(
        lambda s: {"y": embed_one(s), "n": tf.reduce_sum(tf.cast(s > 0, tf.int64))},
        devices=CPUS[:k],
        weights=[1, 3, 2, 1][:k],
    )
    for k in range(1, 5)
}


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "uint16", "uint32", "uint64"])
def test_a_stream_of_dtypes_a_gpu_tensorlist_cannot_hold_comes_back_exact(dtype):
    # On a GPU these travel through the stream's TensorArrays as their carrier dtype
    # (_kinds.CARRIERS); the values and the dtype must come back unchanged.
    info = np.iinfo(dtype)
    x = np.array([info.min, info.max, 0, 1, info.max - 1, 7, 3], dtype=dtype)
    f = tfshard.parallelize(tf.identity, devices=CPUS[:3])
    got = f(tf.data.Dataset.from_tensor_slices(x).batch(3))
    assert got.dtype == tf.as_dtype(dtype)
    np.testing.assert_array_equal(got.numpy(), x)


CTRL_C_LOST_IN_A_FINALIZER = """
import gc, os, signal, sys, time
import numpy as np
import tfshard
tfshard.virtual_devices(2)
import tensorflow as tf

class Finalizer:  # what a traced graph freed by the garbage collector runs
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while Python runs a finalizer
        time.sleep(0.05)

def slow(block):
    Finalizer()  # made and freed while f(ds) traces its loop: Ctrl-C lands in __del__
    return tf.py_function(lambda t: (time.sleep(0.02), t)[1], [block], tf.float32)

f = tfshard.parallelize(slow, per_sample=False, devices=["cpu:0", "cpu:1"])
ds = tf.data.Dataset.from_tensor_slices(np.zeros([2000, 1], np.float32)).batch(2)
start = time.monotonic()
try:
    f(ds)
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.1f} s", flush=True)
"""


def test_ctrl_c_that_python_drops_in_a_finalizer_still_stops_the_stream():
    # Python prints a KeyboardInterrupt raised inside __del__ as ignored and goes
    # on; the stream must still stop at its next call of the loop, not run ~20 s.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", CTRL_C_LOST_IN_A_FINALIZER],
        capture_output=True,
        text=True,
        timeout=60,
        env=children.environ(),
        preexec_fn=children.as_in_a_terminal,
    )
    assert out.stdout.startswith("interrupted after"), (out.stdout, out.stderr[-2000:])
    assert float(out.stdout.split()[2]) < 8.0, out.stdout


# ------------------------------------------------------- Keras's (x, y) datasets


@pytest.mark.parametrize("element", ["x", "(x,)", "(x, y)", "(x, y, w)"])
def test_a_keras_model_takes_a_dataset_as_predict_does(element):
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(21)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    rng = np.random.default_rng(22)
    x = rng.normal(size=(11, 6)).astype(np.float32)
    y, w = rng.integers(0, 3, 11), rng.random(11).astype(np.float32)
    slices = {"x": x, "(x,)": (x,), "(x, y)": (x, y), "(x, y, w)": (x, y, w)}[element]
    dataset = tf.data.Dataset.from_tensor_slices(slices).batch(4)  # 4, 4, 3 rows
    want = model.predict(dataset, verbose=0)  # on the default device: GPU:0 where there is one
    f = tfshard.parallelize(model, devices=CPUS[:2])
    numerics.assert_close(f(dataset), want)
    numerics.assert_close(np.concatenate([b.numpy() for b in f.iterate(dataset)]), want)
    ragged = tf.data.Dataset.from_tensor_slices(slices).padded_batch(4)  # the Python loop
    numerics.assert_close(f(ragged), want)


def test_a_keras_model_refuses_an_element_keras_cannot_unpack_and_a_function_spreads_it():
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    x = np.zeros([4, 2], np.float32)
    four = tf.data.Dataset.from_tensor_slices((x, x, x, x)).batch(2)
    with pytest.raises(ArgumentError, match=r"x, \(x,\), \(x, y\) or \(x, y, sample_weight\)"):
        tfshard.parallelize(model, devices=CPUS[:2])(four)
    # A plain function keeps Dataset.map's rule: a tuple spreads over its parameters.
    f = tfshard.parallelize(lambda a, b: a - b, devices=CPUS[:2])
    pairs = tf.data.Dataset.from_tensor_slices((x + 1, x)).batch(2)
    np.testing.assert_array_equal(f(pairs).numpy(), np.ones([4, 2], np.float32))


def test_a_two_input_model_given_a_pair_per_element_is_told_how_keras_reads_it():
    keras = pytest.importorskip("keras")
    a, b = keras.Input((2,)), keras.Input((2,))
    model = keras.Model([a, b], keras.layers.Add()([a, b]))
    x = np.ones([4, 2], np.float32)
    pairs = tf.data.Dataset.from_tensor_slices((x, 2 * x)).batch(2)
    f = tfshard.parallelize(model, devices=CPUS[:2])
    fix = r"takes 2 inputs.*\(\(x1, x2\),\) or \(\(x1, x2\), y\)"
    with pytest.raises(ArgumentError, match=fix):
        f(pairs)
    inputs_first = tf.data.Dataset.from_tensor_slices(((x, 2 * x),)).batch(2)
    np.testing.assert_array_equal(f(inputs_first).numpy(), 3 * x)


def test_a_function_wrapping_a_model_given_labelled_elements_is_told_the_two_ways():
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    x, y = np.ones([4, 2], np.float32), np.ones([4], np.float32)
    labelled = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    with pytest.raises(ArgumentError, match=r"parallelize the model itself.*lambda x, \*labels"):
        tfshard.parallelize(lambda x: model(x), devices=CPUS[:2])(labelled)


def test_rows_that_differ_between_fields_name_the_dataset_fix_in_the_python_loop_too():
    f = tfshard.parallelize(lambda a, b: a + tf.reduce_sum(b), devices=CPUS[:2])
    ds = tf.data.Dataset.zip(
        (
            tf.data.Dataset.range(6).map(lambda i: tf.ones([i % 2 + 1])).padded_batch(3),
            tf.data.Dataset.range(8).map(lambda i: tf.cast(i, tf.float32)).batch(4),
        )
    )
    with pytest.raises(ArgumentError, match=r"fields of one dataset element.*batch zipped"):
        f(ds)


def test_rows_that_differ_name_the_fix_where_it_is():
    # Fields of an element: the fix is in the dataset, for f.timeline's batch too. A further
    # split argument that differs from them: the fix is broadcast=, as in a call.
    f = tfshard.parallelize(lambda a, b, c=None: a, devices=CPUS[:2])
    zipped = tf.data.Dataset.zip(
        (tf.data.Dataset.range(6).batch(3), tf.data.Dataset.range(8).batch(4))
    )
    fields = r"fields of one dataset element .*\(b has 4 rows but a has 3\).*batch zipped"
    for run in (f, lambda ds: list(f.iterate(ds)), f.timeline):
        with pytest.raises(ArgumentError, match=fields):
            run(zipped)
    agree = tf.data.Dataset.zip((tf.data.Dataset.range(6).batch(3),) * 2)
    further = r"c has 5 rows but a has 3; .*broadcast=\('c',\)"
    with pytest.raises(ArgumentError, match=further):
        f(agree, c=np.zeros([5]))


# A stream's mean is its total divided by its rows, rounded once, as NumPy's: seven rows
# whose means a multiply by the reciprocal of 7 gets one ulp off (float32 84 / 7 = 12, not
# 12.000001; float16 and bfloat16 ties, 2733 and 345, round to even once divided).
_SEVEN_ROWS = {
    "float32": np.arange(28).reshape(7, 4),
    "float16": np.stack([[2848] * 5 + [2844, 2047], np.arange(7) * 3], axis=1),
    "bfloat16": np.stack([[360] * 6 + [255], np.arange(7)], axis=1),
    "int32": np.stack([[5, 0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0], np.arange(7)], axis=1),
}


# Batches of 3 rows (of unknown size when traced), and one of a static 7 rows.
@pytest.mark.parametrize("size, static", [(3, False), (7, True)])
@pytest.mark.parametrize("dtype", list(_SEVEN_ROWS))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_streams_mean_of_exact_values_is_numpys(k, dtype, size, static):
    x = tf.constant(_SEVEN_ROWS[dtype], dtype).numpy()
    if dtype in rounding.LOW_PRECISION:  # NumPy's float16 rule: float32 totals, cast once
        want = np.mean(x.astype(np.float32), 0).astype(x.dtype)
    else:
        want = np.mean(x, 0)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(size, drop_remainder=static)
    for max_rows in (None, 2):
        f = tfshard.parallelize(lambda s: s, reduce="mean", devices=CPUS[:k], max_rows=max_rows)
        np.testing.assert_array_equal(f(ds, batched=True).numpy(), want)
    if dtype == "float32":  # every run of an arange's rows has an exact tf.reduce_mean
        f = tfshard.parallelize(
            lambda b: tf.reduce_mean(b, 0),
            per_sample=False,
            reduce="mean",
            devices=CPUS[:k],
            max_rows=3,
        )
        np.testing.assert_array_equal(f(ds, batched=True).numpy(), want)


@pytest.mark.parametrize("way", ["call", "iterate"])
def test_flags_of_a_stream_that_are_not_what_they_say_are_refused(way):
    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])
    ds = tf.data.Dataset.range(6).batch(3)
    run = f if way == "call" else (lambda d, **kw: list(f.iterate(d, **kw)))
    with pytest.raises(ArgumentError, match="batched='yes' must be True, False or None, not a"):
        run(ds, batched="yes")
    with pytest.raises(ArgumentError, match=r"progress='yes': True for lines on stderr, False"):
        run(ds, progress="yes")
    # The keywords are checked before the dataset (whose scalars have no batch dimension).
    with pytest.raises(ArgumentError, match=r"progress='yes': True for lines on stderr, False"):
        run(tf.data.Dataset.range(6), progress="yes")


def test_batched_takes_a_numpy_bool_as_the_bool_it_is():
    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])
    assert f(tf.data.Dataset.range(6).batch(3), batched=np.True_).numpy().tolist() == [
        0, 2, 4, 6, 8, 10,
    ]  # fmt: skip
    with pytest.raises(ArgumentError, match=r"batched=False: each element is one sample"):
        f(tf.data.Dataset.range(6), batched=np.False_)


# ------------------------------------------ weights="auto"'s caps in a stream


def _planned_by(n, weights, caps):
    """Independent reference of a plan of two devices under caps that hold its `n` rows,
    in exact fractions: device k's share of n by the weights, or its cap where the share
    passes it (the other device then takes the rest); largest remainder (ties to device
    0) rounds it."""
    assert sum(c if c is not None else n for c in caps) >= n  # only where the caps hold n
    total = sum(weights)
    shares = [Fraction(n * w, total) for w in weights]
    for k in (0, 1):
        if caps[k] is not None and shares[k] > caps[k]:
            return [caps[0], n - caps[0]] if k == 0 else [n - caps[1], caps[1]]
    base = [int(s) for s in shares]
    if sum(base) < n:
        k = max((0, 1), key=lambda j: (shares[j] - base[j], -j))
        base[k] += 1
    return base


def _noting_rows(seen):
    """A whole-shard function of x * 2 whose shards note their rows in `seen`."""

    def note(rows, k):
        seen.append((int(k), int(rows)))
        return np.float32(0)

    def twice(block):
        rows = tf.shape(block, out_type=tf.int64)[0]
        return block * 2.0 + tf.py_function(note, [rows, tfshard.shard_index()], tf.float32)

    return twice


def _per_batch(seen):
    """`seen`'s rows as one ``[shard 0's, shard 1's]`` per batch, in order."""
    rows = {0: [n for k, n in seen if k == 0], 1: [n for k, n in seen if k == 1]}
    return [list(pair) for pair in zip(rows[0], rows[1])]


def test_a_streams_batches_are_planned_within_the_caps(one_batch_per_call, tmp_path):
    """Device 1 capped at 3 (as a shard of 6 rows out of its memory would cap it): each
    batch of the traced loop and of the Python loop (`f.iterate`, `f.write`, and
    ``f(dataset)`` of unknown per-sample shapes) is planned within the cap by the
    weights in use as it runs (the reference's plan), the last batch uneven; results
    are NumPy's. Both devices capped (5 and 3): a batch of 9 rows is refused before
    anything runs, as a call of 9 rows is; batches of 8 fit."""
    seen = []
    f = tfshard.parallelize(
        _noting_rows(seen), per_sample=False, devices=CPUS[1:3], weights="auto"
    )
    assert f.balance.cap(1, 6) == 3
    f.balance.due = lambda: None  # calls unmeasured: the Python loop's weights stay
    x = np.random.default_rng(40).normal(size=[23, 3]).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(8)  # 8, 8, 7
    unknown = tf.data.Dataset.from_generator(  # per-sample shapes unknown: the Python loop
        lambda: (x[i : i + 8] for i in range(0, 23, 8)),
        output_signature=tf.TensorSpec([None, None], tf.float32),
    )

    def written(d):
        f.write(d, tmp_path / "out", overwrite=True)
        return tf.constant(tfshard.load(tmp_path / "out"))

    in_use = []
    f.streams.on_call = lambda limit, guarded: in_use.append(f.balance.in_use())
    streams = {
        "traced": lambda: f(ds),
        "iterate": lambda: tf.concat(list(f.iterate(ds)), 0),
        "write": lambda: written(ds),
        "python_loop": lambda: f(unknown),
    }
    for name, run in streams.items():
        seen.clear()
        in_use.clear()
        np.testing.assert_array_equal(run().numpy(), x * 2.0)
        plans = _per_batch(seen)
        assert [sum(p) for p in plans] == [8, 8, 7] and all(p[1] <= 3 for p in plans), name
        if name == "traced":  # one batch a call: each call's weights and caps
            assert [c for _, c in in_use] == [(None, 3)] * 3
            want = [_planned_by(n, w, c) for n, (w, c) in zip([8, 8, 7], in_use)]
        else:  # calls, unmeasured: the weights and caps in use
            assert in_use == []
            want = [_planned_by(n, *f.balance.in_use()) for n in (8, 8, 7)]
        assert plans == want, name
    assert len(f.streams.loops) == 1  # the traced loop ran: one, under the caps
    assert f.balance.cap(0, 10) == 5
    for run in (f, lambda d: list(f.iterate(d))):
        seen.clear()
        with pytest.raises(ArgumentError, match="a batch of 9 rows needs more memory") as error:
            run(tf.data.Dataset.from_tensor_slices(x).batch(9))
        assert "at most 8 rows together (/device:CPU:1: 5, /device:CPU:2: 3)" in str(error.value)
        assert seen == []
    with pytest.raises(ArgumentError, match="a call of 9 rows needs more memory"):
        f(x[:9])
    seen.clear()
    np.testing.assert_array_equal(f(ds).numpy(), x * 2.0)
    assert all(p[0] <= 5 and p[1] <= 3 for p in _per_batch(seen))


def _feed_ops(f):
    """The types of the ops of the traced loop's feeds (`tfshard_feed`: the plan, split
    and copies of each batch), in its call's graph and the functions it calls."""
    (loop,) = f.streams.loops.values()
    graph = loop.graph(False).as_graph_def()
    nodes = [*graph.node, *(n for fn in graph.library.function for n in fn.node_def)]
    return collections.Counter(n.op for n in nodes if "tfshard_feed" in n.name)


def test_a_stream_without_caps_has_no_ops_of_them():
    """The caps' check and water-filling are ops of a capped stream's loop only: the
    loop of a stream of weights="auto" with no caps has no Assert nor SelectV2 in its
    feeds, the same function's loop once a device is capped has both."""
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[1:3], weights="auto")
    ds = tf.data.Dataset.from_tensor_slices(np.ones([10, 2], np.float32)).batch(4)
    f(ds)
    plain = _feed_ops(f)
    assert plain["Assert"] == 0 and plain["SelectV2"] == 0, plain
    f.balance.cap(1, 4)
    np.testing.assert_array_equal(f(ds).numpy(), np.full([10, 2], 2.0, np.float32))
    capped = _feed_ops(f)
    assert capped["Assert"] > 0 and capped["SelectV2"] > 0, capped


# A real out-of-memory on the shard's own device, in a process of its own, as
# test_balance's `_REAL_OUT_OF_MEMORY`: shard 1 asks its device for 2**46 floats where
# its rows pass what `held` says its device holds; a tf.py_function notes each shard's rows.
_STREAM_OUT_OF_MEMORY = """
import json, numpy as np, tensorflow as tf, tfshard
tfshard.virtual_devices(3)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(8)
seen, held = [], {"rows": 5}

def note(rows, k):
    seen.append((int(k), int(rows)))
    return np.int64(held["rows"])

def make():
    def affine(block):
        rows = tf.shape(block, out_type=tf.int64)[0]
        k = tfshard.shard_index()
        limit = tf.py_function(note, [rows, k], tf.int64)
        big = tf.constant(2**46, tf.int64)
        ask = tf.where((k == 1) & (rows > limit), big, tf.constant(1, tf.int64))
        return block * 2.0 + 1.0 + tf.reduce_sum(tf.zeros(tf.reshape(ask, [1])))
    devices = ["/device:CPU:1", "/device:CPU:2"]
    return tfshard.parallelize(affine, devices=devices, per_sample=False, weights="auto")

def run(thunk, want):
    seen.clear()
    try:
        out = thunk()
    except tfshard.TfshardError as error:
        return {"error": type(error).__name__, "first": str(error).splitlines()[0],
                "exhausted": isinstance(error, tf.errors.ResourceExhaustedError)}
    return {"right": bool(np.array_equal(out.numpy(), want * 2.0 + 1.0)), "seen": seen[:]}

x = np.random.default_rng(12).normal(size=[40, 3]).astype(np.float32)
ds = tf.data.Dataset.from_tensor_slices(x).batch(16)  # 16, 16, 8
listed = lambda f: (lambda: tf.concat(list(f.iterate(ds)), 0))
found = {}
# The traced loop's first batch runs out on device 1 (8 rows): capped at 4.
f = make()
found["stream"], found["stream_caps"] = run(lambda: f(ds), x), f.balance.caps()
found["stream_again"], found["stream_call"] = run(lambda: f(ds), x), run(lambda: f(x[:16]), x[:16])
# The Python loop's (f.iterate, f.write) batches are calls: the same.
g = make()
found["iterate"], found["iterate_caps"] = run(listed(g), x), g.balance.caps()
found["iterate_stream"] = run(lambda: g(ds), x)
# A call learns the cap, and the streams after it plan within it.
h = make()
found["call"], found["call_caps"] = run(lambda: h(x[:16]), x[:16]), h.balance.caps()
found["call_stream"], found["call_iterate"] = run(lambda: h(ds), x), run(listed(h), x)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def stream_out_of_memory():
    """What `_STREAM_OUT_OF_MEMORY`'s child found."""
    return children.printed_json(_STREAM_OUT_OF_MEMORY, timeout=300, TF_ENABLE_ONEDNN_OPTS="0")


_WITHIN = [[12, 4], [12, 4], [4, 4]]  # 16, 16, 8 rows with device 1 capped at 4


@pytest.mark.parametrize("learned_by", ["stream", "iterate"])
def test_a_streams_batch_out_of_its_devices_memory_caps_it(stream_out_of_memory, learned_by):
    """The batch of 16 rows gave device 1 8 rows, which ran out of its memory: the
    stream raises the call's error (device, rows, cap) and device 1 is capped at 4; the
    next stream (the traced loop) and the next call fit, results NumPy's."""
    found = stream_out_of_memory
    failed = found[learned_by]
    assert failed["error"] == "ShardResourceExhaustedError" and failed["exhausted"]
    assert failed["first"].startswith(
        f"affine: shard 1 on {CPUS[2]} (rows [8:16) of 16) failed: it ran out of memory. "
    )
    assert f"{CPUS[2]} gets at most 4 rows (it ran out of memory with 8)" in failed["first"]
    assert "from the next call or stream on" in failed["first"]
    assert found[f"{learned_by}_caps"] == [None, 4]
    again = found["stream_again" if learned_by == "stream" else "iterate_stream"]
    assert again["right"] and _per_batch(again["seen"]) == _WITHIN
    if learned_by == "stream":
        call = found["stream_call"]
        assert call["right"] and _per_batch(call["seen"]) == [[12, 4]]


def test_a_cap_learned_by_a_call_holds_in_the_streams_after_it(stream_out_of_memory):
    found = stream_out_of_memory
    assert found["call"]["exhausted"] and found["call_caps"] == [None, 4]
    for case in ("call_stream", "call_iterate"):
        assert found[case]["right"] and _per_batch(found[case]["seen"]) == _WITHIN, case


# --------------------------------- weights="auto": a stream's loop beside other calls


def _stream_calling(itself):
    """A stream of 8 batches through a new weights="auto" function f's traced loop, each
    batch made by a tf.data map calling, from a tf.py_function, f `itself` (a call of f
    beside each call of the loop that fetches a batch) or another function of the same
    body. Returns f's measurements counted and dropped in the stream."""
    w = tf.constant(np.random.default_rng(5).normal(size=[8, 8]).astype(np.float32) / 3)

    def body(b):
        return tf.tanh(b @ w)

    f = tfshard.parallelize(body, devices=CPUS[:2], per_sample=False, weights="auto")
    made = f if itself else tfshard.parallelize(body, devices=CPUS[2:3], per_sample=False)
    xs = np.random.default_rng(6).normal(size=[8, 16, 8]).astype(np.float32)
    ds = tf.data.Dataset.range(8).map(
        lambda i: tf.ensure_shape(
            tf.py_function(lambda j: made(xs[int(j)]), [i], tf.float32), [16, 8]
        )
    )
    got = f(ds, batched=True).numpy()
    want = np.tanh(np.tanh(xs.reshape(-1, 8) @ w.numpy()) @ w.numpy())
    numerics.assert_close(got, want)
    return f.balance.measured, f.balance.dropped


def test_a_streams_loop_call_beside_another_call_is_not_counted():
    """A call of the stream's loop times its batches' shards: one that another call of
    the function ran beside (here its own dataset's map, calling it) holds that call's
    seconds too, and is dropped (f.balance.dropped), as a measured call is."""
    # The reference: the map calls another function (the same body on another device),
    # and f's loop calls run alone.
    measured, dropped = _stream_calling(itself=False)
    assert dropped == 0 and measured >= 1  # every call of the loop but its first counted
    measured, dropped = _stream_calling(itself=True)
    # Every call of the loop that fetched a batch ran beside f's call in the map: only the
    # loop's last call may have fetched none, and the map's first call (before the loop)
    # ran alone.
    assert dropped >= 1 and measured <= 2, (measured, dropped)


def _asserting_over_caps_text(b):
    """The function's own assertion, failing on every batch, whose text is the caps'
    check's (`tfshard.errors.OVER_CAPS`) with two numbers after it."""
    text = tfshard.errors.OVER_CAPS + " the function's own check"
    tf.debugging.Assert(tf.reduce_sum(b) < 0, [text, tf.constant([7]), tf.constant([3])])
    return b * 2.0


@pytest.mark.parametrize("caps", [False, True], ids=["no caps", "caps"])
def test_a_functions_own_error_is_not_taken_for_the_caps_check(caps):
    """A stream's error is the caps' check's (a batch the caps cannot hold) only where its
    loop has caps and the failing op is that check: the function's own assertion of the
    same text is the shard's error, as in a call."""
    f = tfshard.parallelize(
        _asserting_over_caps_text, devices=CPUS[:2], per_sample=False,
        weights="auto" if caps else None,
    )
    if caps:
        f.balance.cap(0, 8)
        f.balance.cap(1, 6)  # 4 and 3 rows: a batch of 4 fits
    x = np.ones([12, 3], np.float32)
    with pytest.raises(tfshard.errors.ShardError, match="own check") as called:
        f(x[:4])
    with pytest.raises(tfshard.errors.ShardError, match="own check") as streamed:
        f(tf.data.Dataset.from_tensor_slices(x).batch(4))
    assert not isinstance(streamed.value, ArgumentError)
    assert type(streamed.value) is type(called.value)


def test_a_streams_batch_over_the_caps_is_refused_with_the_fix():
    f = tfshard.parallelize(lambda b: b * 2.0, devices=CPUS[:2], per_sample=False, weights="auto")
    f.balance.cap(0, 8)
    f.balance.cap(1, 6)  # 4 and 3 rows: 7 together
    x = np.ones([16, 3], np.float32)
    with pytest.raises(ArgumentError, match=r"a batch of 8 rows needs more memory .* at most 7"):
        f(tf.data.Dataset.from_tensor_slices(x).batch(8))
