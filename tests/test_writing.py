"""f.write(dataset, path) and tfshard.load: outputs on disk in order, and resumes after crashes.

References: the same function's in-memory result on the dataset, ``f(dataset)``
(the traced loop and its TensorList gather, not the Python loop write uses),
NumPy for the job of tests/write_job.py, and an uninterrupted write of the
same job, which every interrupted and resumed write must equal byte for byte.
The interruptions are real: child processes (write_job.py) killed by SIGKILL
at points reached by counting calls or chosen by what the files on disk show,
stopped by SIGINT, and refused by a file size limit; a disk that fills (the
manifest's temporary file becomes /dev/full); each is resumed here and
counted, row by row, through a `tf.py_function` in the function.
"""

import collections
import io
import json
import os
import pathlib
import signal
import subprocess
import sys

import numerics
import numpy as np
import pytest
import tensorflow as tf
import write_job
from children import as_in_a_terminal
from children import environ as child_environ

import tfshard
from tfshard import writing
from tfshard.errors import ArgumentError, WriteError

CPUS = [f"/device:CPU:{i}" for i in range(4)]
REPO = pathlib.Path(__file__).resolve().parents[1]


def rng_data(rows, features):
    """[rows, features] float32 normal values, the same for the same shape in any test order."""
    return np.random.default_rng(rows * 100 + features).normal(size=[rows, features]).astype(
        np.float32
    )


