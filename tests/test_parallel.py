"""@parallelize: splitting, placement, tracing, nesting, errors.

References are independent of tfshard: the same function on one device
(`tf.vectorized_map` or a plain call), NumPy, or MirroredStrategy.
"""

import collections
import gc
import threading
import weakref
import zlib

import numerics
import numpy as np
import pytest
import rounding
import tensorflow as tf
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tfshard
from tfshard.errors import ArgumentError, DeviceError, ShardError, TfshardError

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))
# Devices no test makes replicas on (with replicas each shard traces its own),
# so tests of the shared trace see it whatever ran before them.
_UNREPLICATED = CPUS[1:]

# Each test seeds its own values (np.random.default_rng(seed)): a test's data must not depend
# on which tests ran before it.
W = tf.constant(np.random.default_rng(0).normal(size=[6, 5]).astype(np.float32))


def embed_one(sample):
    return tf.tanh(tf.linalg.matvec(W, sample, transpose_a=True))


def reference(fn, x, device="/device:CPU:0"):
    """The same per-sample function on one device, without tfshard."""
    with tf.device(device):
        return tf.vectorized_map(fn, tf.convert_to_tensor(x))


@pytest.fixture(scope="module")
def embed():
    # The CPU bed by name: the defaults are the GPUs on a machine that has some.
    return tfshard.parallelize(embed_one, devices=CPUS)


# ------------------------------------------------------------------ basics


def test_default_devices_are_the_gpus_else_every_logical_cpu():
    f = tfshard.parallelize(embed_one)
    gpus = tuple(d.name for d in tf.config.list_logical_devices("GPU"))
    assert f.devices == (gpus or CPUS)  # this machine's: every GPU, else every logical CPU
    assert f.output_device == f.devices[0]
    # Equal to one device of the same kind (TF32's tolerance where a GPU runs in it).
    rng = np.random.default_rng(100)
    x = rng.normal(size=[9, 6]).astype(np.float32)
    want = reference(embed_one, x, f.devices[0]).numpy()
    numerics.assert_close(f(x), want, f.devices)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 17])
def test_per_sample_equals_one_device(embed, n):
    rng = np.random.default_rng(101)
    x = rng.normal(size=[n, 6]).astype(np.float32)
    out = embed(x)
    assert out.shape == (n, 5)
    numerics.assert_close(out.numpy(), reference(embed_one, x).numpy())


def test_bare_and_called_decorator_forms():
    @tfshard.parallelize
    def bare(s):
        return s + 1

    @tfshard.parallelize(devices=["cpu:1", "cpu:2"])
    def called(s):
        return s + 1

    x = np.arange(5.0)
    assert bare(x).numpy().tolist() == called(x).numpy().tolist() == (x + 1).tolist()
    assert called.devices == CPUS[1:3]
    assert bare.__name__ == "bare" and called.__name__ == "called"


def test_tensor_numpy_and_variable_inputs_agree(embed):
    rng = np.random.default_rng(102)
    x = rng.normal(size=[7, 6]).astype(np.float32)
    expected = reference(embed_one, x).numpy()
    for value in (x, tf.constant(x), tf.Variable(x)):
        numerics.assert_close(embed(value).numpy(), expected)


def test_result_lands_on_the_output_device():
    f = tfshard.parallelize(lambda s: s * 2, devices=["cpu:1", "cpu:2"])
    assert f(np.ones([5, 2])).device.endswith("/device:CPU:1")
    g = tfshard.parallelize(lambda s: s * 2, devices=["cpu:1", "cpu:2"], output_device="cpu:3")
    assert g(np.ones([5, 2])).device.endswith("/device:CPU:3")


@pytest.mark.parametrize("index", [0, 1])
def test_an_int_output_device_is_a_gpu_index_even_zero(index):
    # The oracle is resolve_device: GPU `index` where it exists, else its DeviceError.
    f = tfshard.parallelize(lambda s: s * 2, devices=["cpu:2", "cpu:3"], output_device=index)
    try:
        want = tfshard.resolve_device(index)
    except DeviceError:
        with pytest.raises(DeviceError, match=rf"^output_device={index}: device {index} "):
            f(np.ones([5, 2]))
    else:
        assert f(np.ones([5, 2])).device == want


@pytest.mark.parametrize("bad", [False, [], (), np.array([0, 1]), b"cpu", 1.0])
def test_an_output_device_that_is_no_device_is_refused_at_decoration(bad):
    with pytest.raises(
        ArgumentError, match=r"^output_device=.* is of type \w+, not a device: .*None \(the default"
    ):
        tfshard.parallelize(tf.identity, devices=["cpu:2", "cpu:3"], output_device=bad)


def test_an_empty_output_device_name_is_refused_not_read_as_the_default():
    f = tfshard.parallelize(lambda s: s * 2, devices=["cpu:2", "cpu:3"], output_device="")
    with pytest.raises(DeviceError, match=r"^output_device='': device '' is not a device name"):
        f(np.ones([5, 2]))


def test_per_batch_equals_one_device():
    def block(x):
        return tf.tanh(x @ W) * tf.cast(tf.shape(x)[0] >= 0, tf.float32)

    f = tfshard.parallelize(block, per_sample=False)
    rng = np.random.default_rng(103)
    x = rng.normal(size=[11, 6]).astype(np.float32)
    numerics.assert_close(f(x).numpy(), block(tf.constant(x)).numpy())


def test_per_batch_function_sees_its_shard_sizes():
    f = tfshard.parallelize(
        lambda x: tf.fill([tf.shape(x)[0]], tf.shape(x)[0]),
        per_sample=False,
        devices=["cpu:0", "cpu:1", "cpu:2"],
    )
    assert f(np.zeros([8, 1])).numpy().tolist() == [3, 3, 3, 3, 3, 3, 2, 2]


def test_per_batch_matches_mirrored_strategy():
    """Same per-batch function, same devices: MirroredStrategy is the reference."""
    devices = ["/device:CPU:0", "/device:CPU:1"]

    def block(x):
        return tf.tanh(x @ W)

    rng = np.random.default_rng(104)
    x = rng.normal(size=[10, 6]).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy(devices)
    halves = np.split(x, 2)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(halves[ctx.replica_id_in_sync_group])
    )
    per_replica = strategy.run(tf.function(block), args=(values,))
    expected = np.concatenate([t.numpy() for t in strategy.experimental_local_results(per_replica)])
    f = tfshard.parallelize(block, devices=devices, per_sample=False)
    numerics.assert_close(f(x).numpy(), expected)


# ---------------------------------------------------------------- tracing


def test_two_traces_serve_every_batch_size():
    """One graph for every batch that gives each device a row, one for smaller batches.

    A batch that fills the devices runs its shards bare; a smaller one (or none)
    needs the empty-shard guard, a cond whose cost a call that has rows everywhere
    should not pay (`Engine._may_be_empty`).
    """
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2

    devices = _UNREPLICATED
    assert tfshard.replicas.Replicas.find(devices) is None
    f = tfshard.parallelize(fn, devices=devices, per_sample=False)
    for n in (0, 1, 3, 8, 33, 100):
        assert f(np.ones([n, 3], np.float32)).shape == (n, 3)
    assert f.trace_count == 2  # guarded for 0 and 1 row on 3 devices, bare for the rest
    # In each graph the shard on the output device traces in place, the others share
    # one trace (tfshard._sharding.choose).
    assert len(calls) == 4
    f(np.ones([5, 4], np.float32))  # a new per-sample shape is a new signature
    assert f.trace_count == 3
    assert len(calls) == 6


def test_per_sample_traces_its_first_size_exactly_then_once_for_all_sizes():
    f = tfshard.parallelize(embed_one, devices=CPUS)
    for n in (2, 9, 30, 0, 2, 17):
        embed_rows = f(np.ones([n, 6], np.float32))
        assert embed_rows.shape == (n, 5)
        # The reference runs eagerly on TensorFlow's default device (GPU:0 on a GPU machine).
        numerics.assert_close(embed_rows, embed_one(np.ones([n, 6], np.float32)))
    # The first size (2) exactly; then rows open: fewer than devices (0), enough (9, 30, 17).
    assert f.trace_count == 3
    graphs = [f.get_concrete_function(np.ones([n, 6], np.float32)) for n in (2, 9, 17)]
    assert graphs[0].inputs[0].shape.as_list() == [2, 6]
    assert graphs[1] is graphs[2] and graphs[1].inputs[0].shape.as_list() == [None, 6]


def test_new_static_values_trace_again():
    f = tfshard.parallelize(lambda s, scale: s * scale)
    x = np.ones([3], np.float32)
    assert f(x, 2.0).numpy().tolist() == [2, 2, 2]
    assert f(x, 3.0).numpy().tolist() == [3, 3, 3]
    assert f(x, 3.0).numpy().tolist() == [3, 3, 3]
    assert f.trace_count == 2


def test_calls_from_several_threads_are_correct():
    # The 4 CPU devices by name: how many graphs serve sizes 1 to 8 depends on the device
    # count (on 2 GPUs, 2 or 3, as the first thread to call asks for 1 row or more).
    f = tfshard.parallelize(lambda s: s * 3, devices=CPUS)
    results, errors = {}, []

    def work(i):
        try:
            x = np.arange(i + 1, dtype=np.float32) + i
            results[i] = (f(x).numpy(), x * 3)
        except Exception as error:  # noqa: BLE001 - surfaced below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, want in results.values():
        np.testing.assert_array_equal(got, want)
    # The first size exactly (whichever thread came first), then rows open: 1 to 3 rows on
    # the 4 devices (guarded), and 4 to 8 (bare).
    assert f.trace_count == 3


def test_works_inside_another_tf_function(embed):
    @tf.function
    def outer(x):
        return embed(x) + 1.0

    rng = np.random.default_rng(105)
    x = rng.normal(size=[5, 6]).astype(np.float32)
    numerics.assert_close(outer(x).numpy(), reference(embed_one, x).numpy() + 1)


# ----------------------------------------------------------------- nesting


Pair = collections.namedtuple("Pair", "left right")


