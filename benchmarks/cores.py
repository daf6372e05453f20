r"""How much more work two processes get through than one: the machine's own ceiling.

A speed-up over one device on K logical CPU devices can be no better than what
K cores give when they share nothing at all. This script measures that: it
starts K worker processes, each running the compute case's matmul + tanh
chain with one intra-op thread, and times one worker alone against all K at
once, in alternating rounds. K workers doing K times the work in the time one
does it alone would be K x; shared caches, memory bandwidth and a virtual
machine's scheduling take their part, and no method inside one process (tfshard,
a hand-written graph, MirroredStrategy) can beat what is left.

  python benchmarks/cores.py                       # 2 workers, 9 rounds
  python benchmarks/cores.py --workers=2 --rounds=15 --batch=8192
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from absl import app, flags

_WORKERS = flags.DEFINE_integer("workers", 2, "Worker processes, one core each.", lower_bound=2)
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Rounds of (one alone, all at once).", lower_bound=1)
_CALLS = flags.DEFINE_integer("calls", 10, "Calls of the chain per worker per round.")
_BATCH = flags.DEFINE_integer("batch", 4096, "Rows per call (half the compute case's batch).")
_WIDTH = flags.DEFINE_integer("width", 256, "Feature size of the chain.")
_DEPTH = flags.DEFINE_integer("depth", 8, "matmul + tanh layers of the chain.")
_CHILD = flags.DEFINE_bool("child", False, "Run as a worker (used by the script itself).")


def child() -> None:
    """A worker: builds the chain, then for each 'go' on stdin times --calls calls."""
    import _harness
    import cases
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    fn = tf.function(cases.matmul_tanh_chain(_WIDTH.value, _DEPTH.value, 0, "/device:CPU:0"))
    x = _harness.random_inputs([_BATCH.value, _WIDTH.value], 1, 1, "/device:CPU:0")[0]
    fn(x).numpy()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        start = time.perf_counter()
        for _ in range(_CALLS.value):
            fn(x).numpy()
        print(f"{time.perf_counter() - start:.6f}", flush=True)


def _round(workers: list[subprocess.Popen]) -> float:
    """Starts `workers` at once; returns the time until the last one finished."""
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    return max(float(w.stdout.readline()) for w in workers)


def measure(count: int, rounds: int) -> dict[str, float]:
    """Times one worker alone and `count` at once, `rounds` times each.

    Returns:
      The medians, and ``ratio``: how much more work `count` workers did per
      second than one (the median of per-round ratios).
    """
    argv = [sys.executable, __file__, "--child"] + [a for a in sys.argv[1:] if a != "--child"]
    workers = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    try:
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker failed to start; run it with --child to see why")
        alone, together = [], []
        for _ in range(rounds):
            alone.append(_round(workers[:1]))
            together.append(_round(workers))
    finally:
        for w in workers:
            w.stdin.close()
            w.wait(timeout=60)
    return {
        "alone_median_s": statistics.median(alone),
        "together_median_s": statistics.median(together),
        "ratio": statistics.median(count * a / t for a, t in zip(alone, together)),
    }


def main(argv: list[str]) -> None:
    del argv
    if _CHILD.value:
        child()
        return
    count = _WORKERS.value
    result = measure(count, _ROUNDS.value)
    print(
        f"{_CALLS.value} calls of the chain ({_DEPTH.value} x [{_BATCH.value}, {_WIDTH.value}] "
        f"x [{_WIDTH.value}, {_WIDTH.value}] + tanh) per worker, one intra-op thread each:"
    )
    print(f"  one worker alone:    {result['alone_median_s'] * 1e3:9.1f} ms (median)")
    print(f"  {count} workers at once: {result['together_median_s'] * 1e3:9.1f} ms (median)")
    print(
        f"  {count} workers get through {result['ratio']:.2f}x the work of one "
        f"(ideal {count}x): the ceiling of any speed-up on {count} CPU devices here"
    )


if __name__ == "__main__":
    app.run(main)
