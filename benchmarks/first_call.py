r"""The first call's cost: tracing, against device count and input size.

A parallelized function traces its graph on the first call with a new
argument signature; later calls reuse it. This script times first calls of
fresh functions (each a new Python function, so nothing is cached) whose
argument is a dict of L leaves of [8, 3] rows, each leaf a per-sample matmul,
on K devices (the machine's GPUs when TensorFlow lists one, else K logical CPU
devices; --device_type=cpu insists on the CPU), called directly and from inside a `tf.function`, and
one later call for comparison. It prints a table and, with --json, the numbers.

The baselines are what a user would write instead, first calls of the same
per-sample function on the same devices: a hand-written `tf.function` (split,
`tf.vectorized_map` under a `tf.device` block per shard, concat) and
`MirroredStrategy.run` with each replica given its shard. Both trace the
function once per device, for the batch's exact shape, so each new batch size
traces again. The hand-written graph is also timed traced for any batch size
(an `input_signature` with rows None), as tfshard traces: that is its cost for
what tfshard's first call buys, since an unknown row count makes a bigger
vectorized graph, slower to trace and to run the first time.

  python benchmarks/first_call.py                          # K = 1, 2, 4; L = 1, 10, 50
  python benchmarks/first_call.py --leaves=1,100 --devices=4
  python benchmarks/first_call.py --devices=1,2 --split_gpu=2   # one GPU as two
  PYTHONPATH=../other-checkout python benchmarks/first_call.py   # another version of tfshard

Only tfshard's public API is used, so any version of it can be measured.
"""

from __future__ import annotations

import json
import time

import _device_flags
from absl import app, flags

_DEVICES = flags.DEFINE_list(
    "devices", ["1", "2", "4"], "Device counts K to measure (on GPUs the default stops at theirs)."
)
_LEAVES = flags.DEFINE_list("leaves", ["1", "10", "50"], "Leaves L of the argument.")
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")


def first_calls(tfshard, tf, np, devices: list[str], leaves: int) -> dict[str, float]:
    """Seconds of the first call (direct, inside a tf.function) and of a later one."""
    x = {f"leaf{i:04d}": np.ones([8, 3], np.float32) for i in range(leaves)}
    weight = tf.ones([3, 2])

    def make():  # a new function each time: nothing of an earlier trace is reused
        return tfshard.parallelize(_per_sample(tf, weight), devices=devices)

    direct = make()
    began = time.perf_counter()
    direct(x)
    first = time.perf_counter() - began
    began = time.perf_counter()
    direct(x)
    later = time.perf_counter() - began

    inner = make()
    outer = tf.function(lambda value: inner(value))
    began = time.perf_counter()
    outer(x)
    in_function = time.perf_counter() - began
    want = direct(x)
    times = {"first_s": first, "later_s": later, "first_in_tf_function_s": in_function}
    baselines = {
        "hand_written": hand_written(tf, devices, weight),
        "hand_written_any_batch": hand_written(tf, devices, weight, any_batch=True),
        "mirrored": mirrored(tf, devices, weight),
    }
    for name, run in baselines.items():
        began = time.perf_counter()
        got = run(x)
        times[f"{name}_first_s"] = time.perf_counter() - began
        for key, value in want.items():  # the same result, or the times compare nothing
            np.testing.assert_allclose(got[key].numpy(), value.numpy(), rtol=1e-6)
    return times


def _per_sample(tf, weight):
    def fn(sample):
        return {k: tf.linalg.matvec(weight, v, transpose_a=True) for k, v in sample.items()}

    return fn


def _shards(tf, x, count):
    """Each leaf split into `count` near-equal shards: one dict per shard."""
    rows = tf.shape(next(iter(x.values())))[0]
    sizes = [(rows + count - 1 - k) // count for k in range(count)]
    pieces = {k: tf.split(v, sizes, num=count) for k, v in x.items()}
    return [{k: p[i] for k, p in pieces.items()} for i in range(count)]


def _concat(tf, outputs, device):
    with tf.device(device):
        return {k: tf.concat([o[k] for o in outputs], 0) for k in outputs[0]}


def hand_written(tf, devices, weight, any_batch=False):
    """Split, vectorized_map under a tf.device block per shard, concat: one tf.function.

    With `any_batch`, traced with the row count unknown (one trace for every
    batch size); else for the argument's shapes.
    """
    fn = _per_sample(tf, weight)

    def run(x):
        outputs = []
        for shard, device in zip(_shards(tf, x, len(devices)), devices):
            with tf.device(device):
                outputs.append(tf.vectorized_map(fn, shard))
        return _concat(tf, outputs, devices[0])

    if not any_batch:
        return tf.function(run)

    def call(x):
        rows = {k: tf.TensorSpec([None, *v.shape[1:]], tf.as_dtype(v.dtype)) for k, v in x.items()}
        return tf.function(run, input_signature=[rows])(x)

    return call


def mirrored(tf, devices, weight):
    """MirroredStrategy.run on the same devices, each replica given its shard."""
    fn = _per_sample(tf, weight)
    strategy = tf.distribute.MirroredStrategy(devices=devices)

    @tf.function
    def run(x):
        shards = _shards(tf, x, len(devices))
        values = strategy.experimental_distribute_values_from_function(
            lambda context: shards[context.replica_id_in_sync_group]
        )
        outputs = strategy.run(lambda v: tf.vectorized_map(fn, v), args=(values,))
        local = strategy.experimental_local_results(outputs)
        return _concat(tf, list(local), devices[0])

    return run


def main(argv: list[str]) -> None:
    del argv
    counts = [int(k) for k in _DEVICES.value]
    import tfshard  # after flags: --help stays fast

    # The GPUs, else max(K) logical CPU devices. On GPUs the default counts stop at the
    # machine's GPUs; counts given with --devices are all needed.
    pool = _device_flags.devices(max(counts), needed=max(counts) if _DEVICES.present else 1)
    counts = [k for k in counts if k <= len(pool)]
    import numpy as np
    import tensorflow as tf

    print(f"devices: {', '.join(pool)}")
    rows = []
    print(
        f"{'K':>2} {'leaves':>6} {'first s':>8} {'in tf.function s':>17} {'later s':>8}"
        f" {'hand-written first s':>21} {'any batch':>9} {'mirrored first s':>17}"
    )
    for leaves in (int(n) for n in _LEAVES.value):
        for k in counts:
            times = first_calls(tfshard, tf, np, pool[:k], leaves)
            rows.append({"devices": k, "leaves": leaves, **times})
            print(
                f"{k:>2} {leaves:>6} {times['first_s']:>8.2f} "
                f"{times['first_in_tf_function_s']:>17.2f} {times['later_s']:>8.4f} "
                f"{times['hand_written_first_s']:>21.2f} "
                f"{times['hand_written_any_batch_first_s']:>9.2f} "
                f"{times['mirrored_first_s']:>17.2f}",
                flush=True,
            )
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump({"tfshard": tfshard.__file__, "devices": pool, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    app.run(main)
