r"""A long job's result to disk: ``f.write`` against the README recipe, ``f(dataset)``, predict.

Embeds ``--rows`` rows with a Keras MLP (``--features`` -> ``--hidden`` ->
``--dim``, ReLU between) in global batches of ``--batch``, each way in a fresh
Python process (this script runs itself with ``--way=...``), so every way
starts from the same state:

- ``write``: ``tfshard.parallelize(model).write(dataset, path)``, the outputs
  written to a ``.npy`` file as they come, committed once a second;
- ``recipe``: the README's former recipe, ``f.iterate(dataset)`` writing each
  batch into a ``np.lib.format.open_memmap`` file (what ``write`` does, by hand,
  without the crash safety);
- ``call``: ``f(dataset)``, the whole result in memory (the traced loop);
- ``predict``: Keras's ``model.predict(dataset)``, on one device.

The rows are made in the pipeline from their batch's index
(``tf.random.stateless_uniform``), so no way holds its input. In each process
the model is built, the way runs once on two batches (tracing, and for
``write`` a first file), and then the measured run: its wall time, and its
peak resident set (``resource.getrusage``'s ``ru_maxrss``, after resetting the
kernel's high-water mark with ``/proc/self/clear_refs``) above the RSS just
before it. Pages of a file written through a memory map count in that RSS
while they stay mapped; pages written with ``pwrite`` (``write``) do not. Every
way's first and last rows are checked against the recipe's.

  python benchmarks/write.py                                  # 200,000 and 1,000,000 rows
  python benchmarks/write.py --rows=200000 --ways=write,recipe --json=write.json

The tfshard ways run on ``--devices`` logical CPU devices with one intra-op
thread each (``tfshard.virtual_devices`` and
``set_intra_op_parallelism_threads(1)``, as ``examples/`` do); ``predict`` runs
on the first of them.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time

import _child
from absl import app, flags

_ROWS = flags.DEFINE_list("rows", ["200000", "1000000"], "Rows embedded, one run of each way.")
_BATCH = flags.DEFINE_integer("batch", 4096, "Global batch.", lower_bound=1)
_FEATURES = flags.DEFINE_integer("features", 256, "Input features.", lower_bound=1)
_HIDDEN = flags.DEFINE_integer("hidden", 512, "Hidden units.", lower_bound=1)
_DIM = flags.DEFINE_integer("dim", 512, "Output features.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices", 2, "Logical CPU devices.", lower_bound=1)
_WAYS = flags.DEFINE_list("ways", ["write", "recipe", "call", "predict"], "Ways, one process each.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Rounds of every way, interleaved; medians are reported.", lower_bound=1
)
_DIR = flags.DEFINE_string("dir", None, "Where the files go (default: a temporary directory).")
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")
_WAY = flags.DEFINE_string("way", None, "Internal: measure this one way and print JSON.")

WAYS = ("write", "recipe", "call", "predict")
_MB = 1 / 2**20
_CHECKED = 64  # rows at each end compared across ways


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """The kernel's high-water mark of this process's RSS back to its RSS now."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def child(way: str, rows: int, sizes: dict, devices: int, directory: str) -> dict:
    """One way measured in this process, which must not have started TensorFlow."""
    import numpy as np
    import tensorflow as tf

    import tfshard

    tfshard.virtual_devices(devices)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    names = tfshard.list_devices("CPU")
    batch, features = sizes["batch"], sizes["features"]
    tf.keras.utils.set_random_seed(0)
    with tf.device(names[0]):
        model = tf.keras.Sequential(
            [
                tf.keras.Input((features,)),
                tf.keras.layers.Dense(sizes["hidden"], activation="relu"),
                tf.keras.layers.Dense(sizes["dim"]),
            ]
        )

    def rows_of(n: int) -> tf.data.Dataset:
        def make(index):  # noqa: ANN001, ANN202  a batch of indices -> [b, features]
            seed = tf.stack([index[0], tf.constant(0, tf.int64)])
            return tf.random.stateless_uniform([tf.size(index), features], seed, -1.0, 1.0)

        return tf.data.Dataset.range(n).batch(batch).map(make)

    f = tfshard.parallelize(model, devices=names)
    path = os.path.join(directory, f"{way}-{rows}")

    def run(n: int, target: str):  # noqa: ANN202
        dataset = rows_of(n)
        if way == "write":
            f.write(dataset, target)
            return tfshard.load(target)
        if way == "recipe":
            out = np.lib.format.open_memmap(
                target + ".npy", mode="w+", dtype=np.float32, shape=(n, sizes["dim"])
            )
            at = 0
            for batch_out in f.iterate(dataset):
                out[at : at + len(batch_out)] = batch_out.numpy()
                at += len(batch_out)
            out.flush()
            return out
        if way == "call":
            return f(dataset).numpy()
        if way == "predict":
            with tf.device(names[0]):
                return model.predict(dataset, verbose=0)
        raise app.UsageError(f"--ways: unknown way {way!r}; choose from {', '.join(WAYS)}")

    run(2 * batch, path + "-warmup")  # traced, and a first file written
    before = _rss()
    _reset_peak()
    start = time.perf_counter()
    result = run(rows, path)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ends = np.concatenate([result[:_CHECKED], result[-_CHECKED:]])
    return {
        "way": way,
        "rows": rows,
        "seconds": seconds,
        "rss_before": before,
        "rss_growth": peak - before,
        "result_bytes": rows * sizes["dim"] * 4,
        "ends": ends.tolist(),
    }