def _equal(got, want):
    """`got` (what load gave) equals `want` (f(dataset)), leaf by leaf, in structure."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key in want:
            _equal(got[key], want[key])
    elif isinstance(want, tuple | list):
        assert type(got).__name__ == type(want).__name__, (type(got), type(want))
        assert getattr(got, "_fields", None) == getattr(want, "_fields", None)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _equal(a, b)
    elif isinstance(want, tf.RaggedTensor):
        assert isinstance(got, tf.RaggedTensor)
        assert got.to_list() == want.to_list()
    else:
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype.as_numpy_dtype
        np.testing.assert_array_equal(got, want.numpy())


Pair = collections.namedtuple("Pair", "low high")

OUTPUTS = {
    "dense": lambda s: tf.tanh(s) * 3.0,
    "dict": lambda s: {"emb": s * 2.0, "sq": tf.reduce_sum(s * s), "id": tf.cast(s[0], tf.int32)},
    "nested": lambda s: (s, {"pair": Pair(s[:1], tf.cast(s > 0, tf.uint8))}),
    "ragged": lambda s: {"r": tf.range(tf.cast(tf.abs(s[0]) * 3, tf.int32)), "d": s},
}


@pytest.mark.parametrize(
    ("outputs", "length"),
    [("dense", "known"), ("dict", "unknown"), ("nested", "known"), ("ragged", "unknown")],
)
def test_write_then_load_equals_the_call_on_the_dataset(tmp_path, outputs, length):
    f = tfshard.parallelize(OUTPUTS[outputs], devices=CPUS[:3])
    x = rng_data(23, 4)
    ds = tf.data.Dataset.from_tensor_slices(x)
    if length == "unknown":
        ds = ds.filter(lambda s: s[1] > -1.0)
        assert int(ds.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    ds = ds.batch(5)  # the last batch partial
    written = f.write(ds, tmp_path / "out")
    want = f(ds)
    rows = sum(len(batch) for batch in ds)
    assert written == writing.Written(str(tmp_path / "out"), rows, -(-rows // 5), rows)
    _equal(tfshard.load(tmp_path / "out"), want)


def test_a_ragged_output_of_two_ragged_dimensions(tmp_path):
    def nested(s):  # [(k), (j)] per sample: k rows of lengths 0, 1, ..
        k = tf.cast(tf.abs(s[0]) * 3, tf.int64) % 4
        return tf.RaggedTensor.from_row_lengths(tf.range(k * (k - 1) // 2), tf.range(k))

    f = tfshard.parallelize(nested, devices=CPUS[:2], ragged=True)
    ds = tf.data.Dataset.from_tensor_slices(rng_data(11, 2)).batch(4)
    f.write(ds, tmp_path / "deep")
    got, want = tfshard.load(tmp_path / "deep"), f(ds)
    assert got.ragged_rank == want.ragged_rank == 2
    assert got.to_list() == want.to_list()
    names = sorted(os.listdir(tmp_path / "deep"))
    assert names == [
        "manifest.json",
        "output.row_lengths.1.npy",
        "output.row_lengths.2.npy",
        "output.values.npy",
    ]


def test_numpy_reads_the_files_without_tfshard(tmp_path):
    f = tfshard.parallelize(lambda s: {"emb": s * 2.0, "ids": tf.range(tf.cast(s[0], tf.int32))})
    x = np.arange(14, dtype=np.float32).reshape(7, 2) % 4
    f.write(tf.data.Dataset.from_tensor_slices(x), tmp_path / "w", batch_size=3)
    emb = np.load(tmp_path / "w" / "emb.npy", mmap_mode="r")
    np.testing.assert_array_equal(emb, x * 2.0)
    values = np.load(tmp_path / "w" / "ids.values.npy")
    lengths = np.load(tmp_path / "w" / "ids.row_lengths.npy")
    np.testing.assert_array_equal(lengths, x[:, 0].astype(int))
    rows = np.split(values, np.cumsum(lengths)[:-1])
    assert [r.tolist() for r in rows] == [list(range(int(n))) for n in x[:, 0]]
    manifest = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == 7 and manifest["batches"] == 3
    assert isinstance(tfshard.load(tmp_path / "w")["emb"], np.memmap)


def test_every_numeric_dtype_comes_back_exact(tmp_path):
    dtypes = [tf.bfloat16, tf.float16, tf.float64, tf.bool, tf.int8, tf.uint64, tf.complex64]
    f = tfshard.parallelize(lambda s: {d.name: tf.cast(s, d) for d in dtypes}, devices=CPUS[:2])
    ds = tf.data.Dataset.from_tensor_slices(np.arange(9.0).reshape(9, 1) - 3).batch(4)
    f.write(ds, tmp_path / "d")
    got, want = tfshard.load(tmp_path / "d"), f(ds)
    for dtype in dtypes:
        assert got[dtype.name].dtype == dtype.as_numpy_dtype
        np.testing.assert_array_equal(got[dtype.name], want[dtype.name].numpy())


def test_further_arguments_and_batch_size_as_a_call_takes_them(tmp_path):
    f = tfshard.parallelize(
        lambda s, w, scale: tf.linalg.matvec(w, s) * scale, devices=CPUS[:2], broadcast=("w",)
    )
    w, x = rng_data(3, 4), rng_data(10, 4)
    ds = tf.data.Dataset.from_tensor_slices(x)
    f.write(ds, tmp_path / "a", w, batch_size=4, scale=2.0)
    numerics.assert_close(tfshard.load(tmp_path / "a"), 2.0 * x @ w.T, f.devices)


@pytest.mark.parametrize("element", ["x", "(x, y)", "(x, y, w)"])
def test_a_keras_model_writes_what_predict_gives(tmp_path, element):
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(31)
    # Built and predicted on the default device (GPU:0 where there is one), as a user
    # does: there Keras compiles predict with XLA, which reads only local variables.
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    rng = np.random.default_rng(32)
    x = rng.normal(size=(11, 6)).astype(np.float32)
    y, w = rng.integers(0, 3, 11), rng.random(11).astype(np.float32)
    slices = {"x": x, "(x, y)": (x, y), "(x, y, w)": (x, y, w)}[element]
    ds = tf.data.Dataset.from_tensor_slices(slices).batch(4)
    tfshard.parallelize(model, devices=CPUS[:2]).write(ds, tmp_path / "p")
    numerics.assert_close(tfshard.load(tmp_path / "p"), model.predict(ds, verbose=0))


def test_an_empty_dataset_writes_outputs_of_zero_rows(tmp_path):
    f = tfshard.parallelize(lambda s: {"a": s[:2] * 2, "b": tf.range(tf.cast(s[0], tf.int32))})
    ds = tf.data.Dataset.from_tensor_slices(np.zeros([0, 5], np.float32)).batch(4)
    assert f.write(ds, tmp_path / "e").rows == 0
    got = tfshard.load(tmp_path / "e")
    assert got["a"].shape == (0, 2) and got["b"].shape.as_list() == [0, None]


# ------------------------------------------------------------------ refusals


def _counted(features=write_job.FEATURES):
    """The job's function, with the rows it computes counted."""
    rows = []
    return write_job.make_scored(rows.append, CPUS[:2]), rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted writes of the job: the narrow one, and the wide one known and unknown."""
    base = tmp_path_factory.mktemp("reference")
    f, rows = _counted()
    f.write(write_job.dataset(), base / "job")
    assert sum(rows) == write_job.ROWS
    for name, unknown in (("known", False), ("unknown", True)):
        f.write(write_job.dataset(write_job.WIDE, unknown), base / "wide" / name)
    return base


def test_the_job_equals_numpy(reference):
    x = write_job.inputs()
    got = tfshard.load(reference / "job")
    np.testing.assert_array_equal(got["y"], x * 2 + 1)
    lengths = x[:, 0].astype(np.int64) % 4
    assert got["n"].to_list() == [[float(v)] * int(k) for v, k in zip(x[:, 1], lengths)]
    np.testing.assert_array_equal(got["row"], np.arange(write_job.ROWS))


def test_a_finished_write_called_again_computes_only_its_first_batch_to_check_it(
    reference, tmp_path, capsys
):
    f, rows = _counted()
    stream = io.StringIO()
    assert f.write(write_job.dataset(), reference / "job", progress=stream).computed_rows == 0
    assert rows == [4, 4]  # the first batch of 8, on two devices: checked against the disk
    assert "holds all 45 rows already; nothing to compute" in stream.getvalue()


def test_another_function_or_dataset_is_refused_and_overwrite_replaces(reference, tmp_path):
    target = tmp_path / "job"
    f, _ = _counted()
    f.write(write_job.dataset(), target)
    fix = "pass overwrite=True to replace it, or write to another path"
    other = tfshard.parallelize(lambda x: x, per_sample=False, devices=CPUS[:2])
    theirs = f"the write there was made by the function 'scored', not by '<lambda>'; {fix}"
    with pytest.raises(ArgumentError, match=theirs):
        other.write(write_job.dataset(), target)
    six = write_job.dataset(features=6)
    with pytest.raises(ArgumentError, match=r"elements element: TensorSpec\(shape=\(None, 3\)"):
        f.write(six, target)
    five = f"a dataset of 6 batches, this one is of 5 batches; {fix}"
    with pytest.raises(ArgumentError, match=five):
        f.write(write_job.dataset().take(5), target)
    unknown = write_job.dataset().filter(lambda b: True)
    with pytest.raises(ArgumentError, match="this one is of an unknown number of batches; "):
        f.write(unknown, target)
    shuffled = (
        tf.data.Dataset.from_tensor_slices(write_job.inputs())
        .shuffle(45, seed=1, reshuffle_each_iteration=False)
        .batch(8)
    )  # one order, every time
    with pytest.raises(ArgumentError, match=r"first batch differs .* reshuffle_each_iteration"):
        f.write(shuffled, target)
    # overwrite=True: the shuffled rows, in their order, and nothing of the old files left.
    f.write(shuffled, target, overwrite=True)
    np.testing.assert_array_equal(
        tfshard.load(target)["y"], np.concatenate([b.numpy() for b in shuffled]) * 2 + 1
    )
    assert sorted(os.listdir(target)) == sorted(os.listdir(reference / "job"))


def test_another_output_of_the_same_name_is_refused_at_its_first_batch(tmp_path):
    ds = tf.data.Dataset.from_tensor_slices(np.ones([10, 3], np.float32)).batch(4)

    def embed(s):
        return s * 2

    tfshard.parallelize(embed, devices=CPUS[:2]).write(ds.take(2), tmp_path / "e")
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    manifest["complete"] = False  # as if it had stopped after two of three batches
    manifest["dataset"]["batches"] = 3
    (tmp_path / "e" / "manifest.json").write_text(json.dumps(manifest))

    def embed(s):  # noqa: F811  the same name, another output: [N, 3] int32
        return tf.cast(s, tf.int32)

    with pytest.raises(
        ArgumentError,
        match=r"output there is dense float32 \[N, 3\]; this "
        r"function gives dense int32 \[N, 3\]",
    ):
        tfshard.parallelize(embed, devices=CPUS[:2]).write(ds, tmp_path / "e")


def test_what_cannot_be_written_is_refused_before_anything_runs(tmp_path):
    ds = tf.data.Dataset.from_tensor_slices(np.ones([4, 2], np.float32)).batch(2)
    summed = tfshard.parallelize(lambda s: s, devices=CPUS[:2], reduce="sum")
    with pytest.raises(ArgumentError, match=r"reduce='sum' gives one value.*call <lambda>\(dat"):
        summed.write(ds, tmp_path / "s")
    f = tfshard.parallelize(lambda s: s, devices=CPUS[:2])
    with pytest.raises(ArgumentError, match=r"infinite .* \(dataset.take\(n\)\)"):
        f.write(ds.repeat(), tmp_path / "i")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArgumentError, match="is a file; write into a directory"):
        f.write(ds, tmp_path / "file")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    for overwrite in (False, True):  # never a user's files
        with pytest.raises(ArgumentError, match=r"files that are not a tfshard write's \(notes"):
            f.write(ds, tmp_path / "mine", overwrite=overwrite)
    words = tfshard.parallelize(lambda s: tf.strings.as_string(s), devices=CPUS[:2])
    with pytest.raises(ArgumentError, match="tf.string tensor; write stores numbers"):
        words.write(ds, tmp_path / "w")
    with pytest.raises(WriteError, match=r"Not a directory \(.*below\); nothing was written"):
        f.write(ds, tmp_path / "file" / "below")
    assert not (tmp_path / "s").exists() and not (tmp_path / "i").exists()


def test_outputs_whose_row_shape_changes_are_refused_naming_the_leaf(tmp_path):
    x = np.repeat(np.arange(1.0, 4.0, dtype=np.float32), 2)[:, None]  # batch k's rows hold k
    ds = tf.data.Dataset.from_tensor_slices(x).batch(2)
    widens = tfshard.parallelize(
        lambda s: {"x": tf.tile(s, [1, tf.cast(s[0, 0], tf.int32)])},
        per_sample=False,
        devices=CPUS[:1],
    )
    changed = r"output\['x'\] has rows of shape \[2\] in this batch but \[1\] in the first; a file"
    with pytest.raises(ArgumentError, match=changed):
        widens.write(ds, tmp_path / "g")
    assert tfshard.load(tmp_path / "g", partial=True)["x"].tolist() == [[1.0], [1.0]]


def test_load_refuses_a_write_that_has_not_finished_unless_partial(tmp_path):
    with pytest.raises(ArgumentError, match="no manifest.json there"):
        tfshard.load(tmp_path)
    f = tfshard.parallelize(lambda s: s + 1, devices=CPUS[:2])
    ds = tf.data.Dataset.range(10).batch(3)

    def stop(i, b):
        tf.debugging.assert_less(i, tf.constant(2, tf.int64), "stop")
        return b

    failing = tf.data.Dataset.zip((tf.data.Dataset.range(4), ds)).map(stop)
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        f.write(failing, tmp_path / "p")
    assert "tfshard: 6 rows (2 batches) are on disk" in "".join(caught.value.__notes__)
    with pytest.raises(ArgumentError, match=r"has not finished \(6 rows in 2 batches") as not_yet:
        tfshard.load(tmp_path / "p")
    # It cannot tell whether a write runs there now (whose lock refuses another write).
    assert "a write may be running there); once none is, call <lambda>.write(" in str(
        not_yet.value
    )
    assert tfshard.load(tmp_path / "p", partial=True).tolist() == [1, 2, 3, 4, 5, 6]
    # The rows so far are a valid .npy for NumPy too: its header counts them.
    assert np.load(tmp_path / "p" / "output.npy").tolist() == [1, 2, 3, 4, 5, 6]
    assert f.write(ds, tmp_path / "p").computed_rows == 4
    assert tfshard.load(tmp_path / "p").tolist() == list(range(1, 11))


def test_a_second_write_to_a_path_being_written_is_refused(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    (tmp_path / "busy").mkdir()
    held = os.open(tmp_path / "busy", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a write in another process holds it
    f = tfshard.parallelize(lambda s: s, devices=CPUS[:2])
    ds = tf.data.Dataset.range(4).batch(2)
    try:
        with pytest.raises(WriteError, match="another write is running there"):
            f.write(ds, tmp_path / "busy")
    finally:
        os.close(held)
    assert f.write(ds, tmp_path / "busy").rows == 4  # and free once it ends


def test_a_crash_after_the_last_commit_finishes_on_resume(reference, tmp_path, monkeypatch):
    # Every batch committed, the files not yet trimmed nor the write marked done.
    def crash(self):
        raise KeyboardInterrupt

    f, rows = _counted()
    with monkeypatch.context() as patch:
        patch.setattr(writing.Store, "finish", crash)
        with pytest.raises(KeyboardInterrupt):
            f.write(write_job.dataset(), tmp_path / "job")
    manifest = _resume_and_compare(tmp_path / "job", reference / "job", write_job.dataset())
    assert manifest["rows"] == write_job.ROWS and manifest["batches"] == 6


# ---------------------------------------------------------- crashes, resumed


SCENARIOS = (
    "before_first_batch",
    "mid_compute",
    "mid_data",
    "mid_header",
    "mid_manifest",
    "mid_make",
    "sigint",
    "full_disk",
)


@pytest.fixture(scope="module", autouse=True)
def started(tmp_path_factory):
    """Every scenario of write_job.py in its own process, started with this module's first
    test, so that they start TensorFlow while the tests above run; name -> (process, the
    write's directory, its log)."""
    base = tmp_path_factory.mktemp("children")
    env = child_environ(TF_CPP_MIN_LOG_LEVEL="3")
    processes = {}
    for name in SCENARIOS:
        path, log = base / name, base / f"{name}.log"
        command = [sys.executable, str(REPO / "tests" / "write_job.py"), name, str(path), str(log)]
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=as_in_a_terminal,
        )
        processes[name] = (process, path, log)
    yield processes
    for process, _, _ in processes.values():
        process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def children(started):
    """Each scenario's end: name -> (exit status, stdout, stderr, directory, log)."""
    done = {}
    for name, (process, path, log) in started.items():
        out, err = process.communicate(timeout=240)
        done[name] = (process.returncode, out, err, path, log)
    return done


