"""The job tests/test_writing.py interrupts: one function and data for the test and its children.

Run as a script, it is a child process that writes the job and dies at one
chosen point (``python tests/write_job.py SCENARIO PATH LOG``): SIGKILL
before the first batch, inside the function, part way through batch 3's data
(its row ids written, its ``y`` rows not), after some of its commit's headers
(``n``'s, not ``y``'s), with its manifest written to the temporary file and
not yet renamed, or in an ``overwrite=True`` of another function's write
once the new manifest is there and the old write's files are not yet removed;
SIGINT inside the function; or a file size limit. The points
in the function are reached by counting its calls; those in the store, by
what the files on disk show, checked at every statement of tfshard's store
(`_when_the_disk_shows`), so each is the same point on every run. The
children commit after every batch (`tfshard.writing.COMMIT_SECONDS = 0`), so
what they commit before dying is known; the resumed writes in the test
process commit on the default clock.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

ROWS, BATCH = 45, 8  # 6 batches, the last of 5
FEATURES = 3
WIDE = 64  # the full-disk child's features: a file of rows outgrows its manifest


def inputs(features: int = FEATURES) -> np.ndarray:
    return np.arange(ROWS * features, dtype=np.float32).reshape(ROWS, features)


def dataset(features: int = FEATURES, unknown_length: bool = False):  # noqa: ANN201
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(inputs(features))
    if unknown_length:  # 30 of the 45 rows, in batches of 8, 8, 8, 6; cardinality unknown
        ds = ds.filter(lambda row: tf.cast(row[0], tf.int64) % (3 * features) != 0)
    return ds.batch(BATCH)


def make_scored(on_call, devices=("/device:CPU:0", "/device:CPU:1")):  # noqa: ANN001, ANN201
    """The job: two dense outputs (one the row's global index) and a ragged one per row;
    `on_call(rows)` runs once per shard."""
    import tensorflow as tf

    import tfshard

    def count(rows):  # noqa: ANN001, ANN202
        on_call(int(rows))
        return rows

    def scored(x):  # noqa: ANN001, ANN202
        seen = tf.py_function(count, [tf.shape(x)[0]], tf.int32)
        with tf.control_dependencies([seen]):
            lengths = tf.cast(x[:, 0], tf.int64) % 4
            ragged = tf.RaggedTensor.from_row_lengths(tf.repeat(x[:, 1], lengths), lengths)
            # Each row's global index: a resume must count on from the rows on disk.
            return {"y": x * 2.0 + 1.0, "n": ragged, "row": tfshard.row_index()}

    return tfshard.parallelize(scored, per_sample=False, devices=list(devices))


def _kill_at(function, n: int, sig=signal.SIGKILL):  # noqa: ANN001, ANN202
    """`function`, dying by `sig` at its `n`-th call."""
    calls = [0]

    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), sig)
        return function(*args, **kwargs)

    return wrapped


def row_on_disk(path: str, file: str, row: int, dtype) -> np.ndarray:  # noqa: ANN001
    """Row `row` of a `.npy` file of `dtype` rows, as written, whatever its header counts;
    empty where the file is shorter, or holds zeros there (a reservation, not a row)."""
    try:
        with open(os.path.join(path, file), "rb") as stream:
            np.lib.format.read_magic(stream)
            shape = np.lib.format.read_array_header_1_0(stream)[0]
            width = int(np.prod(shape[1:]))
            stream.seek(stream.tell() + row * width * np.dtype(dtype).itemsize)
            values = np.fromfile(stream, dtype, count=width)
    except FileNotFoundError:
        return np.zeros([0], dtype)
    return values if len(values) == width and values.any() else np.zeros([0], dtype)


def header_rows(path: str, file: str) -> int | None:
    """The rows a `.npy` file's header counts (None: no file yet)."""
    try:
        with open(os.path.join(path, file), "rb") as stream:
            np.lib.format.read_magic(stream)
            return np.lib.format.read_array_header_1_0(stream)[0][0]
    except FileNotFoundError:
        return None


def _when_the_disk_shows(shard_calls: list[int], shown) -> None:  # noqa: ANN001
    """SIGKILL at the first statement of tfshard's store, once batch 3 is computed (shard
    call 5), after which `shown()` is true of the files on disk (a `sys.settrace` tracer)."""
    from tfshard import writing

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        if frame.f_code.co_filename != writing.__file__:
            return None
        if event == "line" and shard_calls[0] >= 5 and shown():
            os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    sys.settrace(tracer)


def make_old(devices=("/device:CPU:0", "/device:CPU:1")):  # noqa: ANN001, ANN201
    """Another function whose write the job replaces (``overwrite=True``): files of other
    names (``old.npy``) and one of the job's (``y.npy``)."""
    import tfshard

    return tfshard.parallelize(lambda x: {"old": -x, "y": x}, devices=list(devices))


def _when_the_overwrite_shows_both(path: str) -> None:
    """SIGKILL at the first statement of tfshard's store after which the new write's
    manifest is on disk and the old write's ``old.npy`` is still there."""
    from tfshard import writing

    def shown() -> bool:
        try:
            with open(os.path.join(path, "manifest.json")) as manifest:
                new = json.load(manifest)["function"] == "scored"
        except (OSError, ValueError):
            return False
        return new and os.path.exists(os.path.join(path, "old.npy"))

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        if frame.f_code.co_filename != writing.__file__:
            return None
        if event == "line" and shown():
            os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    sys.settrace(tracer)


def main(scenario: str, path: str, log: str) -> None:
    import tfshard

    tfshard.virtual_devices(2)
    from tfshard import writing

    writing.COMMIT_SECONDS = 0  # a commit after every batch: the points below are exact
    shard_calls = [0]
    on_call = lambda rows: shard_calls.__setitem__(0, shard_calls[0] + 1)  # noqa: E731
    # Two shards a batch and one commit after each: batch 3 begins at shard call 5. The
    # store writes the leaves' files in leaf order: n.values, n.row_lengths, row, y.
    if scenario == "before_first_batch":
        on_call = _kill_at(on_call, 1)
    elif scenario == "mid_compute":
        on_call = _kill_at(on_call, 5)
    elif scenario == "mid_data":  # batch 3's row ids on disk, its y rows not yet
        _when_the_disk_shows(
            shard_calls,
            lambda: row_on_disk(path, "row.npy", 16, np.int64).tolist() == [16]
            and not row_on_disk(path, "y.npy", 16, np.float32).size,
        )
    elif scenario == "mid_header":  # batch 3's data synced, n's headers rewritten, not y's
        _when_the_disk_shows(shard_calls, lambda: header_rows(path, "n.row_lengths.npy") == 24)
    elif scenario == "mid_manifest":  # batch 3's manifest written, not yet renamed over the old
        temporary = os.path.join(path, ".manifest.json.tmp")
        _when_the_disk_shows(
            shard_calls, lambda: os.path.exists(temporary) and os.path.getsize(temporary) > 0
        )
    elif scenario == "mid_make":  # overwrite=True: its manifest there, the old files too
        make_old().write(dataset(), path)
        _when_the_overwrite_shows_both(path)
    elif scenario == "sigint":
        on_call = _kill_at(on_call, 5, sig=signal.SIGINT)
    elif scenario != "full_disk":
        raise SystemExit(f"unknown scenario {scenario!r}")
    if scenario == "full_disk":
        _full_disk(path, log)
        return
    with open(log, "w") as progress:
        try:
            overwrite = scenario == "mid_make"
            make_scored(on_call).write(dataset(), path, progress=progress, overwrite=overwrite)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            return
    print("finished", flush=True)


def _full_disk(path: str, log: str) -> None:
    """Writes of the wide job under a file size limit: with a known length, without, and
    without with commits only after the first batch and on the way out ("uncommitted")."""
    import resource

    from tfshard import writing
    from tfshard.errors import WriteError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write gets EFBIG, not death
    header, row = 128, WIDE * 4
    resource.setrlimit(resource.RLIMIT_FSIZE, (header + 20 * row, resource.RLIM_INFINITY))
    f = make_scored(lambda rows: None)
    report = {}
    for name, unknown in (("known", False), ("unknown", True), ("uncommitted", True)):
        writing.COMMIT_SECONDS = 1e9 if name == "uncommitted" else 0
        try:
            f.write(dataset(WIDE, unknown), os.path.join(path, name))
            report[name] = None
        except WriteError as error:
            report[name] = {
                "message": str(error),
                "errno": error.errno,
                "is_os_error": isinstance(error, OSError),
            }
    with open(log, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
