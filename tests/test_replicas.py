"""Tests of tfshard.replicas: one copy of the weights per device, read where each shard runs.

Where a variable's read is placed is read from the traced graph: TensorFlow places a
ReadVariableOp where its variable is, so a shard whose op takes the handle of a variable on
another device copies that variable to its own on every call. The references are
independent: the model on one device, `tf.distribute.MirroredStrategy` on the same devices,
and the variables' sizes from their shapes.
"""

from __future__ import annotations

import contextlib

import numerics
import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard.errors import ArgumentError
from tfshard.replicas import Replicas, apply_gradients, variable_reads

keras = pytest.importorskip("keras")

DEVICES = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]


# Models, variables and references live on DEVICES[0], /device:CPU:0 (conftest).
pytestmark = pytest.mark.usefixtures("built_on_the_cpu_bed")


def _home(variable) -> str:
    """Where a (Keras) variable lives, as a local name (/device:CPU:0)."""
    held = variable if isinstance(variable, tf.Variable) else variable.value
    spec = tf.DeviceSpec.from_string(held.device)
    return tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index).to_string()


def _cnn() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((12, 12, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(5),
        ]
    )


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 12, 12, 3), dtype=np.float32)


def _sizes(model: keras.Model) -> int:
    return sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in model.get_weights())


def _reads(f, *args):
    return variable_reads(f.get_concrete_function(*args), f.devices)


def test_without_replicas_other_shards_read_the_weights_from_their_home_device():
    keras.utils.set_random_seed(1)
    model = _cnn()
    f = tfshard.parallelize(model, devices=DEVICES)
    x = _images(7)
    reads = _reads(f, x)
    home = _home(model.weights[0])  # where the eager variables were created
    assert {_home(w) for w in model.weights} == {home} == {DEVICES[0]}
    assert [len(r) for r in reads] == [len(model.weights)] * 3
    assert all(not r.remote and r.device == home for r in reads[0])
    assert all(r.remote and r.device == home for shard in reads[1:] for r in shard)
    text = f.explain(x)
    crossing = 2 * _sizes(model)  # shards 1 and 2 read every weight from CPU:0
    assert 2**10 <= crossing < 2**20  # so it reads in KiB, binary units as nvidia-smi's MiB
    assert f"each call reads {crossing / 2**10:.1f} KiB of variables" in text
    assert sum(sum(r.nbytes for r in s if r.remote) for s in reads) == crossing
    assert "replicas():" in text


def test_with_replicas_each_shard_reads_the_copy_on_its_device():
    f = tfshard.parallelize(lambda x: model(x), devices=DEVICES, per_sample=False)
    with f.replicas():
        model = _cnn()
    x = _images(7)
    for k, shard in enumerate(_reads(f, x)):
        assert len(shard) == len(model.weights)
        assert {r.device for r in shard} == {DEVICES[k]} and not any(r.remote for r in shard)
    assert f.explain(x).splitlines()[-1] == "  each call reads 0 B of variables from other devices"


@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_keras_cnn_inference_equals_one_device(replicated, jit_compile):
    keras.utils.set_random_seed(2)
    model = _cnn()
    x = _images(7, seed=3)
    want = model(x).numpy()
    f = tfshard.parallelize(model, devices=DEVICES, jit_compile=jit_compile)
    if replicated:
        f = tfshard.parallelize(f.replicate(model), devices=DEVICES, jit_compile=jit_compile)
    if jit_compile and not replicated:
        # XLA cannot read a variable on another device: refused before anything runs.
        with pytest.raises(ArgumentError, match=r"jit_compile=True, shard 1 .* reads .*replicas"):
            f(x)
        return
    numerics.assert_close(f(x).numpy(), want)
    numerics.assert_close(f(x[:2]).numpy(), want[:2])  # < K rows


def test_mobilenet_v2_inference_equals_one_device_replicated_and_compiled():
    keras.utils.set_random_seed(4)
    model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), alpha=0.35)
    x = np.random.default_rng(5).random((5, 32, 32, 3), dtype=np.float32)
    want = model(x).numpy()
    plain = tfshard.parallelize(model, devices=DEVICES[:2])
    numerics.assert_close(plain(x).numpy(), want)
    compiled = tfshard.parallelize(plain.replicate(model), devices=DEVICES[:2], jit_compile=True)
    numerics.assert_close(compiled(x).numpy(), want)
    assert compiled.explain(x).endswith("each call reads 0 B of variables from other devices")


def _mlp() -> keras.Model:
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)]
    )


def _mirrored_training(initial, batches, devices) -> list[np.ndarray]:
    """The same training with MirroredStrategy: each replica's slice, the loss over the batch."""
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        model = _mlp()
        model.set_weights(initial)
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)

    def replica_step(x, y, n):
        with tf.GradientTape() as tape:
            per_sample = tf.reduce_mean(tf.square(model(x) - y), axis=-1)
            loss = tf.reduce_sum(per_sample) / n
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    def step(dx, dy, n):
        # Eagerly, reducing on one device: inside a tf.function Keras 3's optimizer
        # under MirroredStrategy failed in TF 2.21 ("You must feed a value for
        # placeholder tensor 'cond/else/_1/cond/Placeholder_2'"), and eagerly the
        # default collective all-reduce mixed up its tensors' shapes.
        strategy.run(replica_step, args=(dx, dy, n))

    sizes = tfshard.parallelize(tf.identity, devices=devices).plan(len(batches[0][0]))
    for x, y in batches:
        xs, ys = np.split(x, np.cumsum(sizes)[:-1]), np.split(y, np.cumsum(sizes)[:-1])
        dx = strategy.experimental_distribute_values_from_function(
            lambda ctx, xs=xs: tf.constant(xs[ctx.replica_id_in_sync_group])
        )
        dy = strategy.experimental_distribute_values_from_function(
            lambda ctx, ys=ys: tf.constant(ys[ctx.replica_id_in_sync_group])
        )
        step(dx, dy, tf.constant(float(len(x))))
    return model.get_weights()


