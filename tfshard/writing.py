"""The store of ``f.write(dataset, path)``: batches in, committed atomically, checked before
trusted; and `load`, which reads it back.

The stream that feeds it hands it each global batch's outputs as they come
(`Store.append`) and asks for commits (`Store.commit`); nothing here calls back
up. Opening a store at a path that holds a write checks it against this one
(`opened`), so calling ``write`` again after the process died resumes after the
last batch that reached the disk.

Nothing on disk changes before the first batch's outputs are computed and
checked (`Store.append`): a write that fails before then (the function fails
to trace or to run, or gives outputs no file holds) leaves the path as it was:
a missing directory missing, an unfinished write unchanged, and a write that
``overwrite=True`` replaces whole. The directory is then made (where it
was missing) and locked, the manifest written, and the old write's files
removed; a second write to the path is refused at its open (the directory
existed) or at its first batch (it did not). Until its first commit, the new
manifest names the old write's files and its own (``replaces``), so a write
killed or stopped before then leaves the old write whole or the new one with
no batch, which removes them when it resumes or is overwritten.

The format: `path` is a directory holding

- one ``.npy`` file per part of each output leaf, named by the leaf's path in
  the outputs' structure (``output.npy`` for a single output, ``emb.npy`` and
  ``ids.npy`` for ``{"emb": ..., "ids": ...}``, ``a.0.npy`` for
  ``{"a": (x, y)}``'s first). A dense leaf is one file of its rows; a ragged
  leaf is its flat values, ``NAME.values.npy``, and one row-lengths vector per
  ragged dimension, ``NAME.row_lengths.npy`` (``NAME.row_lengths.K.npy`` for
  the K-th of several): the parts `tfshard._kinds` gathers it by, so
  ``tf.RaggedTensor.from_nested_row_lengths`` rebuilds it.
- ``manifest.json``: the format and version, whether the write is complete,
  the rows and batches committed, the function's name, the outputs' structure,
  each leaf's path, kind and parts (file, dtype, per-row shape, rows
  committed), and the dataset's fingerprint (its element spec, its number of
  batches when known, and a hash of its first batch).

Plain ``.npy`` files, because what people do next with embeddings or scores
is NumPy: ``np.load(path + "/emb.npy", mmap_mode="r")`` reads a finished
write without tfshard, memory-mapped, and `load` gives the outputs' structure
of memory maps. A ``.npy`` header is plain text with NumPy's growth padding, so
the row count is rewritten in place as rows arrive, and each file is a valid
array of the rows committed so far.

Crash safety. Data goes first, the count that makes it visible last: each
batch's parts are written at their place in the files; at a commit (after the
first batch, then at most every `COMMIT_SECONDS`, and at the end, and on the way
out of Ctrl-C or an error) the files are synced, their headers rewritten with
the rows now durable and synced again, and then the manifest is replaced
atomically (written as ``.manifest.json.tmp``, fsync, `os.replace`, fsync of
the directory). So the manifest never counts a row that is not on disk, and a
``.npy`` header never shows a row before it is durable, however the process
dies (Ctrl-C, SIGKILL, a power cut, a full disk). Anything past the committed
rows is ignored and overwritten on resume. A crash loses at most the batches computed
since the last commit, about `COMMIT_SECONDS` of work.

Resuming assumes the same function and the dataset's same batches in the same
order, and checks it before it trusts the disk: the function's name; the
dataset's element spec, number of batches and first batch (a hash, which
catches another file, another batch size or an unseeded shuffle); the
manifest's fields and each file's header, dtype, per-row shape, rows and size;
then the last committed batch, read and computed again, against what is on
disk (`Store.verify`). It then streams the rest with ``tfshard.row_index()``
counting on from the rows on disk. A change that shows only in rows before the
last committed batch (a function that differs only there, or the dataset after
its first batch) cannot be seen.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import hashlib
import io
import json
import math
import os
import re
import threading
import time
import weakref
from collections import namedtuple
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tfshard import _kinds, _trees
from tfshard._arguments import check_flag
from tfshard.errors import ArgumentError, OnDisk, WriteError, write_error

FORMAT = "tfshard.write"
VERSION = 2
# The manifest versions `load` reads: 1 lacks the last batch's rows, so it is not resumed.
READS = (1, 2)
MANIFEST = "manifest.json"
# A commit syncs every file and replaces the manifest; once a second costs little
# (syncs of what the kernel is already writing back, below) and bounds what a crash
# loses to about a second of batches. 0 commits after every batch.
COMMIT_SECONDS = 1.0
# How far a float computed again may be from the one on disk, in eps of its dtype, of the
# larger of it and its row's largest value (`_difference`).
ROUNDING = 4
# Each leaf's kind by its name in the manifest (the kinds own how a value is parts).
_KINDS: dict[str, _kinds.Kind] = {"dense": _kinds.Dense, "ragged": _kinds.Ragged}


class Written(NamedTuple):
    """What `ShardedFunction.write` did.

    Attributes:
      path: the directory written.
      rows: rows on disk, all of the dataset's.
      batches: global batches on disk.
      computed_rows: rows this call computed: all of them for a new write,
        those after the last commit for a resumed one, 0 for a finished one.
    """

    path: str
    rows: int
    batches: int
    computed_rows: int


def opened(
    path: str, batches: tf.data.Dataset, function: str, overwrite: bool, call: str
) -> Store:
    """The store of a write `call` of `function` into `path`, open: the write there checked
    against `batches` (the dataset's global batches, as the function takes them: their
    element spec, number and first batch), or a new one (`overwrite`: always). Nothing
    on disk changes before its first batch (`Store.open`).

    Raises:
      ArgumentError: `path` is a file, or holds another function's or dataset's write
        or files that are not a write's.
      WriteError: `path` cannot be written, or holds files that are not what a
        write left there.
    """
    count = int(batches.cardinality())
    source = {
        "element": _element_spec(batches.element_spec),
        "batches": count if count >= 0 else None,
        "first_batch": _first_batch_hash(batches),
    }
    return Store.open(path, function, source, overwrite, call)


def _new_manifest(function: str, source: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a new write of `function` over the dataset `source` describes."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "complete": False,
        "rows": 0,
        "batches": 0,
        "last_batch_rows": 0,
        "function": function,
        "dataset": source,
        "outputs": None,
        "leaves": None,
    }


def _dangling(path: str) -> str | None:
    """The symbolic link that `path`, or a missing folder above it, is and that leads to
    nothing (its target missing, or a loop of links); None where there is none. Making
    the directory through it would fail (`os.makedirs`), so a write refuses it at its open."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        if os.path.islink(folder):
            return folder
        if os.path.dirname(folder) == folder:
            return None
        folder = os.path.dirname(folder)
    return None


def _unwritable(path: str) -> OSError | None:
    """Why the directory `path` (or, missing, the nearest existing folder above it, where it
    would be made) cannot be written, as the OSError writing would raise; None when nothing
    that can be seen without writing stands in the way."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return OSError(errnos.ENOTDIR, os.strerror(errnos.ENOTDIR), path)
    if hasattr(os, "statvfs") and os.statvfs(folder).f_flag & os.ST_RDONLY:
        return OSError(errnos.EROFS, os.strerror(errnos.EROFS), folder)
    if not os.access(folder, os.W_OK | os.X_OK):
        return OSError(errnos.EACCES, os.strerror(errnos.EACCES), folder)
    return None


def checked_path(path: Any, dataset: Any, call: str) -> str:
    """`path` as a str, refused early when it is not a directory's name."""
    if isinstance(path, tf.data.Dataset) and isinstance(dataset, str | os.PathLike):
        raise ArgumentError(
            f"{call}(dataset, path) takes the dataset first, then the path; they came the "
            "other way round"
        )
    if not isinstance(dataset, tf.data.Dataset):
        raise ArgumentError(
            f"{call}(dataset, path) takes a tf.data.Dataset first, got "
            f"{type(dataset).__name__}; for arrays, tf.data.Dataset.from_tensor_slices(x) "
            "with batch_size=N"
        )
    return _directory(path, f"{call}(dataset, path)")


