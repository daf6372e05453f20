"""Plan and split: how many rows each shard gets, and those rows cut out of the batch.

The first step of every call and of every batch of a stream: `plan` counts
the rows of the split arguments and turns them into one size per shard
(`plan_sizes`, the same arithmetic as `plan_rows` in Python), and `split`
cuts each argument where it lives::

    [N, ...] --plan (where the batch is, int32)--> sizes [K] --split (there)--> K x [n_k, ...]

Sizes come from ``tf.shape(x)[0]`` at run time, so a trace with open rows
serves every batch size (where the rows are static, as in a per-sample
function's graph for its first size, they are constants). The plan is int32
arithmetic placed where the batch lives, of ops whose every argument
TensorFlow keeps in host memory there (int32 on a GPU is host memory, as its
shape arithmetic is): on a GPU nothing of it waits for the device or copies
to it, and on any device nothing of it crosses to another, so a call needs
no more transfers than a hand-written ``tf.split`` where the batch is.
Weights fed at run time (``weights="auto"``), or static weights whose total
is too large for exact int32 arithmetic, are planned in int64 on the host
instead (`device_plan`), and only their int32 sizes cross to the split.

**Caps.** ``weights="auto"`` may hold a device to at most so many rows (a cap
learned when a shard of that many more ran out of memory,
`tfshard._balance.Balance.caps`). A plan with caps is water-filling: each
device's share is its quota by the weights of the rows left, a device whose
quota passes its cap gets its cap and leaves, and the rows left are shared
again by the weights of the devices still under theirs, until no quota passes
a cap; then largest-remainder rounding as without caps (a cap is an integer,
so rounding never passes it). The caps are constants of the graph, planned in
int64 on the host, one round per capped device (`plan_sizes`); a plan without
caps has none of these ops. Rows beyond what the caps hold together
(`capacity`) go by the weights, past the caps: a call of so many rows raises
before it runs (`tfshard._engine.Engine.check_caps`), and so does a stream's
batch, whose rows Python does not see, by an in-graph check before its split
(`within_caps`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tfshard import _kinds
from tfshard.errors import INPUTS_DIFFER, OVER_CAPS, ArgumentError

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


# The largest total of static weights whose plan is exact int32 arithmetic: the
# products ``(n % total) * w_k`` stay below ``total**2 < 2**31`` (`device_plan`).
INT32_TOTAL = 46340


def int32_weights(weights: tuple[int, ...] | tf.Tensor | None) -> tuple[int, ...] | None:
    """Static weights divided by their greatest common divisor (the same plan), where
    their total is then at most `INT32_TOTAL`; None for weights that are not."""
    if weights is None or isinstance(weights, tf.Tensor):
        return None
    divisor = math.gcd(*weights)
    reduced = tuple(w // divisor for w in weights)
    return reduced if sum(reduced) <= INT32_TOTAL else None


Caps = tuple[int | None, ...]  # each device's most rows, None: no cap


def planned_where_the_batch_is(
    weights: tuple[int, ...] | tf.Tensor | None, caps: Caps | None = None
) -> bool:
    """Whether a plan of these weights is int32 arithmetic where the batch is
    (`plan_sizes_int32`): even, or static with a small total (`int32_weights`),
    and no caps; else it is int64 on the host (`plan_sizes`)."""
    return not capped(caps) and (weights is None or int32_weights(weights) is not None)


def capped(caps: Caps | None) -> bool:
    """Whether `caps` hold any device to fewer rows (None, or all None: no)."""
    return caps is not None and any(c is not None for c in caps)


def capacity(weights: tuple[int, ...] | None, caps: Caps | None) -> int | None:
    """The most rows a plan of these weights gives within `caps`: the caps of the devices
    it gives rows to added up, or None where one of them has no cap (any rows fit)."""
    if not capped(caps):
        return None
    weights = (1,) * len(caps) if weights is None else weights
    held = [c for w, c in zip(weights, caps) if w > 0]
    return None if None in held else sum(held)


def within_caps(
    n: tf.Tensor, count: int, weights: tuple[int, ...] | tf.Tensor | None, caps: Caps
) -> tf.Operation:
    """The in-graph `capacity` check of a batch of `n` rows (an int64 scalar) whose
    weights are fed (a stream's, ``weights="auto"``): an Assert that the caps of the
    devices the weights give rows hold them together, where Python cannot see the rows
    before the batch runs. Its message starts with `OVER_CAPS`, then the rows and the
    rows the caps hold (`tfshard.errors.over_caps` reads them back)."""
    if isinstance(weights, tf.Tensor):
        w = tf.reshape(tf.cast(weights, tf.int64), [count])
    else:
        w = tf.constant((1,) * count if weights is None else weights, tf.int64)
    held = w > 0
    limit = tf.constant([0 if c is None else c for c in caps], tf.int64)
    unbounded = tf.reduce_any(held & tf.constant([c is None for c in caps]))
    fits = tf.reduce_sum(tf.where(held, limit, tf.zeros([count], tf.int64)))
    return tf.raw_ops.Assert(
        condition=unbounded | (n <= fits),
        data=[tf.constant(f"{OVER_CAPS} :end (the batch's rows, then the caps')"),
              tf.stack([n]), tf.stack([fits])],
        summarize=1,
    )


def plan_sizes_int32(n: tf.Tensor, count: int, weights: tuple[int, ...] | None) -> tf.Tensor:
    """`plan_sizes` of an int32 row count `n`, as an int32 vector, exact for any ``n < 2**31``.

    Every op is one whose GPU kernel holds its int32 arguments in host memory
    (no Cast, Cumsum, Select or All): a plan placed on a GPU runs on the host's
    memory there. `weights`: None, or static weights with a total of at most
    `INT32_TOTAL` (`device_plan`).
    """
    if weights is None:
        # n // K + 1 for the first n % K shards: ceil((n - k) / K), as floor((n - k - 1) /
        # K) + 1 (no sum above n: exact up to 2**31 - 1; floor division rounds down).
        after = tf.constant([k + 1 for k in range(count)], tf.int32)
        return (n - after) // count + 1
    total = sum(weights)
    w = tf.constant(weights, tf.int32)
    # n * w // total without n * w: n = q * total + r, and r * w < total**2 < 2**31.
    q, r = n // total, n % total
    part = r * w
    base = q * w + part // total
    remainder = part % total
    left = n - tf.reduce_sum(base)  # 0 <= left < count
    # A leftover row each to the largest remainders, ties to the lower index: shard k's
    # key beats shard j's where its remainder is larger, or equal at a lower index.
    key = remainder * count + tf.constant([count - 1 - k for k in range(count)], tf.int32)
    # rank[k]: how many shards beat shard k (keys differ, so each difference is >= 1 or <= -1).
    beats = tf.minimum(tf.maximum(key[None, :] - key[:, None], 0), 1)
    rank = tf.reduce_sum(beats, axis=1)
    return base + tf.minimum(tf.maximum(left - rank, 0), 1)


def plan_sizes(
    n: tf.Tensor,
    count: int,
    weights: tuple[int, ...] | tf.Tensor | None,
    caps: Caps | None = None,
) -> tf.Tensor:
    """Shard sizes for `n` rows on `count` devices, as an int64 vector summing to n.

    Unweighted, sizes differ by at most one and the first ``n % count`` shards
    get the extra row. Weighted, each shard gets the floor of its quota
    ``n * w_k / sum(w)`` and the rows left over go one each to the largest
    remainders (ties to the lower index): largest-remainder rounding. Equal
    weights give the unweighted plan. `plan_sizes_int32` is the same plan in
    int32, for the plans made where the batch is. With `caps`, the quotas are
    water-filled under them first (module docstring).

    Args:
      n: the rows, a scalar tensor.
      count: the number of shards.
      weights: `integer_weights` as constants of the graph, or as an int64
        ``[count]`` tensor fed at run time (``weights="auto"``, whose weights
        change without a new trace), or None for an even split.
      caps: each device's most rows (None: no cap), constants of the graph, or
        None for no caps.
    """
    n = tf.cast(n, tf.int64)
    index = tf.range(count, dtype=tf.int64)
    if capped(caps):
        return _capped_sizes(n, count, weights, caps, index)
    if weights is None:
        return n // count + tf.cast(index < n % count, tf.int64)
    if isinstance(weights, tf.Tensor):
        w = tf.reshape(tf.cast(weights, tf.int64), [count])
        total = tf.reduce_sum(w)
    else:
        w = tf.constant(weights, tf.int64)
        total = sum(weights)
    return _shares(n, w, total, index)


def _capped_sizes(
    n: tf.Tensor,
    count: int,
    weights: tuple[int, ...] | tf.Tensor | None,
    caps: Caps,
    index: tf.Tensor,
) -> tf.Tensor:
    """`plan_sizes` under `caps`: one round per capped device fixes each device whose
    quota of the rows left passes its cap (exactly: ``left * w_k > cap_k * W``, W the
    weights of the devices still open), then the rows left are shared by largest
    remainder among the open devices (by every weight where none is left open)."""
    if isinstance(weights, tf.Tensor):
        w = tf.reshape(tf.cast(weights, tf.int64), [count])
    else:
        w = tf.constant((1,) * count if weights is None else weights, tf.int64)
    limit = tf.constant([0 if c is None else c for c in caps], tf.int64)
    has_cap = tf.constant([c is not None for c in caps])
    zero = tf.zeros([count], tf.int64)
    open_ = w > 0
    fixed = zero
    for _ in range(sum(c is not None for c in caps)):
        left = n - tf.reduce_sum(fixed)
        now = tf.where(open_, w, zero)
        over = open_ & has_cap & (left * w > limit * tf.reduce_sum(now))
        fixed = tf.where(over, limit, fixed)
        open_ = open_ & ~over
    left = n - tf.reduce_sum(fixed)
    shared = tf.where(tf.reduce_any(open_), tf.where(open_, w, zero), w)
    return fixed + _shares(left, shared, tf.reduce_sum(shared), index)


def _shares(n: tf.Tensor, w: tf.Tensor, total: Any, index: tf.Tensor) -> tf.Tensor:
    """Largest-remainder shares of `n` rows by the int64 weights `w` of sum `total`."""
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


def plan_rows(
    n: int, count: int, weights: tuple[int, ...] | None, caps: Caps | None = None
) -> list[int]:
    """`plan_sizes` in Python, for `plan`, `explain` and messages (no TF ops: works in a graph)."""
    if capped(caps):
        w = (1,) * count if weights is None else weights
        fixed, open_ = [0] * count, [x > 0 for x in w]
        for _ in range(sum(c is not None for c in caps)):
            left, total = n - sum(fixed), sum(x for x, o in zip(w, open_) if o)
            for k in range(count):
                if open_[k] and caps[k] is not None and left * w[k] > caps[k] * total:
                    fixed[k], open_[k] = caps[k], False
        shared = tuple(x if o else 0 for x, o in zip(w, open_)) if any(open_) else w
        return [f + r for f, r in zip(fixed, plan_rows(n - sum(fixed), count, shared))]
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
    """The CPU of the task that holds `device` (none: this process's, where datasets
    iterate): where plans of fed weights run."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def row_count(t: Any, device: str | None) -> tf.Tensor:
    """The rows of `t` as an int32 scalar, by a Shape op on `device` ("" or None: the
    caller's scope), or a constant where static. On a GPU it stays in host memory,
    so nothing that reads it waits for `t`'s device."""
    return _kinds.of(t).row_count(t, device)


def split(t: Any, sizes: tf.Tensor, count: int, where: str) -> list[Any]:
    """`t` split along axis 0 into `count` pieces of `sizes` rows, where `t` lives, its
    int32 bounds computed on `where` (where `sizes` is; "": the caller's scope), so
    nothing the split reads waits for `t`'s device."""
    return _kinds.of(t).split(t, sizes, count, where)


class Planned(NamedTuple):
    """The first step's result, in the graph.

    Attributes:
      total: the batch's rows, an int64 scalar (a stream adds them up; a mean
        divides by them).
      sizes: each shard's rows, an int32 vector where the plan ran (`plan_device`;
        on a GPU, in host memory).
      pieces: ``pieces[i][k]``, split argument i's rows for shard k (each still
        where its argument lives; the shard's device scope copies it).
    """

    total: tf.Tensor
    sizes: tf.Tensor
    pieces: list[list[Any]]


def plan_device(
    split_devices: Sequence[str],
    weights: tuple[int, ...] | tf.Tensor | None,
    host: str,
    caps: Caps | None = None,
) -> str:
    """Where `plan_and_split` plans: where the first split argument lives ("" where
    that is the caller's scope: a tensor of a graph, a stream's batch on the host),
    or `host` for weights or caps it plans there (`planned_where_the_batch_is`)."""
    if not planned_where_the_batch_is(weights, caps):
        return host
    return split_devices[0] if split_devices else ""


def plan_and_split(
    inputs: Sequence[Any],
    split_devices: Sequence[str],
    paths: Sequence[str],
    count: int,
    weights: tuple[int, ...] | tf.Tensor | None,
    host: str,
    caps: Caps | None = None,
) -> Planned:
    """The rows and shard sizes where the batch is, then every split argument cut where
    it lives.

    The sizes are int32 arithmetic where the first split argument lives
    (`plan_sizes_int32`: on a GPU, ops of host memory, so nothing waits for the
    device and nothing crosses to the host), or int64 on `host` for weights fed
    at run time or of a large total (`plan_sizes`). Each argument is split on
    its own device, so each shard's rows cross once. Inside a tf.function the
    split arguments' rows are unknown to Python, so there the plan waits for a
    check that they are equal (its message starts with `INPUTS_DIFFER`, then
    the arguments' paths).

    Args:
      inputs: the split arguments' tensors.
      split_devices: where each lives ("" where it came from a graph).
      paths: their names, for the check's message.
      count: the number of shards.
      weights: `integer_weights`, as constants or an int64 tensor fed at run
        time (`plan_sizes`), or None for an even split.
      host: the CPU of a plan made on the host.
      caps: each device's most rows, constants (`plan_sizes`), or None: no caps.
    """
    batch = split_devices[0] if split_devices else ""
    n = agreed_rows(inputs, split_devices, paths, batch)
    with _kinds.placed(batch):
        total = tf.cast(n, tf.int64)
    where = plan_device(split_devices, weights, host, caps)
    with _kinds.placed(where):
        if planned_where_the_batch_is(weights, caps):
            sizes = plan_sizes_int32(n, count, int32_weights(weights))
        else:
            sizes = tf.cast(plan_sizes(n, count, weights, caps), tf.int32)
    pieces = []
    for tensor, device in zip(inputs, split_devices):
        with _kinds.placed(device):  # "": where the caller's scope says (a stream's host)
            pieces.append(split(tensor, sizes, count, where))
    return Planned(total, sizes, pieces)


def onto_devices(planned: Planned, devices: Sequence[str]) -> Planned:
    """`planned` with each shard's pieces copied to its device by an Identity there
    (``shard_k/Identity``): a stream's next batch moves while the current computes."""
    pieces: list[list[Any]] = [[] for _ in planned.pieces]
    for k, device in enumerate(devices):
        with tf.name_scope(f"shard_{k}"), tf.device(device):
            for field, parts in zip(pieces, planned.pieces):
                field.append(tf.nest.map_structure(tf.identity, parts[k], expand_composites=True))
    return planned._replace(pieces=pieces)


def agreed_rows(
    inputs: Sequence[Any], split_devices: Sequence[str], paths: Sequence[str], where: str
) -> tf.Tensor:
    """The split arguments' rows (int32): the first's, counted where it lives (`where`
    for one that came from a graph), after `rows_agree`'s check that every argument has
    them, run at `where`. The one check of this rule in a graph (`plan_and_split`, and a
    device alone, `tfshard._step.Step`)."""
    counts = [row_count(t, d or where) for t, d in zip(inputs, split_devices)]
    with _kinds.placed(where):
        checks = rows_agree(counts, split_devices, paths)
        with tf.control_dependencies(checks):
            return tf.identity(counts[0]) if checks else counts[0]


def rows_agree(
    counts: Sequence[tf.Tensor], split_devices: Sequence[str], paths: Sequence[str]
) -> list[tf.Operation]:
    """The check that every split argument has the first's rows, where Python could not
    make it (an input that came from a graph, device ""); [] where it did.

    Its message starts with `INPUTS_DIFFER`, then the arguments' paths, each followed
    by ", " (`tfshard.errors.inputs_differ` reads path k as the k-th item), then the
    fix. It has no marker for tfshard and no quote (TensorFlow would print it as
    ``\\'``), because inside the caller's own `tf.function` it reaches the user as
    TensorFlow prints it: ``assertion failed: [tfshard: split arguments with different
    numbers of rows: x, y, and ...; their rows, then the rows they need:] [7 8] [7 7]``.
    """
    if len(counts) < 2 or all(split_devices):
        return []
    return [
        host_assert(
            tf.stack(counts),
            tf.fill([len(counts)], counts[0]),
            f"{INPUTS_DIFFER} {', '.join(paths)}, and every split argument needs the same "
            "leading dimension (name one in broadcast=(...) to copy it whole to each "
            "device); their rows, then the rows they need:",
        )
    ]


def host_assert(got: tf.Tensor, want: tf.Tensor, message: str) -> tf.Operation:
    """An Assert that `got` equals `want` (small int32 vectors), printing both if not.

    Of ops that hold int32 in host memory on a GPU (no All), so the check waits for
    nothing on the device; unguarded (`tf.debugging.assert_equal`'s tf.cond spares
    costly data, and these vectors cost nothing). Vectors of one entry are compared
    as their one scalars (the scalar a vector was stacked from, where it was).
    """
    if want.shape[0] == 1:
        condition = tf.equal(*(_scalar(v) for v in (got, want)))
    else:
        condition = tf.equal(tf.reduce_max(tf.abs(got - want)), 0)
    return tf.raw_ops.Assert(
        condition=condition,
        data=[tf.constant(message), got, want],
        summarize=int(want.shape[0]),  # K: a row count per shard
    )


def _scalar(vector: tf.Tensor) -> tf.Tensor:
    """The one entry of a ``[1]`` vector: the scalar it was stacked from, else unstacked."""
    if vector.op.type == "Pack" and len(vector.op.inputs) == 1:
        return vector.op.inputs[0]
    return tf.unstack(vector, num=1)[0]
