"""``weights="auto"``: each device's time per row, measured on the user's own function.

**Measuring.** With ``weights="auto"`` a measured call (or a stream's
batch) times each of its shards inside the graph, by two timestamps on its
device (`timed`): one when its rows are ready, before any of its ops runs,
one when its outputs are. The step returns each shard's rows and seconds
beside its results (`Timing`): four ops and two calls of a tiny function per
shard, two ``[K]`` vectors per call. A timestamp is a stateful op, which
TensorFlow would chain with every other stateful op of the call (the shards
would run in turn), so each is a call that takes its shard's token
(`tfshard._sharding.token`). On a GPU an op counts as done once its kernels
are queued, so there each timestamp waits for one element of the shard's
rows, then of each output, to reach the host: the start and end of the
kernels (the device's earlier work included in neither), not of their launch.
Across workers, both timestamps of a shard are taken on its own machine's
clock, and its seconds include sending it its rows.

**Which calls are measured** (`Balance.due`). Until the plan has stayed the
same over `SETTLED` measurements, every call is; once it has (and after a few
more that weigh the fastest device alone against the split), one call after
`EVERY`, the next after twice as many calls, and so on up to one in
`SPARSEST`: the interval doubles with each measured call that leaves the plan
as it is. The calls between run the unmeasured graph: the same plan, its
weights the graph's constants, with no timestamp and nothing sent to the
host, as static weights run. A measurement that changes the plan (or the
split's weights while the fastest device alone holds every row), or that finds
the other of the two ending calls sooner once, takes the interval back to
`EVERY`; a plan change measures every call again until it settles.
A measured call is either the split, its shards timed and the whole call to
its outputs ready (on a GPU, one element of them read on the host; outputs on
a CPU are ready when the call returns), or the fastest device alone, the whole
call timed so.
(A stream's traced loop times every batch of its calls, each call of the
loop one measurement, counted where no other call of the function ran beside
it, `Turns.alone`, else dropped.)
A measured call of a function runs alone among its calls (`Turns`): it
waits for the calls in flight to end, and calls from other threads wait for
it, so its seconds are its own shards', not another call's queued on the
same device. A call made on a thread that TensorFlow started (the function
called from a `tf.py_function`, a `tf.numpy_function` or a tf.data function)
waits as any other, except while a call of the function that can be running
Python is in flight (its graph holds such an op, or it is a call of a
stream's traced loop, whose dataset may run Python): it may be a call made
from inside that call's shards, which would wait for the call it is in. It
then waits for nothing: it runs beside the calls in flight, and a measured
call it ran beside is not counted (`Turns.alone`). Nothing runs apart from the user's own
calls, at the split they use, beside whatever else the machine runs then.

**Memory** (`Balance.cap`). A shard of a call that runs out of memory on
its own device (``tf.errors.ResourceExhaustedError``, the call alone among
the function's calls: `tfshard._engine.Engine.learned` says which count) with
r rows at once caps that device at r // 2 rows (never above a cap it had: caps
only go down, for the function's life). Every later call (not a graph traced
before, which holds the caps of its trace) gives a capped device at most
its cap, the rows over it going to the devices under theirs by their weights
(`tfshard._plan`, water-filling); a capped device no longer holds every row
alone, nor is it weighed alone, and one capped at 0 is not in a call's graph,
as one weighted 0. Speed still sets the weights (caps are not part of them):
a cap only bounds a share. A stream learns and uses caps too: the Python
loop's batches are calls; the traced loop plans every batch under the caps in
use when the stream starts (its device capped at 0 gets no rows, in the
loop's guarded shards), refuses a batch they cannot hold before it runs, and
learns from a batch that ran alone in its call of the loop (each stream's
first batch; a batch of a call of several, not known to Python, teaches
nothing), its call taking a turn (`Turns`) as a call does.

**Deciding** (`Balance`, pure Python, on the engine):

- A device's time per row is the lower quartile of its last `WINDOW`
  measurements (seconds over rows of one call, or of one call of a
  stream's loop): another job on a shared machine only ever slows a call,
  so the device's own speed is what its least disturbed calls show.
- Its weight is its speed, the fastest's time per row over its own,
  shown with the slowest device at 1 and rounded to 2 decimals (``[2.95,
  1.0]``): `ShardedFunction.weights` gives what the plan uses, to read or to
  pass again as ``weights=``.
- The plan changes only when the best weights are predicted to finish a
  call at least `BAND` and `MIN_GAIN` sooner than the
  weights in use, both predicted from the same times per row for the last
  call's rows: noise inside the band never moves the plan, and a function
  so cheap that its shards' fixed costs (and the machine's jitter) outweigh
  their rows keeps its plan.
- A device keeps a weight, and so rows, unless it is measured useless: more
  than `USELESS` times slower per row than the fastest. A useless device
  gets no rows from then on (and is not measured again: make a new function
  to measure it again).
- The split pays or not: the fastest device alone holds every row (weighted
  1, the others 0) once its whole calls, per row, end `BAND` and `MIN_GAIN`
  sooner than the split's (the lower quartile of each's last `WINDOW`, at
  least `MIN_SAMPLES` each) in `MIN_SAMPLES` comparisons in a row; the split
  is still measured now and then, by its own weights, and is the plan again
  once it is found to end calls sooner so.
- The first run of each traced graph warms up (kernels made, memory
  allocated) and is not counted, nor is a shard that took under `SHORTEST`,
  which times the clock more than the device. Until every device has been
  measured `MIN_SAMPLES` times, the split stays as it is (even at first).
  A device that cannot take rows is left out of that wait and of every
  decision, and keeps its weight beside the fastest's: one capped at 0, or
  capped and not yet measured `MIN_SAMPLES` times (a cap too small for a
  shard to take `SHORTEST` is never measured).
"""

