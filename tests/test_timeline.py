"""f.timeline(x): TensorFlow's record of one call, on the 4 logical CPU devices of conftest.py.

Every function here names its output device (a GPU machine's default is GPU:0), except
the GPU tests at the end, which need a GPU and skip elsewhere. Parallelism is a
measurement on 2 cores that other processes may share: each check takes the best of a
few timelines (contention only lowers it; a chained function cannot rise above 1.0
however the cores are shared), with margins.
"""

import gzip
import importlib
import sys
import types
from pathlib import Path

import children
import numerics
import numpy as np
import pytest
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver

import tfshard
from tfshard import timeline as timeline_lib

FOUR = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
DEVICES = [f"/device:CPU:{i}" for i in range(4)]
WIDTH = 256
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _layers(layers=20, seed=0):
    """The weights, on the host (a GPU machine's eager constants would live on GPU:0)."""
    rng = np.random.default_rng(seed)
    with tf.device("/cpu:0"):
        return [
            tf.constant((rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32))
            for _ in range(layers)
        ]


def _rows(n, seed=1):
    return np.random.default_rng(seed).standard_normal((n, WIDTH), dtype=np.float32)


def _pure(devices, **options):
    options.setdefault("output_device", devices[0])
    weights = _layers()

    def dense_stack(sample):  # [WIDTH] -> [WIDTH]
        for w in weights:
            sample = tf.tanh(tf.linalg.matvec(w, sample, transpose_a=True))
        return sample

    return tfshard.parallelize(dense_stack, devices=devices, **options)


def _best_parallelism(f, x, tries=3):
    f(x)  # a warm call is recorded: a first run's costs (memory, kernels made) are not
    return max(f.timeline(x).parallelism for _ in range(tries))


@pytest.fixture(scope="module")
def pure_four():
    return _pure(FOUR)


@pytest.fixture(scope="module")
def every_shard_writes_one_counter():
    """Each shard reads one variable first and adds its sum to it last: shards take turns.

    Automatic control dependencies order the reads and writes of one variable in
    the order they were traced, so each shard's read waits for the write of the
    shard before it, and its work depends on that read: each shard starts when
    the one before it ended. (A shard that only writes at its end overlaps its
    work with the others', and only the writes are ordered.)
    """
    weights = _layers()
    counter = tf.Variable(0.0)

    def layers_then_count(x):  # [B, WIDTH] -> [B, WIDTH]
        x = x + 0.0 * counter.read_value()  # waits for the write of the shard before
        for w in weights:
            x = tf.tanh(x @ w)
        counter.assign_add(tf.reduce_sum(x))
        return x

    f = tfshard.parallelize(
        layers_then_count, devices=FOUR, per_sample=False, output_device="cpu:0"
    )
    f.counter = counter
    return f


# ------------------------------------------------------------ parallelism


def test_pure_function_on_four_devices_runs_at_once(pure_four):
    # 2 cores: the bound is 2.0; a quiet machine measures ~1.8.
    assert _best_parallelism(pure_four, _rows(2048)) >= 1.5


def test_one_device_has_parallelism_about_one():
    f = _pure(["cpu:1"])
    f(_rows(1024))
    timelines = [f.timeline(_rows(1024)) for _ in range(5)]
    assert all(len(t.shards) == 1 for t in timelines)
    # Busy time is when an op ran, so one shard can never exceed 1.0; a quiet
    # machine measures ~0.95, and under load (9 runnable threads on 2 cores)
    # the gaps while its thread waits for a core bring it down to ~0.65.
    assert all(t.parallelism <= 1.0 + 1e-9 for t in timelines)
    assert max(t.parallelism for t in timelines) >= 0.6


def _overlap_ms(a, b):
    return sum(max(0.0, min(y, d) - max(x, c)) for x, y in a.intervals for c, d in b.intervals)