def _files(path):
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def _resume_and_compare(path, reference_path, dataset):
    """Resumes the write at `path`; the rows it computed, checked to be exactly the missing ones."""
    manifest = json.loads((path / "manifest.json").read_text())
    assert not manifest["complete"]
    f, rows = _counted()
    written = f.write(dataset, path)
    assert written.computed_rows == written.rows - manifest["rows"]
    # The missing rows, and the last committed batch again, checked against the disk.
    assert sum(rows) == written.computed_rows + manifest["last_batch_rows"]
    assert _files(path) == _files(reference_path)  # byte for byte, the manifest too
    return manifest


def test_a_write_killed_before_its_first_batch_left_nothing_and_writes_anew(children, reference):
    code, out, err, path, _ = children["before_first_batch"]
    assert code == -signal.SIGKILL, (out, err[-3000:])
    assert not path.exists()  # nothing is made before the first batch's outputs are in hand
    f, rows = _counted()
    assert f.write(write_job.dataset(), path).computed_rows == write_job.ROWS == sum(rows)
    assert _files(path) == _files(reference / "job")


@pytest.mark.parametrize(
    ("scenario", "committed"),
    [
        ("mid_compute", 2),
        ("mid_data", 2),
        ("mid_header", 2),
        ("mid_manifest", 2),
    ],
)
def test_a_write_killed_anywhere_resumes_to_the_uninterrupted_files(
    children, reference, scenario, committed
):
    code, out, err, path, _ = children[scenario]
    assert code == -signal.SIGKILL, (out, err[-3000:])
    leftovers = set(os.listdir(path)) - set(os.listdir(reference / "job"))
    if scenario == "mid_manifest":  # batch 3's count, not renamed; the next commit replaces it
        assert leftovers == {".manifest.json.tmp"}
        assert json.loads((path / ".manifest.json.tmp").read_text())["rows"] == 24
    else:
        assert not leftovers
    if scenario == "mid_data":  # batch 3's row ids on disk, its y rows not
        assert write_job.row_on_disk(path, "row.npy", 16, np.int64).tolist() == [16]
        assert not write_job.row_on_disk(path, "y.npy", 16, np.float32).size
    if scenario == "mid_header":  # n's headers count batch 3; y's and the manifest do not
        assert np.load(path / "n.row_lengths.npy").shape == (24,)
        assert np.load(path / "y.npy").shape == (16, 3)
    manifest = _resume_and_compare(path, reference / "job", write_job.dataset())
    assert manifest["batches"] == committed
    assert manifest["rows"] == 8 * committed


def test_an_overwrite_killed_between_its_manifest_and_the_old_files_removal_resumes(
    children, reference
):
    # Killed in overwrite=True of another function's write (old.npy, y.npy), once the new
    # write's manifest is on disk and before old.npy is removed: the new write, no batch yet.
    code, out, err, path, _ = children["mid_make"]
    assert code == -signal.SIGKILL, (out, err[-3000:])
    assert {"manifest.json", "old.npy"} <= set(os.listdir(path))
    with pytest.raises(ArgumentError, match="the write there has not finished"):
        tfshard.load(path)
    f, rows = _counted()
    assert f.write(write_job.dataset(), path).computed_rows == write_job.ROWS == sum(rows)
    assert _files(path) == _files(reference / "job")  # old.npy gone: it was the old write's
    # And an overwrite of it, as of any write.
    assert f.write(write_job.dataset(), path, overwrite=True).computed_rows == write_job.ROWS
    assert _files(path) == _files(reference / "job")


def test_ctrl_c_stops_a_write_saying_where_and_it_resumes(children, reference):
    code, out, err, path, log = children["sigint"]
    assert (code, out.strip()) == (0, "interrupted"), err[-3000:]
    lines = log.read_text().splitlines()
    assert lines[0].startswith("scored: batch 1/6  8 samples")
    assert lines[-2].startswith("scored: stopped at batch 2/6, 16 samples, after ")
    assert lines[-2].endswith("(KeyboardInterrupt)")
    assert lines[-1] == (
        f"16 rows (2 batches) are on disk in {str(path)!r}; call "
        f"scored.write(dataset, {str(path)!r}) again to resume after them"
    )
    _resume_and_compare(path, reference / "job", write_job.dataset())


def test_a_full_disk_is_a_clear_error_and_the_write_resumes(children, reference):
    code, out, err, path, log = children["full_disk"]
    assert code == 0, err[-3000:]
    report = json.loads(log.read_text())
    # A known length reserves its files first: the limit is met before any batch is written.
    known = report["known"]
    assert known["is_os_error"] and known["errno"] == 27
    assert "File too large" in known["message"] and "y.npy" in known["message"]
    assert "the file size limit (ulimit -f) is reached; raise it" in known["message"]
    assert "0 rows (0 batches) are on disk" in known["message"]
    assert known["message"].endswith("again to resume after them")
    # An unknown length meets it at the third batch; two are committed.
    unknown = report["unknown"]
    assert unknown["errno"] == 27 and "16 rows (2 batches) are on disk" in unknown["message"]
    for name, unknown_length in (("known", False), ("unknown", True)):
        dataset = write_job.dataset(write_job.WIDE, unknown_length)
        wide = write_job.make_scored(lambda rows: None, CPUS[:2])
        before = json.loads((path / name / "manifest.json").read_text())["rows"]
        written = wide.write(dataset, path / name)
        assert written.rows - before == written.computed_rows
        assert _files(path / name) == _files(reference / "wide" / name)


def test_a_batch_half_written_when_the_disk_fills_counts_for_nothing(children, reference):
    # Commits after the first batch and on the way out only: batch 2 is written, not
    # committed, when the file size limit stops batch 3 part way (its row ids written,
    # its y rows cut at the limit). The commit on the way out counts batches 1 and 2 whole,
    # in every file, and none of batch 3.
    code, out, err, path, log = children["full_disk"]
    assert code == 0, err[-3000:]
    report = json.loads(log.read_text())["uncommitted"]
    assert report["errno"] == 27 and "16 rows (2 batches) are on disk" in report["message"]
    stopped = path / "uncommitted"
    assert write_job.row_on_disk(stopped, "row.npy", 16, np.int64).tolist() == [16]  # batch 3's
    dataset = write_job.dataset(write_job.WIDE, unknown_length=True)
    manifest = json.loads((stopped / "manifest.json").read_text())
    parts = [p["rows"] for leaf in manifest["leaves"] for p in leaf["parts"]]
    assert manifest["batches"] == 2 and parts == [0, 16, 16, 16]  # n's values: none (WIDE)
    _resume_and_compare(stopped, reference / "wide" / "unknown", dataset)