from __future__ import annotations

import collections
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from tfshard import _plan, _sharding
from tfshard._arguments import check_flag
from tfshard._plan import Caps
from tfshard.errors import ArgumentError

# Measurements per device whose lower quartile is its time per row.
WINDOW = 9
# Measurements in a row that leave the plan as it is, after which it is settled,
SETTLED = 9
# and then one call in this many is measured, after at most this many measured in a row
# to weigh the fastest device alone against the split;
EVERY = 25
LEARNING = 12
# The calls between measured ones double with each measured call that leaves the plan as
# it is, up to this many.
SPARSEST = 200
# The plan changes when the best weights are predicted this much faster than those in use,
BAND = 0.05
# and by at least this many seconds a call.
MIN_GAIN = 0.25e-3
# A device this many times slower per row than the fastest is useless: it gets no rows.
USELESS = 50.0
# Measurements of each device needed before the plan can change (or a device be found
# useless): one call's alone could be one slowed by another job.
MIN_SAMPLES = 3
# A shard timed under this many seconds tells nothing of its device's speed (the
# timestamps' resolution is a microsecond, a thread's wake-up ten): not counted.
SHORTEST = 20e-6
# A measured call waits at most this long for the calls in flight to end (`Turns`), and
# a call for a measured one: only a call that never ends waits so long (one made from
# inside another's shard on a thread Python started, such as a pool's that a shard's
# `tf.py_function` waits for; one on TensorFlow's own threads does not wait while a call
# that can run Python is in flight, `Turns.running_python`), and the call then runs
# unmeasured (`Turns.gave_up` counts them).
LONGEST_WAIT_S = 30.0


class Timing(NamedTuple):
    """What the timed shards of one call (or of a stream's batches) took.

    Attributes:
      rows: each shard's rows, int64 ``[K]``.
      seconds: each shard's seconds from its rows ready to its outputs ready,
        float64 ``[K]``.
    """

    rows: tf.Tensor
    seconds: tf.Tensor


def stamp() -> Any:
    """The timestamp of `timed`: a traced function of a token, called once per stamp."""

    def now(handle: tf.Tensor) -> tf.Tensor:
        # The handle keeps the call out of the stateful chain (`timed`); depending on it
        # keeps the stamp after the call's control inputs once TensorFlow inlines the
        # call (they then wait for its inputs only: a stamp on nothing ran at the start).
        with tf.control_dependencies([handle]):
            return tf.timestamp()

    return tf.function(now, autograph=False).get_concrete_function(
        tf.TensorSpec([], tf.resource)
    )


def timed(
    run: Callable[[], Any], inputs: Sequence[Any], device: str, clock: Any
) -> tuple[Any, tf.Tensor]:
    """`run()`'s outputs, and the seconds from `inputs` ready to them ready, on `device`.

    Args:
      run: the shard's computation, traced here (under the caller's scopes).
      inputs: the shard's rows: the first timestamp waits for them.
      device: the shard's device, where both timestamps run.
      clock: `stamp()`, shared by the shards of one call.
    """
    handle = _sharding.token(device)
    with tf.device(device), tf.control_dependencies(_finished(inputs, device)):
        start = clock(handle)
    # The shard's ops wait for the first stamp: ready beside them, it could otherwise
    # run after them (the executor runs ready ops in no promised order).
    with tf.control_dependencies([start]):
        outputs = run()
    with tf.device(device), tf.control_dependencies(_finished(outputs, device)):
        end = clock(handle)
    return outputs, end - start


def _ops(values: Any) -> list[tf.Tensor]:
    return [t for t in tf.nest.flatten(values, expand_composites=True) if isinstance(t, tf.Tensor)]


def _finished(outputs: Any, device: str) -> list[tf.Tensor]:
    """What a timestamp waits for: the shard's rows (the first) or outputs (the second),
    or on a GPU one element of each read on the host (a GPU op is done, for a control
    edge, when its kernels are queued; the read waits for the kernels queued before)."""
    leaves = _ops(outputs)
    if tf.DeviceSpec.from_string(device).device_type != "GPU":
        return leaves
    touched = []
    for leaf in leaves:
        if leaf.dtype in (tf.resource, tf.variant, tf.string):
            touched.append(leaf)
            continue
        with tf.device(device):
            first = tf.reshape(leaf, [-1])[:1]  # [0] or [1] elements: nothing to copy back
        with tf.device(_plan.host_cpu(device)):
            touched.append(tf.identity(first))
    return touched


