"""_balance: weights="auto" measures each device on the function and plans by it.

The rules (lower-quartile window, dead band, the useless device, warm-up, which calls
are measured) are checked on `Balance` with given timings; the measurement on the CPU
bed, with an unequal pair made honestly: shard 1 does three times the work per row
(`tfshard.shard_index`), so its device is three times slower per row, and the best
weights are 3:1.
"""

import re
import signal
import threading
import time

import children
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


def _device_1_alone_ahead() -> Balance:
    """Two devices whose device 1 alone ends calls far sooner than the split."""
    balance = Balance(2)
    _measured(balance, [4, 4], [0.0040, 0.0036], times=3)
    for _ in range(12):
        balance.observe_alone(1, 8, 0.0001, warm_up=False)
        balance.observe([4, 4], [0.0040, 0.0036], warm_up=False, call_seconds=0.008)
    return balance


def test_a_device_alone_found_useless_gives_its_rows_to_the_split():
    # Device 1 alone ends calls far sooner than the split: it holds every row. Then it
    # slows 100x (another job on it): once the split's measurements weigh it 0, the rows
    # go to the other device, not to it for good with nothing measured again.
    balance = _device_1_alone_ahead()
    assert balance.weights == (0.0, 1.0) and not balance.one_left
    _measured(balance, [4, 4], [0.0040, 0.40], times=_balance.WINDOW)
    assert balance.weights == (1.0, 0.0) and balance.one_left


def test_a_measured_call_interrupted_while_it_waits_leaves_later_calls_their_turns(monkeypatch):
    # Ctrl-C (a SIGINT to the main thread, as a terminal sends it) while a measured call
    # waits for another thread's call to end: the calls after it neither wait for it nor
    # lose their measuring (a stuck one would wait forever here).
    assert threading.current_thread() is threading.main_thread()
    monkeypatch.setattr(_balance, "LONGEST_WAIT_S", 1e9)
    turns = _balance.Turns()
    held, release = threading.Event(), threading.Event()

    def holder():
        with turns.call(False):
            held.set()
            release.wait(120)  # bounds a hang only

    def ctrl_c():
        while not turns.measuring():  # until the call waits
            if release.is_set():
                return
            time.sleep(0)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=holder, daemon=True).start()
    assert held.wait(120)
    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt), turns.call(True):
            pass
    finally:
        release.set()
    assert not turns.measuring()
    measured = []

    def calls():
        with turns.call(False):
            pass
        with turns.call(True) as alone:
            measured.append(alone)

    later = threading.Thread(target=calls, daemon=True)
    later.start()
    later.join(120)  # bounds a hang only: the calls take microseconds
    assert not later.is_alive() and measured == [True] and turns.gave_up == 0


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
        assert balance.due() == "split" and balance.plan_for("split") == ((2, 1), None)
        balance.observe([67, 33], [0.0134, 0.0132], warm_up=False, call_seconds=0.04)
    assert balance.settled
    # Then the fastest device alone is weighed (every call until it is known), its whole
    # calls 20 ms.
    assert balance.due() == "alone" and balance.plan_for("alone") == ((1, 0), None)
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
    assert balance.plan_for("split") == ((2, 1), None)
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


# ------------------------------------------------- wrong arguments to the hook