def test_nested_inputs_and_outputs_keep_their_structure():
    def fn(batch, offset):
        return {
            "sum": batch["a"] + batch["b"][0],
            "pair": Pair(batch["b"][1] * 2, tf.reduce_sum(batch["a"]) + offset),
        }

    f = tfshard.parallelize(fn, devices=CPUS[:3])
    rng = np.random.default_rng(106)
    a = rng.normal(size=[7, 2]).astype(np.float32)
    b0 = rng.normal(size=[7, 2]).astype(np.float32)
    b1 = np.arange(7)
    out = f({"a": a, "b": [b0, b1]}, offset=1.0)
    assert set(out) == {"sum", "pair"} and isinstance(out["pair"], Pair)
    numerics.assert_close(out["sum"].numpy(), a + b0)
    assert out["pair"].left.numpy().tolist() == (b1 * 2).tolist()
    numerics.assert_close(out["pair"].right.numpy(), a.sum(1) + 1)


def test_several_split_arguments_and_keywords():
    f = tfshard.parallelize(lambda x, y, *, z: x * y + z)
    rng = np.random.default_rng(107)
    x, y, z = (rng.normal(size=[9, 3]).astype(np.float32) for _ in range(3))
    numerics.assert_close(f(x, y, z=z).numpy(), x * y + z)


def test_broadcast_arguments_go_whole_to_every_shard():
    def fn(sample, table):
        return tf.gather(table, sample)

    f = tfshard.parallelize(fn, broadcast=("table",))
    rng = np.random.default_rng(108)
    table = rng.normal(size=[4, 3]).astype(np.float32)
    ids = np.array([3, 0, 1, 1, 2, 3, 0])
    np.testing.assert_array_equal(f(ids, table).numpy(), table[ids])
    np.testing.assert_array_equal(f(ids, table=table).numpy(), table[ids])
    g = tfshard.parallelize(fn, broadcast=(1,))
    np.testing.assert_array_equal(g(ids, table).numpy(), table[ids])


def test_python_constants_are_static():
    seen = []

    def fn(sample, mode, scale=None):
        seen.append((mode, scale))
        return sample * (2.0 if mode == "double" else 1.0)

    f = tfshard.parallelize(fn, per_sample=False, devices=CPUS[:2])
    assert f(np.ones([3]), "double").numpy().tolist() == [2, 2, 2]
    assert f(np.ones([3]), "same").numpy().tolist() == [1, 1, 1]
    assert set(seen) == {("double", None), ("same", None)}


def test_captured_variables_are_read_on_each_device():
    v = tf.Variable([1.0, 2.0])
    f = tfshard.parallelize(lambda s: s * v)
    x = np.ones([5, 2], np.float32)
    assert f(x).numpy().tolist() == [[1, 2]] * 5
    v.assign([3.0, 4.0])
    assert f(x).numpy().tolist() == [[3, 4]] * 5


def test_method_decoration_binds_self():
    class Model:
        def __init__(self):
            self.w = tf.constant(3.0)

        @tfshard.parallelize(devices=["cpu:0", "cpu:1"])
        def apply(self, sample):
            return sample * self.w

    assert Model().apply(np.ones([3], np.float32)).numpy().tolist() == [3, 3, 3]


def test_a_method_of_a_temporary_instance_sees_the_instance_itself():
    # tf.function gives such a method self=None; the weakref.proxy tfshard bound
    # to had died by the call (ReferenceError).
    seen = []

    class Model:
        def __init__(self, w):
            self.w = tf.constant(w)

        @tfshard.parallelize(devices=CPUS[:2])
        def apply(self, sample):
            seen.append(self)
            return sample * self.w

    x = np.ones([3], np.float32)
    # Not inside an assert: pytest's rewriting would hold the temporary itself.
    out = Model(3.0).apply(x)
    assert out.numpy().tolist() == [3, 3, 3]
    assert seen and all(type(s) is Model for s in seen)
    m = Model(2.0)
    bound = m.apply
    assert bound(x).numpy().tolist() == [2, 2, 2]
    assert seen[-1] is m and bound.__self__ is m and bound == m.apply
    # Whatever traces on a temporary keeps it alive until done, the stream included.
    stream = Model(4.0).apply.iterate(tf.data.Dataset.from_tensors(x).repeat(2), batched=True)
    gc.collect()
    assert [r.numpy().tolist() for r in stream] == [[4, 4, 4]] * 2
    assert "2 devices" in Model(1.0).apply.explain(x)
    assert Model(5.0).apply.get_concrete_function(x)(x).numpy().tolist() == [5, 5, 5]


def test_autograph_control_flow_in_a_method():
    class Model:
        def __init__(self):
            self.sign = tf.constant(-1.0)

        @tfshard.parallelize(devices=CPUS[:2])
        def apply(self, sample):
            if tf.reduce_sum(sample) > 0:
                return sample
            return self.sign * sample

    x = np.array([[1.0], [-2.0], [3.0]], np.float32)
    m = Model()
    assert m.apply(x).numpy().ravel().tolist() == [1, 2, 3]


def test_autograph_control_flow_in_the_function():
    def fn(sample):
        if tf.reduce_sum(sample) > 0:
            return sample
        return -sample

    f = tfshard.parallelize(fn)
    x = np.array([[1.0], [-2.0], [3.0]], np.float32)
    assert f(x).numpy().ravel().tolist() == [1, 2, 3]


def test_per_sample_falls_back_to_a_loop_for_unvectorizable_ops():
    def fn(sample):
        return tf.py_function(lambda s: s * 2, [sample], tf.float32)

    f = tfshard.parallelize(fn, devices=["cpu:0", "cpu:1"])
    out = f(np.arange(5, dtype=np.float32))
    assert out.numpy().ravel().tolist() == [0, 2, 4, 6, 8]


# ------------------------------------------------------------------ ragged


def test_outputs_of_varying_shape_become_ragged_in_order():
    f = tfshard.parallelize(lambda n: tf.range(n), devices=CPUS[:3])
    out = f(np.array([2, 0, 3, 1, 4]))
    assert isinstance(out, tf.RaggedTensor)
    assert out.to_list() == [[0, 1], [], [0, 1, 2], [0], [0, 1, 2, 3]]


def test_ragged_flag_returns_ragged_even_for_fixed_shapes():
    f = tfshard.parallelize(lambda s: s * 2, ragged=True, devices=CPUS[:2])
    out = f(np.ones([3, 2], np.int32))
    assert isinstance(out, tf.RaggedTensor) and out.to_list() == [[2, 2]] * 3


def test_ragged_inputs_are_split_by_rows():
    f = tfshard.parallelize(lambda row: tf.reduce_sum(row), devices=CPUS[:3])
    rt = tf.ragged.constant([[1, 2], [], [3], [4, 5, 6], [7]])
    assert f(rt).numpy().tolist() == [3, 0, 3, 15, 7]


def test_ragged_results_for_fewer_rows_than_devices():
    f = tfshard.parallelize(lambda n: tf.range(n), devices=CPUS)
    assert f(np.array([2])).to_list() == [[0, 1]]
    assert f(np.zeros([0], np.int64)).to_list() == []


# ------------------------------------------------------------------ reduce


@pytest.mark.parametrize(
    "op, np_op", [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min)]
)
@pytest.mark.parametrize("n", [1, 3, 10])
def test_per_sample_reductions_match_numpy(op, np_op, n):
    f = tfshard.parallelize(lambda s: {"sq": s * s, "s": tf.reduce_sum(s)}, reduce=op)
    rng = np.random.default_rng(109)
    x = rng.normal(size=[n, 3]).astype(np.float32)
    out = f(x)
    numerics.assert_close(out["sq"].numpy(), np_op(x * x, axis=0))
    numerics.assert_close(out["s"].numpy(), np_op(x.sum(1)))


def test_mean_is_over_samples_not_shard_means():
    # 5 rows on 2 devices (3 + 2): the mean of shard means would be 2.25, not 2.0.
    f = tfshard.parallelize(lambda s: s, reduce="mean", devices=CPUS[:2])
    assert f(np.array([0.0, 1.0, 2.0, 3.0, 4.0], np.float32)).numpy() == pytest.approx(2.0)


def test_per_batch_mean_weights_shards_by_size():
    """A shard-mean loss reduces to exactly the full-batch mean, empty shards ignored."""
    f = tfshard.parallelize(
        lambda b: tf.reduce_mean(b, axis=0), per_sample=False, reduce="mean", devices=CPUS
    )
    rng = np.random.default_rng(110)
    for n in (1, 2, 5, 13):
        x = rng.normal(size=[n, 4]).astype(np.float32)
        numerics.assert_close(f(x).numpy(), x.mean(0))


def test_whole_shard_outputs_of_unknown_inner_shape_for_fewer_rows_than_devices():
    """An empty shard's zeros need every inner dimension; unknown ones call the function."""

    def same_shape(b):  # [n, ?] as traced: tf.reshape to a computed shape
        return tf.reshape(b * 2.0, tf.concat([tf.shape(b)[:1], [-1]], 0))

    f = tfshard.parallelize(same_shape, devices=CPUS, per_sample=False)
    rng = np.random.default_rng(111)
    for n in (0, 1, 2, 3, 5):
        x = rng.normal(size=[n, 3]).astype(np.float32)
        numerics.assert_close(f(x).numpy(), (x * 2.0).reshape(n, 3))


def test_per_batch_sum_max_min_skip_empty_shards():
    sum_f = tfshard.parallelize(lambda b: tf.reduce_sum(b), per_sample=False, reduce="sum")
    max_f = tfshard.parallelize(lambda b: tf.reduce_max(b), per_sample=False, reduce="max")
    min_f = tfshard.parallelize(lambda b: tf.reduce_min(b), per_sample=False, reduce="min")
    x = np.array([-3.0, 5.0], np.float32)  # two of four shards are empty
    assert sum_f(x).numpy() == 2.0
    assert max_f(x).numpy() == 5.0
    assert min_f(x).numpy() == -3.0


def test_data_parallel_gradient_step_equals_full_batch():
    rng = np.random.default_rng(112)
    w = tf.Variable(rng.normal(size=[6, 1]).astype(np.float32))
    x = rng.normal(size=[11, 6]).astype(np.float32)
    y = rng.normal(size=[11, 1]).astype(np.float32)

    def grads(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(xb @ w - yb))
        return {"loss": loss, "grad": tape.gradient(loss, w)}

    f = tfshard.parallelize(grads, per_sample=False, reduce="mean", devices=CPUS[:3])
    got = f(x, y)
    want = grads(tf.constant(x), tf.constant(y))
    numerics.assert_close(got["loss"].numpy(), want["loss"].numpy())
    numerics.assert_close(got["grad"].numpy(), want["grad"].numpy())


