"""The GPU suite: what tests/test_gpu_kernels.py proves from the graph, checked on real GPUs.

Every test needs GPUs: without them it skips, and with TFSHARD_REQUIRE_GPU=1
it fails (tests/conftest.py), so a broken driver cannot pass as "skipped".
With one physical GPU and TFSHARD_REQUIRE_GPU=1, the root conftest.py splits
it into two logical GPUs, so the two-GPU checks run (the overlap check then
measures two streams on one card, not two cards). BUILD.md says what each
check means.
"""

import time

import numpy as np
import pytest
import tensorflow as tf

import tfshard

DTYPES = (
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16",
    "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)  # fmt: skip
_PLAN_OPS = {"FloorDiv", "FloorMod", "Range", "Less", "Unpack", "Cumsum"}


def _batch(dtype: str, n: int = 10) -> tf.Tensor:
    """[n, 4] of `dtype`, made on GPU:0 (where a real pipeline would have it)."""
    with tf.device("/device:GPU:0"):
        return tf.cast(tf.reshape(tf.range(4 * n) % 7, [n, 4]), dtype)


@pytest.mark.parametrize("output", ["gpu", "host"])
@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_shard_runs_on_its_gpu_and_the_plan_on_the_host(
    two_gpus, dtype, per_sample, output, executed_nodes
):
    """From one run's step stats: nothing of a shard or the gather fell back to a CPU.

    With the output on GPU:1 both shards trace in place; with it on the host
    CPU, both GPUs call one shared trace of the function.
    """
    gpus = tfshard.list_devices("GPU")[:2]
    out_device = gpus[1] if output == "gpu" else "/device:CPU:0"
    fn = (lambda s: s[:2]) if per_sample else (lambda x: x[:, :2])
    f = tfshard.parallelize(fn, devices=gpus, output_device=out_device, per_sample=per_sample)
    x = _batch(dtype)
    concrete = f.get_concrete_function(x)
    ran = executed_nodes(concrete, x.numpy())
    for k, device in enumerate(gpus):
        shard = {
            d
            for name, op, d in ran
            if f"tfshard_shard_{k}/" in name and op not in ("Switch", "Identity")
        }
        assert shard == {device}, (k, shard)
    # The shared trace's nodes (cond/... for the empty-shard guard) ran on each GPU.
    shared = {d for name, _, d in ran if name.startswith("cond/")}
    assert shared == (set() if output == "gpu" else set(gpus)), shared
    collect = {d for name, _, d in ran if name.startswith("tfshard_collect/")}
    assert collect == {out_device}
    split = {d for _, op, d in ran if op in ("SplitV", "StridedSlice", "Bitcast")}
    assert gpus[0] in split and not any("CPU" in d for d in split - {gpus[0]}), split
    top = {op.name for op in concrete.graph.get_operations()}
    plan = {d for name, op, d in ran if op in _PLAN_OPS and name in top}
    assert plan == {"/device:CPU:0"}


@pytest.mark.parametrize("reduce", [None, "sum", "max"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_lands_on_the_output_device(two_gpus, dtype, reduce):
    if reduce and (dtype == "bool" or (dtype.startswith("complex") and reduce == "max")):
        pytest.skip(f"reduce={reduce!r} is not defined for {dtype}")
    gpus = tfshard.list_devices("GPU")[:2]
    f = tfshard.parallelize(tf.identity, devices=gpus, output_device=gpus[1], reduce=reduce)
    for n in (0, 1, 9):  # no rows, fewer rows than devices, uneven shards
        x = _batch(dtype, n)
        out = f(x)
        assert out.device.endswith(gpus[1].split("/device:")[1]), out.device
        expected = x.numpy()
        if reduce == "sum":
            expected = np.sum(expected, 0, dtype=expected.dtype)
        elif reduce == "max" and n:
            expected = expected.max(0)
        if reduce != "max" or n:
            np.testing.assert_array_equal(out.numpy(), expected)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_replicated_weights_are_read_on_each_gpu(two_gpus, jit_compile):
    """With replicas each GPU holds a copy and each shard reads its own (XLA too)."""
    gpus = tfshard.list_devices("GPU")[:2]
    f = tfshard.parallelize(
        lambda x: tf.matmul(x, w), devices=gpus, per_sample=False, jit_compile=jit_compile
    )
    with f.replicas():
        w = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [4, 3]))
    copies = tfshard.replicas.Replicas.find(gpus).strategy.experimental_local_results(w)
    assert sorted(c.device.split("device:")[-1] for c in copies) == ["GPU:0", "GPU:1"]
    x = _batch("float32")
    reads = tfshard.replicas.variable_reads(f.get_concrete_function(x), f.devices)
    assert [[r.device for r in shard] for shard in reads] == [[gpus[0]], [gpus[1]]]
    result = f(x)
    assert result.device.endswith(gpus[0].split("device:")[-1])
    np.testing.assert_allclose(result.numpy(), x.numpy() @ w.numpy(), rtol=1e-5)


def test_shards_on_two_gpus_overlap_in_time(two_gpus):
    """One call on two GPUs against the same batch on one: overlapping shards are faster."""
    gpus = tfshard.list_devices("GPU")[:2]
    size = 4096

    def heavy(x):  # [n, size, size] -> [n]: a few large products per row
        for _ in range(4):
            x = tf.matmul(x, x) / size
        return tf.reduce_sum(x, axis=[1, 2])

    both = tfshard.parallelize(heavy, devices=gpus, per_sample=False)
    one = tfshard.parallelize(heavy, devices=gpus[:1], per_sample=False)
    x = _batch("float32", 8 * size * size // 4)
    x = tf.reshape(x, [8, size, size]) / 7.0

    def median_seconds(f):
        f(x).numpy()  # warm-up: trace and allocate
        times = []
        for _ in range(5):
            start = time.perf_counter()
            f(x).numpy()
            times.append(time.perf_counter() - start)
        return sorted(times)[2]

    speedup = median_seconds(one) / median_seconds(both)
    print(f"two GPUs vs one: {speedup:.2f}x")
    assert speedup > 1.3, f"shards did not overlap: {speedup:.2f}x on two GPUs"
