"""Shards run at once whatever the function does (issue 24), and keep their side effects.

Devices: the 4 logical CPU devices of conftest.py; the speed-up proof also on
8, in a subprocess that splits the CPU itself (benchmarks/concurrency.py).

References: the traced graph's own control edges (what TensorFlow's automatic
control dependencies added between shards), NumPy for values, and for the
timed proof the same functions on one device, in the same process. Calls from
several threads of one ``weights="auto"`` function: each measured call's
interval against every other call's (`_balance.Turns`), and the plans seen
against the function's fixed cost ratio.
"""

import _thread
import dis
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import children
import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard import _balance, _graph

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))
REPO = Path(__file__).resolve().parent.parent
_SHARD = re.compile(r"(?:^|/)tfshard_shard_(\d+)/")
CALLS = ("StatefulPartitionedCall", "PartitionedCall")


def _shard(name):
    match = _SHARD.search(name)
    return None if match is None else int(match.group(1))


def _whole_call_waits(concrete):
    """(waiting shard, shard waited for, op type) where a shard waits for another's whole call.

    A control edge from a call (one kernel: the whole of a shard) to an op of
    another shard, or into a call from another shard, makes that shard start
    after the other; an edge between two in-place shards' ops is ordered op by
    op, since TensorFlow inlines them into the step.
    """
    waits = []
    for op in concrete.graph.get_operations():
        for before in op.control_inputs:
            s, t = _shard(op.name), _shard(before.name)
            if s is None or t is None or s == t:
                continue
            if op.type in CALLS or before.type in CALLS:
                waits.append((s, t, op.type))
    return waits


def _kinds():
    generator = tf.random.Generator.from_seed(3)
    variable = tf.Variable(tf.ones([3]))
    dropout = tf.keras.layers.Dropout(0.5)

    def printing(x):
        tf.print("shard", tf.shape(x), output_stream="file:///dev/null")
        return x * 2.0

    def asserting(x):
        tf.debugging.assert_all_finite(x, "rows must be finite")
        return x * 2.0

    return {
        "uniform": lambda x: x + 0 * tf.random.uniform(tf.shape(x)),
        "seeded uniform": lambda x: x + 0 * tf.random.uniform(tf.shape(x), seed=7),
        "generator": lambda x: x + 0 * generator.uniform(tf.shape(x)),
        "nn dropout": lambda x: tf.nn.dropout(x, 0.5),
        "keras dropout": lambda x: dropout(x, training=True),
        "print": printing,
        "assertion": asserting,
        "variable read": lambda x: x * variable,
    }


@pytest.mark.parametrize("per_sample", [False, True], ids=["whole shard", "per sample"])
@pytest.mark.parametrize("kind", list(_kinds()))
def test_no_shard_waits_for_another_shards_call(kind, per_sample):
    f = tfshard.parallelize(_kinds()[kind], devices=CPUS, per_sample=per_sample)
    x = np.ones([8, 3], np.float32)
    f(x)
    assert _whole_call_waits(f.get_concrete_function(x)) == []


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_random_op_leaves_the_shared_calls_unchained(jit_compile):
    """The case of the issue: shards off the output device share one trace, and its calls,
    stateful through the random op, were chained one after another."""
    f = tfshard.parallelize(
        lambda x: x + 0 * tf.random.uniform(tf.shape(x)), devices=CPUS, jit_compile=jit_compile
    )
    x = np.ones([8, 3], np.float32)
    np.testing.assert_array_equal(f(x), x)
    concrete = f.get_concrete_function(x)
    calls = [op for op in concrete.graph.get_operations() if op.type in CALLS and _shard(op.name)]
    assert {_shard(op.name) for op in calls} >= {1, 2, 3}  # the shared (or compiled) calls
    assert _whole_call_waits(concrete) == []


def test_the_check_finds_calls_chained_one_after_another():
    """What tfshard's graph was before: one stateful trace called under each shard's scope
    and device, which automatic control dependencies chain (the check can fail)."""
    shared = tf.function(
        lambda x: x + tf.random.uniform(tf.shape(x)),
        experimental_attributes={"_noinline": True},
    ).get_concrete_function(tf.TensorSpec([None], tf.float32))

    @tf.function
    def body(x):
        outputs = []
        for k, device in enumerate(CPUS):
            with tf.name_scope(f"tfshard_shard_{k}"), tf.device(device):
                outputs.append(shared(x))
        return outputs

    concrete = body.get_concrete_function(tf.TensorSpec([None], tf.float32))
    assert [w[:2] for w in _whole_call_waits(concrete)] == [(1, 0), (2, 1), (3, 2)]