def _directory(path: Any, call: str) -> str:
    """`path` (a str or os.PathLike naming a directory) as a str; ArgumentError otherwise."""
    if not isinstance(path, str | os.PathLike):
        raise ArgumentError(
            f"{call}: path={path!r} is a {type(path).__name__}; give the directory as a str "
            "or pathlib.Path"
        )
    path = os.fspath(path)
    if not isinstance(path, str):
        raise ArgumentError(f"{call}: path={path!r} is bytes; give the directory as a str")
    if not path:
        raise ArgumentError(f"{call}: path is empty; name the directory (\".\" for this one)")
    if "\0" in path:
        raise ArgumentError(
            f"{call}: path={path!r} holds a NUL character (\\x00), which no file name can; "
            "name the directory without it"
        )
    return path


class _Lease:
    """A write's hold on its directory's lock: `fd`, the directory as `_Locks.take` opened
    and locked it, from the end of `take` until the write closes (-1 otherwise)."""

    def __init__(self) -> None:
        self.fd = -1


class _Locks:
    """The directories this process holds locked for writes: each one's descriptor, the
    `_Lease` it is for (weakly) and the thread of its write.

    The lock is the kernel's (`flock`), so it goes with the process however it
    ends. Within the process, an interrupt (Ctrl-C in a notebook keeps the
    process) that lands in `take` before the lease holds the descriptor, or
    as the write closes, would keep it held with no write running; so a
    record whose lease is gone or no longer holds its descriptor (a closed
    write sets it to -1 first), or whose thread has ended, is stale: the next
    write there takes it over. A record of a lease that holds it is a running
    write's, in this thread too (a write started inside another, from a
    callback): another write there is refused. The table closes only the
    descriptors it holds.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[tuple[int, int], tuple[int, weakref.ref[_Lease], threading.Thread]] = {}

    def take(self, path: str, call: str, lease: _Lease) -> None:
        """Opens the directory `path` into `lease.fd`, locked against other writes until
        `release`; WriteError where another write, of this process or another, holds it."""
        fd = os.open(path, os.O_RDONLY)
        try:
            import fcntl
        except ImportError:  # no flock (Windows): guarded within this process only
            fcntl = None
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino)
        # Each step leaves the lock recorded or released, wherever an interrupt lands: a
        # lock is taken only once recorded, and a record goes in the statement that closes
        # its directory; the lease holds it last, so until then the record is stale.
        with self._guard:
            if key in self._held and self._stale(*self._held[key]):
                stale = self._held[key][1]()
                if stale is not None:
                    stale.fd = -1  # it holds the descriptor no longer
                os.close(self._held.pop(key)[0])  # and with it the lock it held
            busy = key in self._held  # a running write of this process holds it
            if not busy:
                self._held[key] = (fd, weakref.ref(lease), threading.current_thread())
                busy = fcntl is not None and not _flocked(fcntl, fd)  # or another process's
                if busy:
                    os.close(self._held.pop(key)[0])
                else:
                    lease.fd = fd
            else:
                os.close(fd)
            if busy:
                error = WriteError(
                    f"{call}: another write is running there (it holds the directory's "
                    "lock); wait for it to end, or write somewhere else"
                )
                error.errno, error.strerror = errnos.EWOULDBLOCK, os.strerror(errnos.EWOULDBLOCK)
                error.filename = path
                raise error

    def release(self, lease: _Lease) -> None:
        """Ends `lease`: closes the directory the table holds for it, and with it the lock."""
        lease.fd = -1  # its record is stale from here, wherever this stops
        with self._guard:
            held = [key for key, (_, owner, _) in self._held.items() if owner() is lease]
            if held:
                os.close(self._held.pop(held[0])[0])  # the record goes as the lock does

    @staticmethod
    def _stale(fd: int, owner: weakref.ref[_Lease], thread: threading.Thread) -> bool:
        lease = owner()
        return lease is None or lease.fd != fd or not thread.is_alive()


def _flocked(fcntl: Any, fd: int) -> bool:
    """Whether `fd`'s directory is now locked by it; False where another holds the lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


_locks = _Locks()


def load(path: str | os.PathLike, *, partial: bool = False) -> Any:
    """What `ShardedFunction.write` wrote: the outputs' structure, memory-mapped.

    Args:
      path: the directory given to ``write``.
      partial: also load a write that has not finished (its committed rows);
        otherwise that is an error.

    Returns:
      The outputs as the function returns them, for all rows: a read-only
      `np.memmap` for each dense leaf (an array for a single output, a dict
      of them for a dict, a tuple for a tuple); a ragged leaf as a
      `tf.RaggedTensor` built from its memory-mapped parts.

    It takes no lock, so a write that runs meanwhile goes on: it opens every
    file the manifest names, reads the manifest again, and keeps what it read
    only when that is the same write (equal but for the rows committed),
    finished unless `partial`, and each file it holds open is still the one
    of its name; the memory maps are of those open files, which a later
    ``overwrite=True`` removes but cannot change. So beside a write in
    progress it gives the rows committed when it read (``partial=True``), and
    beside one that replaces the path, the old write whole or the new one as a
    load of it gives it (not finished: the error, or its committed rows with
    ``partial=True``), trying again `LOAD_TRIES` times, never a mix.

    Raises:
      ArgumentError: `path` or `partial` is not what it should be, `path` holds
        no write (a file, nothing, or a directory without a manifest: the message
        says which), or one that has not finished.
      WriteError: the manifest or a file is not what the write left there
        (damaged, truncated, edited by hand), with the fix that works there;
        or another write replaced the path each time it was read.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "twice")
    >>> f = tfshard.parallelize(lambda s: {"twice": 2 * s}, devices=["cpu:0", "cpu:1"])
    >>> f.write(tf.data.Dataset.range(5), path, batch_size=2).rows
    5
    >>> tfshard.load(path)["twice"].tolist()
    [0, 2, 4, 6, 8]
    """
    path = _directory(path, "tfshard.load(path)")
    call = f"tfshard.load({path!r})"
    check_flag(partial, "partial", call)
    for _ in range(LOAD_TRIES):
        manifest = _loaded_manifest(path, call)
        if manifest is None:
            raise ArgumentError(f"{call}: {_no_write(path)}")
        if not manifest["complete"] and not partial:
            raise ArgumentError(
                f"{call}: the write there has not finished ({manifest['rows']} "
                f"rows in {manifest['batches']} batches so far; a write may be running there); "
                f"once none is, call {manifest['function']}.write(dataset, path) again to "
                "finish it, or pass partial=True for the rows so far"
            )
        if manifest["leaves"] is None:
            raise ArgumentError(
                f"tfshard.load({path!r}, partial=True): no batch was written yet, so there is "
                "nothing to load"
            )
        files = _open_files(path, manifest)  # held: a write that replaces them leaves them whole
        try:
            again = _loaded_manifest(path, call)  # the files opened are still this write's
            if (
                again is not None
                and (again["complete"] or partial)  # else an overwrite began: read it again
                and _same_write(manifest, again)
                and _same_files(path, files)
            ):
                _check_files(path, again, f"{call}: ", files)
                values = []
                for leaf in again["leaves"]:
                    parts = [_mapped(part, files[part["file"]]) for part in leaf["parts"]]
                    values.append(_KINDS[leaf["kind"]].from_parts(parts))
                return _decode(again["outputs"], values)
        finally:
            _close_files(files)
    raise WriteError(
        f"{call}: another write is replacing the write there (overwrite=True): its "
        f"{MANIFEST} or files changed while they were read, {LOAD_TRIES} times; call "
        "tfshard.load again when that write has ended"
    )


# How often `load` reads a write again when another write replaced it while it read.
LOAD_TRIES = 5
# The manifest's fields a commit of the same write changes (and each part's "rows").
_COMMITTED = ("complete", "rows", "batches", "last_batch_rows")