def test_shards_that_take_turns_show_parallelism_about_one(every_shard_writes_one_counter):
    f = every_shard_writes_one_counter
    assert _best_parallelism(f, _rows(2048)) <= 1.15
    # And they really took turns: no two shards' work overlaps by more than a sliver.
    shards = f.timeline(_rows(2048)).shards
    for i, a in enumerate(shards):
        for b in shards[i + 1 :]:
            assert _overlap_ms(a, b) <= 0.1 * min(a.busy_ms, b.busy_ms), (a, b)


def test_the_record_is_the_call_and_writes_what_the_call_writes(every_shard_writes_one_counter):
    # The timeline makes the call f(x) makes, once: the counter moves as one call moves it.
    f = every_shard_writes_one_counter
    x = _rows(64)
    f(x)  # traced and warm
    start = f.counter.numpy()
    f.timeline(x)
    recorded = f.counter.numpy()
    f.counter.assign(start)
    f(x)
    called = f.counter.numpy()
    assert recorded != start
    numerics.assert_close(np.float32(recorded - start), np.float32(called - start))


# ------------------------------------------------------------- the record


def test_shards_are_in_order_with_the_plans_rows_and_consistent_times(pure_four):
    x = _rows(10)
    timeline = pure_four.timeline(x)
    assert [s.index for s in timeline.shards] == [0, 1, 2, 3]
    assert [s.device for s in timeline.shards] == DEVICES
    assert [s.rows for s in timeline.shards] == pure_four.plan(10) == [3, 3, 2, 2]
    for s in timeline.shards:
        assert s.ops > 0
        assert 0.0 <= s.start_ms <= s.end_ms <= timeline.total_ms
        assert 0.0 < s.busy_ms <= s.end_ms - s.start_ms + 1e-6
        assert s.busy_ms == pytest.approx(sum(b - a for a, b in s.intervals))
    assert timeline.gather is not None and timeline.gather.device == DEVICES[0]
    assert timeline.gather.end_ms >= max(s.end_ms for s in timeline.shards)


def test_busy_time_follows_the_work_each_shard_got():
    # Independent of the record: shard 0 gets 5 times the rows of each other shard.
    # Busy time includes time an op's thread waited for a core, so under load
    # the best of three runs is compared, with a wide margin (5x expected).
    f = _pure(FOUR, weights=[5, 1, 1, 1])
    f(_rows(2048))
    timelines = [f.timeline(_rows(2048)) for _ in range(3)]
    assert [s.rows for s in timelines[0].shards] == f.plan(2048) == [1280, 256, 256, 256]
    ratios = [t.shards[0].busy_ms / max(s.busy_ms for s in t.shards[1:]) for t in timelines]
    assert max(ratios) > 2.0, ratios


def test_copies_are_the_tensors_the_call_hands_between_devices(pure_four):
    timeline = pure_four.timeline(_rows(1000))
    copies = {c.device: c for c in timeline.copies}
    # By hand: the output device receives each other shard's result, once.
    assert copies[DEVICES[0]].tensors_in == 3
    for k in (1, 2, 3):
        c = copies[DEVICES[k]]
        assert c.tensors_in >= 1 and c.tensors_out >= 1  # its rows in, its result out
        # Logical CPU devices share memory: TF hands tensors over, nothing is copied.
        assert c.bytes_in is None and c.bytes_out is None and c.ms is None
    assert sum(c.tensors_in for c in timeline.copies) == sum(
        c.tensors_out for c in timeline.copies
    )


def test_an_input_living_on_a_device_is_not_copied_from_the_host():
    # The input lives on CPU:1, where shard 0 runs and results land: the call hands
    # shard 1 its rows (CPU:1 -> CPU:2) and takes its result back (CPU:2 -> CPU:1),
    # and nothing else. CPU:0 (the host) sends and receives nothing.
    f = tfshard.parallelize(
        lambda s: tf.tanh(s) * 2.0, devices=["cpu:1", "cpu:2"], output_device="cpu:1"
    )
    with tf.device("/cpu:1"):
        x = tf.constant(_rows(64))
    f(x)
    timeline = f.timeline(x)
    assert [(c.device, c.tensors_in, c.tensors_out) for c in timeline.copies] == [
        ("/device:CPU:1", 1, 1),
        ("/device:CPU:2", 1, 1),
    ]
    assert [s.rows for s in timeline.shards] == [32, 32]


