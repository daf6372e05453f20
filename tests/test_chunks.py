"""_chunks: max_rows= runs a shard in chunks, and nothing about its results changes.

References: the same function without max_rows (which tests/test_parallel.py checks
against one device and NumPy), and NumPy itself.
"""

import threading

import numerics
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfshard
from tfshard import ArgumentError

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))
rng = np.random.default_rng(30)


def chunk_sizes(block):
    """Each row tagged with the rows its call saw, and its global row."""
    n = tf.shape(block)[0]
    return tf.stack([tf.cast(tf.fill([n], n), tf.int64), tfshard.row_index()], axis=1)


def _chunks_of(sizes, limit):
    """The chunk size each row of each shard is run in: [m, m, ..., rest] per shard."""
    tags = []
    for n in sizes:
        full, rest = divmod(n, limit)
        tags += [limit] * (full * limit) + [rest] * rest
    return tags


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 30), limit=st.integers(1, 7))
def test_the_function_never_sees_more_than_max_rows_and_rows_stay_in_order(n, limit):
    f = tfshard.parallelize(chunk_sizes, devices=CPUS[:3], per_sample=False, max_rows=limit)
    got = f(np.zeros([n, 2], np.float32)).numpy()
    assert got[:, 0].tolist() == _chunks_of(f.plan(n), limit)
    assert got[:, 1].tolist() == list(range(n))


def test_one_limit_per_device_and_none_for_no_limit():
    f = tfshard.parallelize(
        chunk_sizes, devices=CPUS[:2], per_sample=False, max_rows=[None, 2], weights=[1, 1]
    )
    got = f(np.zeros([9, 1], np.float32)).numpy()
    assert got[:, 0].tolist() == [5] * 5 + [2, 2, 2, 2]


def mlp(sample):
    return tf.tanh(tf.linalg.matvec(W, sample)) * 2.0


W = tf.constant(rng.normal(size=[5, 4]).astype(np.float32))


@pytest.mark.parametrize("reduce", [None, "mean", "min"])  # sum and max: as mean and min
def test_per_sample_results_and_reductions_equal_the_unchunked(reduce):
    rng = np.random.default_rng(300)
    x = rng.normal(size=[23, 4]).astype(np.float32)
    whole = tfshard.parallelize(mlp, devices=CPUS[:3], reduce=reduce)
    chunked = tfshard.parallelize(mlp, devices=CPUS[:3], reduce=reduce, max_rows=3)
    numerics.assert_close(chunked(x).numpy(), whole(x).numpy())
    assert chunked(x[:2]).shape == whole(x[:2]).shape  # empty shards too


def test_a_whole_shard_mean_and_its_gradient_stay_the_batch_mean():
    """A shard's mean loss is weighted by its rows chunk by chunk, as shards are."""
    rng = np.random.default_rng(301)
    v = tf.Variable(rng.normal(size=[4]).astype(np.float32))

    def loss_and_grad(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.linalg.matvec(x, v) - y) ** 2)
        return {"loss": loss, "grad": tape.gradient(loss, v), "per_row": y * 2.0}

    x = rng.normal(size=[17, 4]).astype(np.float32)
    y = rng.normal(size=[17]).astype(np.float32)
    options = dict(devices=CPUS[:2], per_sample=False, reduce="mean", weights=[2, 1])
    chunked = tfshard.parallelize(loss_and_grad, max_rows=4, **options)(x, y)
    whole = tfshard.parallelize(loss_and_grad, **options)(x, y)
    for key in whole:
        numerics.assert_close(chunked[key].numpy(), whole[key].numpy(), err_msg=key)
    residual = x @ v.numpy() - y
    numerics.assert_close(chunked["loss"].numpy(), np.mean(residual**2))


@pytest.mark.parametrize("reduce", ["sum", "max", "min"])
def test_a_whole_shard_value_of_fixed_shape_combines_chunks_as_shards(reduce):
    ops = {"sum": tf.reduce_sum, "max": tf.reduce_max, "min": tf.reduce_min}
    fn = lambda x: ops[reduce](x, axis=0)  # noqa: E731 - a shard's [3] value
    rng = np.random.default_rng(302)
    x = rng.integers(-50, 50, size=[14, 3]).astype(np.int32)
    f = tfshard.parallelize(fn, devices=CPUS[:3], per_sample=False, reduce=reduce, max_rows=2)
    want = {"sum": x.sum(0), "max": x.max(0), "min": x.min(0)}[reduce]
    np.testing.assert_array_equal(f(x).numpy(), want)


