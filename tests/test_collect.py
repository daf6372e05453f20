"""Gathering and reducing shard outputs, checked against NumPy."""

import numerics
import numpy as np
import pytest
import rounding
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfshard
from tfshard import collect
from tfshard.errors import ArgumentError

R = collect.REDUCTIONS


def _in_graph(fn, *args):
    """Runs `fn` traced, as parallelize runs collect."""
    return tf.function(fn, autograph=False)(*args)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=4))
def test_gather_concatenates_in_shard_order(sizes):
    pieces = []
    start = 0
    for n in sizes:
        pieces.append(np.arange(start, start + n, dtype=np.float32).reshape(n, 1).repeat(2, 1))
        start += n
    out = _in_graph(lambda *p: collect.gather(list(p)), *pieces)
    np.testing.assert_array_equal(out.numpy(), np.concatenate(pieces))


def test_gather_keeps_unknown_row_counts_and_inner_shape():
    @tf.function(input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None, 3])])
    def f(a, b):
        out = collect.gather([a, b])
        assert out.shape.as_list() == [None, 3]
        return out

    assert f(tf.ones([2, 3]), tf.zeros([0, 3])).shape == (2, 3)


def test_gather_ragged_rebuilds_rows_in_order():
    a = tf.ragged.constant([[[1], [2]], [], [[3]]], ragged_rank=1)
    b = tf.ragged.constant([[[4], [5], [6]]], ragged_rank=1)
    nested_a = tf.ragged.constant([[[1, 2], [3]], [[4]]])
    nested_b = tf.ragged.constant([[[5], [], [6, 7, 8]]])
    out = _in_graph(lambda x, y: collect.gather([x, y]), a, b)
    assert out.to_list() == a.to_list() + b.to_list()
    nested = _in_graph(lambda x, y: collect.gather([x, y]), nested_a, nested_b)
    assert nested.to_list() == nested_a.to_list() + nested_b.to_list()


@pytest.mark.parametrize(
    "op, np_op", [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min)]
)
def test_per_sample_partials_combine_to_the_full_reduction(op, np_op):
    rng = np.random.default_rng(1)
    shards = [rng.normal(size=[n, 3]).astype(np.float32) for n in (4, 0, 3, 1)]

    def run(*parts):
        partials = [collect.shard_partial(p, tf.shape(p)[0], R[op], per_sample=True) for p in parts]
        return collect.finished(
            collect.combine(partials, R[op]), sum(len(s) for s in shards), R[op]
        )

    np.testing.assert_allclose(
        _in_graph(run, *shards).numpy(), np_op(np.concatenate(shards), 0), rtol=1e-6
    )


def test_per_shard_mean_is_size_weighted_and_ignores_empty_shards():
    # Shard means 1.0 (3 rows), NaN (empty), 4.0 (1 row): full mean (3 + 4) / 4.
    values = [tf.constant(1.0), tf.constant(np.nan, tf.float32), tf.constant(4.0)]
    sizes = [3, 0, 1]

    def run():
        partials = [
            collect.shard_partial(v, tf.constant(n), R["mean"], per_sample=False)
            for v, n in zip(values, sizes)
        ]
        return collect.finished(collect.combine(partials, R["mean"]), tf.constant(4), R["mean"])

    assert _in_graph(run).numpy() == pytest.approx(7.0 / 4.0)


def _mean_of_shards(x, sizes):
    """The mean of `x`'s rows, in shards of `sizes` rows, as collect reduces it."""

    def run(x):
        parts = tf.split(x, sizes)
        partials = [collect.shard_partial(p, tf.shape(p)[0], R["mean"], True) for p in parts]
        return collect.finished(collect.combine(partials, R["mean"]), tf.shape(x)[0], R["mean"])

    return _in_graph(run, x)


def test_combine_int_mean_is_exact_and_nan_for_no_samples():
    exact = _mean_of_shards(tf.constant([-3, -4]), [1, 1])
    assert exact.dtype == tf.float64 and exact.numpy() == np.mean([-3, -4]) == -3.5
    small = _mean_of_shards(tf.constant([1, 0, 0], tf.int16), [2, 1])
    assert small.dtype == tf.float32 and small.numpy() == pytest.approx(1 / 3)
    # No samples: every partial is the empty sum, and the mean is NaN, not a crash.
    assert np.isnan(_mean_of_shards(tf.zeros([0], tf.int32), [0, 0]).numpy())