# ------------------------------------- a resume is the uninterrupted write (issue 37)


def _everything(s):
    """A per-sample function that reads every feature a resume must carry on: the row's
    global index, its shard, row-keyed random numbers, a ragged output, several leaves."""
    row = tfshard.row_index()
    noise = tf.random.stateless_uniform([2], seed=tf.stack([row, tf.constant(7, tf.int64)]))
    return {
        "y": tf.tanh(s) + noise[0],
        "ids": tf.stack([row, tf.cast(tfshard.shard_index(), tf.int64)]),
        "ragged": tf.range(tf.cast(row % 3, tf.int32)),
    }


def _keras_model():
    keras = tf.keras
    dense = keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(5))
    return keras.Sequential([keras.Input([4]), dense])


def _row_keyed(x):
    """A whole-shard function in chunks of `max_rows`, its weights measured (`"auto"`)."""
    row = tfshard.row_index()
    return {"y": x * 2.0 + tf.cast(row, tf.float32)[:, None], "row": row}


JOBS = {
    # name: (a fresh function, its dataset of three batches, every k-th statement: all of
    # them for the job that reads every feature, a sample for the others)
    "everything": (
        lambda: tfshard.parallelize(_everything, devices=CPUS[:3], weights=[2, 1, 1], ragged=True),
        lambda: tf.data.Dataset.from_tensor_slices(rng_data(13, 4)).batch(5),
        1,
    ),
    "keras": (
        lambda: tfshard.parallelize(_keras_model(), devices=CPUS[:2]),
        lambda: tf.data.Dataset.from_tensor_slices((rng_data(11, 4), np.zeros(11))).batch(4),
        10,
    ),
    "auto_max_rows": (
        lambda: tfshard.parallelize(
            _row_keyed, per_sample=False, devices=CPUS[:2], weights="auto", max_rows=2
        ),
        lambda: tf.data.Dataset.from_tensor_slices(rng_data(13, 3)).batch(6),
        25,
    ),
}


_TFSHARD = os.path.dirname(tfshard.__file__) + os.sep


def _write_code(frame):
    """Whether a frame, at its call, runs a write's code: the store (every function of
    tfshard/writing.py), or a function of tfshard handed the store (the loop that feeds it,
    and what commits on the way out when it stops)."""
    file = frame.f_code.co_filename
    if file == writing.__file__:
        return True
    return file.startswith(_TFSHARD) and any(
        isinstance(value, writing.Store) for value in frame.f_locals.values()
    )


def _on_commit_path(statement):
    """A `sys.settrace` tracer calling `statement(frame)` at each statement of a write's
    code (`_write_code`) that one batch's commit path runs (the second batch's append and
    commit) and the finish runs, up to the store's close."""
    calls = collections.Counter()
    recording = [False]

    def tracer(frame, event, arg):
        if event == "call" and not _write_code(frame):
            return None
        name = frame.f_code.co_name
        if event == "call" and isinstance(frame.f_locals.get("self"), writing.Store):
            if name in ("append", "finish"):
                calls[name] += 1
                recording[0] = (name, calls[name]) in (("append", 2), ("finish", 1))
            elif name == "close":  # the write is over: its files close
                recording[0] = False
        if event == "line" and recording[0]:
            statement(frame)
        return tracer

    return tracer


def _traced(tracer, write):
    sys.settrace(tracer)
    try:
        write()
    finally:
        sys.settrace(None)


def _stop_points(write):
    """The statements of the commit path (`_on_commit_path`) as (code, line), in order."""
    events = []
    _traced(_on_commit_path(lambda frame: events.append((frame.f_code, frame.f_lineno))), write)
    return events


def _stop_at(point, write):
    """`write()`, interrupted by KeyboardInterrupt at the `point`-th statement of the
    commit path (as counted by `_stop_points`), as Ctrl-C would; True if it was."""
    seen = [0]

    def statement(frame):
        seen[0] += 1
        if seen[0] == point:
            sys.settrace(None)
            raise KeyboardInterrupt

    try:
        _traced(_on_commit_path(statement), write)
    except KeyboardInterrupt:
        return True
    return False


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_write_stopped_at_any_statement_of_its_commit_path_resumes_byte_for_byte(
    tmp_path, monkeypatch, job
):
    """Stopped (Ctrl-C) at each statement one batch's append and commit and the finish run,
    then resumed by another function object: the files equal an uninterrupted write's, byte
    for byte, manifest included. The oracle is that uninterrupted write; on e91da92 the row
    ids restarted at 0 and a stop between a batch's data and its count doubled the batch."""
    monkeypatch.setattr(writing, "COMMIT_SECONDS", 0)  # a commit per batch: exact points
    make, dataset, every = JOBS[job]
    reference = tmp_path / "reference"
    events = _stop_points(lambda: make().write(dataset(), reference))
    # Each statement once, where it first runs (a loop's later rounds repeat its first).
    firsts = sorted({event: i + 1 for i, event in reversed(list(enumerate(events)))}.values())
    assert len(firsts) > 40
    points = firsts[::every]
    want = _files(reference)
    stopped = 0
    stopping, resuming = make(), make()  # two objects, as two processes would have
    for point in points:
        path = tmp_path / f"stopped{point}"
        stopped += _stop_at(point, lambda path=path: stopping.write(dataset(), path))
        written = resuming.write(dataset(), path)
        code, line = events[point - 1]
        assert _files(path) == want, f"stopped at {code.co_name}, line {line}"
        assert written.rows == int(json.loads(want["manifest.json"])["rows"])
    assert stopped == len(points)


def test_row_ids_count_on_across_a_resume(tmp_path):
    ds = tf.data.Dataset.range(100).batch(10)
    path = tmp_path / "ids"
    f = tfshard.parallelize(lambda s: tfshard.row_index(), devices=CPUS[:2])
    _stopped_after(f, ds, path, 3)
    g = tfshard.parallelize(lambda s: tfshard.row_index(), devices=CPUS[:2])  # a new process's
    assert g.write(ds, path).computed_rows == 70
    np.testing.assert_array_equal(tfshard.load(path), np.arange(100))


def test_another_function_of_the_same_name_is_refused_even_when_finished(tmp_path):
    ds = tf.data.Dataset.from_tensor_slices(np.ones([40, 3], np.float32)).batch(8)
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:2])
    g = tfshard.parallelize(lambda s: tf.reduce_sum(s, keepdims=True), devices=CPUS[:2])
    f.write(ds, tmp_path / "w")
    with pytest.raises(ArgumentError, match=r"output there is dense float32 \[N, 3\]; this fun"):
        g.write(ds, tmp_path / "w")
    h = tfshard.parallelize(lambda s: s * 3.0, devices=CPUS[:2])  # same outputs, other values
    with pytest.raises(ArgumentError, match=r"first batch computed again differs .* overwrite"):
        h.write(ds, tmp_path / "w")
    assert tfshard.load(tmp_path / "w").tolist() == (np.ones([40, 3]) * 2).tolist()


def test_the_lock_is_held_exactly_while_a_write_runs(tmp_path):
    ds = tf.data.Dataset.from_tensor_slices(np.ones([6, 3], np.float32)).batch(4)
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:2])
    f.write(ds, tmp_path / "w")
    f.write(ds, tmp_path / "w")  # finished: returns having checked its first batch
    g = tfshard.parallelize(lambda s: s + 5.0, devices=CPUS[:2])
    assert g.write(ds, tmp_path / "w", overwrite=True).computed_rows == 6
    with pytest.raises(ArgumentError):
        f.write(ds, tmp_path / "w")  # refused: and the lock goes with the refusal
    assert g.write(ds, tmp_path / "w").computed_rows == 0


def _stopped_after(f, ds, path, batches):
    """A write of `ds` that stopped (Ctrl-C) after committing `batches` batches."""
    calls = []
    original = writing.Store.commit

    def commit(self, *, due):
        original(self, due=False)
        calls.append(1)
        if len(calls) == batches:
            raise KeyboardInterrupt

    writing.Store.commit = commit
    try:
        with pytest.raises(KeyboardInterrupt):
            f.write(ds, path)
    finally:
        writing.Store.commit = original
    assert json.loads((path / "manifest.json").read_text())["batches"] == batches


