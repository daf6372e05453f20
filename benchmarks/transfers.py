r"""What crosses devices in one call: TensorFlow's partition graphs, counted exactly.

On a GPU every edge between the host and a device is a copy, and one towards the
host a wait; on the CPU bed they cost next to nothing, so a clock cannot see them,
but TensorFlow's partition graphs of one call show each one. This script runs one
call of each case in a `tf.compat.v1.Session` (``RunOptions(output_partition_graphs=True)``,
a full trace for the bytes) and counts the ``_Send``/``_Recv``/``_HostSend``/``_HostRecv``
nodes of its partition graphs and the bytes they moved, beside the same call
of the reference a user has without tfshard:

  python benchmarks/transfers.py              # the table, and --json=FILE for the numbers

The bed: the CPU split into logical devices (`_harness.setup_devices`), the shards
on ``CPU:1``.., the input a tensor on ``CPU:1`` and the output landing there,
``CPU:0`` standing for the host. A call's graph is the concrete function the
call runs (`ShardedFunction.get_concrete_function`), called in the session on
inputs of exactly its signature's shapes (rows open where the graph's are: the
input is a variable whose static shape leaves its rows open, so the optimizer
cannot read them through the ``placeholder_with_default`` either), so
TensorFlow's optimizer sees what it sees in an eager call. The fetch of the
result counts 2 (a send and a receive to the session's client) in every row
alike. ``per_shard`` has no public concrete function: its case calls
``f.per_shard`` inside the session's graph, as graph-mode code does, beside the
hand-written list written into that graph (no `tf.function` around it: a
function's outputs land on its caller's device, and each result is to stay on
its shard's, as ``per_shard`` gives them); the case of a call inside a user's
`tf.function` (rows unknown: every shard guarded against having none) calls
tfshard and a hand-written `tf.function` the same way.

Cases: one device against a plain `tf.function` on it; two devices against a
hand-written ``tf.device`` + ``tf.split`` + ``tf.concat`` graph; ``weights="auto"``
after it settled against the same static split; weights ``[1, 0]`` (a device that
gets no rows) against the one device alone; then per sample, a reduction, a call
inside a `tf.function` and ``per_shard``; then replicas: the matrix a variable made in
``f.replicas()`` (in the counted graph), an eager call's graph and a call inside a
`tf.function`, against the hand-written graph with one copy of the variable made on each
device, each device's body reading its own (the copies `tf.distribute.MirroredStrategy`
holds and its replicas read, without its per-replica machinery). The target of each
row is the reference's count (``≤``), but the guarded call with replicas': its
shard's cond reads a variable, so it is a stateful cond, which the function's
control outputs wait for: a control token from shard 1's device to the caller's
(2 more, no bytes; the hand-written graph has no cond).
"""

from __future__ import annotations

import collections
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

# allow_override: the benchmarks are imported into one process by the tests, and other
# scripts name flags alike (unequal.py's width and auto_calls).
_ROWS = flags.DEFINE_integer("rows", 8, "Rows per call.", allow_override=True)
_WIDTH = flags.DEFINE_integer(
    "width", 4, "Features per row (the matmul's width).", allow_override=True
)
_AUTO_CALLS = flags.DEFINE_integer(
    "auto_calls", 12, "Calls weights='auto' measures first.", allow_override=True
)
_EDGES = flags.DEFINE_bool(
    "edges", False, "Print each case's cross-device edges too.", allow_override=True
)
_JSON = flags.DEFINE_string("json", None, "Write the numbers here.", allow_override=True)

TRANSFER_OPS = ("_Send", "_Recv", "_HostSend", "_HostRecv")
RECEIVES = ("_Recv", "_HostRecv")