@pytest.mark.parametrize(
    "value, op, message",
    [
        (tf.constant([True]), "sum", "dtype bool"),
        (tf.constant(["a"]), "max", "dtype string"),
        (tf.constant([1j]), "max", "is complex"),
        (tf.ragged.constant([[1], []]), "sum", "is ragged"),
    ],
)
def test_check_reducible_names_the_path(value, op, message):
    with pytest.raises(
        ArgumentError, match=f"outputs\\['x'\\] .*{message}|outputs\\['x'\\] {message}"
    ):
        collect.check_reducible(value, R[op], "outputs['x']")


INTEGERS = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("dtype", INTEGERS)
def test_integers_reduce_through_int64_exactly(dtype, op, per_sample):
    """Integers reduce as int64 (GPU kernels): the result is the dtype's own, wrap-around too."""
    info = np.iinfo(dtype)
    x = np.array([[info.max, info.min, 3], [info.max, 7, info.min], [1, info.max, 2]], dtype)
    shards = [x[:2], x[2:], x[:0]]  # an empty shard too
    reference = {"sum": np.sum(x, 0, dtype=dtype), "max": x.max(0), "min": x.min(0)}[op]

    def reduce(*parts):
        if per_sample:
            partials = [collect.shard_partial(p, tf.shape(p)[0], R[op], True) for p in parts]
        else:  # a shard's value: its own reduction, as a whole-shard function returns it
            values = [
                collect.finished(collect.shard_partial(p, tf.shape(p)[0], R[op], True), 1, R[op])
                for p in parts
            ]
            partials = [
                collect.shard_partial(v, tf.shape(p)[0], R[op], False)
                for v, p in zip(values, parts)
            ]
        return collect.finished(collect.combine(partials, R[op]), tf.constant(3, tf.int64), R[op])

    out = _in_graph(reduce, *shards)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.numpy(), reference)