def measure(way: str, rows: int, sizes: dict, devices: int, directory: str) -> dict:
    """`child` in a fresh Python process; its JSON."""
    arguments = [
        f"--way={way}", f"--rows={rows}", f"--devices={devices}", f"--dir={directory}",
        *(f"--{name}={value}" for name, value in sizes.items()),
    ]  # fmt: skip
    return _child.measured(__file__, way, arguments)


def compare(runs: list[dict]) -> None:
    """Every way's first and last rows equal the recipe's (float32, 1e-4)."""
    import numpy as np

    by_way = {run["way"]: np.asarray(run.pop("ends")) for run in runs}
    want = by_way.get("recipe", next(iter(by_way.values())))
    for way, ends in by_way.items():
        np.testing.assert_allclose(ends, want, rtol=1e-4, atol=1e-5, err_msg=way)


def summary(runs: list[dict]) -> list[dict]:
    """Per rows and way: the median seconds and peak growth over the rounds, and the
    median seconds over the recipe's."""
    import statistics

    rows = []
    for count in dict.fromkeys(r["rows"] for r in runs):
        medians = {}
        for way in dict.fromkeys(r["way"] for r in runs if r["rows"] == count):
            mine = [r for r in runs if r["rows"] == count and r["way"] == way]
            medians[way] = {
                "rows": count,
                "way": way,
                "rounds": len(mine),
                "seconds": statistics.median(r["seconds"] for r in mine),
                "seconds_all": [round(r["seconds"], 3) for r in mine],
                "rss_growth": statistics.median(r["rss_growth"] for r in mine),
                "result_bytes": mine[0]["result_bytes"],
            }
        recipe = medians.get("recipe")
        for row in medians.values():
            row["x_recipe"] = row["seconds"] / recipe["seconds"] if recipe else None
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["  way       rows      seconds  x recipe   peak RSS+ MB  x result  result MB"]
    for row in rows:
        ratio = f"{row['x_recipe']:8.2f}" if row["x_recipe"] is not None else f"{'-':>8}"
        lines.append(
            f"  {row['way']:<8} {row['rows']:>9,} {row['seconds']:>9.2f}  {ratio}  "
            f"{row['rss_growth'] * _MB:>12.1f}  {row['rss_growth'] / row['result_bytes']:>8.2f}"
            f"  {row['result_bytes'] * _MB:>9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    sizes = {
        "batch": _BATCH.value, "features": _FEATURES.value, "hidden": _HIDDEN.value,
        "dim": _DIM.value,
    }  # fmt: skip
    if _WAY.value:
        run = child(_WAY.value, int(_ROWS.value[0]), sizes, _DEVICES.value, _DIR.value)
        print(json.dumps(run))
        return
    for way in _WAYS.value:
        if way not in WAYS:
            raise app.UsageError(f"--ways: unknown way {way!r}; choose from {', '.join(WAYS)}")
    directory = _DIR.value or tempfile.mkdtemp(prefix="tfshard-write-")
    load = os.getloadavg()
    print(
        f"MLP {_FEATURES.value} -> {_HIDDEN.value} -> {_DIM.value} in batches of "
        f"{_BATCH.value}; tfshard on {_DEVICES.value} logical CPU devices, predict on the "
        f"first; median of {_REPEATS.value} round(s), each way in a fresh process; files in "
        f"{directory}; load average {load[0]:.2f} at the start"
    )
    runs = []
    try:
        for rows in (int(r) for r in _ROWS.value):
            for _ in range(_REPEATS.value):
                for way in _WAYS.value:
                    runs.append(measure(way, rows, sizes, _DEVICES.value, directory))
                    for name in os.listdir(directory):  # the next way starts on an empty disk
                        target = os.path.join(directory, name)
                        if os.path.isdir(target):
                            shutil.rmtree(target)
                        else:
                            os.remove(target)
                compare([r for r in runs if r["rows"] == rows and "ends" in r])
    finally:
        if not _DIR.value:
            shutil.rmtree(directory, ignore_errors=True)
    rows = summary(runs)
    print(table(rows))
    report = {
        "sizes": sizes, "devices": _DEVICES.value, "repeats": _REPEATS.value,
        "load_average_start": load, "load_average_end": os.getloadavg(), "summary": rows,
        "runs": runs,
    }  # fmt: skip
    print(json.dumps(report))
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    app.run(main)
