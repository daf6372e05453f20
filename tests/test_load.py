"""tfshard.load: what f.write wrote, read back whole and consistent, or a clear refusal.

References: NumPy arrays the test computes itself, and the writes' own
outputs read back with NumPy alone (``np.load``). Another write that
replaces the path while `load` reads it runs at each statement of `load` in
turn (a `sys.settrace` tracer on `tfshard.load`'s frame runs it there), so the
interleavings are exact, not left to timing.
"""

import json
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard import writing
from tfshard.errors import ArgumentError, WriteError

CPUS = [f"/device:CPU:{i}" for i in range(4)]
ROWS = 12


def _inputs():
    return np.arange(ROWS * 2, dtype=np.float32).reshape(ROWS, 2)


def _dataset():
    return tf.data.Dataset.from_tensor_slices(_inputs()).batch(4)


def _scaled(scale):
    """A function named ``scaled`` (so writes of any scale have the same manifest)."""

    def scaled(s):
        return {"a": s * scale, "b": s[0] * scale + 1.0}

    return tfshard.parallelize(scaled, devices=CPUS[:2])


def _want(scale):
    x = _inputs()
    return {"a": x * np.float32(scale), "b": x[:, 0] * np.float32(scale) + np.float32(1.0)}


def _which(got, scales):
    """The scale of the write `got` (a load's result) is whole of; fails for a mix."""
    assert isinstance(got, dict) and sorted(got) == ["a", "b"]
    for scale in scales:
        want = _want(scale)
        rows = len(got["a"])
        if rows == len(got["b"]) and all(
            np.array_equal(np.asarray(got[key]), want[key][:rows]) for key in want
        ):
            return scale
    raise AssertionError(f"a mixed result: {({k: np.asarray(v).tolist() for k, v in got.items()})}")


def _statements_of_load(action, at):
    """Runs ``tfshard.load`` with `action()` called before its statements numbered in `at`
    (counting each statement run in `load`'s own frame from 0; None: before every one)."""
    seen = [0]

    def in_load(frame, event, arg):
        if event == "line":
            if at is None or seen[0] in at:
                action()
            seen[0] += 1
        return in_load

    def tracer(frame, event, arg):
        return in_load if frame.f_code is tfshard.load.__code__ else None

    return tracer, seen


def _traced(run, action, at=None):
    tracer, seen = _statements_of_load(action, at)
    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        return run(), seen[0]
    finally:
        sys.settrace(before)


def _count_statements(path, **kwargs):
    return _traced(lambda: tfshard.load(path, **kwargs), lambda: None)[1]


def test_an_overwrite_at_any_statement_of_load_gives_one_write_whole_never_a_mix(tmp_path):
    """Writes of one function name over the same dataset have manifests equal in every field,
    so only the files tell the old write from the new: load returns one of them whole."""
    path = tmp_path / "w"
    functions = {1.0: _scaled(1.0), -1.0: _scaled(-1.0)}
    functions[1.0].write(_dataset(), path)
    statements = _count_statements(path)
    assert statements > 5
    now = [1.0]
    seen = set()
    for at in range(statements):
        before, after = now[0], -now[0]

        def overwrite(after=after):
            functions[after].write(_dataset(), path, overwrite=True)
            now[0] = after

        got, _ = _traced(lambda: tfshard.load(path), overwrite, {at})
        assert now[0] == after  # the overwrite ran, inside this load
        seen.add((before, _which(got, (before, after))))
    # Statements before the files are opened see the new write; after they are known to be
    # the manifest's, the old one (its files stay whole while open).
    assert seen == {(1.0, -1.0), (-1.0, 1.0), (1.0, 1.0), (-1.0, -1.0)}


def test_an_overwrite_at_every_statement_of_load_is_a_clear_write_error(tmp_path):
    path = tmp_path / "w"
    functions = [_scaled(1.0), _scaled(-1.0)]
    functions[0].write(_dataset(), path)
    count = [0]

    def overwrite():
        count[0] += 1
        functions[count[0] % 2].write(_dataset(), path, overwrite=True)

    with pytest.raises(WriteError, match="another write is replacing the write there") as caught:
        _traced(lambda: tfshard.load(path), overwrite)
    assert "call tfshard.load again when that write has ended" in str(caught.value)
    assert "changed outside" not in str(caught.value)
    # It tried again, each time after another overwrite, before it gave up.
    assert count[0] > writing.LOAD_TRIES