def _loaded_manifest(path: str, call: str) -> dict[str, Any] | None:
    """`_read_manifest` for `load`: its problems as the errors `load` raises."""
    try:
        return _read_manifest(path)
    except ValueError as error:
        raise WriteError(
            f"{call}: its {MANIFEST} is not a manifest this tfshard wrote ({error}); "
            f"{_fix(path)}"
        ) from None
    except OSError as error:
        raise write_error(error, call, "nothing was read") from None


def _no_write(path: str) -> str:
    """Why `path`, where no manifest was found, holds no write, and what to do: it is a
    file, a symbolic link that leads nowhere, nothing at all, or a directory without
    one. Called only to word an error."""
    if os.path.isdir(path):
        return f"no {MANIFEST} there, so it holds no write; make one with f.write(dataset, path)"
    if os.path.exists(path):
        return (
            "it is a file, not the directory of a write; give the directory that "
            "f.write(dataset, path) wrote"
        )
    with contextlib.suppress(OSError):  # no link there (EINVAL, ENOENT): nothing is
        return (
            f"it is a symbolic link to {os.readlink(path)!r}, which leads to nothing (no "
            f"directory, so no {MANIFEST} there); check the link, or give the directory that "
            "f.write(dataset, path) wrote"
        )
    return (
        f"nothing is at that path (no directory, so no {MANIFEST} there); check the path, or "
        "make a write there with f.write(dataset, path)"
    )


def _fix(path: str) -> str:
    """How to make `path`, whose write is damaged, a write again, as `load` and `write`
    advise it: ``overwrite=True`` where it takes the path (`_unlisted` finds no file),
    else remove the directory or write to another path. Called only to word an error."""
    try:
        unlisted = _unlisted(path)
    except OSError:
        unlisted = []
    if unlisted:
        return (
            "remove the directory, or write to another path (a write removes only the files "
            f"a manifest names, not {_listed(unlisted)})"
        )
    return "write it again with overwrite=True (f.write(dataset, path, overwrite=True))"


def _unlisted(path: str) -> list[str]:
    """The names in the directory `path` that ``overwrite=True`` refuses to remove: those
    no manifest there names (read leniently: `_listed_files`)."""
    return sorted(set(os.listdir(path)) - {MANIFEST, _temporary(MANIFEST), *_listed_files(path)})


