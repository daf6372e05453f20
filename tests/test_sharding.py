"""_sharding: how each shard runs, one pure choice, settled by what the shared trace learned.

The choice is a function of where the shards are and what is asked; its reasons are
measured elsewhere (tests/test_step.py for placement, tests/test_concurrency.py for
shards at once). Here its table, against the rules the module states.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfshard import _sharding
from tfshard._sharding import How
from tfshard.position import Position

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))
HOST = CPUS[0]
WORKER = "/job:worker/replica:0/task:1/device:CPU:0"


def _choose(devices, output=CPUS[0], **asked):
    options = dict(replicas=False, jit_compile=False, beside_transfers=False) | asked
    return _sharding.choose(devices, output, HOST, **options)


def test_shards_off_the_output_and_the_host_share_one_trace():
    assert _choose(CPUS) == [How.IN_PLACE, How.SHARED, How.SHARED, How.SHARED]
    # Output on CPU:1: CPU:0 is the host and CPU:1 the output, both in place.
    assert _choose(CPUS, output=CPUS[1]) == [How.IN_PLACE, How.IN_PLACE, How.SHARED, How.SHARED]


@pytest.mark.parametrize(
    "asked",
    [{"replicas": True}, {"beside_transfers": True}],
    ids=["replicas", "beside_transfers"],
)
def test_every_shard_runs_in_place_where_sharing_is_not_right(asked):
    assert _choose(CPUS, **asked) == [How.IN_PLACE] * 4


def test_one_shard_off_the_output_would_share_with_nobody():
    assert _choose(CPUS[:2]) == [How.IN_PLACE, How.IN_PLACE]


def test_a_remote_device_runs_every_shard_in_place():
    assert _choose((CPUS[1], CPUS[2], WORKER)) == [How.IN_PLACE] * 3


def test_xla_compiles_one_trace_or_one_per_device_with_replicas():
    assert _choose(CPUS, jit_compile=True) == [How.COMPILED] * 4
    assert _choose(CPUS, jit_compile=True, replicas=True) == [How.COMPILED_PER_DEVICE] * 4


def test_a_shared_trace_that_writes_runs_in_place():
    chosen = _choose(CPUS)
    assert _sharding.settle(chosen, writes=True) == [How.IN_PLACE] * 4
    assert _sharding.settle(chosen, writes=False) == chosen


def test_a_trace_returns_its_structure_and_whether_it_writes_as_values():
    counter = tf.Variable(0.0)

    def guarded(rows_in, rows, position):
        (x,) = rows_in
        return {"y": x * 2.0, "n": rows, "first": position.first}

    def writing(rows_in, rows, position):
        counter.assign_add(1.0)
        return guarded(rows_in, rows, position)

    @tf.function(autograph=False)
    def body(x):
        pure = _sharding.Trace.of(guarded, [[x]])
        writes = _sharding.Trace.of(writing, [[x]])
        assert not pure.writes and writes.writes
        assert pure.structure == writes.structure
        token = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="t")
        position = Position(tf.constant(1), tf.constant(5, tf.int64))
        return pure([x], tf.constant(3), position, token)

    out = body(tf.constant(np.arange(3, dtype=np.float32)))
    assert set(out) == {"y", "n", "first"} and int(out["first"]) == 5
    np.testing.assert_array_equal(out["y"].numpy(), [0.0, 2.0, 4.0])
