"""position: each shard knows its index and its rows' global indices, in every kind of call.

The reference is the plan itself (`f.plan(n)`, checked against exact fractions in
tests/test_plan.py) and NumPy: row i of the input is in the shard whose block of the
plan holds it, and its global index is i plus the rows of the stream before its batch.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfshard
from tfshard import TfshardError

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))


def where_sample(sample):
    """[shard, global row] of one sample (int64)."""
    del sample
    return tf.stack([tf.cast(tfshard.shard_index(), tf.int64), tfshard.row_index()])


def where_shard(block):
    """[n, 2]: [shard, global row] of each row of the shard."""
    rows = tfshard.row_index()
    shard = tf.fill(tf.shape(rows), tf.cast(tfshard.shard_index(), tf.int64))
    return tf.stack([shard, rows], axis=1) + 0 * tf.cast(tf.shape(block)[:1], tf.int64)


def expected(sizes, offset=0):
    """[shard, global row] of each row, from a plan (NumPy)."""
    shards = np.repeat(np.arange(len(sizes)), sizes)
    return np.stack([shards, offset + np.arange(sum(sizes))], axis=1)


def _uses_the_shared_trace(f, x):
    graph = f.get_concrete_function(x).graph
    calls = {op.name.split("/")[0] for op in graph.get_operations() if op.type.endswith("Call")}
    return {"tfshard_shard_1", "tfshard_shard_2", "tfshard_shard_3"} <= calls


@pytest.mark.parametrize("per_sample", [True, False], ids=["per_sample", "whole_shard"])
def test_four_devices_three_of_them_calling_one_shared_trace(per_sample):
    # Output on device 0: shards 1 to 3 call one trace, so position is an input of it.
    fn = where_sample if per_sample else where_shard
    f = tfshard.parallelize(fn, devices=CPUS, per_sample=per_sample)
    x = np.zeros([11, 3], np.float32)
    assert _uses_the_shared_trace(f, x)
    for n in (11, 3, 0):  # uneven shards, fewer rows than devices, none
        np.testing.assert_array_equal(f(x[:n]).numpy().reshape(-1, 2), expected(f.plan(n)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 40),
    weights=st.lists(st.integers(0, 5), min_size=1, max_size=3).filter(any),
)
def test_any_size_and_weights_index_every_row_once_in_order(n, weights):
    f = tfshard.parallelize(where_shard, devices=CPUS[: len(weights)], weights=weights,
                            per_sample=False)  # fmt: skip
    got = f(np.zeros([n, 1], np.float32)).numpy().reshape(-1, 2)
    np.testing.assert_array_equal(got, expected(f.plan(n)))


@pytest.mark.parametrize("per_sample", [True, False], ids=["per_sample", "whole_shard"])
def test_compiled_with_xla(per_sample):
    fn = where_sample if per_sample else where_shard
    f = tfshard.parallelize(fn, devices=CPUS[:3], per_sample=per_sample, jit_compile=True)
    got = f(np.zeros([7, 2], np.float32)).numpy().reshape(-1, 2)
    np.testing.assert_array_equal(got, expected(f.plan(7)))


def test_with_replicas_each_shard_reads_its_copy_and_knows_its_place():
    f = tfshard.parallelize(
        lambda s: where_sample(s) * scale, devices=CPUS[:3], per_sample=True
    )
    with f.replicas():
        scale = tf.Variable(tf.constant(1, tf.int64))
    np.testing.assert_array_equal(f(np.zeros([5])).numpy(), expected(f.plan(5)))


def test_ragged_outputs_map_each_samples_row_with_it():
    # ragged=True maps with tf.map_fn, which takes the rows' positions along.
    f = tfshard.parallelize(
        lambda s: tf.fill([tfshard.row_index() % 3], tfshard.row_index()),
        devices=CPUS[:2],
        ragged=True,
    )
    got = f(np.zeros([5])).to_list()
    assert got == [[i] * (i % 3) for i in range(5)]


def test_per_shard_results_hold_each_shards_own_rows():
    f = tfshard.parallelize(where_shard, devices=CPUS[:2], per_sample=False, weights=[2, 1])
    parts = [p.numpy() for p in f.per_shard(np.zeros([6, 1]))]
    np.testing.assert_array_equal(np.concatenate(parts), expected([4, 2]))


# ------------------------------------------------------------------ streams


@pytest.fixture(scope="module")
def by_sample():
    return tfshard.parallelize(where_sample, devices=CPUS[:3])


def test_a_stream_counts_rows_over_every_batch_traced_loop(by_sample):
    ds = tf.data.Dataset.from_tensor_slices(np.zeros([23, 2], np.float32)).batch(5)
    got = by_sample(ds).numpy()
    # Each batch of 5 (the last of 3) is planned on its own; its rows follow the ones before.
    sizes = [5, 5, 5, 5, 3]
    want = np.concatenate([expected(by_sample.plan(m), 5 * i) for i, m in enumerate(sizes)])
    np.testing.assert_array_equal(got, want)


def test_a_stream_counts_rows_in_the_python_loop_and_iterate(by_sample):
    # padded_batch may change the per-sample shape (unknown in the spec), so f(ds) takes
    # the Python loop; these samples keep one length, as that loop asks.
    ds = tf.data.Dataset.from_generator(
        lambda: (np.ones([2], np.float32) for _ in range(7)),
        output_signature=tf.TensorSpec([None], tf.float32),
    ).padded_batch(3)
    sizes = [3, 3, 1]
    want = np.concatenate(
        [expected(by_sample.plan(m), offset=3 * i) for i, m in enumerate(sizes)]
    )
    np.testing.assert_array_equal(by_sample(ds).numpy(), want)
    parts = [r.numpy() for r in by_sample.iterate(ds)]
    np.testing.assert_array_equal(np.concatenate(parts), want)


@pytest.mark.parametrize("padded", [False, True], ids=["traced_loop", "python_loop"])
def test_a_reduced_stream_sums_the_global_rows(padded):
    f = tfshard.parallelize(lambda s: tfshard.row_index(), devices=CPUS[:2], reduce="sum")
    samples = tf.data.Dataset.from_generator(
        lambda: (np.zeros([2], np.float32) for _ in range(17)),
        output_signature=tf.TensorSpec([None] if padded else [2], tf.float32),
    )
    ds = samples.padded_batch(4) if padded else samples.batch(4)
    assert int(f(ds)) == sum(range(17))


# ------------------------------------------------------------------ uses


def test_a_row_keyed_random_stream_is_the_same_whatever_the_devices():
    """README's recipe: a stateless op seeded by the row gives every row its own numbers."""

    def noisy(sample):
        seed = tf.stack([tf.constant(7, tf.int64), tfshard.row_index()])
        return sample + tf.random.stateless_normal([3], seed=seed)

    x = np.zeros([9, 3], np.float32)
    one = tfshard.parallelize(noisy, devices=CPUS[:1])(x).numpy()
    assert len({tuple(row) for row in one.round(5)}) == 9  # every row its own numbers
    for devices, weights in ((CPUS[:2], None), (CPUS[:3], [1, 3, 2])):
        got = tfshard.parallelize(noisy, devices=devices, weights=weights)(x).numpy()
        np.testing.assert_array_equal(got, one)