_NAN, _INF = float("nan"), float("inf")
_WRONG_CALLS = {
    "cap, a negative device": (
        lambda b: b.cap(-1, 10), r"balance\.cap\(device=-1\): .* an int from 0 to 1"
    ),
    "cap, a device past the last": (lambda b: b.cap(2, 10), r"cap\(device=2\)"),
    "cap, a bool device": (lambda b: b.cap(True, 10), r"cap\(device=True\)"),
    "cap, a float device": (lambda b: b.cap(0.0, 10), r"cap\(device=0\.0\)"),
    "cap, negative rows": (lambda b: b.cap(0, -4), r"balance\.cap: rows=-4 .* an int >= 0"),
    "cap, fractional rows": (lambda b: b.cap(0, 2.5), r"rows=2\.5 "),
    "cap, rows as a string": (lambda b: b.cap(0, "4"), r"rows='4' "),
    "observe, too few rows": (
        lambda b: b.observe([2], [0.1, 0.2], warm_up=False),
        r"balance\.observe: rows=\[2\] must be a list of 2 values \(not 1\)",
    ),
    "observe, too many seconds": (
        lambda b: b.observe([2, 2], [0.1, 0.2, 0.3], warm_up=False),
        r"seconds=\[0\.1, 0\.2, 0\.3\] must be a list of 2 values \(not 3\)",
    ),
    "observe, rows as a string": (
        lambda b: b.observe("22", [0.1, 0.2], warm_up=False), r"rows='22' must be a list"
    ),
    "observe, negative rows": (
        lambda b: b.observe([-5, 2], [0.1, 0.2], warm_up=False), r"rows\[0\]=-5 .* int >= 0"
    ),
    "observe, a string for seconds": (
        lambda b: b.observe([2, 2], ["a", 0.1], warm_up=False),
        r"seconds\[0\]='a' .* a finite number >= 0",
    ),
    "observe, NaN seconds": (
        lambda b: b.observe([2, 2], [0.1, _NAN], warm_up=False), r"seconds\[1\]=nan "
    ),
    "observe, infinite seconds": (
        lambda b: b.observe([2, 2], [_INF, 0.1], warm_up=False), r"seconds\[0\]=inf "
    ),
    "observe, negative seconds": (
        lambda b: b.observe([2, 2], [-0.1, 0.1], warm_up=False), r"seconds\[0\]=-0\.1 "
    ),
    "observe, warm_up not a bool": (
        lambda b: b.observe([2, 2], [0.1, 0.2], warm_up="no"), r"warm_up='no' must be True"
    ),
    "observe, negative call_seconds": (
        lambda b: b.observe([2, 2], [0.1, 0.2], warm_up=False, call_seconds=-1.0),
        r"call_seconds=-1\.0 ",
    ),
    "observe, a warm-up's wrong rows": (
        lambda b: b.observe([2], [0.1, 0.2], warm_up=True), r"rows=\[2\] must be a list"
    ),
    "observe_alone, a negative device": (
        lambda b: b.observe_alone(-1, 8, 0.1, warm_up=False),
        r"balance\.observe_alone\(device=-1\)",
    ),
    "observe_alone, negative rows": (
        lambda b: b.observe_alone(0, -8, 0.1, warm_up=False), r"observe_alone: rows=-8 "
    ),
    "observe_alone, NaN seconds": (
        lambda b: b.observe_alone(0, 8, _NAN, warm_up=False), r"observe_alone: seconds=nan "
    ),
    "observe_alone, warm_up not a bool": (
        lambda b: b.observe_alone(0, 8, 0.1, warm_up="False"), r"warm_up='False' "
    ),
    "plan_for, an unknown kind": (
        lambda b: b.plan_for("both"), r"plan_for\(kind='both'\): .* 'split' or 'alone'"
    ),
}


def _state(balance):
    """All a balance shows of what it learned."""
    return (
        balance.weights,
        balance.in_use(),
        balance.caps(),
        balance.per_row(),
        balance.measured,
        balance.changes,
        balance.settled,
        balance.due(),
    )


@pytest.mark.parametrize("case", _WRONG_CALLS)
def test_a_wrong_argument_to_the_hook_is_named_and_changes_nothing(case):
    call, named = _WRONG_CALLS[case]
    balance = Balance(2)
    _measured(balance, [50, 50], [0.05, 0.15], times=_balance.MIN_SAMPLES)  # 3:1
    balance.cap(1, 80)
    before, twin = _state(balance), Balance(2)
    with pytest.raises(ArgumentError, match=named):
        call(balance)
    assert _state(balance) == before
    # Measured the same, a balance no wrong call reached takes the next ones alike.
    _measured(twin, [50, 50], [0.05, 0.15], times=_balance.MIN_SAMPLES)
    twin.cap(1, 80)
    twin.due()
    for b in (balance, twin):
        b.observe([60, 20], [0.06, 0.06], warm_up=False, call_seconds=0.07)
        b.observe_alone(0, 80, 0.1, warm_up=False)
        b.cap(0, 100)
    assert _state(balance) == _state(twin)


def test_the_hook_takes_numpy_values_as_python_ones():
    given, listed = Balance(2), Balance(2)
    for _ in range(_balance.MIN_SAMPLES):
        given.observe(np.array([50, 50]), np.array([0.05, 0.15]), warm_up=np.bool_(False))
        given.observe_alone(np.int64(0), np.int32(100), np.float32(0.1), warm_up=np.False_)
        listed.observe([50, 50], [0.05, 0.15], warm_up=False)
        listed.observe_alone(0, 100, float(np.float32(0.1)), warm_up=False)
    assert given.cap(np.int64(1), np.int64(9)) == listed.cap(1, 9) == 4
    assert _state(given) == _state(listed) and given.weights == (3.0, 1.0)