@pytest.mark.parametrize("per_sample", [False, True], ids=["whole shard", "per sample"])
def test_a_print_that_feeds_no_output_prints_once_per_shard(tmp_path, per_sample):
    log = tmp_path / "print.log"

    def fn(x):
        tf.print("rows", tf.shape(x)[0], output_stream=f"file://{log}")
        return x + 1.0

    f = tfshard.parallelize(fn, devices=CPUS, per_sample=per_sample)
    np.testing.assert_array_equal(f(np.zeros([10, 3], np.float32)), np.ones([10, 3]))
    lines = log.read_text().splitlines()
    assert len(lines) == len(CPUS)  # one per shard: none dropped, none repeated
    if not per_sample:
        assert sorted(lines) == sorted(f"rows {n}" for n in f.plan(10))


def test_a_shards_assign_then_read_stays_ordered():
    """Inside a shard, the read after an assign sees it (0 if it ran first)."""
    variable = tf.Variable(0.0)

    def fn(x):
        variable.assign(7.0)
        return x + variable.read_value()

    f = tfshard.parallelize(fn, devices=CPUS, per_sample=False)
    for _ in range(5):
        variable.assign(0.0)
        np.testing.assert_array_equal(f(np.zeros([8, 1], np.float32)), np.full([8, 1], 7.0))


def test_writes_to_one_variable_from_every_shard_are_all_kept():
    counter = tf.Variable(0.0)

    def fn(x):
        counter.assign_add(tf.cast(tf.shape(x)[0], tf.float32))
        return x

    f = tfshard.parallelize(fn, devices=CPUS, per_sample=False)
    for n in (8, 3, 0):
        counter.assign(0.0)
        f(np.zeros([n, 2], np.float32))
        assert counter.numpy() == n


def test_a_generator_draws_different_numbers_on_every_shard():
    """The shards advance one state: no two shards draw the same numbers, and the
    state moves on by what they drew together (in whatever order they ran)."""
    generator = tf.random.Generator.from_seed(11)
    f = tfshard.parallelize(lambda x: generator.uniform(tf.shape(x)), devices=CPUS)
    before = generator.state.numpy().copy()
    out = f(np.zeros([8, 1000], np.float32)).numpy()
    assert len(np.unique(out, axis=0)) == len(out)  # no row drawn twice
    assert not np.array_equal(generator.state.numpy(), before)


def test_writes_resources_tells_a_writing_trace_from_a_reading_one():
    variable, generator = tf.Variable(1.0), tf.random.Generator.from_seed(1)
    spec = tf.TensorSpec([None], tf.float32)
    traces = {
        name: tf.function(fn).get_concrete_function(spec)
        for name, fn in {
            "read": lambda x: x * variable,
            "random": lambda x: x + tf.random.uniform(tf.shape(x)),
            "print": lambda x: (tf.print(x), x)[1],
            "assign": lambda x: variable.assign_add(tf.reduce_sum(x)) * x,
            "generator": lambda x: x + generator.normal(tf.shape(x)),
            "nested": lambda x: tf.cond(x[0] > 0, lambda: variable.assign(1.0), lambda: 0.0) * x,
        }.items()
    }
    writes = {name: _graph.writes_resources(t) for name, t in traces.items()}
    assert writes == {
        "read": False,
        "random": False,
        "print": False,
        "assign": True,
        "generator": True,
        "nested": True,
    }


# ------------------------------------------------- weights="auto" under threads


