"""Real Keras work, end to end, against the same work on one device.

The silent wrong results found so far lived in code tfshard did not write (a Keras loss
object under replicas, float16 totals): these tests run what users bring (a CNN's
inference over a labelled dataset, an MLP trained with a loss object and an optimizer, a
model with string preprocessing, mixed precision) and compare each with one device,
`model.predict` or one-device training. They exercise tfshard through its public surface
only; which module a failure points at is for the module tests to say.
"""

from __future__ import annotations

import contextlib

import numerics
import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard.replicas import apply_gradients

keras = pytest.importorskip("keras")

DEVICES = ["/device:CPU:0", "/device:CPU:1"]


# Models, variables and references live on DEVICES[0], /device:CPU:0 (conftest).
pytestmark = pytest.mark.usefixtures("built_on_the_cpu_bed")


@pytest.fixture
def policy(request):
    """Sets a Keras dtype policy for one test and restores the default after it."""
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def _digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Eight-by-eight 'digits': a class-dependent stroke pattern plus noise, flattened."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    patterns = np.random.default_rng(0).random((10, 64))
    images = patterns[labels] + 0.3 * rng.normal(size=(n, 64))
    return images.astype(np.float32), labels.astype(np.int32)


def test_a_cnns_inference_over_a_labelled_dataset_equals_predict():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((12, 12, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(4),
        ]
    )
    rng = np.random.default_rng(2)
    images = rng.random((37, 12, 12, 3), dtype=np.float32)
    labels = rng.integers(0, 4, 37)
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(16)  # 16, 16, 5
    want = model.predict(dataset, verbose=0)
    plain = tfshard.parallelize(model, devices=DEVICES)
    numerics.assert_close(plain(dataset).numpy(), want)
    copies = tfshard.parallelize(plain.replicate(model), devices=DEVICES)
    numerics.assert_close(copies(dataset).numpy(), want)


def test_an_mlp_trained_with_a_loss_object_and_adam_on_replicas_equals_one_device():
    keras.utils.set_random_seed(3)

    def mlp() -> keras.Model:
        return keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
        )

    reference = mlp()
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = _digits(150, seed=4)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # the last batch: 22 rows

    @tfshard.parallelize(devices=DEVICES, per_sample=False, reduce="mean")
    def step_values(x, y):
        with tf.GradientTape() as tape:
            loss = loss_object(y, model(x))
        return loss, tape.gradient(loss, model.trainable_variables)

    with step_values.replicas():
        model = mlp()
        model.set_weights(reference.get_weights())
        optimizer = keras.optimizers.Adam(1e-2)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    one_optimizer = keras.optimizers.Adam(1e-2)
    losses, one_losses = [], []
    for _ in range(3):  # epochs
        for xb, yb in dataset:
            loss, grads = step_values(xb, yb)
            apply_gradients(optimizer, zip(grads, model.trainable_variables))
            losses.append(float(loss))
            with tf.GradientTape() as tape:
                one_loss = loss_object(yb, reference(xb))
            one_grads = tape.gradient(one_loss, reference.trainable_variables)
            one_optimizer.apply_gradients(zip(one_grads, reference.trainable_variables))
            one_losses.append(float(one_loss))
    numerics.assert_close(np.float32(losses), np.float32(one_losses))  # float32 losses
    assert losses[-1] < 0.5 * losses[0]  # it learned
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    @tfshard.parallelize(devices=DEVICES, per_sample=False, reduce="sum")
    def evaluate(x, y):
        accuracy.update_state(y, model(x))  # a metric made in replicas: a total per device
        return tf.zeros([])

    evaluate(dataset)
    one_accuracy = keras.metrics.SparseCategoricalAccuracy()
    one_accuracy.update_state(y, reference(x))
    numerics.assert_close(accuracy.result().numpy(), one_accuracy.result().numpy())


def test_a_model_with_string_preprocessing_equals_one_device():
    keras.utils.set_random_seed(5)
    texts = np.array(
        ["the cat sat", "a dog ran", "the dog sat down", "cats and dogs", "", "a b c d e f"] * 4
    )
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=6)
    vectorize.adapt(texts)
    inputs = keras.Input((), dtype="string")
    hidden = keras.layers.Embedding(20, 4)(vectorize(inputs))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(inputs, outputs)
    labels = np.arange(len(texts)) % 2
    dataset = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(5)
    want = model.predict(dataset, verbose=0)
    plain = tfshard.parallelize(model, devices=DEVICES)
    numerics.assert_close(plain(dataset).numpy(), want)
    copies = tfshard.parallelize(plain.replicate(model), devices=DEVICES)
    numerics.assert_close(copies(texts).numpy(), model(texts).numpy())