def test_training_with_replicas_equals_one_device_and_mirrored_strategy():
    keras.utils.set_random_seed(6)
    reference = _mlp()
    initial = reference.get_weights()
    rng = np.random.default_rng(7)
    batches = [  # 7 rows on 3 devices: shards of 3, 2, 2
        (rng.normal(size=(7, 4)).astype(np.float32), rng.normal(size=(7, 2)).astype(np.float32))
        for _ in range(20)
    ]

    @tfshard.parallelize(devices=DEVICES, per_sample=False, reduce="mean")
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return tape.gradient(loss, model.trainable_variables)

    with gradients.replicas():
        model = _mlp()
        model.set_weights(initial)
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)

    @tf.function
    def step(x, y):
        apply_gradients(optimizer, zip(gradients(x, y), model.trainable_variables))

    one_optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        if i % 2:
            step(x, y)  # inside a tf.function
        else:
            apply_gradients(optimizer, zip(gradients(x, y), model.trainable_variables))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(x) - y))
        grads = tape.gradient(loss, reference.trainable_variables)
        one_optimizer.apply_gradients(zip(grads, reference.trainable_variables))
        for weight in model.weights:  # the copies stay equal after every step
            first, *others = Replicas.find(DEVICES).strategy.experimental_local_results(
                weight.value
            )
            assert len(others) == len(DEVICES) - 1
            for copy in others:
                np.testing.assert_array_equal(copy.numpy(), first.numpy())
    mirrored = _mirrored_training(initial, batches, DEVICES)
    for got, one, mirror in zip(model.get_weights(), reference.get_weights(), mirrored):
        numerics.assert_close(got, one)
        numerics.assert_close(got, mirror)


def test_weights_set_outside_the_function_reach_every_copy():
    f = tfshard.parallelize(lambda x: x * scale, devices=DEVICES)
    with f.replicas():
        scale = tf.Variable(2.0)
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(f(x).numpy(), x * 2)
    scale.assign(3.0)
    np.testing.assert_array_equal(f(x).numpy(), x * 3)  # every shard, so every copy


def test_a_shard_assigning_a_replicated_variable_is_refused():
    f = tfshard.parallelize(lambda x: norm(x, training=True), devices=DEVICES, per_sample=False)
    with f.replicas():
        norm = keras.layers.BatchNormalization()
        norm.build((None, 3))
    with pytest.raises(
        ArgumentError, match=r"assigns the replicated variables \S*moving_mean\S*, \S*moving_var"
    ):
        f(np.ones([6, 3], np.float32))

    def count(x):
        if tf.reduce_sum(x) > 0:  # the write inside a tf.cond branch
            calls.assign_add(1.0)
        return x

    g = tfshard.parallelize(count, devices=DEVICES, per_sample=False)
    with g.replicas():
        calls = tf.Variable(0.0)
    with pytest.raises(ArgumentError, match=r"drift apart.*training=False"):
        g(np.ones([6], np.float32))


def test_per_shard_in_a_tf_function_reads_the_copies_and_refuses_a_write():
    # In a graph, per_shard traces its shards into the caller's graph: still checked.
    f = tfshard.parallelize(lambda x: x * scale, devices=DEVICES)
    with f.replicas():
        scale = tf.Variable(2.0)
    x = np.arange(7, dtype=np.float32)
    got = tf.function(lambda t: f.per_shard(t))(tf.constant(x))
    np.testing.assert_array_equal(np.concatenate([g.numpy() for g in got]), x * 2)
    scale.assign(3.0)  # every copy
    got = tf.function(lambda t: f.per_shard(t))(tf.constant(x))
    np.testing.assert_array_equal(np.concatenate([g.numpy() for g in got]), x * 3)

    def count(x):
        calls.assign_add(1.0)
        return x

    g = tfshard.parallelize(count, devices=DEVICES, per_sample=False)
    with g.replicas():
        calls = tf.Variable(0.0)
    with pytest.raises(ArgumentError, match=r"assigns the replicated variable .*drift apart"):
        tf.function(lambda t: g.per_shard(t))(tf.constant(x))


def test_replicas_are_shared_by_functions_on_the_same_devices_and_retrace():
    f = tfshard.parallelize(lambda x: x * w, devices=DEVICES)
    g = tfshard.parallelize(lambda x: x + w, devices=list(reversed(DEVICES)))
    w = tf.Variable(2.0)
    x = np.ones([3], np.float32)
    f(x)  # traced with the plain variable: shards 1 and 2 read it remotely
    assert sum(r.remote for s in _reads(f, x) for r in s) == 2
    with g.replicas():  # the same three devices
        w = tf.Variable(5.0)
    assert Replicas.find(DEVICES) is Replicas.find(list(reversed(DEVICES)))
    np.testing.assert_array_equal(f(x).numpy(), x * 5)  # retraced: reads the new copies
    assert not any(r.remote for s in _reads(f, x) for r in s)
    assert not any(r.remote for s in _reads(g, x) for r in s)