def setup(count: int = 4) -> list[str]:
    """The CPU bed: `count` logical CPU devices (before TensorFlow starts)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _harness

    return _harness.setup_devices(count)


# ------------------------------------------------------------------ counting


def count_partitions(build: Callable[[], Any]) -> dict[str, Any]:
    """The transfers and bytes of one run of the graph `build` makes, from its partitions.

    Args:
      build: called inside a fresh `tf.Graph`; returns the tensors to fetch, and may
        leave variables to initialize (they are, in a run of their own first).

    Returns:
      ``transfers`` (sends and receives, each counted), ``bytes`` (what the sends
      sent), ``by_op`` (each op's count) and ``edges`` (``sender -> receiver: tensor``).
    """
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        fetches = tf.nest.flatten(build(), expand_composites=True)
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto()
    config.device_count["CPU"] = len(tf.config.list_logical_devices("CPU"))
    options = tf.compat.v1.RunOptions(
        output_partition_graphs=True, trace_level=tf.compat.v1.RunOptions.FULL_TRACE
    )
    metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        session.run(fetches, options=options, run_metadata=metadata)
    by_op: collections.Counter[str] = collections.Counter()
    edges, sent = [], []
    for partition in metadata.partition_graphs:
        for node in partition.node:
            if node.op not in TRANSFER_OPS:
                continue
            by_op[node.op] += 1
            if node.op in RECEIVES:
                sender = node.attr["send_device"].s.decode().rsplit("/", 1)[-1]
                receiver = node.attr["recv_device"].s.decode().rsplit("/", 1)[-1]
                edges.append(f"{sender} -> {receiver}: {node.attr['tensor_name'].s.decode()}")
            else:
                sent.append(node.input[0])
    return {
        "transfers": sum(by_op.values()),
        "bytes": _sent_bytes(metadata, sent),
        "by_op": dict(by_op),
        "edges": sorted(edges),
    }


def _sent_bytes(metadata: Any, sent: Sequence[str]) -> int:
    """The bytes of the tensors the sends sent (``op:index`` each), from the run's step stats.

    The step stats hold every op's outputs as they ran (shape and dtype), not the
    sends and receives themselves: a sent tensor is its producer's output. A
    tensor whose producer the stats do not hold counts 0.
    """
    import tensorflow as tf

    outputs = {}
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            for output in node.output:
                outputs[f"{node.node_name}:{output.slot}"] = output.tensor_description
    total = 0
    for name in sent:
        name = name.lstrip("^")
        description = outputs.get(name if ":" in name else f"{name}:0")
        if description is None:
            continue
        dtype = tf.dtypes.as_dtype(description.dtype)
        elements = 1
        for dim in description.shape.dim:
            elements *= max(dim.size, 0)
        total += elements * (dtype.size if dtype.is_numpy_compatible else 0)
    return total


def call_graph(concrete: Any, values: Sequence[Any], devices: Sequence[str], host: str) -> Any:
    """A builder (`count_partitions`) of one call of `concrete` on `values`.

    Each value becomes a variable on its device, read through a
    ``placeholder_with_default`` of the signature's shape, so the optimizer knows
    no more of its rows than the concrete function's signature says (as in an
    eager call); int64 values (``weights="auto"``'s fed weights) live on `host`.
    The call runs under the first value's device, where its outputs land.
    """
    import tensorflow as tf

    specs = [t for t in concrete.inputs if t.dtype != tf.resource][: len(values)]

    def build() -> Any:
        inputs = []
        for value, device, spec in zip(values, devices, specs):
            with tf.device(device):
                variable = _open_rows_variable(value)
                inputs.append(tf.compat.v1.placeholder_with_default(variable, spec.shape))
        with tf.device(devices[0]):
            return concrete(*inputs)

    del host
    return build


def _open_rows_variable(value: Any) -> Any:
    """A variable holding `value` whose rows its static shape leaves open.

    Grappler infers shapes through a ``placeholder_with_default`` from its
    default: a variable of static shape would give it the rows that an eager
    call's optimizer never sees (the function's signature has them open), and
    it would fold shapes and sizes into constants that wait on control edges.
    """
    import numpy as np
    import tensorflow as tf

    shape = np.shape(value)
    return tf.Variable(value, trainable=False, shape=tf.TensorShape([None, *shape[1:]]))


def graph_mode(call: Callable[[Any], Any], value: Any, device: str) -> Any:
    """A builder of `call` on `value` (a variable on `device`) inside the session's graph."""
    import tensorflow as tf

    def build() -> Any:
        with tf.device(device):
            x = _open_rows_variable(value).read_value()
            return call(x)

    return build


