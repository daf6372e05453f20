r"""The host's work per call: what tfshard's call path costs beside the graph it runs.

On a GPU a call returns once its kernels are queued, so whatever the host
does per call (Python in the call path, a lock, a read of a tensor) is what a
small call costs beyond the device's work. The CPU bed shows that cost as
time per call of a function too small to hide it, in one process, rounds
interleaved (`_harness.time_rounds`), and exactly as the Python function
calls a call makes (cProfile's count, the same on any machine).

Two cases, on 2 logical CPU devices (one intra-op thread each):

``dropped``: ``weights="auto"`` after it found the second device useless (its
shard sleeps ``--sleep_ms`` per call, in a `tf.py_function`: far over 50x
slower per row), so the first holds every row; against the same function on
the first device alone (tfshard, one device), static ``weights=[1, 0]``, and
a plain `tf.function` of the function (without its sleep) on the first
device. The promise: the settled call with a dropped device costs what the
device alone costs.

``settled``: ``weights="auto"`` on two alike devices, settled (whatever it
settled on: a split, or one device alone where the split does not pay), its
measured calls (one in 25 at first, ever fewer down to one in 200) among those
timed, against static weights equal to the ones it settled on; ``--settled_rows`` rows (512) of
``--settled_width`` (64), so that its shards are long enough to time. The promise: within 5 %.

``small_batch``: an even 2-device call of ``--rows`` rows (8 by default)
against the hand-written ``tf.device`` + ``tf.split`` + ``tf.concat`` graph
(`cases.hand_graph`), called as a user calls it (a `tf.function`) and as its
concrete function (no tf.function dispatch: the graph alone); and the graph
tfshard runs (`ShardedFunction.get_concrete_function`) called as it is, so
that tfshard's time splits into its Python (tfshard over tfshard_graph) and
its graph (tfshard_graph over hand_concrete). Each graph's ops are counted.

``one_device``: the same function on one device, tfshard (``alone``, and its
graph called as it is) against a plain `tf.function` of it there, called as a
user calls it and as its concrete function. The promise: one device costs what
a `tf.function` costs.

``--ops`` prints each graph's ops by name scope (``tfshard_shard_k``,
``tfshard_collect``, ``tfshard_rows``, ``tfshard_position``; the plan at the
top), to see what each part of a call adds.

  python benchmarks/call_overhead.py                     # every case
  python benchmarks/call_overhead.py --case=dropped --profile=12
  python benchmarks/call_overhead.py --case=one_device --case=small_batch --ops

Only tfshard's public API is used, so another version of it can be measured
the same way (``PYTHONPATH=../other-checkout``).
"""

from __future__ import annotations

import cProfile
import json
import pstats
import re
import time
from collections.abc import Callable
from typing import Any

from absl import app, flags

CASES = ("dropped", "settled", "small_batch", "one_device")
_CASE = flags.DEFINE_multi_enum("case", list(CASES), list(CASES), "Cases to run.")
_ROWS = flags.DEFINE_integer("rows", 8, "Rows per call.")
_WIDTH = flags.DEFINE_integer("width", 16, "Feature size of the function's matmul + tanh.")
_PER_SAMPLE = flags.DEFINE_bool(
    "per_sample", False, "Map the function over rows (its graph then differs by rows)."
)
_SLEEP_MS = flags.DEFINE_float("sleep_ms", 10.0, "dropped: the slow shard's sleep per call.")
_SETTLING = flags.DEFINE_integer(
    "settling", 4000, "settled: at most this many calls until the weights held over 800."
)
_SETTLED_ROWS = flags.DEFINE_integer(
    "settled_rows", 512, "settled: rows per call (its shards long enough to time)."
)
_SETTLED_WIDTH = flags.DEFINE_integer("settled_width", 64, "settled: the feature size.")
_CALLS = flags.DEFINE_integer("calls", 200, "Calls per timed sample (their mean).")
_REPEATS = flags.DEFINE_integer("repeats", 21, "Timed rounds (the median's sample size).")
_PROFILED = flags.DEFINE_integer("profiled", 2000, "Calls of each method under cProfile.")
_PROFILE = flags.DEFINE_integer(
    "profile", 0, "Print this many of each method's functions by own time (0: none)."
)
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.")
_OPS = flags.DEFINE_bool("ops", False, "Print each graph's ops, grouped by name scope.")


