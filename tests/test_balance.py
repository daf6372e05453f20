"""_balance: weights="auto" measures each device on the function and plans by it.

The rules (lower-quartile window, dead band, the useless device, warm-up, which calls
are measured) are checked on `Balance` with given timings; the measurement on the CPU
bed, with an unequal pair made honestly: shard 1 does three times the work per row
(`tfshard.shard_index`), so its device is three times slower per row, and the best
weights are 3:1.
"""

import itertools
import re
import threading
import time

import numerics
import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard import ArgumentError, _balance
from tfshard._balance import Balance

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))


def _measured(balance, rows, seconds, times=5):
    for _ in range(times):
        balance.observe(rows, seconds, warm_up=False)
    return balance.weights


# ----------------------------------------------------------------- the rules


def test_weights_are_the_devices_speeds_with_the_slowest_at_one():
    assert _measured(Balance(2), [50, 50], [0.05, 0.15]) == (3.0, 1.0)
    assert _measured(Balance(3), [40, 40, 40], [0.02, 0.08, 0.04]) == (4.0, 1.0, 2.0)


def test_a_first_run_warms_up_and_a_device_not_yet_measured_keeps_the_plan():
    balance = Balance(2)
    balance.observe([50, 50], [0.05, 0.5], warm_up=True)
    assert balance.weights is None and balance.measured == 0
    for _ in range(_balance.MIN_SAMPLES):
        balance.observe([1, 0], [0.05, 0.0], warm_up=False)  # device 1 got no rows
    assert balance.weights is None and balance.measured == _balance.MIN_SAMPLES
    _measured(balance, [50, 50], [0.05, 0.5], times=_balance.MIN_SAMPLES - 1)
    assert balance.weights is None  # device 1 measured twice: one call could mislead
    assert _measured(balance, [50, 50], [0.05, 0.5], times=1) == (10.0, 1.0)


def test_noise_inside_the_band_never_moves_the_plan():
    balance = Balance(2)
    # Device 1 is 4 % slower, give or take: even is predicted within 5 % of the best.
    for slower in [1.04, 1.0, 1.08, 1.02, 1.06, 0.98, 1.04]:
        balance.observe([100, 100], [0.01, 0.01 * slower], warm_up=False)
        assert balance.weights is None


def test_one_slow_call_of_a_shared_machine_does_not_swing_the_plan():
    balance = Balance(2)
    weights = _measured(balance, [75, 25], [0.075, 0.075], times=6)  # 3:1, balanced
    assert weights == (3.0, 1.0)
    balance.observe([75, 25], [0.75, 0.075], warm_up=False)  # another job took device 0
    balance.observe([75, 25], [0.075, 0.6], warm_up=False)  # then device 1
    assert balance.weights == (3.0, 1.0)


def test_a_change_that_saves_under_a_quarter_millisecond_is_not_made():
    # 3:1 per row, but the whole call takes tens of microseconds: nothing worth a new plan.
    assert _measured(Balance(2), [10, 10], [1e-4, 3e-4]) is None
    # A shard timed in microseconds times the clock: not counted at all.
    short = Balance(2)
    for _ in range(_balance.MIN_SAMPLES):
        short.observe([10, 10], [1e-4, 5e-6], warm_up=False)
    assert short.per_row() == [1e-5, None]


def test_a_device_keeps_rows_unless_over_fifty_times_slower():
    assert _measured(Balance(2), [50, 50], [0.01, 0.4]) == (40.0, 1.0)
    slow = Balance(2)
    assert _measured(slow, [50, 50], [0.01, 0.6], times=2) is None  # 2 measurements: even
    assert _measured(slow, [50, 50], [0.01, 0.6], times=1) == (1.0, 0.0)  # 3: useless
    assert slow.integer() == (1, 0)


def test_a_device_found_useless_stays_so_whatever_the_others_do():
    balance = Balance(2)
    assert _measured(balance, [50, 50], [0.01, 0.6], times=3) == (1.0, 0.0)
    # Device 1 gets no rows (nor is it measured); device 0 slows 60x (another job on it).
    # Its old window would now call device 1 only twice as slow: it stays out all the same.
    assert _measured(balance, [100, 0], [0.6, 0.0], times=9) == (1.0, 0.0)
    assert balance.integer() == (1, 0)


def test_a_function_left_with_one_device_measures_no_more_calls():
    """Every other device useless: the call is one device's plain trace, and nothing is
    measured (no host read, no turn alone among threads), settled or not."""
    balance = Balance(2)
    assert _measured(balance, [50, 50], [0.01, 0.6], times=3) == (1.0, 0.0)
    assert [balance.due() for _ in range(30)] == [None] * 30