def test_a_measured_call_runs_alone_among_the_functions_calls():
    """No call is in flight while a measured one is, whatever the threads do: its
    timing is its own shards'."""
    turns = _balance.Turns()
    lock = threading.Lock()
    inside: set[int] = set()
    seen = {"measured": 0, "beside": 0, "overlaps": []}

    def caller(index):
        for i in range(60):
            with turns.call(measure=(index + i) % 7 == 0) as measured:
                me = index * 1000 + i
                with lock:
                    if measured:
                        seen["measured"] += 1
                        if inside:
                            seen["overlaps"].append((me, sorted(inside)))
                    elif inside:
                        seen["beside"] += 1
                    inside.add(-me if measured else me)
                    if any(k < 0 for k in inside - {-me}):
                        seen["overlaps"].append((me, sorted(inside)))
                time.sleep(0)  # let another thread run while this one is inside
                with lock:
                    inside.discard(-me if measured else me)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["overlaps"] == []
    assert seen["measured"] >= 1


def test_a_call_made_inside_a_call_on_its_thread_is_not_measured():
    turns = _balance.Turns()
    with turns.call(measure=False) as outer, turns.call(measure=True) as inner:
        assert (outer, inner) == (False, False)  # and it did not wait for the outer call
    with turns.call(measure=True) as alone:
        assert alone


def _on_a_tensorflow_thread(body):
    """Runs `body()` from a `tf.py_function` in a `tf.function`: on a thread of TensorFlow's
    runtime, which Python did not start, as a function called from its own shards runs.
    Returns what it returned, and whether it ran on another thread than this one."""
    seen = []

    def run():
        seen.append((body(), threading.get_ident() != caller))
        return 0

    caller = threading.get_ident()
    tf.function(lambda: tf.py_function(run, [], tf.int32))()
    return seen[0]


def _turn_taken_at_once(turns):
    """A call's turn, from a thread TensorFlow started: whether it was measured and alone
    (it must not wait: a wait here would wait for the call this test holds)."""
    with turns.call(measure=True) as measured:
        return measured, turns.alone()


def test_a_call_on_a_tensorflow_thread_runs_beside_a_measured_call_it_is_inside():
    # A shard's tf.py_function calling the function: a wait for the measured call in
    # flight would wait for the call it is made from (until LONGEST_WAIT_S gave up).
    turns = _balance.Turns()
    with turns.call(measure=True) as measured, turns.running_python():
        assert measured and turns.alone()
        inner, elsewhere = _on_a_tensorflow_thread(lambda: _turn_taken_at_once(turns))
        assert elsewhere and inner == (False, False)  # unmeasured, beside the measured call
        assert not turns.alone()  # whose seconds now hold the inner call's: not counted
    assert turns.gave_up == 0
    with turns.call(measure=True) as measured:
        assert measured and turns.alone()  # the next one runs alone again


def test_a_call_on_a_tensorflow_thread_with_none_in_flight_is_measured():
    # (a tf.data function that calls the function, say: its calls are measured too)
    turns = _balance.Turns()
    (measured, alone), elsewhere = _on_a_tensorflow_thread(lambda: _turn_taken_at_once(turns))
    assert elsewhere and measured and alone and turns.gave_up == 0


def test_a_measured_call_waiting_for_one_whose_shard_calls_the_function_is_not_stuck():
    # An unmeasured call in flight (this thread's), a measured one waiting for it to end
    # (another thread's), and the unmeasured call's shard calling the function on a
    # thread TensorFlow started: that call runs at once, so both waits end.
    turns = _balance.Turns()
    waited = []

    def measured_call():
        with turns.call(measure=True) as measured:
            waited.append((measured, turns.alone()))

    waiter = threading.Thread(target=measured_call, daemon=True)
    with turns.call(measure=False), turns.running_python():
        waiter.start()
        while not turns.measuring() and waiter.is_alive():  # until the measured call waits
            time.sleep(0)
        assert turns.measuring(), "the measured call never waited"
        inner, elsewhere = _on_a_tensorflow_thread(lambda: _turn_taken_at_once(turns))
        assert elsewhere and inner == (False, False)
    waiter.join(120)  # bounds a hang only: it waits for this thread's turn to end
    assert not waiter.is_alive() and waited == [(True, True)] and turns.gave_up == 0


def _on_a_thread_python_did_not_start(body):
    """Runs `body()` on a thread of `_thread.start_new_thread`, which `threading` did not
    start (as TensorFlow's): what it returned, once it has."""
    seen, ended = [], threading.Event()

    def run():
        try:
            seen.append(body())
        finally:
            ended.set()

    _thread.start_new_thread(run, ())
    assert ended.wait(120)  # bounds a hang only
    return seen[0]


