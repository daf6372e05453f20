r"""Bulk-synchronous data-parallel training of a logistic regression.

Every step splits the minibatch across the devices; each device computes the
mean-loss gradient of its slice, and tfshard combines the slices' gradients
with ``reduce="mean"``, weighting each by its size, so the result is exactly
the gradient of the whole minibatch. The update is applied once, to weights
that live on the first device. Minibatches that do not divide evenly across
the devices (the default, 75 on 2 or 4 devices, and the last, smaller one of
each epoch) are fine.

The script then trains the same model on one device, without tfshard, on the
same minibatches, and checks that both end with the same weights (float32
tolerance), printing both loss curves.

    python examples/data_parallel_training.py
    python examples/data_parallel_training.py --virtual_devices=4 --epochs=20
    python examples/data_parallel_training.py --plot=loss.png   # needs matplotlib

Copy it with ``_common.py`` (in examples/), which it imports.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import _common
import numpy as np
from _common import tf
from absl import app, flags

import tfshard

RTOL, ATOL = 1e-5, 1e-6

_VIRTUAL_DEVICES = _common.define_virtual_devices_flag()
_DEVICES = _common.define_devices_flag()
_CONTEXTS = _common.define_contexts_flag()
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Passes over the training data.", lower_bound=1)
_MINIBATCH_SIZE = flags.DEFINE_integer(
    "minibatch_size",
    75,
    "Examples per step, split across the devices (need not divide evenly).",
    lower_bound=1,
)
_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", 2000, "Size of the synthetic training set.", lower_bound=1
)
_FEATURES = flags.DEFINE_integer("features", 20, "Features per example.", lower_bound=1)
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.5, "Step size of gradient descent.")
_PLOT = _common.define_plot_flag("Write the loss curves to this PNG file")


def make_data(n: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic binary classification set: x [n, features], labels y [n] in {0, 1}."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features), dtype=np.float32)
    true_w = rng.standard_normal(features).astype(np.float32)
    p = 1.0 / (1.0 + np.exp(-(x @ true_w + 0.5)))
    y = (rng.random(n) < p).astype(np.float32)
    return x, y


def mean_loss(x: tf.Tensor, y: tf.Tensor, w: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Mean logistic loss of rows x [n, F] with labels y [n]."""
    logits = tf.linalg.matvec(x, w) + b  # [n, F] x [F] -> [n]
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))


def shard_gradients(x: tf.Tensor, y: tf.Tensor, w: tf.Tensor, b: tf.Tensor) -> dict[str, tf.Tensor]:
    """One device's slice of a minibatch: its mean loss and the loss's gradients."""
    with tf.GradientTape() as tape:
        tape.watch([w, b])
        loss = mean_loss(x, y, w, b)
    grad_w, grad_b = tape.gradient(loss, [w, b])
    return {"loss": loss, "w": grad_w, "b": grad_b}


def minibatches(n: int, size: int, epoch: int, seed: int = 0) -> Iterator[np.ndarray]:
    """The row indices of each minibatch of an epoch (shuffled; the last may be smaller)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n, size):
        yield order[start : start + size]


class Trained(NamedTuple):
    """Final weights and the mean training loss of each epoch."""

    w: np.ndarray
    b: float
    losses: list[float]


def train_data_parallel(
    devices: Sequence[str],
    x: np.ndarray,
    y: np.ndarray,
    epochs: int,
    minibatch_size: int,
    learning_rate: float,
) -> Trained:
    """Trains with each minibatch's gradient computed across `devices`.

    The weights are variables on ``devices[0]``; each step copies them to every
    device (``broadcast=``), and the size-weighted mean of the slices'
    gradients comes back to ``devices[0]``, where it is applied.
    """
    gradients = tfshard.parallelize(
        shard_gradients, devices=devices, per_sample=False, reduce="mean", broadcast=("w", "b")
    )
    with tfshard.pin(gradients.devices[0]):
        w = tf.Variable(tf.zeros([x.shape[1]]), name="w")
        b = tf.Variable(0.0, name="b")
    losses = []
    for epoch in range(epochs):
        total = 0.0
        for rows in minibatches(len(x), minibatch_size, epoch):
            g = gradients(x[rows], y[rows], w, b)
            w.assign_sub(learning_rate * g["w"])
            b.assign_sub(learning_rate * g["b"])
            total += float(g["loss"]) * len(rows)
        losses.append(total / len(x))
    return Trained(w.numpy(), float(b.numpy()), losses)


def train_one_device(
    device: str,
    x: np.ndarray,
    y: np.ndarray,
    epochs: int,
    minibatch_size: int,
    learning_rate: float,
) -> Trained:
    """The reference: the same training on one device, plain TensorFlow, no tfshard."""
    with tfshard.pin(device):
        w = tf.Variable(tf.zeros([x.shape[1]]), name="w")
        b = tf.Variable(0.0, name="b")
        losses = []
        for epoch in range(epochs):
            total = 0.0
            for rows in minibatches(len(x), minibatch_size, epoch):
                with tf.GradientTape() as tape:
                    loss = mean_loss(tf.constant(x[rows]), tf.constant(y[rows]), w, b)
                grad_w, grad_b = tape.gradient(loss, [w, b])
                w.assign_sub(learning_rate * grad_w)
                b.assign_sub(learning_rate * grad_b)
                total += float(loss) * len(rows)
            losses.append(total / len(x))
    return Trained(w.numpy(), float(b.numpy()), losses)


def max_difference(a: Trained, b: Trained) -> float:
    """The largest absolute difference between two trainings' weights."""
    return float(max(np.max(np.abs(a.w - b.w)), abs(a.b - b.b)))


