r"""A Keras model's stream against ``model.predict``: time, host reads, edges back to the host.

On a GPU, every time the host reads a tensor the device computed, or a loop's
iteration needs a value back from the device, the host waits for the device's
queue to drain; on the CPU bed those waits cost next to nothing, so a clock
cannot see them. This script counts them exactly, beside the time:

- ``reads``: the tensors Python reads on the host during one warm pass of
  ``f(dataset)`` (``int(t)``, ``bool(t)``, ``t.numpy()``...), against one pass
  of ``model.predict(dataset)``; the result itself is not read.
- ``back``: the runs of cross-device edges, in one warm pass, from a shard's
  device to the host, from TensorFlow's profiler (each run of a ``_Send`` the
  record names with its source and destination devices: an edge in the loop's
  body runs once per batch), in all and per batch; ``--edges`` lists them by
  the node that sends. On a GPU, an int32 scalar or a loop's condition (held in
  host memory there) and a control edge cost no wait; any other value does.
  On the CPU bed the stream runs on ``CPU:1``.. with ``CPU:0`` standing for
  the host; on a GPU machine on ``GPU:0``..
- ``time``: the median of ``--repeats`` warm passes of each, alternated, in one
  process, and their ratio (``predict`` on the stream's first device).

The model's ``jit_compile`` is set True (``--jit``), as Keras resolves it on a
GPU machine, so on one device both run under XLA (tfshard follows the model's
own ``jit_compile``).

  python benchmarks/stream_waits.py                       # an MLP and a small MobileNetV2
  python benchmarks/stream_waits.py --devices=2 --models=mlp --edges
  python benchmarks/stream_waits.py --models=mobilenet --size=96 --json=waits.json
"""

from __future__ import annotations

import collections
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _device_flags
from absl import app, flags

flags.adopt_module_key_flags(_device_flags)  # --help lists --device_type and the rest
_MODELS = flags.DEFINE_list("models", ["mlp", "mobilenet"], "mlp and/or mobilenet.")
_IMAGES = flags.DEFINE_integer("images", 512, "Rows (images) in the dataset.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 128, "Rows per batch.", lower_bound=1)
_SIZE = flags.DEFINE_integer("size", 32, "MobileNetV2's image side.", lower_bound=32)
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed passes of each.", lower_bound=1)
_JIT = flags.DEFINE_bool("jit", True, "Set the model's jit_compile True, as on a GPU.")
_DEVICES = flags.DEFINE_integer(
    "devices", 1, "Devices the stream runs on (predict runs on the first).", lower_bound=1
)
_EDGES = flags.DEFINE_bool("edges", False, "List the edges back to the host.")
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")

_READS = ("numpy", "__int__", "__index__", "__bool__", "__float__", "__array__")


def host_reads(run: Any) -> int:
    """How many times `run()` reads an eager tensor's value on the host."""
    import tensorflow as tf

    kind = type(tf.constant(0))
    count = [0]
    saved = {name: getattr(kind, name) for name in _READS}

    def counted(method: Any) -> Any:
        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return method(self, *args, **kwargs)

        return read

    try:
        for name, method in saved.items():
            setattr(kind, name, counted(method))
        run()
    finally:
        for name, method in saved.items():
            setattr(kind, name, method)
    return count[0]


def edges_back(run: Any, device: str, host: str) -> collections.Counter:
    """The cross-device edges from `device` to `host` in the profile of `run()`, by the
    node that sends each."""
    import tensorflow as tf

    from tfshard import timeline

    xspace = timeline.xspace_message()
    logdir = Path(tempfile.mkdtemp())
    tf.profiler.experimental.start(str(logdir))
    try:
        run()
    finally:
        tf.profiler.experimental.stop()
    sent: collections.Counter = collections.Counter()
    src, dst = _local(device), _local(host)
    for path in sorted(logdir.glob("plugins/profile/*/*.xplane.pb")):
        space = xspace()
        space.ParseFromString(path.read_bytes())
        for plane in space.planes:
            stat_names = {e.key: e.value.name for e in plane.stat_metadata}
            for line in plane.lines:
                for event in line.events:
                    stats = {}
                    for stat in event.stats:
                        kind = stat.WhichOneof("value")
                        value = getattr(stat, kind) if kind else None
                        if kind == "ref_value":
                            value = stat_names.get(value, "")
                        stats[stat_names.get(stat.metadata_id, "")] = value
                    key = stats.get("key")
                    if not isinstance(key, str) or "from" not in stats:
                        continue
                    parts = key.split(";")
                    if len(parts) > 2 and _local(parts[0]) == src and _local(parts[2]) == dst:
                        sent[stats["from"]] += 1  # one event per run of the send
    return sent


def _local(name: str) -> str:
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(name)
    return f"{spec.device_type}:{spec.device_index}"


def model_of(kind: str, size: int) -> tuple[Any, tuple[int, ...]]:
    import keras

    if kind == "mlp":
        shape = (64,)
        layers = [keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]
        return keras.Sequential([keras.Input(shape), *layers]), shape
    shape = (size, size, 3)
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=shape, classes=10, alpha=0.35
    )
    return model, shape