def _unfinished(path, function, batches):
    """A write of `function` over `_dataset()` that stopped with an error after `batches`
    batches (a dataset of unknown length, so the same dataset resumes it)."""
    x = _inputs()

    def stream(fail):
        for start in range(0, ROWS, 4):
            if fail and start >= 4 * batches:
                raise RuntimeError("the stream broke")
            yield x[start : start + 4]

    def dataset(fail):
        spec = tf.TensorSpec([None, 2], tf.float32)
        return tf.data.Dataset.from_generator(lambda: stream(fail), output_signature=spec)

    with pytest.raises(tf.errors.UnknownError, match="the stream broke"):
        function.write(dataset(True), path, batched=True, overwrite=True)
    return dataset(False)


def test_a_partial_load_while_the_same_write_goes_on_gives_its_committed_rows(tmp_path):
    """load(partial=True) beside a running write is what it is for: the write resumed and
    finished at any statement of load gives the rows committed before or after, never an
    error."""
    path = tmp_path / "w"
    function = _scaled(2.0)
    rest = _unfinished(path, function, 1)
    assert len(tfshard.load(path, partial=True)["a"]) == 4
    statements = _count_statements(path, partial=True)
    rows = set()
    for at in range(statements):
        if at:  # one batch on disk again
            rest = _unfinished(path, function, 1)

        def resume(rest=rest):
            function.write(rest, path, batched=True)

        got, _ = _traced(lambda: tfshard.load(path, partial=True), resume, {at})
        assert _which(got, (2.0,)) == 2.0
        rows.add(len(got["a"]))
        assert tfshard.load(path)["a"].shape == (ROWS, 2)  # the resume finished
    assert rows == {4, ROWS}


def test_an_overwrite_that_commits_a_batch_during_load_gives_no_partial_result(tmp_path):
    """An overwrite of the same function and dataset (a manifest equal but for its count)
    that commits its first batch at any statement of load: without partial=True, load
    gives the old write whole or says the write there has not finished, never its rows
    so far."""
    path = tmp_path / "w"
    function = _scaled(2.0)
    rest = _unfinished(path, function, 1)
    function.write(rest, path, batched=True)
    statements = _count_statements(path)
    outcomes = set()
    for at in range(statements):

        def overwrite_one_batch():
            _unfinished(path, function, 1)

        try:
            got, _ = _traced(lambda: tfshard.load(path), overwrite_one_batch, {at})
        except ArgumentError as error:
            assert "has not finished (4 rows in 1 batches so far;" in str(error)
            outcomes.add("not finished")
        else:
            assert _which(got, (2.0,)) == 2.0
            assert len(got["a"]) == ROWS, f"a partial result at statement {at}"
            outcomes.add("whole")
        assert len(tfshard.load(path, partial=True)["a"]) == 4  # the overwrite ran, stopped
        function.write(rest, path, batched=True)  # finished again for the next statement
    assert outcomes == {"not finished", "whole"}


def test_load_reads_through_the_files_it_opened(tmp_path):
    """What load returns stays whole after the path is overwritten and its old files are
    removed: the memory maps hold the files they were made from."""
    path = tmp_path / "w"
    _scaled(1.0).write(_dataset(), path)
    got = tfshard.load(path)
    _scaled(-1.0).write(_dataset(), path, overwrite=True)
    assert _which(got, (1.0,)) == 1.0
    assert _which(tfshard.load(path), (-1.0,)) == -1.0
    assert isinstance(got["a"], np.memmap)
    np.testing.assert_array_equal(np.load(path / "a.npy"), _want(-1.0)["a"])


def test_a_manifest_that_is_not_json_is_refused_with_the_fix_that_works(tmp_path):
    path = tmp_path / "w"
    function = _scaled(1.0)
    function.write(_dataset(), path)
    (path / "manifest.json").write_text("{")
    with pytest.raises(WriteError, match="remove the directory") as caught:
        tfshard.load(path)
    assert "overwrite=True" not in str(caught.value)
    with pytest.raises(ArgumentError, match="not a tfshard write's"):  # what load did not advise
        function.write(_dataset(), path, overwrite=True)