def test_reductions_over_zero_samples():
    x = np.zeros([0, 2], np.float32)
    assert np.isnan(tfshard.parallelize(lambda s: s, reduce="mean")(x).numpy()).all()
    assert tfshard.parallelize(lambda s: s, reduce="sum")(x).numpy().tolist() == [0, 0]
    assert tfshard.parallelize(lambda s: s, reduce="max")(x).numpy().tolist() == [-np.inf] * 2


def test_integer_mean_is_exact_as_mirrored_strategy_gives_it():
    f = tfshard.parallelize(lambda s: s, reduce="mean", devices=CPUS[:2])
    x = np.array([0, 1, 1], np.int32)
    out = f(x)
    assert out.dtype == tf.float64 and out.numpy() == pytest.approx(2 / 3)
    strategy = tf.distribute.MirroredStrategy(CPUS[:2])
    ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(3))
    per_replica = strategy.run(lambda b: tf.cast(b, tf.float64), args=(next(iter(ds)),))
    mirrored = strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=0)
    assert out.numpy() == pytest.approx(mirrored.numpy())


# One function per device count and reduction (each traces once per dtype), with weights
# so shards differ in size.
_LOW_PRECISION = {
    (k, op): tfshard.parallelize(lambda s: s, reduce=op, devices=CPUS[:k], weights=[1, 3, 2, 1][:k])
    for k in range(1, 5)
    for op in ("sum", "mean", "max", "min")
}


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(0, 200_000),
    devices=st.integers(1, 4),
    op=st.sampled_from(["sum", "mean", "max", "min"]),
    dtype=st.sampled_from(rounding.LOW_PRECISION),
)
@example(n=10**6, devices=4, op="sum", dtype="float16")
@example(n=10**6, devices=4, op="mean", dtype="float16")
@example(n=10**6, devices=4, op="sum", dtype="bfloat16")
@example(n=10**6, devices=4, op="mean", dtype="bfloat16")
def test_low_precision_reductions_are_the_dtypes_rounding_of_the_true_result(n, devices, op, dtype):
    """float16 and bfloat16 total in float32 (as NumPy and JAX do) and come back in their
    own dtype: no sum sticks, no row count overflows, up to a million rows."""
    # In [0, 1/16): a float16 sum of a million rows stays finite (about 31,250).
    x = rounding.values(np.random.default_rng(n), [n, 4], dtype, high=1 / 16)
    out = _LOW_PRECISION[(devices, op)](x)
    rounding.assert_rounded(out, rounding.reference(op, rounding.exact(x)), dtype)


@pytest.mark.parametrize("dtype", rounding.LOW_PRECISION)
def test_a_low_precision_shard_mean_is_weighted_by_shard_size_over_a_million_rows(dtype):
    def shard_mean(b):  # in float32, as a mixed-precision loss is; its value in the dtype
        return tf.cast(tf.reduce_mean(tf.cast(b, tf.float32), 0), b.dtype)

    f = tfshard.parallelize(
        shard_mean, per_sample=False, reduce="mean", devices=CPUS[:3], weights=[1, 3, 2]
    )
    # Centred on 0, so the shard means nearly cancel: a shard size or a product rounded
    # to the dtype (bfloat16 holds 166,667 as 166,912) shows in the mean.
    x = rounding.values(np.random.default_rng(0), [10**6, 2], dtype, low=-1.0)
    sizes = f.plan(len(x))  # shards of 166,667, 500,000 and 333,333 rows
    shards = np.split(x, np.cumsum(sizes)[:-1])
    means = [rounding.exact(shard_mean(tf.constant(s)).numpy()) for s in shards]
    want = sum(m * n for m, n in zip(means, sizes)) / len(x)
    rounding.assert_rounded(f(x), want, dtype)


@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("dtype", ["int8", "int32", "uint32", "int64", "uint64"])
def test_integer_means_total_past_the_dtypes_range(dtype, per_sample):
    """Totals of 8- to 32-bit integers in int64, of 64-bit ones in float64: none wraps."""
    info = np.iinfo(dtype)
    x = np.array([[info.max, info.min]] * 5, dtype)  # 5 rows on 3 devices: 2 + 2 + 1
    # A whole-shard function's value: its first row, which is each of its rows.
    f = tfshard.parallelize(
        (lambda s: s) if per_sample else (lambda b: b[0]),
        per_sample=per_sample,
        reduce="mean",
        devices=CPUS[:3],
    )
    out = f(x)
    result = np.float32 if info.bits <= 16 else np.float64  # as tf.math.truediv gives
    assert out.dtype == result
    np.testing.assert_array_equal(out.numpy(), x.astype(np.float64).mean(0).astype(result))


def test_int32_means_of_the_issue_are_exact():
    f = tfshard.parallelize(lambda s: s, reduce="mean", devices=CPUS[:2])
    assert f(np.full([3, 1], 10**9, np.int32)).numpy().tolist() == [1e9]
    assert f(np.full([4, 1], 2**31 - 1, np.int32)).numpy().tolist() == [2**31 - 1]


# ----------------------------------------------------------------- jit


def test_jit_compile_matches_and_compiles_per_shard(embed):
    f = tfshard.parallelize(embed_one, jit_compile=True, devices=CPUS[:2])
    rng = np.random.default_rng(113)
    x = rng.normal(size=[5, 6]).astype(np.float32)
    numerics.assert_close(f(x).numpy(), reference(embed_one, x).numpy())


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"devices": []}, r"devices=\[\]: give at least one device"),
        ({"reduce": "avg"}, r"reduce='avg': choose one of 'sum', 'mean', 'max', 'min'"),
        (
            {"weights": [1, 2, 3], "devices": ["cpu:0", "cpu:1"]},
            "weights has 3 entries but devices has 2",
        ),
        ({"weights": [1, -1]}, r"weights\[1\]=-1 is negative"),
        ({"weights": [0, 0]}, "at least one weight must be > 0"),
        ({"weights": [1, float("nan")]}, r"weights\[1\]=nan: weights must be finite"),
        ({"weights": ["a"]}, r"weights\[0\]='a' is not a number"),
        ({"weights": 3}, "pass one number per device"),
        ({"ragged": True, "reduce": "sum"}, "ragged=True with reduce='sum'"),
        ({"ragged": True, "per_sample": False}, "ragged=True needs per_sample=True"),
        ({"broadcast": ("table",)}, "broadcast names 'table', but fn has no such parameter"),
    ],
)
def test_bad_options_fail_at_decoration(kwargs, message):
    def fn(x):
        return x

    with pytest.raises(ArgumentError, match=message):
        tfshard.parallelize(fn, **kwargs)


@pytest.mark.parametrize("name", ["per_sample", "ragged", "allow_duplicate_devices", "jit_compile"])
@pytest.mark.parametrize("bad", ["False", "no", 0, 1, 0.0, [], np.array([False, False])])
def test_flags_take_a_bool_not_another_values_truth(name, bad):
    refused = rf"parallelize: {name}=.* must be True(, False or None| or False), not a"
    with pytest.raises(ArgumentError, match=refused):
        tfshard.parallelize(tf.identity, devices=CPUS[:2], **{name: bad})


def test_flags_take_numpy_bools_and_none_where_none_has_a_meaning():
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    column_max = tfshard.parallelize(
        lambda b: tf.reduce_max(b, 0), devices=CPUS[:2], per_sample=np.False_, reduce="max"
    )
    assert column_max(x).numpy().tolist() == [6.0, 7.0]  # the max of each column, per shard
    with pytest.raises(ArgumentError, match=r"per_sample='False' must be True, False or None.*"
                       r"\(None, the default: False for a Keras layer or model"):  # fmt: skip
        tfshard.parallelize(tf.identity, per_sample="False")
    with pytest.raises(ArgumentError, match=r"ragged='no' must be True or False, not a str"):
        tfshard.parallelize(tf.identity, ragged="no", reduce="sum")
    with pytest.raises(ArgumentError, match=r"allow_duplicate_devices=None must be True or False, "
                       r"not None$"):  # fmt: skip
        tfshard.parallelize(tf.identity, allow_duplicate_devices=None)
    with pytest.raises(ArgumentError, match=r"ragged=1 must be True or False, not an int$"):
        tfshard.parallelize(tf.identity, ragged=1)
    doubled = tfshard.parallelize(
        lambda s: s * 2, devices=["cpu:1", "cpu:1"], allow_duplicate_devices=np.True_,
        jit_compile=None, ragged=np.False_,
    )  # fmt: skip
    assert doubled(x).numpy().tolist() == (x * 2).tolist()
    assert isinstance(doubled(x), tf.Tensor)


@pytest.mark.parametrize(
    "devices, message",
    [
        (b"cpu", r"devices=b'cpu' is of type bytes: pass a list of devices"),
        (b"\x00\x01", r"devices=b'\\x00\\x01' is of type bytes: pass a list of devices"),
        (["cpu:0", b"cpu:1"], r"devices\[1\]=b'cpu:1' is of type bytes, not a device"),
        ({"cpu:0"}, r"devices=\{'cpu:0'\} is of type set: pass a list of devices"),
        ([0, True], r"devices\[1\]=True is of type bool, not a device"),
    ],
)
def test_devices_that_are_no_devices_are_refused_at_decoration(devices, message):
    with pytest.raises(ArgumentError, match=message):
        tfshard.parallelize(tf.identity, devices=devices)


def test_numpy_integers_are_the_ints_they_hold_in_devices_and_max_rows():
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    # devices=[np.int64(0)] is GPU 0, as devices=[0] (the oracle: resolve_device(0)).
    f = tfshard.parallelize(lambda s: s * 2, devices=[np.int64(0)], output_device=np.int64(0))
    try:
        want = tfshard.resolve_device(0)
    except DeviceError:
        with pytest.raises(DeviceError, match=r"^device 0 \(/device:GPU:0\) does not exist"):
            f(x)
    else:
        assert f.devices == (want,) and f.output_device == want
    # max_rows as a NumPy array is one per device, as a list is.
    per_device = tfshard.parallelize(
        lambda b: b * 2, devices=CPUS[:2], per_sample=False, max_rows=np.array([1, 2])
    )
    assert per_device(x).numpy().tolist() == (x * 2).tolist()
    with pytest.raises(ArgumentError, match=r"max_rows has 2 entries but devices has 3"):
        tfshard.parallelize(tf.identity, devices=CPUS[:3], max_rows=np.array([1, 2]))
    with pytest.raises(ArgumentError, match=r"max_rows\[0\]=np.float64\(1.0\): each entry is an"):
        tfshard.parallelize(tf.identity, devices=CPUS[:2], max_rows=np.array([1.0, 2.0]))
    assert tfshard.parallelize(tf.identity, devices=CPUS[:3]).plan(np.int64(7)) == [3, 2, 2]


