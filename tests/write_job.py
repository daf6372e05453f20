"""The job tests/test_writing.py interrupts: one function and data for the test and its children.

Run as a script, it is a child process that writes the job and dies at one
chosen point (``python tests/write_job.py SCENARIO PATH LOG``): SIGKILL
before the first batch, inside the function, half way through a batch's data,
after some of a commit's headers, half way through the manifest's temporary
file; SIGINT inside the function; or a file size limit. Every point is
reached by counting calls, so it is the same point on every run. The
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


def _kill_at(function, n: int, before=None, sig=signal.SIGKILL):  # noqa: ANN001, ANN202
    """`function`, dying by `sig` at its `n`-th call (after `before(*args)` if given)."""
    calls = [0]

    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == n:
            if before is not None:
                before(*args, **kwargs)
            os.kill(os.getpid(), sig)
        return function(*args, **kwargs)

    return wrapped


def main(scenario: str, path: str, log: str) -> None:
    import tfshard

    tfshard.virtual_devices(2)
    from tfshard import writing

    writing.COMMIT_SECONDS = 0  # a commit after every batch: the points below are exact
    shard_calls = [0]
    on_call = lambda rows: shard_calls.__setitem__(0, shard_calls[0] + 1)  # noqa: E731
    # Two shards a batch and one commit after each: batch 3 begins at shard call 5, its
    # commit is the fourth manifest written (the first is the empty one), and its headers
    # are marks 13..16 (four files made at the first batch, four marks per commit, in
    # leaf order: n.values, n.row_lengths, row, y); its data, appends 9..12.
    if scenario == "before_first_batch":
        on_call = _kill_at(on_call, 1)
    elif scenario == "mid_compute":
        on_call = _kill_at(on_call, 5)
    elif scenario == "mid_data":  # batch 3: n's values, half of its row lengths
        append = writing._Column.append
        half = lambda self, array, at: append(self, array[: len(array) // 2], at)  # noqa: E731
        writing._Column.append = _kill_at(append, 10, before=half)
    elif scenario == "mid_header":  # batch 3's data synced, n's two headers rewritten, not y's
        writing._Column.mark = _kill_at(writing._Column.mark, 14, writing._Column.mark)
    elif scenario == "mid_manifest":  # half of batch 3's manifest in the temporary file
        replace = writing._replace

        def half_written(target, data):  # noqa: ANN001, ANN202
            directory, name = os.path.split(target)
            with open(os.path.join(directory, writing._temporary(name)), "wb") as out:
                out.write(data[: len(data) // 2])

        writing._replace = _kill_at(replace, 4, before=half_written)
    elif scenario == "sigint":
        on_call = _kill_at(on_call, 5, sig=signal.SIGINT)
    elif scenario != "full_disk":
        raise SystemExit(f"unknown scenario {scenario!r}")
    if scenario == "full_disk":
        _full_disk(path, log)
        return
    with open(log, "w") as progress:
        try:
            make_scored(on_call).write(dataset(), path, progress=progress)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            return
    print("finished", flush=True)


def _full_disk(path: str, log: str) -> None:
    """Writes of the wide job under a file size limit: with a known length, and without."""
    import resource

    from tfshard.errors import WriteError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write gets EFBIG, not death
    header, row = 128, WIDE * 4
    resource.setrlimit(resource.RLIMIT_FSIZE, (header + 20 * row, resource.RLIM_INFINITY))
    f = make_scored(lambda rows: None)
    report = {}
    for name, unknown in (("known", False), ("unknown", True)):
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