def test_the_table_names_every_device_rows_and_parallelism(pure_four):
    timeline = pure_four.timeline(_rows(10))
    text = str(timeline)
    assert text.startswith("dense_stack: one call, 10 rows on 4 devices, ")
    assert f"parallelism {timeline.parallelism:.2f} (1.00: one after another" in text
    lines = text.splitlines()
    for k, (device, rows) in enumerate(zip(DEVICES, [3, 3, 2, 2])):
        line = next(line for line in lines if line.split()[:1] == [str(k)])
        assert line.split()[1:3] == [device, str(rows)]
        assert "#" in line.split("|")[1]  # its lane shows when it ran
    assert any(line.split()[:2] == ["gather", DEVICES[0]] for line in lines)
    for device in DEVICES:
        assert sum(device in line for line in lines) >= 2  # its shard, and its copies
    # Each device's copies line: the tensors it took in and sent out, and no sizes (shared
    # memory: nothing is copied between logical CPU devices).
    for c in timeline.copies:
        line = next(line for line in lines if line.split()[:1] == [c.device])
        assert line.split()[1:3] == [str(c.tensors_in), str(c.tensors_out)]
        if c.device in DEVICES:  # a GPU machine's GPU:0 may copy something of its own
            assert line.endswith("none recorded (shared memory)")


def test_shards_traced_in_place_with_replicas_are_recorded_alike():
    # With replicas every shard traces in place (no shared trace): its ops carry
    # its scope, and its cond is lowered, so no graph op names the edges.
    devices = ["cpu:3", "cpu:2", "cpu:1"]
    f = tfshard.parallelize(lambda s: tf.tanh(s * scale), devices=devices, output_device="cpu:3")
    with f.replicas():
        scale = tf.Variable(2.0)
    n = 300
    timeline = f.timeline(_rows(n))
    assert [s.device for s in timeline.shards] == [
        "/device:CPU:3",
        "/device:CPU:2",
        "/device:CPU:1",
    ]
    assert [s.rows for s in timeline.shards] == [100, 100, 100]
    assert all(s.ops > 0 and s.busy_ms > 0 for s in timeline.shards)
    copies = {c.device: c for c in timeline.copies}
    for device in ("/device:CPU:2", "/device:CPU:1"):
        # Its rows in and its outputs out (with, traced in place, its cond's predicate).
        assert copies[device].tensors_in >= 1 and copies[device].tensors_out >= 1


def test_an_empty_batch_and_a_batch_smaller_than_the_devices(pure_four):
    timeline = pure_four.timeline(_rows(2))
    assert [s.rows for s in timeline.shards] == [1, 1, 0, 0]
    assert "2 rows on 4 devices" in str(timeline)
    empty = pure_four.timeline(_rows(0))
    assert [s.rows for s in empty.shards] == [0, 0, 0, 0]


def test_a_keras_model_is_recorded_and_its_inference_leaves_its_weights():
    model = tf.keras.Sequential([tf.keras.Input([8]), tf.keras.layers.Dense(4)])
    before = [w.copy() for w in model.get_weights()]
    f = tfshard.parallelize(model, devices=FOUR[:2], output_device="cpu:0")
    timeline = f.timeline(np.ones([16, 8], np.float32))
    assert [s.rows for s in timeline.shards] == [8, 8]
    assert all(s.ops > 0 for s in timeline.shards)
    for w, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, b)


def test_compiled_shards_count_their_one_kernel_as_busy():
    # With XLA each shard is one call whose ops the record does not list. TensorFlow's
    # profiler leaves one compiled shard's call out of about one record in three here (the
    # XSpace holds its result's send, not its call): each shard is judged on the best of
    # five records.
    f = _pure(FOUR, jit_compile=True)
    f(_rows(256))  # compiled in a call of its own
    timelines = [f.timeline(_rows(256)) for _ in range(5)]
    assert [s.rows for s in timelines[0].shards] == [64, 64, 64, 64]
    for k in range(4):
        best = max((t.shards[k] for t in timelines), key=lambda s: s.busy_ms)
        assert best.ops >= 1 and best.busy_ms > 0.5, best


