"""f.timeline(x): TensorFlow's record of one call, on the 4 logical CPU devices of conftest.py.

Parallelism is a measurement on 2 cores that other processes may share: each
check takes the best of a few timelines (contention only lowers it; a chained
function cannot rise above 1.0 however the cores are shared), with margins.
"""

import importlib
import subprocess
import sys
import types
from pathlib import Path

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
    rng = np.random.default_rng(seed)
    return [
        tf.constant((rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32))
        for _ in range(layers)
    ]


def _rows(n, seed=1):
    return np.random.default_rng(seed).standard_normal((n, WIDTH), dtype=np.float32)


def _pure(devices, **options):
    weights = _layers()

    def dense_stack(sample):  # [WIDTH] -> [WIDTH]
        for w in weights:
            sample = tf.tanh(tf.linalg.matvec(w, sample, transpose_a=True))
        return sample

    return tfshard.parallelize(dense_stack, devices=devices, **options)


def _best_parallelism(f, x, tries=3):
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

    f = tfshard.parallelize(layers_then_count, devices=FOUR, per_sample=False)
    f.counter = counter
    return f


# ------------------------------------------------------------ parallelism


def test_pure_function_on_four_devices_runs_at_once(pure_four):
    # 2 cores: the bound is 2.0; a quiet machine measures ~1.8.
    assert _best_parallelism(pure_four, _rows(2048)) >= 1.5


def test_one_device_has_parallelism_about_one():
    f = _pure(["cpu:1"])
    timelines = [f.timeline(_rows(1024)) for _ in range(3)]
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


def test_timeline_leaves_the_functions_variables_as_they_were(every_shard_writes_one_counter):
    f = every_shard_writes_one_counter
    before = float(f.counter.numpy())
    f.timeline(_rows(64))
    assert float(f.counter.numpy()) == before
    f(_rows(64))  # a real call does write it
    assert float(f.counter.numpy()) != before


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
    timelines = [f.timeline(_rows(2048)) for _ in range(3)]
    assert [s.rows for s in timelines[0].shards] == f.plan(2048) == [1280, 256, 256, 256]
    ratios = [t.shards[0].busy_ms / max(s.busy_ms for s in t.shards[1:]) for t in timelines]
    assert max(ratios) > 2.0, ratios


def test_copies_count_each_shards_rows_in_and_its_result_out(pure_four):
    n = 1000
    timeline = pure_four.timeline(_rows(n))
    sizes = pure_four.plan(n)
    copies = {c.device: c for c in timeline.copies}
    for k in (1, 2, 3):
        c = copies[DEVICES[k]]
        row_bytes = sizes[k] * WIDTH * 4
        # Its result, to the gather on CPU:0 (and, traced in place, a cond's predicate).
        assert 0 <= c.bytes_out - row_bytes <= 16
        # Its rows, the 20 weight matrices it reads, and its row count.
        assert 0 <= c.bytes_in - (row_bytes + 20 * WIDTH * WIDTH * 4 + 4) <= 16
        assert c.ms is None  # logical CPU devices share memory: no copy, no time
    assert 0 <= copies[DEVICES[0]].bytes_in - sum(sizes[1:]) * WIDTH * 4 <= 16


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
    # Sizes in binary units, as explain and nvidia-smi give them: shards 1..3 each take
    # in their rows and the 20 weight matrices (5 MiB) and send out 2 or 3 rows (KiB).
    copies = {c.device: c for c in timeline.copies}
    for device in DEVICES[1:]:
        c = copies[device]
        line = next(line for line in lines if line.split()[:1] == [device])
        assert line.split()[1:5] == [
            f"{c.bytes_in / 2**20:.1f}",
            "MiB",
            f"{c.bytes_out / 2**10:.1f}",
            "KiB",
        ]


def test_shards_traced_in_place_with_replicas_are_recorded_alike():
    # With replicas every shard traces in place (no shared trace): its ops carry
    # its scope, and its cond is lowered, so no graph op names the edges.
    devices = ["cpu:3", "cpu:2", "cpu:1"]
    f = tfshard.parallelize(lambda s: tf.tanh(s * scale), devices=devices)
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
        # Its outputs, and the few bytes of its cond's predicate.
        assert 0 <= copies[device].bytes_out - 100 * WIDTH * 4 <= 16
        assert copies[device].bytes_in >= 100 * WIDTH * 4