def test_every_reduction_is_one_record_and_an_unknown_name_lists_them():
    assert set(collect.REDUCTIONS) == {"sum", "mean", "max", "min"}
    assert [r.name for r in collect.REDUCTIONS.values()] == list(collect.REDUCTIONS)
    assert collect.reduction(None) is None
    assert collect.reduction("max") is collect.REDUCTIONS["max"]
    for bad in ("prod", "SUM", 3):
        with pytest.raises(
            ArgumentError, match=r"reduce=.*choose one of 'sum', 'mean', 'max', 'min'"
        ):
            collect.reduction(bad)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_a_running_total_over_batches_equals_one_reduction_over_all_rows(op):
    # Batches of 3, 0 and 2 rows on 2 shards each, as a stream reduces them: each
    # batch's total (a mean undivided), accumulated, finished once.
    rng = np.random.default_rng(7)
    batches = [rng.integers(-50, 50, size=[n, 2]).astype(np.int32) for n in (3, 0, 2)]
    r = collect.REDUCTIONS[op]

    def run(*xs):
        totals = [collect.no_rows(r, tf.int32)]
        for x in xs:
            halves = tf.split(x, [tf.shape(x)[0] // 2, tf.shape(x)[0] - tf.shape(x)[0] // 2])
            partials = [collect.shard_partial(h, tf.shape(h)[0], r, True) for h in halves]
            batch = collect.combine(partials, r)
            totals = collect.accumulate(totals, [batch], r)
        return collect.finished(totals[0], 5, r)

    every = np.concatenate(batches)
    want = {"sum": every.sum(0), "mean": every.mean(0), "max": every.max(0), "min": every.min(0)}
    np.testing.assert_allclose(_in_graph(run, *batches).numpy(), want[op], rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(rounding.LOW_PRECISION),
    op=st.sampled_from(["sum", "mean", "max", "min"]),
    sizes=st.lists(st.integers(0, 25_000), min_size=1, max_size=4),
    per_sample=st.booleans(),
)
def test_low_precision_floats_reduce_to_the_dtypes_rounding_of_the_true_result(
    dtype, op, sizes, per_sample
):
    """float16 and bfloat16 total in float32 from shard to result (up to 100,000 rows here):
    no sum sticks, no row count overflows, and the result is in the dtype itself."""
    rng = np.random.default_rng(sum(sizes) + len(sizes))
    x = rounding.values(rng, [sum(sizes), 2], dtype)
    starts = np.cumsum([0, *sizes])
    shards = [x[a:b] for a, b in zip(starts[:-1], starts[1:])]
    if per_sample:
        want = rounding.reference(op, rounding.exact(x))
    else:
        # Each shard's own value, as a whole-shard function returns it: its reduction
        # rounded to the dtype; NaN for an empty shard, which must not count.
        shards = [
            tf.cast(rounding.reference(op, rounding.exact(s)) if len(s) else [np.nan] * 2, dtype)
            for s in shards
        ]
        full = [(rounding.exact(v), n) for v, n in zip(shards, sizes) if n]
        if op == "mean" and full:  # a shard's mean counts once per row
            want = sum(v * n for v, n in full) / len(x)
        else:
            want = rounding.reference(op, np.array([v for v, _ in full]).reshape(-1, 2))

    def run(*parts):
        partials = [collect.shard_partial(p, n, R[op], per_sample) for p, n in zip(parts, sizes)]
        return collect.finished(
            collect.combine(partials, R[op]), tf.constant(len(x), tf.int64), R[op]
        )

    rounding.assert_rounded(_in_graph(run, *shards), want, dtype)


@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("dtype", INTEGERS)
def test_integer_means_total_where_they_cannot_wrap(dtype, per_sample):
    """Totals past the dtype's range (past int64's for 64-bit), as NumPy's float64 mean."""
    info = np.iinfo(dtype)
    # Shards of 2, 1 and 0 rows; a shard's rows alike, so one row is also its shard's value.
    rows = np.array([[info.max, info.min], [info.max, info.min], [info.max, 1]], dtype)
    sizes = [2, 1, 0]

    def reduce():
        # Whole shards: each shard's value (the empty shard's must not count).
        values = tf.split(rows, sizes) if per_sample else tf.unstack(rows[[0, 2, 0]])
        partials = [
            collect.shard_partial(v, tf.constant(n, tf.int64), R["mean"], per_sample)
            for v, n in zip(values, sizes)
        ]
        return collect.finished(
            collect.combine(partials, R["mean"]), tf.constant(3, tf.int64), R["mean"]
        )

    out = _in_graph(reduce)
    result = np.float32 if info.bits <= 16 else np.float64  # as tf.math.truediv gives
    assert out.dtype == result
    want = rows.astype(np.float64).mean(0)
    np.testing.assert_allclose(out.numpy(), want.astype(result), rtol=np.finfo(result).eps)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", rounding.LOW_PRECISION)
def test_a_running_total_of_low_precision_batches_stays_in_float32(dtype, op):
    # 400 batches of 200 rows on 2 shards each, totalled batch by batch as a stream's
    # Python loop totals them: past 32,768 a bfloat16 total's spacing (256) is over twice
    # a batch's sum (~100), and 80,000 rows are past float16's largest count (65,504).
    x = rounding.values(np.random.default_rng(11), [400, 200, 2], dtype)
    r = R[op]

    @tf.function(autograph=False)
    def batch_total(b):
        partials = [collect.shard_partial(h, 100, r, True) for h in tf.split(b, 2)]
        return collect.combine(partials, r)

    totals = [collect.no_rows(r, tf.as_dtype(dtype))]
    for b in x:
        totals = collect.accumulate(totals, [batch_total(b)], r)
    assert totals[0].value.dtype == tf.float32  # what a stream carries from batch to batch
    want = rounding.reference(op, rounding.exact(x).reshape(-1, 2))
    rounding.assert_rounded(collect.finished(totals[0], 80_000, r), want, dtype)


def test_the_accumulator_dtype_is_one_rule_of_the_record():
    wide = {tf.float16: tf.float32, tf.bfloat16: tf.float32, tf.float32: tf.float32}
    for dtype, accumulator in wide.items():
        assert {r.accumulator(dtype) for r in R.values()} == {accumulator}
    for name in INTEGERS:
        dtype = tf.as_dtype(name)
        assert R["sum"].accumulator(dtype) == R["max"].accumulator(dtype) == tf.int64
        assert R["mean"].accumulator(dtype) == (tf.float64 if dtype.size == 8 else tf.int64)
        assert (
            R["mean"].result_dtype(dtype)
            == tf.math.truediv(tf.zeros([], dtype), tf.ones([], dtype)).dtype
        )
        assert R["sum"].result_dtype(dtype) == dtype
    assert collect.running_spec(R["mean"], tf.float16) == collect.Total.Spec(
        value=tf.TensorSpec(None, tf.float32), output_dtype=tf.float16
    )


# ---------------------------------------------- a mean is its total divided by the count
#
# Seven rows whose column totals are exact in the accumulator dtype, and whose means a
# multiply by the reciprocal of 7 rounds the wrong way: float32 84 * (1/7) is 12.000001,
# not 12; the float16 and bfloat16 means are ties (2733 and 345) that round to even once
# divided (2732, 344) but up from one ulp above; the int32 totals 5 and 9 over 7 come out
# one float64 ulp off. NumPy is the oracle: a total divided by the count, rounded once.
CPUS = [f"/device:CPU:{i}" for i in range(4)]
_SEVEN = {
    "float32": np.arange(28).reshape(7, 4),
    "float16": np.stack([[2848] * 5 + [2844, 2047], np.arange(7) * 3], axis=1),
    "bfloat16": np.stack([[360] * 6 + [255], np.arange(7)], axis=1),
    "int32": np.stack([[5, 0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0], np.arange(7)], axis=1),
}


def _seven_rows(dtype):
    """`_SEVEN[dtype]` in `dtype`, exactly (a NumPy array)."""
    return tf.constant(_SEVEN[dtype], dtype).numpy()


def _numpy_mean(x):
    """NumPy's mean over the rows of `x`: float16 and bfloat16 through float32, cast once."""
    if x.dtype.kind == "f" and x.dtype.itemsize >= 4:
        return np.mean(x, axis=0)
    if x.dtype.kind in "iu":
        return np.mean(x, axis=0)  # float64, as tf.math.truediv gives an int32 mean
    return np.mean(x.astype(np.float32), axis=0).astype(x.dtype)


def test_the_oracle_means_are_the_ones_a_reciprocal_gets_wrong():
    assert np.mean(_seven_rows("float32"), 0).tolist() == [12, 13, 14, 15]
    assert tf.reduce_mean(_seven_rows("float32"), 0).numpy().tolist() == [12, 13, 14, 15]
    assert _numpy_mean(_seven_rows("float16"))[0] == np.mean(_seven_rows("float16")[:, 0]) == 2732
    assert _numpy_mean(_seven_rows("bfloat16"))[0] == 344
    np.testing.assert_array_equal(_numpy_mean(_seven_rows("int32"))[:2], [5 / 7, 9 / 7])
    reciprocal = {"float32": (84, 7), "int32": (5, 7)}
    for dtype, (total, count) in reciprocal.items():
        wide = np.float32 if dtype == "float32" else np.float64
        assert wide(total) * (wide(1) / wide(count)) != wide(total) / wide(count)


@pytest.mark.parametrize("dtype", list(_SEVEN))
def test_a_mean_divides_by_a_count_known_when_the_graph_is_traced(dtype):
    """A count the trace knows (a batch of static shape) still divides: Grappler turns a
    division by a constant into a multiply by its reciprocal, rounded twice."""
    x = _seven_rows(dtype)

    def mean(x):
        partials = [collect.shard_partial(p, tf.shape(p)[0], R["mean"], True) for p in (x,)]
        return collect.finished(collect.combine(partials, R["mean"]), 7, R["mean"])

    np.testing.assert_array_equal(_in_graph(mean, x).numpy(), _numpy_mean(x))


def test_a_chunked_shards_value_divides_by_its_rows_known_when_traced():
    x = _seven_rows("float32")

    def shard_value(x):
        partial = collect.shard_partial(x, tf.shape(x)[0], R["mean"], True)
        return collect.shard_value(partial, tf.constant(7), R["mean"])

    np.testing.assert_array_equal(_in_graph(shard_value, x).numpy(), np.mean(x, 0))


@pytest.mark.parametrize("max_rows", [None, 2])
@pytest.mark.parametrize("dtype", list(_SEVEN))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_calls_mean_is_numpys_on_any_devices(k, dtype, max_rows):
    x = _seven_rows(dtype)
    f = tfshard.parallelize(lambda s: s, reduce="mean", devices=CPUS[:k], max_rows=max_rows)
    out = f(x)
    assert out.dtype == _numpy_mean(x).dtype
    np.testing.assert_array_equal(out.numpy(), _numpy_mean(x))


@pytest.mark.parametrize("max_rows", [None, 3])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_whole_shard_mean_is_numpys_on_any_devices(k, max_rows):
    # Every run of consecutive rows of an arange has an exact mean, so each shard's (and
    # chunk's) tf.reduce_mean is exact, and so is the whole batch's, divided once.
    x = _seven_rows("float32")
    f = tfshard.parallelize(
        lambda b: tf.reduce_mean(b, 0),
        per_sample=False,
        reduce="mean",
        devices=CPUS[:k],
        max_rows=max_rows,
    )
    np.testing.assert_array_equal(f(x).numpy(), np.mean(x, 0))


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 64),
    k=st.sampled_from([1, 2, 4]),
    max_rows=st.sampled_from([None, 2, 5]),
    per_sample=st.booleans(),
)
def test_a_mean_of_exact_values_is_numpys_for_any_row_count(rows, k, max_rows, per_sample):
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) - 10
    fn = (lambda s: s) if per_sample else (lambda b: tf.reduce_mean(b, 0))
    f = tfshard.parallelize(
        fn, per_sample=per_sample, reduce="mean", devices=CPUS[:k], max_rows=max_rows
    )
    np.testing.assert_array_equal(f(x).numpy(), np.mean(x, 0))
    np.testing.assert_array_equal(f(x).numpy(), tf.reduce_mean(x, 0).numpy())