def test_methods_that_take_tensors_refuse_a_dataset_with_the_fix():
    @tfshard.parallelize(devices=CPUS[:2])
    def double(s):
        return s * 2

    ds = tf.data.Dataset.from_tensor_slices(np.zeros([4, 2], np.float32)).batch(2)
    refused = (
        r"^double.explain\(\) takes tensors and arrays, not a tf.data.Dataset; explain one of "
        r"its batches, double.explain\(next\(iter\(dataset\)\)\), or record one as it runs "
        r"with double.timeline\(dataset\)$"
    )
    with pytest.raises(ArgumentError, match=refused):
        double.explain(ds)
    for method in ("get_concrete_function", "get_measured_function"):
        refused = (
            rf"^double.{method}\(\) takes tensors and arrays, not a tf.data.Dataset; pass one "
            rf"of its batches, double.{method}\(next\(iter\(dataset\)\)\)$"
        )
        with pytest.raises(ArgumentError, match=refused):
            getattr(double, method)(ds)
    # ... and the fixes they name run.
    batch = next(iter(ds))
    assert "[0:1)" in double.explain(batch)
    assert double.get_concrete_function(batch) is not None
    # A dataset elsewhere than first in a call: the call streams only a first one.
    with pytest.raises(ArgumentError, match=r"y is a tf.data.Dataset; to stream it, pass a "
                       r"dataset as the first positional argument of a call, <lambda>\(dataset, "
                       r"\.\.\.\); anywhere else pass tensors or arrays"):  # fmt: skip
        tfshard.parallelize(lambda x, y: x, devices=CPUS[:2])(np.zeros([2]), ds)


def test_weights_length_is_checked_against_default_devices():
    n = len(tf.config.list_logical_devices("GPU")) or len(CPUS)  # the defaults' count
    f = tfshard.parallelize(tf.identity, weights=[1] * (n + 1))
    with pytest.raises(ArgumentError, match=rf"weights has {n + 1} entries but there are {n} "):
        f(np.ones([3]))


def test_duplicate_devices_need_an_opt_in():
    f = tfshard.parallelize(tf.identity, devices=["cpu:1", "/device:CPU:1"])
    with pytest.raises(
        ArgumentError,
        match=r"devices\[0\]='cpu:1' and devices\[1\]='/device:CPU:1' are both "
        r"/device:CPU:1.*allow_duplicate_devices=True",
    ):
        f(np.ones([3]))
    g = tfshard.parallelize(tf.identity, devices=["cpu:1", "cpu:1"], allow_duplicate_devices=True)
    assert g(np.arange(3)).numpy().tolist() == [0, 1, 2]


def test_context_names_alias_one_card_with_opt_in():
    with tfshard.use_contexts("dev0->cpu:2;dev1->cpu:2", log=False):
        f = tfshard.parallelize(tf.identity, devices=["dev0", "dev1"], allow_duplicate_devices=True)
        assert f.devices == ("/device:CPU:2", "/device:CPU:2")
        assert f(np.arange(5)).numpy().tolist() == [0, 1, 2, 3, 4]


def test_unknown_device_is_a_device_error():
    f = tfshard.parallelize(tf.identity, devices=["cpu:0", "GPU:3"])
    with pytest.raises(DeviceError, match="'GPU:3'"):
        f(np.ones([2]))


def test_mismatched_leading_dimensions_name_both_arguments():
    f = tfshard.parallelize(lambda x, y: x + y)
    with pytest.raises(ArgumentError, match=r"y has 8 rows but x has 7.*broadcast=\('y',\)"):
        f(np.ones([7, 2]), np.ones([8, 2]))


def test_mismatch_inside_a_structure_names_the_path():
    f = tfshard.parallelize(lambda d: d["a"])
    with pytest.raises(ArgumentError, match=r"d\['b'\]\[1\] has 2 rows but d\['a'\] has 3"):
        f({"a": np.ones([3]), "b": [np.ones([3]), np.ones([2])]})


def test_rank_zero_input_explains_broadcast():
    f = tfshard.parallelize(lambda x, s: x * s)
    with pytest.raises(ArgumentError, match=r"s is a scalar \(rank 0\).*broadcast=\('s',\)"):
        f(np.ones([3]), tf.constant(2.0))


def test_no_tensor_argument():
    f = tfshard.parallelize(lambda x: x)
    with pytest.raises(ArgumentError, match="got no tensor or array to split"):
        f([1.0, 2.0])


def test_wrong_arguments_for_the_signature():
    f = tfshard.parallelize(lambda x: x)
    with pytest.raises(ArgumentError, match="too many positional arguments"):
        f(np.ones(3), np.ones(3))


def test_unhashable_constant():
    f = tfshard.parallelize(lambda x, opts: x)
    with pytest.raises(ArgumentError, match=r"opts is a set, which is neither a tensor"):
        f(np.ones(3), {1, 2})


def test_sparse_input_is_refused_with_a_remedy():
    f = tfshard.parallelize(lambda x: x)
    sparse = tf.sparse.from_dense(tf.eye(3))
    with pytest.raises(ArgumentError, match=r"tf.SparseTensor.*tf.sparse.to_dense"):
        f(sparse)


def test_sparse_broadcast_argument():
    f = tfshard.parallelize(
        lambda i, m: tf.sparse.to_dense(m)[i], broadcast=("m",), devices=CPUS[:2]
    )
    m = tf.sparse.from_dense(tf.constant([[0.0, 1.0], [2.0, 0.0]]))
    assert f(np.array([1, 0, 1]), m).numpy().tolist() == [[2, 0], [0, 1], [2, 0]]


@pytest.mark.parametrize("per_sample", [True, False])
def test_non_tensor_outputs_name_the_path(per_sample):
    f = tfshard.parallelize(lambda x: {"ok": x, "bad": "text"}, per_sample=per_sample)
    with pytest.raises(ArgumentError, match=r"outputs\['bad'\] is str 'text'") as raised:
        f(np.ones([3, 1]))
    assert "StagingError" not in type(raised.value).__name__
    g = tfshard.parallelize(lambda x: None, per_sample=per_sample)
    with pytest.raises(ArgumentError, match="forget to return"):
        g(np.ones([3, 1]))


def test_scalar_per_shard_output_without_reduce():
    f = tfshard.parallelize(lambda b: tf.reduce_sum(b), per_sample=False)
    with pytest.raises(ArgumentError, match=r"outputs is a scalar per shard.*reduce="):
        f(np.ones([4]))


def test_bool_output_cannot_be_summed():
    f = tfshard.parallelize(lambda s: s > 0, reduce="sum")
    with pytest.raises(ArgumentError, match=r"outputs has dtype bool.*cast it"):
        f(np.ones([3]))


def test_failure_in_a_shard_names_device_and_rows():
    f = tfshard.parallelize(lambda s: tf.debugging.check_numerics(s, "bad value"), devices=CPUS[:2])
    x = np.array([1.0, 2.0, 3.0, np.nan, 5.0], np.float32)
    with pytest.raises(
        ShardError, match=r"shard 1 on /device:CPU:1 \(rows \[3:5\) of 5\) failed"
    ) as raised:
        f(x)
    # Still the TensorFlow error type, for existing handlers.
    assert isinstance(raised.value, tf.errors.InvalidArgumentError)
    assert isinstance(raised.value, TfshardError)


def test_bad_input_errors_are_value_errors():
    with pytest.raises(ValueError):
        tfshard.parallelize(tf.identity, reduce="nope")


def test_plan_and_explain_validate():
    f = tfshard.parallelize(tf.identity, devices=CPUS[:2])
    with pytest.raises(ArgumentError, match=r"plan\(n=-1\)"):
        f.plan(-1)
    text = f.explain(np.zeros([3, 2]))
    assert "[0:2)" in text and "[2:3)" in text and "-> /device:CPU:0" in text


# ------------------------------------------------- review regressions


def test_broadcast_position_passed_by_keyword_still_broadcasts():
    f = tfshard.parallelize(lambda x, w: tf.reduce_sum(x * w), broadcast=(1,), devices=CPUS)
    x = np.ones([4, 4], np.float32)
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    assert f(x, w).numpy().tolist() == f(x, w=w).numpy().tolist() == [120.0] * 4


def test_broadcast_position_out_of_range():
    with pytest.raises(ArgumentError, match=r"broadcast=2: a position must be 0..1"):
        tfshard.parallelize(lambda x, w: x, broadcast=(2,))


def test_ragged_row_splits_dtype_is_part_of_the_signature():
    f = tfshard.parallelize(lambda row: tf.reduce_sum(row), devices=CPUS[:2])
    r64 = tf.ragged.constant([[1, 2], [3], [4, 5]])
    r32 = r64.with_row_splits_dtype(tf.int32)
    assert f(r64).numpy().tolist() == f(r32).numpy().tolist() == [3, 3, 9]


def test_methods_trace_per_instance_without_keeping_it_alive():
    class Model:
        def __init__(self, scale):
            self.scale = scale

        @tfshard.parallelize(devices=CPUS[:2])
        def apply(self, sample):
            return sample * self.scale

    m, other = Model(2.0), Model(3.0)
    for n in (3, 5, 7):  # per instance: its first size, then one trace for every size
        assert m.apply(np.ones([n], np.float32)).numpy().tolist() == [2] * n
    assert other.apply(np.ones([2], np.float32)).numpy().tolist() == [3, 3]
    assert (m.apply.trace_count, other.apply.trace_count) == (2, 1)
    ds = tf.data.Dataset.from_tensor_slices(np.ones([5], np.float32))
    assert m.apply(ds, batch_size=2).numpy().tolist() == [2.0] * 5
    assert [r.shape[0] for r in m.apply.iterate(ds, batch_size=2)] == [2, 2, 1]
    assert "rows" in m.apply.explain(np.ones([3], np.float32))
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None
    assert other.apply.trace_count == 1


def test_trace_errors_in_the_function_explain_per_sample():
    W5 = tf.ones([3, 5])
    f = tfshard.parallelize(lambda x: tf.matmul(x, W5))
    with pytest.raises(ArgumentError, match=r"(?s)traced on one sample .*\(3,\).*per_sample=False"):
        f(np.ones([8, 3], np.float32))


