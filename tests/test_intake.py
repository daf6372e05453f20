"""Taking a dataset in (`tfshard._intake`): the one record of what a stream's call asked.

References: the arrays the datasets are made of, batched by NumPy.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfshard import _arguments, _intake
from tfshard.errors import ArgumentError


def _arguments_of(fn):
    return _arguments.Arguments(fn, (), "f")


def test_autotuning_is_off_on_host_cpus_unless_the_dataset_says_so():
    ds = tf.data.Dataset.range(4).batch(2)
    assert _intake.prepare(ds, None, None, cpu_only=True).options().autotune.enabled is False
    assert _intake.prepare(ds, None, None).options().autotune.enabled is None
    options = tf.data.Options()
    options.autotune.enabled = True
    kept = _intake.prepare(ds.with_options(options), None, None, cpu_only=True)
    assert kept.options().autotune.enabled is True


def test_samples_are_batched_once_and_each_batch_becomes_a_call():
    x = np.random.default_rng(1).normal(size=[7, 3]).astype(np.float32)
    fn = lambda sample, scale: sample * scale  # noqa: E731
    intake = _intake.take(
        _arguments_of(fn), fn, tf.data.Dataset.from_tensor_slices(x), (2.0,), {}, batch_size=3
    )
    batches = [element.numpy() for element in intake.batches]
    for got, want in zip(batches, np.split(x, [3, 6]), strict=True):
        np.testing.assert_array_equal(got, want)
    call = intake.call(tf.constant(batches[-1]))
    assert call.rows == 1
    assert [leaf.kind for leaf in call.key.leaves] == ["split", "static"]
    empty = intake.empty()
    assert empty.rows == 0
    assert empty.tensors[0].shape.as_list() == [0, 3]


def test_a_keras_model_takes_x_of_each_element_and_progress_is_checked_once():
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(4))).batch(2)
    intake = _intake.take(_arguments_of(model), model, ds, (), {}, progress=False)
    np.testing.assert_array_equal(
        np.concatenate([element[0].numpy() for element in intake.batches]), x
    )
    assert intake.meter() is None
    with pytest.raises(ArgumentError, match=r"progress='yes': True for lines on stderr"):
        _intake.take(_arguments_of(model), model, ds, (), {}, progress="yes")