def test_a_dataset_records_one_batch_the_first_or_the_one_asked_for():
    f = tfshard.parallelize(tf.sin, devices=FOUR, output_device="cpu:0")
    dataset = tf.data.Dataset.from_tensor_slices(_rows(10)).batch(4)
    assert [s.rows for s in f.timeline(dataset).shards] == [1, 1, 1, 1]
    last = f.timeline(dataset, batch_index=2)  # the last batch: 2 rows
    assert [s.rows for s in last.shards] == [1, 1, 0, 0]
    samples = tf.data.Dataset.from_tensor_slices(_rows(10))
    assert [s.rows for s in f.timeline(samples, batch_size=8).shards] == [2, 2, 2, 2]
    with pytest.raises(tfshard.ArgumentError, match=r"has no batch 3 \(it has fewer than 4\)"):
        f.timeline(dataset, batch_index=3)
    with pytest.raises(tfshard.ArgumentError, match=r"batch_size= is for a tf.data.Dataset"):
        f.timeline(_rows(4), batch_size=2)


def test_batch_index_is_for_a_dataset_and_takes_numpy_integers():
    f = tfshard.parallelize(tf.sin, devices=FOUR, output_device="cpu:0")
    with pytest.raises(tfshard.ArgumentError, match=r"timeline\(\.\.\., batch_index=\.\.\.\): "
                       r"batch_index= is for a tf.data.Dataset; with tensors"):  # fmt: skip
        f.timeline(_rows(4), batch_index=3)
    dataset = tf.data.Dataset.from_tensor_slices(_rows(10)).batch(4)
    last = f.timeline(dataset, batch_index=np.int64(2))  # the last batch: 2 rows
    assert [s.rows for s in last.shards] == [1, 1, 0, 0]
    with pytest.raises(tfshard.ArgumentError, match=r"batch_index=np.True_: the batch to record"):
        f.timeline(dataset, batch_index=np.True_)


def test_a_keras_models_dataset_of_x_and_y_records_x():
    model = tf.keras.Sequential([tf.keras.Input([8]), tf.keras.layers.Dense(4)])
    f = tfshard.parallelize(model, devices=FOUR[:2], output_device="cpu:0")
    pairs = (np.ones([6, 8], np.float32), np.zeros([6]))
    dataset = tf.data.Dataset.from_tensor_slices(pairs).batch(6)
    assert [s.rows for s in f.timeline(dataset).shards] == [3, 3]


def test_tables_and_a_critical_section_end_as_the_call_leaves_them():
    """A function that captures resources other than variables is recorded (issue 30), and
    what its call writes is written, once: the record is the call."""
    keys = tf.constant(["a", "b", "c"])
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(keys, tf.constant([1.0, 2.0, 3.0])), -1.0
    )
    mutable = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=-1)
    mutable.insert(keys, tf.constant([7, 8, 9], tf.int64))
    vocabulary = tf.keras.layers.StringLookup(vocabulary=["a", "c"])
    counted = tf.Variable(0.0)
    section = tf.CriticalSection()

    def look(words):
        found = table.lookup(words) + tf.cast(mutable.lookup(words) + vocabulary(words), tf.float32)
        mutable.insert(words, tf.zeros_like(mutable.lookup(words)))
        section.execute(lambda: counted.assign_add(tf.cast(tf.size(words), tf.float32)))
        return found

    f = tfshard.parallelize(look, devices=FOUR[:3], per_sample=False, output_device="cpu:0")
    timeline = f.timeline(tf.constant(["a", "b", "z", "c", "a", "b"]))
    assert [s.rows for s in timeline.shards] == [2, 2, 2]
    assert all(s.ops > 0 for s in timeline.shards)
    # Each word the call saw is set to 0 in the mutable table; each row counted once.
    assert mutable.lookup(tf.constant(["a", "b", "c", "z"])).numpy().tolist() == [0, 0, 0, 0]
    assert counted.numpy() == 6.0