def chain(tf: Any, tfshard: Any, width: int, sleep_s: float) -> Callable[[Any], Any]:
    """``tanh(x @ w)``, whose shards other than the first also sleep `sleep_s` (0: none)."""
    import numpy as np

    w = tf.constant(np.random.default_rng(0).standard_normal([width, width]).astype("float32"))

    def nap() -> float:
        time.sleep(sleep_s)
        return 0.0

    def fn(x: Any) -> Any:
        y = tf.tanh(tf.linalg.matvec(w, x, transpose_a=True) if x.shape.rank == 1 else x @ w)
        if not sleep_s:
            return y
        slept = tf.cond(
            tfshard.shard_index() > 0,
            lambda: tf.py_function(nap, [], tf.float32),
            lambda: tf.constant(0.0),
        )
        return y + 0.0 * slept

    return fn


def vectorized(tf: Any, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`fn` of one row, mapped over the rows as tfshard maps it."""
    return lambda x: tf.vectorized_map(fn, x, fallback_to_while_loop=True)


def calls_per_call(method: Callable[[Any], Any], x: Any, calls: int) -> tuple[float, Any]:
    """The Python function calls one call of `method` makes (cProfile), and the stats."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        method(x)
    profile.disable()
    stats = pstats.Stats(profile)
    return stats.total_calls / calls, stats


def top(stats: Any, count: int, calls: int) -> list[str]:
    """The `count` functions of most own time, as lines: us per call, calls per call."""
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:count]
    return [
        f"      {tt / calls * 1e6:7.2f} us {nc / calls:5.1f}x  {_where(func)}"
        for func, (_, nc, tt, _, _) in rows
    ]


def _where(func: tuple[str, int, str]) -> str:
    path, line, name = func
    short = re.sub(r".*/(site-packages|lib/python[\d.]+)/", "", path)
    return f"{short}:{line}({name})"


def graph_nodes(method: Any, x: Any) -> list[Any] | None:
    """The nodes of the graph a call of `method` runs (its functions' bodies included)."""
    graph = getattr(method, "graph", None)
    if graph is None and hasattr(method, "get_concrete_function"):
        graph = method.get_concrete_function(x).graph
    if graph is None:
        return None
    definition = graph.as_graph_def()
    return [*definition.node, *(n for f in definition.library.function for n in f.node_def)]


def graph_ops(method: Any, x: Any) -> int | None:
    """The number of ops of the graph a call of `method` runs."""
    nodes = graph_nodes(method, x)
    return None if nodes is None else len(nodes)


def ops_by_scope(method: Any, x: Any) -> list[str]:
    """Lines: each top name scope of the graph's ops, their count and types."""
    nodes = graph_nodes(method, x)
    if nodes is None:
        return []
    scopes: dict[str, list[str]] = {}
    for node in nodes:
        scope = node.name.split("/")[0] if "/" in node.name else "(top)"
        scopes.setdefault(scope, []).append(node.op)
    return [
        f"      {len(types):3d} {scope}: {', '.join(sorted(types))}"
        for scope, types in scopes.items()
    ]


