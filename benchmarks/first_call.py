r"""The first call's cost: tracing and the first run, each in a fresh process.

A parallelized function traces its graph on the first call with a new
argument signature; later calls reuse it. TensorFlow keeps caches of its own
across functions (traced pfor rules, kernels, grappler's), so each first call
here runs in a fresh process, after TensorFlow is up and the inputs (and any
model) are built, and the table gives the median of ``--runs`` processes.

Two kinds of work:

- ``per_sample``: a per-sample function of a dict of L leaves of [8, 3] rows,
  each leaf a matvec, on K devices (the machine's GPUs when TensorFlow lists
  one, else K logical CPU devices; --device_type=cpu insists on the CPU),
  called directly and from inside a `tf.function`, and one later call for
  comparison. Baselines, first calls of the same per-sample function on the
  same devices: a hand-written `tf.function` (split, `tf.vectorized_map` under
  a `tf.device` block per shard, concat), traced for the batch's exact shape
  and for any batch size (rows None, as tfshard traces), and
  `MirroredStrategy.run` with each replica given its shard (exact shapes).
- ``keras_stream`` (--keras): Keras MobileNetV2 (alpha 0.35, 96x96, no
  pretrained weights) over 256 images in batches of 32, ``f(dataset)`` against
  ``model.predict(dataset)`` with the model built under `MirroredStrategy` on
  the same devices, and tfshard with the model's copies in ``f.replicas()``.

  python benchmarks/first_call.py                          # K = 1, 2, 4; L = 1, 10, 50
  python benchmarks/first_call.py --devices=2,4 --leaves=50 --keras --runs=3
  python benchmarks/first_call.py --devices=1,2 --split_gpu=2   # one GPU as two
  PYTHONPATH=../other-checkout python benchmarks/first_call.py   # another version of tfshard

Only tfshard's public API is used, so any version of it can be measured (the
child processes inherit PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import _device_flags
from absl import app, flags

flags.adopt_module_key_flags(_device_flags)  # --help lists --device_type and the rest
_DEVICES = flags.DEFINE_list(
    "devices", ["1", "2", "4"], "Device counts K to measure (on GPUs the default stops at theirs)."
)
_LEAVES = flags.DEFINE_list("leaves", ["1", "10", "50"], "Leaves L of the per-sample argument.")
_RUNS = flags.DEFINE_integer("runs", 3, "Fresh processes per number (the median).", lower_bound=1)
_KERAS = flags.DEFINE_bool("keras", False, "Also the Keras MobileNetV2 stream case.")
_BASELINES = flags.DEFINE_bool(
    "baselines", True, "Measure the hand-written graph and MirroredStrategy too."
)
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")
# Set by the parent for a child process: which one measurement to make.
_WAY = flags.DEFINE_string("way", None, "(internal) the measurement a child makes.")

PER_SAMPLE_WAYS = ("tfshard", "tfshard_in_tf_function", "hand_written", "hand_written_any_batch",
                   "mirrored")  # fmt: skip
KERAS_WAYS = ("tfshard_stream", "tfshard_stream_replicas", "mirrored_predict")


# ------------------------------------------------------------------ children


def per_sample(tfshard, tf, np, devices: list[str], leaves: int, way: str) -> dict[str, float]:
    """One way's first call (and, for tfshard, a later one) on the per-sample case."""
    x = {f"leaf{i:04d}": np.ones([8, 3], np.float32) for i in range(leaves)}
    weight = tf.ones([3, 2])
    fn = _per_sample(tf, weight)
    if way in ("tfshard", "tfshard_in_tf_function"):
        f = tfshard.parallelize(fn, devices=devices)
        run = f if way == "tfshard" else tf.function(lambda value: f(value))
    elif way == "mirrored":
        run = mirrored(tf, devices, fn)
    else:
        run = hand_written(tf, devices, fn, any_batch=way == "hand_written_any_batch")
    began = time.perf_counter()
    got = run(x)
    times = {"first_s": time.perf_counter() - began}
    began = time.perf_counter()
    run(x)
    times["later_s"] = time.perf_counter() - began
    for key, value in got.items():  # the same result as NumPy, or the times compare nothing
        np.testing.assert_allclose(value.numpy(), x[key] @ weight.numpy(), rtol=1e-6)
    return times