def test_a_functions_hook_refuses_a_wrong_cap_and_the_function_runs_as_before():
    f = tfshard.parallelize(lambda s: s * 2.0, devices=CPUS[:2], per_sample=False, weights="auto")
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(f(x).numpy(), x * 2)
    for device, rows in [(-1, 10), (5, 10), (0, -4)]:
        with pytest.raises(ArgumentError, match=r"balance\.cap"):
            f.balance.cap(device, rows)
    assert f.balance.caps() is None
    np.testing.assert_array_equal(f(x).numpy(), x * 2)
    np.testing.assert_array_equal(f(x[:1]).numpy(), x[:1] * 2)


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


# A real out-of-memory on the shard's own device, run in a process of its own: with
# oneDNN's CPU allocator (this process's) a refused allocation is retried for seconds
# before it fails; TensorFlow's plain one (TF_ENABLE_ONEDNN_OPTS=0) fails at once. Shard 1
# asks its device for 2**46 floats (256 TiB: no allocator grants it) where its rows (a
# chunk's, under max_rows) pass what `held` says its device holds; a tf.py_function that
# raises nothing records each shard's rows and answers `held`. One child, every case.
_REAL_OUT_OF_MEMORY = """
import contextlib, json, threading, numpy as np, tensorflow as tf, tfshard
tfshard.virtual_devices(3)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(8)
DEVICES = ["/device:CPU:1", "/device:CPU:2"]
seen, held = [], {"rows": 5, "together": None}

def note(rows, k):
    seen.append((int(k), int(rows)))
    if int(k) == 1 and held["together"] is not None:
        # Two calls in flight together: each waits for the other's shard 1, whose rows
        # take the memory it would have (another call's, not its own shard's).
        held["together"].wait(timeout=60)
        return np.int64(0)
    return np.int64(held["rows"])

def make(host=False, **options):
    def affine(block):
        rows = tf.shape(block, out_type=tf.int64)[0]
        k = tfshard.shard_index()
        limit = tf.py_function(note, [rows, k], tf.int64)
        big = tf.constant(2**46, tf.int64)
        ask = tf.where((k == 1) & (rows > limit), big, tf.constant(1, tf.int64))
        # host: the op that runs out is placed on CPU:0, not on the shard's device.
        with tf.device("/device:CPU:0") if host else contextlib.nullcontext():
            scratch = tf.reduce_sum(tf.zeros(tf.reshape(ask, [1])))
        return block * 2.0 + 1.0 + scratch
    return tfshard.parallelize(affine, devices=DEVICES, per_sample=False, weights="auto", **options)

def call(f, x):
    try:
        out = f(x)
    except tfshard.TfshardError as error:
        return {"error": type(error).__name__, "first": str(error).splitlines()[0],
                "exhausted": isinstance(error, tf.errors.ResourceExhaustedError)}
    return {"right": bool(np.array_equal(out.numpy(), x * 2.0 + 1.0))}

x = np.random.default_rng(12).normal(size=[16, 3]).astype(np.float32)
found = {}
# An unmeasured call alone: device 1 capped at 8 // 2; later calls, measured and not in
# turn, each right, device 1 never over its cap.
f = make()
f.balance.due = lambda: None
found["first"] = call(f, x)
found["caps"], found["plans"] = f.balance.caps(), [f.plan(16), f.plan(6), f.plan(9)]
found["explained"] = f.explain(x)
kinds = iter(["split", None, None] * 10)
f.balance.due = lambda: next(kinds)
seen.clear()
found["later"] = [call(f, np.resize(x, [(16, 9, 40, 3, 0, 7)[i % 6], 3])) for i in range(30)]
found["most"] = max(n for k, n in seen if k == 1)
found["measured"] = f.balance.measured
# Its memory shrinks (another job): a measured call of 4 rows on it runs out too. The
# devices measured equal first, whatever the calls above measured on a busy machine, so
# that the split gives device 1 its cap of 4 (not fewer rows, which would fit).
for _ in range(20):
    f.balance.observe([8, 8], [0.08, 0.08], warm_up=False)
found["down_split"] = f.balance.plan_for("split")[0]
held["rows"] = 3
f.balance.due = lambda: "split"
found["down"] = call(f, x)
f.balance.due = lambda: None
found["down_caps"] = f.balance.caps()
seen.clear()
found["down_after"] = call(f, x)
found["down_seen"] = [n for k, n in seen if k == 1]
# max_rows=4: the shard runs chunks of 4 rows, and one of them runs out.
held["rows"] = 3
f = make(max_rows=4)
f.balance.due = lambda: None
found["chunks"] = call(f, x)
found["chunks_caps"] = f.balance.caps()
seen.clear()
found["chunks_after"] = call(f, x)
found["chunks_seen"] = [n for k, n in seen if k == 1]
# The op that runs out is on the host's CPU, not the shard's device: no cap.
held["rows"] = 5
f = make(host=True)
f.balance.due = lambda: None
found["host"] = call(f, x)
found["host_caps"] = f.balance.caps()
# The only device left runs out: a call of as many rows no longer fits.
f = make()
for _ in range(3):
    f.balance.observe([4, 4], [0.4, 0.004], warm_up=False)
found["one_left"] = f.balance.one_left
found["left"] = call(f, x[:10])
found["left_caps"] = f.balance.caps()
found["left_again"] = call(f, x[:10])
found["left_fits"] = call(f, x[:5])
# Two calls in flight together, each out of memory for the other's rows: no cap.
held["rows"] = 8
f = make()
f.balance.due = lambda: None
call(f, x)  # traced and warm, alone: fits
held["together"] = threading.Barrier(2)
results = []
threads = [threading.Thread(target=lambda: results.append(call(f, x))) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
held["together"] = None
found["together"] = results
found["together_caps"] = f.balance.caps()
found["together_after"] = call(f, x)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def out_of_memory():
    """What `_REAL_OUT_OF_MEMORY`'s child found."""
    return children.printed_json(_REAL_OUT_OF_MEMORY, timeout=300, TF_ENABLE_ONEDNN_OPTS="0")


