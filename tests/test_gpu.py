"""The GPU suite: what tests/test_gpu_kernels.py proves from the graph, checked on real GPUs.

Every test of a GPU needs GPUs: without them it skips, and with TFSHARD_REQUIRE_GPU=1
it fails (tests/conftest.py), so a broken driver cannot pass as "skipped".
With one physical GPU and TFSHARD_REQUIRE_GPU=1, the root conftest.py splits
it into two logical GPUs, so the two-GPU checks run: placement and copies are
real, and overlap is read from the kernels' times in one run's trace (two
streams of one card cannot show it as a speed-up, which is checked only on two
physical GPUs). The checks themselves run on the CPU bed too, where they can.
BUILD.md says what each check means.
"""

import time

import numerics
import numpy as np
import pytest
import tensorflow as tf

import tfshard

DTYPES = (
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16",
    "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)  # fmt: skip
_PLAN_OPS = {"FloorDiv", "FloorMod", "Range", "Less", "Unpack", "Cumsum"}
_SPLIT_OPS = {"SplitV", "StridedSlice", "Bitcast"}


def _reads_the_batch_size(op_type: str, input_types: list[str]) -> bool:
    """The plan's `tf.shape(x)[0]`: a StridedSlice of a Shape (placed where the batch is)."""
    return op_type == "StridedSlice" and input_types[:1] == ["Shape"]


def _split_and_plan(
    ran: list[tuple[str, str, str]], top: dict[str, tuple[str, list[str]]]
) -> tuple[set[str], set[str]]:
    """Devices the split and the plan ran on, from one run's (node, op, device) rows.

    `top` maps the traced graph's own nodes (not a shard's function body) to their op type
    and their inputs' op types. The split is the top-level SplitV/Bitcast/StridedSlice that
    cuts the batch; the StridedSlice of Shape that reads the batch size is the plan's, as
    are `_PLAN_OPS`.
    """
    split, plan = set(), set()
    for name, op, device in ran:
        # A shard's own nodes, in place at the top level when no empty-shard cond wraps
        # them, are the shard's (checked shard by shard).
        if name not in top or name.startswith("tfshard_shard_"):
            continue
        if name.startswith(("tfshard_collect/", "tfshard_rows/")):
            continue  # the gather's row counts and their check, where results land
        if op in _PLAN_OPS or _reads_the_batch_size(*top[name]):
            plan.add(device)
        elif op in _SPLIT_OPS:
            split.add(device)
    return split, plan


def _check_placement(f, x, executed_nodes) -> None:
    """From one run's step stats: each shard on its device, the gather on the output
    device, the split and the plan (int32: in host memory on a GPU) where the batch is,
    the first device."""
    with tf.device(x.device):
        fewer = x[1:]
    # A per-sample function's first batch size has a graph of its own, its plan folded
    # into constants; every other size runs the graph whose rows are open.
    for batch in (x, fewer):
        _check_graph(f, batch, executed_nodes)


def _check_graph(f, x, executed_nodes) -> None:
    devices, out_device = f.devices, f.output_device
    concrete = f.get_concrete_function(x)
    exact = concrete.inputs[0].shape[0] is not None
    ran = executed_nodes(concrete, x.numpy())
    for k, device in enumerate(devices):
        shard = {
            d
            for name, op, d in ran
            if f"tfshard_shard_{k}/" in name and op not in ("Switch", "Identity")
        }
        assert shard == {device}, (k, shard)
    # The shared trace's nodes (cond/... for the empty-shard guard) ran on each device.
    shared = {d for name, _, d in ran if name.startswith("cond/")}
    assert shared == (set() if out_device in devices else set(devices)), shared
    collect = {d for name, _, d in ran if name.startswith("tfshard_collect/")}
    assert collect == {out_device}
    top = {
        op.name: (op.type, [t.op.type for t in op.inputs]) for op in concrete.graph.get_operations()
    }
    split, plan = _split_and_plan(ran, top)
    assert split == {devices[0]}, split
    assert plan <= {devices[0]} if exact else plan == {devices[0]}, plan


def _batch(dtype: str, n: int = 10) -> tf.Tensor:
    """[n, 4] of `dtype`, made on GPU:0 (where a real pipeline would have it)."""
    with tf.device("/device:GPU:0"):
        return tf.cast(tf.reshape(tf.range(4 * n) % 7, [n, 4]), dtype)


@pytest.mark.parametrize("output", ["gpu", "host"])
@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_shard_runs_on_its_gpu_and_the_plan_where_the_batch_is(
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
    _check_placement(f, _batch(dtype), executed_nodes)


@pytest.mark.parametrize("output", ["in_place", "host"])
@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_the_placement_check_does_not_count_the_plan_as_the_split(
    dtype, per_sample, output, executed_nodes
):
    """The same check on CPU:1 and CPU:2, where the host's CPU:0 is another device.

    The H100 run of 2026-11-24 (diag.log) showed the plan's StridedSlice of Shape on CPU:0
    beside the SplitV on GPU:0; a check that took it for the split failed 60 times.
    """
    devices = ["/device:CPU:1", "/device:CPU:2"]
    out_device = devices[1] if output == "in_place" else "/device:CPU:0"
    fn = (lambda s: s[:2]) if per_sample else (lambda x: x[:, :2])
    f = tfshard.parallelize(fn, devices=devices, output_device=out_device, per_sample=per_sample)
    with tf.device(devices[0]):
        x = tf.cast(tf.reshape(tf.range(40) % 7, [10, 4]), dtype)
    _check_placement(f, x, executed_nodes)


def test_split_and_plan_read_the_rows_of_the_h100_run():
    # diag.log, float32 per_sample=True output=gpu: the rows the old check misread.
    ran = [
        ("strided_slice", "StridedSlice", "/device:CPU:0"),
        ("split", "SplitV", "/device:GPU:0"),
        ("tfshard_shard_0/cond/then/_0/tfshard_shard_0/cond/loop_body/strided_slice",
         "StridedSlice", "/device:GPU:0"),
        ("tfshard_shard_1/cond/then/_8/tfshard_shard_1/cond/loop_body/strided_slice",
         "StridedSlice", "/device:GPU:1"),
        ("Bitcast", "Bitcast", "/device:GPU:0"),
        ("Cumsum", "Cumsum", "/device:CPU:0"),
    ]  # fmt: skip
    top = {
        "strided_slice": ("StridedSlice", ["Shape", "Const", "Const", "Const"]),
        "split": ("SplitV", ["Placeholder", "AddV2", "Const"]),
        "Bitcast": ("Bitcast", ["Placeholder"]),
        "Cumsum": ("Cumsum", ["Pack"]),
    }
    assert _split_and_plan(ran, top) == ({"/device:GPU:0"}, {"/device:CPU:0"})


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


def _kernel_spans(step_stats, name_part: str) -> list[tuple[int, int]]:
    """[start, end) in µs of every GPU kernel of one run whose op name holds `name_part`.

    GPU kernels are the step stats' stream entries ("/device:GPU:0/stream:…"), timed on
    the GPU by the device tracer; their node names are the ops that launched them.
    """
    spans = []
    for device in step_stats.dev_stats:
        if "/stream:" not in device.device:
            continue  # the ops' own rows, and memcpy; "stream:all" may repeat a kernel
        for node in device.node_stats:
            if name_part in node.node_name:
                start = node.all_start_micros
                end = start + max(node.all_end_rel_micros, node.op_end_rel_micros, 1)
                spans.append((start, end))
    return spans


def _overlapping_pairs(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """How many (kernel of a, kernel of b) pairs run at the same time."""
    return sum(1 for s0, e0 in a for s1, e1 in b if s0 < e1 and s1 < e0)


@pytest.mark.parametrize("tf32", [True, False])
def test_float32_on_gpus_equals_one_gpu_within_the_stated_tolerance(two_gpus, tf32):
    """README, "Numerics on GPUs": TF32's tolerance with it on, exact float32 with it off.

    Off, the two ways still differ in float32's last bits (another batch split picks other
    kernels): 1.7e-5 absolute on the H100, on an entry near 0 of sums of order 10, which is
    why the tolerance is relative to the magnitudes (`numerics`).
    """
    gpus = tfshard.list_devices("GPU")[:2]
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(tf32)
    try:
        with tf.device(gpus[0]):
            w = tf.random.stateless_normal([256, 256], seed=[1, 2])
            x = tf.random.stateless_normal([64, 256], seed=[3, 4])
            one = tf.matmul(x, w).numpy()  # the same function on one device of the kind
        f = tfshard.parallelize(lambda b: tf.matmul(b, w), devices=gpus, per_sample=False)
        got = f(x).numpy()
        assert numerics.tolerance("float32", gpus)["rtol"] == (2e-3 if tf32 else 1e-5)
        numerics.assert_close(got, one, gpus)
        exact = x.numpy().astype(np.float64) @ w.numpy().astype(np.float64)
        error = float(np.max(np.abs(got - exact)) / np.max(np.abs(exact)))
        print(f"TF32 {'on' if tf32 else 'off'}: max error {error:.2e} of the largest entry")
        assert error < (2e-3 if tf32 else 1e-5)
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


def test_the_tolerance_widens_only_where_a_gpu_runs_tf32(monkeypatch):
    tf32 = [True]
    monkeypatch.setattr(
        tf.config.experimental, "tensor_float_32_execution_enabled", lambda: tf32[0]
    )
    cpus = ["/device:CPU:0", "/device:CPU:1"]
    assert numerics.tolerance("float32", cpus) == {"rtol": 1e-5, "atol": 1e-5}
    assert numerics.tolerance("float32", ("/device:CPU:0", "/device:GPU:1"), 3.0) == {
        "rtol": 2e-3,
        "atol": 6e-3,
    }
    remote = "/job:worker/replica:0/task:1/device:GPU:0"
    assert numerics.tolerance(tf.float32, remote)["rtol"] == 2e-3
    assert numerics.tolerance("float64", remote) == {"rtol": 1e-12, "atol": 1e-12}
    assert numerics.tolerance("int32", remote) == {"rtol": 0.0, "atol": 0.0}
    tf32[0] = False  # tf.config.experimental.enable_tensor_float_32_execution(False)
    assert numerics.tolerance("float32", ["/device:GPU:0", "/device:GPU:1"])["rtol"] == 1e-5
    # An entry near 0 is judged against the array's magnitude, not by rtol alone.
    numerics.assert_close(np.float32([10.0, 1.7e-5]), np.float32([10.0, 0.0]), cpus)
    with pytest.raises(AssertionError):
        numerics.assert_close(np.float32([10.0, 2e-4]), np.float32([10.0, 0.0]), cpus)
    numerics.assert_close(np.int8([1, 2]), np.int8([1, 2]), cpus)  # integers: exact
    with pytest.raises(AssertionError):
        numerics.assert_close(np.int8([1, 2]), np.int8([1, 3]), cpus)


def test_overlapping_pairs_counts_kernels_that_run_at_the_same_time():
    assert _overlapping_pairs([(0, 10), (20, 30)], [(5, 25)]) == 2
    assert _overlapping_pairs([(0, 10)], [(10, 20)]) == 0  # back to back is not at once


def test_shards_on_two_gpus_run_kernels_at_the_same_time(two_gpus, traced_run):
    """One run's trace: a kernel of shard 0 runs while a kernel of shard 1 runs.

    The kernels are small (4 products of 256 x 256 each), so neither shard fills a card: on one
    card split into two logical GPUs both streams can run at once, and whether they did is
    what the trace says. Timing cannot say it there (the streams share the card's SMs).
    """
    gpus = tfshard.list_devices("GPU")[:2]

    def chain(x):  # [n, 256, 256] -> [n]: 64 small dependent products per shard
        for _ in range(64):
            x = tf.tanh(tf.matmul(x, x) / 256.0)
        return tf.reduce_sum(x, axis=[1, 2])

    f = tfshard.parallelize(chain, devices=gpus, output_device=gpus[1], per_sample=False)
    with tf.device(gpus[0]):
        x = tf.random.stateless_uniform([8, 256, 256], seed=[1, 2])
    concrete = f.get_concrete_function(x)
    traced_run(concrete, x.numpy())  # warm-up: allocation and autotuning
    stats = traced_run(concrete, x.numpy())
    spans = [_kernel_spans(stats, f"tfshard_shard_{k}/") for k in range(2)]
    seen = sorted({d.device for d in stats.dev_stats})
    assert all(len(s) >= 64 for s in spans), (
        f"kernels of shard 0, 1: {len(spans[0])}, {len(spans[1])}; "
        f"devices in the trace: {seen} (no stream entries: the device tracer, CUPTI, is off)"
    )
    pairs = _overlapping_pairs(*spans)
    print(f"kernel pairs of shards 0 and 1 running at the same time: {pairs}")
    assert pairs > 0, f"the two shards' kernels never ran at the same time ({seen})"


def test_shards_on_two_physical_gpus_are_faster_than_one(two_gpus):
    """One call on two GPUs against the same batch on one: overlapping shards are faster."""
    if len(tf.config.list_physical_devices("GPU")) < 2:
        pytest.skip(
            "one physical GPU split in two: its two streams share one card's SMs, so a "
            "speed-up cannot show overlap (the kernel trace test shows it)"
        )
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