def test_numpy_scalars_are_tensors_not_trace_constants():
    f = tfshard.parallelize(lambda x, s: x * s, broadcast=("s",), devices=CPUS[:2])
    for i in range(3):
        assert f(np.ones([2], np.float32), np.float32(i)).numpy().tolist() == [i, i]
    assert f.trace_count == 1


def test_dict_outputs_keep_their_key_order():
    f = tfshard.parallelize(lambda s: {"z": s, "a": s * 2}, devices=CPUS[:2])
    out = f(np.ones([3]))
    assert list(out) == ["z", "a"]
    g = tfshard.parallelize(lambda d: d, devices=CPUS[:2])
    assert list(g(collections.OrderedDict(b=np.ones(2), a=np.ones(2)))) == ["b", "a"]


def test_defaultdicts_in_and_out_keep_their_type_and_factory():
    # As tf.nest keeps them (tf.function hands the function a plain dict).
    f = tfshard.parallelize(lambda d: d["a"] * (1 + len(d["unset"])), devices=CPUS[:2])
    given_ = collections.defaultdict(list, a=np.ones(3))
    assert f(given_).numpy().tolist() == [1, 1, 1]
    g = tfshard.parallelize(lambda s: collections.defaultdict(int, z=s, a=s), devices=CPUS[:2])
    out = g(np.ones(3))
    assert type(out) is collections.defaultdict and out.default_factory is int
    assert list(out) == ["z", "a"] and out["unset"] == 0
    streamed = g(tf.data.Dataset.from_tensor_slices(np.ones(5)), batch_size=2)
    assert type(streamed) is collections.defaultdict and streamed.default_factory is int


# ------------------------------------------------- shards that get no rows


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
def test_ragged_outputs_with_inner_dims_when_shards_are_empty(n):
    # Per-sample outputs [s, 3]: stacked ragged, and empty shards keep the inner 3.
    f = tfshard.parallelize(lambda s: tf.fill([s, 3], s), devices=CPUS[:3])
    x = np.arange(n, dtype=np.int32) % 4
    out = f(x)
    assert out.shape.as_list() == [n, None, 3]
    assert out.to_list() == [[[int(s)] * 3] * int(s) for s in x]


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_outputs_of_unknown_rank_when_shards_are_empty(n):
    # A numpy_function has no static shape and vectorized_map falls back to a loop.
    f = tfshard.parallelize(
        lambda s: tf.numpy_function(lambda v: v * 2, [s], tf.float32), devices=CPUS[:3]
    )
    x = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    out = f(x).numpy()
    assert out.tolist() == (x * 2).tolist() or (n == 0 and out.shape == (0,))


class _LazyDense(tf.Module):
    """Creates its kernel on the first call, as a Keras layer builds."""

    def __init__(self):
        super().__init__()
        self.kernel = None

    def __call__(self, sample):
        if self.kernel is None:
            self.kernel = tf.Variable(tf.reshape(tf.range(15.0), [3, 5]) / 15.0)
        return tf.matmul(sample, self.kernel)


def _avg_pool_gradient(sample):
    image = sample[None, :, :, None]  # [2, 3] -> [1, 2, 3, 1]
    with tf.GradientTape() as tape:
        tape.watch(image)
        pooled = tf.nn.avg_pool2d(image, 2, 1, "SAME")
        loss = tf.reduce_sum(pooled * pooled)
    return tape.gradient(loss, image)[0, :, :, 0]


# Per-sample functions of [2, 3] samples whose outputs have rank >= 1; each broke
# (or returned the wrong shape) on a shard with no rows.
PER_SAMPLE_FUNCTIONS = {
    "matmul": lambda s: tf.matmul(s, tf.ones([3, 5])),
    "conv2d": lambda s: tf.nn.conv2d(s[None, :, :, None], tf.ones([2, 2, 1, 4]), 1, "SAME")[0],
    "avg_pool_gradient": _avg_pool_gradient,
    "sparse_softmax_cross_entropy": lambda s: tf.nn.sparse_softmax_cross_entropy_with_logits(
        tf.constant([0, 2]), s
    ),
    "print": lambda s: (tf.print(s[0, 0], output_stream="file:///dev/null"), s * 2)[1],
    "variable_created_once": _LazyDense(),
}


@pytest.mark.parametrize("name", sorted(PER_SAMPLE_FUNCTIONS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 3 * len(CPUS)), seed=st.integers(0, 2**16))
def test_per_sample_functions_for_every_batch_size(name, n, seed):
    """Batches from 0 rows to 3K on K devices: every sample once, in order, as on one device."""
    fn = PER_SAMPLE_FUNCTIONS[name]
    f = _PER_SAMPLE_SHARDED.setdefault(name, tfshard.parallelize(fn, devices=CPUS))
    x = np.random.default_rng(seed).normal(size=[n, 2, 3]).astype(np.float32)
    out = f(x)
    with tf.device("/device:CPU:0"):
        one = tf.function(lambda s: fn(s)).get_concrete_function(tf.TensorSpec([2, 3]))
        expected = np.stack([one(s).numpy() for s in x]) if n else None
    if n == 0:
        assert out.shape[0] == 0 and out.shape[1:] == one.structured_outputs.shape
    else:
        numerics.assert_close(out.numpy(), expected)


_PER_SAMPLE_SHARDED: dict = {}


# ------------------------------------------------------- callable objects


def test_a_keras_layer_or_model_wrapped_directly_runs_per_batch():
    # Built and run once on the CPU bed by name (TensorFlow's default would be GPU:0).
    with tf.device(CPUS[0]):
        x = np.random.default_rng(0).normal(size=[7, 6]).astype(np.float32)
        dense = tf.keras.layers.Dense(5)
        dense.build((None, 6))
        numerics.assert_close(tfshard.parallelize(dense, devices=CPUS)(x), dense(x))
        model = tf.keras.Sequential(
            [tf.keras.Input([8, 8, 3]), tf.keras.layers.Conv2D(4, 3), tf.keras.layers.Flatten()]
        )
        images = np.random.default_rng(1).normal(size=[3, 8, 8, 3]).astype(np.float32)
        f = tfshard.parallelize(model, devices=CPUS)
        assert f.__name__ == model.__class__.__name__ == "Sequential"
        numerics.assert_close(f(images), model(images))
        # Its attributes stay its own and ours stay ours.
        assert not hasattr(f, "layers") and f.__wrapped__ is model


def test_a_tf_module_with_attributes_of_ours_names():
    class Scale(tf.Module):
        def __init__(self):
            super().__init__()
            self._lock, self._fn, self._engine = True, None, "not tfshard's"
            self.w = tf.Variable(3.0)

        def __call__(self, sample):
            return sample * self.w

    f = tfshard.parallelize(Scale(), devices=CPUS[:2])
    assert f(np.arange(3, dtype=np.float32)).numpy().tolist() == [0.0, 3.0, 6.0]


class _Sign:
    """A plain callable object with Python control flow on a tensor."""

    def __call__(self, x):
        if tf.reduce_sum(x) > 0:
            return x
        return -x


class _SignModule(tf.Module):
    def __call__(self, x):
        if tf.reduce_sum(x) > 0:
            return x
        return -x


@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("make", [_Sign, _SignModule])
def test_callable_objects_get_autograph_as_in_tf_function(make, per_sample):
    obj = make()
    x = np.array([[1.0], [-2.0], [3.0], [-4.0]], np.float32)
    f = tfshard.parallelize(obj, devices=CPUS[:2], per_sample=per_sample)
    one = tf.function(obj)  # the reference: tf.function converts the object's __call__
    if per_sample:
        expected = np.concatenate([one(row)[None] for row in x])
    else:  # two shards of two rows
        expected = np.concatenate([one(x[:2]), one(x[2:])])
    assert f(x).numpy().tolist() == expected.tolist()


def _xla_clusters(f, x):
    """The calls compiled with XLA in the graph `f` runs for `x`."""
    graph = f.get_concrete_function(x).graph
    return sum(
        op.type in ("PartitionedCall", "StatefulPartitionedCall") and op.get_attr("_XlaMustCompile")
        for op in graph.get_operations()
    )


def test_options_are_never_taken_from_the_wrapped_object():
    inner = tf.function(lambda s: s * 2.0, jit_compile=False)
    f = tfshard.parallelize(inner, devices=CPUS[:2], jit_compile=True)
    assert f(np.arange(4.0, dtype=np.float32)).numpy().tolist() == [0.0, 2.0, 4.0, 6.0]
    assert _xla_clusters(f, np.zeros([4], np.float32)) == 2  # one per shard


@tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
def _centred(block):
    return block - tf.reduce_mean(block, axis=0)


class _Centred(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def __call__(self, block):
        return _centred.python_function(block)


@pytest.mark.parametrize("make", [lambda: _centred, _Centred], ids=["function", "module"])
def test_a_tf_functions_input_signature_still_refuses_what_it_does_not_take(make):
    # tfshard calls its Python function, which would take one sample (and centre the
    # sample's own two values): the signature refuses it, as the tf.function does.
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    f = tfshard.parallelize(make(), devices=CPUS[:2])  # per sample
    with pytest.raises(ArgumentError, match=r"(?s)takes block as .*\(2,\).*per_sample=False"):
        f(x)
    g = tfshard.parallelize(make(), devices=CPUS[:2], per_sample=False)
    want = np.concatenate([x[:3] - x[:3].mean(0), x[3:] - x[3:].mean(0)])  # two shards of 3
    np.testing.assert_array_equal(g(x).numpy(), want)
    with pytest.raises(ArgumentError, match=r"takes block .* dtype float64"):
        g(x.astype(np.float64))


def test_a_tf_function_made_with_jit_compile_has_each_shard_compiled():
    # tfshard calls its Python function, so it compiles the shards as the tf.function would.
    inner = tf.function(lambda s: s * 2.0, jit_compile=True)
    f = tfshard.parallelize(inner, devices=CPUS[:2])
    assert f(np.arange(4.0, dtype=np.float32)).numpy().tolist() == [0.0, 2.0, 4.0, 6.0]
    assert _xla_clusters(f, np.zeros([4], np.float32)) == 2  # one per shard


@tf.function(jit_compile=True)
def _first_few(sample):
    return tf.range(tf.cast(sample[0], tf.int32) % 3)  # a row of 0 to 2 values


def test_a_tf_functions_jit_compile_gives_way_to_ragged_rows():
    # XLA compiles the function, not tf.map_fn's list of rows around it: ragged=True runs
    # without XLA, as the tf.function itself runs on each sample (the reference).
    x = np.arange(14, dtype=np.float32).reshape(7, 2)
    f = tfshard.parallelize(_first_few, devices=CPUS[:3], ragged=True)
    assert f(x).to_list() == [_first_few(row).numpy().tolist() for row in x]


def test_a_tf_functions_jit_compile_with_rows_of_unknown_shape_names_the_fixes():
    # Each sample's output has its own length, so tfshard stacks them one sample at a
    # time, which XLA cannot compile; the tf.function itself compiles on each sample.
    x = np.arange(14, dtype=np.float32).reshape(7, 2)
    want = [_first_few(row).numpy().tolist() for row in x]
    fixes = r"(?s)one sample at a time .* fixed shape .*jit_compile=False.*ragged=True"
    with pytest.raises(ShardError, match=fixes):
        tfshard.parallelize(_first_few, devices=CPUS[:3])(x)
    explicit = tfshard.parallelize(_first_few.python_function, devices=CPUS[:3],
                                   jit_compile=True, ragged=True)  # fmt: skip
    with pytest.raises(ShardError, match=fixes):
        explicit(x)
    for fixed in (
        tfshard.parallelize(_first_few, devices=CPUS[:3], ragged=True),
        tfshard.parallelize(_first_few.python_function, devices=CPUS[:3], jit_compile=False,
                            ragged=True),  # fmt: skip
    ):
        assert fixed(x).to_list() == want


def test_a_tf_functions_jit_compile_of_strings_names_them():
    as_text = tf.function(tf.strings.as_string, jit_compile=True)
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="AsString"):
        as_text(x)  # the reference: XLA refuses the tf.function itself
    f = tfshard.parallelize(as_text, devices=CPUS[:2], per_sample=False)
    with pytest.raises(ShardError, match=r"no kernel for op \w+ on string tensors"):
        f(x)