def test_a_shard_out_of_its_devices_memory_caps_it_and_later_calls_plan_within_it(
    out_of_memory,
):
    found = out_of_memory
    first = found["first"]
    assert first["error"] == "ShardResourceExhaustedError" and first["exhausted"]
    assert first["first"].startswith(
        f"affine: shard 1 on {CPUS[2]} (rows [8:16) of 16) failed: it ran out of memory. "
    )
    assert f"{CPUS[2]} gets at most 4 rows (it ran out of memory with 8)" in first["first"]
    assert "from the next call or stream on" in first["first"]
    assert "is not run again" in first["first"] and "call it again" in first["first"]
    assert found["caps"] == [None, 4] and found["plans"] == [[12, 4], [3, 3], [5, 4]]
    assert "caps [-, 4]" in found["explained"]
    assert found["later"] == [{"right": True}] * 30
    assert found["most"] == 4 and found["measured"] > 0


def test_a_cap_only_goes_down(out_of_memory):
    found = out_of_memory
    assert found["down_split"][0] == found["down_split"][1]  # even: device 1 gets its cap
    assert found["down"]["exhausted"] and "at most 2 rows" in found["down"]["first"]
    assert found["down_caps"] == [None, 2]
    assert found["down_after"] == {"right": True} and found["down_seen"] == [2]
    balance = Balance(2)
    assert balance.cap(1, 8) == 4 and balance.cap(1, 20) == 4 and balance.cap(1, 5) == 2
    assert balance.cap(0, 1) == 0 and balance.caps() == (0, 2)


def test_under_max_rows_a_cap_halves_the_rows_of_the_chunk_that_ran_out(out_of_memory):
    """A shard of 8 rows in chunks of 4 ran out on a chunk: the rows at once were 4, so the
    cap is 2 (not 4, which would run the same chunk again); the remedy is a smaller
    max_rows, not max_rows."""
    found = out_of_memory
    message = found["chunks"]["first"]
    assert found["chunks"]["exhausted"] and found["chunks_caps"] == [None, 2]
    assert f"{CPUS[2]} gets at most 2 rows (it ran out of memory with 4 rows at once)" in message
    assert (
        f"as it ran in chunks of at most 4 rows, make it with a smaller max_rows= for {CPUS[2]}"
        in message
    )
    assert "pass max_rows=N" not in message
    assert found["chunks_after"] == {"right": True} and found["chunks_seen"] == [2]