def test_what_a_call_plans_by_is_the_weights_shown_after_every_measurement():
    """A call reads the plan without computing it: after each measurement (a split's or
    a device alone's, noisy, three devices, one of them turning useless), the integer
    weights it plans by are the weights shown, in proportion, zeros where they are."""
    rng = np.random.default_rng(11)
    balance = Balance(3)
    shown = set()
    for i in range(300):
        per_row = (1e-4, 3e-4, 2e-4 if i < 150 else 0.5)  # device 2 turns useless
        rows = [40, 40, 40]
        seconds = [n * t * (1.0 + rng.random()) for n, t in zip(rows, per_row)]
        if i % 5 == 4:
            balance.observe_alone(0, 120, 120 * 1e-4 * rng.random(), warm_up=False)
        else:
            balance.observe(rows, seconds, warm_up=False, call_seconds=max(seconds))
        weights, planned = balance.weights, balance.integer()
        if weights is None:
            assert planned == (1, 1, 1)
            continue
        shown.add(weights)
        assert [w == 0 for w in weights] == [p == 0 for p in planned], (weights, planned)
        # Scaled to integers of a 2**24 total: a share's rounding is float32's.
        want = np.float32(np.array(weights) / sum(weights))
        numerics.assert_close(np.float32(np.array(planned) / sum(planned)), want)
    assert len(shown) > 1 and balance.weights[2] == 0.0  # the plan moved, and dropped one


def test_a_device_left_alone_is_left_alone_for_good():
    balance = Balance(3)
    _measured(balance, [50, 50, 50], [0.01, 0.6, 0.02], times=3)
    assert balance.weights == (2.0, 0.0, 1.0) and not balance.one_left
    assert balance.due() is not None  # two devices to weigh: still measured
    # Device 2 slows 45x: once its window says so, it is useless too.
    _measured(balance, [50, 0, 50], [0.01, 0.0, 0.9], times=_balance.WINDOW)
    assert balance.weights == (1.0, 0.0, 0.0) and balance.one_left
    # The one left slows 100x (another job on it): the others stay out, nothing measured.
    _measured(balance, [100, 0, 0], [1.0, 0.0, 0.0], times=9)
    assert balance.weights == (1.0, 0.0, 0.0) and balance.one_left
    assert [balance.due() for _ in range(30)] == [None] * 30


def test_a_device_alone_found_useless_gives_its_rows_to_the_split():
    # Device 1 alone ends calls far sooner than the split: it holds every row. Then it
    # slows 100x (another job on it): once the split's measurements weigh it 0, the rows
    # go to the other device, not to it for good with nothing measured again.
    balance = Balance(2)
    _measured(balance, [4, 4], [0.0040, 0.0036], times=3)
    for _ in range(12):
        balance.observe_alone(1, 8, 0.0001, warm_up=False)
        balance.observe([4, 4], [0.0040, 0.0036], warm_up=False, call_seconds=0.008)
    assert balance.weights == (0.0, 1.0) and not balance.one_left
    _measured(balance, [4, 4], [0.0040, 0.40], times=_balance.WINDOW)
    assert balance.weights == (1.0, 0.0) and balance.one_left


def test_a_measured_call_interrupted_while_it_waits_leaves_later_calls_their_turns(monkeypatch):
    # Ctrl-C while a measured call waits for the others to end: the calls after it
    # neither wait for it nor lose their measuring (a stuck one would wait forever here).
    monkeypatch.setattr(_balance, "LONGEST_WAIT_S", 1e9)
    turns = _balance.Turns()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(turns._changed, "wait_for", interrupted)
        with pytest.raises(KeyboardInterrupt), turns.call(True):
            pass
    measured = []

    def calls():
        with turns.call(False):
            pass
        with turns.call(True) as alone:
            measured.append(alone)

    later = threading.Thread(target=calls, daemon=True)
    later.start()
    later.join(120)  # bounds a hang only: the calls take microseconds
    assert not later.is_alive() and measured == [True]


def test_calls_slowed_by_other_jobs_leave_a_devices_time_as_it_is():
    """Another job only slows a call: up to 6 of a device's 9 measurements slowed leave
    its time per row (the window's lower quartile) where its undisturbed calls put it."""
    balance = Balance(2)
    assert _measured(balance, [75, 25], [0.075, 0.075], times=9) == (3.0, 1.0)
    for k in range(6):
        slowed = [0.075, 0.075]
        slowed[k % 2] *= 2.0 + k  # one device or the other, 2x to 7x slower
        balance.observe([75, 25], slowed, warm_up=False)
    assert balance.weights == (3.0, 1.0) and balance.changes == 1
    assert balance.per_row() == pytest.approx([1e-3, 3e-3])