def where_shard_in_branches(block):
    """`where_shard`, its position read first inside a tf.cond branch and a loop's body,
    then again outside them (each read in its own graph)."""
    n = tf.shape(block, out_type=tf.int64)[0]
    rows = tf.cond(n > 0, tfshard.row_index, lambda: tf.zeros([0], tf.int64))
    shard = tf.while_loop(
        lambda i, s: i < 1,
        lambda i, s: (i + 1, s + tf.cast(tfshard.shard_index(), tf.int64)),
        (tf.constant(0), tf.constant(0, tf.int64)),
    )[1]
    assert_same = tf.debugging.assert_equal(rows, tfshard.row_index())
    with tf.control_dependencies([assert_same]):
        shard = tf.fill([n], shard + 0 * tf.cast(tfshard.shard_index(), tf.int64))
    return tf.stack([shard, rows], axis=1)


@pytest.mark.parametrize("devices", [1, 3])
def test_a_position_read_inside_a_branch_or_a_loop_is_the_shards_own(devices):
    # The position's tensors are made where the function first reads them.
    f = tfshard.parallelize(where_shard_in_branches, devices=CPUS[:devices], per_sample=False)
    for n in (7, 2, 0):
        got = f(np.zeros([n, 1], np.float32)).numpy().reshape(-1, 2)
        np.testing.assert_array_equal(got, expected(f.plan(n)))
    g = tfshard.parallelize(where_shard_in_branches, devices=CPUS[:devices], per_sample=False,
                            max_rows=2)  # fmt: skip
    got = g(np.zeros([7, 1], np.float32)).numpy().reshape(-1, 2)
    np.testing.assert_array_equal(got, expected(g.plan(7)))