# ---------------------------------------------- complex sums and means, against one device


def _one_device(op, x):
    """`tf.reduce_<op>` over the rows of `x` in a tf.function on CPU:0."""
    reduce = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max}.get(op)
    reduce = reduce or tf.reduce_min
    with tf.device(CPUS[0]):
        return tf.function(lambda t: reduce(t, 0), autograph=False)(tf.constant(x)).numpy()


def _parts(z):
    """A complex array's real and imaginary parts, side by side (NaN compared part by part)."""
    return np.stack([np.real(z), np.imag(z)])


@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_complex_sums_and_means_are_one_devices_in_calls_and_streams(dtype, op, rows):
    rng = np.random.default_rng(rows)
    x = (rng.normal(size=[rows, 3]) + 1j * rng.normal(size=[rows, 3])).astype(dtype)
    if rows == 0 and op == "mean":
        # TensorFlow's CPU kernel gives 0+0j for no rows; the mean of none is NaN in
        # both parts, as NumPy's, as a float mean of none is NaN.
        with pytest.warns(RuntimeWarning, match="Mean of empty slice"), np.errstate(all="ignore"):
            want = np.mean(x, 0)
        assert np.isnan(want.real).all() and np.isnan(want.imag).all()
    else:
        want = _one_device(op, x)
    for weights in (None, [1, 3]):
        f = tfshard.parallelize(lambda s: s, reduce=op, devices=CPUS[:2], weights=weights)
        for call in (x, tf.data.Dataset.from_tensor_slices(x).batch(2)):
            got = f(call).numpy()
            assert got.dtype == np.dtype(dtype)
            if rows == 0:
                np.testing.assert_array_equal(_parts(got), _parts(want))
            else:
                numerics.assert_close(got, want, [*f.devices, CPUS[0]])


