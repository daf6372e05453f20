"""_shards: what a shard returns, checked alike across shards.

The behaviour of whole shards, empty shards and per-sample outputs is tested
end to end in test_parallel.py; here the checks that name what differs.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard import _shards
from tfshard.errors import ArgumentError

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))


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
        _shards.check_outputs(outputs, CPUS[:2])


def test_check_outputs_names_a_key_that_differs_between_shards():
    outputs = _outputs(lambda x: {"loss": x}, lambda x: {"loss": x, "extra": x})
    with pytest.raises(ArgumentError, match=r"outputs\['extra'\] differs between shards"):
        _shards.check_outputs(outputs, CPUS[:2])


# ------------------------------------------------------------------ hints
# Newcomer mistakes (issue 28): each failure's hint must be the fix for that case.

keras = pytest.importorskip("keras")


def _cnn():
    return keras.Sequential(
        [keras.Input((8, 8, 3)), keras.layers.Conv2D(2, 3), keras.layers.Flatten()]
    )


def _failure(f, *args):
    with pytest.raises(ArgumentError) as raised:
        f(*args)
    return str(raised.value)


def test_a_list_of_images_is_told_to_stack_them():
    images = [np.zeros([8, 8, 3], np.float32)] * 4
    model = _cnn()
    for f in (
        tfshard.parallelize(model, devices=CPUS[:2]),
        tfshard.parallelize(lambda image: model(image[None])[0], devices=CPUS[:2]),
    ):
        message = _failure(f, images)
        assert "is a Python list of 4 arrays" in message and "np.stack(" in message
        assert "per_sample=False" not in message and "broadcast" not in message


def test_one_image_without_its_batch_dimension_is_told_to_add_it():
    message = _failure(tfshard.parallelize(_cnn(), devices=CPUS[:2]), np.zeros([8, 8, 3]))
    assert "looks like one sample without its batch dimension" in message
    assert "[None, 8, 8, 3]" in message and "[None]" in message
    assert "per_sample=False" not in message and "broadcast" not in message


def test_a_layer_made_inside_the_function_is_named_as_the_cause():
    for per_sample, x in ((False, np.zeros([4, 3], np.float32)), (True, np.zeros([4, 3]))):
        f = tfshard.parallelize(
            lambda x, per_sample=per_sample: keras.layers.Dense(2)(x[None] if per_sample else x),
            devices=CPUS[:2],
            per_sample=per_sample,
        )
        message = _failure(f, x)
        assert "makes a variable each time it is traced" in message
        assert "Create it once, outside the function" in message
        assert "per_sample=False" not in message.split("\n", 1)[1]


def test_a_per_sample_failure_says_what_the_function_saw_and_both_remedies():
    def needs_a_batch(x):
        return tf.matmul(x, tf.ones([3, 2]))  # rank 2 only

    message = _failure(tfshard.parallelize(needs_a_batch, devices=CPUS[:2]), np.zeros([4, 3]))
    assert "ran on one sample at a time" in message and "shapes [3]" in message
    assert "pass per_sample=False" in message and "x[None]" in message
    assert "broadcast" not in message  # one argument: nothing to broadcast


# ------------------------------------------------- what pfor gets wrong, per sample


def test_a_one_row_shard_keeps_its_batch_dimension():
    # pfor squeezed a one-row shard's [1] to [] (tf.norm per sample), and the gather failed.
    x = np.arange(21, dtype=np.float32).reshape(7, 3)  # 2, 2, 2, 1 rows on 4 devices
    f = tfshard.parallelize(lambda s: tf.norm(s), devices=CPUS)
    np.testing.assert_allclose(f(x).numpy(), np.linalg.norm(x, axis=1), rtol=1e-6)
    assert [tuple(o.shape) for o in f.per_shard(x)] == [(2,), (2,), (2,), (1,)]


def test_a_per_sample_function_that_writes_a_variable_runs_sample_by_sample():
    # vectorized_map refused assign_add (a TF stack trace) and applied a Keras metric's
    # update once for all samples (2.0 where one device gives 2.5).
    total = tf.Variable(0.0)
    f = tfshard.parallelize(lambda s: total.assign_add(s) * 0.0 + s, devices=CPUS[:2])
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(f(x).numpy(), x)
    assert total.numpy() == x.sum()
    mean = keras.metrics.Mean()
    g = tfshard.parallelize(lambda s: (mean.update_state(s), s)[1], devices=CPUS[:2])
    g(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    assert mean.result().numpy() == 2.5


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
def test_a_per_sample_assertion_holds_for_every_sample_whatever_the_device_count(devices):
    # vectorized_map checked a tf.debugging.assert_* on a shard's first row only: 8 rows
    # passed on 3 or 4 devices and failed on 1 or 2.
    def bounded(s):
        tf.debugging.assert_less(s, 6.0, message="too big")
        return s * 2.0

    f = tfshard.parallelize(bounded, devices=CPUS[:devices])
    with pytest.raises(tf.errors.InvalidArgumentError, match="too big"):
        f(np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(f(np.arange(6, dtype=np.float32)).numpy(), np.arange(6) * 2.0)


# ------------------------------------------------ one row per row, on any device count


@pytest.mark.parametrize("dtype", ["float32", "int32"])  # a ConcatV2, a TensorList
@pytest.mark.parametrize("devices", [1, 2])
def test_a_whole_shard_output_without_a_row_per_row_is_refused_on_any_device_count(
    devices, dtype
):
    # One device's check compares two scalars, several devices' two vectors; both name
    # the output, the shard and its rows.
    f = tfshard.parallelize(lambda b: {"y": b[:1]}, per_sample=False, devices=CPUS[:devices])
    with pytest.raises(
        ArgumentError,
        match=r"outputs\['y'\] on shard 0 \(/device:CPU:0\) has 1 rows for [24]; with "
        r"per_sample=False each output must have one row per input row",
    ):
        f(np.ones([4, 3], dtype))
    # Right rows pass, the same graph.
    x = np.arange(8, dtype=dtype).reshape(4, 2)
    g = tfshard.parallelize(lambda b: {"y": b * 2}, per_sample=False, devices=CPUS[:devices])
    np.testing.assert_array_equal(g(x)["y"].numpy(), x * 2)

