"""Files the command line writes (a LATENT, a benchmark's JSON, make-tiny's files): the path checked before any work
starts, and the result written so that nothing but a regular file is ever replaced and a finished result is never lost.

An output path that is, or links to, a path the command was given for anything else (a model, a conditioning file, a
LoRA, a file inside a model folder) is refused before any work (`refuse_inputs`): `main` checks every flag whose value
`check` or `check_dir` returned, and a command checks the files it names inside an output folder.

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

SUBCOMMANDS = ("command", "what")   # the parsed namespace's entries that name a subcommand, not a path
KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


class OutputPath(str):
    """A path a command writes, as check() (a file) or check_dir() (a folder) returned it; `given`: as the user typed
    it."""

    def __new__(cls, path: str, given: str, folder: bool = False):
        self = super().__new__(cls, path)
        self.given, self.folder = given, folder
        return self


class ResultNotWritten(Exception):
    """Writing a finished result to its path failed; the message (one line) says why and where the result is."""


def special_kind(path: str) -> str | None:
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
    try:
        kind = special_kind(path)
    except OSError as e:   # a name too long, a loop of links, a folder not searchable
        raise ArgumentTypeError(f"{text} is invalid: {e.strerror}; write elsewhere") from None
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
    return OutputPath(path, text)


def check_dir(text: str) -> str:
    """The folder to write into, before any work: an existing folder where a file can be created, or a new one that
    can be made (created when the command writes). Raises ArgumentTypeError ("<text> is invalid: ...", one line)."""
    path = os.path.abspath(text)
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):   # a folder to make, or a file on the way (said below)
        pass
    except OSError as e:   # a name too long, a loop of links, a folder not searchable
        raise ArgumentTypeError(f"{text} is invalid: {e.strerror}; write elsewhere") from None
    parent = path
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        what = "a file" if os.path.exists(parent) else "a link to nothing"
        raise ArgumentTypeError(f"{text} is {what}, not a folder" if parent == path else
                                f"{text} is invalid: {parent} is {what}, not a folder")
    try:   # as check(): the one sure test; a missing folder is made (and removed) where it would be made
        if parent == path:
            fd, probe = tempfile.mkstemp(dir=path, prefix=".xdit-probe-")
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".xdit-probe-"))
    except OSError as e:
        what = "no file can be created in" if parent == path else "no folder can be created in"
        raise ArgumentTypeError(f"{text} is invalid: {what} {parent} ({e.strerror}); write elsewhere") from None
    return OutputPath(text, text, folder=True)


def given_paths(a) -> list[tuple[str, str]]:
    """(flag, path) of every existing path the command's flags name, outputs aside: what the job reads."""
    found = []

    def walk(flag, value):
        if isinstance(value, OutputPath):
            return
        if isinstance(value, str):
            if os.path.lexists(value):
                found.append((flag, value))
        elif isinstance(value, (list, tuple)):   # --lora PATH:STRENGTH (repeated) -> [(path, strength), ...]
            for item in value:
                walk(flag, item)
    for dest, value in vars(a).items():
        if dest not in SUBCOMMANDS:
            walk("--" + dest.replace("_", "-"), value)
    return found


def refuse_inputs(flag: str, path: str, a, given: str | None = None) -> None:
    """Raise UsageError when `path`, a file the command would write, is, or links to, a path given to another of its
    flags, or replaces a file inside a folder given to one (a diffusers model): nothing the user gave is overwritten."""
    from .args import UsageError

    shown = given or path
    real = os.path.realpath(path)
    for other, value in given_paths(a):
        source = os.path.realpath(value)
        if real == source or _same_file(path, value):
            how = "is" if os.path.abspath(shown) == os.path.abspath(value) else "is the same file as"
            raise UsageError(f"argument {flag}: {shown} {how} the {other} file {value}: writing there would replace "
                             f"it; give a new name, e.g. {_example(shown)}")
        if os.path.isdir(source) and os.path.lexists(path) and real.startswith(source.rstrip(os.sep) + os.sep):
            raise UsageError(f"argument {flag}: {shown} is a file inside the {other} folder {value}, which the job "
                             f"reads: writing there would replace it; write elsewhere")


def _same_file(a: str, b: str) -> bool:
    """One file under two names (a hard link, a bind mount)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _example(path: str) -> str:
    stem, suffix = os.path.splitext(path)
    return f"{stem}-out{suffix}"


def refuse_outputs_that_are_inputs(a) -> None:
    """Every output file the parsed flags name (OutputPath), checked against every other flag's paths."""
    for dest, value in vars(a).items():
        if isinstance(value, OutputPath) and not value.folder:
            refuse_inputs("--" + dest.replace("_", "-"), value, a, value.given)


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
    kind = special_kind(path)   # the job ran for a while: the target may have changed meanwhile
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