def _zeros(rows, dtype):
    """`rows` rows of signed zeros: all -0.0, alternating from +0.0, alternating from -0.0
    (a complex row's imaginary parts are its real parts reversed)."""
    signs = np.array([[1, i % 2 == 0, i % 2 == 1] for i in range(rows)], bool).reshape(rows, 3)
    x = np.where(signs, -0.0, 0.0)
    if dtype.startswith("complex"):
        z = np.zeros([rows, 3], dtype)
        z.real, z.imag = x, x[:, ::-1]
        return z
    return tf.constant(x, dtype).numpy()


def _signed(x):
    """Each value's sign bit, part by part for complex: what tells -0.0 from +0.0."""
    x = np.asarray(x)
    parts = [x.real, x.imag] if x.dtype.kind == "c" else [x.astype(np.float64)]
    return np.stack([np.signbit(p) for p in parts])


@pytest.mark.parametrize(
    "dtype, op",
    [(d, o) for d in ("float16", "float32", "float64") for o in ("sum", "mean", "max", "min")]
    + [("complex64", "sum"), ("complex64", "mean")],
)
def test_a_reduction_of_zeros_has_the_sign_one_device_gives_it(dtype, op):
    """A lone -0.0 sums to -0.0 as on one device (an empty shard's neutral value is -0.0,
    not +0.0), several zeros to +0.0, no rows to +0.0, on 2 devices, weighted or not."""
    fs = [
        tfshard.parallelize(lambda s: s, reduce=op, devices=CPUS[:2], weights=weights)
        for weights in (None, [1, 3])
    ]
    for rows in (0, 1, 2, 5):
        x = _zeros(rows, dtype)
        if rows == 0 and op != "sum":
            continue  # NaN, -inf and +inf: tested above and in test_parallel
        want = _one_device(op, x)
        # The max of +0.0 and -0.0 is either (TF's kernels pick by blocking): only -0.0s.
        kept = slice(None) if op in ("sum", "mean") else slice(0, 1)
        for f in fs:
            for call in (x, tf.data.Dataset.from_tensor_slices(x).batch(2)):
                got = f(call).numpy()
                np.testing.assert_array_equal(got, want)
                np.testing.assert_array_equal(
                    _signed(got[kept]),
                    _signed(want[kept]),
                    err_msg=f"{rows} rows, weights {f.weights}, {type(call).__name__}",
                )