@pytest.mark.parametrize(
    "started_by",
    [
        lambda body: _on_a_tensorflow_thread(body)[0],
        _on_a_thread_python_did_not_start,
    ],
    ids=["tensorflow", "_thread"],
)
def test_a_call_on_a_thread_python_did_not_start_waits_where_no_call_runs_python(started_by):
    # A tf.data map calling the function on several of TensorFlow's threads: no call in
    # flight runs Python, so none can be calling it, and a measured call waits for the
    # calls in flight as it would on any thread (else it ran beside them, not counted).
    turns = _balance.Turns()
    found = []

    def caller():
        found.append(started_by(lambda: _turn_taken_at_once(turns)))

    waiter = threading.Thread(target=caller, daemon=True)
    with turns.call(measure=False):  # an unmeasured call in flight, running no Python
        waiter.start()
        while not turns.measuring() and waiter.is_alive():  # until the measured call waits
            time.sleep(0)
        assert turns.measuring(), "the call on the other thread did not wait"
    waiter.join(120)  # bounds a hang only: it waits for this thread's turn to end
    assert not waiter.is_alive() and found == [(True, True)] and turns.gave_up == 0


# Ctrl-C lands where Python checks for it: as a function starts, at a call, at a backward
# jump. Turns' own functions, each line and start of one (their `call` and `line` events).
_TURNS_CODE = frozenset(
    member.__code__
    for kind in (_balance.Turns, _balance._Turn, _balance._Python)
    for member in vars(kind).values()
    if inspect.isfunction(member)
)


def _with_exits(code):
    """The offsets in `code` past where a ``with`` statement enters: a line event there
    is its exit (its ``__exit__`` called next), where Python never checks for an
    interrupt (it does after that call, the lock released)."""
    entered = {
        i.positions.lineno: i.offset
        for i in dis.get_instructions(code)
        if i.opname in ("BEFORE_WITH", "SETUP_WITH")
    }
    return {
        i.offset
        for i in dis.get_instructions(code)
        if i.positions.lineno in entered and i.offset > entered[i.positions.lineno]
    }


_NEVER_CHECKED = {code: _with_exits(code) for code in _TURNS_CODE}


def _interrupted_at(position, body):
    """Runs `body()` with a KeyboardInterrupt raised at the `position`th event (a
    function of `Turns` starting, or a line of one) on this thread; whether it was."""
    seen = [0]

    def event():
        seen[0] += 1
        if seen[0] == position + 1:
            raise KeyboardInterrupt  # (a trace function that raises is unset)

    def line(frame, kind, arg):
        if kind == "line" and frame.f_lasti not in _NEVER_CHECKED[frame.f_code]:
            event()
        return line

    def start(frame, kind, arg):
        if frame.f_code not in _TURNS_CODE:
            return None
        event()
        return line

    tracing = sys.gettrace()
    sys.settrace(start)
    try:
        body()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(tracing)
    assert seen[0] <= position, "interrupted, yet the interrupt did not come out of the call"
    return False


def _no_turn_left_taken(turns):
    """Nothing of an ended call is still taken (LONGEST_WAIT_S is 0: a call that waits at
    all gives up, and `gave_up` counts it): a measured call here and on another thread
    each runs alone at once; a call on a thread Python did not start waits for a call in
    flight (none counts as running Python)."""
    gave_up = turns.gave_up
    assert not turns.alone() and not turns.measuring()
    assert _turn_taken_at_once(turns) == (True, True)  # (this thread is in no call)
    elsewhere = []
    other = threading.Thread(target=lambda: elsewhere.append(_turn_taken_at_once(turns)))
    other.start()
    other.join(120)  # bounds a hang only
    assert elsewhere == [(True, True)] and turns.gave_up == gave_up
    with turns.call(measure=False):
        found = _on_a_thread_python_did_not_start(lambda: _turn_taken_at_once(turns))
    assert found == (False, False) and turns.gave_up == gave_up + 1  # it waited


def _unsettled(balance):
    """Changes `balance`'s plan (device 0 three times faster, then device 1): the next call
    is measured."""
    for seconds in ([0.03, 0.01], [0.01, 0.03]):
        for _ in range(_balance.WINDOW):
            balance.observe([10, 10], seconds, warm_up=False)