def _listed(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"


def _open_files(path: str, manifest: dict[str, Any]) -> dict[str, int | OSError]:
    """Each file `manifest` names, open for reading, or why it could not be opened; close
    them with `_close_files`."""
    files: dict[str, int | OSError] = {}
    try:
        for leaf in manifest["leaves"] or ():
            for part in leaf["parts"]:
                try:
                    files[part["file"]] = os.open(os.path.join(path, part["file"]), os.O_RDONLY)
                except OSError as error:
                    files[part["file"]] = error
    except BaseException:
        _close_files(files)
        raise
    return files


def _close_files(files: dict[str, int | OSError]) -> None:
    for fd in files.values():
        if isinstance(fd, int):
            os.close(fd)


def _same_write(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether two manifests read at one path are of one write: equal but for what its
    commits change (the rows, batches and whether it finished)."""

    def kept(manifest: dict[str, Any]) -> dict[str, Any]:
        leaves = manifest["leaves"]
        if leaves is not None:
            leaves = [
                {**leaf, "parts": [{**part, "rows": None} for part in leaf["parts"]]}
                for leaf in leaves
            ]
        fields = {key: value for key, value in manifest.items() if key not in _COMMITTED}
        return {**fields, "leaves": leaves}

    return kept(before) == kept(after)


def _same_files(path: str, files: dict[str, int | OSError]) -> bool:
    """Whether each open file is still the one its name in `path` leads to. A write
    makes its files anew (it never reuses an old write's), so with the manifest read
    after they were opened, the files are those that manifest describes."""
    for name, fd in files.items():
        try:
            now = os.stat(os.path.join(path, name))
        except OSError:
            now = None
        if isinstance(fd, int):
            held = os.fstat(fd)
            if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                return False
        elif isinstance(fd, FileNotFoundError) and now is not None:
            return False  # made since: by a write that replaces these
    return True


def _mapped(part: dict[str, Any], fd: int) -> np.ndarray:
    """A part's committed rows from its open file (checked by `_check_files`),
    memory-mapped read-only (an empty array for none)."""
    dtype, shape, rows = _dtype(part["dtype"]), tuple(part["shape"]), part["rows"]
    if rows == 0:
        return np.zeros((0, *shape), dtype)
    with open(fd, "rb", closefd=False) as file:  # the map holds the file, not `fd`
        offset = len(_header(dtype, 0, shape))
        return np.memmap(file, dtype, mode="r", offset=offset, shape=(rows, *shape))


# ----------------------------------------------------------------- the store


class _Count(NamedTuple):
    """How much of a write is written (or committed): one value, replaced whole, so that
    no interrupt can leave a batch's rows counted in one place and not in another.

    Attributes:
      rows: the dataset's rows.
      batches: its batches.
      last_batch_rows: the rows of the last batch (0 before the first).
      parts: each part's rows (entries along its first dimension), in leaf order.
    """

    rows: int
    batches: int
    last_batch_rows: int
    parts: tuple[int, ...]


class Store:
    """One write's directory: its manifest, its files, what is written and committed.

    Attributes:
      path: the directory.
      complete: whether the write there had finished when opened.
      leaves: the output leaves' records (path, kind, parts), once known.
    """

    def __init__(
        self, path: str, manifest: dict[str, Any], call: str, replaces: Sequence[str] | None = None
    ) -> None:
        self.path = path
        # "replaces": what a manifest of a new write names until its first commit (`_make`).
        self._manifest = {key: value for key, value in manifest.items() if key != "replaces"}
        self._call = call
        self.complete = bool(manifest["complete"])
        self.leaves: list[dict[str, Any]] | None = manifest["leaves"]
        parts = tuple(part["rows"] for leaf in self.leaves or () for part in leaf["parts"])
        self._committed = _Count(
            manifest["rows"], manifest["batches"], manifest["last_batch_rows"], parts
        )
        self._written = self._committed  # written, not yet committed
        self._files: list[list[_Column]] | None = None  # open files, per leaf and part
        self._structure: Hashable = None
        self._last_commit = 0.0
        self._lease = _Lease()  # the directory, open and locked (`_locks`)
        # A new write (`replaces` given: the files of an old write there, which
        # overwrite=True replaces) has its manifest in memory only, until its first
        # batch's outputs are in hand (`_make`); until then `path` is as it was. A
        # manifest of no batch yet may still name files a stopped write left there
        # (`_make`): they go at this write's first batch.
        self._on_disk = replaces is None
        self._replaces = list(manifest.get("replaces") or () if replaces is None else replaces)
        self._changed = False  # whether this write changed anything on disk yet

    @property
    def rows(self) -> int:
        """Rows committed (on disk and counted by the manifest)."""
        return self._committed.rows

    @property
    def batches(self) -> int:
        """Batches committed."""
        return self._committed.batches

    @property
    def last_batch_rows(self) -> int:
        """The rows of the last batch committed."""
        return self._committed.last_batch_rows

    def on_disk(self) -> OnDisk:
        """Where the write stands: what is committed, where the next batch goes, and whether
        `path` is still as it was before the write (it changed nothing there yet)."""
        committed, written = self._committed, self._written
        as_it_was = not self._changed
        return OnDisk(
            self.path, committed.rows, committed.batches, written.rows, written.batches, as_it_was
        )

    @classmethod
    def open(
        cls, path: str, function: str, source: dict[str, Any], overwrite: bool, call: str
    ) -> Store:
        """The write at `path`, checked against this one, or a new one (`overwrite`: always).

        Nothing on disk changes here. An existing directory is locked for this
        process until `close`; a missing one is made and locked by the first
        batch (`_make`). A path that could not be written (a file, a symbolic
        link, it or a missing folder above it, that leads to no directory, no
        permission, a read-only file system) fails here, before anything runs.
        """
        if os.path.exists(path) and not os.path.isdir(path):
            raise ArgumentError(f"{call}: {path!r} is a file; write into a directory")
        if not os.path.isdir(path):
            link = _dangling(path)
            if link is not None:
                raise ArgumentError(
                    f"{call}: {link!r} is a symbolic link to {os.readlink(link)!r}, which leads "
                    "to no directory; make the directory it points to, remove the link, or "
                    "write to another path"
                )
            problem = _unwritable(path)
            if problem is not None:
                raise write_error(problem, call, "nothing was written") from None
            return cls(path, _new_manifest(function, source), call, replaces=())
        lease = _Lease()
        try:
            _locks.take(path, call, lease)
            store = cls._opened(path, function, source, overwrite, call)
            problem = None if store.complete else _unwritable(path)  # a finished one is read
            if problem is not None:
                raise write_error(problem, call, "nothing was written") from None
            store._lease = lease
        except BaseException:
            lease.fd = -1  # its lock's record is stale from here
            _locks.release(lease)
            raise
        return store

    @classmethod
    def _opened(
        cls, path: str, function: str, source: dict[str, Any], overwrite: bool, call: str
    ) -> Store:
        try:
            manifest = None if overwrite else _read_manifest(path)
        except ValueError as error:
            raise WriteError(
                f"{call}: {os.path.join(path, MANIFEST)} is not a manifest this tfshard "
                f"wrote ({error}); {_fix(path)}"
            ) from None
        if manifest is not None:
            _check_same(manifest, function, source, call)
            _check_files(path, manifest, f"{call}: ")
            if manifest["last_batch_rows"] is None and not manifest["complete"]:
                raise WriteError(
                    f"{call}: the unfinished write there was made by an earlier tfshard, which "
                    f"did not record enough to check a resume; {_fix(path)}"
                )
            return cls(path, manifest, call)
        # A new write: it takes the path only where a manifest there names every file (with
        # none there, without overwrite=True, none), the rule `_fix` advises by.
        others = _unlisted(path)
        if others:
            raise ArgumentError(
                f"{call}: {path!r} holds files that are not a tfshard write's "
                f"({_listed(others)}); write into a new or empty directory (a write never "
                "removes files it did not write)"
            )
        old = _listed_files(path) if overwrite else []
        return cls(path, _new_manifest(function, source), call, replaces=old)

    def verify(self, result: Any, first_row: int) -> None:
        """Raises unless `result`, a committed batch computed again, equals what is on disk.

        The batch is the first (`first_row` 0) or the last committed; each of
        its parts must equal the same entries of its file as `_difference` says.
        So another function, changed weights, a dataset that changed before this
        batch ends, or a random function are refused before anything is appended.
        """
        values, structure = _trees.flatten(result, "output")
        parts = self._parts(values, structure)
        self._same_outputs(values, structure, parts)
        committed = iter(self._committed.parts)
        for leaf, arrays in zip(self.leaves, parts):
            for part, array in zip(leaf["parts"], arrays):
                end = next(committed)
                start = 0 if first_row == 0 else end - len(array)
                stored = _read_part(self.path, part)[max(start, 0) : start + len(array)]
                difference = _difference(array, stored) if start >= 0 else "more rows"
                if difference:
                    batch = "first batch" if first_row == 0 else f"batch {self.batches - 1}"
                    raise ArgumentError(
                        f"{self._call}: the {batch} computed again differs from what is on disk "
                        f"({leaf['path']}, {part['file']}: {difference}), so the function (its "
                        "code or weights) or the dataset up to that batch changed since it was "
                        "written, or the function is random (unseeded random ops give other "
                        "numbers every run: key them by tfshard.row_index() with stateless "
                        "ops), or its outputs depend on the split (tfshard.shard_index() with "
                        "weights='auto', whose plan may differ between runs: key them by "
                        "row_index(), or give fixed weights); resuming would mix two runs' "
                        "results. Pass overwrite=True to write it anew, or write to another path"
                    )

    def append(self, result: Any, rows: int, *, empty: bool = False) -> None:
        """One batch's outputs written at their place in the files (not yet committed).

        A batch is written whole or not at all: the count that makes it part of
        the write changes in one step after all of its data is written, so a
        failure part way (a full disk, Ctrl-C) leaves the count as it was, and
        the next batch writes over what it wrote. `empty`: the outputs of zero
        rows that say what a dataset without elements would give; they make
        the files and count no batch.
        """
        values, structure = _trees.flatten(result, "output")
        parts = self._parts(values, structure)
        if self._files is None:
            self._start(values, structure, parts, rows)
        self._check(structure, parts)
        written = self._written
        arrays = [array for leaf_arrays in parts for array in leaf_arrays]
        for column, array, at in zip(self._columns(), arrays, written.parts):
            column.append(array, at)
        self._written = _Count(
            written.rows + rows,
            written.batches + (0 if empty else 1),
            written.last_batch_rows if empty else rows,
            tuple(at + len(array) for at, array in zip(written.parts, arrays)),
        )

    def commit(self, *, due: bool) -> None:
        """Makes the batches written durable and counted; with `due`, only when one is due.

        A commit is due after the first batch, then every `COMMIT_SECONDS`.
        """
        if self._files is None or self._written == self._committed:
            return
        if due and self.batches and time.monotonic() - self._last_commit < COMMIT_SECONDS:
            return
        self._commit(self._written, complete=False)

    def finish(self) -> None:
        """Trims the files to their rows, commits the last batches, marks the write done."""
        self._changed = True
        if self._files is None and self.leaves is not None:  # all committed before a crash
            self._files = [
                [_Column.reopen(self.path, p) for p in leaf["parts"]] for leaf in self.leaves
            ]
        written = self._written
        for column, rows in zip(self._columns(), written.parts):
            column.trim(rows)
        self._commit(written, complete=True)
        self.complete = True

    def close(self) -> None:
        """Closes the files, then the directory and with it the lock (whatever the files do)."""
        self._lease.fd = -1  # a write closing: its lock's record is stale from here
        try:
            for column in self._columns():
                column.close()
        finally:
            _locks.release(self._lease)

    def _parts(self, values: list[Any], structure: Hashable) -> list[list[np.ndarray]]:
        """Each output leaf as the NumPy arrays of its parts; ArgumentError, naming the leaf,
        for a value no file holds."""
        parts: list[list[np.ndarray]] = []
        for value in values:
            try:
                parts.append(_parts(value))
            except ArgumentError as error:
                where = _trees.paths("output", structure)[len(parts)]
                raise ArgumentError(f"{self._call}: {where} {error}") from None
        return parts

    def _columns(self) -> list[_Column]:
        return [column for columns in self._files or () for column in columns]

    def _commit(self, count: _Count, *, complete: bool) -> None:
        """Makes `count` durable: the data first, then each header's rows, then the manifest.

        A header never counts rows that are not durable; if the manifest cannot
        be replaced (a full disk), the headers go back to the committed rows.
        """
        columns = self._columns()
        for column in columns:  # the data durable first ...
            column.sync()
        try:
            for column, rows in zip(columns, count.parts):  # ... then each header's rows
                column.mark(rows)
                column.sync()
            self._save(count, complete=complete)  # ... then the manifest's count
        except OSError:
            with contextlib.suppress(OSError):
                for column, rows in zip(columns, self._committed.parts):
                    column.mark(rows)
            raise
        self._committed = count
        self._last_commit = time.monotonic()

    def _start(
        self, values: list[Any], structure: Hashable, parts: list[list[np.ndarray]], rows: int
    ) -> None:
        """The files, new or reopened, at the first batch of this run, once its outputs are
        checked: the first change this write makes on disk."""
        if self.leaves is not None:  # a write resumed: the same outputs, or refused
            self._same_outputs(values, structure, parts)
            self._changed = True
            self._files = [
                [_Column.reopen(self.path, part) for part in leaf["parts"]] for leaf in self.leaves
            ]
        else:
            records = _records(values, structure, parts)
            outputs = _encode(structure, self._call)  # refuses keys no file is named by
            self._make([part["file"] for record in records for part in record["parts"]])
            self._structure = structure
            self._files = []
            for record in records:  # each file closed by `close`, however this ends
                self._files.append([])
                for part in record["parts"]:
                    self._files[-1].append(_Column.create(self.path, part))
            self.leaves = records
            self._manifest["outputs"] = outputs
            zeros = tuple(0 for _ in self._columns())
            # Nothing written yet, so one count for both, in one statement: no interrupt
            # (Ctrl-C) can leave them with parts of two lengths for the commit on the way out.
            self._committed = self._written = self._committed._replace(parts=zeros)
        expected = self._manifest["dataset"]["batches"]
        if expected is not None and rows:  # known length: room for it now, or a clear error
            for columns, leaf in zip(self._files, self.leaves):
                # The part with one entry per row (a ragged leaf's values have no known length).
                columns[_KINDS[leaf["kind"]].ROWS_PART].reserve(expected * rows)

    def _make(self, files: list[str]) -> None:
        """A new write on disk, with no batch yet: its directory (made and locked here if it
        was missing at `open`), its manifest, then the old write's files removed (those
        `overwrite=True` replaces, which stay whole until now); `files`: those it makes next.

        Until the first commit the manifest names, as ``replaces``, the old
        write's files and `files`, so wherever a kill or an error stops the
        write before then, the path holds the old write whole (before the
        manifest's `os.replace`) or the new write with no batch, which counts
        the files left as its own: a resume (at its first batch, here) or an
        ``overwrite=True`` removes them.
        """
        replaces = [*self._replaces, *(file for file in files if file not in self._replaces)]
        if self._on_disk and replaces == self._replaces:  # its manifest names them already
            self._changed = True
            self._removed()
            return
        # A manifest of no batch yet is rewritten where this write makes other files (the
        # same function name, resumed with other outputs): it names those too.
        if not self._on_disk and self._lease.fd < 0:
            os.makedirs(self.path, exist_ok=True)  # failing, it leaves `path` missing
            self._changed = True
            _locks.take(self.path, self._call, self._lease)
            if os.listdir(self.path):
                raise WriteError(
                    f"{self._call}: another write began in {self.path!r} while this one "
                    f"computed its first batch; call {self._call} again to check and resume "
                    "that write, or write to another path"
                )
        manifest = {**self._manifest, "replaces": replaces}
        _replace(os.path.join(self.path, MANIFEST), _encoded(manifest))
        self._changed = self._on_disk = True  # failing, it left the old manifest (`_replace`)
        self._removed()

    def _removed(self) -> None:
        """Removes the old write's files this write replaces (after its manifest)."""
        for file in self._replaces:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.path, file))
        self._replaces = []

    def _same_outputs(
        self, values: list[Any], structure: Hashable, parts: list[list[np.ndarray]]
    ) -> None:
        """Raises ArgumentError unless these outputs are those the files hold (structure,
        kinds, dtypes, per-row shapes); the structure every later batch must keep."""
        records = _records(values, structure, parts)
        _check_outputs(self.leaves, self._manifest["outputs"], records, structure, self._call)
        self._structure = structure

    def _check(self, structure: Hashable, parts: list[list[np.ndarray]]) -> None:
        """Raises ArgumentError when a batch's outputs do not fit the files."""
        if structure != self._structure:
            raise ArgumentError(
                f"{self._call}: this batch's outputs have another structure than the first "
                f"batch's ({_trees.first_difference('output', structure, self._structure)}); "
                "the function must return one structure for every batch"
            )
        for leaf, arrays in zip(self.leaves, parts):
            for part, array in zip(leaf["parts"], arrays):
                if list(array.shape[1:]) != part["shape"]:
                    what = "values" if leaf["kind"] == "ragged" else "rows"
                    raise ArgumentError(
                        f"{self._call}: {leaf['path']} has {what} of shape "
                        f"{list(array.shape[1:])} in this batch but {part['shape']} in the "
                        "first; a file holds one per-row shape (pad to one length, or return "
                        f"a ragged tensor: parallelize(..., ragged=True) per sample)"
                    )

    def _save(self, count: _Count, *, complete: bool) -> None:
        manifest = dict(self._manifest)
        manifest["rows"], manifest["batches"] = count.rows, count.batches
        manifest["last_batch_rows"], manifest["complete"] = count.last_batch_rows, complete
        rows = iter(count.parts)
        manifest["leaves"] = [
            {**leaf, "parts": [{**part, "rows": next(rows)} for part in leaf["parts"]]}
            for leaf in self.leaves or ()
        ]
        _replace(os.path.join(self.path, MANIFEST), _encoded(manifest))
        self._manifest, self.leaves = manifest, manifest["leaves"]


# ------------------------------------------------------------------ one file


class _Column:
    """One ``.npy`` file whose first dimension grows: a header with room for any row
    count (NumPy's growth padding), then the rows, written where they belong.

    The store keeps the counts (`_Count`); a column writes where it is told.
    """

    def __init__(self, path: str, part: dict[str, Any], fd: int) -> None:
        self._path = path
        self._fd = fd
        self._dtype = _dtype(part["dtype"])
        self._shape = tuple(part["shape"])
        self._row_bytes = self._dtype.itemsize * math.prod(self._shape)
        self._offset = len(_header(self._dtype, 0, self._shape))

    @classmethod
    def create(cls, directory: str, part: dict[str, Any]) -> _Column:
        path = os.path.join(directory, part["file"])
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        column = cls(path, part, fd)
        column.mark(0)
        return column

    @classmethod
    def reopen(cls, directory: str, part: dict[str, Any]) -> _Column:
        """The file of a resumed write (checked by `_check_files`); rows past the
        committed ones are written over."""
        path = os.path.join(directory, part["file"])
        column = cls(path, part, os.open(path, os.O_RDWR))
        column.mark(part["rows"])  # a header may count rows a crash left uncommitted
        return column

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows, so a full disk fails now rather than hours in."""
        if not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(self._fd, 0, self._offset + rows * self._row_bytes)
        except OSError as error:
            if error.errno in (errnos.EOPNOTSUPP, errnos.EINVAL):
                return  # a file system that cannot reserve: its writes will say
            raise OSError(error.errno, error.strerror, self._path) from None

    def append(self, array: np.ndarray, at: int) -> None:
        """Writes `array`'s rows from row `at` on (not yet durable, nor counted)."""
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        start = self._offset + at * self._row_bytes
        try:
            _write_at(self._fd, data, start)
        except OSError as error:
            raise OSError(error.errno, error.strerror, self._path) from None
        if hasattr(os, "posix_fadvise") and len(data):
            # Starts writing these pages back now (and lets them leave the cache once
            # written), so the commit's sync finds them mostly on disk and does not
            # stall the stream.
            os.posix_fadvise(self._fd, start, len(data), os.POSIX_FADV_DONTNEED)

    def sync(self) -> None:
        try:
            _sync(self._fd)
        except OSError as error:
            raise OSError(error.errno, error.strerror, self._path) from None

    def mark(self, rows: int) -> None:
        """Writes the header with `rows` rows (in place: same length)."""
        try:
            _write_at(self._fd, memoryview(_header(self._dtype, rows, self._shape)), 0)
        except OSError as error:
            raise OSError(error.errno, error.strerror, self._path) from None

    def trim(self, rows: int) -> None:
        """Cuts what a reservation or an interrupted run left past `rows` rows."""
        os.ftruncate(self._fd, self._offset + rows * self._row_bytes)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _header(dtype: np.dtype, rows: int, shape: tuple[int, ...]) -> bytes:
    """A ``.npy`` header (version 1.0) for `rows` rows of `shape`, NumPy's own bytes, padded
    so the row count can be rewritten in place (`np.lib.format.GROWTH_AXIS_MAX_DIGITS`)."""
    out = io.BytesIO()
    fields = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": (rows, *shape),
    }
    np.lib.format.write_array_header_1_0(out, fields)
    return out.getvalue()