@pytest.mark.parametrize("read", [tfshard.shard_index, tfshard.row_index])
def test_per_shard_in_a_tf_function_refuses_a_position_another_trace_left_in_a_tf_function(read):
    # The inner tf.function's first trace (a call on one device) holds that call's
    # position; per_shard traced into a caller's graph would hand it to every shard (a
    # TypeError when run, before). The fix the error names: read it outside, pass it in.
    @tf.function
    def scaled(block):
        return block * tf.cast(read(), block.dtype)[..., None]

    def outside(block, position):
        return block * tf.cast(position, block.dtype)[..., None]

    x = np.ones([7, 2], np.float32)
    alone = tfshard.parallelize(lambda b: scaled(b) + 0.0, devices=CPUS[:1], per_sample=False)
    np.testing.assert_array_equal(alone(x).numpy(), np.arange(7)[:, None] * x if read is
                                  tfshard.row_index else 0 * x)  # fmt: skip
    f = tfshard.parallelize(lambda b: scaled(b) + 0.0, devices=CPUS[1:4], per_sample=False)
    with pytest.raises(TfshardError, match=r"(?s)read inside a tf.function .*pass it in"):
        tf.function(lambda t: f.per_shard(t))(x)
    passed = tf.function(outside)
    g = tfshard.parallelize(lambda b: passed(b, read()), devices=CPUS[1:4], per_sample=False)
    got = tf.function(lambda t: g.per_shard(t))(x)
    starts = np.cumsum([0, *g.plan(7)])
    for i, part in enumerate(got):
        rows = np.arange(starts[i], starts[i + 1])
        position = rows if read is tfshard.row_index else np.full(len(rows), i)
        np.testing.assert_array_equal(part.numpy(), position[:, None] * x[: len(rows)])


@tf.function(autograph=False)
def _flipped_unless_positive(sample):
    if tf.reduce_sum(sample) > 0:  # a tensor as a Python bool: autograph=False refuses it
        return sample
    return -sample


def test_a_tf_function_made_with_autograph_false_runs_converted():
    # TF has no public way to read autograph=False: tfshard converts its Python function
    # (its docstring says so), as a tf.function made with autograph=True would run it.
    x = np.array([[1.0, 2.0], [-5.0, 1.0], [3.0, 3.0], [-1.0, -1.0]], np.float32)
    with pytest.raises(TypeError, match="as a Python `bool`"):
        _flipped_unless_positive(x[0])  # the tf.function itself
    converted = tf.function(_flipped_unless_positive.python_function)  # the reference
    f = tfshard.parallelize(_flipped_unless_positive, devices=CPUS[:2])
    np.testing.assert_array_equal(f(x).numpy(), [converted(row).numpy() for row in x])


_BLOCK = tf.TensorSpec([None, 2], tf.float32)


@tf.function(input_signature=[_BLOCK, tf.TensorSpec([], tf.float32)])
def _scaled(block, k):
    return block * k, tf.fill(tf.shape(block)[:1], k) / 2


@pytest.mark.parametrize("k", [3, 3.0], ids=["int", "float"])
def test_an_input_signature_converts_python_values_as_the_tf_function_does(k):
    # The reference: the tf.function itself on each shard's rows (two shards of 3), which
    # turns k into a float32 tensor; its Python function on k as given would not.
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    f = tfshard.parallelize(_scaled, devices=CPUS[:2], per_sample=False)
    got = f(x, k)
    parts = [_scaled(tf.constant(x[:3]), k), _scaled(tf.constant(x[3:]), k)]
    for i in range(2):
        want = np.concatenate([p[i].numpy() for p in parts])
        assert got[i].dtype == want.dtype == np.float32
        np.testing.assert_array_equal(got[i].numpy(), want)
    with pytest.raises(ArgumentError, match=r"takes k as .*float32.* not a float32 tensor"):
        f(x, "three")


@tf.function(input_signature=[_BLOCK, _BLOCK])
def _added(*blocks):
    return blocks[0] + blocks[1]


def test_an_input_signature_pairs_its_specs_with_star_args():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    f = tfshard.parallelize(_added, devices=CPUS[:2], per_sample=False)
    want = np.concatenate([_added(x[:3], 2 * x[:3]), _added(x[3:], 2 * x[3:])])
    np.testing.assert_array_equal(f(x, 2 * x).numpy(), want)
    with pytest.raises(ArgumentError, match=r"takes blocks\[1\] as .* dtype float64"):
        f(x, x.astype(np.float64))


_ROW = tf.TensorSpec([None], tf.float32)
_Other = collections.namedtuple("_Other", "right left")

# (the signature's spec of y, y, whether the tf.function takes it): lists and tuples
# as TensorFlow casts them (by kind), a nested Python list where a spec is converted whole.
_SIGNED = [
    ((_ROW, _ROW), ([1.0, 2.0], [3.0]), True),
    ((_ROW, _ROW), [[1.0, 2.0], [3.0]], False),  # a list where it has a tuple
    ([_ROW, _ROW], [[1.0, 2.0], [3.0]], True),
    ([_ROW, _ROW], ([1.0, 2.0], [3.0]), False),  # a tuple where it has a list
    ((_ROW, _ROW), ([1.0], [2.0], [3.0]), False),  # three where it has two
    ({"a": _ROW, "b": tf.TensorSpec([None], tf.int32)}, {"a": [1.0, 2.0], "b": [3, 4]}, True),
    ({"a": _ROW}, {"a": [1.0], "b": [2.0]}, False),  # a key it does not have
    ({"a": [_ROW, _ROW]}, {"a": [[1.0], [2.0, 5.0]]}, True),
    ({"a": [_ROW, _ROW]}, {"a": ([1.0], [2.0])}, False),
    (tf.TensorSpec([None, 3]), [[1, 2, 3], [4, 5, 6]], True),  # converted whole
    (tf.TensorSpec([None, 3]), [[1, 2, 3], [4, 5]], False),  # not rectangular
    ((tf.TensorSpec([None, 3]), _ROW), ([[1, 2, 3], [4, 5, 6]], (7.0, 8.0)), True),
    (_ROW, (1.0, 2.0), True),
    (Pair(_ROW, _ROW), _Other(right=[1.0], left=[2.0, 3.0]), True),  # as a Pair
    ((_ROW, _ROW), Pair([1.0], [2.0, 3.0]), True),  # a namedtuple is a tuple
    ((tf.TensorSpec([None], tf.int32),), ([1.5],), False),
    ((tf.RaggedTensorSpec([None, None]),), ([[1.0, 2.0], [3.0]],), False),  # not converted
]


def _leaf_sum_and_kinds(x, y):
    # x plus every leaf's total, plus a number that tells which structure y came as
    total = tf.add_n([tf.cast(tf.reduce_sum(t), tf.float32) for t in tf.nest.flatten(y)])
    kinds = repr(tf.nest.map_structure(lambda t: 0, y))
    return x + total + float(zlib.crc32(kinds.encode()) % 997)


@pytest.mark.parametrize("spec, y, takes", _SIGNED)
def test_an_input_signature_casts_nested_structures_as_the_tf_function_does(spec, y, takes):
    # The reference: the tf.function itself, called on the whole batch (its result is
    # per row, so it is the shards' results concatenated), or its refusal.
    signed = tf.function(_leaf_sum_and_kinds, input_signature=[_ROW, spec])
    x = np.arange(6, dtype=np.float32)
    f = tfshard.parallelize(signed, devices=CPUS[:2], per_sample=False)
    try:
        want = signed(x, y).numpy()
    except TypeError:
        assert not takes
        with pytest.raises(ArgumentError, match=r"takes y as .* but tfshard gives it y of"):
            f(x, y)
    else:
        assert takes
        np.testing.assert_array_equal(f(x, y).numpy(), want)


@tf.function(input_signature=[(_ROW, _ROW)])
def _sum_of_pair(pair):
    return pair[0] + pair[1]


def test_an_input_signature_refuses_a_split_list_where_it_has_a_tuple():
    a, b = np.arange(6, dtype=np.float32), np.ones(6, np.float32)
    with pytest.raises(TypeError, match="tuple"):
        _sum_of_pair([a, b])  # the reference refuses the list
    f = tfshard.parallelize(_sum_of_pair, devices=CPUS[:2], per_sample=False)
    np.testing.assert_array_equal(f((a, b)).numpy(), _sum_of_pair((a, b)).numpy())
    with pytest.raises(ArgumentError, match=r"takes pair as .* gives it pair of a list"):
        f([a, b])


# ------------------------------------------------ whole-shard rows, reduce


