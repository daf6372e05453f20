"""README.md's python blocks run as printed, in fresh child processes; and the error text it
quotes is TensorFlow's.

The README reads as programs: a block that imports tfshard starts one (its own fresh
process, as a user pasting it would), and a block that does not continues the program
before it (`embed`, `images` and `ds` come from "What it does"). Each program is one child
that runs its blocks in order and names the README line of the block that failed, so a
TensorFlow start is paid once per program, not once per block.

Skipped blocks are listed in `_SKIPPED` by how their first line starts, each with why; a
listed block the README no longer has fails the test, so the list cannot go stale.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from children import environ

import tfshard

README = Path(__file__).resolve().parent.parent / "README.md"

# How the block's first line starts -> why it does not run here.
_SKIPPED = {
    "predict = tfshard.parallelize(lambda x: model(x)": (
        "a fragment: `build_model`, `devices` and `model` are the reader's own"
    ),
    'f = tfshard.parallelize(fn, per_sample=False, weights="auto")': (
        "a fragment: `fn`, `batches` and `x` are the reader's own"
    ),
    "timeline = f.timeline(x)": ("a fragment: `f`, `x` and `dataset` are the reader's own"),
    "with tfshard.utilization.Monitor() as monitor:": (
        "needs nvidia-smi and a GPU, and `train_one_epoch`, `step_fn`, `batch` are the reader's"
    ),
    'tfshard.connect("host1:2222,host2:2222")': (
        "needs worker servers on host1 and host2 (examples/cluster_map.py runs that locally)"
    ),
}

# Runs one program's blocks in order; argv: a JSON list of [README line, source] pairs.
_RUNNER = """\
import json, sys, traceback
namespace = {"__name__": "__main__"}
for line, source in json.loads(sys.argv[1]):
    try:
        exec(compile(source, f"README.md:{line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the block at README.md line {line} failed")
"""


def _blocks() -> list[tuple[int, str]]:
    """Every ```python block of the README: (line of its fence, its dedented source)."""
    blocks, lines = [], README.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, textwrap.dedent("\n".join(body))))
        i += 1
    return blocks


def _skipped(source: str) -> bool:
    return any(source.startswith(first) for first in _SKIPPED)


def _programs() -> list[list[tuple[int, str]]]:
    """The blocks not skipped, grouped: a block importing tfshard starts a program."""
    programs: list[list[tuple[int, str]]] = []
    for line, source in _blocks():
        if _skipped(source):
            continue
        if "import tfshard" in source or not programs:
            programs.append([])
        programs[-1].append((line, source))
    return programs


def test_every_skipped_block_is_in_the_readme():
    sources = [source for _, source in _blocks()]
    assert [f for f in _SKIPPED if sum(s.startswith(f) for s in sources) != 1] == []


@pytest.mark.parametrize("program", _programs(), ids=lambda p: f"README.md:{p[0][0]}-{p[-1][0]}")
def test_readme_program_runs_as_printed(program, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(program)],
        cwd=tmp_path,  # blocks write "embeddings" and "embeddings.npy" where they run
        env=environ(TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_the_rows_check_inside_a_tf_function_is_quoted_as_tensorflow_prints_it():
    # "One exception": the README's own example, x of 7 rows and y of 8.
    two = tfshard.parallelize(lambda x, y: x + y, devices=["/device:CPU:0", "/device:CPU:1"])

    @tf.function(input_signature=[tf.TensorSpec([None, 784]), tf.TensorSpec([None, 784])])
    def outer(x, y):
        return two(x, y)

    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        outer(np.zeros([7, 784], np.float32), np.zeros([8, 784], np.float32))
    printed = next(
        line.strip() for line in caught.value.message.splitlines() if "assertion failed" in line
    )
    printed = printed[printed.index("assertion failed: ") :]
    quoted = README.read_text().split("Its\nmessage says what the `ArgumentError` would", 1)[1]
    assert f"```\n{printed}\n```" in quoted.split("Where the rows are static", 1)[0]