def _started_outside_python() -> bool:
    """Whether this thread was started outside Python's `threading`: by TensorFlow's runtime,
    to run a `tf.py_function`, a `tf.numpy_function` or a tf.data function.

    Python gives such a thread what its documentation calls a dummy thread
    object (`threading.current_thread`). No public name tells one from a thread
    that `threading.Thread` started (both are `threading.Thread`s, alive, with
    an ident; a dummy is daemonic, as a started thread may be), so this reads
    its class, `threading._DummyThread`, the one CPython has always given them
    (a thread of `_thread.start_new_thread` has one too, and is taken for
    TensorFlow's: `Turns` lets it skip its wait only while a call in flight can
    run Python).
    """
    return isinstance(threading.current_thread(), threading._DummyThread)


# What a turn holds (`_Turn`), each set in the same statement as the count it stands for:
# an interrupt lands before both or after both, and giving the turn back undoes it once.
_NOTHING, _RUNNING, _ALONE, _WAITING = 0, 1, 2, 3


class Turns:
    """Calls of one function in flight together, a measured one alone.

    Calls from several threads run side by side; a measured call
    (`Balance.due`) waits until the calls in flight have ended, and the calls
    that come meanwhile wait until it has ended, so its shards' seconds are
    its own (another call's shards on the same device would otherwise run
    inside its timestamps). One measured call at a time: a call due while
    another measures runs unmeasured, after it.

    Two kinds of call wait for nothing, since the call they would wait for may
    be waiting for them: one made from inside a call of this function on the
    same thread, and one made on a thread Python did not start (TensorFlow's,
    running a `tf.py_function`, a `tf.numpy_function` or a tf.data function)
    while a call in flight can be running Python (`running_python`: the
    function called from its own shards, or from a stream's dataset). Either
    runs at once, beside the calls in flight, unmeasured (one on TensorFlow's
    thread is measured where no call is in flight), and a measured call it
    runs beside is no longer `alone`: the engine does not count its
    measurement. Where no call in flight can run Python, a call on
    TensorFlow's thread (a tf.data map calling the function, its calls on
    several such threads) waits as a call on any thread does. A wait that passes
    `LONGEST_WAIT_S` (a call made from inside another's shard on a thread
    Python started, which that call waits for) gives up: the call then runs
    unmeasured, or beside the measured one, which is not `alone` either.

    A Ctrl-C never leaves a turn taken. Python raises a KeyboardInterrupt as a
    function starts, at a call or a backward jump, so it can land inside
    `take` or `done`, or as a ``finally`` block calls `done`: each change
    `take` makes is recorded in the turn by the statement that makes it, `take`
    gives back what it took when it raises, and `done` undoes only what the
    turn still holds (a repeat does nothing). A caller takes the turn inside
    the ``try`` whose ``finally`` calls `done` in a loop until one call of it
    ends uninterrupted, then raises the interrupt it caught (as
    `tfshard._engine.Engine` does, and the context managers `call` and
    `running_python` return, but for an interrupt that lands as their
    ``__exit__`` starts).

    Attributes:
      gave_up: waits that passed `LONGEST_WAIT_S` and gave up, so far (read it,
        do not set it).
    """

    def __init__(self) -> None:
        # One lock, taken directly on the path of every call, with nothing between taking
        # it and the change it guards; a waiting call waits on a lock of its own
        # (`_waker`), which a change releases (`_wake`).
        self._mutex = threading.Lock()
        self._wakers: list[Any] = []
        self._running = 0  # unmeasured calls in flight
        # Calls begun while another was in flight: a call that began with none in flight
        # ran alone for as long as this count is what it was then (`alone`).
        self._crowded = 0
        self._alone = False  # a measured call is in flight
        self._waiting = False  # a measured call waits for the others to end
        self._python = 0  # calls in flight that can be running Python (`running_python`)
        self._inside = threading.local()  # this thread's calls in flight
        self.gave_up = 0

    def call(self, measure: bool) -> _Turn:
        """A call's turn, not yet taken (`take`, then `done`); as a context manager,
        entered, whether the call is measured (`measure`, and it could run alone)."""
        return _Turn(self, measure)

    def running_python(self) -> _Python:
        """The part of a call (taken its turn) that can run Python (a graph that holds a
        `tf.py_function`, a `tf.numpy_function`, or a stream's loop, whose dataset may),
        a context manager (or `_Python.enter`, then `_Python.leave`, as `take` and
        `done`): while it runs, a call on a thread that TensorFlow started, which may be
        one made from inside it, waits for no turn."""
        return _Python(self)

    def take(self, turn: _Turn) -> bool:
        """Takes `turn` (`call`), waiting as the rules above say; returns whether the call
        is measured. Raising (an interrupt), it gives back what it took first."""
        try:
            inside = self._inside
            depth = turn._depth = getattr(inside, "depth", 0)
            deadline = None
            while True:
                with self._mutex:
                    waker = self._step(turn, depth > 0, deadline)
                if waker is None:
                    break
                if deadline is None:
                    deadline = time.monotonic() + LONGEST_WAIT_S
                waker.acquire(True, max(deadline - time.monotonic(), 0.0))  # or a change
                if time.monotonic() < deadline:
                    continue
                deadline = 0.0  # passed: the next look gives up waiting
            inside.since = turn._since
            inside.depth = depth + 1
            return turn._held == _ALONE
        except BaseException as raised:
            interrupted = None
            while True:  # until one `done` ends uninterrupted (a repeat does nothing)
                try:
                    self.done(turn)
                    break
                except KeyboardInterrupt as error:
                    interrupted = error
            if interrupted is not None:
                raise interrupted from raised
            raise

    def done(self, turn: _Turn) -> None:
        """Gives `turn` back, what `take` took of it; a repeat (after an interrupt in it)
        does nothing twice. Called on the thread that took it."""
        with self._mutex:
            self._leave(turn)
        if turn._depth is not None:
            self._inside.depth = turn._depth

    def alone(self) -> bool:
        """Whether this thread's call in flight has had no other call of the function in
        flight beside it so far (a measured call, or one begun with none in flight and
        none begun since); False outside a call's turn."""
        inside = self._inside
        return getattr(inside, "depth", 0) > 0 and getattr(inside, "since", -1) == self._crowded

    def measuring(self) -> bool:
        """Whether a measured call is in flight, or waits for the calls in flight to end
        (a call that comes meanwhile waits for it, `Turns`)."""
        return self._alone or self._waiting

    def _step(self, turn: _Turn, nested: bool, deadline: float | None) -> Any:
        """One look at the calls in flight, the mutex held: takes `turn` (None), or returns
        the lock to wait on (`_waker`) until something changes; `deadline` 0: the
        wait has passed `LONGEST_WAIT_S`."""
        if nested:  # beside the call it was made from, which it must not wait for
            self._crowded += 1
            self._running, turn._held, turn._since = self._running + 1, _RUNNING, -1
            return None
        # A call on TensorFlow's thread may be made from inside a call in flight that runs
        # Python, which it would wait for: only then does it not wait.
        waits = not (self._python > 0 and _started_outside_python())
        passed = deadline == 0.0
        if turn._held == _WAITING:  # a measured call, waiting for the others to end
            if self._running == 0:
                self._waiting, self._alone, turn._held = False, True, _ALONE
                turn._since = self._crowded
                return None
            if not passed:
                return self._waker()
            turn._measure = False
            self.gave_up += 1
            self._leave(turn)  # (and those waiting for it look again)
        elif turn._measure and not (self._alone or self._waiting):
            if self._running == 0:  # nothing to wait for
                self._alone, turn._held, turn._since = True, _ALONE, self._crowded
                return None
            if waits:
                self._waiting, turn._held = True, _WAITING
                return self._waker()
        turn._measure = False  # due while another measures: runs unmeasured, after it
        if (self._alone or self._waiting) and waits:
            if not passed:
                return self._waker()
            self.gave_up += 1
        beside = self._running > 0 or self._alone  # (a call that did not wait)
        if beside:
            self._crowded += 1
        since = -1 if beside else self._crowded
        self._running, turn._held, turn._since = self._running + 1, _RUNNING, since
        return None

    def _leave(self, turn: _Turn) -> None:
        """Undoes what `turn` holds, the mutex held, and wakes the waiting calls to look
        again (each time: a repeat wakes those an interrupt here left waiting)."""
        held = turn._held
        if held == _RUNNING:
            self._running, turn._held = self._running - 1, _NOTHING
        elif held == _ALONE:
            self._alone, turn._held = False, _NOTHING
        elif held == _WAITING:
            self._waiting, turn._held = False, _NOTHING
        if self._wakers:
            self._wake()

    def _waker(self) -> Any:
        """A lock for this thread to wait on, the mutex held: `_wake` releases it."""
        waker = threading.Lock()
        waker.acquire()
        self._wakers.append(waker)
        return waker

    def _wake(self) -> None:
        """Wakes every waiting call to look again, the mutex held. (Only this releases a
        waker, so one locked is one to release; one released twice after an
        interrupt here is one its waiter no longer waits on.)"""
        for waker in self._wakers:
            if waker.locked():
                waker.release()
        self._wakers.clear()