def _read_part(directory: str, part: dict[str, Any]) -> np.ndarray:
    """A part's committed rows, memory-mapped read-only (an empty array for none)."""
    fd = os.open(os.path.join(directory, part["file"]), os.O_RDONLY)
    try:
        return _mapped(part, fd)
    finally:
        os.close(fd)  # the map holds the file


def _finfo(dtype: np.dtype) -> Any:
    """`np.finfo` of a float dtype, bfloat16's from ml_dtypes."""
    try:
        return np.finfo(dtype)
    except ValueError:
        import ml_dtypes

        return ml_dtypes.finfo(dtype)


def _dtype(name: str) -> np.dtype:
    """A NumPy dtype by name; bfloat16 and the like come from ml_dtypes (TF's own)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write part of a large buffer
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _sync(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)  # the data and its size; macOS has only fsync


# --------------------------------------------------------------- the manifest


def _temporary(name: str) -> str:
    """The name a file is written under before it replaces `name`."""
    return f".{name}.tmp"


def _replace(path: str, data: bytes) -> None:
    """Replaces the file at `path` with `data` atomically: the old or the new, never half."""
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, _temporary(name))
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _write_at(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    with contextlib.suppress(OSError):  # the rename durable too, where directories sync
        fd = os.open(directory or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _encoded(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1) + "\n").encode()


def _manifest_json(path: str) -> Any:
    """The JSON of the manifest at `path`, as it is (every reader of a manifest reads it
    here); OSError where it cannot be read, ValueError where it is not JSON (nested
    deeper than JSON reads, too)."""
    with open(os.path.join(path, MANIFEST), "rb") as file:
        text = file.read()
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("it is not JSON") from None


def _read_manifest(path: str) -> dict[str, Any] | None:
    """The manifest at `path`, None if there is none; ValueError if it is not one tfshard
    wrote (not JSON, another format or version, a key missing or of the wrong type)."""
    try:
        manifest = _manifest_json(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError("its format is not tfshard.write")
    if manifest.get("version") not in READS:
        raise ValueError(f"version {manifest.get('version')!r}; this tfshard reads {READS}")
    if manifest["version"] == 1:  # before a write recorded its last batch's rows
        manifest = {**manifest, "last_batch_rows": None}
    _check_schema(manifest)
    return manifest


def _check_schema(manifest: dict[str, Any]) -> None:
    """Raises ValueError naming the first key of `manifest` that is missing or wrong."""

    def need(record: dict[str, Any], key: str, where: str, kinds: Any, check: Any = None) -> Any:
        if not isinstance(record, dict) or key not in record:
            raise ValueError(f"{where}{key} is missing")
        value = record[key]
        allowed = kinds if isinstance(kinds, tuple) else (kinds,)
        wrong = isinstance(value, bool) and bool not in allowed
        if wrong or not isinstance(value, kinds) or (check is not None and not check(value)):
            raise ValueError(f"{where}{key} is {value!r}")
        return value

    count = lambda n: n >= 0  # noqa: E731
    need(manifest, "complete", "", bool)
    rows = need(manifest, "rows", "", int, count)
    batches = need(manifest, "batches", "", int, count)
    if manifest["last_batch_rows"] is not None:
        need(manifest, "last_batch_rows", "", int, lambda n: 0 <= n <= rows)
    need(manifest, "function", "", str)
    dataset = need(manifest, "dataset", "", dict)
    pair = lambda item: isinstance(item, list) and len(item) == 2  # noqa: E731
    strings = lambda items: all(pair(i) and all(isinstance(s, str) for s in i) for i in items)  # noqa: E731
    need(dataset, "element", "dataset.", list, strings)
    known = need(dataset, "batches", "dataset.", (int, type(None)))
    need(dataset, "first_batch", "dataset.", (str, type(None)))
    if known is not None and (batches > known or (manifest["complete"] and batches != known)):
        raise ValueError(f"batches is {batches}, but the dataset has {known}")
    leaves = need(manifest, "leaves", "", (list, type(None)))
    need(manifest, "outputs", "", (dict, type(None)))
    if (leaves is None) != (manifest["outputs"] is None) or (leaves is None and rows):
        raise ValueError("its outputs and leaves disagree")
    if leaves is None and manifest["complete"]:
        raise ValueError("a finished write without leaves")
    if "replaces" in manifest:  # an old write's files and its own, until its first commit
        replaced = need(manifest, "replaces", "", list, lambda names: leaves is None)
        if not all(isinstance(name, str) and _plain_file_name(name) for name in replaced):
            raise ValueError(f"replaces is {replaced!r}")
    if leaves is not None:
        _check_structure(manifest["outputs"], leaves)
    files = set()
    for i, leaf in enumerate(leaves or ()):
        where = f"leaves[{i}]."
        need(leaf, "path", where, str)
        kind = need(leaf, "kind", where, str, lambda k: k in _KINDS)
        least = 2 if kind == "ragged" else 1
        parts = need(leaf, "parts", where, list, lambda p, least=least: len(p) >= least)
        for j, part in enumerate(parts):
            at = f"{where}parts[{j}]."
            name = need(part, "file", at, str, _plain_file_name)
            if name.lower() in files:
                raise ValueError(f"{at}file {name!r} is another part's too")
            files.add(name.lower())
            need(part, "dtype", at, str, _known_dtype)
            need(part, "shape", at, list, lambda s: all(type(d) is int and d >= 0 for d in s))
            need(part, "rows", at, int, count)
        own = parts[_KINDS[kind].ROWS_PART]["rows"]
        if own != rows:
            raise ValueError(f"{where[:-1]} has {own} rows, not the write's {rows}")


def _check_structure(outputs: dict[str, Any], leaves: list[Any]) -> None:
    """Raises ValueError unless `outputs` is a structure `_encode` writes that holds each of
    `leaves` once, at the path the leaf's record names."""
    found: dict[int, list[Any]] = {}  # each leaf's labels on the way to it

    def walk(node: Any, labels: list[Any]) -> None:
        shown = repr(node) if len(repr(node)) <= 60 else repr(node)[:57] + "..."
        wrong = ValueError(f"outputs holds {shown}, which is not a structure tfshard writes")
        fields = set(node) if isinstance(node, dict) else None
        if fields == {"leaf"}:
            number = node["leaf"]
            if type(number) is not int or not 0 <= number < len(leaves) or number in found:
                raise ValueError(f"outputs holds {shown}: not one of its {len(leaves)} leaves once")
            found[number] = labels
        elif fields == {"dict"}:
            items = node["dict"]
            if not isinstance(items, list) or not all(
                isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)
                for item in items
            ):
                raise wrong
            names = [name for name, _ in items]
            try:
                sorted(names)  # the leaf order (`_key`): keys of one type
            except TypeError:
                raise wrong from None
            if len(set(names)) != len(names):
                raise wrong
            for name, child in items:
                walk(child, [*labels, name])
        elif fields in ({"tuple"}, {"list"}, {"namedtuple", "fields", "items"}):
            items = node.get("items", node.get("tuple", node.get("list")))
            if not isinstance(items, list):
                raise wrong
            if "namedtuple" in node:
                try:
                    named = namedtuple(node["namedtuple"], node["fields"])  # noqa: PYI024
                except (TypeError, ValueError):
                    raise wrong from None
                if len(named._fields) != len(items):
                    raise wrong
            for i, child in enumerate(items):
                walk(child, [*labels, i])
        else:
            raise wrong

    try:
        walk(outputs, [])
    except RecursionError:
        raise ValueError("outputs is nested deeper than any structure tfshard writes") from None
    if len(found) != len(leaves):
        raise ValueError(f"outputs holds {len(found)} of its {len(leaves)} leaves")
    for number, labels in found.items():
        where = leaves[number].get("path") if isinstance(leaves[number], dict) else None
        if not isinstance(where, str) or not _at(where, labels):
            raise ValueError(
                f"leaves[{number}].path is {where!r}, but outputs has that leaf at "
                f"output{''.join(f'[{label!r}]' for label in labels)}"
            )


