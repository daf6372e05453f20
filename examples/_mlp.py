"""The embedding MLP of the examples that embed samples: weights and one sample's embedding."""

from __future__ import annotations

import numpy as np
from _common import tf


def make_params(features: int, hidden: int, dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of the MLP ``features -> hidden -> dim``."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(hidden)).astype(np.float32),
        "w2": (rng.standard_normal((hidden, dim)) / np.sqrt(hidden)).astype(np.float32),
    }


def embed(sample: tf.Tensor, params: dict[str, tf.Tensor]) -> tf.Tensor:
    """The unit-length embedding of one sample: [features] -> [dim]."""
    hidden = tf.nn.relu(tf.linalg.matvec(params["w1"], sample, transpose_a=True) + params["b1"])
    return tf.math.l2_normalize(tf.linalg.matvec(params["w2"], hidden, transpose_a=True))
