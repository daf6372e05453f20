r"""Embed a corpus too large to hold on every device at once, straight to disk, resumably.

``f.write(dataset, path)`` streams the dataset through the parallelized
function one global batch at a time and writes the embeddings to
``PATH/output.npy`` in input order as they are computed, so memory holds the
batches in flight, not the result. Stop it (Ctrl-C, or kill it) and run the
same command again: it resumes after the last batch that reached the disk and
computes what is missing (and the last batch on disk again, to check it); run it
once more and it computes nothing new (its first batch again, to check it). The
script then reads the file back with NumPy alone (memory-mapped) and checks
rows of it against NumPy's own embedding.

    python examples/write_embeddings.py                       # 200,000 rows to ./embeddings
    python examples/write_embeddings.py --rows=2000000 --path=/data/emb --progress
    python examples/write_embeddings.py --virtual_devices=4 --batch_size=8192
    python examples/write_embeddings.py --overwrite           # replace what ./embeddings holds

A path that holds another write (another function's, or of other ``--rows``
or ``--batch_size``) is refused, not mixed: ``--overwrite`` replaces it.

Copy it with ``_common.py`` and ``_mlp.py`` (in examples/), which it imports.
"""

from __future__ import annotations

import os
import sys
import time

import _common
import _mlp
import numpy as np
from _common import tf
from absl import app, flags

import tfshard

FEATURES, HIDDEN, DIM = 256, 512, 512

_VIRTUAL_DEVICES = _common.define_virtual_devices_flag()
_ROWS = flags.DEFINE_integer("rows", 200_000, "How many samples to embed.", lower_bound=0)
_PATH = flags.DEFINE_string(
    "path", "embeddings", "The directory to write (made if missing; run again to resume)."
)
_OVERWRITE = flags.DEFINE_bool(
    "overwrite",
    False,
    "Replace a write --path holds (another function's, or of other --rows or --batch_size) "
    "instead of refusing it; the default resumes or checks the same write.",
)
_BATCH_SIZE = _common.define_batch_size_flag(
    4096, "Samples per global batch, split across the devices."
)
_PROGRESS = _common.define_progress_flag(
    True, "Progress lines on stderr: rows done, rate, time left."
)


def make_params(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of the embedding MLP, ``FEATURES -> HIDDEN -> DIM``."""
    return _mlp.make_params(FEATURES, HIDDEN, DIM, seed)


def samples(rows: int, batch_size: int) -> tf.data.Dataset:
    """The corpus: `rows` samples of FEATURES floats, made in the pipeline, in batches.

    Batch k is a stateless random draw seeded by k, the same on every run, so a
    resumed run sees the same batches in the same order, as `write` needs.
    """

    def batch_of(index: tf.Tensor) -> tf.Tensor:  # [b] indices -> [b, FEATURES]
        seed = tf.stack([index[0] // batch_size, tf.constant(0, tf.int64)])
        return tf.random.stateless_normal([tf.size(index), FEATURES], seed)

    return tf.data.Dataset.range(rows).batch(batch_size).map(batch_of)


def sample_rows(indices: list[int], batch_size: int) -> np.ndarray:
    """Samples by index, as `samples` makes them: [len(indices), FEATURES]."""
    rows = []
    for i in indices:
        batch = tf.random.stateless_normal([batch_size, FEATURES], [i // batch_size, 0])
        rows.append(batch[i % batch_size].numpy())
    return np.stack(rows)


def build(devices: list[str]) -> tfshard.ShardedFunction:
    """One sample's embedding on `devices`, its weights copied whole to each."""
    return tfshard.parallelize(_mlp.embed, devices=devices, broadcast=("params",))


def write_embeddings(
    f: tfshard.ShardedFunction,
    params: dict[str, np.ndarray],
    rows: int,
    path: str,
    batch_size: int,
    progress: bool = False,
    overwrite: bool = False,
) -> tfshard.writing.Written:
    """Embeds `rows` samples to `path` (resuming a write there, or replacing it with
    `overwrite`); what was written."""
    params = {name: tf.constant(value) for name, value in params.items()}
    return f.write(
        samples(rows, batch_size), path, params, progress=progress, overwrite=overwrite
    )


def check(path: str, params: dict[str, np.ndarray], batch_size: int, count: int = 3) -> float:
    """Reads ``path/output.npy`` with NumPy alone and embeds its first and last `count`
    samples with NumPy; the largest difference."""
    embeddings = np.load(os.path.join(path, "output.npy"), mmap_mode="r")  # nothing read yet
    rows = len(embeddings)
    indices = sorted({*range(min(count, rows)), *range(max(rows - count, 0), rows)})
    if not indices:
        return 0.0
    x = sample_rows(indices, batch_size)
    hidden = np.maximum(x @ params["w1"] + params["b1"], 0.0)
    want = hidden @ params["w2"]
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    return float(np.max(np.abs(embeddings[indices] - want)))


# tfshard's fixes for a path that holds another write, said as this script's flags.
FLAG_WORDS = (
    ("write it again with overwrite=True (f.write(dataset, path, overwrite=True))",
     "run again with --overwrite"),
    ("overwrite=True", "--overwrite"),
    ("write to another path", "give another --path"),
)  # fmt: skip


def main(argv: list[str]) -> None:
    del argv
    with _common.exit_on_error(FLAG_WORDS):
        setup = _common.setup_devices(_VIRTUAL_DEVICES.value)
        print(setup.note)
        print(f"devices: {', '.join(setup.devices)}")
        f, params = build(setup.devices), make_params()
        rows, path = _ROWS.value, _PATH.value
        again = " without --overwrite" if _OVERWRITE.value else ""
        print(
            f"embedding {rows} samples with an MLP {FEATURES} -> {HIDDEN} -> {DIM} into "
            f"{path}/ in global batches of {_BATCH_SIZE.value} (Ctrl-C, then run again"
            f"{again}: it resumes)"
        )
        start = time.perf_counter()
        try:
            written = write_embeddings(
                f, params, rows, path, _BATCH_SIZE.value, _PROGRESS.value, _OVERWRITE.value
            )
        except KeyboardInterrupt:  # what is on disk stays: the progress lines say how much
            sys.exit(f"interrupted; run the same command again{again} to resume")
        seconds = time.perf_counter() - start
        size = os.path.getsize(os.path.join(path, "output.npy"))
        if written.computed_rows == 0 and written.rows:
            how = "it was written already: computed nothing"
        elif written.computed_rows < written.rows:
            how = f"resumed: computed the last {written.computed_rows} rows in {seconds:.1f} s"
        else:
            how = f"computed all of them in {seconds:.1f} s"
        print(
            f"{path}/output.npy holds {written.rows} embeddings "
            f"({size / 2**20:.1f} MiB, {written.batches} batches); {how}"
        )
        print(
            "read back with NumPy alone (np.load(..., mmap_mode='r')): its first and last "
            f"rows match NumPy's embedding to {check(path, params, _BATCH_SIZE.value):.2g}"
        )


if __name__ == "__main__":
    app.run(main)