def _at(where: str, labels: list[Any]) -> bool:
    """Whether `where` is the path `_trees.paths` gives the leaf at `labels` (keys and
    indices; an attrs field, which the manifest keeps as a dict's key, as ``.name``)."""
    rest = where.removeprefix("output")
    if rest == where:
        return False
    for label in labels:
        for shown in (f"[{label!r}]", f".{label}" if isinstance(label, str) else None):
            if shown is not None and rest.startswith(shown):
                rest = rest[len(shown) :]
                break
        else:
            return False
    return not rest


def _plain_file_name(name: str) -> bool:
    return name.endswith(".npy") and os.path.basename(name) == name and name not in (".", "..")


def _known_dtype(name: str) -> bool:
    try:
        _dtype(name)
    except (TypeError, AttributeError):
        return False
    return True


def _check_files(
    path: str,
    manifest: dict[str, Any],
    call: str,
    files: dict[str, int | OSError] | None = None,
) -> None:
    """Raises WriteError, with `_fix`'s advice, unless every file holds what the manifest
    says it does.

    Each part's file must exist with a NumPy header of the manifest's dtype and
    per-row shape, counting at least the committed rows (exactly, once the
    write is finished), and be long enough for them; a ragged leaf's row
    lengths must add up to the entries of its next part. `files`: the files as
    `_open_files` gives them (an open descriptor, or the OSError that opening
    it raised), read through these; None: opened here.
    """
    if files is None:
        files = _open_files(path, manifest)
        try:
            return _check_files(path, manifest, call, files)
        finally:
            _close_files(files)
    complete = manifest["complete"]
    for leaf in manifest["leaves"] or ():
        for part in leaf["parts"]:
            file = os.path.join(path, part["file"])
            problem = _file_problem(files[part["file"]], part, complete)
            if problem:
                raise WriteError(
                    f"{call}{file} {problem}: it was changed outside the write; {_fix(path)}"
                )
        if leaf["kind"] == "ragged":
            parts = leaf["parts"]  # values, then the row lengths of each ragged dimension
            for outer, inner in zip(parts[1:], [*parts[2:], parts[0]]):
                lengths = _mapped(outer, files[outer["file"]])
                if int(np.sum(lengths, dtype=np.int64)) != inner["rows"] or (lengths < 0).any():
                    file = os.path.join(path, outer["file"])
                    raise WriteError(
                        f"{call}{file} holds row lengths that do not add up to the "
                        f"{inner['rows']} entries of {inner['file']}: it was changed outside "
                        f"the write; {_fix(path)}"
                    )
    return None