def test_replicas_scopes_of_other_devices_do_not_nest_and_say_so():
    f = tfshard.parallelize(lambda x: x, devices=DEVICES[:2])
    g = tfshard.parallelize(lambda x: x, devices=DEVICES[1:])
    with f.replicas(), f.replicas():  # the same devices: one scope, entered twice
        w = tf.Variable(1.0)
    assert Replicas.find(DEVICES[:2]).holds(w)
    nested = r"do not nest .*Leave the other scope"
    with f.replicas(), pytest.raises(ArgumentError, match=nested), g.replicas():
        pass
    strategy = tf.distribute.MirroredStrategy(DEVICES[1:])  # the user's own strategy too
    inside = r"inside another distribution"
    with strategy.scope(), pytest.raises(ArgumentError, match=inside), f.replicas():
        pass
    with g.replicas():  # nothing was left entered
        v = tf.Variable(2.0)
    assert Replicas.find(DEVICES[1:]).holds(v)


def test_forget_all_forgets_every_set_of_replicas_and_the_functions_retrace():
    traces = []

    def scaled(x):
        traces.append(1)  # Python runs while a shard is traced, never in a call
        return x * w

    f = tfshard.parallelize(scaled, devices=DEVICES)
    with f.replicas():
        w = tf.Variable(2.0)
    held, two = Replicas.find(DEVICES), Replicas.of(DEVICES[:2])
    x = np.ones([3], np.float32)
    assert not any(r.remote for s in _reads(f, x) for r in s)  # each shard its own copy
    np.testing.assert_array_equal(f(x).numpy(), x * 2)
    traced = len(traces)
    f(x)
    assert len(traces) == traced  # nothing changed: no trace
    Replicas.forget_all()
    assert Replicas.find(DEVICES) is None and Replicas.find(DEVICES[:2]) is None
    np.testing.assert_array_equal(f(x).numpy(), x * 2)  # the copies f holds live on
    assert len(traces) > traced  # retraced at its next call
    traced = len(traces)
    f(x)
    assert len(traces) == traced
    again = Replicas.of(DEVICES)  # new copies, made anew
    assert again is not held and again is not two and Replicas.find(DEVICES) is again


def test_replicate_copies_a_built_layer_with_its_weights():
    layer = keras.layers.Dense(3)
    x = np.random.default_rng(10).random((5, 4), dtype=np.float32)
    want = layer(x).numpy()
    f = tfshard.parallelize(layer, devices=DEVICES)
    copy = f.replicate(layer)
    g = tfshard.parallelize(copy, devices=DEVICES)
    numerics.assert_close(g(x).numpy(), want)
    assert all(not r.remote for shard in _reads(g, x) for r in shard)


def test_replicate_refuses_what_it_cannot_copy():
    f = tfshard.parallelize(tf.identity, devices=DEVICES)
    with pytest.raises(ArgumentError, match=r"build it inside `with f.replicas\(\):`"):
        f.replicate(tf.Module())


def test_replicas_refuse_devices_of_another_machine():
    with pytest.raises(ArgumentError, match="another machine"):
        Replicas.of(["/job:worker/replica:0/task:1/device:CPU:0", "/device:CPU:0"])


def test_apply_gradients_refuses_a_mix_and_passes_plain_variables_through():
    f = tfshard.parallelize(tf.identity, devices=DEVICES)
    with f.replicas():
        shared = tf.Variable(1.0)
    plain = tf.Variable(1.0)
    optimizer = keras.optimizers.SGD(0.5)
    with pytest.raises(ArgumentError, match="not replicated but other variables are"):
        apply_gradients(optimizer, [(tf.constant(1.0), shared), (tf.constant(1.0), plain)])
    apply_gradients(keras.optimizers.SGD(0.5), [(tf.constant(1.0), plain)])
    assert plain.numpy() == 0.5


def test_a_dataset_stream_reads_each_devices_copy_and_is_checked_like_a_call():
    f = tfshard.parallelize(lambda x: model(x), devices=DEVICES, per_sample=False)
    keras.utils.set_random_seed(8)
    reference = _cnn()
    with f.replicas():
        model = _cnn()
        model.set_weights(reference.get_weights())
    x = _images(11, seed=9)
    stream = f(tf.data.Dataset.from_tensor_slices(x).batch(4))  # the traced loop
    numerics.assert_close(stream.numpy(), reference(x).numpy())
    # Checked on the loop's probe: no call graph traced beside the loop (a trace per device).
    assert f.trace_count == 1
    train = tfshard.parallelize(lambda x: norm(x, training=True), devices=DEVICES, per_sample=False)
    with train.replicas():
        norm = keras.layers.BatchNormalization()
        norm.build((None, 3))
    with pytest.raises(ArgumentError, match="assigns the replicated variable"):
        train(tf.data.Dataset.from_tensor_slices(np.ones([6, 3], np.float32)).batch(2))


def test_a_refused_write_names_the_variables_written_not_the_others_the_shard_reads():
    # The shard's cond takes every variable of the model; only BatchNorm's statistics are
    # written (the census saw "dense_3/kernel" named here).
    f = tfshard.parallelize(lambda x: model(x, training=True), devices=DEVICES, per_sample=False)
    with f.replicas():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()]
        )
    with pytest.raises(ArgumentError) as raised:
        f(np.ones([6, 4], np.float32))
    message = str(raised.value)
    assert "moving_mean" in message and "moving_variance" in message
    assert "kernel" not in message and "gamma" not in message


# ---------------------------------------------------------------- Keras conventions

DEVICES_2 = DEVICES[:2]


def _classifier() -> keras.Model:
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)]
    )