def test_a_resume_with_changed_data_or_weights_is_refused_not_mixed(tmp_path):
    x = rng_data(40, 3)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(8)
    changed = x.copy()
    changed[8:24] += 1.0  # batches 1 and 2: after the first, which a hash checks
    weights = tf.Variable(tf.ones([3]))
    f = tfshard.parallelize(lambda s: s * weights, devices=CPUS[:2])
    _stopped_after(f, ds, tmp_path / "data", 3)
    with pytest.raises(ArgumentError, match=r"batch 2 computed again differs from what is on di"):
        f.write(tf.data.Dataset.from_tensor_slices(changed).batch(8), tmp_path / "data")
    _stopped_after(f, ds, tmp_path / "weights", 3)
    weights.assign([1.0, 2.0, 3.0])
    with pytest.raises(ArgumentError, match=r"\(its code or weights\)"):
        f.write(ds, tmp_path / "weights")
    weights.assign([1.0, 1.0, 1.0])  # as written: the resume goes on, and nothing is mixed
    assert f.write(ds, tmp_path / "weights").computed_rows == 16
    np.testing.assert_array_equal(tfshard.load(tmp_path / "weights"), x)


def test_an_error_in_the_function_names_the_batch_its_rows_and_how_to_resume(tmp_path):
    def fails_at_row_13(s):
        row = tfshard.row_index()
        tf.debugging.assert_none_equal(row, tf.constant(13, tf.int64), message="bad row")
        return s

    f = tfshard.parallelize(fails_at_row_13, devices=CPUS[:2])
    ds = tf.data.Dataset.range(20).batch(5)
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        f.write(ds, tmp_path / "e")
    message = str(caught.value)
    assert "bad row" in message
    assert "stopped in batch 2 of the dataset, whose rows start at row 10" in message
    assert f"10 rows (2 batches) are on disk in {str(tmp_path / 'e')!r}" in message
    assert "again to resume after them" in message


def _write_args_cases(tmp_path, ds, f):
    target = tmp_path / "new"
    return [
        (lambda: f.write(target, ds), "takes the dataset first, then the path"),
        (lambda: f.write(ds, None), r"path=None is a NoneType; give the directory as a str"),
        (lambda: f.write(ds, 123), "path=123 is a int"),
        (lambda: f.write(ds, b"x"), "path=b'x' is a bytes"),
        (lambda: f.write(ds, ""), "path is empty; name the directory"),
        (lambda: f.write(ds, "a\0b"), r"path='a\\x00b' holds a NUL character"),
        (lambda: f.write(np.ones([4, 2]), target), "takes a tf.data.Dataset first, got ndarray"),
        (lambda: f.write(ds, target, overwrite="no"), "overwrite='no' must be True or False"),
        (lambda: f.write(ds, target, overwrite=1), "overwrite=1 must be True or False"),
        (lambda: f.write(ds, target, progress="yes"), "progress='yes': True for lines on std"),
        (lambda: f.write(ds, target, batched="yes"), "batched='yes' must be True, False or None"),
        (lambda: f.write(ds, target, batch_size=2), r"batch_size=2: the dataset's elements are b"),
        (lambda: f.write(ds.unbatch(), target, batch_size=0), "batch_size=0: the number of samp"),
        (lambda: f.write(ds.unbatch(), target, batch_size="8"), "batch_size='8': the number"),
        (lambda: f.write(ds.unbatch(), target, batch_size=True), "batch_size=True: the number"),
        (lambda: tfshard.load(None), r"path=None is a NoneType"),
        (lambda: tfshard.load(""), "path is empty"),
        (lambda: tfshard.load("a\0b"), "holds a NUL character"),
        (lambda: tfshard.load(tmp_path / "done", partial="no"), "partial='no' must be True or F"),
    ]


def test_every_wrong_argument_of_write_and_load_is_refused_before_anything_is_made(tmp_path):
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:2])
    ds = tf.data.Dataset.from_tensor_slices(np.ones([6, 2], np.float32)).batch(4)
    f.write(ds, tmp_path / "done")
    before = sorted(os.listdir(tmp_path))
    for run, message in _write_args_cases(tmp_path, ds, f):
        with pytest.raises(tfshard.TfshardError, match=message):
            run()
        assert sorted(os.listdir(tmp_path)) == before, message  # nothing made on disk


def test_numpy_bools_are_taken_for_the_flags(tmp_path):
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:2])
    x = rng_data(6, 2)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(4)
    assert f.write(ds, tmp_path / "w", overwrite=np.False_).computed_rows == 6
    assert f.write(ds, tmp_path / "w", overwrite=np.True_).computed_rows == 6
    np.testing.assert_array_equal(tfshard.load(tmp_path / "w", partial=np.False_), x * 2.0)
    np.testing.assert_array_equal(tfshard.load(tmp_path / "w", partial=np.True_), x * 2.0)


def _damage(path, how):
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    y = path / "output.npy"
    if how == "truncated":  # into the committed rows (an unfinished write reserved more)
        part = manifest["leaves"][0]["parts"][0]
        y.write_bytes(y.read_bytes()[: 128 + part["rows"] * 3 * 4 - 8])
    elif how == "deleted":
        y.unlink()
    elif how == "rows+500":
        manifest["rows"] += 500
        manifest["leaves"][0]["parts"][0]["rows"] += 500
    elif how == "batches-2":
        manifest["batches"] -= 2
    elif how == "dtype":
        manifest["leaves"][0]["parts"][0]["dtype"] = "int32"
    elif how == "missing key":
        del manifest["rows"]
    elif how == "garbage header":
        data = bytearray(y.read_bytes())
        data[10:40] = b"{'descr': '|O', 'fortran_or" + b"xx"
        y.write_bytes(bytes(data))
    elif how == "not json":
        manifest_path.write_text("{")
        return
    manifest_path.write_text(json.dumps(manifest))


DAMAGE = ("truncated", "deleted", "rows+500", "batches-2", "dtype", "missing key",
          "garbage header", "not json")  # fmt: skip


@pytest.mark.parametrize("complete", [True, False], ids=["finished", "unfinished"])
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_or_edited_write_is_refused_naming_what_and_the_fix(tmp_path, how, complete):
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:2])
    x = rng_data(40, 3)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(4)  # 10 batches
    path = tmp_path / "w"
    if complete:
        f.write(ds, path)
    else:
        _stopped_after(f, ds, path, 5)
    _damage(path, how)
    fix = "remove the directory" if how == "not json" else "overwrite=True"
    with pytest.raises(tfshard.TfshardError, match=fix) as caught:
        f.write(ds, path)
    assert "output.npy" in str(caught.value) or "manifest" in str(caught.value) or (
        "computed again differs" in str(caught.value)
    )
    if how != "batches-2":  # the manifest alone cannot tell; the resume's check does
        with pytest.raises(tfshard.TfshardError, match=fix if how == "not json" else "write it a"):
            tfshard.load(path, partial=True)  # the fix write takes
    if how == "not json":  # its files cannot be told from a user's: overwrite refuses too
        with pytest.raises(ArgumentError, match="not a tfshard write's"):
            f.write(ds, path, overwrite=True)
        path = tmp_path / "elsewhere"
    written = f.write(ds, path, overwrite=True)
    assert written.rows == 40
    np.testing.assert_array_equal(tfshard.load(path), x * 2.0)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_manifest_the_full_disk_refuses_leaves_the_headers_at_the_committed_rows(
    tmp_path, monkeypatch
):
    # The disk fills while batch 3 is computed, after batches 1 and 2 are committed: the
    # manifest's temporary file, which a commit writes before it replaces manifest.json,
    # becomes /dev/full, where every write fails as on a full disk (ENOSPC). The data files
    # still take batch 3's rows; the manifest refuses them.
    monkeypatch.setattr(writing, "COMMIT_SECONDS", 0)  # a commit per batch
    path = tmp_path / "w"
    armed = [True]

    def fill_the_disk_at_row_8(rows):
        if armed[0] and 8 in rows.numpy():
            armed[0] = False
            os.symlink("/dev/full", path / ".manifest.json.tmp")
        return rows

    def doubled(x):
        seen = tf.py_function(fill_the_disk_at_row_8, [tfshard.row_index()], tf.int64)
        with tf.control_dependencies([seen]):
            return x * 2.0

    f = tfshard.parallelize(doubled, per_sample=False, devices=CPUS[:2])
    x = rng_data(40, 3)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(4)
    with pytest.raises(WriteError, match=r"the disk is full; free some space; 8 rows \(2 batc"):
        f.write(ds, path)
    assert not armed[0]  # the disk filled where the test meant it to
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["rows"] == 8
    assert np.load(path / "output.npy").shape == (8, 3)  # not batch 3's 12
    os.remove(path / ".manifest.json.tmp")  # space freed
    assert f.write(ds, path).computed_rows == 32
    np.testing.assert_array_equal(tfshard.load(path), x * 2.0)
    f.write(ds, tmp_path / "uninterrupted")
    assert _files(path) == _files(tmp_path / "uninterrupted")  # byte for byte