# Each policy's float rounding: what one shard's own float16 (bfloat16) sums may differ by.
_ROUNDING = {"mixed_float16": 2e-3, "mixed_bfloat16": 1.6e-2}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
@pytest.mark.parametrize("replicated", [False, True])
def test_a_mixed_precision_model_infers_and_trains_as_on_one_device(policy, replicated):
    keras.utils.set_random_seed(6)

    def mlp() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(10, dtype="float32"),  # logits in float32, as Keras advises
            ]
        )

    reference = mlp()
    x, y = _digits(40, seed=7)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    scope = tfshard.parallelize(tf.identity, devices=DEVICES).replicas
    with scope() if replicated else contextlib.nullcontext():
        model = mlp()
        model.set_weights(reference.get_weights())
        # SGD: an update proportional to the gradient, so rounding stays rounding (Adam's
        # first steps are the gradient's sign: a rounding that flips a near-zero one is 2 lr).
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    infer = tfshard.parallelize(model, devices=DEVICES)
    np.testing.assert_allclose(infer(x).numpy(), reference(x).numpy(), rtol=_ROUNDING[policy])

    @tfshard.parallelize(devices=DEVICES, per_sample=False, reduce="mean")
    def step_values(x, y):
        with tf.GradientTape() as tape:
            loss = loss_object(y, model(x))
            scaled = optimizer.scale_loss(loss)  # gradients of the scaled loss, unscaled by apply
        return loss, tape.gradient(scaled, model.trainable_variables)

    one_optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    for _ in range(3):
        loss, grads = step_values(x, y)
        apply_gradients(optimizer, zip(grads, model.trainable_variables))
        with tf.GradientTape() as tape:
            one_loss = loss_object(y, reference(x))
            scaled = one_optimizer.scale_loss(one_loss)
        one_grads = tape.gradient(scaled, reference.trainable_variables)
        one_optimizer.apply_gradients(zip(one_grads, reference.trainable_variables))
        np.testing.assert_allclose(loss.numpy(), one_loss.numpy(), rtol=_ROUNDING[policy])
    assert all(w.dtype == np.float32 for w in model.get_weights())  # float32 master weights
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=_ROUNDING[policy], atol=_ROUNDING[policy] / 10)



def test_a_model_never_built_before_its_first_parallelized_step_trains_as_on_one_device():
    """README: Keras 3 builds a model at its first call and lifts its variables out of the
    trace, so a model first called inside the parallelized function still trains."""

    def unbuilt() -> keras.Model:
        keras.utils.set_random_seed(8)
        return keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(10)])

    model, reference = unbuilt(), unbuilt()
    x, y = _digits(24, seed=9)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tfshard.parallelize(devices=DEVICES, per_sample=False, reduce="mean")
    def step_values(x, y):
        with tf.GradientTape() as tape:
            loss = loss_object(y, model(x))
        return loss, tape.gradient(loss, model.trainable_variables)

    optimizer, one_optimizer = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    for _ in range(3):
        loss, grads = step_values(x, y)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        with tf.GradientTape() as tape:
            one_loss = loss_object(y, reference(x))
        one_grads = tape.gradient(one_loss, reference.trainable_variables)
        one_optimizer.apply_gradients(zip(one_grads, reference.trainable_variables))
        numerics.assert_close(loss.numpy(), one_loss.numpy())
    assert len(model.trainable_variables) == 4
    for got, want in zip(model.get_weights(), reference.get_weights()):
        numerics.assert_close(got, want)


def _compiled_shards(f, *args) -> list[int]:
    """The shards whose call the traced graph marks for XLA (``_XlaMustCompile``)."""
    graph = f.get_concrete_function(*args).graph.as_graph_def()
    marked = {n.name for n in graph.node if n.attr["_XlaMustCompile"].b}
    return sorted(k for k in range(len(f.devices)) if any(f"shard_{k}/" in n for n in marked))


def test_a_model_runs_with_its_own_jit_compile_as_predict_does():
    keras.utils.set_random_seed(10)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)]
    )
    x, _ = _digits(9, seed=11)
    # Uncompiled, jit_compile is Keras's "auto": True only on a machine with a GPU.
    auto = tfshard.parallelize(model, devices=DEVICES[:1])
    assert _compiled_shards(auto, x) == ([0] if model.jit_compile else [])
    model.compile(jit_compile=True)
    want = model.predict(x, verbose=0)  # predict runs under XLA
    one = tfshard.parallelize(model, devices=DEVICES[:1])
    assert _compiled_shards(one, x) == [0]
    numerics.assert_close(one(x).numpy(), want)
    # On two devices the weights live on the first: XLA cannot read them from the second,
    # so the model runs without it (jit_compile=True would refuse).
    plain = tfshard.parallelize(model, devices=DEVICES)
    assert _compiled_shards(plain, x) == []
    numerics.assert_close(plain(x).numpy(), want)
    copies = tfshard.parallelize(plain.replicate(model), devices=DEVICES)
    assert _compiled_shards(copies, x) == [0, 1]
    numerics.assert_close(copies(x).numpy(), want)
    numerics.assert_close(copies(x[:1]).numpy(), want[:1])  # a shard without rows
    opted_out = tfshard.parallelize(model, devices=DEVICES[:1], jit_compile=False)
    assert _compiled_shards(opted_out, x) == []
    wrapped = tfshard.parallelize(lambda x: model(x), devices=DEVICES[:1], per_sample=False)
    assert _compiled_shards(wrapped, x) == []  # not a model: False unless asked
    numerics.assert_close(wrapped(x).numpy(), want)


@pytest.mark.parametrize("value", ["auto", 1, "true"])
def test_jit_compile_takes_a_bool_or_none(value):
    with pytest.raises(tfshard.TfshardError, match=r"jit_compile=.*True.*False.*None"):
        tfshard.parallelize(tf.identity, jit_compile=value)