def _labelled(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


# Which tfshard reduction gives a Keras loss reduction's value over the whole batch.
_MATCHING_REDUCE = {"sum_over_batch_size": "mean", "sum": "sum", "none": None}


@pytest.mark.parametrize("replicas", ["none", "elsewhere", "model"])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "none"])
@pytest.mark.parametrize("per_sample", [False, True])
def test_keras_loss_objects_give_what_they_give_on_one_device(replicas, reduction, per_sample):
    """A loss object's value and gradients, with replicas on the devices or not.

    Once replicas existed, shards traced in MirroredStrategy's replica context, where a
    Keras loss divides by num_replicas_in_sync (its summed-gradients convention): half
    the loss and gradients on 2 devices (issue 28).
    """
    keras.utils.set_random_seed(11)
    reference = _classifier()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    x, y = _labelled(9, seed=12)  # 5 and 4 rows: unequal shards
    model = reference
    if replicas == "elsewhere":  # another model's copies on the same devices
        with tfshard.parallelize(tf.identity, devices=DEVICES_2).replicas():
            keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    elif replicas == "model":
        model = tfshard.parallelize(tf.identity, devices=DEVICES_2).replicate(reference)

    def loss_and_grads(x, y):
        if per_sample:
            x, y = x[None], y[None]
        with tf.GradientTape() as tape:
            loss = loss_object(y, model(x))
        if per_sample and reduction == "none":
            loss = loss[0]
        return loss, tape.gradient(loss, model.trainable_variables)

    op = _MATCHING_REDUCE[reduction]
    f = tfshard.parallelize(loss_and_grads, devices=DEVICES_2, per_sample=per_sample, reduce=op)
    if reduction == "none":  # one loss per row: gathered; its gradient is of their sum
        f = tfshard.parallelize(
            lambda x, y: loss_and_grads(x, y)[0], devices=DEVICES_2, per_sample=per_sample
        )
        numerics.assert_close(f(x, y).numpy(), loss_object(y, reference(x)).numpy())
        return
    loss, grads = f(x, y)
    with tf.GradientTape() as tape:
        want = loss_object(y, reference(x))
    want_grads = tape.gradient(want, reference.trainable_variables)
    numerics.assert_close(loss.numpy(), want.numpy())
    for got, expected in zip(grads, want_grads):
        numerics.assert_close(got.numpy(), expected.numpy())


def test_tf_nn_compute_average_loss_in_a_shard_is_the_shards_mean():
    f = tfshard.parallelize(
        lambda x: tf.nn.compute_average_loss(x), devices=DEVICES_2, per_sample=False, reduce="mean"
    )
    with f.replicas():
        tf.Variable(0.0)  # replicas exist on these devices
    x = np.arange(7, dtype=np.float32)
    numerics.assert_close(f(x).numpy(), x.mean())


@pytest.mark.parametrize("replicated", [False, True])
def test_keras_metrics_updated_in_shards_equal_one_device(replicated):
    x, y = _labelled(11, seed=13)
    logits = np.random.default_rng(14).normal(size=(11, 3)).astype(np.float32)

    def update(y, logits):
        accuracy.update_state(y, logits)
        mean.update_state(logits)
        return tf.zeros([])

    f = tfshard.parallelize(update, devices=DEVICES, per_sample=False, reduce="sum")
    scope = f.replicas() if replicated else contextlib.nullcontext()
    with scope:  # a metric's total and count: the copies are read as their sum
        accuracy, mean = keras.metrics.SparseCategoricalAccuracy(), keras.metrics.Mean()
    f(y, logits)
    f(y[:4], logits[:4])  # a second call adds to the first, as update_state does
    one_accuracy, one_mean = keras.metrics.SparseCategoricalAccuracy(), keras.metrics.Mean()
    for rows in (slice(None), slice(0, 4)):
        one_accuracy.update_state(y[rows], logits[rows])
        one_mean.update_state(logits[rows])
    numerics.assert_close(accuracy.result().numpy(), one_accuracy.result().numpy())
    numerics.assert_close(mean.result().numpy(), one_mean.result().numpy())