@pytest.mark.parametrize("case", ["measured", "unmeasured", "nested", "waiting", "take"])
def test_a_ctrl_c_anywhere_in_a_turn_leaves_no_turn_taken(case, monkeypatch):
    """A KeyboardInterrupt raised at each point of taking and giving back a call's turn,
    one point a call: it comes out of the call, and every later call takes its turn as
    if the interrupted one had never been (no call waits for it, none is nested in it).
    Cases: a measured call; an unmeasured one (per_shard), its graph running Python; one
    made inside another call's turn on this thread; a measured one that waits for
    another thread's call (and gives up, LONGEST_WAIT_S being 0); and `take` alone, so
    waiting, which gives back what it took where it raises."""
    monkeypatch.setattr(_balance, "LONGEST_WAIT_S", 0.0)
    f = tfshard.parallelize(
        lambda b: tf.py_function(lambda v: v * 2.0, [b], tf.float32),
        devices=CPUS[:2],
        per_sample=False,
        weights="auto",
    )
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    turns = f.balance.turns
    np.testing.assert_array_equal(f(x), x * 2)  # traced before any interrupt
    np.testing.assert_array_equal(f.per_shard(x)[0], x[:2] * 2)
    held, release = threading.Event(), threading.Event()

    def holder():
        with turns.call(measure=False):
            held.set()
            release.wait(120)

    def call():
        if case == "unmeasured":
            np.testing.assert_array_equal(f.per_shard(x)[1], x[2:] * 2)
        elif case == "take":
            taken.append(turns.call(measure=True))
            turns.take(taken[-1])
        else:
            np.testing.assert_array_equal(f(x), x * 2)

    interrupted, taken = 0, []
    for position in range(1000):
        if case in ("measured", "waiting"):
            _unsettled(f.balance)
            assert not f.balance.settled  # the next call is measured
        counted = f.balance.measured
        if case in ("waiting", "take"):
            held.clear(), release.clear()
            other = threading.Thread(target=holder)
            other.start()
            assert held.wait(120)  # bounds a hang only
        if case == "nested":
            with turns.call(measure=False):  # taken before the interrupt can land
                hit = _interrupted_at(position, call)
        else:
            hit = _interrupted_at(position, call)
        if case == "take" and not hit:
            turns.done(taken[-1])  # (raising, `take` gave back what it took)
        if case in ("waiting", "take"):
            release.set()
            other.join(120)
        _no_turn_left_taken(turns)
        if not hit:  # every point passed
            break
        interrupted += 1
    assert interrupted >= 8 and position == interrupted
    if case == "measured":
        assert f.balance.measured == counted + 1  # the uninterrupted call was measured


def test_a_tf_data_map_calling_the_function_has_its_measured_calls_counted():
    """A tf.data map of 4 parallel calls calling a weights="auto" function (no Python in
    it) through tf.py_function: its calls come on TensorFlow's threads, and take turns as
    one thread's calls do: no measured call is dropped, every one is counted."""
    w = tf.constant(np.random.default_rng(3).normal(size=[16, 16]).astype(np.float32) / 4)
    f = tfshard.parallelize(
        lambda b: tf.tanh(b @ w), devices=CPUS[:2], per_sample=False, weights="auto"
    )
    x = np.random.default_rng(4).normal(size=[64, 16]).astype(np.float32)
    want = np.tanh(x @ w.numpy())

    def call(i):
        return np.float32(np.abs(f(x).numpy() - want).max())

    calls = 40
    ds = tf.data.Dataset.range(calls).map(
        lambda i: tf.py_function(call, [i], tf.float32), num_parallel_calls=4
    )
    errors = [float(e) for e in ds]
    b = f.balance
    assert len(errors) == calls and max(errors) < 1e-4
    # Until the plan settles (SETTLED measurements in a row that keep it) every call is
    # measured, each graph's first run not counted: one thread's calls count as many.
    assert (b.dropped, b.turns.gave_up) == (0, 0) and b.measured >= _balance.SETTLED, (
        b.measured, b.dropped)