# ---------------------------------------------- ragged=True: a known shape stays known


def _samples(s):
    """Per sample: a [2], a [3, 2] (shapes known) and a [s[0] % 4] (ragged)."""
    return {
        "d": s * 2,
        "m": tf.reshape(s, [1, 2]) * tf.ones([3, 1]),
        "r": tf.range(tf.cast(s[0], tf.int32) % 4),
    }


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_ragged_outputs_of_known_shape_keep_it_on_any_split(rows):
    x = np.stack([np.arange(rows) * 7 % 5, np.arange(rows)], 1).astype(np.float32)
    samples = {"d": [2], "m": [3, 2], "r": [None]}
    # A sample of shape [d, ...] stacks to a ragged [rows, d, ...]: one ragged rank.
    specs = {
        key: tf.RaggedTensorSpec([rows, *shape], tf.int32 if key == "r" else tf.float32, 1)
        for key, shape in samples.items()
    }
    if rows:
        # The oracle: tf.map_fn stacking the same samples as ragged, in one tf.function
        # (it cannot map no rows).
        signature = {
            key: tf.RaggedTensorSpec(shape, spec.dtype, ragged_rank=0)
            for (key, shape), spec in zip(samples.items(), specs.values())
        }
        mapped = tf.function(
            lambda t: tf.map_fn(_samples, t, fn_output_signature=signature), autograph=False
        )(tf.constant(x))
        assert {key: tf.type_spec_from_value(v) for key, v in mapped.items()} == specs
    splits = [
        {"devices": CPUS[:1]},
        {"devices": CPUS[:2]},
        {"devices": CPUS[:2], "weights": [1, 3]},
        {"devices": CPUS[:2], "weights": [1, 0]},
        {"devices": CPUS[:3], "weights": [2, 0, 1]},
    ]
    for split in splits:
        f = tfshard.parallelize(_samples, ragged=True, **split)
        got = f(x)
        assert {key: tf.type_spec_from_value(v) for key, v in got.items()} == specs, split
        if rows:  # a stream of the rows gives the call's type spec too (its traced loop)
            streamed = f(tf.data.Dataset.from_tensor_slices(x).batch(2))
            assert {k: tf.type_spec_from_value(v) for k, v in streamed.items()} == specs, split
        np.testing.assert_array_equal(got["d"].to_tensor(shape=[rows, 2]), x * 2)
        for key in samples if rows else ():
            np.testing.assert_array_equal(got[key].flat_values, mapped[key].flat_values)
            np.testing.assert_array_equal(got[key].row_splits, mapped[key].row_splits)


def test_a_truncating_shard_mean_is_the_weighted_mean_of_what_each_shard_returned():
    """README (reduce=, max_rows=): a fixed-shape output is each shard's (chunk's) own
    value, weighted by its rows; TF's int32 mean truncates, per shard and per chunk."""
    x = np.array([0, 1, 0, 1, 2, 2], np.int32)

    def truncated(rows):  # what tf.reduce_mean gives for these rows, in NumPy
        return int(np.sum(rows)) // len(rows)

    def shard_mean(b):
        return tf.reduce_mean(b)

    one = tfshard.parallelize(shard_mean, per_sample=False, reduce="mean", devices=CPUS[:1])
    assert one(x).numpy() == truncated(x) == 1
    # Two shards of 3 rows: (0 * 3 + 1 * 3) / 6.
    two = tfshard.parallelize(shard_mean, per_sample=False, reduce="mean", devices=CPUS[:2])
    assert two(x).numpy() == (truncated(x[:3]) * 3 + truncated(x[3:]) * 3) / 6 == 0.5
    # One shard in chunks of 2: the chunks' means (0, 0, 2) weighted, 4 / 6, truncated
    # again as the shard's own int32 value.
    chunked = tfshard.parallelize(
        shard_mean, per_sample=False, reduce="mean", devices=CPUS[:1], max_rows=2
    )
    chunks = [truncated(x[i : i + 2]) * 2 for i in range(0, 6, 2)]
    assert chunked(x).numpy() == sum(chunks) // 6 == 0
