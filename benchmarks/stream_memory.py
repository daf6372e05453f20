r"""Peak memory of streaming a dataset whose result is larger than one batch.

Streams ``--rows`` rows in batches of ``--batch`` through a function whose
output row is ``--width`` float32 values, so the whole result is R = rows x
width x 4 bytes, and reads the allocator's peak bytes on the output device
(`tf.config.experimental.get_memory_info`) above what was allocated before,
for each way of getting the result:

- ``f(dataset)``: every batch's outputs kept in TensorLists on the output
  device, concatenated after the last batch (lists and result alive at once).
- ``f.iterate(dataset)``: one batch's result at a time, each copied into a
  NumPy array the caller preallocated (host memory outside TensorFlow's
  allocator, as a file-backed ``np.lib.format.open_memmap`` would be).
- ``f(x)``: the same rows as one in-memory tensor, for contrast.

On GPUs the numbers are the output GPU's; on logical CPU devices every device
shares the host's CPU allocator, so they are the process's TensorFlow host
bytes (the dataset's own batches included). TensorFlow's plain CPU allocator
keeps no statistics ("Cannot reset memory stats for device 'CPU:0'"); oneDNN's
does, and TensorFlow turns oneDNN on by itself only on CPUs with AVX-512 VNNI
and later, so the script sets ``TF_ENABLE_ONEDNN_OPTS=1`` unless it is set.

  python benchmarks/stream_memory.py                      # rows 2^15 and 2^17
  python benchmarks/stream_memory.py --rows=65536 --batch=1024 --json=memory.json
"""

from __future__ import annotations

import gc
import json
import os

from absl import app, flags

_ROWS = flags.DEFINE_list("rows", ["32768", "131072"], "Rows streamed, one run each.")
_BATCH = flags.DEFINE_integer("batch", 4096, "Global batch.", lower_bound=1)
_WIDTH = flags.DEFINE_integer("width", 256, "float32 values per output row.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices", 2, "Logical CPU devices (no GPU).", lower_bound=1)
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")


_ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"


def peak_bytes(tf, device: str, run) -> int:
    """The allocator's peak on `device` while `run()` runs, above what was allocated before."""
    gc.collect()
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as error:
        raise RuntimeError(
            f"{error}: its allocator keeps no statistics. On a CPU, run with "
            f"{_ONEDNN_ENV}=1 (oneDNN's allocator keeps them, TensorFlow's plain one does not)"
        ) from None
    before = tf.config.experimental.get_memory_info(device)["current"]
    result = run()
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    del result
    return peak - before


def measure(tfshard, tf, np, rows: int, batch: int, width: int, devices: list[str]) -> dict:
    """Peak bytes of each way to stream `rows` rows, with the sizes they compare with."""
    weights = tf.random.normal([16, width], seed=1)

    def fn(block):  # [n, 16] -> [n, width]
        return tf.tanh(tf.matmul(block, weights))

    f = tfshard.parallelize(fn, per_sample=False, devices=devices)
    output = f.output_device
    device = tf.DeviceSpec.from_string(output)
    memory_device = f"{device.device_type}:{device.device_index}"
    x = np.random.default_rng(0).normal(size=[rows, 16]).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(batch)

    def streamed():
        return f(dataset)

    def iterated():
        out = np.empty([rows, width], np.float32)
        at = 0
        for result in f.iterate(dataset):
            out[at : at + len(result)] = result.numpy()
            at += len(result)
        return out

    def in_memory():
        return f(x)

    ways = {"f(dataset)": streamed, "f.iterate(dataset)": iterated, "f(x)": in_memory}
    want = np.tanh(x @ weights.numpy())
    # Exact float32 against NumPy, but TF32 where a GPU runs float32 matmuls in it (README,
    # "Numerics on GPUs").
    tf32 = "GPU" in output and tf.config.experimental.tensor_float_32_execution_enabled()
    tolerance = {"rtol": 2e-3, "atol": 2e-3} if tf32 else {"rtol": 1e-4, "atol": 1e-5}
    for name, run in ways.items():  # warm-up (traces, tf.data threads), and a check
        np.testing.assert_allclose(np.asarray(run()), want, err_msg=name, **tolerance)
    result_bytes = rows * width * 4
    peaks = {name: peak_bytes(tf, memory_device, run) for name, run in ways.items()}
    return {
        "rows": rows,
        "batch": batch,
        "width": width,
        "output_device": output,
        "memory_of": memory_device,
        "result_bytes": result_bytes,
        "batch_result_bytes": batch * width * 4,
        "peak_bytes": peaks,
        "peak_over_result": {name: peak / result_bytes for name, peak in peaks.items()},
    }


def main(argv: list[str]) -> None:
    del argv
    # Before TensorFlow starts (_harness imports it): a CPU allocator that keeps statistics.
    os.environ.setdefault(_ONEDNN_ENV, "1")
    import _harness  # after flags: --help stays fast
    import numpy as np
    import tensorflow as tf

    import tfshard

    if tf.config.list_physical_devices("GPU"):  # does not start the runtime
        devices = tfshard.list_devices("GPU")
    else:
        devices = _harness.setup_devices(_DEVICES.value)
    mb = 1 / 2**20
    runs = []
    print(f"devices: {', '.join(devices)}; batch {_BATCH.value}, {_WIDTH.value} float32 per row")
    header = ("rows", "result MB", "batch MB", "way", "peak MB", "x result")
    print("{:>8} {:>10} {:>9}  {:<20} {:>9} {:>9}".format(*header))
    for rows in (int(r) for r in _ROWS.value):
        run = measure(tfshard, tf, np, rows, _BATCH.value, _WIDTH.value, devices)
        runs.append(run)
        for name, peak in run["peak_bytes"].items():
            result, one_batch = run["result_bytes"] * mb, run["batch_result_bytes"] * mb
            print(
                f"{rows:>8} {result:>10.1f} {one_batch:>9.1f}  {name:<20} {peak * mb:>9.1f} "
                f"{run['peak_over_result'][name]:>8.2f}x"
            )
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump({"devices": devices, "runs": runs}, out, indent=2)


if __name__ == "__main__":
    app.run(main)