def same_weights(a: Trained, b: Trained) -> bool:
    """Whether two trainings ended with equal weights, to float32 tolerance."""
    return bool(
        np.allclose(a.w, b.w, rtol=RTOL, atol=ATOL) and np.isclose(a.b, b.b, rtol=RTOL, atol=ATOL)
    )


def split_sizes(n: int, minibatch_size: int, devices: Sequence[str]) -> str:
    """How the minibatches split across the devices, e.g. "75 -> 38/37; last 50 -> 25/25"."""
    plan = tfshard.parallelize(tf.identity, devices=devices).plan
    text = f"{minibatch_size} -> {'/'.join(map(str, plan(min(n, minibatch_size))))}"
    last = n % minibatch_size
    if last and n > minibatch_size:
        text += f"; last {last} -> {'/'.join(map(str, plan(last)))}"
    return text


def plot_losses(curves: dict[str, list[float]], path: str) -> None:
    """Writes the loss curves to a PNG file.

    Raises:
      ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for style, (label, losses) in zip(("-o", "--x"), curves.items()):
        axes.plot(range(1, len(losses) + 1), losses, style, label=label)
    axes.set_xlabel("epoch")
    axes.set_ylabel("mean training loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str]) -> None:
    del argv
    _common.check_plot(_PLOT.value)  # before training
    with _common.exit_on_error():
        setup = _common.setup_devices(_VIRTUAL_DEVICES.value, _DEVICES.value, _CONTEXTS.value)
        devices = setup.devices
        print(setup.note)
        print(f"devices: {', '.join(devices)}")
        x, y = make_data(_NUM_EXAMPLES.value, _FEATURES.value)
        args = (x, y, _EPOCHS.value, _MINIBATCH_SIZE.value, _LEARNING_RATE.value)
        print(
            f"logistic regression on {len(x)} examples of {x.shape[1]} features; minibatches "
            f"split across the devices as {split_sizes(len(x), _MINIBATCH_SIZE.value, devices)}"
        )
        parallel = train_data_parallel(devices, *args)
        reference = train_one_device(devices[0], *args)
    print(f"{'epoch':>5}  {'data-parallel':>13}  {'one device':>10}")
    for epoch, (a, b) in enumerate(zip(parallel.losses, reference.losses), start=1):
        print(f"{epoch:>5}  {a:>13.6f}  {b:>10.6f}")
    difference = max_difference(parallel, reference)
    if not same_weights(parallel, reference):
        raise SystemExit(
            f"error: after {_EPOCHS.value} epochs the data-parallel weights differ from "
            f"single-device training by up to {difference:.3g} (rtol {RTOL}, atol {ATOL})"
        )
    print(
        f"weights after {_EPOCHS.value} epochs equal single-device training on the same "
        f"minibatches: max |difference| {difference:.2g} (rtol {RTOL}, atol {ATOL})"
    )
    if _PLOT.value:
        plot_losses({"data-parallel": parallel.losses, "one device": reference.losses}, _PLOT.value)
        print(f"wrote the loss curves to {_PLOT.value}")


if __name__ == "__main__":
    app.run(main)