# ------------------------------------------------------------------ the functions


def batch_fn(tf: Any, width: int) -> Callable[[Any], Any]:
    """The small function: one matmul and a tanh on a block of rows (per_sample=False)."""

    def small(x):
        w = tf.fill([width, width], 1.0 / width)
        return tf.tanh(tf.matmul(x, w))

    return small


def sample_fn(tf: Any, width: int) -> Callable[[Any], Any]:
    """The same for one sample (per_sample=True)."""

    def small(sample):
        w = tf.fill([width, width], 1.0 / width)
        return tf.tanh(tf.linalg.matvec(w, sample, transpose_a=True))

    return small


def matmul_fn(tf: Any, kernel: Sequence[Any]) -> Callable[[Any], Any]:
    """The small function with its matrix a variable, ``kernel[0]`` (made later, in the
    graph that is counted: a list the builder fills)."""

    def dense(x):
        return tf.tanh(tf.matmul(x, kernel[0]))

    return dense


def hand_written(
    tf: Any,
    body: Callable[[Any], Any] | Sequence[Callable[[Any], Any]],
    devices: Sequence[str],
    output: str,
    weights: Sequence[int] | None = None,
    combine: str = "concat",
) -> Any:
    """The graph a user writes by hand: split where the input is, a body per device, concat.

    Sizes come from the input's shape on the output device (largest-remainder
    rounding of `weights`, or even); `body` is one function for every device, or
    one per device (each reading its device's copy of a variable); `combine` is
    "concat", "sum" (each shard sums its rows, the sums are added on the output
    device) or "list" (each shard's own).
    """
    k = len(devices)
    w = [1] * k if weights is None else list(weights)
    bodies = list(body) if isinstance(body, Sequence) else [body] * k

    def graph(x):
        with tf.device(output):
            n = tf.shape(x, out_type=tf.int64)[0]
            base = [n * wi // sum(w) for wi in w]
            left = n - tf.add_n(base)
            sizes = [b + tf.cast(i < left, tf.int64) for i, b in enumerate(base)]
            pieces = tf.split(x, tf.stack(sizes), num=k)
        outs = []
        for device, piece, each in zip(devices, pieces, bodies):
            with tf.device(device):
                y = each(piece)
                outs.append(tf.reduce_sum(y, 0) if combine == "sum" else y)
        if combine == "list":
            return outs
        with tf.device(output):
            return tf.add_n(outs) if combine == "sum" else tf.concat(outs, 0)

    return graph


# ------------------------------------------------------------------ the cases


def cases(devices: Sequence[str], rows: int, width: int, auto_calls: int) -> list[dict[str, Any]]:
    """Every case's counts beside its reference's (see the module docstring).

    Args:
      devices: the bed's devices; ``devices[0]`` stands for the host, the shards run
        on ``devices[1]`` and ``devices[2]``.
      rows: rows per call.
      width: features per row.
      auto_calls: calls ``weights="auto"`` measures before it is counted.
    """
    import numpy as np
    import tensorflow as tf

    import tfshard

    host, one, two = devices[0], devices[1], devices[2]
    pair = [one, two]
    value = np.random.default_rng(0).standard_normal([rows, width]).astype(np.float32)
    with tf.device(one):
        x = tf.constant(value)
    small, per_sample = batch_fn(tf, width), sample_fn(tf, width)
    open_rows = tf.TensorSpec([None, width], tf.float32)

    def plain(fn: Callable[[Any], Any]) -> Any:
        return tf.function(fn).get_concrete_function(open_rows)

    def sharded(f: Any, *calls_first: Any) -> Any:
        """f's graph for `x`, after the calls that settle it (a first size, auto's measures)."""
        for call in calls_first:
            f(call)
        return f.get_concrete_function(x)

    def counted(concrete: Any, fed: Sequence[Any] = ()) -> dict[str, Any]:
        values = [value, *fed]
        where = [one] + [host] * len(fed)
        return count_partitions(call_graph(concrete, values, where, host))

    def auto_feed(f: Any, concrete: Any) -> list[Any]:
        """The weights an auto call feeds (one per device in its graph), on the host."""
        specs = [t for t in concrete.inputs if t.dtype != tf.resource]
        if len(specs) < 2:
            return []
        count = specs[1].shape[0]
        weights = f.weights or (1,) * len(f.devices)
        kept = [w for w in weights if w > 0] if count < len(weights) else list(weights)
        scale = min(kept)
        return [np.array([round(w / scale * 100) for w in kept], np.int64)]

    results = []

    def add(case: str, what: str, ours: dict[str, Any], reference: str, ref: dict[str, Any]):
        results.append(
            {"case": case, "tfshard": what, "reference": reference,
             "transfers": ours["transfers"], "bytes": ours["bytes"],
             "reference_transfers": ref["transfers"], "reference_bytes": ref["bytes"],
             "edges": ours["edges"], "reference_edges": ref["edges"]}
        )  # fmt: skip

    batch_ref = counted(plain(small))
    alone = tfshard.parallelize(small, devices=[one], per_sample=False)
    alone_counts = counted(sharded(alone, x[:1]))
    add("one device", "per_sample=False", alone_counts, "tf.function", batch_ref)

    even = tfshard.parallelize(small, devices=pair, per_sample=False)
    hand = counted(plain(hand_written(tf, small, pair, one)))
    add("two devices", "per_sample=False", counted(sharded(even, x[:1])), "hand-written", hand)

    auto = tfshard.parallelize(small, devices=pair, per_sample=False, weights="auto")
    auto_graph = sharded(auto, *([x] * auto_calls))
    settled = auto.weights
    static_weights = None if settled is None else [round(w * 100) for w in settled]
    static = tfshard.parallelize(small, devices=pair, per_sample=False, weights=static_weights)
    add(
        "two devices, auto settled", f"weights={settled}",
        counted(auto_graph, auto_feed(auto, auto_graph)),
        f"static weights={settled}", counted(sharded(static, x[:1])),
    )  # fmt: skip

    dropped = tfshard.parallelize(small, devices=pair, per_sample=False, weights=[1, 0])
    add(
        "weights [1, 0]", "per_sample=False", counted(sharded(dropped, x[:1])),
        "tfshard on the device alone", alone_counts,
    )  # fmt: skip

    def mapped(b: Any) -> Any:
        return tf.vectorized_map(per_sample, b)

    vmapped = counted(plain(mapped))
    for size, first in (("first size", ()), ("any size", (x[:1],))):
        each = tfshard.parallelize(per_sample, devices=[one])
        add("one device, per sample", size, counted(sharded(each, *first)), "tf.function", vmapped)
    hand_each = counted(plain(hand_written(tf, mapped, pair, one)))
    for size, first in (("first size", ()), ("any size", (x[:1],))):
        each = tfshard.parallelize(per_sample, devices=pair)
        ours = counted(sharded(each, *first))
        add("two devices, per sample", size, ours, "hand-written", hand_each)

    summed = tfshard.parallelize(per_sample, devices=pair, reduce="sum")
    hand_sum = counted(plain(hand_written(tf, mapped, pair, one, combine="sum")))
    ours = counted(sharded(summed, x[:1]))
    add("two devices, reduce='sum'", "any size", ours, "hand-written", hand_sum)

    inside = tfshard.parallelize(small, devices=pair, per_sample=False)
    hand_inside = tf.function(hand_written(tf, small, pair, one))
    add(
        "two devices, in a tf.function", "rows unknown: guarded",
        count_partitions(graph_mode(inside, value, one)),
        "hand-written", count_partitions(graph_mode(hand_inside, value, one)),
    )  # fmt: skip

    shards = tfshard.parallelize(small, devices=pair, per_sample=False)
    hand_list = hand_written(tf, small, pair, one, combine="list")  # in the caller's graph
    add(
        "two devices, per_shard", "graph mode",
        count_partitions(graph_mode(lambda t: list(shards.per_shard(t)), value, one)),
        "hand-written, in place", count_partitions(graph_mode(hand_list, value, one)),
    )  # fmt: skip
    dropped_shards = tfshard.parallelize(small, devices=pair, per_sample=False, weights=[1, 0])
    add(
        "weights [1, 0], per_shard", "graph mode",
        count_partitions(graph_mode(lambda t: dropped_shards.per_shard(t)[0], value, one)),
        "tf.function", count_partitions(graph_mode(tf.function(small), value, one)),
    )  # fmt: skip

    # Replicas: the matrix a variable with a copy on each device, made in the counted graph.
    matrix = np.random.default_rng(1).standard_normal([width, width]).astype(np.float32)

    def replicated(guarded: bool) -> Callable[[], Any]:
        kernel: list[Any] = []
        f = tfshard.parallelize(matmul_fn(tf, kernel), devices=pair, per_sample=False)

        def build() -> Any:
            with f.replicas():
                kernel[:] = [tf.Variable(matrix)]
            if guarded:
                return graph_mode(f, value, one)()
            with tf.device(one):  # the graph an eager call of these rows runs
                concrete = f.get_concrete_function(tf.zeros(value.shape))
            return call_graph(concrete, [value], [one], host)()

        return build

    def copies(guarded: bool) -> Callable[[], Any]:
        def build() -> Any:
            bodies = []
            for device in pair:
                with tf.device(device):
                    bodies.append(matmul_fn(tf, [tf.Variable(matrix)]))
            hand = tf.function(hand_written(tf, bodies, pair, one))
            if guarded:
                return graph_mode(hand, value, one)()
            return call_graph(hand.get_concrete_function(open_rows), [value], [one], host)()

        return build

    add(
        "two devices, replicas", "tf.Variable matmul", count_partitions(replicated(False)),
        "hand-written, copy per device", count_partitions(copies(False)),
    )  # fmt: skip
    add(
        "replicas, in a tf.function", "rows unknown: guarded",
        count_partitions(replicated(True)),
        "hand-written, copy per device", count_partitions(copies(True)),
    )  # fmt: skip
    tfshard.replicas.Replicas.forget_all()  # the process's functions on `pair` read none
    return results


def table(results: Sequence[dict[str, Any]]) -> str:
    """The counts as a table: one line per case, tfshard's beside its reference's."""
    lines = [
        f"{'case':<28} {'tfshard':<21} {'sends+recvs':>11} {'bytes':>7}   "
        f"{'reference':<29} {'sends+recvs':>11} {'bytes':>7}"
    ]
    for r in results:
        lines.append(
            f"{r['case']:<28} {r['tfshard']:<21} {r['transfers']:>11} {r['bytes']:>7}   "
            f"{r['reference']:<29} {r['reference_transfers']:>11} {r['reference_bytes']:>7}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # a full trace warns once a run
    devices = setup(4)
    results = cases(devices, _ROWS.value, _WIDTH.value, _AUTO_CALLS.value)
    print(table(results))
    if _EDGES.value:
        for r in results:
            print(f"\n{r['case']} ({r['tfshard']}):", *r["edges"], sep="\n  ")
            print(f"  reference, {r['reference']}:", *r["reference_edges"], sep="\n  ")
    summary = [{k: v for k, v in r.items() if "edges" not in k} for r in results]
    print(json.dumps(summary))
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