@pytest.mark.parametrize("n", [0, 1, 3, 8, 9])
@pytest.mark.parametrize("op, np_op", [("sum", np.sum), ("mean", np.mean), ("max", np.max)])
def test_per_row_outputs_of_whole_shards_reduce_over_all_rows(n, op, np_op):
    losses = tfshard.parallelize(
        lambda b: tf.reduce_sum(b * b, axis=1), per_sample=False, reduce=op, devices=CPUS[:3]
    )
    rng = np.random.default_rng(114)
    x = rng.normal(size=[n, 4]).astype(np.float32)
    if n == 0 and op == "max":
        return  # no rows: the identity of max, as tf.reduce_max gives
    expected = np_op(np.sum(x * x, axis=1)) if n else (np.nan if op == "mean" else 0.0)
    numerics.assert_close(losses(x).numpy(), expected)


def test_shard_values_and_per_row_values_together():
    def step(b):
        return {"per_row": tf.reduce_sum(b, axis=1), "shard_mean": tf.reduce_mean(b, axis=0)}

    f = tfshard.parallelize(step, per_sample=False, reduce="mean", devices=CPUS[:3])
    rng = np.random.default_rng(115)
    x = rng.normal(size=[10, 2]).astype(np.float32)
    out = f(x)
    numerics.assert_close(out["per_row"].numpy(), np.mean(x.sum(1)))
    numerics.assert_close(out["shard_mean"].numpy(), x.mean(0))


@pytest.mark.parametrize("n", [2, 8])
def test_whole_shard_outputs_without_a_row_per_row_are_refused(n):
    f = tfshard.parallelize(
        lambda b: {"m": tf.reduce_mean(b, axis=0, keepdims=True)}, per_sample=False, devices=CPUS
    )
    with pytest.raises(
        ArgumentError,
        match=r"outputs\['m'\] on shard \d \(/device:CPU:\d\) has 1 rows for [02]; with "
        r"per_sample=False each output must have one row per input row",
    ):
        f(np.ones([n, 3], np.float32))
    f_sum = tfshard.parallelize(
        lambda b: tf.reduce_sum(b, axis=1)[:1], per_sample=False, reduce="sum", devices=CPUS[:2]
    )
    with pytest.raises(ArgumentError, match=r"outputs on shard 0 .* has 1 rows for 4"):
        f_sum(np.ones([8, 3], np.float32))


# ------------------------------------------------------- bad input, census


def test_weights_whose_sum_overflows_still_plan():
    big = np.finfo(np.float64).max / 2
    f = tfshard.parallelize(lambda s: s, devices=CPUS[:3], weights=[big, big, big / 2])
    assert f.plan(10) == [4, 4, 2]
    assert f(np.arange(10.0)).numpy().tolist() == list(range(10))


def test_a_batch_of_2_31_rows_is_refused_before_the_graph():
    f = tfshard.parallelize(lambda s: s, devices=CPUS[:2])
    with pytest.raises(ArgumentError, match=r"s has 2147483648 rows; .*fewer than 2\*\*31 rows"):
        f(np.zeros([2**31, 0], np.float32))  # no elements: nothing is allocated


def test_split_arguments_of_different_rows_inside_a_tf_function():
    f = tfshard.parallelize(lambda a, b: a + b, devices=CPUS[:2])

    @tf.function(input_signature=[tf.TensorSpec([None]), tf.TensorSpec([None])])
    def outer(a, b):
        return f(a, b=b)

    assert outer(tf.ones([3]), tf.ones([3])).numpy().tolist() == [2.0] * 3
    # The check fails while the user's own tf.function runs: its message says it all.
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"(?s)split arguments with different numbers of rows: a, b, .*same leading "
        r"dimension.*broadcast=.*\[3 4\]",
    ):
        outer(tf.ones([3]), tf.ones([4]))


@pytest.mark.parametrize("shard", [0, 1])  # traced in place; calling the shared trace
def test_a_shard_error_shows_the_users_frames_once_and_not_tfshards(shard):
    def my_step(block):
        return tf.debugging.check_numerics(tf.math.log(block), "log of a negative")

    # Three devices: shards 1 and 2 share a trace (with two, both trace in place).
    f = tfshard.parallelize(my_step, per_sample=False, devices=_UNREPLICATED)
    x = np.ones(9, np.float32)
    x[3 * shard : 3 * shard + 3] = -1.0  # negative in this shard's rows only
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        f(x)
    message = str(raised.value)
    assert f"shard {shard} on {_UNREPLICATED[shard]}" in message
    assert "log of a negative" in message and "in tf__my_step" in message
    assert "tfshard/_" not in message and "tfshard/parallel.py" not in message
    # (every shard has rows, so shard 0 runs the function bare, in place; the shared
    # trace keeps its empty-shard cond, cond/, and its nodes are named as in it)
    node = "tfshard_shard_0/CheckNumerics" if shard == 0 else "cond/CheckNumerics"
    assert message.count(f"Detected at node {node} ") == 1


@pytest.mark.parametrize("per_sample", [True, False])
def test_every_failing_shard_is_named_again_and_again(per_sample):
    """A shard's failure cancels the step; the error must still name it, every time.

    A failure inside a called function can lose the race to the cancelled
    receives beside it (measured: 3 to 14 of 20 failures of a shard on the
    output device came back as a bare CancelledError when it ran as a call).
    """
    f = tfshard.parallelize(
        lambda s: tf.debugging.check_numerics(tf.math.log(s), "log of a negative"),
        devices=_UNREPLICATED,
        per_sample=per_sample,
    )
    named = collections.Counter()
    for _ in range(4):
        for bad in range(9):
            x = np.ones(9, np.float32)
            x[bad] = -1.0
            with pytest.raises(ShardError) as raised:
                f(x)
            shard = bad // 3
            named[f"shard {shard} on {_UNREPLICATED[shard]}" in str(raised.value)] += 1
    assert named == {True: 36}


@pytest.mark.parametrize("seeded", ["op seed", "global seed", "stateless"])
def test_a_seeded_random_op_repeats_one_stream_on_every_shard(seeded):
    """README's promise, shard on the output device and shared-trace shards alike."""

    def noise(x):
        if seeded == "stateless":
            return x + tf.random.stateless_uniform([1], seed=[1, 2])
        return x + tf.random.uniform([1], seed=7 if seeded == "op seed" else None)

    f = tfshard.parallelize(noise, devices=_UNREPLICATED, per_sample=False)
    if seeded == "global seed":
        tf.random.set_seed(5)
    try:
        out = f(np.zeros([3, 1], np.float32)).numpy()  # one row per shard
    finally:
        tf.random.set_seed(None)
    assert np.all(out == out[0]) and 0 < out[0, 0] < 1, out


def test_shards_off_the_output_device_call_one_shared_trace_each_on_its_device():
    devices = _UNREPLICATED
    assert tfshard.replicas.Replicas.find(devices) is None
    f = tfshard.parallelize(lambda s: s * 2.0, devices=devices)
    graph_def = f.get_concrete_function(np.ones([8, 3], np.float32)).graph.as_graph_def()
    calls = [n for n in graph_def.node if n.op in ("PartitionedCall", "StatefulPartitionedCall")]
    # Shard 0, on the output device, is traced in place (see _sharding.choose).
    assert [n.name.split("/")[0] for n in calls] == [f"tfshard_shard_{k}" for k in (1, 2)]
    assert [n.device for n in calls] == list(devices[1:])
    (name,) = {n.attr["f"].func.name for n in calls}
    library = {fd.signature.name: fd for fd in graph_def.library.function}
    assert library[name].attr["_noinline"].b  # run as a function: errors name the call
    assert not any(n.device for n in library[name].node_def)  # it runs where each call runs


def test_scalar_per_sample_outputs_on_every_path():
    # Vectorized: numbers. tf.map_fn (ragged=True): string work, which pfor cannot vectorize.
    square_sum = tfshard.parallelize(lambda s: tf.reduce_sum(s * s), devices=CPUS)
    assert square_sum(np.arange(10.0).reshape(5, 2)).numpy().tolist() == [1, 13, 41, 85, 145]
    words = np.array([b"a b c", b"d", b"", b"e f", b"g"])
    size = tfshard.parallelize(lambda s: tf.size(tf.strings.split(s)), devices=CPUS, ragged=True)
    assert size(words).numpy().tolist() == [3, 1, 0, 2, 1]
    both = tfshard.parallelize(
        lambda s: (tf.size(tf.strings.split(s)), tf.strings.split(s)), devices=CPUS, ragged=True
    )
    count, split = both(words[:3])  # 3 rows on 4 devices: an empty shard too
    assert count.numpy().tolist() == [3, 1, 0]
    assert split.to_list() == [[b"a", b"b", b"c"], [b"d"], []]


def test_a_pfor_failure_suggests_ragged():
    size = tfshard.parallelize(lambda s: tf.size(tf.strings.split(s)), devices=CPUS[:2])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?s)vectorized_map.*ragged=True"):
        size(np.array([b"a b c", b"d", b"", b"e f"]))


def test_random_noise_keyed_by_row_equals_one_device():
    """The documented recipe: stateless ops seeded by (seed, row id) give each row its own
    noise, the same on any number of devices as on one."""

    def noisy(sample, row):
        return sample + tf.random.stateless_normal([3], seed=tf.stack([7, row]))

    x = np.zeros([9, 3], np.float32)
    rows = np.arange(9, dtype=np.int64)
    f = tfshard.parallelize(noisy, devices=CPUS)
    out = f(x, rows).numpy()
    with tf.device("/device:CPU:0"):
        one = tf.vectorized_map(lambda a: noisy(*a), (tf.constant(x), tf.constant(rows))).numpy()
    numerics.assert_close(out, one)
    assert len({tuple(r) for r in out.round(6)}) == 9  # no two rows share noise


def test_a_fixed_seed_repeats_per_shard_as_documented():
    # One traced function runs on every shard: an op-seeded random op gives each
    # shard the same stream (as MirroredStrategy does). README: "Random ops".
    f = tfshard.parallelize(
        lambda b: tf.random.stateless_uniform(tf.shape(b), seed=[1, 2]),
        per_sample=False,
        devices=CPUS[:2],
    )
    out = f(np.zeros([8], np.float32)).numpy()
    assert out[:4].tolist() == out[4:].tolist()