def test_an_empty_batch_and_a_batch_smaller_than_the_devices(pure_four):
    timeline = pure_four.timeline(_rows(2))
    assert [s.rows for s in timeline.shards] == [1, 1, 0, 0]
    assert "2 rows on 4 devices" in str(timeline)
    empty = pure_four.timeline(_rows(0))
    assert [s.rows for s in empty.shards] == [0, 0, 0, 0]


def test_a_keras_model_is_recorded_with_its_weights_untouched():
    model = tf.keras.Sequential([tf.keras.Input([8]), tf.keras.layers.Dense(4)])
    before = [w.copy() for w in model.get_weights()]
    f = tfshard.parallelize(model, devices=FOUR[:2])
    timeline = f.timeline(np.ones([16, 8], np.float32))
    assert [s.rows for s in timeline.shards] == [8, 8]
    assert all(s.ops > 0 for s in timeline.shards)
    for w, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, b)


def test_compiled_shards_count_their_one_kernel_as_busy():
    # With XLA each shard is one call whose ops the record does not list.
    f = _pure(FOUR, jit_compile=True)
    timeline = f.timeline(_rows(256))
    assert [s.rows for s in timeline.shards] == [64, 64, 64, 64]
    for s in timeline.shards:
        assert s.ops >= 1 and s.busy_ms > 0.5, s


def test_a_dataset_records_one_batch_the_first_or_the_one_asked_for():
    f = tfshard.parallelize(tf.sin, devices=FOUR)
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


def test_a_keras_models_dataset_of_x_and_y_records_x():
    model = tf.keras.Sequential([tf.keras.Input([8]), tf.keras.layers.Dense(4)])
    f = tfshard.parallelize(model, devices=FOUR[:2])
    pairs = (np.ones([6, 8], np.float32), np.zeros([6]))
    dataset = tf.data.Dataset.from_tensor_slices(pairs).batch(6)
    assert [s.rows for s in f.timeline(dataset).shards] == [3, 3]


def test_lookup_tables_and_critical_sections_are_copied_and_left_as_they_were():
    """A function that captures resources other than variables is recorded (issue 30)."""
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
        mutable.insert(words, tf.zeros_like(mutable.lookup(words)))  # writes go to the copy
        section.execute(lambda: counted.assign_add(tf.reduce_sum(found)))
        return found

    f = tfshard.parallelize(look, devices=FOUR[:3], per_sample=False)
    timeline = f.timeline(tf.constant(["a", "b", "z", "c", "a", "b"]))
    assert [s.rows for s in timeline.shards] == [2, 2, 2]
    assert all(s.ops > 0 for s in timeline.shards)
    assert mutable.lookup(keys).numpy().tolist() == [7, 8, 9] and counted.numpy() == 0.0
    # The copies hold what the tables held: the recorded run finds what a call finds.
    read = tfshard.parallelize(
        lambda w: table.lookup(w) + tf.cast(mutable.lookup(w) + vocabulary(w), tf.float32),
        devices=FOUR[:3],
        per_sample=False,
    )
    words = tf.constant(["a", "b", "z", "c"])
    concrete = read.get_concrete_function(words)
    graph, feeds, setup = timeline_lib._replay(concrete, [words], "read")
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(setup.ops, setup.feeds)
        got = session.run(graph.get_tensor_by_name(concrete.outputs[0].name), feeds)
    np.testing.assert_array_equal(got, read(words).numpy())
    np.testing.assert_array_equal(got, [9.0, 10.0, -2.0, 14.0])


def test_a_resource_it_cannot_copy_is_refused_naming_its_ops():
    queue = tf.queue.FIFOQueue(4, tf.float32, shapes=[[]])
    f = tfshard.parallelize(
        lambda x: x * tf.cast(queue.size(), x.dtype), devices=FOUR[:2], per_sample=False
    )
    with pytest.raises(tfshard.ArgumentError, match=r"used by QueueSizeV2.*a queue, iterator"):
        f.timeline(np.ones([4], np.float32))


def test_auto_weights_are_recorded_with_the_plan_in_use():
    f = tfshard.parallelize(tf.identity, devices=FOUR[:2], weights="auto")
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
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=EXAMPLES.parent,
    )
    assert "--shared_counter" in result.stdout
    assert "tensorflow loaded: False" in result.stderr, result.stderr[-2000:]
