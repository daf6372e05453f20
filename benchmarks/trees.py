r"""The tree walk: `tfshard`'s flatten against `tf.nest`, per call.

Every call of a parallelized function flattens its arguments into leaves and a
hashable key of their structure (its trace key). tfshard's walker does both in
one pass; with `tf.nest` it takes two: `tf.nest.flatten` for the leaves and
`tf.nest.map_structure(type)` for a key. The table gives, for a few argument
structures of [8, 4] tensors, the best of ``--repeat`` timings of ``--number``
walks, per walk.

  python benchmarks/trees.py
  python benchmarks/trees.py --number=20000 --repeat=7
"""

from __future__ import annotations

import timeit
from typing import Any

from absl import app, flags

_NUMBER = flags.DEFINE_integer("number", 20000, "Walks per timing.", lower_bound=1)
_REPEAT = flags.DEFINE_integer("repeat", 7, "Timings per case (the best is kept).", lower_bound=1)


def cases(tf) -> dict[str, Any]:
    """The argument structures measured, by name."""
    x = tf.zeros([8, 4])
    return {
        "one tensor": x,
        "(x, y, z)": (x, x, x),
        "dict of 5 tensors": dict.fromkeys("abcde", x),
    }


def measure(value: Any, number: int, repeat: int) -> dict[str, float]:
    """Seconds per walk of `value`: tfshard's flatten and tf.nest's two passes."""
    import tensorflow as tf

    from tfshard import _trees

    def nest() -> Any:
        return tf.nest.flatten(value), tf.nest.map_structure(type, value)

    def best(walk) -> float:
        return min(timeit.repeat(walk, number=number, repeat=repeat)) / number

    return {"tfshard_s": best(lambda: _trees.flatten(value)), "tf_nest_s": best(nest)}


def main(argv: list[str]) -> None:
    del argv
    import tensorflow as tf

    print(f"{'structure':<20} {'tfshard':>9}  {'tf.nest':>9}")
    for name, value in cases(tf).items():
        times = measure(value, _NUMBER.value, _REPEAT.value)
        print(f"{name:<20} {times['tfshard_s'] * 1e6:6.1f} us  {times['tf_nest_s'] * 1e6:6.1f} us")


if __name__ == "__main__":
    app.run(main)