def test_ragged_outputs_and_xla_in_chunks():
    ragged = tfshard.parallelize(
        lambda s: tf.range(tf.cast(s, tf.int32) % 4), devices=CPUS[:2], ragged=True, max_rows=2
    )
    assert ragged(np.arange(7)).to_list() == [list(range(i % 4)) for i in range(7)]
    rng = np.random.default_rng(303)
    x = rng.normal(size=[9, 4]).astype(np.float32)
    compiled = tfshard.parallelize(mlp, devices=CPUS[:2], jit_compile=True, max_rows=2)
    numerics.assert_close(compiled(x).numpy(), tfshard.parallelize(mlp)(x).numpy())


@pytest.mark.parametrize("padded", [False, True], ids=["traced_loop", "python_loop"])
def test_a_stream_in_chunks(padded):
    rng = np.random.default_rng(304)
    x = rng.normal(size=[13, 4]).astype(np.float32)
    samples = tf.data.Dataset.from_generator(
        lambda: iter(x), output_signature=tf.TensorSpec([None] if padded else [4], tf.float32)
    )
    ds = samples.padded_batch(5) if padded else samples.batch(5)
    f = tfshard.parallelize(mlp, devices=CPUS[:2], max_rows=2)
    want = tfshard.parallelize(mlp)(x).numpy()
    numerics.assert_close(f(ds).numpy(), want)


def test_chunked_shards_with_a_stateful_function_still_run_at_once():
    """Each shard's chunks wait for the other shard's: only shards at once get through.

    The function is stateful (a stateful numpy_function): without the loop's own token,
    TensorFlow would chain one shard's loop after the other's, and the barrier would
    never be met: its bound only ends that wait, generous for a machine whose cores other
    jobs keep busy (20 s ran out once beside two busy loops and a second test process).
    """
    barrier = threading.Barrier(2, timeout=120)

    def meet(x):
        barrier.wait()
        return x

    f = tfshard.parallelize(
        lambda x: tf.numpy_function(meet, [x], tf.float32, stateful=True),
        devices=CPUS[:2],
        per_sample=False,
        max_rows=2,
    )
    x = np.arange(8, dtype=np.float32).reshape(8, 1)
    np.testing.assert_array_equal(f(x).numpy(), x)  # two chunks on each device


@pytest.mark.parametrize(
    "max_rows, devices, match",
    [
        (0, CPUS[:2], r"max_rows=0: .*int >= 1"),
        ("4", CPUS[:2], r"max_rows='4': .*int >= 1"),
        (True, CPUS[:2], r"max_rows=True"),
        ([2, 0], CPUS[:2], r"max_rows\[1\]=0: each entry is an int >= 1, or None"),
        ([2, 2, 2], CPUS[:2], r"max_rows has 3 entries but devices has 2"),
    ],
)
def test_bad_max_rows_name_the_fix(max_rows, devices, match):
    with pytest.raises(ArgumentError, match=match):
        tfshard.parallelize(tf.identity, devices=devices, max_rows=max_rows)


def test_explain_shows_the_limits():
    f = tfshard.parallelize(tf.identity, devices=CPUS[:2], max_rows=[None, 64])
    assert "  max_rows [-, 64]: at most that many rows at once on each device" in f.explain(
        np.zeros([4])
    )


@pytest.mark.parametrize(
    "fn",
    [lambda b: tf.reduce_sum(b), lambda b: {"y": b, "loss": tf.reduce_sum(b)}],
    ids=["scalar", "in_a_dict"],
)
@pytest.mark.parametrize("max_rows", [2, [None, 2]], ids=["every_device", "one_device"])
def test_a_scalar_per_shard_in_chunks_names_max_rows_and_reduce(fn, max_rows):
    # The reference: the gather's message of the same call without max_rows, which names
    # the output; with chunks it says they are concatenated, and f.per_shard is no fix.
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    whole = tfshard.parallelize(fn, devices=CPUS[:2], per_sample=False)
    with pytest.raises(ArgumentError, match="scalar per shard") as unchunked:
        whole(x)
    output = str(unchunked.value).split(" is a scalar per shard")[0]
    chunked = tfshard.parallelize(fn, devices=CPUS[:2], per_sample=False, max_rows=max_rows)
    for call in (chunked, chunked.per_shard):
        with pytest.raises(ArgumentError) as error:
            call(x)
        message = str(error.value)
        assert message.startswith(f"{output} is a scalar per chunk; with max_rows ")
        assert "reduce=" in message and "drop max_rows" in message


def test_a_scalar_per_shard_in_chunks_is_reduced_as_the_message_says():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    f = tfshard.parallelize(tf.reduce_sum, devices=CPUS[:2], per_sample=False, max_rows=2,
                            reduce="sum")  # fmt: skip
    np.testing.assert_array_equal(f(x).numpy(), x.sum())  # exact: small integers