@pytest.mark.parametrize(
    "case", ["not json, alone", "not json, with its files", "version 3, with a stray file"]
)
def test_write_and_load_give_one_fix_for_a_damaged_write_the_one_overwrite_takes(
    tmp_path, case
):
    path = tmp_path / "w"
    function = _scaled(1.0)
    if case == "not json, alone":
        path.mkdir()
        (path / "manifest.json").write_text("{")
    else:
        function.write(_dataset(), path)
    if case == "not json, with its files":
        (path / "manifest.json").write_text("{")
    if case == "version 3, with a stray file":
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "version": 3}))
        (path / "notes.npy").write_bytes(b"mine")
    with pytest.raises(WriteError, match="is not a manifest this tfshard wrote") as loaded:
        tfshard.load(path)
    with pytest.raises(WriteError, match="is not a manifest this tfshard wrote") as written:
        function.write(_dataset(), path)
    fix = str(loaded.value).rsplit("; ", 1)[1]
    assert fix == str(written.value).rsplit("; ", 1)[1]
    if "overwrite=True (" in fix:
        function.write(_dataset(), path, overwrite=True)
        assert _which(tfshard.load(path), (1.0,)) == 1.0
    else:
        assert fix.startswith("remove the directory, or write to another path")
        with pytest.raises(ArgumentError, match="not a tfshard write's"):
            function.write(_dataset(), path, overwrite=True)
    assert ("overwrite=True (" in fix) == (case == "not json, alone")