@pytest.mark.parametrize("optimizer_name", ["SGD", "Adam"])
def test_training_with_a_loss_object_and_replicas_equals_one_device_and_mirrored(optimizer_name):
    keras.utils.set_random_seed(15)
    reference = _classifier()
    initial = reference.get_weights()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batches = [_labelled(8, seed=16 + i) for i in range(6)]  # 4 rows per device

    @tfshard.parallelize(devices=DEVICES_2, per_sample=False, reduce="mean")
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_object(y, model(x))
        return loss, tape.gradient(loss, model.trainable_variables)

    with tfshard.parallelize(tf.identity, devices=DEVICES_2).replicas():
        model = _classifier()
        model.set_weights(initial)
        optimizer = getattr(keras.optimizers, optimizer_name)(0.05)
    for x, y in batches:
        loss, grads = gradients(x, y)
        apply_gradients(optimizer, zip(grads, model.trainable_variables))

    one = getattr(keras.optimizers, optimizer_name)(0.05)
    for x, y in batches:
        with tf.GradientTape() as tape:
            want = loss_object(y, reference(x))
        one.apply_gradients(zip(tape.gradient(want, reference.trainable_variables),
                                reference.trainable_variables))
    numerics.assert_close(loss.numpy(), want.numpy())  # the last batch's

    strategy = tf.distribute.MirroredStrategy(
        DEVICES_2, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        mirrored = _classifier()
        mirrored.set_weights(initial)
        mirrored_optimizer = getattr(keras.optimizers, optimizer_name)(0.05)

    def replica_step(x, y):  # the loss object scales by 1 / replicas, gradients are summed
        with tf.GradientTape() as tape:
            loss = loss_object(y, mirrored(x))
        grads = tape.gradient(loss, mirrored.trainable_variables)
        mirrored_optimizer.apply_gradients(zip(grads, mirrored.trainable_variables))

    for x, y in batches:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        dx, dy = next(iter(strategy.experimental_distribute_dataset(dataset)))
        strategy.run(replica_step, args=(dx, dy))
    for got, expected, mirror in zip(
        model.get_weights(), reference.get_weights(), mirrored.get_weights()
    ):
        numerics.assert_close(got, expected)
        numerics.assert_close(got, mirror)


def test_apply_gradients_names_a_wrong_argument_before_updating_anything():
    f = tfshard.parallelize(tf.identity, devices=DEVICES)
    with f.replicas():
        shared = tf.Variable([1.0, 2.0], name="shared")
        inside = keras.optimizers.SGD(0.5)
    plain = tf.Variable([1.0, 2.0], name="plain")
    outside = keras.optimizers.SGD(0.5)
    for optimizer, variable in ((outside, plain), (inside, shared)):
        grad = tf.ones([2])
        for args, message in [
            ((None, [(grad, variable)]), r"optimizer=None of type NoneType has no apply_gradients"),
            ((optimizer, None), r"grads_and_vars=None of type NoneType; pass \(gradient, variable"),
            ((optimizer, [(variable, grad)]), r"pair 0 is \(variable .*, gradient\), swapped"),
            ((optimizer, [(grad,)]), r"pair 0 is \(<tf.Tensor: shape=\(2,\).*,\); pass \(gradient"),
            ((optimizer, [(grad, 3.0)]), r"pair 0 holds 3\.0 where its variable goes"),
            (
                (optimizer, [(grad, variable), (tf.ones([3]), variable)]),
                r"pair 1 gives variable .* of shape \(2,\) a gradient of shape \(3,\); each",
            ),
        ]:
            with pytest.raises(ArgumentError, match=message):
                apply_gradients(*args)
    np.testing.assert_array_equal(plain.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(shared.numpy(), [1.0, 2.0])
    apply_gradients(outside, iter([(np.ones(2, np.float32), plain)]))  # any iterable of pairs
    np.testing.assert_array_equal(plain.numpy(), [0.5, 1.5])


def test_an_optimizer_made_on_the_other_side_of_replicas_is_refused_with_the_fix():
    f = tfshard.parallelize(tf.identity, devices=DEVICES_2)
    with f.replicas():
        model = _classifier()
        inside = keras.optimizers.Adam(0.1)
    outside = keras.optimizers.Adam(0.1)
    pairs = [(tf.ones_like(v), v) for v in model.trainable_variables]
    with pytest.raises(ArgumentError, match=r"created outside `with f\.replicas\(\):`.*create it"):
        apply_gradients(outside, pairs)
    plain = tf.Variable([1.0, 2.0])
    with pytest.raises(ArgumentError, match=r"created inside `with f\.replicas\(\):`.*outside"):
        apply_gradients(inside, [(tf.ones([2]), plain)])
    apply_gradients(inside, pairs)  # where it belongs, it works
    assert int(inside.iterations.numpy()) == 1


def test_a_plain_keras_optimizer_step_on_copies_works_only_without_slots():
    """README: optimizer.apply_gradients outside Strategy.run updates copies only for an
    optimizer that keeps no per-variable state (plain SGD); Adam needs apply_gradients."""
    f = tfshard.parallelize(tf.identity, devices=DEVICES_2)
    with f.replicas():
        model = _classifier()
        sgd, adam = keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.1)
    before = model.get_weights()
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    sgd.apply_gradients(zip(grads, model.trainable_variables))
    for weight, old in zip(model.weights, before):
        for copy in Replicas.find(DEVICES_2).strategy.experimental_local_results(weight.value):
            numerics.assert_close(copy.numpy(), old - 0.1)
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        adam.apply_gradients(zip(grads, model.trainable_variables))


@pytest.mark.parametrize("layer", ["string_lookup", "text_vectorization", "tf_idf"])
def test_replicate_copies_an_adapted_lookup_layers_vocabulary(layer):
    texts = np.array(["a b", "b", "c d", "d", "a", "b c"])
    inputs = keras.Input((), dtype="string")
    if layer == "string_lookup":
        lookup = keras.layers.StringLookup()
        lookup.adapt(["a", "b", "c", "a"])
        outputs = keras.layers.Embedding(5, 4)(lookup(inputs))
    else:
        mode = "tf_idf" if layer == "tf_idf" else "int"
        lookup = keras.layers.TextVectorization(max_tokens=10, output_mode=mode)
        lookup.adapt(["a b c", "b c d", "a a"])
        outputs = lookup(inputs)
        if mode == "int":
            outputs = keras.layers.Embedding(10, 4)(outputs)
    model = keras.Model(inputs, outputs)
    f = tfshard.parallelize(tf.identity, devices=DEVICES_2)
    copy = tfshard.parallelize(f.replicate(model), devices=DEVICES_2)
    numerics.assert_close(copy(texts).numpy(), model(texts).numpy())


@keras.saving.register_keras_serializable(package="tfshard_tests")
class _Tokens(keras.layers.Layer):
    """A custom layer holding an adapted lookup as an attribute (not in any .layers)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lookup = keras.layers.StringLookup()

    def call(self, x):
        return self.lookup(x)


def test_replicate_copies_a_vocabulary_nested_in_a_custom_layer_or_the_layer_itself():
    texts = tf.constant(["a", "c", "zz", "b"])
    f = tfshard.parallelize(tf.identity, devices=DEVICES_2)
    tokens = _Tokens()
    tokens.lookup.adapt(tf.constant(["a", "b", "c", "a"]))
    inputs = keras.Input((), dtype="string")
    model = keras.Model(inputs, tokens(inputs))
    copy = f.replicate(model)
    np.testing.assert_array_equal(copy(texts).numpy(), model(texts).numpy())
    lookup = keras.layers.StringLookup()
    lookup.adapt(tf.constant(["x", "y", "x"]))
    np.testing.assert_array_equal(f.replicate(lookup)(texts).numpy(), lookup(texts).numpy())


@pytest.mark.parametrize("make_optimizer", ["sgd_momentum", "adam", "loss_scale"])
def test_the_first_training_step_traces_each_shard_once(make_optimizer):
    """The optimizer's state is made at the first apply_gradients, in the replicas, and no
    parallelized function retraces for it: the step's shards are traced once, ever."""
    keras.utils.set_random_seed(8)
    rng = np.random.default_rng(9)
    x = rng.normal(size=(6, 4)).astype(np.float32)
    y = rng.normal(size=(6, 2)).astype(np.float32)
    traced = []

    @tfshard.parallelize(devices=DEVICES[:2], per_sample=False, reduce="mean")
    def gradients(x, y):
        traced.append(tfshard.shard_index())
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return tape.gradient(loss, model.trainable_variables)

    optimizers = {
        "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
        "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
    }
    reference = _mlp()
    with gradients.replicas():
        model = _mlp()
        model.set_weights(reference.get_weights())
        optimizer = optimizers[make_optimizer]()
    one_optimizer = optimizers[make_optimizer]()
    generation = Replicas.generation
    for _ in range(3):
        apply_gradients(optimizer, zip(gradients(x, y), model.trainable_variables))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(x) - y))
        grads = tape.gradient(loss, reference.trainable_variables)
        one_optimizer.apply_gradients(zip(grads, reference.trainable_variables))
    assert len(traced) == 2  # one trace per shard, in the first step only
    assert Replicas.generation == generation  # the optimizer's state retraced nothing
    assert len(optimizer.variables) == len(one_optimizer.variables)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        numerics.assert_close(got, want)


