r"""Peak host memory of ``parallelize(model)(dataset)`` against ``model.predict(dataset)``.

A Keras MobileNetV2 with random weights (``weights=None``) runs over ``--images``
random images of ``--size`` x ``--size`` x 3 in batches of ``--batch``, each way
in a fresh Python process so that every way starts from the same state. In
each process, after the model is built and the dataset made, the baseline is
the process's resident set (RSS); the way then runs twice:

- ``cold``: the first run, tracing included, as a user's first call; its
  growth is the peak RSS during the run (the kernel's high-water mark,
  ``VmHWM``, reset before it) above the baseline;
- ``warm``: the second run, its peak above the RSS the first run left.

It also reads TensorFlow's own CPU allocator (`tf.config.experimental.get_memory_info`,
peak above what was allocated before each run), which sees tensors but not the
graphs, kernels and thread stacks that RSS also counts. The ways:

- ``predict``: ``model.predict(dataset, verbose=0)``, on the default device;
- ``tfshard``: ``tfshard.parallelize(model, devices=<--devices logical CPUs>)(dataset)``;

and, to tell what running on several devices costs from what tfshard's loop costs:

- ``one_device``: `tfshard.parallelize` on the first device only;
- ``function``: ``tf.function(model)`` called on each batch from Python, the
  results concatenated (predict without Keras's machinery), one device;
- ``hand_written``: a ``tf.function`` that splits each batch into one piece per
  device, runs the model under one ``tf.device`` per piece and concatenates, called
  on each batch from Python (the overhead floor of DESIGN.md), on tfshard's devices.

  python benchmarks/predict_memory.py                                # ~2 min on 2 cores
  python benchmarks/predict_memory.py --images=2000 --size=96 --json=predict_memory.json

The second line is issue 25's size (2,000 images of 96x96, 2 devices).
"""

from __future__ import annotations

import json
import os
import sys

import _child
from absl import app, flags