@pytest.mark.parametrize("per_sample", [True, False], ids=["per_sample", "whole_shard"])
def test_a_function_that_never_reads_its_position_has_none_in_its_graph(per_sample):
    # A position's ops are made in the scope "tfshard_position", where the function reads it.
    f = tfshard.parallelize(lambda x: x * 2.0, devices=CPUS[:2], per_sample=per_sample)
    g = tfshard.parallelize(
        lambda x: x * tf.cast(tfshard.shard_index(), tf.float32),
        devices=CPUS[:2],
        per_sample=per_sample,
    )
    x = np.ones([4, 3], np.float32)
    np.testing.assert_array_equal(g(x).numpy(), expected([2, 2])[:, :1] * x)

    def position_ops(h):
        graph = h.get_concrete_function(x).graph.as_graph_def()
        nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
        return [node.name for node in nodes if "tfshard_position/" in node.name]

    assert position_ops(g) and not position_ops(f)


@pytest.mark.parametrize("name", ["shard_index", "row_index"])
def test_outside_a_parallelized_function_it_says_where_to_call_it(name):
    with pytest.raises(TfshardError, match=rf"tfshard.{name}\(\) was called outside"):
        getattr(tfshard, name)()

    @tf.function
    def plain(x):
        return x + tf.cast(getattr(tfshard, name)(), x.dtype)

    with pytest.raises(TfshardError, match="inside a function given to tfshard.parallelize"):
        plain(tf.constant(1.0))


# ------------------------------------------------------------------ a user's tf.function

# How shards run: in place (2 devices), sharing one trace (3: two off the output device),
# in chunks, compiled as tfshard's option or as the tf.function's own.
_RUNS = {
    "plain": ({}, {}),
    "max_rows": ({}, {"max_rows": 2}),
    "jit_compile": ({}, {"jit_compile": True}),
    "tf_function_jit_compile": ({"jit_compile": True}, {}),
}


@pytest.mark.parametrize("run", _RUNS)
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("per_sample", [True, False], ids=["per_sample", "whole_shard"])
def test_a_tf_function_sees_each_shards_own_position(per_sample, devices, run):
    # A tf.function's cache would give every shard the first shard's trace, its position too.
    decorated, options = _RUNS[run]
    fn = tf.function(where_sample if per_sample else where_shard, **decorated)
    f = tfshard.parallelize(fn, devices=CPUS[:devices], per_sample=per_sample, **options)
    for n in (7, 2):  # uneven shards, then fewer rows than devices
        got = f(np.zeros([n, 2], np.float32)).numpy().reshape(-1, 2)
        np.testing.assert_array_equal(got, expected(f.plan(n)))


@pytest.mark.parametrize("per_sample", [True, False], ids=["per_sample", "whole_shard"])
def test_a_tf_function_counts_rows_over_every_batch_of_a_stream(per_sample):
    fn = tf.function(where_sample if per_sample else where_shard)
    f = tfshard.parallelize(fn, devices=CPUS[:3], per_sample=per_sample)
    ds = tf.data.Dataset.from_tensor_slices(np.zeros([12, 2], np.float32)).batch(5)
    want = np.concatenate([expected(f.plan(m), 5 * i) for i, m in enumerate([5, 5, 2])])
    np.testing.assert_array_equal(f(ds).numpy().reshape(-1, 2), want)


def test_a_tf_function_reading_replicas_knows_each_shards_place():
    f = tfshard.parallelize(
        tf.function(lambda s: where_sample(s) * scale), devices=CPUS[:3], per_sample=True
    )
    with f.replicas():
        scale = tf.Variable(tf.constant(1, tf.int64))
    np.testing.assert_array_equal(f(np.zeros([5])).numpy(), expected(f.plan(5)))


class _Where(tf.Module):
    """A module whose tf.function methods read the position; `__call__` makes its
    variable on its first call, as a tf.function may."""

    def __init__(self):
        super().__init__()
        self.one = None

    @tf.function
    def __call__(self, block):
        if self.one is None:
            self.one = tf.Variable(tf.constant(1, tf.int64))
        return where_shard(block) * self.one

    @tf.function
    def where(self, block):
        return where_shard(block)


def test_a_modules_tf_function_methods_see_each_shards_own_position():
    module = _Where()
    x = np.zeros([7, 1], np.float32)
    for fn in (module, module.where):
        f = tfshard.parallelize(fn, devices=CPUS[:3], per_sample=False)
        np.testing.assert_array_equal(f(x).numpy(), expected(f.plan(7)))
    assert len(module.variables) == 1  # made once, read by every shard


@tf.function
def _scaled_by(block, shard):
    return block * tf.cast(shard, block.dtype)