class _Python:
    """`Turns.running_python`: counts a call's part that can run Python while it runs;
    `leave` undoes what `enter` did, once (a repeat does nothing)."""

    __slots__ = ("_turns", "_held")

    def __init__(self, turns: Turns) -> None:
        self._turns, self._held = turns, False

    def enter(self) -> None:
        turns = self._turns
        with turns._mutex:
            if not self._held:
                turns._python, self._held = turns._python + 1, True

    def leave(self) -> None:
        turns = self._turns
        with turns._mutex:
            if self._held:
                turns._python, self._held = turns._python - 1, False

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, *exc: object) -> None:
        interrupted = None
        while True:  # until one `leave` ends uninterrupted (a repeat does nothing)
            try:
                self.leave()
                break
            except KeyboardInterrupt as error:
                interrupted = error
        if interrupted is not None:
            raise interrupted


class _Turn:
    """One call's turn in `Turns`: what it holds, for `Turns.done` to give back (a class,
    not a generator: it is on every call's path)."""

    __slots__ = ("_turns", "_measure", "_held", "_depth", "_since")

    def __init__(self, turns: Turns, measure: bool) -> None:
        self._turns, self._measure = turns, measure
        self._held, self._depth, self._since = _NOTHING, None, -1

    def __enter__(self) -> bool:
        return self._turns.take(self)

    def __exit__(self, *exc: object) -> None:
        interrupted = None
        while True:  # until one `done` ends uninterrupted (a repeat does nothing)
            try:
                self._turns.done(self)
                break
            except KeyboardInterrupt as error:
                interrupted = error
        if interrupted is not None:
            raise interrupted