def test_a_resume_of_a_dataset_that_has_fewer_batches_now_is_refused(tmp_path):
    f = tfshard.parallelize(lambda s: s + 1, devices=CPUS[:2])
    ds = tf.data.Dataset.range(100).batch(10).filter(lambda b: True)  # a length unknown
    _stopped_after(f, ds, tmp_path / "w", 3)
    with pytest.raises(ArgumentError, match=r"holds 3 batches, but the dataset has fewer now"):
        f.write(ds.take(2), tmp_path / "w")
    assert f.write(ds, tmp_path / "w").computed_rows == 70


# ------------------------- nothing on disk before the first batch is written (issue 39)


FAILURES = ("trace", "shape", "string", "key", "run")


def _job(fails=None):
    """The function `job` of this section, as written, or failing before its first batch is
    written: raising while traced ("trace"), a shape error in its trace ("shape"), an output
    no file holds ("string"), outputs no file can be named by ("key": a dict's float keys),
    or an assertion that fails in its first batch's run ("run").
    One name, so that every one of them is checked against a write of the one as written."""

    def job(x):
        if fails == "trace":
            raise ValueError("job fails while traced")
        if fails == "shape":
            x = tf.matmul(x, tf.ones([5, 5]))  # x is [N, 3]
        if fails == "run":
            tf.debugging.assert_less(x, tf.reduce_min(x), message="job fails when it runs")
        y = x * 2.0 + 1.0
        y = tf.strings.as_string(y) if fails == "string" else y
        if fails == "key":
            return {0.5: y, 1.5: tfshard.row_index()}
        return {"y": y, "row": tfshard.row_index()}

    return tfshard.parallelize(job, per_sample=False, devices=CPUS[:2])


def _first_batch_data():
    x = rng_data(20, 3)
    return x, tf.data.Dataset.from_tensor_slices(x).batch(4)  # 5 batches


def _refused_before_its_first_batch(fails, write):
    """`write()` of `_job(fails)`: the error it raises, checked to be one of tfshard's
    that says what failed."""
    with pytest.raises(tfshard.TfshardError) as caught:
        write(_job(fails))
    message = str(caught.value)
    said = {
        "trace": "ValueError: job fails while traced",
        "shape": "Dimensions must be equal, but are 3 and 5",
        "string": "output['y'] is a tf.string tensor; write stores numbers and bools",
        "key": "an output dict has a key 0.5 of type float; write names files by keys",
        "run": "job fails when it runs",
    }[fails]
    assert said in message, message
    if fails != "run":
        assert isinstance(caught.value, ArgumentError)
    return message


def _assert_the_uninterrupted_write(path, tmp_path, x, ds):
    """`path` holds, byte for byte, what `_job` writes of `ds` uninterrupted, and loads as
    NumPy computes it."""
    _job().write(ds, tmp_path / "uninterrupted")
    assert _files(path) == _files(tmp_path / "uninterrupted")
    got = tfshard.load(path)
    np.testing.assert_array_equal(got["y"], x * 2.0 + 1.0)
    np.testing.assert_array_equal(got["row"], np.arange(20))


@pytest.mark.parametrize("fails", FAILURES)
def test_a_write_that_fails_before_its_first_batch_leaves_a_new_path_missing(tmp_path, fails):
    x, ds = _first_batch_data()
    path = tmp_path / "new" / "job"  # its parent is missing too
    message = _refused_before_its_first_batch(fails, lambda f: f.write(ds, path))
    assert os.listdir(tmp_path) == []
    assert f"nothing was written ({str(path)!r} is as it was before this call)" in message
    assert "again" not in message  # calling it again as it is would fail the same way
    if fails == "run":
        assert "stopped in batch 0 of the dataset, whose rows start at row 0" in message
    # Fixed, it writes what an uninterrupted write writes, byte for byte.
    assert _job().write(ds, path).computed_rows == 20
    _assert_the_uninterrupted_write(path, tmp_path, x, ds)


@pytest.mark.parametrize("fails", FAILURES)
def test_a_write_that_fails_before_its_first_batch_leaves_an_unfinished_write_unchanged(
    tmp_path, fails
):
    x, ds = _first_batch_data()
    path = tmp_path / "job"

    def stop(i, batch):  # the dataset fails at batch 2: batches 0 and 1 are on disk
        tf.debugging.assert_less(i, tf.constant(2, tf.int64), "stop")
        return batch

    stopping = tf.data.Dataset.zip((tf.data.Dataset.range(5), ds)).map(stop)
    with pytest.raises(tf.errors.InvalidArgumentError):
        _job().write(stopping, path)
    before = _files(path)
    assert json.loads(before["manifest.json"])["rows"] == 8
    message = _refused_before_its_first_batch(fails, lambda f: f.write(ds, path))
    assert _files(path) == before  # byte for byte, and no other file
    # The last committed batch, computed again to check it, failed.
    assert f"8 rows (2 batches) are on disk in {str(path)!r}, as before this call" in message
    # Fixed, it resumes to what an uninterrupted write writes, byte for byte.
    assert _job().write(ds, path).computed_rows == 12
    _assert_the_uninterrupted_write(path, tmp_path, x, ds)


@pytest.mark.parametrize("fails", FAILURES)
def test_an_overwrite_that_fails_before_its_first_batch_leaves_the_old_write_whole(
    tmp_path, fails
):
    x, ds = _first_batch_data()
    path = tmp_path / "job"
    tfshard.parallelize(lambda s: -s, devices=CPUS[:2]).write(ds, path)  # another function's
    before = _files(path)
    message = _refused_before_its_first_batch(
        fails, lambda f: f.write(ds, path, overwrite=True)
    )
    assert _files(path) == before  # byte for byte, and no other file
    np.testing.assert_array_equal(tfshard.load(path), -x)
    assert f"nothing was written ({str(path)!r} is as it was before this call)" in message
    assert "again" not in message
    # Fixed, it replaces the old write with what an uninterrupted write writes, byte for byte.
    assert _job().write(ds, path, overwrite=True).computed_rows == 20
    _assert_the_uninterrupted_write(path, tmp_path, x, ds)


def test_a_write_to_a_missing_path_that_another_takes_meanwhile_is_refused_at_its_first_batch(
    tmp_path,
):
    # The path is missing when the write opens it; while its first batch is computed,
    # another write takes it, as a write in another process would: it makes the directory
    # and holds its lock (or, in the second case, leaves a finished write there).
    fcntl = pytest.importorskip("fcntl")
    _, ds = _first_batch_data()
    _job().write(ds, tmp_path / "finished")
    finished = _files(tmp_path / "finished")

    def another_write_takes(path, finish):
        """`_job()` as written, but at its first batch another write takes `path`; and the
        other write's lock, while it holds it."""
        held = []

        def take(rows):
            if not held:
                os.mkdir(path)
                held.append(os.open(path, os.O_RDONLY))
                fcntl.flock(held[0], fcntl.LOCK_EX)
                if finish:  # it finished, and its lock went with it
                    for name, data in finished.items():
                        (path / name).write_bytes(data)
                    os.close(held[0])
            return rows

        def job(x):  # the name of the finished write's function
            seen = tf.py_function(take, [tf.shape(x)[0]], tf.int32)
            with tf.control_dependencies([seen]):
                return {"y": x * 2.0 + 1.0, "row": tfshard.row_index()}

        return tfshard.parallelize(job, per_sample=False, devices=CPUS[:2]), held

    running = tmp_path / "running"
    f, held = another_write_takes(running, finish=False)
    try:
        with pytest.raises(WriteError, match="another write is running there"):
            f.write(ds, running)
    finally:
        os.close(held[0])
    assert os.listdir(running) == []  # the other write's directory, as it left it
    done = tmp_path / "done"
    f, _ = another_write_takes(done, finish=True)
    with pytest.raises(WriteError, match=r"another write began in .* while this one computed"):
        f.write(ds, done)
    assert _files(done) == finished
    assert _job().write(ds, done).computed_rows == 0  # that write, checked: it is finished