def _file_problem(fd: int | OSError, part: dict[str, Any], complete: bool) -> str:
    """What is wrong with one part's file (`fd`, open, or why it could not be opened), or
    "" when it holds what `part` says."""
    if isinstance(fd, FileNotFoundError):
        return "is missing"
    if isinstance(fd, OSError):
        return f"cannot be read ({fd})"
    dtype, shape, rows = _dtype(part["dtype"]), tuple(part["shape"]), part["rows"]
    try:
        # A 1.0 header is at most 65535 bytes after its 10 of magic, version and length.
        opened = io.BytesIO(os.pread(fd, 10 + 65535, 0))
        major, minor = np.lib.format.read_magic(opened)
        if (major, minor) != (1, 0):
            return f"has a .npy header of version {major}.{minor}, not the 1.0 a write makes"
        header, fortran, stored = np.lib.format.read_array_header_1_0(opened)
        offset = opened.tell()
        size = os.fstat(fd).st_size
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        return f"has no readable .npy header ({error})"
    if offset != len(_header(dtype, 0, shape)):
        return "has a header this write would not make"
    if fortran or stored != np.dtype(np.lib.format.dtype_to_descr(dtype)):
        return f"holds {stored} values, not the manifest's {part['dtype']}"
    if tuple(header[1:]) != shape:
        return f"holds rows of shape {list(header[1:])}, not the manifest's {list(shape)}"
    if header[0] < rows or (complete and header[0] != rows):
        return f"counts {header[0]} rows in its header, not the manifest's {rows}"
    row_bytes = dtype.itemsize * math.prod(shape)
    if size < offset + rows * row_bytes or (complete and size != offset + rows * row_bytes):
        return f"is {size} bytes long, not the {offset + rows * row_bytes} of its {rows} rows"
    return ""


def _difference(got: np.ndarray, stored: np.ndarray) -> str:
    """How a part computed again differs from the same entries on disk; "" when equal.

    Integers and bools must be equal; floats within `ROUNDING` units of their
    dtype's precision (eps) of the larger of the value and its row's largest
    finite magnitude (another split of the batch, or a GPU's reductions, may round
    another way), NaN where NaN: a function or weights changed by more than
    that is refused, in bfloat16 (eps 2**-7) a change of about 3%.
    """
    if got.shape != stored.shape:
        return f"{len(got)} entries computed, {len(stored)} there"
    if got.dtype.kind not in "fcV":
        if np.array_equal(got, stored):
            return ""
        return f"{int(np.sum(got != stored))} of {got.size} values differ"
    if not got.size:
        return ""
    wide = np.asarray(got).astype(np.complex128 if got.dtype.kind == "c" else np.float64)
    there = np.asarray(stored).astype(wide.dtype)
    tolerance = ROUNDING * float(_finfo(got.dtype).eps)
    magnitude = np.where(np.isfinite(there), np.abs(there), 0.0).reshape(len(there), -1)
    scale = np.max(magnitude, axis=1, initial=0.0).reshape((-1,) + (1,) * (there.ndim - 1))
    with np.errstate(invalid="ignore"):  # inf - inf: isclose says whether they are equal
        near = np.abs(wide - there) <= tolerance * scale
    close = np.isclose(wide, there, rtol=tolerance, atol=0.0, equal_nan=True) | near
    if close.all():
        return ""
    worst = float(np.max(np.abs(wide - there)[~close]))
    return f"{int(np.sum(~close))} of {got.size} values differ, by up to {worst:.3g}"


def _listed_files(path: str) -> list[str]:
    """The data files a manifest at `path` names, read leniently (a damaged manifest of
    tfshard's still names its files, which `overwrite=True` replaces); [] for none."""
    try:
        manifest = _manifest_json(path)
    except (OSError, ValueError):
        return []
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return []
    replaced = manifest.get("replaces")  # an old write's files and its own, until its first commit
    names = replaced if isinstance(replaced, list) else []
    files = [name for name in names if isinstance(name, str) and _plain_file_name(name)]
    for leaf in manifest.get("leaves") or ():
        for part in (leaf.get("parts") or ()) if isinstance(leaf, dict) else ():
            name = part.get("file") if isinstance(part, dict) else None
            if isinstance(name, str) and _plain_file_name(name):
                files.append(name)
    return files


def _check_same(manifest: dict[str, Any], function: str, source: dict[str, Any], call: str) -> None:
    """Raises ArgumentError when the write at a path is another function's or dataset's."""
    fix = "pass overwrite=True to replace it, or write to another path"
    if manifest["function"] != function:
        raise ArgumentError(
            f"{call}: the write there was made by the function {manifest['function']!r}, not by "
            f"{function!r}; {fix}"
        )
    old = manifest["dataset"]
    if old["element"] != source["element"]:
        raise ArgumentError(
            f"{call}: the write there is of a dataset with elements {_shown(old['element'])}, "
            f"not {_shown(source['element'])}; {fix}"
        )
    if old["batches"] != source["batches"]:
        was, now = (_count(d["batches"]) for d in (old, source))
        raise ArgumentError(
            f"{call}: the write there is of a dataset of {was} batches, this one is of {now} "
            f"batches; {fix}"
        )
    if old["first_batch"] != source["first_batch"]:
        raise ArgumentError(
            f"{call}: the dataset's first batch differs from the one written there, so its "
            "batches cannot be trusted to come in the same order (another file? another "
            "batch_size? a shuffle? shuffle(n, seed=s, reshuffle_each_iteration=False) gives "
            f"one order every time); a resume needs the same batches in the same order; {fix}"
        )