def test_a_function_reading_a_queue_is_recorded():
    queue = tf.queue.FIFOQueue(4, tf.float32, shapes=[[]])
    queue.enqueue(1.0)
    f = tfshard.parallelize(
        lambda x: x * tf.cast(queue.size(), x.dtype),
        devices=FOUR[:2],
        per_sample=False,
        output_device="cpu:0",
    )
    timeline = f.timeline(np.ones([4], np.float32))
    assert [s.rows for s in timeline.shards] == [2, 2]
    assert all(s.ops > 0 for s in timeline.shards)


def test_a_profile_of_your_own_running_is_named_with_the_fix(pure_four, tmp_path):
    tf.profiler.experimental.start(str(tmp_path))
    try:
        with pytest.raises(
            tfshard.TfshardError,
            match=r"dense_stack.timeline\(\): TensorFlow's profiler is already running .*"
            r"stop your trace first \(tf.profiler.experimental.stop\(\)\)",
        ):
            pure_four.timeline(_rows(8))
    finally:
        tf.profiler.experimental.stop()
    assert [s.rows for s in pure_four.timeline(_rows(8)).shards] == [2, 2, 2, 2]


def test_the_xspace_fields_are_tensorflows():
    """The fields the timeline decodes have the numbers and types of TSL's xplane.proto."""
    xplane = pytest.importorskip(
        "tensorflow.tsl.profiler.protobuf.xplane_pb2", reason="TF's own XSpace classes"
    )
    ours = timeline_lib.xspace_message().DESCRIPTOR
    theirs = xplane.XSpace.DESCRIPTOR
    checked = 0

    def repeated(field):  # protobuf 7 has no `label`
        if hasattr(field, "is_repeated"):
            return field.is_repeated
        return field.label == field.LABEL_REPEATED

    def same(a, b):
        nonlocal checked
        for field in a.fields:
            other = b.fields_by_name[field.name]
            assert (field.number, field.type, repeated(field)) == (
                other.number,
                other.type,
                repeated(other),
            ), field.full_name
            checked += 1
            if field.message_type is not None:
                same(field.message_type, other.message_type)

    same(ours, theirs)
    assert checked >= 20


def test_auto_weights_are_recorded_with_the_plan_in_use():
    f = tfshard.parallelize(tf.identity, devices=FOUR[:2], weights="auto", output_device="cpu:0")
    assert [s.rows for s in f.timeline(np.ones([6], np.float32)).shards] == [3, 3]


def test_parallelism_is_busy_over_span():
    def shard(k, start, end):
        return timeline_lib.Shard(
            device=DEVICES[k],
            start_ms=start,
            end_ms=end,
            busy_ms=end - start,
            intervals=((start, end),),
            ops=1,
            index=k,
            rows=1,
        )

    def made(*spans):
        shards = tuple(shard(k, a, b) for k, (a, b) in enumerate(spans))
        return timeline_lib.Timeline("f", shards, None, (), 10.0, 0.0)

    assert made((0, 4), (4, 8)).parallelism == pytest.approx(1.0)
    assert made((0, 4), (0, 4), (0, 4)).parallelism == pytest.approx(3.0)
    assert made((0, 4), (2, 6)).parallelism == pytest.approx(8 / 6)


# ------------------------------------------------------------------ GPUs


def _gpu_record_of(f, x):
    """The timeline of a warm call of `f` on `x`."""
    f(x)
    return f.timeline(x)


def test_a_gpu_records_its_kernels_and_the_copy_of_an_input_on_the_host(one_gpu):
    f = _pure(["gpu:0"])
    with tf.device("/cpu:0"):
        x = tf.constant(_rows(4096))
    timeline = _gpu_record_of(f, x)
    shard = timeline.shards[0]
    assert shard.device == "/device:GPU:0"
    assert shard.ops > 0 and 0 < shard.busy_ms <= timeline.total_ms
    copies = {c.device: c for c in timeline.copies}
    # The input crosses to the GPU: a host-to-device memcpy of its bytes, with its time.
    assert copies["/device:GPU:0"].bytes_in >= 4096 * WIDTH * 4
    assert copies["/device:GPU:0"].ms > 0