def measure(harness: Any, methods: dict[str, Callable[[Any], Any]], x: Any) -> dict[str, Any]:
    """Times the methods in interleaved rounds and counts their Python calls."""
    errors = harness.check_outputs(methods, next(iter(methods)), x)
    times = harness.time_rounds(
        methods, [x], repeats=_REPEATS.value, warmup=20, inner=_CALLS.value
    )
    result: dict[str, Any] = {"methods": {}}
    for name, method in methods.items():
        count, stats = calls_per_call(method, x, _PROFILED.value)
        result["methods"][name] = {
            "median_us": harness.median(times[name]) * 1e6,
            "python_calls_per_call": count,
            "graph_ops": graph_ops(method, x),
            "ops_by_scope": ops_by_scope(method, x),
            "relative_error": errors[name],
            "top": top(stats, _PROFILE.value, _PROFILED.value),
        }
    result["ratios"] = {
        f"{a}/{b}": harness.paired_ratio(times[a], times[b])
        for a in methods
        for b in methods
        if a != b
    }
    return result


def print_case(name: str, result: dict[str, Any], ratios: list[str]) -> None:
    print(f"== {name}: {result['description']}")
    print(f"   {'method':<14}{'median us':>10}{'py calls':>10}{'graph ops':>10}")
    for method, m in result["methods"].items():
        ops = "-" if m["graph_ops"] is None else m["graph_ops"]
        print(
            f"   {method:<14}{m['median_us']:10.1f}{m['python_calls_per_call']:10.1f}{ops:>10}"
        )
    for ratio in ratios:
        print(f"   {ratio:<28} {result['ratios'][ratio]:.3f}x (median of per-round ratios)")
    for method, m in result["methods"].items():
        if _OPS.value and m["ops_by_scope"]:
            print(f"   {method}: graph ops by name scope")
            print("\n".join(m["ops_by_scope"]))
        if m["top"]:
            print(f"   {method}: own time per call under cProfile")
            print("\n".join(m["top"]))
    print(flush=True)


def dropped_case(tf: Any, tfshard: Any, harness: Any, devices: list[str]) -> dict[str, Any]:
    fn = chain(tf, tfshard, _WIDTH.value, _SLEEP_MS.value / 1e3)
    x = harness.random_inputs([_ROWS.value, _WIDTH.value], 1, 1, devices[0])[0]
    per_sample = _PER_SAMPLE.value
    auto = tfshard.parallelize(fn, devices=devices, per_sample=per_sample, weights="auto")
    calls = 0
    while auto.weights is None or auto.weights[1] != 0:
        if calls == 500:
            raise SystemExit(f"weights='auto' kept the slow device: {auto.weights}")
        auto(x)
        calls += 1
    plain = chain(tf, tfshard, _WIDTH.value, 0.0)  # without the slow shards' branch
    if per_sample:
        plain = vectorized(tf, plain)
    with tf.device(devices[0]):
        plain = tf.function(plain).get_concrete_function(x)
    methods = {
        "alone": tfshard.parallelize(fn, devices=devices[:1], per_sample=per_sample),
        "auto": auto,
        "static_1_0": tfshard.parallelize(
            fn, devices=devices, per_sample=per_sample, weights=[1, 0]
        ),
        "tf_function": plain,
    }
    explained = auto.explain(x).splitlines()[1].strip()
    result = measure(harness, methods, x)
    result.update(
        description=f"weights='auto' with the second device dropped after {calls} calls "
        f"({explained}); {_ROWS.value} rows x {_WIDTH.value}",
        dropped_after_calls=calls,
    )
    return result


def settled_case(tf: Any, tfshard: Any, harness: Any, devices: list[str]) -> dict[str, Any]:
    rows, width = _SETTLED_ROWS.value, _SETTLED_WIDTH.value
    fn = chain(tf, tfshard, width, 0.0)
    x = harness.random_inputs([rows, width], 1, 1, devices[0])[0]
    per_sample = _PER_SAMPLE.value
    auto = tfshard.parallelize(fn, devices=devices, per_sample=per_sample, weights="auto")
    calls = held = 0
    while calls < _SETTLING.value and held < 800:
        before = auto.weights
        auto(x)
        calls += 1
        held = held + 1 if auto.weights == before else 0
    weights = None if auto.weights is None else list(auto.weights)
    methods = {
        "auto": auto,
        "static_same": tfshard.parallelize(
            fn, devices=devices, per_sample=per_sample, weights=weights
        ),
    }
    explained = auto.explain(x).splitlines()[1].strip()
    result = measure(harness, methods, x)
    result["description"] = (
        f"weights='auto' after {calls} calls ({explained}), against static "
        f"weights={weights}; {rows} rows x {width}; weights after timing: "
        f"{auto.weights}"
    )
    return result