def test_a_saved_model_exports_the_tf_function_that_calls_it(tmp_path):
    class Embedder(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(tf.reshape(tf.range(6.0), [3, 2]))
            self.embed = tfshard.parallelize(self.one, devices=CPUS[:2])
            self.serve = tf.function(self.embed, input_signature=[tf.TensorSpec([None, 3])])

        def one(self, sample):
            return tf.linalg.matvec(self.w, sample, transpose_a=True)

    module = Embedder()
    rng = np.random.default_rng(116)
    x = rng.normal(size=[5, 3]).astype(np.float32)
    tf.saved_model.save(module, str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    assert not hasattr(loaded, "embed")  # a ShardedFunction is not a tf.function: not exported
    numerics.assert_close(loaded.serve(x).numpy(), x @ module.w.numpy())


def test_a_keras_model_built_first_trains_through_tfshard_as_on_one_device():
    # Built and run once on the CPU bed by name (TensorFlow's default would be GPU:0).
    rng = np.random.default_rng(117)
    with tf.device(CPUS[0]):
        model = tf.keras.Sequential([tf.keras.Input([6]), tf.keras.layers.Dense(3)])  # built
        x = rng.normal(size=[10, 6]).astype(np.float32)
        y = rng.normal(size=[10, 3]).astype(np.float32)

        def loss(batch, target):
            return tf.reduce_mean(tf.square(model(batch) - target))

        f = tfshard.parallelize(loss, per_sample=False, reduce="mean", devices=CPUS[:3])
        with tf.GradientTape() as tape:
            sharded = f(x, y)
        grads = tape.gradient(sharded, model.trainable_variables)
        with tf.GradientTape() as tape:
            one = loss(x, y)
        expected = tape.gradient(one, model.trainable_variables)
        assert all(g is not None for g in grads)
        for g, e in zip(grads, expected):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-4, atol=1e-6)


def test_batch_norm_updates_its_moving_statistics_once_per_shard_as_documented():
    bn = tf.keras.layers.BatchNormalization(momentum=0.5, epsilon=0.0)
    bn.build((None, 1))
    x = np.array([[0.0], [2.0], [10.0], [14.0]], np.float32)  # shard means 1 and 12
    f = tfshard.parallelize(lambda b: bn(b, training=True), per_sample=False, devices=CPUS[:2])
    f(x)
    # Each shard moves the mean halfway to its own batch mean, one after the other.
    either_order = [0.5 * (0.5 * 1.0) + 0.5 * 12.0, 0.5 * (0.5 * 12.0) + 0.5 * 1.0]
    moved = float(bn.moving_mean.numpy()[0])
    assert any(moved == pytest.approx(v) for v in either_order), moved
    assert moved != pytest.approx(0.5 * x.mean())  # what one device's update gives


@pytest.mark.parametrize("per_sample", [True, False])
def test_a_failing_row_names_its_own_shard_wherever_it_is(per_sample):
    f = tfshard.parallelize(
        lambda s: tf.debugging.check_numerics(tf.math.log(s), "log of a negative"),
        devices=CPUS,
        per_sample=per_sample,
    )
    # Shards of two rows on 4 devices; shard 0's rows again: its failure once
    # raced the shared shards' cancellation and lost its message.
    for bad in [*range(8), 0, 1, 0, 1, 0, 1]:
        x = np.ones(8, np.float32)
        x[bad] = -1.0
        k = bad // 2
        with pytest.raises(
            tf.errors.InvalidArgumentError,
            match=rf"shard {k} on /device:CPU:{k} \(rows \[{2 * k}:{2 * k + 2}\) of 8\) failed",
        ):
            f(x)


def test_a_method_with_broadcast_positions_says_to_name_them():
    class Model:
        @tfshard.parallelize(devices=CPUS[:2], broadcast=(1,))
        def apply(self, x, w):
            return x * tf.reduce_sum(w)

    with pytest.raises(ArgumentError, match=r"apply is a method .*name its arguments instead"):
        Model().apply  # noqa: B018


def test_an_ordinary_failure_in_a_per_sample_function_gets_no_pfor_hint():
    f = tfshard.parallelize(
        lambda s: tf.debugging.check_numerics(tf.math.log(s), "neg"), devices=CPUS[:2]
    )
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        f(np.array([1.0, -1.0], np.float32))
    assert "ragged=True" not in str(raised.value)


# ------------------------------------- outputs that do not depend on the sample

_CONSTANT_OUTPUTS = {
    # name: (per-sample fn of (c, sample), NumPy reference of (c, y))
    "broadcast argument as it is": (lambda c, s: c, lambda c, y: np.full(len(y), c)),
    "constant": (lambda c, s: tf.constant(5, tf.int64), lambda c, y: np.full(len(y), 5)),
    "shape only": (lambda c, s: tf.shape(s), lambda c, y: np.tile(y.shape[1:], [len(y), 1])),
    "mixed with a per-sample output": (
        lambda c, s: (c, 2.0 * s, tf.constant(1.5)),
        lambda c, y: (np.full(len(y), c), 2.0 * y, np.full(len(y), 1.5)),
    ),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(_CONSTANT_OUTPUTS)),
    devices=st.integers(1, 4),
    rows=st.integers(0, 9),
)
def test_a_per_sample_output_that_ignores_the_sample_is_stacked_per_row(kind, devices, rows):
    fn, reference = _CONSTANT_OUTPUTS[kind]
    y = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    f = tfshard.parallelize(fn, devices=CPUS[:devices], broadcast=("c",))
    got = tf.nest.map_structure(lambda t: t.numpy(), f(np.float32(3), y))
    for out, want in zip(tf.nest.flatten(got), tf.nest.flatten(reference(np.float32(3), y))):
        np.testing.assert_array_equal(out, np.asarray(want, out.dtype))


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_a_variables_value_per_sample_and_per_row_of_a_whole_shard(devices):
    v = tf.Variable([1.0, 2.0])
    y = np.zeros([5, 3], np.float32)
    per_sample = tfshard.parallelize(lambda s: v.read_value(), devices=CPUS[:devices])
    np.testing.assert_array_equal(per_sample(y).numpy(), np.tile([1.0, 2.0], [5, 1]))
    # A whole shard's per-row output built from shapes and a variable, not the rows.
    whole = tfshard.parallelize(
        lambda x: tf.broadcast_to(v, [tf.shape(x)[0], 2]),
        devices=CPUS[:devices],
        per_sample=False,
    )
    np.testing.assert_array_equal(whole(y).numpy(), np.tile([1.0, 2.0], [5, 1]))


# ------------------------------------------------------------ each shard's own

_PER_SHARD_FNS = {
    # name: (whole-shard fn, NumPy reference on one shard's rows)
    "scalar": (tf.reduce_sum, lambda x: x.sum()),
    "fixed shape": (lambda x: tf.reduce_max(x, axis=0), lambda x: x.max(0) if len(x) else None),
    "any length": (lambda x: x[: tf.shape(x)[0] // 2], lambda x: x[: len(x) // 2]),
    "nested": (
        lambda x: {"rows": tf.shape(x)[0], "first": x[:1]},
        lambda x: {"rows": len(x), "first": x[:1]},
    ),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(_PER_SHARD_FNS)),
    devices=st.integers(1, 4),
    rows=st.integers(0, 11),
    weighted=st.booleans(),
)
def test_per_shard_gives_each_shards_value_as_it_is_on_its_device(kind, devices, rows, weighted):
    fn, reference = _PER_SHARD_FNS[kind]
    weights = [3, 1, 2, 1][:devices] if weighted else None
    if kind == "fixed shape" and rows < (devices if not weighted else 8):
        rows = 8 * devices  # no empty shard: reduce_max of no rows is -inf, not NumPy's error
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    f = tfshard.parallelize(fn, devices=CPUS[:devices], per_sample=False, weights=weights)
    results = f.per_shard(x)
    assert isinstance(results, tuple) and len(results) == devices
    start = 0
    for k, (result, size) in enumerate(zip(results, f.plan(rows))):
        want = reference(x[start : start + size])
        start += size
        for got, expected in zip(tf.nest.flatten(result), tf.nest.flatten(want)):
            np.testing.assert_array_equal(got.numpy(), expected)
            assert got.device.endswith(CPUS[k][len("/device:") :]), (k, got.device)


def test_per_shard_of_a_per_sample_function_stacks_each_shards_rows():
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:3])
    x = np.arange(7, dtype=np.float32)
    parts = f.per_shard(x)
    assert [p.numpy().tolist() for p in parts] == [[0, 2, 4], [6, 8], [10, 12]]
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in parts]), f(x).numpy())


def test_per_shard_takes_no_dataset():
    f = tfshard.parallelize(lambda s: s, devices=CPUS[:2])
    with pytest.raises(ArgumentError, match=r"per_shard\(\) takes tensors.*iterate\(dataset\)"):
        f.per_shard(tf.data.Dataset.range(4).batch(2))


def test_a_scalar_per_shard_names_per_shard_as_a_remedy():
    f = tfshard.parallelize(tf.reduce_sum, devices=CPUS[:2], per_sample=False)
    with pytest.raises(ArgumentError, match=r"scalar per shard.*f\.per_shard"):
        f(np.ones([4], np.float32))


# ------------------------------------------------- a newcomer's first mistakes


def test_a_python_generator_is_sent_to_dataset_from_generator():
    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])
    batches = (np.ones([4, 3], np.float32) for _ in range(3))
    with pytest.raises(ArgumentError, match=r"generator or iterator.*Dataset\.from_generator"):
        f(batches)


def test_a_stream_keyword_on_a_tensor_says_it_is_for_datasets():
    f = tfshard.parallelize(lambda s: s * 2, devices=CPUS[:2])
    x = np.ones([4, 3], np.float32)
    for key, value in (("batch_size", 2), ("progress", True), ("batched", True)):
        with pytest.raises(ArgumentError, match=rf"{key}= is for a tf.data.Dataset"):
            f(x, **{key: value})
    # A function that takes the keyword itself gets it.
    g = tfshard.parallelize(lambda s, batch_size: s * batch_size, devices=CPUS[:2])
    np.testing.assert_array_equal(g(x, batch_size=3).numpy(), 3 * x)


def test_per_shard_names_a_failing_shard_on_four_devices():
    # Every shard's outputs cross to the output device beside the shards: through the
    # shared trace a failure came back as a bare CancelledError, 20 times in 20.
    def bounded(block):
        tf.debugging.assert_less(tf.reduce_max(block), 10.0, message="too big")
        return block * 2.0

    f = tfshard.parallelize(bounded, devices=CPUS, per_sample=False)
    x = np.zeros([8], np.float32)
    x[7] = 30.0  # shard 3's rows
    for _ in range(5):
        named = r"(?s)^bounded: shard 3 on .*too big"
        with pytest.raises(tf.errors.InvalidArgumentError, match=named):
            f.per_shard(x)