def test_an_input_living_on_the_gpu_is_not_copied_from_the_host(one_gpu):
    # The same call twice, the input on the host, then on the GPU: only the first
    # copies the input (issue 38: a replay fed it from the host either way).
    f = _pure(["gpu:0"])
    rows = _rows(4096)
    received = []
    for where in ("/cpu:0", "/gpu:0"):
        with tf.device(where):
            x = tf.constant(rows)
        timeline = _gpu_record_of(f, x)
        received.append(sum(c.bytes_in or 0 for c in timeline.copies))
    assert received[0] - received[1] >= rows.nbytes, received


def test_two_gpus_record_each_shard_on_its_gpu(two_gpus):
    f = _pure(["gpu:0", "gpu:1"])
    with tf.device("/gpu:0"):
        x = tf.constant(_rows(4096))
    timeline = _gpu_record_of(f, x)
    assert [s.device for s in timeline.shards] == ["/device:GPU:0", "/device:GPU:1"]
    assert [s.rows for s in timeline.shards] == [2048, 2048]
    assert all(s.ops > 0 and s.busy_ms > 0 for s in timeline.shards)
    assert timeline.gather is not None and timeline.gather.device == "/device:GPU:0"
    copies = {c.device: c for c in timeline.copies}
    # GPU:1 takes its rows in and sends its result back.
    assert copies["/device:GPU:1"].tensors_in >= 1 and copies["/device:GPU:1"].tensors_out >= 1


def test_a_gpu_profile_names_the_op_of_each_kernel(one_gpu, tmp_path):
    """What the timeline reads on a GPU: kernels on the GPU's plane, each naming its op."""
    f = _pure(["gpu:0"])
    with tf.device("/gpu:0"):
        x = tf.constant(_rows(1024))
    f(x)
    tf.profiler.experimental.start(str(tmp_path))
    try:
        f(x)
        tf.test.experimental.sync_devices()
    finally:
        tf.profiler.experimental.stop()
    space = timeline_lib.xspace_message()()
    space.ParseFromString(next(tmp_path.glob("plugins/profile/*/*.xplane.pb")).read_bytes())
    named = []
    for plane in space.planes:
        if plane.name != "/device:GPU:0":
            continue
        stat_names = {entry.key: entry.value.name for entry in plane.stat_metadata}
        for line in plane.lines:
            for event in line.events:
                for stat in event.stats:
                    if stat_names.get(stat.metadata_id) == "tf_op":
                        named.append(stat_names.get(stat.ref_value) or stat.str_value)
    assert any(op.startswith("tfshard_shard_0/") for op in named), sorted(set(named))[:20]


# ------------------------------------------ a GPU's record, read on any machine

GPUS = [f"/device:GPU:{k}" for k in range(4)]
DATA = Path(__file__).resolve().parent / "data"


def _recorded(tmp_path, variant):
    """The timeline of one call recorded on an H100 split into 4 logical GPUs (2026-11-24).

    tfshard's graph of that day, 40 x (matmul by a [256, 256] constant, tanh) per
    shard, 256 rows of 256 float32 each, the input on GPU:0 and the results gathered
    there. Shard 0's ops carry its scope; shards 1-3 call one shared trace, whose
    kernels name no shard. `variant` "pure", or "uniform": the function also draws
    ``tf.random.uniform``, which made shards 1-3 run one after another (read from the
    raw trace by hand that day: ../shared/gpu/README.md, "Second probe").
    """
    path = tmp_path / f"{variant}.xplane.pb"
    path.write_bytes(gzip.decompress((DATA / f"gpu_{variant}.xplane.pb.gz").read_bytes()))
    function = {"pure": "__inference_body_1083", "uniform": "__inference_body_2098"}[variant]
    return timeline_lib.read(path, function, devices=GPUS, output=GPUS[0], rows=[256] * 4)