# A shard of more than one row whose first value is negative calls the function on its
# first row from a tf.py_function, on a thread TensorFlow runs it on (f of one row calls
# nothing): f(x) is 2x, with the nested call's result in it. Odd calls nest, even ones do
# not, so some measured calls run beside nested ones and others alone. Every call of
# `always` nests: each is measured (its plan never settles) and none is counted.
_NESTED_CALLS = """
import json
import numpy as np
import tensorflow as tf
import tfshard

tfshard.virtual_devices(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
# The map's calls below each hold TensorFlow's threads while their shards' Python calls
# the function again, whose graph needs threads too: more than the cores (TensorFlow's
# default), else TensorFlow's own pool runs out, whatever tfshard does.
tf.config.threading.set_inter_op_parallelism_threads(16)
nested = []

def calling_itself():
    def head(block):
        if block.shape[0] > 1 and block[0, 0] < 0:
            nested.append(len(block))
            return f(block[:1])
        return block[:1] * 2.0

    def twice(block):
        inner = tf.ensure_shape(tf.py_function(head, [block], tf.float32), [None, 4])
        return block * 2.0 + (inner - block[:1] * 2.0)

    f = tfshard.parallelize(
        twice, devices=["/device:CPU:0", "/device:CPU:1"], per_sample=False, weights="auto"
    )
    return f

def outcome(f, xs):
    wrong = [i for i, x in enumerate(xs) if not np.array_equal(f(x).numpy(), x * 2)]
    b = f.balance
    return {"wrong": wrong, "measured": b.measured, "dropped": b.dropped,
            "gave_up": b.turns.gave_up, "weights": b.weights}

rng = np.random.default_rng(39)
xs = [np.abs(rng.normal(size=[16, 4])).astype(np.float32) * (-1.0 if i % 2 else 1.0)
      for i in range(60)]
seen = outcome(calling_itself(), xs)
seen["nested"] = len(nested)
seen["always"] = outcome(calling_itself(), [-np.abs(xs[0])] * 6)
# A tf.data map of 4 parallel calls calling it: every call on TensorFlow's threads, each
# nesting (its own py_function calls it from every shard).
g = calling_itself()
negative = [-np.abs(x) for x in xs[:12]]
mapped = tf.data.Dataset.range(12).map(
    lambda i: tf.py_function(lambda j: g(negative[int(j)]), [i], tf.float32),
    num_parallel_calls=4, deterministic=True,
)
got = [y.numpy() for y in mapped]
seen["mapped"] = {"wrong": [i for i, y in enumerate(got) if not np.array_equal(y, negative[i] * 2)],
                  "measured": g.balance.measured, "dropped": g.balance.dropped,
                  "gave_up": g.balance.turns.gave_up}
print(json.dumps(seen))
"""


def test_a_function_that_calls_itself_from_its_shards_never_waits_for_itself():
    """weights="auto": a call of f from a tf.py_function in f's shards, on a thread
    TensorFlow started, waits for no turn (else it and the measured call it is inside
    would wait for each other until `LONGEST_WAIT_S`, every measured call). In a child, so
    that a wait that never ends fails this test, not the suite."""
    run = children.python(_NESTED_CALLS, timeout=120, TF_CPP_MIN_LOG_LEVEL="3")
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["wrong"] == [] and seen["gave_up"] == 0, seen
    assert seen["nested"] >= 30, seen  # every odd call nested at least once
    # The measured calls a nested call ran beside are dropped; the others are counted.
    assert seen["dropped"] >= 1 and seen["measured"] >= 1, seen
    always = {"wrong": [], "measured": 0, "dropped": 6, "gave_up": 0, "weights": None}
    assert seen["always"] == always, seen
    # Called from a tf.data map, on TensorFlow's threads: the nested calls still wait for
    # no turn (none stalls), and no measured call is counted.
    mapped = seen["mapped"]
    assert mapped["wrong"] == [] and mapped["gave_up"] == 0, seen
    assert mapped["measured"] == 0 and mapped["dropped"] >= 1, seen


# Device k does one thing at a time (a lock) and waits PER_ROW_S[k] a row: a fixed 1:3
# cost per row, which another call's shard on the same device would add to a measured
# call's seconds if they ran together.
PER_ROW_S = (10e-6, 30e-6)
_DEVICE_LOCKS = (threading.Lock(), threading.Lock())