def measure(kind: str, devices: list[str], host: str) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    import tfshard

    device = devices[0]
    with tf.device(device):
        model, shape = model_of(kind, _SIZE.value)
    model.jit_compile = _JIT.value
    x = np.random.default_rng(0).random((_IMAGES.value, *shape)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(_BATCH.value)
    batches = -(-_IMAGES.value // _BATCH.value)
    f = tfshard.parallelize(model, devices=devices)

    def stream() -> Any:
        return f(ds)

    def predict() -> Any:
        with tf.device(device):
            return model.predict(ds, verbose=0)

    began = time.perf_counter()
    ours = np.asarray(stream())
    first = time.perf_counter() - began
    began = time.perf_counter()
    theirs = predict()
    first_predict = time.perf_counter() - began
    for _ in range(2):  # the loop settles its batches per call
        stream()
        predict()
    reads = host_reads(stream)
    reads_predict = host_reads(predict)
    back: collections.Counter = collections.Counter()
    for shard_device in devices:
        back.update(edges_back(stream, shard_device, host))
    times, times_predict = [], []
    for _ in range(_REPEATS.value):
        began = time.perf_counter()
        np.asarray(stream())
        times.append(time.perf_counter() - began)
        began = time.perf_counter()
        predict()
        times_predict.append(time.perf_counter() - began)
    ms, ms_predict = statistics.median(times) * 1e3, statistics.median(times_predict) * 1e3
    return {
        "model": kind,
        "devices": devices,
        "jit_compile": _JIT.value,
        "batches": batches,
        "max_abs_diff": float(np.max(np.abs(ours - theirs))),
        "reads": reads,
        "reads_predict": reads_predict,
        "back": sum(back.values()),
        "back_per_batch": sum(back.values()) / batches,
        "back_edges": dict(back),
        "first_s": first,
        "first_predict_s": first_predict,
        "ms": ms,
        "ms_predict": ms_predict,
        "ratio": ms / ms_predict,
    }


def main(argv: list[str]) -> None:
    del argv
    count = _DEVICES.value
    machine = _device_flags.devices(count + 1, needed=count)
    import tensorflow as tf

    from tfshard import datasets

    host = datasets.HOST
    gpu = tf.DeviceSpec.from_string(machine[0]).device_type == "GPU"
    devices = machine[:count] if gpu else machine[1 : count + 1]  # the bed: not CPU:0
    results = [measure(kind, devices, host) for kind in _MODELS.value]
    print(f"stream on {', '.join(devices)}, host {host}, jit_compile={_JIT.value}, "
          f"{_IMAGES.value} rows in batches of {_BATCH.value}")  # fmt: skip
    header = ("model", "reads f / predict", "back to host (per batch)", "f ms", "predict ms")
    header = (*header, "ratio")
    print("  " + "  ".join(f"{h:>24}" if i else f"{h:<10}" for i, h in enumerate(header)))
    for r in results:
        row = (
            r["model"],
            f"{r['reads']} / {r['reads_predict']}",
            f"{r['back']} ({r['back_per_batch']:.2f})",
            f"{r['ms']:.1f}",
            f"{r['ms_predict']:.1f}",
            f"{r['ratio']:.2f}x",
        )
        print("  " + "  ".join(f"{c:>24}" if i else f"{c:<10}" for i, c in enumerate(row)))
        if _EDGES.value:
            for name, count in sorted(r["back_edges"].items()):
                print(f"      {count:3d}  {name}")
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    app.run(main)