@pytest.mark.parametrize("variant", ["pure", "uniform"])
def test_a_gpu_record_puts_every_shards_kernels_on_its_logical_gpu(tmp_path, variant):
    # One card split in four has one plane: each kernel is its shard's by its name's
    # scope or by the run that launched it, never by the plane.
    timeline = _recorded(tmp_path, variant)
    assert [s.device for s in timeline.shards] == GPUS
    assert [s.rows for s in timeline.shards] == [256] * 4
    kernels = [s.ops for s in timeline.shards]
    assert kernels[0] >= 80 and len(set(kernels)) == 1, kernels  # each: 40 matmuls, 40 tanh
    assert all(0 < s.busy_ms <= s.end_ms - s.start_ms for s in timeline.shards)


def test_a_gpu_record_counts_each_shards_rows_in_and_result_out(tmp_path):
    timeline = _recorded(tmp_path, "pure")
    copies = {c.device: c for c in timeline.copies}
    piece = 256 * 256 * 4  # a shard's rows, and its result, in bytes
    for device in GPUS[1:]:
        c = copies[device]
        # Its rows and its guard's predicate (one bool, from the host) in, its result out.
        assert (c.bytes_in, c.bytes_out) == (piece + 1, piece)
        assert c.tensors_in >= 1 and c.tensors_out >= 1 and c.ms > 0
    # The other shards' results, gathered, and shard 0's predicate; the other shards' rows out.
    assert copies[GPUS[0]].bytes_in == 3 * piece + 1
    assert copies[GPUS[0]].bytes_out >= 3 * piece


def test_a_gpu_record_shows_shards_running_at_once_or_in_turn(tmp_path):
    pure = _recorded(tmp_path, "pure").shards
    for a in pure:
        for b in pure:
            assert a.start_ms < b.end_ms, (a, b)  # every pair overlaps
    _, one, two, three = _recorded(tmp_path, "uniform").shards
    assert one.end_ms <= two.start_ms and two.end_ms <= three.start_ms


def test_a_gpu_record_leaves_out_kernels_that_are_not_the_calls(tmp_path):
    # Another function's kernel on a shard's stream, during the call and before it: it
    # names no op of the call and no run of the call launched it.
    space = timeline_lib.xspace_message()()
    space.ParseFromString(gzip.decompress((DATA / "gpu_pure.xplane.pb.gz").read_bytes()))
    plane = next(p for p in space.planes if p.name == "/device:GPU:0")
    stat = {entry.value.name: entry.key for entry in plane.stat_metadata}
    line = max(plane.lines, key=lambda line: len(line.events))  # a compute stream
    line.timestamp_ns -= 10**9  # its events as they were, from a second earlier on
    for event in line.events:
        event.offset_ps += 10**12
    # A kernel inside the call (1 us after the stream's first), one a second before it.
    for offset_ps in (line.events[0].offset_ps + 10**6, 0):
        event = line.events.add(metadata_id=line.events[0].metadata_id, duration_ps=10**6)
        event.offset_ps = offset_ps
        event.stats.add(metadata_id=stat["tf_op"], str_value="model/dense/MatMul:MatMul")
        event.stats.add(metadata_id=stat["correlation_id"], uint64_value=10**9 + offset_ps)
    path = tmp_path / "foreign.xplane.pb"
    path.write_bytes(space.SerializeToString())
    reference = _recorded(tmp_path, "pure")
    timeline = timeline_lib.read(
        path, "__inference_body_1083", devices=GPUS, output=GPUS[0], rows=[256] * 4
    )
    assert [s.ops for s in timeline.shards] == [s.ops for s in reference.shards]
    assert timeline.total_ms == pytest.approx(reference.total_ms)


def test_a_function_the_record_does_not_hold_is_named(tmp_path):
    _recorded(tmp_path, "pure")
    with pytest.raises(tfshard.TfshardError, match="no op of the call"):
        timeline_lib.read(
            tmp_path / "pure.xplane.pb", "__inference_typo_1", devices=GPUS, output=GPUS[0]
        )


def test_reading_a_profile_that_is_not_there_names_the_path(tmp_path):
    with pytest.raises(tfshard.ArgumentError, match="no such file or directory"):
        timeline_lib.read(tmp_path / "nothing", "f", devices=GPUS, output=GPUS[0])