def test_a_symbolic_link_to_nothing_is_refused_at_open_naming_the_fix(tmp_path):
    # The path, or a missing folder above it, is a link whose target is missing (or a loop
    # of links): making the directory through it would fail, so the write is refused at its
    # open, before anything runs (the function given fails when it runs: it never does).
    _, ds = _first_batch_data()
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for path, link in (
        (tmp_path / "link", tmp_path / "link"),
        (tmp_path / "link" / "a" / "b", tmp_path / "link"),
        (tmp_path / "loop" / "a", tmp_path / "loop"),
    ):
        with pytest.raises(ArgumentError) as caught:
            _job("run").write(ds, path)
        message = str(caught.value)
        assert f"{str(link)!r} is a symbolic link to {os.readlink(link)!r}" in message, message
        assert "make the directory it points to, remove the link" in message, message
        assert "again" not in message
    assert sorted(os.listdir(tmp_path)) == ["link", "loop"]
    # The first fix it names: the directory it points to, made, is written through the link.
    (tmp_path / "nowhere").mkdir()
    assert _job().write(ds, tmp_path / "link" / "a").computed_rows == 20
    _job().write(ds, tmp_path / "uninterrupted")
    assert _files(tmp_path / "nowhere" / "a") == _files(tmp_path / "uninterrupted")


def _states_in_make(path, write):
    """`write()`, and what `path` held at each statement its store's `_make` ran (its own
    and those of what it calls in tfshard/writing.py) and at its return, in order: a dict
    of file name to bytes, or None where `path` was missing. A SIGKILL at a statement
    leaves what the disk holds there (the store writes with `os.write`: nothing waits in
    the process's buffers), so these are the states a kill in `_make` can leave."""
    make = writing.Store._make.__code__
    states = []
    inside = [False]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != writing.__file__:
            return None
        inside[0] = inside[0] or (event == "call" and frame.f_code is make)
        if inside[0] and event in ("line", "return"):
            states.append(_files(path) if path.is_dir() else None)
        if event == "return" and frame.f_code is make:
            inside[0] = False
        return tracer

    _traced(tracer, write)
    return states


@pytest.mark.parametrize("where", ["overwrite", "missing"])
def test_a_write_killed_at_any_statement_of_its_make_leaves_the_old_write_or_the_new(
    tmp_path, where
):
    """Each state a kill in `_make` can leave (`_states_in_make`) under overwrite=True of
    another function's write (old.npy and y.npy, which the job writes too), or of a missing
    path: `load` gives the old write whole or refuses (the new one has no batch), never a
    mix; then the job called again as it was (and an overwrite=True of it) writes what an
    uninterrupted write does, byte for byte. On d3d0766 a kill after the new manifest left
    old.npy, which a later overwrite=True refused as not a write's."""
    x, ds = _first_batch_data()
    _job().write(ds, tmp_path / "uninterrupted")
    want = _files(tmp_path / "uninterrupted")
    path = tmp_path / "job"
    if where == "overwrite":
        tfshard.parallelize(lambda s: {"old": -s, "y": s}, devices=CPUS[:2]).write(ds, path)
    old = _files(path) if path.exists() else None
    states = _states_in_make(path, lambda: _job().write(ds, path, overwrite=where == "overwrite"))
    assert len(states) > 15 and _files(path) == want
    distinct = []
    for state in states:
        if state not in distinct:
            distinct.append(state)
    # The old write whole, then (overwrite) its manifest's temporary, then the new manifest
    # with old.npy and y.npy, then without them.
    assert distinct[0] == old and len(distinct) >= (4 if where == "overwrite" else 3)
    for i, state in enumerate(distinct):
        killed = tmp_path / f"killed{i}"
        if state is not None:
            killed.mkdir()
            for name, data in state.items():
                (killed / name).write_bytes(data)
        try:
            loaded = tfshard.load(killed)
        except ArgumentError as error:  # no write there, or the new one with no batch yet
            assert "no manifest.json there" in str(error) or "has not finished" in str(error)
            loaded = None
        manifest = json.loads((state or {}).get("manifest.json", "null"))
        new = manifest is not None and manifest["function"] == "job"
        if loaded is not None:  # the old write, whole
            assert not new
            np.testing.assert_array_equal(loaded["old"], -x)
            np.testing.assert_array_equal(loaded["y"], x)
            with pytest.raises(ArgumentError, match="made by the function '<lambda>', not by 'j"):
                _job().write(ds, killed)  # another function's write: overwrite=True replaces it
        else:
            assert new or manifest is None  # the new write, or no write there
            assert _job().write(ds, killed).computed_rows == 20, i
            assert _files(killed) == want, i
        assert _job().write(ds, killed, overwrite=True).computed_rows == 20, i
        assert _files(killed) == want, i


def test_a_path_that_cannot_be_made_at_the_first_batch_says_nothing_was_written(tmp_path):
    # The folder above the path is missing at open and a file when the first batch is in
    # hand (another program made it meanwhile): the directory cannot be made, which a call
    # again would meet too, so the error says so without advising one.
    _, ds = _first_batch_data()
    path = tmp_path / "folder" / "job"

    def take(rows):
        if not (tmp_path / "folder").exists():
            (tmp_path / "folder").write_text("a file")
        return rows

    def job(x):
        seen = tf.py_function(take, [tf.shape(x)[0]], tf.int32)
        with tf.control_dependencies([seen]):
            return {"y": x * 2.0 + 1.0, "row": tfshard.row_index()}

    f = tfshard.parallelize(job, per_sample=False, devices=CPUS[:2])
    with pytest.raises(WriteError) as caught:
        f.write(ds, path)
    message = str(caught.value)
    assert caught.value.filename == str(path) and "Not a directory" in message, message
    assert f"nothing was written ({str(path)!r} is as it was before this call)" in message
    assert "again" not in message
    assert os.listdir(tmp_path) == ["folder"] and not path.exists()


@pytest.mark.parametrize("again", ["resumed", "overwritten"])
def test_a_write_stopped_before_its_first_commit_leaves_files_it_removes_again(
    tmp_path, monkeypatch, again
):
    # The first batch's files are made, and the disk is too small for their reservation: the
    # write stops before its first commit. Its manifest names those files as its own, so the
    # write called again (or overwrite=True) removes them and writes the uninterrupted files.
    errno = pytest.importorskip("errno")
    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no reservation on this platform")
    _, ds = _first_batch_data()
    path = tmp_path / "job"

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(os, "posix_fallocate", full)
        with pytest.raises(WriteError, match="the disk is full; free some space"):
            _job().write(ds, path)
    assert {"row.npy", "y.npy", "manifest.json"} <= set(os.listdir(path))
    assert json.loads((path / "manifest.json").read_text())["leaves"] is None
    with pytest.raises(ArgumentError, match="the write there has not finished"):
        tfshard.load(path)
    _job().write(ds, tmp_path / "uninterrupted")
    overwrite = again == "overwritten"
    assert _job().write(ds, path, overwrite=overwrite).computed_rows == 20
    assert _files(path) == _files(tmp_path / "uninterrupted")


