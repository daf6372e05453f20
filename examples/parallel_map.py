r"""Embed N samples with a small MLP on every device at once, and time it.

The function is written for one sample; `tfshard.parallelize` splits the
samples across the devices, runs the shards concurrently in one graph and
gathers the embeddings back in input order. The script prints the plan, the
throughput, and the speed-up over the same function on one device, measured
in the same run (warm-up first, median of --repeats runs).

    python examples/parallel_map.py                        # GPUs, else 2 logical CPUs
    python examples/parallel_map.py --virtual_devices=4 --weights=2,1,1,1
    python examples/parallel_map.py --contexts='dev0->cpu:0;dev1->cpu:1' \
        --devices=dev0,dev1
    python examples/parallel_map.py --batch_size=4096 --progress   # a tf.data stream

Copy it with ``_common.py`` and ``_mlp.py`` (in examples/), which it imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import _common
import _mlp
import numpy as np
from _common import tf
from absl import app, flags

import tfshard

FEATURES, HIDDEN, DIM = 256, 1024, 128

_VIRTUAL_DEVICES = _common.define_virtual_devices_flag()
_DEVICES = _common.define_devices_flag()
_CONTEXTS = _common.define_contexts_flag()
_REPEATS = _common.define_repeats_flag()
_NUM_SAMPLES = flags.DEFINE_integer(
    "num_samples", 65536, "How many samples to embed.", lower_bound=0
)
_BATCH_SIZE = _common.define_batch_size_flag(
    None,
    "Stream the samples as a tf.data.Dataset in global batches of this many (each "
    "split across the devices). Default: one call on the whole array.",
)
_WEIGHTS = flags.DEFINE_list(
    "weights",
    None,
    "Relative device speeds, one per device (e.g. 3,1): shard sizes follow them. "
    "Default: an even split.",
)
_PROGRESS = _common.define_progress_flag(
    False, "Print a progress line with samples/s while streaming (needs --batch_size)."
)


def _check_weights(values: list[str] | None) -> bool:
    for value in values or ():
        try:
            float(value)
        except ValueError:
            raise flags.ValidationError(
                f"{value!r} is not a number; give one number per device, e.g. 3,1"
            ) from None
    return True


flags.register_validator("weights", _check_weights)
flags.register_multi_flags_validator(
    ["progress", "batch_size"],
    lambda values: not values["progress"] or values["batch_size"] is not None,
    "--progress reports on a stream of batches; give --batch_size too",
)


def make_params(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of the embedding MLP, ``FEATURES -> HIDDEN -> DIM``."""
    return _mlp.make_params(FEATURES, HIDDEN, DIM, seed)


def make_samples(n: int, seed: int = 1) -> np.ndarray:
    """``n`` random samples, [n, FEATURES] float32."""
    return np.random.default_rng(seed).standard_normal((n, FEATURES), dtype=np.float32)


def build(
    devices: Sequence[str], weights: Sequence[float] | None = None
) -> tfshard.ShardedFunction:
    """`embed` on `devices`, its weights copied whole to each device."""
    return tfshard.parallelize(_mlp.embed, devices=devices, weights=weights, broadcast=("params",))


class Measurement(NamedTuple):
    """One run of the embedding on every device and on the first device alone."""

    outputs: np.ndarray  # [N, DIM], from the run on every device
    seconds: float  # median on every device
    one_device_seconds: float  # median on devices[0]
    max_abs_diff: float  # between the two runs' outputs

    @property
    def speedup(self) -> float:
        return self.one_device_seconds / self.seconds


