"""Files the command line writes (a LATENT, a benchmark's JSON): the path checked before any work starts, and the
result written so that nothing but a regular file is ever replaced and a finished result is never lost.

A result is written to a temporary name in the target's folder and renamed over the target, so a reader never sees
half a file. If that fails after the work is done (the folder went away, the disk filled, the target became a folder
or a device), the result is kept: the complete temporary file stays where it is, or the result is written to the
temporary directory or the current one, and the error says where, in one line.
"""
from __future__ import annotations

import os
import stat
import tempfile
from argparse import ArgumentTypeError

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


class ResultNotWritten(Exception):
    """Writing a finished result to its path failed; the message (one line) says why and where the result is."""


def _kind(path: str) -> str | None:
    """What `path` is when it exists and is not a regular file (None: a regular file, or nothing there)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    return next((name for test, name in KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a regular file")


def check(text: str, suffix: str, what: str) -> str:
    """The path to write `what` to, before any work: a regular file or a new name in a folder where a file can be
    created, ending in `suffix`. Raises ArgumentTypeError ("<text> is invalid: ...", one line) otherwise. Symbolic
    links are followed: the file they point to is the one replaced."""
    path = os.path.realpath(text)
    kind = _kind(path)
    if kind == "a folder":
        raise ArgumentTypeError(f"{text} is a folder: give a file name in it, e.g. "
                                f"{os.path.join(text, 'out' + suffix)}")
    if kind:
        raise ArgumentTypeError(f"{text} is {kind}, which is never replaced: give a regular file or a new name")
    if not text.endswith(suffix) or os.path.basename(text) == suffix:
        stem = os.path.splitext(os.path.basename(text))[0] or "out"
        raise ArgumentTypeError(f"{text} is invalid: {what} is written as a {suffix} file; give a name ending in "
                                f"{suffix}, e.g. {os.path.join(os.path.dirname(text), stem + suffix)}")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise ArgumentTypeError(f"{text} is invalid: its folder {folder} does not exist; create it or write elsewhere")
    try:   # the one sure test that a file can be made there: /proc refuses, and root passes any permission bits
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".xdit-probe-")
    except OSError as e:
        raise ArgumentTypeError(f"{text} is invalid: no file can be created in {folder} ({e.strerror}); write "
                                f"elsewhere") from None
    os.close(fd)
    os.unlink(probe)
    return path


def _write_new(folder: str, prefix: str, suffix: str, data: bytes, mode: int) -> str:
    """data in a new file of that folder (removed again if it cannot be written whole); returns its path."""
    fd, path = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(path, mode)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return path


def _mode(path: str) -> int:
    """The new file's permissions: the replaced file's, else what the umask gives a new file."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write(path: str, data: bytes) -> str:
    """Write `data` to `path` (as check() returned it) through a temporary name in its folder; returns `path`.
    Raises ResultNotWritten after keeping the result elsewhere when it cannot be written there."""
    folder, name = os.path.split(path)
    suffix = os.path.splitext(name)[1]
    mode = _mode(path)
    try:
        tmp = _write_new(folder, f".{name}.", ".part", data, mode)
    except OSError as e:
        raise ResultNotWritten(f"could not write {path} ({e.strerror or e}); {_keep(name, suffix, data, mode)}") \
            from None
    kind = _kind(path)   # the job ran for a while: the target may have changed meanwhile
    if kind:
        raise ResultNotWritten(f"{path} is now {kind}, which is never replaced; the result is in {tmp}")
    try:
        os.replace(tmp, path)
    except OSError as e:
        raise ResultNotWritten(f"could not rename the result to {path} ({e.strerror or e}); the result is in "
                               f"{tmp}") from None
    return path


def _keep(name: str, suffix: str, data: bytes, mode: int) -> str:
    """Write a result that could not go where asked to the temporary directory or the current one; say where."""
    stem = name[:-len(suffix)] if suffix else name
    failures = []
    for folder in dict.fromkeys((tempfile.gettempdir(), os.getcwd())):
        try:
            return f"the result is in {_write_new(folder, f'{stem}-', suffix, data, mode)}"
        except OSError as e:
            failures.append(f"{folder}: {e.strerror or e}")
    return f"it could not be kept elsewhere either ({'; '.join(failures)})"