def _calling_a_tf_function_that_reads_its_shard(read=tfshard.shard_index):
    """A function calling its own tf.function, which reads the shard's index (or `read`)."""

    @tf.function
    def scaled(block):
        return block * tf.cast(read(), block.dtype)[..., None]

    return lambda block: scaled(block) + 0.0


_STALE = r"(?s)read inside a tf.function .*pass it in as an argument"


@pytest.mark.parametrize(
    "devices, options",
    [(2, {}), (3, {}), (1, {"max_rows": 2})],
    ids=["in_place", "shared_trace", "chunks"],
)
def test_a_tf_function_read_inside_the_function_names_the_fix(devices, options):
    # Its cache hands the next shard (or chunk) the first one's trace, with the first
    # one's position in it. 6 rows: every shard (every chunk but the first) takes 2.
    x = np.ones([6, 2], np.float32)
    f = tfshard.parallelize(_calling_a_tf_function_that_reads_its_shard(),
                            devices=CPUS[:devices], per_sample=False, **options)  # fmt: skip
    with pytest.raises(TfshardError, match=_STALE):
        f(x)
    # The fix it names: the position read outside the tf.function, passed in.
    g = tfshard.parallelize(lambda b: _scaled_by(b, tfshard.shard_index()),
                            devices=CPUS[:devices], per_sample=False, **options)  # fmt: skip
    np.testing.assert_array_equal(g(x).numpy(), expected(g.plan(6))[:, :1] * x)


def test_a_tf_function_read_per_sample_inside_the_function_names_the_fix():
    f = tfshard.parallelize(_calling_a_tf_function_that_reads_its_shard(), devices=CPUS[:2])
    with pytest.raises(TfshardError, match=_STALE):
        f(np.ones([6, 2], np.float32))


def test_a_tf_function_traced_for_one_parallelized_function_is_refused_by_the_next():
    # One device alone is right, but the next function's call would reuse its trace.
    fn = _calling_a_tf_function_that_reads_its_shard()
    x = np.ones([4, 2], np.float32)
    alone = tfshard.parallelize(fn, devices=CPUS[:1], per_sample=False)
    np.testing.assert_array_equal(alone(x).numpy(), 0 * x)
    with pytest.raises(TfshardError, match=_STALE):
        tfshard.parallelize(fn, devices=CPUS[1:2], per_sample=False)(x)


def test_a_tf_functions_cached_row_index_is_refused_by_the_next_function():
    # Whole shard, row_index() is an op on the position's tensor: it is refused as the
    # position itself is (a raw TypeError naming the op, before).
    fn = _calling_a_tf_function_that_reads_its_shard(tfshard.row_index)
    x = np.ones([4, 2], np.float32)
    alone = tfshard.parallelize(fn, devices=CPUS[:1], per_sample=False)
    np.testing.assert_array_equal(alone(x).numpy(), np.arange(4)[:, None] * x)
    with pytest.raises(TfshardError, match=_STALE):
        tfshard.parallelize(fn, devices=CPUS[1:2], per_sample=False)(x)


def test_a_parallelized_function_inside_a_shard_may_close_over_its_position():
    # The inner function's graph holds the outer shard's index: a tensor of the trace
    # under way, not a stale one. Each outer shard's rows carry its own index.
    def outer(block):
        index = tfshard.shard_index()
        inner = tfshard.parallelize(lambda b: b[:, 0] * 0 + tf.cast(index, tf.float32),
                                    devices=CPUS[2:4], per_sample=False)  # fmt: skip
        return inner(block)

    f = tfshard.parallelize(outer, devices=CPUS[:2], per_sample=False)
    x = np.ones([6, 2], np.float32)
    np.testing.assert_array_equal(f(x).numpy(), expected(f.plan(6))[:, 0])


class _Scoped(tf.Module):
    @tf.Module.with_name_scope
    @tf.function
    def above(self, block):  # the decorator calls the tf.function itself
        return where_shard(block)

    @tf.function
    @tf.Module.with_name_scope
    def below(self, block):
        return where_shard(block)


def test_a_decorator_above_a_tf_function_is_named_in_the_fix():
    module = _Scoped(name="scoped")  # a name scope may not start with "_"
    x = np.zeros([7, 1], np.float32)
    f = tfshard.parallelize(module.above, devices=CPUS[:3], per_sample=False)
    with pytest.raises(TfshardError, match=r"with_name_scope, calls the tf.function: put it below"):
        f(x)
    g = tfshard.parallelize(module.below, devices=CPUS[:3], per_sample=False)  # the fix
    np.testing.assert_array_equal(g(x).numpy(), expected(g.plan(7)))