def test_memory_that_is_not_the_devices_own_caps_nothing(out_of_memory):
    """An op of shard 1 placed on the host's CPU ran out there; and two calls in flight
    together ran out for each other's rows: the plain remedies, no cap, and the next call
    alone runs as before."""
    found = out_of_memory
    for case, caps in (("host", "host_caps"), ("together", "together_caps")):
        failed = found[case] if case == "host" else found[case][0]
        assert failed["exhausted"] and "learned" not in failed["first"], failed
        assert "Pass max_rows=N to run each shard's function" in failed["first"]
        assert "learns that from a call that ran alone out of the device's own" in failed["first"]
        assert found[caps] is None
    assert [r["exhausted"] for r in found["together"]] == [True, True]
    assert found["together_after"] == {"right": True}


def test_a_call_that_no_longer_fits_once_capped_says_so(out_of_memory):
    """The only device left (the other useless) ran out with 10 rows: capped at 5, a call
    of 10 rows cannot run again, and the error says what can."""
    found = out_of_memory
    assert found["one_left"] and found["left_caps"] == [None, 5]
    message = found["left"]["first"]
    assert "a call of 10 rows no longer fits its devices: calls of at most 5 rows" in message
    assert "Split the batch, or make the function with max_rows=N" in message
    assert "call it again" not in message
    assert found["left_again"]["error"] == "ArgumentError"
    assert found["left_fits"] == {"right": True}


def test_a_pythons_memory_error_in_a_shard_is_the_hosts_and_caps_nothing(monkeypatch):
    """A tf.py_function's MemoryError (TensorFlow raises ResourceExhaustedError) is the
    host process's memory, whatever device the shard is on: the plain remedies."""
    monkeypatch.setitem(OUT_OF_MEMORY_ABOVE, "rows", 5)
    seen = []
    f = tfshard.parallelize(_bounded(seen), devices=CPUS[:2], per_sample=False, weights="auto")
    x = np.ones([16, 3], np.float32)
    with pytest.raises(tfshard.ShardError) as raised:
        f(x)
    first = str(raised.value).splitlines()[0]
    assert isinstance(raised.value, tf.errors.ResourceExhaustedError)
    assert first.startswith(f"affine: shard 1 on {CPUS[1]} (rows [8:16) of 16) failed: it ran")
    assert "learned" not in first and "Pass max_rows=N" in first
    assert f.balance.caps() is None and f.plan(16) == [8, 8]


def test_a_device_that_cannot_take_rows_leaves_the_others_balanced():
    """Devices 0 and 2 are 3:1 per row. Device 1, capped before it was measured (at 0
    rows, or at 2 rows whose shards are too short to time), is never measured: the others
    are weighed without it, as they are without a cap, and it keeps its weight beside
    the fastest's."""
    free = Balance(3)
    _measured(free, [10, 10, 10], [0.01, 0.01, 0.03], times=12)
    assert free.weights == (3.0, 3.0, 1.0)
    for cap_rows, rows, seconds in (
        (1, [20, 0, 20], [0.02, 0.0, 0.06]),  # capped at 0: no rows
        (4, [19, 2, 19], [0.019, 0.00001, 0.057]),  # capped at 2: 10 us, under SHORTEST
    ):
        balance = Balance(3)
        balance.cap(1, cap_rows)
        _measured(balance, rows, seconds, times=_balance.MIN_SAMPLES)
        assert balance.weights == (3.0, 3.0, 1.0), cap_rows
        assert balance.per_row()[1] is None and balance.integer() == (3, 3, 1)
    # Two devices, one capped at 0: one device is left, and no call is measured again.
    pair = Balance(2)
    pair.cap(1, 1)
    assert pair.one_left and pair.due() is None


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
    # Made with max_rows, the remedy is a smaller one.
    g = tfshard.parallelize(
        _bounded(seen), devices=CPUS[:2], per_sample=False, weights="auto", max_rows=4
    )
    g.balance.cap(0, 8)
    g.balance.cap(1, 6)
    with pytest.raises(tfshard.ArgumentError, match="or make it with a smaller max_rows="):
        g.plan(8)


def test_a_device_alone_that_runs_out_of_memory_gives_the_rows_back_to_the_split():
    balance = _device_1_alone_ahead()
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
    assert balance.plan_for("alone") == ((1, 1), (None, 4)) and balance.integer() == (1, 1)


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
