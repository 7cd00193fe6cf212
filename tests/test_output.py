"""Where the command line writes a result (engine/cli/output.py): the path is checked before any work (a regular file
or a new name in a folder where a file can be made, with the right suffix; devices, pipes, folders and /proc refused),
the file is written under a temporary name and renamed only over a regular file, and a result that cannot be written
where asked is kept and said where, in one line. Pure file-system tests: no rank starts."""
import errno
import os
import socket
import stat
import tempfile
from argparse import ArgumentTypeError

import pytest

from engine.cli import output

DATA = b"result bytes " * 100


def check(path):
    return output.check(str(path), ".safetensors", "a LATENT")


def refused(path) -> str:
    with pytest.raises(ArgumentTypeError) as info:
        check(path)
    message = str(info.value)
    print(message)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("device", ["/dev/full", "/dev/null", "/dev/zero"])
def test_a_device_is_refused_and_left_as_it_is(device):
    before = os.stat(device)
    assert refused(device) == f"{device} is a character device, which is never replaced: give a regular file or a " \
                              f"new name"
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_a_named_pipe_a_socket_and_a_folder_are_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe.safetensors")
    assert "is a named pipe, which is never replaced" in refused(tmp_path / "pipe.safetensors")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock.safetensors"))
        assert "is a socket, which is never replaced" in refused(tmp_path / "sock.safetensors")
    assert refused(tmp_path) == f"{tmp_path} is a folder: give a file name in it, e.g. {tmp_path}/out.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.safetensors", "sock.safetensors"]  # nothing left


def test_a_link_to_a_device_is_refused_and_a_link_to_a_regular_file_writes_that_file(tmp_path):
    os.symlink("/dev/full", tmp_path / "full.safetensors")
    assert "is a character device" in refused(tmp_path / "full.safetensors")
    target = tmp_path / "real.safetensors"
    target.write_bytes(b"old")
    os.symlink(target, tmp_path / "link.safetensors")
    path = check(tmp_path / "link.safetensors")
    assert path == str(target)
    output.write(path, DATA)
    assert os.path.islink(tmp_path / "link.safetensors") and target.read_bytes() == DATA


@pytest.mark.parametrize("path, reason", [("/proc/x.safetensors", "no file can be created in /proc"),
                                          ("/sys/x.safetensors", "no file can be created in /sys")])
def test_kernel_file_systems_are_refused_before_any_work(path, reason):
    message = refused(path)
    assert message.startswith(f"{path} is invalid: {reason} (") and message.endswith("); write elsewhere")


def test_the_suffix_is_required_and_the_message_suggests_the_name_with_it(tmp_path):
    assert refused(tmp_path / "image.png") == (f"{tmp_path}/image.png is invalid: a LATENT is written as a "
                                               f".safetensors file; give a name ending in .safetensors, e.g. "
                                               f"{tmp_path}/image.safetensors")
    assert "e.g. out.safetensors" in refused("out")


def test_a_missing_folder_is_refused_and_a_new_name_in_a_folder_passes_without_leaving_a_file(tmp_path):
    assert "its folder" in refused(tmp_path / "missing" / "x.safetensors")
    assert check(tmp_path / "new.safetensors") == str(tmp_path / "new.safetensors")
    assert list(tmp_path.iterdir()) == []   # the probe that a file can be made there is gone


def test_writing_replaces_a_regular_file_through_a_temporary_name_and_keeps_its_permissions(tmp_path, monkeypatch):
    target = tmp_path / "out.safetensors"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((a, b)), real_replace(a, b)))
    assert output.write(check(target), DATA) == str(target)
    assert target.read_bytes() == DATA and stat.S_IMODE(os.stat(target).st_mode) == 0o640
    (source, dest), = renames
    assert os.path.dirname(source) == str(tmp_path) and os.path.basename(source).startswith(".out.safetensors.")
    assert dest == str(target) and os.listdir(tmp_path) == ["out.safetensors"]


def test_a_target_that_became_a_folder_during_the_job_is_not_replaced_and_the_result_stays_in_the_temporary_file(
        tmp_path):
    path = check(tmp_path / "out.safetensors")
    os.mkdir(path)   # while the job ran
    with pytest.raises(output.ResultNotWritten) as info:
        output.write(path, DATA)
    message = str(info.value)
    print(message)
    kept = message.split("the result is in ")[1]
    assert message.startswith(f"{path} is now a folder, which is never replaced; ") and "\n" not in message
    assert os.path.isdir(path) and open(kept, "rb").read() == DATA and os.path.dirname(kept) == str(tmp_path)