def test_a_fixed_cost_ratio_under_one_sided_noise_keeps_one_plan():
    """The census's single caller: a fixed 1:3 cost, and two calls in three slowed on
    each device (another job on the machine, 1.2x to 4x), the rest within 2 %: once a
    window of measurements is full, the plan never moves in 400 measurements."""
    rng = np.random.default_rng(5)
    balance = Balance(2)
    for i in range(400):
        if i == _balance.WINDOW:
            learning = balance.changes  # each device's first measurements: the min of few
        weights = balance.integer()
        sizes = [512 * w // sum(weights) for w in weights]
        seconds = []
        for k, (n, per_row) in enumerate(zip(sizes, (10e-6, 30e-6))):
            slowed = (i + k) % 3 != 0  # 6 of any 9 measurements in a row
            factor = 1.2 + 2.8 * rng.random() if slowed else 1.0 + 0.02 * rng.random()
            seconds.append(n * per_row * factor)
        balance.observe(sizes, seconds, warm_up=False)
    assert balance.changes == learning
    fast, slow = balance.weights
    assert slow == 1.0 and 2.9 <= fast <= 3.1


def test_a_settled_plan_is_measured_one_call_in_every():
    balance = Balance(2)
    due = [balance.due() for _ in range(3)]
    assert due == ["split"] * 3  # not settled: every call
    _measured(balance, [75, 25], [0.075, 0.075], times=_balance.MIN_SAMPLES)  # a plan: 3:1
    assert balance.weights == (3.0, 1.0)
    for _ in range(_balance.SETTLED - 1):
        assert balance.due() and not balance.settled
        balance.observe([75, 25], [0.075, 0.075], warm_up=False)
    assert balance.due() and not balance.settled
    balance.observe([75, 25], [0.075, 0.075], warm_up=False)
    assert balance.settled
    # Whole calls not measured here: at most LEARNING calls try to, then one in EVERY.
    assert all(balance.due() for _ in range(_balance.LEARNING))
    due = [balance.due() is not None for _ in range(_balance.EVERY)]
    assert due == [False] * (_balance.EVERY - 1) + [True]


def _gaps(balance, count):
    """The calls from each of the next `count` measured calls (`Balance.due`) to the one
    before it (the first: from the last call asked)."""
    gaps = []
    for _ in range(count):
        calls = 1
        while balance.due() is None:
            calls += 1
            assert calls <= 10 * _balance.SPARSEST, "no call measured"
        gaps.append(calls)
    return gaps


def _settled_three_to_one():
    """A Balance settled on 3:1, its first calls after settling (whole calls) done."""
    balance = Balance(2)
    _measured(balance, [75, 25], [0.075, 0.075], times=_balance.MIN_SAMPLES + _balance.SETTLED)
    assert balance.settled and balance.weights == (3.0, 1.0)
    assert all(balance.due() for _ in range(_balance.LEARNING))
    return balance


def test_a_settled_plan_is_measured_ever_more_sparsely():
    """Each measured call that leaves the plan as it is doubles the calls to the next,
    from EVERY up to SPARSEST: counted exactly, call by call."""
    assert _balance.EVERY < _balance.SPARSEST < 10 * _balance.EVERY
    balance = _settled_three_to_one()
    sparse = [min(_balance.EVERY * 2**i, _balance.SPARSEST) for i in range(7)]
    gaps = []
    for _ in range(len(sparse)):
        gaps += _gaps(balance, 1)
        balance.observe([75, 25], [0.075, 0.075], warm_up=False)  # the same plan
    assert gaps == sparse and sparse[-2:] == [_balance.SPARSEST] * 2
    assert balance.settled and balance.changes == 1
    # Device 1 gets as fast as device 0: the plan moves, every call is measured until
    # the new one settles, then the interval starts again from EVERY.
    _measured(balance, [75, 25], [0.075, 0.025], times=7)
    assert balance.weights == (1.0, 1.0) and not balance.settled
    assert _gaps(balance, 3) == [1, 1, 1]
    _measured(balance, [50, 50], [0.05, 0.05], times=_balance.SETTLED)
    assert balance.settled and balance.weights == (1.0, 1.0)
    learning = _gaps(balance, _balance.LEARNING)
    assert learning == [1] * _balance.LEARNING
    assert _gaps(balance, 3) == [_balance.EVERY, 2 * _balance.EVERY, 4 * _balance.EVERY]


def test_a_settled_plan_measures_often_again_once_a_device_alone_leans_ahead(monkeypatch):
    """Whole calls: the split ends a call in 14 ms and the device alone in 20, the plan
    the split, measured ever more sparsely; one call alone of 10 ms leans towards a
    change, and the next measured call comes EVERY calls later, not SPARSEST (the calls
    measured in a row to weigh a change, LEARNING, are used up here: 0)."""
    monkeypatch.setattr(_balance, "LEARNING", 0)
    balance = Balance(2)
    _measured(balance, [50, 50], [0.01, 0.02], times=_balance.MIN_SAMPLES)
    for _ in range(_balance.SETTLED):
        balance.observe([67, 33], [0.0134, 0.0132], warm_up=False, call_seconds=0.014)
    for _ in range(_balance.MIN_SAMPLES):
        balance.observe_alone(0, 100, 0.02, warm_up=False)
    assert balance.settled and balance.weights == (2.0, 1.0)
    for _ in range(4):
        _gaps(balance, 1)
        balance.observe([67, 33], [0.0134, 0.0132], warm_up=False, call_seconds=0.014)
    assert _gaps(balance, 1) == [_balance.SPARSEST]
    balance.observe_alone(0, 100, 0.010, warm_up=False)
    assert balance.weights == (2.0, 1.0)  # once is not enough to change
    assert _gaps(balance, 1) == [_balance.EVERY]


def test_a_new_plan_is_measured_every_call_until_it_settles():
    balance = Balance(2)
    _measured(balance, [75, 25], [0.075, 0.075], times=_balance.MIN_SAMPLES + _balance.SETTLED)
    assert balance.settled and balance.weights == (3.0, 1.0)
    # Device 1 gets as fast as device 0 (its window turns over): the plan follows.
    _measured(balance, [75, 25], [0.075, 0.025], times=7)
    assert balance.weights == (1.0, 1.0) and not balance.settled
    assert all(balance.due() for _ in range(_balance.EVERY))


def test_the_fastest_device_alone_holds_every_row_where_the_split_does_not_pay():
    balance = Balance(2)
    assert _measured(balance, [50, 50], [0.01, 0.02], times=_balance.MIN_SAMPLES) == (2.0, 1.0)
    # The split's whole calls take 40 ms a 100 rows (a slow link: more than its shards);
    # its weights are found first, and settle.
    for _ in range(_balance.SETTLED):
        assert balance.due() == "split" and balance.plan_for("split") == (2, 1)
        balance.observe([67, 33], [0.0134, 0.0132], warm_up=False, call_seconds=0.04)
    assert balance.settled
    # Then the fastest device alone is weighed (every call until it is known), its whole
    # calls 20 ms.
    assert balance.due() == "alone" and balance.plan_for("alone") == (1, 0)
    balance.observe_alone(0, 100, 0.5, warm_up=True)  # its graph's first run: not counted
    # Known from 3 calls, and found faster in 3 comparisons in a row.
    for _ in range(2 * _balance.MIN_SAMPLES - 2):
        balance.observe_alone(0, 100, 0.02, warm_up=False)
        assert balance.weights == (2.0, 1.0)
    balance.observe_alone(0, 100, 0.02, warm_up=False)
    assert balance.weights == (1.0, 0.0) and balance.integer() == (1, 0)
    # Measured alone until that plan settles; then one call in EVERY, the split (by its
    # own weights) and the device alone in turn.
    for _ in range(_balance.SETTLED):
        assert balance.due() == "alone"
        balance.observe_alone(0, 100, 0.02, warm_up=False)
    due = [balance.due() for _ in range(_balance.EVERY)]
    assert due == [None] * (_balance.EVERY - 1) + ["split"]
    assert balance.plan_for("split") == (2, 1)
    # Once the split ends calls sooner (the link got faster: 10 ms; in a quartile of its
    # window, three times in a row), it is the plan again.
    for _ in range(2 * _balance.MIN_SAMPLES - 2):
        balance.observe([67, 33], [0.0067, 0.0066], warm_up=False, call_seconds=0.01)
        assert balance.weights == (1.0, 0.0)
    balance.observe([67, 33], [0.0067, 0.0066], warm_up=False, call_seconds=0.01)
    assert balance.weights == (2.0, 1.0)


def test_the_split_stays_where_it_pays():
    balance = Balance(2)
    _measured(balance, [50, 50], [0.01, 0.02], times=_balance.MIN_SAMPLES)
    for _ in range(_balance.SETTLED):
        balance.observe([67, 33], [0.0134, 0.0132], warm_up=False, call_seconds=0.014)
    for _ in range(_balance.MIN_SAMPLES):
        balance.observe_alone(0, 100, 0.02, warm_up=False)  # alone: 20 ms against 14
    assert balance.weights == (2.0, 1.0)
    # Noise inside the band keeps the split: alone 13.5 ms against the split's 14.
    for _ in range(2 * _balance.MIN_SAMPLES):
        balance.observe_alone(0, 100, 0.0135, warm_up=False)
    assert balance.weights == (2.0, 1.0)


def test_the_plan_follows_a_device_that_changes_speed():
    balance = Balance(2)
    assert _measured(balance, [50, 50], [0.05, 0.15], times=9) == (3.0, 1.0)
    # Device 1 gets as fast as device 0: once most of the window says so, the plan
    # follows (three measurements of a device getting faster, seven of one slower).
    assert _measured(balance, [75, 25], [0.075, 0.025], times=2) == (3.0, 1.0)
    assert _measured(balance, [75, 25], [0.075, 0.025], times=1) == (1.0, 1.0)
    assert _measured(balance, [50, 50], [0.05, 0.15], times=6) == (1.0, 1.0)
    assert _measured(balance, [50, 50], [0.05, 0.15], times=1) == (3.0, 1.0)


# ------------------------------------------------- measured on the CPU bed

# Two devices whose speeds are their own: a shard waits 10 us per row on device 0 and
# three times that on device 1 (`tfshard.shard_index`), as a device computing apart
# from the host's cores would, so other jobs on this machine's two cores move the
# measurement little. (benchmarks/unequal.py measures shards that compute on the cores.)
PER_ROW_S = (10e-6, 30e-6)


def _wait(block, per_row):
    time.sleep(len(block) * float(per_row))
    return block


def unequal(block):
    """Shard 1 takes three times as long per row as shard 0; every shard returns its rows."""
    per_row = tf.gather(tf.constant(PER_ROW_S, tf.float64), tfshard.shard_index())
    # Stateless: a stateful op would be chained after the other shard's and run in turn.
    out = tf.numpy_function(_wait, [block, per_row], tf.float32, stateful=False)
    return tf.ensure_shape(out, block.shape)


@pytest.fixture(scope="module")
def measured():
    """`unequal` with weights="auto" on two devices, after calls enough to measure it."""
    f = tfshard.parallelize(unequal, devices=CPUS[:2], per_sample=False, weights="auto")
    x = np.random.default_rng(1).normal(size=[1024, 4]).astype(np.float32)
    before = f.plan(1024)
    for _ in range(8):
        out = f(x)
    return f, x, out, before


def test_auto_weights_find_the_slower_device_from_the_first_calls(measured):
    f, x, out, before = measured
    assert before == [512, 512]  # even until measured
    fast, slow = f.weights
    # Three times the work per row; the bound is loose for a machine others share.
    assert slow == 1.0 and 1.8 < fast < 5.0, f.weights
    assert 0.6 < f.plan(1024)[0] / 1024 < 0.85
    # The plan changed; the results did not.
    np.testing.assert_array_equal(out.numpy(), x)


def test_measured_weights_can_be_passed_again(measured):
    f, *_ = measured
    again = tfshard.parallelize(unequal, devices=CPUS[:2], per_sample=False, weights=f.weights)
    assert again.weights == f.weights
    assert again.plan(1000) == f.plan(1000)


def test_explain_shows_the_weights_in_use(measured):
    f, x, *_ = measured
    line = f.explain(x).splitlines()[1]
    shown = ", ".join(f"{w:g}" for w in f.weights)
    assert line.startswith(f"  weights [{shown}] (weights='auto', from ")
    fresh = tfshard.parallelize(unequal, devices=CPUS[:2], per_sample=False, weights="auto")
    assert "weights even (weights='auto': 0 measurements, not every device yet)" in (
        fresh.explain(x)
    )
    cheap = tfshard.parallelize(tf.identity, devices=CPUS[:2], per_sample=False, weights="auto")
    for _ in range(_balance.MIN_SAMPLES):
        cheap.balance.observe([50, 50], [0.001, 0.0011], warm_up=False)
    assert "weights even (weights='auto', from 3 measurements: no other split" in (
        cheap.explain(x)
    )


def test_a_stream_measures_as_it_runs():
    f = tfshard.parallelize(unequal, devices=CPUS[:2], per_sample=False, weights="auto")
    x = np.random.default_rng(2).normal(size=[12 * 512, 4]).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(512)
    np.testing.assert_array_equal(f(ds).numpy(), x)
    fast, slow = f.weights  # measured within the stream: its loop's calls after the first
    assert slow == 1.0 and 1.8 < fast < 5.0, f.weights


def test_results_are_the_functions_whatever_the_weights():
    w = tf.constant(np.random.default_rng(3).normal(size=[4, 4]).astype(np.float32))
    same = tfshard.parallelize(lambda s: tf.tanh(tf.linalg.matvec(w, s)), weights="auto")
    x = np.random.default_rng(4).normal(size=[37, 4]).astype(np.float32)
    for _ in range(3):
        numerics.assert_close(same(x).numpy(), np.tanh(x @ w.numpy().T))


def test_a_bad_weights_string_names_auto():
    with pytest.raises(ArgumentError, match=r"weights='fast': .*or weights='auto'"):
        tfshard.parallelize(tf.identity, weights="fast")


def _measurements(f, x):
    """How many measurements `f` counted, as `explain` says."""
    return int(re.search(r"(\d+) measurements?", f.explain(x)).group(1))


def test_calls_between_measured_ones_run_the_unmeasured_graph(monkeypatch):
    f = tfshard.parallelize(tf.identity, devices=CPUS[:2], weights="auto")
    x = np.arange(8, dtype=np.float32)
    balance = f.balance
    # Settled by given timings: two alike devices, the plan even all along, and a device
    # alone far slower than the split.
    _measured(balance, [4, 4], [1e-3, 1e-3], times=_balance.MIN_SAMPLES + _balance.SETTLED)
    for _ in range(_balance.MIN_SAMPLES):
        balance.observe([4, 4], [1e-3, 1e-3], warm_up=False, call_seconds=1e-3)
        balance.observe_alone(0, 8, 1.0, warm_up=False)
    assert balance.settled and balance.weights is None
    due, observed = [], []
    for name in ("observe", "observe_alone"):
        method = getattr(balance, name)
        monkeypatch.setattr(
            balance, name, lambda *a, _m=method, **k: (observed.append(a), _m(*a, **k))[1]
        )
    asked = balance.due
    monkeypatch.setattr(balance, "due", lambda: (due.append(asked()), due[-1])[1])
    for _ in range(3 * _balance.EVERY):
        np.testing.assert_array_equal(f(x).numpy(), x)
    # Each call asked once; the EVERY-th measured (its shards timed), then the one twice
    # as many calls later, the others not.
    assert len(due) == 3 * _balance.EVERY
    assert [d is not None for d in due] == (
        [False] * (_balance.EVERY - 1) + [True] + [False] * (2 * _balance.EVERY - 1) + [True]
    )
    assert len(observed) == 2 and balance.settled and balance.weights is None
    # The graph of the calls between: the outputs alone, no timestamp, no fed weights.
    graph = f.get_concrete_function(x)
    assert isinstance(graph.structured_outputs, tf.Tensor)
    assert [t.dtype for t in graph.inputs if t.dtype != tf.resource] == [tf.float32]
    assert not [op for op in graph.graph.get_operations() if op.type == "StatefulPartitionedCall"]


def test_a_function_left_with_one_device_runs_as_that_device_alone():
    """Every other device found useless: calls from several threads at once run the
    graph of the device alone (no op elsewhere), nothing is measured, none waits."""
    f = tfshard.parallelize(tf.identity, devices=CPUS[:2], weights="auto")
    alone = tfshard.parallelize(tf.identity, devices=CPUS[:1])
    x = np.arange(8, dtype=np.float32)
    balance = f.balance
    _measured(balance, [4, 4], [1e-3, 1.0], times=_balance.MIN_SAMPLES)
    assert f.weights == (1.0, 0.0) and balance.one_left
    before = _measurements(f, x)
    results, failures = [], []

    def calls():
        try:
            for _ in range(2 * _balance.EVERY):
                results.append(f(x).numpy())
        except Exception as error:  # noqa: BLE001 (reported below)
            failures.append(error)

    threads = [threading.Thread(target=calls) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures and len(results) == 8 * _balance.EVERY
    for result in results:
        np.testing.assert_array_equal(result, x)
    assert _measurements(f, x) == before and f.weights == (1.0, 0.0)
    graph = f.get_concrete_function(x).graph
    placed = {tf.DeviceSpec.from_string(op.device) for op in graph.get_operations() if op.device}
    assert {(d.device_type, d.device_index) for d in placed} == {("CPU", 0)}
    assert sorted(op.type for op in graph.get_operations()) == sorted(
        op.type for op in alone.get_concrete_function(x).graph.get_operations()
    )


def test_a_call_where_the_split_does_not_pay_runs_on_the_fastest_device_alone():
    """Two shards that take their turns on one link (a lock), 4 ms each whatever their
    rows: a split call takes twice what one device alone does."""
    link = threading.Lock()

    def through_the_link(block):
        with link:
            time.sleep(0.004)
        return block

    def serial(block):
        out = tf.numpy_function(through_the_link, [block], tf.float32, stateful=False)
        return tf.ensure_shape(out, block.shape)

    f = tfshard.parallelize(serial, devices=CPUS[:2], per_sample=False, weights="auto")
    x = np.random.default_rng(8).normal(size=[64, 4]).astype(np.float32)
    for _ in range(80):
        np.testing.assert_array_equal(f(x).numpy(), x)
    assert f.weights in ((1.0, 0.0), (0.0, 1.0)), f.weights
    assert sorted(f.plan(64)) == [0, 64]
    assert "holds every row" in f.explain(x)


def test_timing_is_four_ops_per_shard_and_keeps_the_shards_unchained():
    """The timestamps are calls taking each shard's token: nothing chains the shards."""
    f = tfshard.parallelize(tf.identity, devices=CPUS[:2], weights="auto")
    x = np.zeros([4], np.float32)
    measured = f.get_measured_function(x)
    graph = measured.graph
    stamps = [op for op in graph.get_operations() if op.type == "StatefulPartitionedCall"]
    assert len(stamps) == 4  # a start and an end per shard
    for op in stamps:
        assert op.inputs[-1].op.type == "VarHandleOp"  # the shard's token
        shard = op.name.split("/")[0]
        chained = {c.name.split("/")[0] for c in op.control_inputs} - {shard}
        assert not {c for c in chained if c.startswith("tfshard_shard_")}, (op.name, chained)
    # It takes the plan's weights after the call's tensors; static weights measure nothing.
    assert [t.dtype for t in measured.inputs if t.dtype != tf.resource] == [tf.float32, tf.int64]
    static = tfshard.parallelize(tf.identity, devices=CPUS[:2], weights=[1, 1])
    assert static.get_measured_function(x) is None
    # One device alone holding every row: calls in turn still time the split, whose graph
    # it is; every other device found useless, nothing is measured.
    for _ in range(3):
        f.balance.observe([4, 4], [0.004, 0.004], warm_up=False, call_seconds=0.008)
    for _ in range(12):
        f.balance.observe_alone(0, 8, 0.0001, warm_up=False)
        f.balance.observe([4, 4], [0.004, 0.004], warm_up=False, call_seconds=0.008)
    assert sorted(f.weights) == [0.0, 1.0] and not f.balance.one_left
    assert f.get_measured_function(x) is not None
    for _ in range(_balance.WINDOW):
        f.balance.observe([4, 4], [0.004, 0.4], warm_up=False)
    assert f.balance.one_left and f.get_measured_function(x) is None
    assert _balance.WINDOW == 9 and _balance.BAND == 0.05 and _balance.USELESS == 50.0


# ------------------------------------------------- what a device's memory holds

# Shard 1 "runs out of memory" on more than OUT_OF_MEMORY_ABOVE rows: its Python raises
# MemoryError, which TensorFlow raises as a tf.errors.ResourceExhaustedError, as a GPU's
# allocator does. Every shard's rows are recorded (shard index, rows) as it runs.
OUT_OF_MEMORY_ABOVE = {"rows": 5}


def _affine(block, k, seen):
    seen.append((int(k), len(block)))
    if int(k) == 1 and len(block) > OUT_OF_MEMORY_ABOVE["rows"]:
        raise MemoryError(f"{len(block)} rows")
    return block * 2.0 + 1.0


def _bounded(seen):
    """A function of a shard, 2 x + 1, whose device 1 holds few rows (records in `seen`)."""

    def affine(block):
        out = tf.py_function(
            lambda b, k: _affine(b.numpy(), k, seen), [block, tfshard.shard_index()], tf.float32
        )
        return tf.ensure_shape(out, block.shape)

    return affine


def test_a_shard_out_of_memory_caps_its_device_and_later_calls_plan_within_it(monkeypatch):
    monkeypatch.setitem(OUT_OF_MEMORY_ABOVE, "rows", 5)
    seen = []
    f = tfshard.parallelize(_bounded(seen), devices=CPUS[:2], per_sample=False, weights="auto")
    x = np.random.default_rng(12).normal(size=[16, 3]).astype(np.float32)
    with pytest.raises(tfshard.ShardError) as raised:
        f(x)
    error = raised.value
    assert isinstance(error, tf.errors.ResourceExhaustedError)
    first = str(error).splitlines()[0]
    assert first.startswith(f"affine: shard 1 on {CPUS[1]} (rows [8:16) of 16) failed: it ran")
    assert f"{CPUS[1]} gets at most 4 rows (it ran out of memory with 8)" in first
    assert "from the next call on" in first and "is not run again" in first
    assert f.balance.caps() == (None, 4)
    assert f.plan(16) == [12, 4] and f.plan(6) == [3, 3] and f.plan(9) == [5, 4]
    assert "caps [-, 4]" in f.explain(x)
    # Later calls, measured (the split's shards timed, weights fed) and not (the weights
    # in use the graph's constants), in turn: each correct, device 1 never over its cap.
    kinds = itertools.cycle(["split", None, None])
    monkeypatch.setattr(f.balance, "due", lambda: next(kinds))
    seen.clear()
    for i in range(30):
        rows = (16, 9, 40, 3, 0, 7)[i % 6]
        out = f(x if rows == 16 else np.resize(x, [rows, 3]))
        numerics.assert_close(out.numpy(), np.resize(x, [rows, 3]) * 2.0 + 1.0)
    assert max(n for k, n in seen if k == 1) == 4
    assert f.balance.caps() == (None, 4) and f.balance.measured > 0


def test_a_cap_only_goes_down(monkeypatch):
    monkeypatch.setitem(OUT_OF_MEMORY_ABOVE, "rows", 5)
    seen = []
    f = tfshard.parallelize(_bounded(seen), devices=CPUS[:2], per_sample=False, weights="auto")
    x = np.ones([16, 3], np.float32)
    with pytest.raises(tf.errors.ResourceExhaustedError):
        f(x)
    assert f.balance.caps() == (None, 4)
    # Its memory shrinks (another job): 4 rows do not fit either, then 2 do.
    monkeypatch.setitem(OUT_OF_MEMORY_ABOVE, "rows", 3)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="at most 2 rows"):
        f(x)
    assert f.balance.caps() == (None, 2)
    seen.clear()
    np.testing.assert_array_equal(f(x).numpy(), x * 3.0)
    assert [n for k, n in seen if k == 1] == [2]
    balance = Balance(2)
    assert balance.cap(1, 8) == 4 and balance.cap(1, 20) == 4 and balance.cap(1, 5) == 2
    assert balance.cap(0, 1) == 0 and balance.caps() == (0, 2)


def test_rows_over_what_every_device_holds_are_refused_before_the_call(monkeypatch):
    seen = []
    f = tfshard.parallelize(_bounded(seen), devices=CPUS[:2], per_sample=False, weights="auto")
    f.balance.cap(0, 8)
    f.balance.cap(1, 6)
    assert f.balance.caps() == (4, 3) and f.plan(7) == [4, 3]
    x = np.ones([8, 3], np.float32)
    message = (
        r"a call of 8 rows needs more memory than its devices hold at once: .* at most 7 "
        r"rows together .*Call it with at most 7 rows at a time, or make it with max_rows=N"
    )
    with pytest.raises(tfshard.ArgumentError, match=message):
        f(x)
    with pytest.raises(tfshard.ArgumentError, match=message):
        f.plan(8)
    assert seen == []  # nothing ran
    np.testing.assert_array_equal(f(x[:7]).numpy(), x[:7] * 3.0)
    assert sorted(seen) == [(0, 4), (1, 3)]


def test_a_device_alone_that_runs_out_of_memory_gives_the_rows_back_to_the_split():
    balance = Balance(2)
    _measured(balance, [4, 4], [0.0040, 0.0036], times=3)
    for _ in range(12):
        balance.observe_alone(1, 8, 0.0001, warm_up=False)
        balance.observe([4, 4], [0.0040, 0.0036], warm_up=False, call_seconds=0.008)
    assert balance.weights == (0.0, 1.0)
    changes = balance.changes
    assert balance.cap(1, 8) == 4
    # The split's weights again: even (device 1 is 10 % faster per row, inside the band).
    assert balance.weights is None and balance.integer() == (1, 1)
    assert balance.changes == changes + 1 and not balance.settled
    # It is not weighed alone again: whole calls alone, faster, change nothing.
    for _ in range(3 * _balance.SETTLED):
        assert balance.due() in ("split", None)
        balance.observe([4, 4], [0.0040, 0.0036], warm_up=False, call_seconds=0.008)
        balance.observe_alone(1, 8, 0.0001, warm_up=False)
    assert balance.plan_for("alone") == balance.integer() == (1, 1)


def test_static_weights_learn_nothing_from_a_shard_out_of_memory(monkeypatch):
    monkeypatch.setitem(OUT_OF_MEMORY_ABOVE, "rows", 5)
    seen = []
    f = tfshard.parallelize(_bounded(seen), devices=CPUS[:2], per_sample=False, weights=[1, 1])
    x = np.ones([16, 3], np.float32)
    learns = "weights='auto' learns that from a call\\)"
    for _ in range(2):
        with pytest.raises(tf.errors.ResourceExhaustedError, match=learns):
            f(x)
    assert f.balance is None and f.plan(16) == [8, 8]
