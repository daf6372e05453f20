r"""Do shards run at once whatever the function does? Speed-ups of stateful functions.

A data-parallel map promises no order of side effects across shards, so a
function with random ops, a `tf.random.Generator`, dropout or `tf.print`
should scale like the same function without them. This script times, in one
process, each kind of function below on one logical CPU device and on K of
them (one intra-op thread each), rounds interleaved across every kind and K,
and prints each kind's speed-up over one device beside the pure function's:

  pure             20 chained [rows, 256] x [256, 256] matmuls + tanh
  uniform          pure + 0 * tf.random.uniform(...)      (a legacy random op)
  generator        pure + 0 * tf.random.Generator.uniform(...)
  nn_dropout       pure on tf.nn.dropout(x, 0.1)
  print            tf.print at the start, then pure
  keras_inference  a 20-layer Keras MLP (Dense 256 tanh + Dropout 0.1), training=False
  keras_dropout    the same MLP, training=True (its reference is keras_inference)

"of pure" is a kind's speed-up over its reference's: 1.0 when the side effects
cost the shards nothing, 1/K-ish when the shards ran one after another.

  python benchmarks/concurrency.py                        # K = 2, 4, 8; whole shards
  python benchmarks/concurrency.py --per_sample --rows=512
  python benchmarks/concurrency.py --devices=4 --json=/tmp/concurrency.json

The CPU is split into max(K) logical devices before TensorFlow starts. Only
tfshard's public API is used, so any version of it can be measured
(``PYTHONPATH=../other-checkout``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags

_DEVICES = flags.DEFINE_list("devices", ["2", "4", "8"], "Device counts K to compare with one.")
_ROWS = flags.DEFINE_integer("rows", 4096, "Rows per call.")
_DEPTH = flags.DEFINE_integer("depth", 20, "matmul + tanh layers (and Keras MLP layers).")
_WIDTH = flags.DEFINE_integer("width", 256, "Feature size.")
_PER_SAMPLE = flags.DEFINE_bool("per_sample", False, "Map the function over samples.")
_KINDS = flags.DEFINE_list("kinds", [], "Kinds to time (default: all).")
_REPEATS = flags.DEFINE_integer("repeats", 9, "Timed rounds.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls of each method first.")
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")

# A kind's reference: the function without its side effect.
REFERENCE = {"keras_dropout": "keras_inference"}
KINDS = (
    "pure",
    "uniform",
    "generator",
    "nn_dropout",
    "print",
    "keras_inference",
    "keras_dropout",
)
# Kinds whose outputs equal the pure function's on one device (the others draw a mask).
EXACT = ("pure", "uniform", "generator", "print")


def functions(tf: Any, depth: int, width: int, per_sample: bool) -> dict[str, Callable]:
    """Each kind's function, for a whole shard [n, width] or one sample [width]."""
    import numpy as np

    rng = np.random.default_rng(0)
    weights = [
        tf.constant(rng.standard_normal([width, width]).astype(np.float32) / width**0.5)
        for _ in range(depth)
    ]
    generator = tf.random.Generator.from_seed(1)

    def pure(x):
        for w in weights:
            x = tf.tanh(tf.linalg.matvec(w, x, transpose_a=True) if per_sample else x @ w)
        return x

    def printing(x):
        tf.print("shard of", tf.shape(x), output_stream="file:///dev/null")
        return pure(x)

    layers = [tf.keras.Input([width])]
    for _ in range(depth):
        layers += [tf.keras.layers.Dense(width, activation="tanh"), tf.keras.layers.Dropout(0.1)]
    mlp = tf.keras.Sequential(layers)

    def keras(training: bool) -> Callable:
        if per_sample:
            return lambda x: mlp(x[tf.newaxis], training=training)[0]
        return lambda x: mlp(x, training=training)

    return {
        "pure": pure,
        "uniform": lambda x: pure(x) + 0 * tf.random.uniform(tf.shape(x)),
        "generator": lambda x: pure(x) + 0 * generator.uniform(tf.shape(x)),
        "nn_dropout": lambda x: pure(tf.nn.dropout(x, 0.1)),
        "print": printing,
        "keras_inference": keras(False),
        "keras_dropout": keras(True),
    }