# ------------------------------------------------------------------ plot


def test_plot_writes_a_png_with_a_lane_per_device(pure_four, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra: pip install matplotlib")
    path = tmp_path / "timeline.png"
    pure_four.timeline(_rows(256)).plot(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_plot_without_matplotlib_names_the_install(pure_four, tmp_path, monkeypatch):
    timeline = pure_four.timeline(_rows(8))
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(tfshard.TfshardError, match=r"pip install matplotlib .*tfshard\[plot\]"):
        timeline.plot(tmp_path / "timeline.png")
    assert not (tmp_path / "timeline.png").exists()


@pytest.mark.parametrize("path", [None, 3, b"timeline.png", ["timeline.png"]])
def test_plot_names_a_path_that_is_not_one(pure_four, path):
    timeline = pure_four.timeline(_rows(8))
    with pytest.raises(tfshard.ArgumentError, match=r"plot: path=.* of type .*; pass the file"):
        timeline.plot(path)


# --------------------------------------------------------------- example


@pytest.fixture(scope="module")
def example():
    """examples/timeline.py, imported with its flags (set aside if another module has them)."""
    values = flags.FLAGS
    names = {"virtual_devices", "devices", "contexts", "rows", "layers", "width"}
    names |= {"shared_counter", "plot"}
    aside = {}
    for name in names & set(values):
        flag = values[name]
        aside[name] = (
            flag,
            values.find_module_defining_flag(name),
            values.find_module_id_defining_flag(name),
        )
        delattr(values, name)
    if not values.is_parsed():
        values.mark_as_parsed()
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES))
        try:
            common = importlib.import_module("_common")
            yield types.SimpleNamespace(common=common, timeline=importlib.import_module("timeline"))
        finally:
            for name in names & set(values):
                delattr(values, name)
            for name in ("_common", "timeline"):
                sys.modules.pop(name, None)
            for name, (flag, module, module_id) in aside.items():
                values[name] = flag
                if module is not None:
                    values.register_flag_by_module(module, flag)
                if module_id is not None:
                    values.register_flag_by_module_id(module_id, flag)


def test_example_record_equals_the_plan_and_its_function_numpy(example):
    f = example.timeline.build(FOUR[:2], layers=3, width=16)
    x = example.timeline.make_rows(9, 16)
    timeline = example.timeline.record(f, x)
    assert [s.rows for s in timeline.shards] == [5, 4]
    # The function it records is the dense stack it says it is.
    rng = np.random.default_rng(0)
    want = x
    for _ in range(3):
        want = np.tanh(want @ (rng.standard_normal((16, 16)) / 4.0).astype(np.float32))
    np.testing.assert_allclose(f(x).numpy(), want, rtol=1e-5, atol=1e-6)


def test_example_main_prints_a_timeline_and_turns(example, capsys, tmp_path):
    with flagsaver.as_parsed(
        virtual_devices="4", rows="512", layers="20", width="128", shared_counter="true"
    ):
        example.timeline.main(["timeline.py"])
    out = capsys.readouterr().out
    assert "layers_fn: one call, 512 rows on 4 devices" in out
    for device in DEVICES:
        assert device in out
    assert "the shards ran about one after another" in out
    assert "each waited for the shared counter" in out


def test_example_flags_are_key_flags_with_help(example):
    listed = {f.name: f.help for f in flags.FLAGS.get_key_flags_for_module(example.timeline)}
    assert set(listed) == {
        "virtual_devices",
        "devices",
        "contexts",
        "rows",
        "layers",
        "width",
        "shared_counter",
        "plot",
    }
    assert all(text and text.strip() for text in listed.values()), listed


def test_example_help_answers_before_tensorflow_loads():
    script = EXAMPLES / "timeline.py"
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(script)!r}, '--help']\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('tensorflow loaded:', 'tensorflow' in sys.modules, file=sys.stderr)\n"
    )
    result = children.python(code)
    assert "--shared_counter" in result.stdout
    assert "tensorflow loaded: False" in result.stderr, result.stderr[-2000:]