_IMAGES = flags.DEFINE_integer("images", 512, "Images run through the model.", lower_bound=1)
_SIZE = flags.DEFINE_integer("size", 96, "Image side in pixels.", lower_bound=32)
_BATCH = flags.DEFINE_integer("batch", 32, "Global batch (predict's default).", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices", 2, "Logical CPU devices for tfshard.", lower_bound=1)
_WAYS = flags.DEFINE_list(
    "ways", ["predict", "tfshard", "one_device", "function", "hand_written"],
    "Ways to measure, one process each.",
)  # fmt: skip
_SOURCE = flags.DEFINE_enum(
    "source",
    "array",
    ["array", "generated"],
    "array: Dataset.from_tensor_slices of a NumPy array of the images (held in memory, in "
    "the baseline); generated: each image made in the pipeline from its index.",
)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Fresh processes per way.", lower_bound=1)
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")
_CHILD = flags.DEFINE_string("child", None, "Internal: measure this one way and print JSON.")

WAYS = ("predict", "tfshard", "one_device", "function", "hand_written")
_MB = 1 / 2**20


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Resets the kernel's high-water mark of this process's RSS to its current RSS."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _run_measured(tf, run) -> dict:  # noqa: ANN001
    """Peak RSS and peak TF-allocator bytes while `run()` runs, above what was before."""
    import gc

    gc.collect()
    tf.config.experimental.reset_memory_stats("CPU:0")
    allocated = tf.config.experimental.get_memory_info("CPU:0")["current"]
    rss = _status_kb("VmRSS") * 1024
    _reset_peak()
    result = run()
    peak = _status_kb("VmHWM") * 1024
    tf_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    del result
    gc.collect()
    return {
        "rss_before": rss,
        "rss_growth": peak - rss,
        "tf_peak_growth": tf_peak - allocated,
        "rss_after": _status_kb("VmRSS") * 1024,
    }


def child(way: str, images: int, size: int, batch: int, devices: int, source: str) -> dict:
    """One way measured in this process, which must not have started TensorFlow."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _harness
    import numpy as np
    import tensorflow as tf

    import tfshard

    names = _harness.setup_devices(devices)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.applications.MobileNetV2(input_shape=(size, size, 3), weights=None)
    held = images if source == "array" else 1  # images held in memory
    x = np.random.default_rng(0).uniform(-1, 1, size=[held, size, size, 3]).astype(np.float32)
    if source == "array":
        dataset = tf.data.Dataset.from_tensor_slices(x).batch(batch)
    else:
        pixels = tf.constant(x[:1])  # the first image, row 0 of the check below

        def image(i):  # noqa: ANN001, ANN202
            noise = tf.random.stateless_uniform([size, size, 3], [i, 0], -1, 1)
            return tf.where(i == 0, pixels[0], noise)

        dataset = tf.data.Dataset.range(images).map(image).batch(batch)
    spec = tf.TensorSpec([None, size, size, 3], tf.float32)
    if way == "predict":

        def run():  # noqa: ANN202
            return model.predict(dataset, verbose=0)

    elif way == "tfshard":
        f = tfshard.parallelize(model, devices=names)

        def run():  # noqa: ANN202
            return f(dataset)

    elif way == "one_device":
        f = tfshard.parallelize(model, devices=names[:1])

        def run():  # noqa: ANN202
            return f(dataset)

    elif way == "function":
        g = tf.function(lambda batch: model(batch, training=False), input_signature=[spec])

        def run():  # noqa: ANN202
            return tf.concat([g(batch) for batch in dataset], 0)

    elif way == "hand_written":

        @tf.function(input_signature=[spec])
        def g(batch):  # noqa: ANN001, ANN202  [B, ...] -> K x [B_k, ...] -> [B, classes]
            n, count = tf.shape(batch)[0], len(names)
            sizes = [n // count + tf.cast(k < n % count, tf.int32) for k in range(count)]
            halves = tf.split(batch, tf.stack(sizes), num=count)
            outputs = []
            for device, half in zip(names, halves):
                with tf.device(device):
                    outputs.append(model(half, training=False))
            with tf.device(names[0]):
                return tf.concat(outputs, 0)

        def run():  # noqa: ANN202
            return tf.concat([g(batch) for batch in dataset], 0)

    else:
        raise app.UsageError(f"--ways: unknown way {way!r}; choose from {', '.join(WAYS)}")
    baseline = _status_kb("VmRSS") * 1024
    cold = _run_measured(tf, run)
    result = np.asarray(run())  # the result's size, and a check against one device
    warm = _run_measured(tf, run)
    want = model(x[:1], training=False).numpy()
    np.testing.assert_allclose(result[:1], want, rtol=1e-4, atol=1e-6)
    return {
        "way": way,
        "source": source,
        "baseline_rss": baseline,
        "input_bytes": x.nbytes,
        "result_bytes": result.nbytes,
        "cold": cold,
        "warm": warm,
    }


def measure(way: str, images: int, size: int, batch: int, devices: int, source: str) -> dict:
    """`child` in a fresh Python process; its JSON."""
    arguments = [
        f"--child={way}", f"--images={images}", f"--size={size}", f"--batch={batch}",
        f"--devices={devices}", f"--source={source}",
    ]  # fmt: skip
    return _child.measured(__file__, way, arguments)


def main(argv: list[str]) -> None:
    del argv
    if _CHILD.value:
        run = child(
            _CHILD.value, _IMAGES.value, _SIZE.value, _BATCH.value, _DEVICES.value, _SOURCE.value
        )
        print(json.dumps(run))
        return
    for way in _WAYS.value:
        if way not in WAYS:
            raise app.UsageError(f"--ways: unknown way {way!r}; choose from {', '.join(WAYS)}")
    print(
        f"MobileNetV2 {_SIZE.value}x{_SIZE.value}, random weights; {_IMAGES.value} images in "
        f"batches of {_BATCH.value} ({_SOURCE.value}); tfshard on {_DEVICES.value} logical CPU "
        "devices"
    )
    header = ("way", "baseline", "input", "result", "cold RSS+", "cold TF+", "warm RSS+")
    header += ("warm TF+",)
    print("{:<12} {:>9} {:>7} {:>7} {:>10} {:>9} {:>10} {:>9}   (MB)".format(*header))
    runs = []
    for _ in range(_REPEATS.value):
        for way in _WAYS.value:
            run = measure(
                way, _IMAGES.value, _SIZE.value, _BATCH.value, _DEVICES.value, _SOURCE.value
            )
            runs.append(run)
            cold, warm = run["cold"], run["warm"]
            print(
                f"{way:<12} {run['baseline_rss'] * _MB:>9.1f} {run['input_bytes'] * _MB:>7.1f} "
                f"{run['result_bytes'] * _MB:>7.1f} {cold['rss_growth'] * _MB:>10.1f} "
                f"{cold['tf_peak_growth'] * _MB:>9.1f} {warm['rss_growth'] * _MB:>10.1f} "
                f"{warm['tf_peak_growth'] * _MB:>9.1f}"
            )
    flags_used = {
        "images": _IMAGES.value, "size": _SIZE.value, "batch": _BATCH.value,
        "devices": _DEVICES.value, "source": _SOURCE.value,
    }  # fmt: skip
    print(json.dumps({"flags": flags_used, "runs": runs}))
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump({"flags": flags_used, "runs": runs}, out, indent=2)


if __name__ == "__main__":
    app.run(main)