# ---------------------------------------------------------------- variables made at the first call


def _unbuilt_mlp(seed: int) -> keras.Model:
    """An MLP without an Input: Keras builds it at its first call (same seed, same weights)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def test_a_keras_model_first_built_by_a_call_inside_replicas_trains_as_mirrored_strategy():
    """Its variables are made at the first call, inside the shard's trace: they get a copy
    per device there, as MirroredStrategy.run makes them (a raw UnliftableError before)."""
    rng = np.random.default_rng(20)
    batches = [  # 7 rows on 3 devices: shards of 3, 2, 2
        (rng.normal(size=(7, 4)).astype(np.float32), rng.normal(size=(7, 2)).astype(np.float32))
        for _ in range(3)
    ]

    @tfshard.parallelize(devices=DEVICES, per_sample=False, reduce="mean")
    def step_values(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return loss, tape.gradient(loss, model.trainable_variables)

    losses = []
    with step_values.replicas():
        model = _unbuilt_mlp(21)
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        for x, y in batches[:2]:  # the first call builds the model, in the scope
            loss, grads = step_values(x, y)
            apply_gradients(optimizer, zip(grads, model.trainable_variables))
            losses.append(loss.numpy())
    x, y = batches[2]  # later calls need not be in the scope
    loss, grads = step_values(x, y)
    apply_gradients(optimizer, zip(grads, model.trainable_variables))
    losses.append(loss.numpy())

    replicas = Replicas.find(DEVICES)
    assert len(model.weights) == 4 and all(replicas.holds(w) for w in model.weights)
    for weight in model.weights:  # a copy per device, equal after every step
        copies = replicas.strategy.experimental_local_results(weight.value)
        assert [_home(c) for c in copies] == DEVICES
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())
    assert not any(r.remote for shard in _reads(step_values, x, y) for r in shard)

    one, one_optimizer = _unbuilt_mlp(21), keras.optimizers.SGD(0.05, momentum=0.9)
    strategy = tf.distribute.MirroredStrategy(
        DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        mirrored = _unbuilt_mlp(21)
        mirrored_optimizer = keras.optimizers.SGD(0.05, momentum=0.9)

    def replica_step(x, y):  # built at the first run, in the replica context
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.reduce_mean(tf.square(mirrored(x) - y), axis=-1)) / 7.0
        grads = tape.gradient(loss, mirrored.trainable_variables)
        mirrored_optimizer.apply_gradients(zip(grads, mirrored.trainable_variables))
        return loss  # this replica's share of the batch mean

    for (x, y), got in zip(batches, losses):
        with tf.GradientTape() as tape:
            want = tf.reduce_mean(tf.square(one(x) - y))
        grads = tape.gradient(want, one.trainable_variables)
        one_optimizer.apply_gradients(zip(grads, one.trainable_variables))
        numerics.assert_close(got, want.numpy())
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(7)
        dx, dy = next(iter(strategy.experimental_distribute_dataset(dataset)))
        shares = strategy.run(replica_step, args=(dx, dy))
        numerics.assert_close(got, strategy.reduce("SUM", shares, axis=None).numpy())
    for got, want, mirror in zip(model.get_weights(), one.get_weights(), mirrored.get_weights()):
        numerics.assert_close(got, want)
        numerics.assert_close(got, mirror)


class _Lazy(tf.Module):
    """Makes its variable at its first call, the pattern tf.function supports."""

    def __init__(self, initial):
        super().__init__()
        self.initial, self.w = initial, None

    def __call__(self, x):
        if self.w is None:
            self.w = tf.Variable(self.initial(), name="w")
        return tf.matmul(x, self.w)


def test_a_module_or_a_function_making_its_variable_at_the_first_call_gets_copies():
    x = np.random.default_rng(22).normal(size=(7, 4)).astype(np.float32)
    lazy = _Lazy(lambda: tf.ones([4, 2]))  # a constant computed in the trace
    made = {}

    def scaled(x):
        if "scale" not in made:
            made["scale"] = tf.Variable(3.0)
        return lazy(x) * made["scale"]

    f = tfshard.parallelize(scaled, devices=DEVICES, per_sample=False)
    with f.replicas():
        got = f(x)
    numerics.assert_close(got.numpy(), x @ np.ones([4, 2], np.float32) * 3)
    replicas = Replicas.find(DEVICES)
    for variable in (lazy.w, made["scale"]):
        assert replicas.holds(variable)
        assert [_home(c) for c in replicas.strategy.experimental_local_results(variable)] == (
            DEVICES
        )
    assert f.explain(x).endswith("each call reads 0 B of variables from other devices")
    made["scale"].assign(2.0)  # outside the function: every copy
    numerics.assert_close(f(x[:2]).numpy(), x[:2] @ np.ones([4, 2], np.float32) * 2)


def test_a_variable_made_at_the_first_call_from_a_value_computed_there_is_refused_with_the_fix():
    x = np.ones([6, 4], np.float32)
    lazy = _Lazy(lambda: tf.random.normal([4, 2], seed=1))
    f = tfshard.parallelize(lambda x: lazy(x), devices=DEVICES, per_sample=False)
    refused = (
        r"creates the variable 'w' while a shard is traced, from a value computed in the "
        r"trace .*Pass the initial value as a callable \(tf\.Variable\(lambda: "
    )
    with f.replicas(), pytest.raises(ArgumentError, match=refused):
        f(x)
    assert lazy.w is None
    lazy.initial = lambda: (lambda: tf.random.normal([4, 2], seed=1))  # the fix: a callable
    with f.replicas():
        got = f(x)
    copies = Replicas.find(DEVICES).strategy.experimental_local_results(lazy.w)
    for copy in copies[1:]:
        np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())
    numerics.assert_close(got.numpy(), x @ copies[0].numpy())


def test_a_model_made_in_replicas_but_first_built_outside_has_plain_variables_and_says_so():
    """README: built by a call outside the scope, its variables get no copies; an optimizer
    made in the scope is refused with the fix (build it inside)."""
    x, y = np.ones([6, 4], np.float32), np.ones([6, 2], np.float32)

    @tfshard.parallelize(devices=DEVICES_2, per_sample=False, reduce="mean")
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return tape.gradient(loss, model.trainable_variables)

    with gradients.replicas():
        model = _unbuilt_mlp(23)
        optimizer = keras.optimizers.SGD(0.1)
    grads = gradients(x, y)
    assert not any(Replicas.find(DEVICES_2).holds(w) for w in model.weights)
    with pytest.raises(ArgumentError, match=r"first built by a call outside it .*model\.build"):
        apply_gradients(optimizer, zip(grads, model.trainable_variables))


# ---------------------------------------------------------------- variables made in other traces


def _mirrored_sgd(batches, seed: int) -> keras.Model:
    """The reference: MirroredStrategy on DEVICES trains an unbuilt MLP with SGD on `batches`."""
    strategy = tf.distribute.MirroredStrategy(
        DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        mirrored = _unbuilt_mlp(seed)
        optimizer = keras.optimizers.SGD(0.05)

    def replica_step(x, y, rows):  # built at the first run, in the replica context
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.reduce_mean(tf.square(mirrored(x) - y), axis=-1)) / rows
        grads = tape.gradient(loss, mirrored.trainable_variables)
        optimizer.apply_gradients(zip(grads, mirrored.trainable_variables))

    for x, y in batches:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x))
        dx, dy = next(iter(strategy.experimental_distribute_dataset(dataset)))
        strategy.run(replica_step, args=(dx, dy, float(len(x))))
    return mirrored


def _assert_copies_on_each_device(variables) -> None:
    replicas = Replicas.find(DEVICES)
    for variable in variables:
        assert replicas.holds(variable)
        held = variable if isinstance(variable, tf.Variable) else variable.value
        copies = replicas.strategy.experimental_local_results(held)
        assert [_home(c) for c in copies] == DEVICES
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())


def test_a_per_sample_function_building_a_keras_model_inside_replicas_trains_as_mirrored():
    """per_sample=True traces the function on one sample before its shards (to learn its
    outputs): the model is built in that trace, outside every shard, and gets its copies
    there as in a shard (a raw UnliftableError before)."""
    rng = np.random.default_rng(30)
    batches = [  # 7 rows on 3 devices: shards of 3, 2, 2
        (rng.normal(size=(7, 4)).astype(np.float32), rng.normal(size=(7, 2)).astype(np.float32))
        for _ in range(3)
    ]

    @tfshard.parallelize(devices=DEVICES, reduce="mean")  # per_sample=True
    def step_values(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[None])[0] - y))
        return loss, tape.gradient(loss, model.trainable_variables)

    first = batches[0][0]
    with step_values.replicas():
        model = _unbuilt_mlp(31)
        optimizer = keras.optimizers.SGD(0.05)
        predict = tfshard.parallelize(lambda x: model(x[None])[0], devices=DEVICES)
        predicted = predict(first)  # the first call builds the model, in the scope
    one = _unbuilt_mlp(31)
    numerics.assert_close(predicted.numpy(), one(first).numpy())
    _assert_copies_on_each_device(model.weights)
    assert len(model.weights) == 4

    one_optimizer = keras.optimizers.SGD(0.05)
    for x, y in batches:
        loss, grads = step_values(x, y)
        apply_gradients(optimizer, zip(grads, model.trainable_variables))
        with tf.GradientTape() as tape:
            want = tf.reduce_mean(tf.square(one(x) - y))
        one_optimizer.apply_gradients(
            zip(tape.gradient(want, one.trainable_variables), one.trainable_variables)
        )
        numerics.assert_close(loss.numpy(), want.numpy())
    _assert_copies_on_each_device(model.weights)
    assert not any(r.remote for shard in _reads(step_values, x, y) for r in shard)
    mirrored = _mirrored_sgd(batches, 31)
    for got, want, mirror in zip(model.get_weights(), one.get_weights(), mirrored.get_weights()):
        numerics.assert_close(got, want)
        numerics.assert_close(got, mirror)


def test_a_per_sample_function_making_a_variable_at_its_first_call_gets_copies():
    x = np.random.default_rng(32).normal(size=(7, 4)).astype(np.float32)
    made = {}

    def scaled(sample):
        if not made:
            made["w"] = tf.Variable(tf.fill([4], 3.0))  # a constant computed in the trace
        return sample * made["w"]

    f = tfshard.parallelize(scaled, devices=DEVICES)  # per_sample=True
    with f.replicas():
        got = f(x)
    numerics.assert_close(got.numpy(), x * 3.0)
    _assert_copies_on_each_device([made["w"]])
    assert f.explain(x).endswith("each call reads 0 B of variables from other devices")
    made["w"].assign(tf.fill([4], 2.0))  # outside the function: every copy
    numerics.assert_close(f(x).numpy(), x * 2.0)


def test_a_function_on_other_devices_building_its_model_inside_replicas_gets_their_copies():
    """As under MirroredStrategy.scope(): a variable made in the scope has its copies on the
    scope's devices, whichever function's trace makes it."""
    x = np.random.default_rng(33).normal(size=(7, 4)).astype(np.float32)
    f = tfshard.parallelize(lambda b: b, devices=DEVICES_2, per_sample=False)
    g = tfshard.parallelize(lambda b: model(b), devices=DEVICES[2:], per_sample=False)
    with f.replicas():
        model = _unbuilt_mlp(34)
        got = g(x)
    one = _unbuilt_mlp(34)
    numerics.assert_close(got.numpy(), one(x).numpy())
    replicas = Replicas.find(DEVICES_2)
    for weight in model.weights:
        assert replicas.holds(weight)
        copies = replicas.strategy.experimental_local_results(weight.value)
        assert [_home(c) for c in copies] == DEVICES_2
    numerics.assert_close(g(x).numpy(), one(x).numpy())


@pytest.mark.parametrize("initial", ["keras", "constant", "random"])
def test_a_users_tf_function_building_variables_inside_replicas_matches_mirrored_scope(initial):
    """Not parallelized: a tf.function of the user's, first called inside the scope, makes
    its variables as it does inside MirroredStrategy.scope(): a copy per device, equal."""
    x = np.random.default_rng(35).normal(size=(7, 4)).astype(np.float32)

    def build():
        """The function, its variables once made, and the function again, eagerly."""
        if initial == "keras":
            model = _unbuilt_mlp(36)
            return model, lambda: [w.value for w in model.weights], model
        made = {}

        def fn(b):
            if not made:
                value = tf.ones([4]) if initial == "constant" else tf.random.normal([4], seed=1)
                made["w"] = tf.Variable(value)
            return b * made["w"]

        return fn, lambda: [made["w"]], lambda b: b * made["w"]

    f = tfshard.parallelize(lambda b: b, devices=DEVICES, per_sample=False)
    with f.replicas():
        pass
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    results, weights = [], []
    ours = Replicas.find(DEVICES).strategy
    for scope, holder in ((f.replicas, ours), (strategy.scope, strategy)):
        fn, variables, again = build()
        with scope():
            got = tf.function(fn)(x)
        made = variables()
        assert made
        for variable in made:
            copies = holder.experimental_local_results(variable)
            assert [_home(c) for c in copies] == DEVICES
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy.numpy(), copies[0].numpy())
        numerics.assert_close(got.numpy(), again(x).numpy())
        results.append(got.numpy())
        weights.append([v.numpy() for v in made])
    if initial != "random":  # the same initial values both ways
        numerics.assert_close(results[0], results[1])
        for got, want in zip(*weights):
            numerics.assert_close(got, want)


@pytest.mark.parametrize("per_sample", [True, False])
def test_a_variable_made_outside_a_shard_from_a_value_computed_there_is_refused_with_the_fix(
    per_sample,
):
    """In tfshard's per-sample trace, or a function on other devices (no replicas), as in a
    shard: an initial value computed in the trace is refused with the fix (a callable)."""
    x = np.ones([6, 4], np.float32)
    lazy = _Lazy(lambda: tf.ones([4, 2]) * 3.0)  # not a constant TensorFlow can read
    f = tfshard.parallelize(lambda b: b, devices=DEVICES_2, per_sample=False)
    if per_sample:
        g = tfshard.parallelize(lambda s: lazy(s[None])[0], devices=DEVICES_2)
    else:
        g = tfshard.parallelize(lambda b: lazy(b), devices=DEVICES[2:], per_sample=False)
    refused = (
        r"creates the variable 'w' while tfshard traces it, from a value computed in the "
        r"trace .*Pass the initial value as a callable \(tf\.Variable\(lambda: "
    )
    with f.replicas(), pytest.raises(ArgumentError, match=refused):
        g(x)
    assert lazy.w is None
    lazy.initial = lambda: (lambda: tf.ones([4, 2]) * 3.0)  # the fix: a callable
    with f.replicas():
        got = g(x)
    numerics.assert_close(got.numpy(), x @ np.full([4, 2], 3.0, np.float32))
    copies = Replicas.find(DEVICES_2).strategy.experimental_local_results(lazy.w)
    assert [_home(c) for c in copies] == DEVICES_2
