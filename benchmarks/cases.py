"""The benchmark cases: workloads, tfshard, and what a user would write instead.

Every case builds the methods it compares from one Python function, checks
that each method's output equals the one-device output on the same input,
then times them round by round (`_harness.time_rounds`). The competitors are
written the way a competent user would write them:

- ``one_device``: the function in a `tf.function` on the first device.
- ``hand_graph``: one `tf.function` with `tf.split`, a `tf.device` block per
  shard and `tf.concat`; the overhead floor of any split-and-gather scheme.
- ``mirrored``: `tf.distribute.MirroredStrategy` on the same devices; inside
  one `tf.function`, `experimental_distribute_values_from_function` hands each
  replica its shard, `run` computes, and the local results are concatenated.
- ``eager_loop``: the naive version, a Python loop over the devices in eager
  mode (each op waits for the previous one, so the shards run one by one).

Each case takes the device names to use, so a test can run it on tiny sizes
with the devices its conftest created.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import _harness
import numpy as np
import tensorflow as tf

import tfshard

Fn = Callable[[Any], Any]

# The targets of issues 3 and 7 are for two devices.
TARGET_DEVICES = 2


# ---------------------------------------------------------------- workloads


def _weights(width: int, depth: int, seed: int, device: str) -> list[tf.Tensor]:
    # Scaled so activations keep unit size through the chain.
    rng = np.random.default_rng(seed)
    with tf.device(device):
        return [
            tf.constant((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32))
            for _ in range(depth)
        ]


def matmul_tanh_chain(width: int, depth: int, seed: int, device: str) -> Fn:
    """A compute-bound per-batch function: [B, width] -> [B, width].

    Args:
      width: the feature size D; each layer is a [B, D] x [D, D] matmul.
      depth: the number of matmul + tanh layers.
      seed: seeds the weights.
      device: where the weights live (they are captured, like a model's).

    Returns:
      The function.
    """
    weights = _weights(width, depth, seed, device)

    def chain(x: tf.Tensor) -> tf.Tensor:
        for w in weights:
            x = tf.tanh(tf.matmul(x, w))  # [B, D] x [D, D] -> [B, D]
        return x

    return chain


def matmul_chain(width: int, depth: int, seed: int, device: str) -> Fn:
    """Plain matmuls, nothing else: [B, width] -> [B, width]."""
    weights = _weights(width, depth, seed, device)

    def matmuls(x: tf.Tensor) -> tf.Tensor:
        for w in weights:
            x = tf.matmul(x, w)
        return x

    return matmuls


def per_sample_mlp(width: int, depth: int, seed: int, device: str) -> Fn:
    """A function of one sample: [width] -> [width], matvec + tanh layers, normalised."""
    weights = _weights(width, depth, seed, device)

    def mlp(sample: tf.Tensor) -> tf.Tensor:
        h = sample
        for w in weights:
            h = tf.tanh(tf.linalg.matvec(w, h))  # [D, D] x [D] -> [D]
        return h / (1.0 + tf.norm(h))

    return mlp


# ------------------------------------------------------------------ methods


def one_device(fn: Fn, device: str) -> Fn:
    """The function in a `tf.function` on one device."""

    @tf.function
    def run(x: tf.Tensor) -> Any:
        with tf.device(device):
            return fn(x)

    return run


def hand_graph(fn: Fn, devices: Sequence[str]) -> Fn:
    """tf.split + tf.device per shard + tf.concat, in one `tf.function`."""
    devices = list(devices)

    @tf.function
    def run(x: tf.Tensor) -> tf.Tensor:
        # [N, ...] -> K x [N_k, ...]; split where x lives, shards cross once.
        shards = tf.split(x, _harness.even_sizes(x.shape[0], len(devices)), axis=0)
        outputs = []
        for shard, device in zip(shards, devices):
            with tf.device(device):
                outputs.append(fn(shard))
        with tf.device(devices[0]):
            return tf.concat(outputs, axis=0)

    return run


def mirrored(fn: Fn, devices: Sequence[str]) -> Fn:
    """`MirroredStrategy.run` on the same devices, each replica given its shard."""
    devices = list(devices)
    strategy = tf.distribute.MirroredStrategy(devices=devices)

    @tf.function
    def run(x: tf.Tensor) -> tf.Tensor:
        shards = tf.split(x, _harness.even_sizes(x.shape[0], len(devices)), axis=0)
        values = strategy.experimental_distribute_values_from_function(
            lambda context: shards[context.replica_id_in_sync_group]
        )
        outputs = strategy.run(fn, args=(values,))
        with tf.device(devices[0]):
            return tf.concat(strategy.experimental_local_results(outputs), axis=0)

    return run


def eager_loop(fn: Fn, devices: Sequence[str]) -> Fn:
    """The naive version: a Python loop over the devices, in eager mode."""
    devices = list(devices)

    def run(x: tf.Tensor) -> tf.Tensor:
        shards = tf.split(x, _harness.even_sizes(int(x.shape[0]), len(devices)), axis=0)
        outputs = []
        for shard, device in zip(shards, devices):
            with tf.device(device):
                outputs.append(fn(shard))
        with tf.device(devices[0]):
            return tf.concat(outputs, axis=0)

    return run


def vectorized(sample_fn: Fn) -> Fn:
    """A batch function that applies `sample_fn` to every row with `tf.vectorized_map`."""

    def batch_fn(x: tf.Tensor) -> Any:
        return tf.vectorized_map(sample_fn, x)

    return batch_fn


def per_batch_methods(fn: Fn, devices: Sequence[str]) -> dict[str, Fn]:
    """One-device reference, tfshard and the three multi-device baselines."""
    return {
        "one_device": one_device(fn, devices[0]),
        "tfshard": tfshard.parallelize(fn, devices=list(devices), per_sample=False),
        "hand_graph": hand_graph(fn, devices),
        "mirrored": mirrored(fn, devices),
        "eager_loop": eager_loop(fn, devices),
    }


def per_sample_methods(sample_fn: Fn, devices: Sequence[str]) -> dict[str, Fn]:
    """The per-sample function everywhere: vectorised, and with `tf.map_fn`."""
    batch_fn = vectorized(sample_fn)

    @tf.function
    def map_fn(x: tf.Tensor) -> tf.Tensor:
        with tf.device(devices[0]):
            return tf.map_fn(sample_fn, x)

    return {
        "one_device": one_device(batch_fn, devices[0]),  # tf.vectorized_map
        "tfshard": tfshard.parallelize(sample_fn, devices=list(devices)),
        "hand_graph": hand_graph(batch_fn, devices),
        "mirrored": mirrored(batch_fn, devices),
        "eager_loop": eager_loop(batch_fn, devices),
        "map_fn": map_fn,
    }


# -------------------------------------------------------------------- cases


def _compare(
    methods: dict[str, Fn],
    inputs: Sequence[Any],
    *,
    repeats: int,
    warmup: int,
    inner: int = 1,
) -> dict[str, Any]:
    errors = _harness.check_outputs(methods, "one_device", inputs[0])
    with _harness.OtherLoad() as other:
        times = _harness.time_rounds(
            methods, inputs, repeats=repeats, warmup=warmup, inner=inner
        )
    comparison = _harness.summarize(times, errors, baseline="one_device")
    comparison["other_processes_cores"] = other.cores
    return comparison


def _inputs(shape: Sequence[int], repeats: int, seed: int, device: str) -> list[tf.Tensor]:
    # Fresh data each round, up to 8 distinct arrays, reused cyclically beyond that.
    return _harness.random_inputs(shape, min(repeats, 8), seed, device)


def _case(description: str, params: dict[str, Any], devices: Sequence[str]) -> dict[str, Any]:
    return {
        "description": description,
        "params": params,
        "devices": list(devices),
        "comparisons": {},
        "targets": [],
        "notes": [],
    }


def compute_case(
    devices: Sequence[str],
    *,
    batch: int = 8192,
    width: int = 256,
    depth: int = 8,
    repeats: int = 15,
    warmup: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """A compute-bound per-batch function (matmul + tanh chain, per_sample=False).

    Args:
      devices: the devices to shard over (the targets are for two).
      batch: rows per call.
      width: the feature size of each [batch, width] x [width, width] matmul.
      depth: matmul + tanh layers.
      repeats: timed rounds.
      warmup: untimed calls of each method first.
      seed: seeds weights and inputs.

    Returns:
      The case's result: parameters, medians, ratios and targets.
    """
    result = _case(
        "compute-bound per-batch function, chain of matmul + tanh (per_sample=False)",
        dict(batch=batch, width=width, depth=depth, devices=len(devices)),
        devices,
    )
    fn = matmul_tanh_chain(width, depth, seed, devices[0])
    inputs = _inputs([batch, width], repeats, seed + 1, devices[0])
    comparison = _compare(
        per_batch_methods(fn, devices), inputs, repeats=repeats, warmup=warmup
    )
    result["comparisons"]["per-batch"] = comparison
    if len(devices) == TARGET_DEVICES:
        speedup, versus = comparison["speedup_vs_one_device"], comparison["tfshard_vs"]
        result["targets"] = [
            _harness.target("speed-up over one device", speedup["tfshard"], ">=", 1.85),
            _harness.target("speed vs hand-written graph", versus["hand_graph"], ">=", 0.95),
            _harness.target("speed vs MirroredStrategy", versus["mirrored"], ">=", 1.0),
        ]
    return result


def small_batch_case(
    devices: Sequence[str],
    *,
    batch: int = 8,
    width: int = 256,
    depth: int = 8,
    inner: int = 50,
    repeats: int = 15,
    warmup: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Per-call overhead: the compute-bound function on a batch too small to split well.

    Args:
      devices: the devices to shard over.
      batch: rows per call (8 for the target).
      width: as in `compute_case`.
      depth: as in `compute_case`.
      inner: calls per timed sample; the sample is their mean.
      repeats: timed rounds.
      warmup: untimed calls of each method first.
      seed: seeds weights and inputs.

    Returns:
      The case's result; its target is tfshard's time per call over the
      hand-written graph's.
    """
    result = _case(
        "per-call overhead: the matmul + tanh chain on a small batch",
        dict(batch=batch, width=width, depth=depth, devices=len(devices), inner=inner),
        devices,
    )
    fn = matmul_tanh_chain(width, depth, seed, devices[0])
    inputs = _inputs([batch, width], repeats, seed + 1, devices[0])
    comparison = _compare(
        per_batch_methods(fn, devices), inputs, repeats=repeats, warmup=warmup, inner=inner
    )
    result["comparisons"]["per-call"] = comparison
    overhead = 1.0 / comparison["tfshard_vs"]["hand_graph"]
    comparison["tfshard_time_over_hand_graph"] = overhead
    if len(devices) == TARGET_DEVICES:
        result["targets"] = [
            _harness.target("per-call time vs hand-written graph", overhead, "<=", 1.1),
        ]
    return result


def per_sample_case(
    devices: Sequence[str],
    *,
    samples: int = 8192,
    width: int = 128,
    depth: int = 4,
    repeats: int = 15,
    warmup: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """A function of one sample, vectorised (tfshard's default path) or mapped.

    Args:
      devices: the devices to shard over.
      samples: rows per call.
      width: the sample size; each layer is a [width, width] matvec.
      depth: matvec + tanh layers.
      repeats: timed rounds.
      warmup: untimed calls of each method first.
      seed: seeds weights and inputs.

    Returns:
      The case's result, with `tf.map_fn` and `tf.vectorized_map` (the
      one-device reference) among the methods.
    """
    result = _case(
        "per-sample function (matvec + tanh layers), vectorised; tf.map_fn for contrast",
        dict(samples=samples, width=width, depth=depth, devices=len(devices)),
        devices,
    )
    sample_fn = per_sample_mlp(width, depth, seed, devices[0])
    inputs = _inputs([samples, width], repeats, seed + 1, devices[0])
    comparison = _compare(
        per_sample_methods(sample_fn, devices), inputs, repeats=repeats, warmup=warmup
    )
    result["comparisons"]["per-sample"] = comparison
    result["notes"].append(
        "one_device is tf.vectorized_map on one device; map_fn is tf.map_fn on one device; "
        "eager_loop calls tf.vectorized_map eagerly, which traces a new graph every call"
    )
    if len(devices) == TARGET_DEVICES:
        result["targets"] = [
            _harness.target("speed vs tf.map_fn", comparison["tfshard_vs"]["map_fn"], ">=", 3.0),
        ]
    return result


def scaling_case(
    devices: Sequence[str],
    *,
    batch: int = 8192,
    batch_sizes: Sequence[int] = (64, 256, 1024, 4096, 16384),
    width: int = 256,
    depth: int = 8,
    repeats: int = 11,
    warmup: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Matmul scaling: speed-up against device count K = 1..len(devices), and batch size.

    Args:
      devices: the logical devices; the K sweep uses the first K of them.
      batch: rows per call in the K sweep.
      batch_sizes: the batch sizes of the batch sweep, on min(2, K) devices.
      width: as in `compute_case`.
      depth: matmuls per call.
      repeats: timed rounds per point.
      warmup: untimed calls of each method first.
      seed: seeds weights and inputs.

    Returns:
      The case's result, with ``sweeps["devices"]`` and ``sweeps["batch"]``.
    """
    result = _case(
        "matmul scaling: chain of [batch, width] x [width, width] matmuls",
        dict(batch=batch, width=width, depth=depth, max_devices=len(devices)),
        devices,
    )
    fn = matmul_chain(width, depth, seed, devices[0])
    inputs = _inputs([batch, width], repeats, seed + 1, devices[0])
    points = []
    for k in range(1, len(devices) + 1):
        comparison = _compare(
            per_batch_methods(fn, devices[:k]), inputs, repeats=repeats, warmup=warmup
        )
        points.append({"devices": k, "comparison": comparison})
    result["sweeps"] = {
        "devices": {
            "variable": "devices",
            "title": f"{depth} matmuls [{batch}, {width}] x [{width}, {width}]",
            "points": points,
        }
    }
    sweep_devices = devices[: min(TARGET_DEVICES, len(devices))]
    points = []
    for size in batch_sizes:
        sized = _inputs([size, width], repeats, seed + 2, devices[0])
        comparison = _compare(
            per_batch_methods(fn, sweep_devices), sized, repeats=repeats, warmup=warmup
        )
        points.append({"batch": size, "comparison": comparison})
    result["sweeps"]["batch"] = {
        "variable": "batch",
        "title": f"on {len(sweep_devices)} devices",
        "points": points,
    }
    cores = _harness.cores()
    bounds = ", ".join(
        f"K={k}: {_harness.core_bound(k, cores):.2f}x" for k in range(1, len(devices) + 1)
    )
    result["notes"].append(
        f"this machine has {cores} cores: above K = {cores} logical CPU devices no speed-up "
        f"over {cores}x is possible, the extra devices share the same cores; K equal shards "
        f"on {cores} cores finish in ceil(K / {cores}) rounds, so the best speed-ups are "
        f"{bounds}"
    )
    return result


def dataset_case(
    devices: Sequence[str],
    *,
    samples: int = 32768,
    batch: int = 4096,
    batch_sizes: Sequence[int] = (1024, 2048, 8192),
    width: int = 256,
    depth: int = 8,
    repeats: int = 11,
    warmup: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """A dataset streamed through the function, against the same samples in memory.

    Every method computes the matmul + tanh chain of `compute_case` on the same
    `samples` rows and returns all outputs in order. tfshard reads the dataset
    three ways: ``f(dataset)`` on a dataset of batches, ``f(dataset,
    batch_size=B)`` on a dataset of samples, and ``f.iterate(dataset)``
    (results per batch, concatenated here); ``tfshard_python_loop`` is the
    Python loop over the batches that ``f(dataset)`` falls back to where it
    cannot trace its loop. ``tfshard_sliced_batches`` streams
    a dataset that slices whole batches out of the tensor, whose pipeline costs
    almost nothing, and ``tfshard_batches_in_memory`` loops `f` over the same
    batches already in memory: the two show what the batching itself costs,
    apart from the pipeline. The baselines loop over the same batches
    (prefetched, as a user would) with a one-device `tf.function`, the
    hand-written graph and the `mirrored` method, and iterate
    `MirroredStrategy.experimental_distribute_dataset` in one `tf.function`.
    Iterating the dataset alone, with no computing, is timed too
    (``pipeline_alone_median_s``): that work shares the cores with the shards.
    A sweep then compares ``f(dataset)`` with ``f(tensor)`` at other batch sizes.

    Args:
      devices: the devices to shard over.
      samples: rows in the dataset.
      batch: the global batch size of the stream.
      batch_sizes: further global batch sizes for the sweep.
      width: as in `compute_case`.
      depth: as in `compute_case`.
      repeats: timed rounds.
      warmup: untimed calls of each method first.
      seed: seeds weights and inputs.

    Returns:
      The case's result; its target is tfshard's throughput on the dataset
      over its throughput on the in-memory tensor.
    """
    result = _case(
        "dataset stream: the matmul + tanh chain over a tf.data.Dataset of batches",
        dict(samples=samples, batch=batch, width=width, depth=depth, devices=len(devices)),
        devices,
    )
    devices = list(devices)
    fn = matmul_tanh_chain(width, depth, seed, devices[0])
    f = tfshard.parallelize(fn, devices=devices, per_sample=False)
    one, hand, mirror = one_device(fn, devices[0]), hand_graph(fn, devices), mirrored(fn, devices)
    strategy = tf.distribute.MirroredStrategy(devices=devices)

    @tf.function
    def mirrored_epoch(dataset: Any) -> tf.Tensor:
        # The whole loop in one graph: faster than a Python loop over this dataset.
        outputs = tf.TensorArray(tf.float32, size=0, dynamic_size=True, infer_shape=False)
        for values in dataset:
            per_replica = strategy.run(fn, args=(values,))
            with tf.device(devices[0]):
                outputs = outputs.write(
                    outputs.size(),
                    tf.concat(strategy.experimental_local_results(per_replica), axis=0),
                )
        return outputs.concat()

    def stream(step: Fn, dataset: Any) -> tf.Tensor:
        outputs = [step(b) for b in dataset]
        with tf.device(devices[0]):
            return tf.concat(outputs, axis=0)

    def open_shape(dataset: tf.data.Dataset) -> tf.data.Dataset:
        # Batches whose per-sample shape the element spec leaves open ([None, None]):
        # f(dataset) cannot trace its loop over them and runs its Python loop.
        return dataset.map(lambda b: tf.reshape(b, [-1, tf.shape(b)[1]]))

    def sliced(x: tf.Tensor, size: int) -> tf.data.Dataset:
        # Whole batches sliced out of x: the same batches, almost no pipeline work.
        starts = tf.data.Dataset.range(0, samples, size)
        return starts.map(lambda start: x[start : start + size])

    def make_input(x: tf.Tensor) -> dict[str, Any]:
        rows = tf.data.Dataset.from_tensor_slices(x)
        batches = rows.batch(batch)
        # A user streaming by hand prefetches; tfshard prefetches by itself.
        prefetched = batches.prefetch(tf.data.AUTOTUNE)
        return {
            "tensor": x,
            "in_memory_batches": list(sliced(x, batch)),
            "sliced": sliced(x, batch),
            "rows": rows,
            "batches": batches,
            "open_shape": open_shape(batches),
            "prefetched": prefetched,
            "distributed": strategy.experimental_distribute_dataset(prefetched),
        }

    methods: dict[str, Fn] = {
        "one_device": lambda i: one(i["tensor"]),
        "tfshard": lambda i: f(i["tensor"]),
        "tfshard_dataset": lambda i: f(i["batches"]),
        "tfshard_batch_size": lambda i: f(i["rows"], batch_size=batch),
        "tfshard_iterate": lambda i: stream(lambda r: r, f.iterate(i["batches"])),
        # What f(dataset) falls back to when it cannot trace its loop: the other choice.
        "tfshard_python_loop": lambda i: f(i["open_shape"]),
        "tfshard_sliced_batches": lambda i: f(i["sliced"]),
        "tfshard_batches_in_memory": lambda i: stream(f, i["in_memory_batches"]),
        "one_device_stream": lambda i: stream(one, i["prefetched"]),
        "hand_graph_stream": lambda i: stream(hand, i["prefetched"]),
        "mirrored_stream": lambda i: stream(mirror, i["prefetched"]),
        "mirrored_distribute_dataset": lambda i: mirrored_epoch(i["distributed"]),
        # The pipeline by itself, no computing: what streaming adds to the cores' work.
        "pipeline_alone": lambda i: stream(lambda b: b, i["prefetched"]),
    }
    tensors = _inputs([samples, width], repeats, seed + 1, devices[0])
    inputs = [make_input(x) for x in tensors]
    pipeline = methods.pop("pipeline_alone")
    comparison = _compare(methods, inputs, repeats=repeats, warmup=warmup)
    pipeline_times = _harness.time_rounds(
        {"pipeline_alone": pipeline}, inputs, repeats=repeats, warmup=warmup
    )["pipeline_alone"]
    comparison["pipeline_alone_median_s"] = _harness.median(pipeline_times)
    result["comparisons"]["stream"] = comparison
    points, ratios = [], []
    for size in sorted({*batch_sizes, batch}):
        sized = [{"tensor": x, "batches": tf.data.Dataset.from_tensor_slices(x).batch(size)}
                 for x in tensors]
        point = _compare(
            {
                "one_device": lambda i: one(i["tensor"]),
                "tfshard": lambda i: f(i["tensor"]),
                "tfshard_dataset": lambda i: f(i["batches"]),
            },
            sized,
            repeats=repeats,
            warmup=warmup,
        )
        points.append({"batch": size, "comparison": point})
        ratios.append(f"{size}: {1.0 / point['tfshard_vs']['tfshard_dataset']:.2f}x")
    result["sweeps"] = {
        "batch": {"variable": "batch", "title": f"{samples} samples", "points": points}
    }
    result["notes"].append(
        "tfshard and one_device take the samples as one in-memory tensor; *_stream loop in "
        "Python over the prefetched batches; mirrored_stream hands each replica its shard "
        "with experimental_distribute_values_from_function, mirrored_distribute_dataset "
        "iterates strategy.experimental_distribute_dataset inside one tf.function; "
        f"iterating the prefetched dataset alone takes "
        f"{comparison['pipeline_alone_median_s'] * 1e3:.2f} ms"
    )
    result["notes"].append(
        "f(dataset) throughput over f(tensor) by global batch size: " + ", ".join(ratios)
    )
    if len(devices) == TARGET_DEVICES:
        versus = comparison["tfshard_vs"]
        result["targets"] = [
            _harness.target(
                "f(dataset) throughput vs f(tensor)", 1.0 / versus["tfshard_dataset"], ">=", 0.9
            ),
        ]
    return result


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    "compute": compute_case,
    "per_sample": per_sample_case,
    "small_batch": small_batch_case,
    "dataset": dataset_case,
    "scaling": scaling_case,
}