def measure(
    f: tfshard.ShardedFunction,
    x: np.ndarray,
    params: dict[str, np.ndarray],
    batch_size: int | None = None,
    repeats: int = 5,
) -> Measurement:
    """Times `f` on `x` against the same function on its first device alone.

    Args:
      f: the parallelized embedding (`build`).
      x: the samples, [N, FEATURES].
      params: the MLP weights.
      batch_size: None to embed `x` in one call; else stream it as an
        unbatched `tf.data.Dataset` that tfshard batches into global batches.
      repeats: timed runs per measurement (median, after a warm-up).

    Returns:
      The outputs, both times, and how far apart the two runs' outputs are.
    """
    one = build(f.devices[:1])
    params = {k: tf.constant(v) for k, v in params.items()}
    if batch_size is None:

        def run(fn: tfshard.ShardedFunction) -> tf.Tensor:
            return fn(x, params)

    else:
        dataset = tf.data.Dataset.from_tensor_slices(x)

        def run(fn: tfshard.ShardedFunction) -> tf.Tensor:
            return fn(dataset, params, batch_size=batch_size)

    seconds = _common.median_seconds(lambda: run(f), repeats)
    one_seconds = _common.median_seconds(lambda: run(one), repeats)
    outputs = run(f).numpy()
    diff = float(np.max(np.abs(outputs - run(one).numpy()), initial=0.0))
    return Measurement(outputs, seconds, one_seconds, diff)


def most_similar(
    f: tfshard.ShardedFunction,
    x: np.ndarray,
    params: dict[str, np.ndarray],
    batch_size: int,
    query: int = 0,
    progress: bool = False,
) -> tuple[int, float]:
    """The sample whose embedding is closest to sample `query`'s, streaming.

    Embeds the samples batch by batch with `f.iterate` and keeps only the best
    match so far, so the embeddings never all sit in memory at once.

    Returns:
      The index of the most similar other sample, and its cosine similarity.
    """
    target = f(x[query : query + 1], params)[0]  # [DIM], unit length
    best, best_cosine, start = -1, -np.inf, 0
    dataset = tf.data.Dataset.from_tensor_slices(x)
    for batch in f.iterate(dataset, params, batch_size=batch_size, progress=progress):
        cosine = tf.linalg.matvec(batch, target).numpy()  # [B, DIM] -> [B]
        if start <= query < start + len(cosine):
            cosine[query - start] = -np.inf  # not itself
        if len(cosine) and cosine.max() > best_cosine:
            best, best_cosine = start + int(cosine.argmax()), float(cosine.max())
        start += len(cosine)
    return best, best_cosine


def main(argv: list[str]) -> None:
    del argv
    with _common.exit_on_error():
        setup = _common.setup_devices(_VIRTUAL_DEVICES.value, _DEVICES.value, _CONTEXTS.value)
        print(setup.note)
        print(f"devices: {', '.join(setup.devices)}")
        weights = [float(w) for w in _WEIGHTS.value] if _WEIGHTS.value else None
        f = build(setup.devices, weights)
        params = make_params()
        x = make_samples(_NUM_SAMPLES.value)
        batch_size = _BATCH_SIZE.value
        print(f"embedding {len(x)} samples with an MLP {FEATURES} -> {HIDDEN} -> {DIM}")
        if batch_size is None:
            print(f.explain(x, params))
        else:
            print(f"as a tf.data.Dataset in global batches of {batch_size}; one batch:")
            print(f.explain(x[:batch_size], params))
        result = measure(f, x, params, batch_size, _REPEATS.value)
        n, k = len(x), len(f.devices)
        print(
            f"throughput: {n / result.seconds:,.0f} samples/s on {k} device(s) "
            f"({result.seconds * 1e3:.1f} ms, median of {_REPEATS.value})"
        )
        print(
            f"one device: {n / result.one_device_seconds:,.0f} samples/s on {f.devices[0]} "
            f"({result.one_device_seconds * 1e3:.1f} ms)"
        )
        ideal = _common.ideal_speedup(f.devices)
        print(f"speed-up:   {result.speedup:.2f}x over one device ({ideal})")
        print(f"outputs match the one-device run's: max |difference| {result.max_abs_diff:.2g}")
        if batch_size is not None and len(x) > 1:
            index, cosine = most_similar(f, x, params, batch_size, progress=_PROGRESS.value)
            print(
                f"streamed with {f.__name__}.iterate: the sample most like sample 0 is "
                f"{index} (cosine {cosine:.3f})"
            )


if __name__ == "__main__":
    app.run(main)