def _on_device(block, k):
    with _DEVICE_LOCKS[int(k)]:
        time.sleep(len(block) * PER_ROW_S[int(k)])
    return block


def _fixed_cost(block):
    out = tf.numpy_function(_on_device, [block, tfshard.shard_index()], tf.float32, stateful=False)
    return tf.ensure_shape(out, block.shape)


def test_eight_threads_calling_one_auto_function_keep_its_plan():
    """The census: 8 threads calling one function of a fixed 1:3 cost saw thousands of
    plan changes and weight ratios from 0.03 to infinity. Each measured call now runs
    alone: the plan settles near 3:1 and stays there."""
    f = tfshard.parallelize(_fixed_cost, devices=CPUS[:2], per_sample=False, weights="auto")
    x = np.random.default_rng(7).normal(size=[512, 4]).astype(np.float32)
    lock, seen, wrong = threading.Lock(), [], []

    def caller():
        for _ in range(40):
            out = f(x).numpy()
            with lock:
                seen.append(f.weights)
                if not np.array_equal(out, x):
                    wrong.append(out)

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and len(seen) == 320
    plans = [seen[0]] + [b for a, b in zip(seen, seen[1:]) if a != b]
    # Device 0 alone holds every row where it ends calls sooner (a machine loaded by
    # other jobs can make it so): a plan of its own, not a ratio.
    ratios = [w[0] / w[1] for w in plans if w is not None and all(w)]
    # From even to near 3:1, perhaps refined once or twice while every call measures.
    assert len(plans) <= 5 and ratios and all(1.5 < r < 6.0 for r in ratios), plans
    assert 1.8 < ratios[-1] < 5.0, plans


# ------------------------------------------------------------ the speed-up proof


def _speedups(count, per_sample):
    """benchmarks/concurrency.py on `count` logical devices, in its own process."""
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "concurrency.py"),
        f"--devices={count}",
        "--rows=1024",
        "--repeats=5",
        "--warmup=1",
        f"--per_sample={per_sample}",
    ]
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=REPO, env=children.environ()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("{"))
    return json.loads(line), out.stdout


# Speed is measured, not asserted in CI (a timed assertion on 2 shared cores flakes,
# and a CI that flakes blocks everyone): TFSHARD_TIMED=1 runs this proof, as the
# closing note of issue 24 did on a quiet machine; the graph tests above hold always.
_TIMED = pytest.mark.skipif(
    os.environ.get("TFSHARD_TIMED") != "1",
    reason="a timed proof: run with TFSHARD_TIMED=1 on a quiet machine",
)


@_TIMED
@pytest.mark.parametrize("per_sample", [False, True], ids=["whole shard", "per sample"])
@pytest.mark.parametrize("count", [4, 8])
def test_every_kind_scales_like_the_pure_function(count, per_sample):
    """Each kind's speed-up over one device is >= 0.9 of the pure function's.

    Contention only lowers a ratio, so each kind keeps its best of up to three
    measurements, each with a pure speed-up of at least 1.4 (below that the
    cores were busy with other work and the comparison proves nothing).
    """
    # keras_inference is keras_dropout's reference, not a kind with side effects. Drawn
    # per sample, a Generator's (or Keras dropout's SeedGenerator's) state advances in
    # pfor's loop one sample at a time, and the next shard's writes wait for it: the
    # gap left open (README, "Side effects across shards").
    skip = {"keras_inference", *(("generator", "keras_dropout") if per_sample else ())}
    best: dict[str, float] = {}
    tables = []
    for _ in range(3):
        result, table = _speedups(count, per_sample)
        tables.append(table)
        if result["speedup"]["pure"][str(count)] < 1.4:
            continue
        for kind, ratios in result["of_pure"].items():
            if kind not in skip:
                best[kind] = max(best.get(kind, 0.0), ratios[str(count)])
        if best and min(best.values()) >= 0.9:
            break
    assert best, "no parallelism to compare with (other load?):\n" + "\n".join(tables)
    slow = {kind: round(v, 2) for kind, v in best.items() if v < 0.9}
    assert not slow, f"kinds slower than 0.9 of the pure speed-up: {slow}\n" + "\n".join(tables)