def test_a_folder_gone_during_the_job_keeps_the_result_in_the_temporary_directory(tmp_path, monkeypatch):
    folder = tmp_path / "results"
    folder.mkdir()
    path = check(folder / "out.safetensors")
    folder.rmdir()
    elsewhere = tmp_path / "tmp"
    elsewhere.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    with pytest.raises(output.ResultNotWritten) as info:
        output.write(path, DATA)
    message = str(info.value)
    print(message)
    assert message.startswith(f"could not write {path} (No such file or directory); the result is in {elsewhere}/out-")
    kept = message.split("the result is in ")[1]
    assert kept.endswith(".safetensors") and open(kept, "rb").read() == DATA


def test_a_full_disk_removes_the_partial_file_and_keeps_the_result_elsewhere(tmp_path, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "tmp").mkdir()
    path = check(tmp_path / "full" / "out.safetensors")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    real_fsync, calls = os.fsync, []

    def fsync(fd):   # the first write (the target's folder) finds the disk full
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(output.ResultNotWritten) as info:
        output.write(path, DATA)
    message = str(info.value)
    print(message)
    assert message.startswith(f"could not write {path} (No space left on device); the result is in {tmp_path}/tmp/")
    assert os.listdir(tmp_path / "full") == []   # no partial file left behind
    assert open(message.split("the result is in ")[1], "rb").read() == DATA


def test_when_nothing_can_be_written_the_message_says_so_in_one_line(tmp_path, monkeypatch):
    path = check(tmp_path / "out.safetensors")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, os.strerror(errno.EIO))))
    with pytest.raises(output.ResultNotWritten) as info:
        output.write(path, DATA)
    message = str(info.value)
    print(message)
    assert message.startswith(f"could not write {path} (Input/output error); it could not be kept elsewhere either (")
    assert "\n" not in message and os.listdir(tmp_path) == []


# ---- output folders (make-tiny --out, calibrate --folder) ------------------------------------------------------
def refused_dir(path) -> str:
    with pytest.raises(ArgumentTypeError) as info:
        output.check_dir(str(path))
    message = str(info.value)
    print(message)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("path, reason", [("/proc/xdir", "no folder can be created in /proc"),
                                          ("/proc/self", "no file can be created in /proc/self"),
                                          ("/sys/xdir/deeper", "no folder can be created in /sys")])
def test_a_folder_that_cannot_be_made_or_written_is_refused_before_any_work(path, reason):
    message = refused_dir(path)
    assert message.startswith(f"{path} is invalid: {reason} (") and message.endswith("); write elsewhere")


def test_a_file_where_a_folder_is_needed_is_refused_and_a_new_folder_passes_without_being_made(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    assert refused_dir(tmp_path / "file") == f"{tmp_path}/file is a file, not a folder"
    assert refused_dir(tmp_path / "file" / "sub") == f"{tmp_path}/file/sub is invalid: {tmp_path}/file is a file, " \
                                                     f"not a folder"
    assert output.check_dir(str(tmp_path / "new" / "deeper")) == str(tmp_path / "new" / "deeper")
    assert output.check_dir(str(tmp_path)) == str(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]   # the probes are gone, the new folder not made yet


# ---- an output is never an input -------------------------------------------------------------------------------
def test_a_file_inside_a_model_folder_given_as_input_is_refused_and_a_new_name_there_passes(tmp_path):
    """A diffusers model is a folder: a result that would replace one of its files is refused; a new name beside them
    replaces nothing."""
    from argparse import Namespace
    from engine.cli.args import UsageError

    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"weights")
    a = Namespace(command="generate", model=str(model), steps=4, loras=[])
    with pytest.raises(UsageError) as info:
        output.refuse_inputs("--out", str(weights), a)
    print(info.value)
    assert str(info.value) == (f"argument --out: {weights} is a file inside the --model folder {model}, which the job "
                               f"reads: writing there would replace it; write elsewhere")
    output.refuse_inputs("--out", str(model / "new.safetensors"), a)
    assert weights.read_bytes() == b"weights"