class Balance:
    """The weights of ``weights="auto"`` for K devices, from their measured time per row.

    The rules are in the module docstring. Thread-safe: calls from several
    threads observe in turn. A method given a wrong argument (a device index
    out of range, negative rows, a count per device of the wrong length, a
    time that is not a finite number >= 0) raises `ArgumentError` naming it,
    and changes nothing.

    Args:
      count: the number of devices.

    Attributes:
      one_left: every device but one is useless (weighted 0) or capped at 0: no call
        is measured again, so none needs a turn (`Turns`); once True, True for good.
      measured: measurements counted so far.
      dropped: measured calls whose measurement was not counted, another call of
        the function having run beside them (`drop`).
      changes: times the plan changed.
      turns: the function's calls in flight (`Turns`), a measured one alone.
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._per_row: list[collections.deque[float]] = [
            collections.deque(maxlen=WINDOW) for _ in range(count)
        ]
        # Whole calls' seconds per row: of the split in use, and of each device alone.
        self._split_calls: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._alone_calls: list[collections.deque[float]] = [
            collections.deque(maxlen=WINDOW) for _ in range(count)
        ]
        self._split: tuple[float, ...] | None = None  # the split's weights (None: even)
        self._alone: int | None = None  # the device that holds every row, where that pays
        self._last = "alone"  # what the last measured call measured
        self._leaning = 0  # comparisons in a row that would change alone for split or back
        self._rows = 0  # the last measured call's rows
        self.measured = 0
        self.dropped = 0
        self.changes = 0
        self.turns = Turns()
        self._steady = 0  # measurements in a row that left the plan as it was
        self._since = 0  # calls since the last one measured, once settled
        self._interval = EVERY  # calls from one measured to the next, once settled
        # Calls sure to be unmeasured from now (once settled, those up to the next measured
        # one), counted down without the lock: `due`'s path for most calls. Under threads a
        # count may be lost (a call more unmeasured); a change sets it to 0 (`_count_one`).
        self._quiet = 0
        self._trials = 0  # calls measured since the plan settled, to weigh alone and split
        # What a call reads, kept as it is after each measurement (`_count_one`, the only
        # place the plan changes): a call between measurements computes nothing of it.
        # `weights`, and `integer` with `caps` (`in_use`), together, so that a reader sees
        # one plan's all.
        self._in_use: tuple[tuple[float, ...] | None, tuple[tuple[int, ...], Caps | None]] = (
            None, (_integer(None, count), None)
        )
        self._weighed: int | None = None  # `_candidate`
        self._caps: Caps | None = None  # `cap`
        self.one_left = count <= 1

    @property
    def weights(self) -> tuple[float, ...] | None:
        """The weights in use (the slowest device with rows at 1), or None: even so far.

        Where the fastest device alone ends a call sooner than the split, it is
        weighted 1 and the others 0."""
        return self._in_use[0]

    def integer(self) -> tuple[int, ...]:
        """The weights in use as the plan takes them (`_plan.integer_weights`); even: all 1."""
        return self._in_use[1][0]

    def plan_for(self, kind: str) -> tuple[tuple[int, ...], Caps | None]:
        """The integer weights a measured call of this `kind` (`due`) plans by, and the
        caps, read at once: the split's weights ("split", also while the fastest device
        holds every row), or the fastest device alone's ("alone"; those in use until one
        is weighed).

        Raises:
          ArgumentError: `kind` is neither.
        """
        if kind not in ("split", "alone"):
            raise ArgumentError(
                f"balance.plan_for(kind={kind!r}): kind must be 'split' or 'alone', what "
                "Balance.due says a measured call measures"
            )
        with self._lock:
            if kind == "split":
                return _integer(self._split, self._count), self._caps
            if kind == "alone" and self._weighed is not None:
                return tuple(int(k == self._weighed) for k in range(self._count)), self._caps
            return self._in_use[1]

    def in_use(self) -> tuple[tuple[int, ...], Caps | None]:
        """What an unmeasured call plans by now, read at once: `integer` and `caps`."""
        return self._in_use[1]

    def caps(self) -> Caps | None:
        """Each device's most rows in a call (None: no cap), as learned by `cap`, or None
        while no device has one."""
        return self._in_use[1][1]

    def cap(self, device: int, rows: int) -> int:
        """Learns that `device` ran out of memory with `rows` rows at once; returns its cap.

        From now on the plan gives it at most ``rows // 2`` rows, or the cap it
        had if that is fewer (caps only go down). Where it held every row alone,
        the split is the plan again; it is not weighed alone from then on. A
        device capped at 0 takes no rows again, as one found useless.

        Args:
          device: the device's index in the function's devices (``f.devices``).
          rows: the rows it held at once, an int >= 0.

        Raises:
          ArgumentError: `device` is not an index of a device, or `rows` not an
            int >= 0 (no cap changes).
        """
        device = self._index(device, "balance.cap")
        rows = _count(rows, "rows", "balance.cap", "the rows the device held at once")
        with self._lock:
            caps = list(self._caps or (None,) * self._count)
            had = caps[device]
            caps[device] = rows // 2 if had is None else min(had, rows // 2)
            self._caps = tuple(caps)
            if self._alone == device:
                self._alone, self._leaning = None, 0
                self.changes += 1
                self._steady = self._trials = 0
                self._interval, self._since, self._quiet = EVERY, 0, 0
                self._in_use = (self._split, (_integer(self._split, self._count), self._caps))
            else:
                self._in_use = (self._in_use[0], (self._in_use[1][0], self._caps))
            self._weighed = self._candidate()
            self.one_left = self._one_left()
            return caps[device]

    def per_row(self) -> list[float | None]:
        """Each device's time per row now (the lower quartile of its window), None until
        it has been measured `MIN_SAMPLES` times."""
        with self._lock:
            return [_quartile(s) if len(s) >= MIN_SAMPLES else None for s in self._per_row]

    @property
    def settled(self) -> bool:
        """The plan stayed the same over the last `SETTLED` measurements (shards too short
        to time, `SHORTEST`, leave it as it is)."""
        return self._steady >= SETTLED

    def due(self) -> str | None:
        """What the next call measures, or None for a call not measured; each call asks once.

        A measured call times the split's shards and the whole call ("split"),
        or the whole call on the fastest device alone ("alone"). Every call is
        measured until the split's weights are `settled`, all of them splits
        (or, once the fastest device alone is the plan, until that settles, all
        of them alone); then every call again until the split and the fastest device alone
        each have `MIN_SAMPLES` whole calls measured, and while a change
        between them found once is checked (`_choose`), the two in turn (at
        most `LEARNING` calls: a call that cannot run alone, such as a stream's
        batch, never measures it); then one call in `EVERY` (the first after
        that is not), the two in turn; the interval then doubles with each
        measured call, up to `SPARSEST`, and is `EVERY` again after a
        measurement that changes the plan or leans towards a change
        (`_count_one`). The calls up to the next measured one are counted down
        without the lock (`_quiet`): under threads a count may be lost, one call
        more unmeasured.
        """
        if self.one_left:
            return None  # every other device useless: one device, nothing to measure
        quiet = self._quiet
        if quiet > 0:
            self._quiet = quiet - 1
            return None
        with self._lock:
            fastest = self._weighed
            weighing = fastest is not None  # alone or split: which pays
            learning = weighing and (
                len(self._split_calls) < MIN_SAMPLES
                or len(self._alone_calls[fastest]) < MIN_SAMPLES
                or self._leaning > 0  # a change found once: see whether it holds
            )
            settled = self._steady >= SETTLED
            if settled and learning and self._trials < LEARNING:
                self._trials += 1
            elif settled:
                self._since += 1
                if self._since < self._interval:
                    return None
                self._interval = min(2 * self._interval, SPARSEST)
                # The calls up to the next measured one (the last counts under the lock).
                self._since = self._quiet = self._interval - 1
                return self._kind(settled)
            self._since = 0
            return self._kind(settled)

    def _kind(self, settled: bool) -> str:
        """What a measured call measures now (`due`), under the lock."""
        fastest = self._weighed
        weighing = fastest is not None
        if not weighing or (self._alone is None and not settled):
            return "split"  # the split's weights first
        if self._alone is not None and not settled:
            return "alone"  # the device alone, newly the plan, until it settles
        if len(self._split_calls) < MIN_SAMPLES:
            return "split"
        if len(self._alone_calls[fastest]) < MIN_SAMPLES:
            return "alone"
        return "alone" if self._last == "split" else "split"

    def observe(
        self,
        rows: Sequence[int],
        seconds: Sequence[float],
        warm_up: bool,
        call_seconds: float | None = None,
    ) -> None:
        """Counts one measurement: each shard's rows and seconds in one call (or loop call).

        Args:
          rows: each shard's rows.
          seconds: each shard's seconds, from its rows ready to its outputs ready.
          warm_up: the graph ran for the first time, so its times include making
            kernels and memory: not counted.
          call_seconds: the whole call's seconds, from before it started to its
            outputs ready (a call of the split in use), or None: not known (a stream).

        Raises:
          ArgumentError: `rows` or `seconds` is not one value per device (an int
            >= 0, a finite number >= 0), `warm_up` not a bool, or `call_seconds`
            neither None nor a finite number >= 0 (nothing is counted).
        """
        call = "balance.observe"
        rows = self._per_device(rows, "rows", call, _count, "a shard's rows")
        seconds = self._per_device(seconds, "seconds", call, _seconds, "a shard's seconds")
        check_flag(warm_up, "warm_up", call)
        if call_seconds is not None:
            call_seconds = _seconds(call_seconds, "call_seconds", call, "the whole call's seconds")
        if warm_up:
            return
        with self._lock:
            for samples, n, s in zip(self._per_row, rows, seconds):
                if n > 0 and s >= SHORTEST:
                    samples.append(float(s) / int(n))
            self._rows = sum(int(n) for n in rows)
            if call_seconds is not None and self._rows > 0:
                self._split_calls.append(float(call_seconds) / self._rows)
            self._last = "split"
            self._count_one(self._decide)

    def observe_alone(self, device: int, rows: int, seconds: float, warm_up: bool) -> None:
        """Counts one whole call of `rows` rows on `device` alone, which took `seconds`
        from before it started to its outputs ready (the first run of its graph: not).

        Raises:
          ArgumentError: `device` is not an index of a device, `rows` not an int
            >= 0, `seconds` not a finite number >= 0, or `warm_up` not a bool
            (nothing is counted).
        """
        call = "balance.observe_alone"
        device = self._index(device, call)
        rows = _count(rows, "rows", call, "the call's rows")
        seconds = _seconds(seconds, "seconds", call, "the whole call's seconds")
        check_flag(warm_up, "warm_up", call)
        if warm_up or rows <= 0:
            return
        with self._lock:
            self._alone_calls[device].append(float(seconds) / int(rows))
            self._rows = int(rows)
            self._last = "alone"
            self._count_one(self._choose)

    def drop(self) -> None:
        """Counts a measured call (or a call of a stream's traced loop) whose measurement
        is not counted: it did not run alone (`Turns.alone`: a call on a thread
        TensorFlow started ran beside it, a wait gave up, or, beside a loop's call, any
        other call of the function), so its seconds may hold another call's. The plan,
        and when the next call is measured (`due`), stay as they are."""
        with self._lock:
            self.dropped += 1

    def _index(self, device: Any, call: str) -> int:
        """`device` as an index of one of the devices, else ArgumentError naming `call`."""
        if (
            isinstance(device, bool)
            or not isinstance(device, numbers.Integral)
            or not 0 <= device < self._count
        ):
            raise ArgumentError(
                f"{call}(device={device!r}): device must be the index of one of the "
                f"function's {self._count} devices, an int from 0 to {self._count - 1} "
                "(its position in f.devices)"
            )
        return int(device)

    def _per_device(
        self, values: Any, name: str, call: str, check: Callable[..., Any], what: str
    ) -> list:
        """`values` (a list, a tuple, a 1-D NumPy array) as a list of one value per device,
        each `check`ed as `what`, else ArgumentError."""
        listed = None
        if isinstance(values, Sequence) and not isinstance(values, str | bytes):
            listed = list(values)
        elif getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):
            listed = values.tolist()  # a NumPy array
        if listed is None or len(listed) != self._count:
            held = "" if listed is None else f" (not {len(listed)})"
            raise ArgumentError(
                f"{call}: {name}={values!r} must be a list of {self._count} values{held}, "
                f"{what} for each device in the order of f.devices"
            )
        return [check(v, f"{name}[{k}]", call, what) for k, v in enumerate(listed)]

    def _count_one(self, decide: Callable[[], None]) -> None:
        before, split = self._in_use[0], self._split
        decide()
        if self._alone is not None and self._split and self._split[self._alone] == 0:
            self._alone = None  # the device alone was found useless: the split takes the rows
        self.measured += 1
        if self._alone is not None:
            now = tuple(1.0 if k == self._alone else 0.0 for k in range(self._count))
        else:
            now = self._split
        if now != before:
            self.changes += 1
            self._steady = self._trials = 0
            self._in_use = (now, (_integer(now, self._count), self._caps))
        else:
            self._steady += 1
        if now != before or self._split != split or self._leaning:
            # Something moved: measure often again (`due`), from this measurement on.
            self._interval, self._since, self._quiet = EVERY, 0, 0
        self._weighed = self._candidate()
        # A device found useless stays so (`_decide`): once one device is left, for good.
        self.one_left = self._one_left()

    def _one_left(self) -> bool:
        """At most one device can take rows: the others weighted 0 by the split, or capped
        at 0 (neither comes back)."""
        caps = self._caps or (None,) * self._count
        weights = self._split or (1.0,) * self._count
        return sum(1 for w, c in zip(weights, caps) if w > 0 and c != 0) <= 1

    def _left_out(self) -> set[int]:
        """The devices that cannot take rows to be measured by: capped at 0, or capped and
        measured fewer than `MIN_SAMPLES` times (a cap too small for a shard that takes
        `SHORTEST` keeps it so)."""
        if self._caps is None:
            return set()
        return {
            k
            for k, c in enumerate(self._caps)
            if c == 0 or (c is not None and len(self._per_row[k]) < MIN_SAMPLES)
        }

    def _candidate(self) -> int | None:
        """The device alone that calls weigh against the split: the one holding every row,
        else the fastest (None until every device is measured `MIN_SAMPLES` times, or
        where the fastest has a cap: it cannot hold every row)."""
        found = self._alone if self._alone is not None else self._fastest()
        if found is not None and self._caps is not None and self._caps[found] is not None:
            return None
        return found

    def _fastest(self) -> int | None:
        """The device of least time per row among those kept and not left out
        (`_left_out`), or None: not every such device measured `MIN_SAMPLES` times yet."""
        out = self._left_out()
        decided = [k for k in range(self._count) if k not in out]
        if any(len(self._per_row[k]) < MIN_SAMPLES for k in decided):
            return None
        now = self._split or (1.0,) * self._count
        rates = [(_quartile(self._per_row[k]), k) for k in decided if now[k] > 0]
        return min(rates)[1] if rates else None

    def _decide(self) -> None:
        out = self._left_out()
        decided = [k for k in range(self._count) if k not in out]
        if any(len(self._per_row[k]) < MIN_SAMPLES for k in decided):
            return  # a device measured too few times yet: keep the plan until it is
        now = self._split or (1.0,) * self._count
        rates = {k: _quartile(self._per_row[k]) for k in decided}
        # A device found useless stays so: it is not measured again (not in the call's
        # graph), and the fastest's own noise must not bring it back.
        kept = [k for k in decided if now[k] > 0]
        if not kept:
            return
        first = min(kept, key=lambda k: rates[k])
        fastest = rates[first]
        best = [
            # A device left out keeps its weight beside the fastest's.
            now[k] / now[first] if k in out
            else 0.0 if now[k] == 0 or rates[k] > USELESS * fastest
            else fastest / rates[k]
            for k in range(self._count)
        ]
        times = [rates[k] for k in decided]
        kept = _finish([now[k] for k in decided], times)
        moved = _finish([best[k] for k in decided], times)
        # A device found useless leaves the plan whatever it would save: its few rows
        # (under 2 %) are within the noise, and its copies and fixed costs are not.
        useless = [w == 0 for w in best] != [w == 0 for w in now]
        if useless or (kept > (1.0 + BAND) * moved and (kept - moved) * self._rows >= MIN_GAIN):
            self._split = _shown(best)
            self._split_calls.clear()  # whole calls of the old split tell nothing of the new
        self._choose()

    def _choose(self) -> None:
        """The fastest device alone, or the split: the other one once it is found to end a
        whole call `BAND` and `MIN_GAIN` sooner (each known from `MIN_SAMPLES` calls) in
        `MIN_SAMPLES` comparisons in a row, so that two near alike do not take turns."""
        fastest = self._candidate()
        if fastest is None:
            return
        alone, split = self._alone_calls[fastest], self._split_calls
        if len(alone) < MIN_SAMPLES or len(split) < MIN_SAMPLES:
            return
        now, other = (_quartile(split), _quartile(alone))
        if self._alone is not None:
            now, other = other, now
        if now > (1.0 + BAND) * other and (now - other) * self._rows >= MIN_GAIN:
            self._leaning += 1
        else:
            self._leaning = 0
        if self._leaning >= MIN_SAMPLES:
            self._alone = fastest if self._alone is None else None
            self._leaning = 0


def _count(value: Any, name: str, call: str, what: str) -> int:
    """`value` as a count of rows, an int >= 0 (a NumPy int too), else ArgumentError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ArgumentError(f"{call}: {name}={value!r} must be {what}, an int >= 0")
    return int(value)


def _seconds(value: Any, name: str, call: str, what: str) -> float:
    """`value` as seconds, a finite number >= 0 (a NumPy number too), else ArgumentError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ArgumentError(f"{call}: {name}={value!r} must be {what}, a finite number >= 0")
    return float(value)


def _integer(weights: tuple[float, ...] | None, count: int) -> tuple[int, ...]:
    return (1,) * count if weights is None else _plan.integer_weights(weights)


def _quartile(samples: Sequence[float]) -> float | None:
    """The lower quartile of a window of times per row (its least of 1 to 4), or None."""
    if not samples:
        return None
    return sorted(samples)[(len(samples) - 1) // 4]


def _finish(weights: Sequence[float], per_row: Sequence[float]) -> float:
    """When a call would end, in seconds per row of the batch: the slowest shard's share."""
    total = sum(weights)
    return max(w / total * s for w, s in zip(weights, per_row))


def _shown(weights: Sequence[float]) -> tuple[float, ...]:
    """Weights as shown and used: the slowest device with rows at 1, two decimals."""
    slowest = min(w for w in weights if w > 0)
    return tuple(round(w / slowest, 2) for w in weights)
