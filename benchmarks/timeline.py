r"""A timeline records the call ``f(x)`` makes: its total against ``f(x)``'s own time.

``f.timeline(x)`` runs the call once under TensorFlow's profiler and reads the
record; its ``total_ms`` (the call's first op to its last) should be the call's
own time, not a replay's. Each case times ``f(x)`` (warm, wall clock, the call
returns when its ops are done) and the total of ``f.timeline(x)``, alternately,
``--repeats`` times in one process, and prints the medians, their ratio (the
target is at most 1.2) and the tensors the record's copies counted:

  python benchmarks/timeline.py              # the table, and --json=FILE for the numbers
  PYTHONPATH=../other-checkout python benchmarks/timeline.py   # another version of tfshard

The bed: the CPU split into 4 logical devices (`_harness.setup_devices`), a
stack of ``--layers`` tanh layers of ``--width`` on ``--rows`` rows, whole
shards at a time. Cases: four shards with the input on ``CPU:0`` (the host)
and the output there; two shards on ``CPU:1`` and ``CPU:2`` with the input
living on ``CPU:1`` and the output landing there.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

_ROWS = flags.DEFINE_integer("rows", 4096, "Rows per call.", allow_override=True)
_WIDTH = flags.DEFINE_integer("width", 256, "Features per row.", allow_override=True)
_LAYERS = flags.DEFINE_integer("layers", 20, "Tanh layers of the function.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed calls and timelines per case.", lower_bound=1)
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.", allow_override=True)


def setup(count: int = 4) -> list[str]:
    """The CPU bed: `count` logical CPU devices (before TensorFlow starts)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _harness

    return _harness.setup_devices(count)


def layers_fn(tf: Any, layers: int, width: int, seed: int = 0) -> Any:
    """A stack of `layers` tanh layers of `width`, for a block of rows."""
    import numpy as np

    rng = np.random.default_rng(seed)
    weights = [
        tf.constant((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32))
        for _ in range(layers)
    ]

    def stack(x):  # [B, width] -> [B, width]
        for w in weights:
            x = tf.tanh(x @ w)
        return x

    return stack


def measure(f: Any, x: Any, repeats: int) -> dict[str, Any]:
    """Median wall time of ``f(x)`` and median total of ``f.timeline(x)``, alternated."""
    f(x)  # traced
    f(x)  # warm
    calls, totals, recorded = [], [], []
    timeline = None
    for _ in range(repeats):
        start = time.perf_counter()
        f(x)
        calls.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        timeline = f.timeline(x)
        recorded.append((time.perf_counter() - start) * 1e3)
        totals.append(timeline.total_ms)
    call_ms, total_ms = statistics.median(calls), statistics.median(totals)
    return {
        "call_ms": call_ms,
        "timeline_total_ms": total_ms,
        "ratio": total_ms / call_ms,
        "timeline_wall_ms": statistics.median(recorded),
        # (getattr: a version of tfshard before tensors were counted can be measured too)
        "copies": {
            c.device: [getattr(c, "tensors_in", None), getattr(c, "tensors_out", None)]
            for c in timeline.copies
        },
    }


def cases(rows: int, width: int, layers: int, repeats: int) -> list[dict[str, Any]]:
    """Every case's numbers (see the module docstring)."""
    import numpy as np
    import tensorflow as tf

    import tfshard

    x = np.random.default_rng(1).standard_normal((rows, width), dtype=np.float32)
    fn = layers_fn(tf, layers, width)
    results = []
    for case, devices, where in (
        ("4 shards, input on the host", ["cpu:0", "cpu:1", "cpu:2", "cpu:3"], "/cpu:0"),
        ("2 shards, input on CPU:1", ["cpu:1", "cpu:2"], "/cpu:1"),
    ):
        f = tfshard.parallelize(fn, devices=devices, per_sample=False, output_device=devices[0])
        with tf.device(where):
            tensor = tf.constant(x)
        results.append({"case": case, **measure(f, tensor, repeats)})
    return results


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"  {'case':<30}  {'f(x) ms':>8}  {'timeline total ms':>17}  {'ratio':>5}  "
        f"{'timeline() wall ms':>18}  copies (tensors in, out)"
    ]
    for r in results:
        copies = ", ".join(f"{d.rsplit('/', 1)[-1]} {i}/{o}" for d, (i, o) in r["copies"].items())
        lines.append(
            f"  {r['case']:<30}  {r['call_ms']:>8.2f}  {r['timeline_total_ms']:>17.2f}  "
            f"{r['ratio']:>5.2f}  {r['timeline_wall_ms']:>18.2f}  {copies}"
        )
    lines.append("  target: ratio <= 1.2 (the record is the call, not a replay)")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the profiler logs each session
    setup(4)
    results = cases(_ROWS.value, _WIDTH.value, _LAYERS.value, _REPEATS.value)
    print(table(results))
    print(json.dumps(results))
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