def small_batch_case(tf: Any, tfshard: Any, harness: Any, devices: list[str]) -> dict[str, Any]:
    import cases

    fn = chain(tf, tfshard, _WIDTH.value, 0.0)
    x = harness.random_inputs([_ROWS.value, _WIDTH.value], 1, 1, devices[0])[0]
    hand = cases.hand_graph(fn, devices)
    f = tfshard.parallelize(fn, devices=devices, per_sample=False)
    methods = {
        "tfshard": f,
        "tfshard_graph": f.get_concrete_function(x),
        "hand_graph": hand,
        "hand_concrete": hand.get_concrete_function(x),
    }
    result = measure(harness, methods, x)
    result["description"] = f"an even call on 2 devices, {_ROWS.value} rows x {_WIDTH.value}"
    return result


def one_device_case(tf: Any, tfshard: Any, harness: Any, devices: list[str]) -> dict[str, Any]:
    fn = chain(tf, tfshard, _WIDTH.value, 0.0)
    x = harness.random_inputs([_ROWS.value, _WIDTH.value], 1, 1, devices[0])[0]
    per_sample = _PER_SAMPLE.value
    alone = tfshard.parallelize(fn, devices=devices[:1], per_sample=per_sample)
    with tf.device(devices[0]):
        plain = tf.function(vectorized(tf, fn) if per_sample else fn)
        plain_concrete = plain.get_concrete_function(x)
    methods = {
        "alone": alone,
        "alone_graph": alone.get_concrete_function(x),
        "tf_function": plain,
        "tf_concrete": plain_concrete,
    }
    result = measure(harness, methods, x)
    result["description"] = (
        f"one device, {_ROWS.value} rows x {_WIDTH.value}"
        f"{', per sample' if per_sample else ''}: tfshard against a plain tf.function"
    )
    return result


def main(argv: list[str]) -> None:
    del argv
    import _harness

    devices = _harness.setup_devices(2)
    import tensorflow as tf

    import tfshard

    tf.get_logger().setLevel("ERROR")
    report = {"environment": _harness.environment(devices), "cases": {}}
    print(f"tfshard from {tfshard.__file__}; load {report['environment']['load_average_start']}")
    for name in dict.fromkeys(_CASE.value):
        if name == "dropped":
            result = dropped_case(tf, tfshard, _harness, devices)
            shown = ["auto/alone", "auto/static_1_0", "static_1_0/alone", "alone/tf_function"]
        elif name == "settled":
            result = settled_case(tf, tfshard, _harness, devices)
            shown = ["auto/static_same"]
        elif name == "one_device":
            result = one_device_case(tf, tfshard, _harness, devices)
            shown = [
                "alone/tf_function",
                "alone_graph/tf_concrete",
                "alone/alone_graph",
                "tf_function/tf_concrete",
            ]
        else:
            result = small_batch_case(tf, tfshard, _harness, devices)
            shown = [
                "tfshard/hand_graph",
                "tfshard/tfshard_graph",
                "tfshard_graph/hand_concrete",
                "hand_graph/hand_concrete",
            ]
        report["cases"][name] = result
        print_case(name, result, shown)
    if _JSON.value:
        with open(_JSON.value, "w") as out:
            json.dump(report, out, indent=1)
        print(f"wrote {_JSON.value}")


if __name__ == "__main__":
    app.run(main)
