"""_shards: what a shard returns, checked alike across shards.

The behaviour of whole shards, empty shards and per-sample outputs is tested
end to end in test_parallel.py; here the checks that name what differs.
"""

import pytest
import tensorflow as tf

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