def measure(
    counts: Sequence[int],
    *,
    rows: int,
    depth: int,
    width: int,
    per_sample: bool,
    kinds: Sequence[str] = KINDS,
    repeats: int,
    warmup: int,
) -> dict[str, Any]:
    """Speed-ups over one device of each kind on K devices, all rounds interleaved.

    The CPU must already be split into at least max(counts) logical devices.

    Returns:
      ``speedup[kind][K]`` and ``of_pure[kind][K]`` (the kind's speed-up over
      its reference's), the median times, and the other processes' load.
    """
    import _harness
    import tensorflow as tf

    import tfshard

    devices = tfshard.list_devices("CPU")
    kinds = list(kinds)
    for kind in kinds:
        reference = REFERENCE.get(kind, "pure")
        if reference not in kinds:
            kinds.insert(0, reference)
    made = functions(tf, depth, width, per_sample)
    methods = {}
    for kind in kinds:
        for k in (1, *counts):
            methods[(kind, k)] = tfshard.parallelize(
                made[kind], devices=devices[:k], per_sample=per_sample
            )
    x = _harness.random_inputs([rows, width], 1, 0, devices[0])
    for kind in EXACT:  # equal work, or the speed-ups compare nothing
        if kind in kinds:
            _harness.check_outputs(
                {f"{kind} K={k}": methods[(kind, k)] for k in (1, *counts)}, f"{kind} K=1", x[0]
            )
    named = {f"{kind} K={k}": f for (kind, k), f in methods.items()}
    with _harness.OtherLoad() as other:
        times = _harness.time_rounds(named, x, repeats=repeats, warmup=warmup)
    speedup: dict[str, dict[int, float]] = {}
    of_pure: dict[str, dict[int, float]] = {}
    for kind in kinds:
        one = times[f"{kind} K=1"]
        speedup[kind] = {k: _harness.paired_ratio(one, times[f"{kind} K={k}"]) for k in counts}
    for kind in kinds:
        reference = speedup[REFERENCE.get(kind, "pure")]
        of_pure[kind] = {k: speedup[kind][k] / reference[k] for k in counts}
    return {
        "speedup": speedup,
        "of_pure": of_pure,
        "median_ms": {name: _harness.median(t) * 1e3 for name, t in times.items()},
        "other_processes_cores": other.cores,
    }


def table(result: dict[str, Any], counts: Sequence[int]) -> str:
    """Speed-up over one device per kind and K, and that as a fraction of pure's."""
    import _harness

    header = ("function", *(f"K = {k}" for k in counts), *(f"of pure, K = {k}" for k in counts))
    rows = [
        (
            kind,
            *(f"{result['speedup'][kind][k]:.2f}x" for k in counts),
            *(f"{result['of_pure'][kind][k]:.2f}" for k in counts),
        )
        for kind in result["speedup"]
    ]
    return _harness.format_rows(header, rows)


def main(argv: list[str]) -> None:
    del argv
    import _harness

    counts = sorted(int(k) for k in _DEVICES.value)
    devices = _harness.setup_devices(max(counts))
    result = measure(
        counts,
        rows=_ROWS.value,
        depth=_DEPTH.value,
        width=_WIDTH.value,
        per_sample=_PER_SAMPLE.value,
        kinds=_KINDS.value or KINDS,
        repeats=_REPEATS.value,
        warmup=_WARMUP.value,
    )
    mode = "per sample" if _PER_SAMPLE.value else "whole shard"
    print(
        f"{_DEPTH.value} x ([{_ROWS.value}, {_WIDTH.value}] x [{_WIDTH.value}, {_WIDTH.value}] "
        f"+ tanh), {mode}; speed-up over one device (median of {_REPEATS.value} paired "
        f"rounds), {_harness.cores()} cores, other processes kept "
        f"{result['other_processes_cores']} cores busy:"
    )
    print(table(result, counts))
    report = {"environment": _harness.environment(devices), "counts": counts, **result}
    print(json.dumps({k: report[k] for k in ("counts", "speedup", "of_pure")}))
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    app.run(main)