def _check_outputs(
    leaves: list[dict[str, Any]],
    outputs: Any,
    records: list[dict[str, Any]],
    structure: Hashable,
    call: str,
) -> None:
    """Raises ArgumentError when a resumed write's outputs differ from those written."""
    fix = "pass overwrite=True to replace it, or write to another path"
    given = _encode(structure, call)
    if given != outputs:
        old = [leaf["path"] for leaf in leaves]
        new = [record["path"] for record in records]
        if old == new:  # the same leaves, in another structure: a dict's keys in another order
            old, new = [repr(_decode(outputs, old))], [repr(_decode(given, new))]
        raise ArgumentError(
            f"{call}: the write there has outputs {', '.join(old)}; this function gives "
            f"{', '.join(new)}; {fix}"
        )
    for leaf, record in zip(leaves, records):
        was = [(p["dtype"], p["shape"]) for p in leaf["parts"]]
        now = [(p["dtype"], p["shape"]) for p in record["parts"]]
        if leaf["kind"] != record["kind"] or was != now:
            raise ArgumentError(
                f"{call}: {leaf['path']} there is {_described(leaf)}; this function gives "
                f"{_described(record)}; {fix}"
            )


def _count(batches: int | None) -> str:
    return "an unknown number of" if batches is None else str(batches)


def _described(leaf: dict[str, Any]) -> str:
    part = leaf["parts"][0]
    shape = "[N" + "".join(f", {d}" for d in part["shape"]) + "]"
    return f"{leaf['kind']} {part['dtype']} {shape}"


def _shown(element: list[list[str]]) -> str:
    return ", ".join(f"{where}: {spec}" for where, spec in element)


def _element_spec(spec: Any) -> list[list[str]]:
    """Each leaf of a dataset's element spec as ``[path, spec]``, for the manifest."""
    leaves, structure = _trees.flatten(spec, "element")
    return [[where, repr(leaf)] for where, leaf in zip(_trees.paths("element", structure), leaves)]


def _first_batch_hash(batches: tf.data.Dataset) -> str | None:
    """A hash of the dataset's first batch (its dtypes, shapes and bytes); None if empty."""
    digest = hashlib.blake2b(digest_size=16)
    for element in batches.take(1):
        for value in _trees.flatten(element)[0]:
            for part in _kinds.of(value).parts(value):
                array = part.numpy()
                digest.update(f"{array.dtype.str}{array.shape}".encode())
                if array.dtype == object:  # strings: their bytes, each with its length
                    for item in array.ravel():
                        digest.update(len(item).to_bytes(8, "little") + item)
                else:
                    digest.update(np.ascontiguousarray(array).tobytes())
        return "blake2b:" + digest.hexdigest()
    return None


# ------------------------------------------------------- outputs and their files


def _parts(value: Any) -> list[np.ndarray]:
    """A batch's output leaf as the NumPy arrays of its parts (`_kinds`); ArgumentError
    for one no file holds, saying what it is (`Store._parts` says which leaf)."""
    if _kinds.of(value) is _kinds.Sparse or not isinstance(value, tf.Tensor | tf.RaggedTensor):
        raise ArgumentError(
            f"is a {type(value).__name__}; write stores dense and ragged tensors "
            "(tf.sparse.to_dense it in the function)"
        )
    arrays = [part.numpy() for part in _kinds.of(value).parts(value)]
    if arrays[0].dtype == object:
        raise ArgumentError(
            "is a tf.string tensor; write stores numbers and bools (map strings to ids in "
            "the function, or stream them with iterate)"
        )
    return arrays


def _records(
    values: list[Any], structure: Hashable, parts: list[list[np.ndarray]]
) -> list[dict[str, Any]]:
    """Each output leaf's record for the manifest: path, kind, parts and their files."""
    records, taken = [], set()
    for where, stem, value, arrays in zip(
        _trees.paths("output", structure), _stems(structure), values, parts
    ):
        kind = "ragged" if isinstance(value, tf.RaggedTensor) else "dense"
        files = []
        for name in _part_names(stem, kind, len(arrays)):
            unique, n = name, 1
            while unique.lower() in taken:  # one file each, on case-blind file systems too
                n += 1
                unique = f"{name}-{n}"
            taken.add(unique.lower())
            files.append(unique + ".npy")
        records.append(
            {
                "path": where,
                "kind": kind,
                "parts": [
                    {"file": file, "dtype": array.dtype.name, "shape": list(array.shape[1:]),
                     "rows": 0}
                    for file, array in zip(files, arrays)
                ],
            }
        )  # fmt: skip
    return records


def _part_names(stem: str, kind: str, count: int) -> list[str]:
    """File names (without ``.npy``) of a leaf's parts: ``emb``; ``ids.values``,
    ``ids.row_lengths`` (``ids.row_lengths.1``, ``.2``, ... for several)."""
    if kind == "dense":
        return [stem]
    lengths = [f"{stem}.row_lengths" + (f".{k}" if count > 2 else "") for k in range(1, count)]
    return [f"{stem}.values", *lengths]


def _stems(structure: Hashable) -> list[str]:
    """A file name stem for each leaf, from its labels: ``emb``, ``a.0``; ``output`` alone."""

    def node(key: Hashable, children: list[list[list[str]]]) -> list[list[str]]:
        labelled = zip(_trees.labels(key), children)
        return [[str(label), *names] for label, stems in labelled for names in stems]

    clean = lambda name: re.sub(r"[^A-Za-z0-9_-]", "_", name)  # noqa: E731
    named = _trees.fold(structure, lambda: [[]], node)
    return [".".join(map(clean, names)) or "output" for names in named]


def _encode(structure: Hashable, call: str) -> Any:
    """The outputs' structure as JSON: ``{"leaf": i}``, ``{"dict": [[key, ...], ...]}``,
    ``{"tuple": [...]}``, ``{"list": [...]}``, ``{"namedtuple": name, "fields": [...],
    "items": [...]}``; a mapping's keys are str or int (ArgumentError for others, naming
    `call`), attrs classes become dicts."""
    counter = iter(range(1 << 62))

    def node(key: Hashable, children: list[Any]) -> Any:
        if isinstance(key, _trees.SequenceNode):
            if hasattr(key.kind, "_fields"):
                fields = list(key.kind._fields)
                return {"namedtuple": key.kind.__name__, "fields": fields, "items": children}
            return {"list" if issubclass(key.kind, list) else "tuple": children}
        for name in key.keys:
            if isinstance(name, bool) or not isinstance(name, str | int):
                raise ArgumentError(
                    f"{call}: an output dict has a key {name!r} of type "
                    f"{type(name).__name__}; write names files by keys, so use str (or int) keys"
                )
        by_key = dict(zip(key.keys, children))
        order = getattr(key, "written", key.keys)  # a dict as written; attrs by field
        return {"dict": [[name, by_key[name]] for name in order]}

    return _trees.fold(structure, lambda: {"leaf": next(counter)}, node)


def _decode(encoded: Any, values: Sequence[Any]) -> Any:
    """The inverse of `_encode`, with `values` at the leaves (`_trees.build` of its key)."""
    order: list[int] = []  # the leaves' numbers, in the key's leaf order
    key = _key(encoded, order)
    return _trees.build(key, (values[i] for i in order))


def _key(encoded: Any, order: list[int]) -> Hashable:
    """The `_trees` structure key `_encode` wrote, its leaves' numbers appended to `order`."""
    if "leaf" in encoded:
        order.append(encoded["leaf"])
        return _trees.LEAF
    if "dict" in encoded:
        written = tuple(name for name, _ in encoded["dict"])
        by_key = dict(encoded["dict"])
        keys = tuple(sorted(written))  # leaf order, as `_trees.flatten` walks a mapping
        children = tuple(_key(by_key[name], order) for name in keys)
        return _trees.MappingNode(dict, keys, children, written, None)
    if "namedtuple" in encoded:
        kind: type = namedtuple(encoded["namedtuple"], encoded["fields"])  # noqa: PYI024
        items = encoded["items"]
    else:
        kind = list if "list" in encoded else tuple
        items = encoded["list" if "list" in encoded else "tuple"]
    return _trees.SequenceNode(kind, tuple(_key(child, order) for child in items))