def test_a_write_of_no_batch_resumed_with_other_outputs_names_its_files_too(
    tmp_path, monkeypatch
):
    # A write stopped before its first commit, called again under the same function name
    # with other outputs and stopped the same way: its manifest names every file there, so
    # overwrite=True replaces them all and writes what an uninterrupted write does.
    errno = pytest.importorskip("errno")
    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no reservation on this platform")
    _, ds = _first_batch_data()
    path = tmp_path / "job"

    def job(x):  # named as `_job`'s, with other outputs
        return {"other": x * 3.0}

    other = tfshard.parallelize(job, per_sample=False, devices=CPUS[:2])

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(os, "posix_fallocate", full)
        for f in (_job(), other):
            with pytest.raises(WriteError, match="the disk is full; free some space"):
                f.write(ds, path)
    assert sorted(os.listdir(path)) == ["manifest.json", "other.npy"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["leaves"] is None and "other.npy" in manifest["replaces"]
    _job().write(ds, tmp_path / "uninterrupted")
    assert _job().write(ds, path, overwrite=True).computed_rows == 20
    assert _files(path) == _files(tmp_path / "uninterrupted")


def test_a_load_that_another_write_replaces_meanwhile_gives_the_old_write_not_a_mix(tmp_path):
    # Another write overwrites the path (its files of the same names) while a load has read
    # the first leaf and not the second: the load gives the old write whole (it holds its
    # files open), rather than one write's "a" with the other's "b"; loaded again, it gives
    # the new write whole. (tests/test_load.py: an overwrite at every statement of load.)
    x, ds = _first_batch_data()
    path = tmp_path / "job"
    tfshard.parallelize(lambda s: {"a": s, "b": -s}, devices=CPUS[:2]).write(ds, path)
    other = tfshard.parallelize(lambda s: {"a": s + 100.0, "b": -s - 100.0}, devices=CPUS[:2])
    overwritten = []

    def tracer(frame, event, arg):
        if frame.f_code is not writing.load.__code__:
            return None
        if event == "line" and len(frame.f_locals.get("values", ())) == 1 and not overwritten:
            overwritten.append(other.write(ds, path, overwrite=True))
        return tracer

    loaded = []
    _traced(tracer, lambda: loaded.append(tfshard.load(path)))
    assert overwritten and overwritten[0].computed_rows == 20
    np.testing.assert_array_equal(loaded[0]["a"], x)
    np.testing.assert_array_equal(loaded[0]["b"], -x)
    got = tfshard.load(path)
    np.testing.assert_array_equal(got["a"], x + 100.0)
    np.testing.assert_array_equal(got["b"], -x - 100.0)


@pytest.mark.parametrize(
    ("dtype", "change"),
    [(tf.bfloat16, [1.05, 1.05]), (tf.float16, [1.01, 1.01]), (tf.float32, [1.0, 1.0 + 1e-6])],
)
def test_a_resume_refuses_a_change_of_low_precision_or_small_outputs(tmp_path, dtype, change):
    # Weights changed before the resume by a few percent (bfloat16: eps 2**-7), 1% (float16)
    # or, in float32, beside a column of 1e6 (the row's largest value scales the rounding
    # allowed), a relative 1e-6 of the small column: each refused, not mixed; unchanged, the
    # resume goes on to the uninterrupted write (its rows as numpy computes them).
    x = np.random.default_rng(3).uniform(1, 2, size=[40, 2]).astype(np.float32)
    if dtype == tf.float32:
        x[:, 1] = 1e6
    ds = tf.data.Dataset.from_tensor_slices(x).batch(8)
    weights = tf.Variable([1.0, 1.0])
    f = tfshard.parallelize(lambda s: tf.cast(s * weights, dtype), devices=CPUS[:2])
    _stopped_after(f, ds, tmp_path / "w", 3)
    weights.assign(change)
    with pytest.raises(ArgumentError, match="the batch 2 computed again differs from what is on"):
        f.write(ds, tmp_path / "w")
    weights.assign([1.0, 1.0])
    assert f.write(ds, tmp_path / "w").computed_rows == 16
    want = tf.cast(x, dtype).numpy()
    np.testing.assert_array_equal(tfshard.load(tmp_path / "w"), want)


def test_ctrl_c_at_any_statement_of_the_first_batchs_start_stops_and_resumes(tmp_path):
    # Ctrl-C (KeyboardInterrupt) at each statement of the store's start of the first batch
    # (`_start`, `_make`, `_removed`: the files and manifest made, the old write's files
    # removed) in an overwrite=True of another function's write: the write stops with
    # KeyboardInterrupt (on 555ead3 one point gave StopIteration), and called again as it
    # was it writes the uninterrupted files, byte for byte.
    _, ds = _first_batch_data()
    _job().write(ds, tmp_path / "uninterrupted")
    want = _files(tmp_path / "uninterrupted")
    codes = {writing.Store._start.__code__, writing.Store._make.__code__}
    codes.add(writing.Store._removed.__code__)

    def tracer(statement):
        def trace(frame, event, arg):
            if frame.f_code.co_filename != writing.__file__:
                return None
            if event == "line" and frame.f_code in codes:
                statement(frame)
            return trace

        return trace

    def old_write(path):
        tfshard.parallelize(lambda s: {"old": -s, "y": s}, devices=CPUS[:2]).write(ds, path)

    old_write(tmp_path / "counted")
    points = []
    _traced(
        tracer(lambda frame: points.append((frame.f_code.co_name, frame.f_lineno))),
        lambda: _job().write(ds, tmp_path / "counted", overwrite=True),
    )
    firsts = list(dict.fromkeys(points))
    assert len(firsts) > 20
    for point in firsts:
        path = tmp_path / f"stopped_{point[0]}_{point[1]}"
        old_write(path)

        def statement(frame, point=point):
            if (frame.f_code.co_name, frame.f_lineno) == point:
                sys.settrace(None)
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            _traced(tracer(statement), lambda path=path: _job().write(ds, path, overwrite=True))
        _job().write(ds, path, overwrite=True)
        assert _files(path) == want, point


def test_ctrl_c_at_any_statement_of_taking_or_releasing_the_lock_leaves_it_free(tmp_path):
    # Ctrl-C at each statement of the lock's take and release (on 555ead3, one after the
    # flock and one after forgetting it kept the lock for the rest of the process): the
    # write stops, and the next write there in this thread writes, after which the
    # directory's lock is free for another process's (a flock on a fresh descriptor).
    fcntl = pytest.importorskip("fcntl")
    ds = tf.data.Dataset.from_tensor_slices(np.ones([6, 3], np.float32)).batch(4)
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:2])
    codes = {writing._Locks.take.__code__, writing._Locks.release.__code__}

    def tracer(statement):
        def trace(frame, event, arg):
            if frame.f_code not in codes:
                return None
            if event == "line":
                statement(frame)
            return trace

        return trace

    points = []
    record = lambda frame: points.append((frame.f_code.co_name, frame.f_lineno))  # noqa: E731
    _traced(tracer(record), lambda: f.write(ds, tmp_path / "counted"))
    firsts = list(dict.fromkeys(points))
    assert {name for name, _ in firsts} == {"take", "release"} and len(firsts) > 10
    for point in firsts:
        path = tmp_path / f"stopped_{point[0]}_{point[1]}"
        path.mkdir()  # so that the first write takes the lock at its open

        def statement(frame, point=point):
            if (frame.f_code.co_name, frame.f_lineno) == point:
                sys.settrace(None)
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            _traced(tracer(statement), lambda path=path: f.write(ds, path))
        f.write(ds, path)
        assert f.write(ds, path).computed_rows == 0
        free = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(free, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(free)


def test_a_write_started_inside_another_write_there_in_its_thread_is_refused(tmp_path):
    # The outer write's function, traced at its first batch in the caller's thread, starts
    # another write of the same directory (eagerly, under tf.init_scope): it is refused as
    # another process's would be, and the outer write ends with its files and frees the lock
    # (on 51f7629 the inner one took the lock over, and the outer one's close then closed a
    # descriptor it no longer held: EBADF).
    fcntl = pytest.importorskip("fcntl")
    x = rng_data(8, 3)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(4)
    path = tmp_path / "w"
    path.mkdir()  # so that the outer write takes the lock at its open
    inner = tfshard.parallelize(lambda s: s * 3.0, devices=CPUS[:2])
    seen = []

    def outer(s):
        if not seen:
            with tf.init_scope():
                try:
                    seen.append(inner.write(ds, path, overwrite=True))
                except WriteError as error:
                    seen.append(error)
        return s * 2.0

    written = tfshard.parallelize(outer, devices=CPUS[:2]).write(ds, path)
    assert written.rows == 8 and len(seen) == 1, seen
    assert isinstance(seen[0], WriteError), seen
    assert "another write is running there" in str(seen[0])
    np.testing.assert_array_equal(tfshard.load(path), x * 2.0)
    free = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(free, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(free)
    assert inner.write(ds, path, overwrite=True).rows == 8
    np.testing.assert_array_equal(tfshard.load(path), x * 3.0)


def test_a_resume_whose_dict_keys_come_in_another_order_is_refused_showing_the_orders(tmp_path):
    x = rng_data(12, 2)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(4)
    written = tfshard.parallelize(lambda s: {"a": s, "b": -s}, devices=CPUS[:2])
    _stopped_after(written, ds, tmp_path / "w", 1)
    swapped = tfshard.parallelize(lambda s: {"b": -s, "a": s}, devices=CPUS[:2])
    with pytest.raises(ArgumentError) as caught:
        swapped.write(ds, tmp_path / "w")
    message = str(caught.value)
    written, given = "{'a': \"output['a']\", 'b': \"output['b']\"}", "{'b': \"output['b']\", 'a':"
    assert f"the write there has outputs {written}; this function gives {given}" in message
    assert "4 rows (1 batches) are on disk" in message and "as before this call" in message