def test_files_that_disagree_with_their_manifest_are_refused_with_overwrite_as_the_fix(
    tmp_path,
):
    path = tmp_path / "w"
    function = _scaled(1.0)
    function.write(_dataset(), path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["leaves"][0]["parts"][0]["dtype"] = "int32"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(WriteError, match=r"overwrite=True"):
        tfshard.load(path)
    function.write(_dataset(), path, overwrite=True)  # the fix load gave works
    assert _which(tfshard.load(path), (1.0,)) == 1.0


def _swap(manifest):
    (_, a), (_, b) = manifest["outputs"]["dict"]
    a["leaf"], b["leaf"] = b["leaf"], a["leaf"]


EDITS = {
    "a leaf number past the leaves": lambda m: m["outputs"]["dict"][0].__setitem__(1, {"leaf": 5}),
    "a leaf number that is a str": lambda m: m["outputs"]["dict"][0].__setitem__(1, {"leaf": "x"}),
    "a leaf number that is a bool": lambda m: m["outputs"]["dict"][1].__setitem__(
        1, {"leaf": True}
    ),
    "no structure": lambda m: m.__setitem__("outputs", {}),
    "one leaf of two": lambda m: m.__setitem__("outputs", {"leaf": 0}),
    "a leaf twice": lambda m: m["outputs"]["dict"][1].__setitem__(1, {"leaf": 0}),
    "leaves swapped": _swap,
    "a key twice": lambda m: m["outputs"]["dict"][1].__setitem__(0, "a"),
    "keys of two types": lambda m: m["outputs"]["dict"][1].__setitem__(0, 3),
    "a dict item that is not a pair": lambda m: m["outputs"]["dict"].append(["c"]),
    "a namedtuple with fewer fields": lambda m: m.__setitem__(
        "outputs", {"namedtuple": "P", "fields": ["x"], "items": [{"leaf": 0}, {"leaf": 1}]}
    ),
    "a namedtuple with a bad field": lambda m: m.__setitem__(
        "outputs", {"namedtuple": "P", "fields": ["x", "1"], "items": [{"leaf": 0}, {"leaf": 1}]}
    ),
    "an unknown node": lambda m: m.__setitem__("outputs", {"set": [{"leaf": 0}, {"leaf": 1}]}),
    "a leaf's path elsewhere": lambda m: m["leaves"][0].__setitem__("path", "output['c']"),
    "a leaf's path that is an int": lambda m: m["leaves"][0].__setitem__("path", 5),
    "an element that is not pairs": lambda m: m["dataset"].__setitem__("element", [1, 2]),
    "an element of numbers": lambda m: m["dataset"].__setitem__("element", [["element", 1]]),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_manifest_whose_structure_or_element_is_edited_is_refused_by_load_and_write(
    tmp_path, edit
):
    path = tmp_path / "w"
    function = _scaled(1.0)
    function.write(_dataset(), path)
    manifest = json.loads((path / "manifest.json").read_text())
    EDITS[edit](manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    damaged = "is not a manifest this tfshard wrote"
    with pytest.raises(WriteError, match=damaged):
        tfshard.load(path)
    with pytest.raises(WriteError, match=damaged):
        function.write(_dataset(), path)
    function.write(_dataset(), path, overwrite=True)  # the fix both give
    assert _which(tfshard.load(path), (1.0,)) == 1.0


def test_a_manifest_nested_deeper_than_json_reads_is_refused_as_damaged(tmp_path):
    path = tmp_path / "w"
    _scaled(1.0).write(_dataset(), path)
    deep = '{"format": "tfshard.write", "version": 2, "outputs": ' + "[" * 10**5 + "]" * 10**5
    (path / "manifest.json").write_text(deep + "}")
    with pytest.raises(WriteError, match="is not a manifest this tfshard wrote.*remove the dir"):
        tfshard.load(path)
    # write reads it through the same check: it names no file, so overwrite=True cannot
    # tell the files there as a write's.
    with pytest.raises(WriteError, match="is not a manifest this tfshard wrote.*remove the dir"):
        _scaled(1.0).write(_dataset(), path)
    with pytest.raises(ArgumentError, match="holds files that are not a tfshard write's"):
        _scaled(1.0).write(_dataset(), path, overwrite=True)


def test_every_structure_write_makes_passes_the_manifest_check(tmp_path):
    """Int keys, lists, tuples and namedtuples, nested: load rebuilds each, leaf by leaf."""
    import collections

    Point = collections.namedtuple("Point", "y x")

    def structured(s):
        return {2: [s, (s[0],)], 10: Point(y=s * 3.0, x={"k": s[1]})}

    function = tfshard.parallelize(structured, devices=CPUS[:2])
    function.write(_dataset(), tmp_path / "w")
    got, x = tfshard.load(tmp_path / "w"), _inputs()
    assert list(got) == [2, 10] and isinstance(got[2], list)
    assert type(got[10]).__name__ == "Point" and got[10]._fields == Point._fields
    np.testing.assert_array_equal(got[2][0], x)
    np.testing.assert_array_equal(got[2][1][0], x[:, 0])
    np.testing.assert_array_equal(got[10].y, x * np.float32(3.0))
    np.testing.assert_array_equal(got[10].x["k"], x[:, 1])


@pytest.mark.parametrize("kind", [str, pathlib.Path], ids=["str", "Path"])
def test_a_path_with_a_nul_character_is_refused_naming_the_argument(tmp_path, kind):
    path = kind(str(tmp_path / "a\0b"))
    with pytest.raises(ArgumentError, match=r"path='.*a\\x00b' holds a NUL character"):
        tfshard.load(path)
    with pytest.raises(ArgumentError, match=r"write\(dataset, path\): path=.* holds a NUL"):
        _scaled(1.0).write(_dataset(), path)
    assert list(tmp_path.iterdir()) == []


def test_a_path_that_holds_no_write_says_what_is_there(tmp_path):
    (tmp_path / "output.npy").write_bytes(b"not a write")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "empty").mkdir()
    cases = {
        "output.npy": "it is a file, not the directory of a write; give the directory that "
        "f.write(dataset, path) wrote",
        "missing": "nothing is at that path (no directory, so no manifest.json there); check "
        "the path, or make a write there with f.write(dataset, path)",
        "output.npy/sub": "nothing is at that path (no directory, so no manifest.json there)",
        "dangling": f"it is a symbolic link to {str(tmp_path / 'gone')!r}, which leads to "
        "nothing",
        "empty": "no manifest.json there, so it holds no write; make one with "
        "f.write(dataset, path)",
    }
    for name, message in cases.items():
        path = str(tmp_path / name)
        with pytest.raises(ArgumentError) as caught:
            tfshard.load(path)
        assert str(caught.value).startswith(f"tfshard.load({path!r}): {message}"), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "empty", "output.npy"]