def keras_stream(tfshard, tf, np, devices: list[str], way: str) -> dict[str, float]:
    """One way's first pass over the MobileNetV2 dataset (and a second one)."""
    import keras

    images = np.random.default_rng(0).random((256, 96, 96, 3), dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices(images).batch(32)

    def build():
        keras.utils.set_random_seed(1)
        return keras.applications.MobileNetV2(
            input_shape=(96, 96, 3), alpha=0.35, weights=None, classes=10
        )

    if way == "mirrored_predict":
        strategy = tf.distribute.MirroredStrategy(devices=devices)
        with strategy.scope():
            model = build()

        def run():
            return model.predict(dataset, verbose=0)
    else:
        f = tfshard.parallelize(lambda x: model(x), devices=devices, per_sample=False)
        if way == "tfshard_stream_replicas":
            with f.replicas():
                model = build()
        else:
            model = build()

        def run():
            return f(dataset).numpy()

    began = time.perf_counter()
    got = run()
    times = {"first_s": time.perf_counter() - began}
    began = time.perf_counter()
    run()
    times["later_s"] = time.perf_counter() - began
    assert got.shape == (256, 10), got.shape
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


def hand_written(tf, devices, fn, any_batch=False):
    """Split, vectorized_map under a tf.device block per shard, concat: one tf.function.

    With `any_batch`, traced with the row count unknown (one trace for every
    batch size); else for the argument's shapes.
    """

    def run(x):
        outputs = []
        for shard, device in zip(_shards(tf, x, len(devices)), devices):
            with tf.device(device):
                outputs.append(tf.vectorized_map(fn, shard))
        return _concat(tf, outputs, devices[0])

    if not any_batch:
        return tf.function(run)
    traced = {}

    def call(x):
        if not traced:
            rows = {
                k: tf.TensorSpec([None, *v.shape[1:]], tf.as_dtype(v.dtype)) for k, v in x.items()
            }
            traced["f"] = tf.function(run, input_signature=[rows])
        return traced["f"](x)

    return call


def mirrored(tf, devices, fn):
    """MirroredStrategy.run on the same devices, each replica given its shard."""
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


def child(way: str, k: int, leaves: int) -> None:
    """Makes one measurement in this fresh process and prints it as one JSON line."""
    pool = _device_flags.devices(k, needed=k)
    import numpy as np
    import tensorflow as tf

    import tfshard

    tf.constant(1.0) + 1.0  # TensorFlow's runtime up before anything is timed
    if way in KERAS_WAYS:
        times = keras_stream(tfshard, tf, np, pool[:k], way)
    else:
        times = per_sample(tfshard, tf, np, pool[:k], leaves, way)
    print("RESULT " + json.dumps({"devices": pool[:k], **times}), flush=True)


# ------------------------------------------------------------------ parent


def measure(way: str, k: int, leaves: int, runs: int) -> dict[str, float]:
    """The median over `runs` fresh processes of one way's first (and later) call."""
    flags_of_device = [
        f"--device_type={_device_flags.DEVICE_TYPE.value}",
        f"--split_gpu={_device_flags.SPLIT_GPU.value}",
        f"--gpu_memory_mb={_device_flags.GPU_MEMORY_MB.value}",
    ]
    results = []
    for _ in range(runs):
        command = [sys.executable, os.path.abspath(__file__), f"--way={way}",
                   f"--devices={k}", f"--leaves={leaves}", *flags_of_device]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{way} (K={k}, L={leaves}) failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    keys = [key for key in results[0] if key.endswith("_s")]
    return {
        "devices": results[0]["devices"],
        **{key: statistics.median(r[key] for r in results) for key in keys},
    }


def main(argv: list[str]) -> None:
    del argv
    counts = [int(k) for k in _DEVICES.value]
    if _WAY.value:
        child(_WAY.value, counts[0], int(_LEAVES.value[0]))
        return
    # The GPUs, else max(K) logical CPU devices. On GPUs the default counts stop at the
    # machine's GPUs; counts given with --devices are all needed.
    pool = _device_flags.devices(max(counts), needed=max(counts) if _DEVICES.present else 1)
    counts = [k for k in counts if k <= len(pool)]
    import tfshard

    print(f"devices: {', '.join(pool)}; median of {_RUNS.value} fresh processes each")
    rows: list[dict] = []
    print(
        f"{'K':>2} {'leaves':>6} {'first s':>8} {'in tf.function s':>17} {'later s':>8}"
        f" {'hand-written s':>15} {'any batch s':>12} {'mirrored s':>11} {'vs mirrored':>12}"
    )
    for leaves in (int(n) for n in _LEAVES.value):
        for k in counts:
            ways = PER_SAMPLE_WAYS if _BASELINES.value else PER_SAMPLE_WAYS[:2]
            got = {way: measure(way, k, leaves, _RUNS.value) for way in ways}
            nan = {"first_s": float("nan")}
            row = {
                "case": "per_sample",
                "devices": k,
                "leaves": leaves,
                "first_s": got["tfshard"]["first_s"],
                "later_s": got["tfshard"]["later_s"],
                "first_in_tf_function_s": got["tfshard_in_tf_function"]["first_s"],
                "hand_written_first_s": got.get("hand_written", nan)["first_s"],
                "hand_written_any_batch_first_s": got.get("hand_written_any_batch", nan)["first_s"],
                "mirrored_first_s": got.get("mirrored", nan)["first_s"],
            }
            row["ratio_to_mirrored"] = row["first_s"] / row["mirrored_first_s"]
            rows.append(row)
            print(
                f"{k:>2} {leaves:>6} {row['first_s']:>8.2f} "
                f"{row['first_in_tf_function_s']:>17.2f} {row['later_s']:>8.4f} "
                f"{row['hand_written_first_s']:>15.2f} "
                f"{row['hand_written_any_batch_first_s']:>12.2f} "
                f"{row['mirrored_first_s']:>11.2f} {row['ratio_to_mirrored']:>11.2f}x",
                flush=True,
            )
    if _KERAS.value:
        print(
            "\nKeras MobileNetV2 (alpha 0.35, 96x96), 256 images in batches of 32: first pass\n"
            f"{'K':>2} {'f(ds) s':>8} {'f(ds), replicas s':>18} {'predict, mirrored s':>20}"
            f" {'vs mirrored':>12} {'later f(ds) s':>14} {'later predict s':>16}"
        )
        for k in counts:
            got = {way: measure(way, k, 0, _RUNS.value) for way in KERAS_WAYS}
            row = {
                "case": "keras_stream",
                "devices": k,
                "first_s": got["tfshard_stream"]["first_s"],
                "replicas_first_s": got["tfshard_stream_replicas"]["first_s"],
                "mirrored_predict_first_s": got["mirrored_predict"]["first_s"],
                "later_s": got["tfshard_stream"]["later_s"],
                "mirrored_predict_later_s": got["mirrored_predict"]["later_s"],
            }
            row["ratio_to_mirrored"] = row["first_s"] / row["mirrored_predict_first_s"]
            rows.append(row)
            print(
                f"{k:>2} {row['first_s']:>8.2f} {row['replicas_first_s']:>18.2f} "
                f"{row['mirrored_predict_first_s']:>20.2f} {row['ratio_to_mirrored']:>11.2f}x "
                f"{row['later_s']:>14.2f} {row['mirrored_predict_later_s']:>16.2f}",
                flush=True,
            )
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump(
                {"tfshard": tfshard.__file__, "devices": pool, "runs": _RUNS.value, "rows": rows},
                out,
                indent=1,
            )


if __name__ == "__main__":
    app.run(main)
