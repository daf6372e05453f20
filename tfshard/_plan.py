"""Plan and split: how many rows each shard gets, and those rows cut out of the batch.

The first step of every call and of every batch of a stream: `plan` counts
the rows of the split arguments on the host and turns them into one size per
shard (`plan_sizes`, the same arithmetic as `plan_rows` in Python), and
`split` cuts each argument where it lives::

    [N, ...] --plan (host)--> sizes [K] --split (where x lives)--> K x [n_k, ...]

Sizes come from ``tf.shape(x)[0]`` at run time, so a trace with open rows
serves every batch size (where the rows are static, as in a per-sample
function's graph for its first size, they are constants); all of it is int64
arithmetic on the host, which never waits for a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tfshard import _kinds
from tfshard.errors import INPUTS_DIFFER, ArgumentError

# Integer weights are used as they are; other weights are scaled to integers
# with this total, so a plan is exact integer arithmetic, the same in the graph
# and in `Engine.plan`.
WEIGHT_SCALE = 1 << 24


def integer_weights(weights: Sequence[float] | None) -> tuple[int, ...] | None:
    """Validated weights as non-negative integers with a positive sum."""
    if weights is None:
        return None
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence | np.ndarray):
        raise ArgumentError(f"weights={weights!r}: pass one number per device, e.g. [3, 1]")
    values = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating):
            raise ArgumentError(f"weights[{i}]={w!r} is not a number")
        if math.isnan(w) or math.isinf(w):
            raise ArgumentError(f"weights[{i}]={w!r}: weights must be finite")
        if w < 0:
            raise ArgumentError(f"weights[{i}]={w!r} is negative; weights are relative speeds >= 0")
        values.append(w)
    if not any(w > 0 for w in values):
        raise ArgumentError(
            f"weights={list(weights)!r}: at least one weight must be > 0 "
            "(they are relative device speeds, e.g. [3, 1])"
        )
    if all(float(w).is_integer() for w in values):
        exact = [int(w) for w in values]  # Python ints: their sum cannot overflow
        if sum(exact) <= WEIGHT_SCALE:
            return tuple(exact)
    # Scale by the largest first: a sum of finite floats can overflow to inf.
    top = float(max(values))
    total = math.fsum(float(w) / top for w in values)
    return tuple(round(float(w) / top / total * WEIGHT_SCALE) for w in values)


def plan_sizes(
    n: tf.Tensor, count: int, weights: tuple[int, ...] | tf.Tensor | None
) -> tf.Tensor:
    """Shard sizes for `n` rows on `count` devices, as an int64 vector summing to n.

    Unweighted, sizes differ by at most one and the first ``n % count`` shards
    get the extra row. Weighted, each shard gets the floor of its quota
    ``n * w_k / sum(w)`` and the rows left over go one each to the largest
    remainders (ties to the lower index): largest-remainder rounding. Equal
    weights give the unweighted plan.

    Args:
      n: the rows, a scalar tensor.
      count: the number of shards.
      weights: `integer_weights` as constants of the graph, or as an int64
        ``[count]`` tensor fed at run time (``weights="auto"``, whose weights
        change without a new trace), or None for an even split.
    """
    n = tf.cast(n, tf.int64)
    index = tf.range(count, dtype=tf.int64)
    if weights is None:
        return n // count + tf.cast(index < n % count, tf.int64)
    if isinstance(weights, tf.Tensor):
        w = tf.reshape(tf.cast(weights, tf.int64), [count])
        total = tf.reduce_sum(w)
    else:
        w = tf.constant(weights, tf.int64)
        total = sum(weights)
    quota = n * w  # Exact: n < 2**31 and total <= 2**24 + count.
    base = quota // total
    remainder = quota % total
    left = n - tf.reduce_sum(base)  # 0 <= left < count
    # rank[k]: how many shards beat shard k for a leftover row.
    beats = (remainder[None, :] > remainder[:, None]) | (
        (remainder[None, :] == remainder[:, None]) & (index[None, :] < index[:, None])
    )
    rank = tf.reduce_sum(tf.cast(beats, tf.int64), axis=1)
    return base + tf.cast(rank < left, tf.int64)


def plan_rows(n: int, count: int, weights: tuple[int, ...] | None) -> list[int]:
    """`plan_sizes` in Python, for `plan`, `explain` and messages (no TF ops: works in a graph)."""
    if weights is None:
        return [n // count + (1 if k < n % count else 0) for k in range(count)]
    total = sum(weights)
    base = [n * w // total for w in weights]
    remainder = [n * w % total for w in weights]
    # The rows left over go one each to the largest remainders, ties to the lower index.
    for k in sorted(range(count), key=lambda k: (-remainder[k], k))[: n - sum(base)]:
        base[k] += 1
    return base


def rows(t: Any) -> tf.Tensor:
    """The number of rows of a batch of any kind (`_kinds`), as an int64 scalar tensor."""
    return _kinds.of(t).rows(t)


def host_cpu(device: str = "") -> str:
    """The CPU of the machine (task) that holds `device`: where plans and checks run.

    Without a device, this process's own: where datasets iterate.
    """
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def row_count(t: Any, device: str | None, host: str) -> tf.Tensor:
    """The rows of `t` as an int64 scalar on `host`; only a Shape op runs on `device`
    (none where the rows are static).

    On a GPU the Shape kernel leaves its output in host memory, so the count
    reaches the host without waiting for `t`'s device; int64 arithmetic placed
    on a GPU would copy it back and forth, and a host read would sync.
    """
    return _kinds.of(t).row_count(t, device, host)


def split(t: Any, sizes: tf.Tensor, count: int, host: str) -> list[Any]:
    """`t` split along axis 0 into `count` pieces of `sizes` rows, where `t` lives.

    Offsets are computed on `host`, where `sizes` is, so nothing the split
    reads waits for `t`'s device. How a kind is cut (and how dtypes without
    GPU split kernels travel) is its adapter's (`_kinds`).
    """
    return _kinds.of(t).split(t, sizes, count, host)


class Planned(NamedTuple):
    """The first step's result, in the graph.

    Attributes:
      total: the batch's rows, an int64 scalar on the host.
      sizes: each shard's rows, an int64 vector on the host.
      pieces: ``pieces[i][k]``, split argument i's rows for shard k (each still
        where its argument lives; the shard's device scope copies it).
    """

    total: tf.Tensor
    sizes: tf.Tensor
    pieces: list[list[Any]]


def plan_and_split(
    inputs: Sequence[Any],
    split_devices: Sequence[str],
    paths: Sequence[str],
    count: int,
    weights: tuple[int, ...] | tf.Tensor | None,
    host: str,
) -> Planned:
    """The rows and shard sizes on the host, then every split argument cut where it lives.

    The sizes are int64 arithmetic on the host, so nothing waits for a GPU, and
    each argument is split on its own device, so each shard's rows cross once.
    Inside a tf.function the split arguments' rows are unknown to Python, so
    there the plan waits for a check that they are equal (its message starts
    with `INPUTS_DIFFER`, then the arguments' paths).

    Args:
      inputs: the split arguments' tensors.
      split_devices: where each lives ("" where it came from a graph).
      paths: their names, for the check's message.
      count: the number of shards.
      weights: `integer_weights`, as constants or an int64 tensor fed at run
        time (`plan_sizes`), or None for an even split.
      host: the CPU the arithmetic runs on.
    """
    counts = [row_count(t, d or None, host) for t, d in zip(inputs, split_devices)]
    with tf.device(host):
        checks = rows_agree(counts, split_devices, paths)
        with tf.control_dependencies(checks):
            total, sizes = counts[0], plan_sizes(counts[0], count, weights)
    pieces = []
    for tensor, device in zip(inputs, split_devices):
        with _kinds.placed(device):  # "": where the caller's scope says (a stream's host)
            pieces.append(split(tensor, sizes, count, host))
    return Planned(total, sizes, pieces)


def onto_devices(planned: Planned, devices: Sequence[str]) -> Planned:
    """`planned` with each shard's pieces copied to that shard's device now.

    An Identity on the device (``shard_k/Identity``) receives the piece, so a
    stream can move the next batch's rows to the devices while the current
    batch still computes.
    """
    pieces: list[list[Any]] = [[] for _ in planned.pieces]
    for k, device in enumerate(devices):
        with tf.name_scope(f"shard_{k}"), tf.device(device):
            for field, parts in zip(pieces, planned.pieces):
                field.append(tf.nest.map_structure(tf.identity, parts[k], expand_composites=True))
    return planned._replace(pieces=pieces)


def rows_agree(
    counts: Sequence[tf.Tensor], split_devices: Sequence[str], paths: Sequence[str]
) -> list[tf.Operation]:
    """The check that every split argument has the first's rows, where Python could not
    make it (an input that came from a graph, device ""); [] where it did. Its message
    starts with `INPUTS_DIFFER`, then the arguments' paths."""
    if len(counts) < 2 or all(split_devices):
        return []
    return [
        host_assert(
            tf.stack(counts),
            tf.fill([len(counts)], counts[0]),
            f"{INPUTS_DIFFER} {', '.join(paths)} :end (their rows, then the "
            "first's: every split argument needs the same leading dimension; "
            "name one in broadcast=(...) to copy it whole to each device)",
        )
    ]


def host_assert(got: tf.Tensor, want: tf.Tensor, message: str) -> tf.Operation:
    """An Assert that `got` equals `want` (small int vectors), printing both if not.

    `tf.debugging.assert_equal` guards its Assert with a tf.cond (an If op, ~20 us
    a call here) so that costly data is only computed on failure; these vectors
    cost nothing, so the Assert runs unguarded.
    """
    return tf.raw_ops.Assert(
        condition=tf.reduce_all(tf.equal(got, want)),
        data=[tf.constant(message), got, want],
        summarize=int(want.shape[0]),  # K: a row count per shard
    )
