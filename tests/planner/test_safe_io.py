"""planner/safe_io.py: files from anywhere read within bounds, written atomically."""

from __future__ import annotations

import os
import resource
import signal
import threading

import pytest

from planner.safe_io import FileRefusedError, parse_json, read_regular_file, write_atomic


def _within(seconds: float, fn):
    """``fn()``'s result or exception, failing the test if it runs past ``seconds`` (a read
    that blocks is left behind in a daemon thread, where it harms nothing)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_regular_file_is_read(tmp_path):
    p = tmp_path / "f.json"
    p.write_bytes(b"[1, 2]")
    assert read_regular_file(p, max_bytes=6, what="f") == b"[1, 2]"
    link = tmp_path / "link.json"
    link.symlink_to(p)
    assert read_regular_file(link, max_bytes=100, what="f") == b"[1, 2]"


def test_a_fifo_with_no_writer_is_refused_at_once(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    with pytest.raises(FileRefusedError, match=r"plan file is a FIFO \(named pipe\), not a regular file"):
        _within(10, lambda: read_regular_file(fifo, max_bytes=2**20, what="plan file"))


@pytest.mark.parametrize("target, kind", [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_a_symlink_to_a_device_is_refused_unread(tmp_path, target, kind):
    if not os.path.exists(target):
        pytest.skip(f"no {target} here")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    with pytest.raises(FileRefusedError, match=f"is {kind}, not a regular file"):
        _within(10, lambda: read_regular_file(link, max_bytes=2**20, what="plan file"))


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(FileRefusedError, match="is a directory"):
        read_regular_file(tmp_path, max_bytes=100, what="f")


def test_a_file_over_the_cap_is_refused(tmp_path):
    p = tmp_path / "big.json"
    p.write_bytes(b" " * 101)
    with pytest.raises(FileRefusedError, match="larger than 100 bytes"):
        read_regular_file(p, max_bytes=100, what="f")


def test_a_file_that_says_size_0_is_still_capped():
    # /proc files report size 0 and produce more: the cap holds while reading.
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc here")
    with pytest.raises(FileRefusedError, match="larger than 10 bytes"):
        read_regular_file("/proc/self/maps", max_bytes=10, what="f")


@pytest.mark.parametrize("text", ["[" * 100_000, "[" * 17 + "]" * 17, '{"a":' * 40 + "1" + "}" * 40])
def test_deep_nesting_is_refused_without_recursion_error(text):
    with pytest.raises(FileRefusedError, match="nests arrays or objects"):
        parse_json(text, what="f", max_depth=16)


@pytest.mark.parametrize("text", ["[" * 16 + "]" * 16, '["[[[[[[[[[[[[[[[[[[[[[[[", 1]',
                                  '["\\"[[[[[[[[[[[[[[[[[[[[["]', '["\\\\", [[]]]'])
def test_brackets_inside_strings_do_not_count(text):
    assert parse_json(text, what="f", max_depth=16) is not None


def test_an_integer_past_pythons_conversion_limit_is_one_refusal():
    with pytest.raises(FileRefusedError, match="holds a number beyond any field's range"):
        parse_json("[" + "9" * 5000 + "]", what="f", max_depth=4)


def test_invalid_json_is_named():
    with pytest.raises(FileRefusedError, match="f is not valid JSON"):
        parse_json("{not json", what="f", max_depth=4)


def test_save_replaces_the_file_and_keeps_its_mode(tmp_path):
    p = tmp_path / "plan.json"
    p.write_bytes(b"old")
    os.chmod(p, 0o640)
    write_atomic(p, b"new", what="f")
    assert p.read_bytes() == b"new" and (p.stat().st_mode & 0o777) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_save_through_a_symlink_replaces_the_file_it_names(tmp_path):
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_bytes(b"old")
    link.symlink_to(real)
    write_atomic(link, b"new", what="f")
    assert link.is_symlink() and real.read_bytes() == b"new"


@pytest.mark.parametrize("target", ["dir", "/dev/null"])
def test_save_refuses_to_replace_what_is_not_a_regular_file(tmp_path, target):
    path = tmp_path / "d" if target == "dir" else tmp_path / "null.json"
    if target == "dir":
        path.mkdir()
    else:
        path.symlink_to(target)
    with pytest.raises(FileRefusedError, match="not a regular file"):
        write_atomic(path, b"x", what="f")


def test_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path):
    # A file-size limit makes the write fail as a full disk does (EFBIG instead of ENOSPC).
    p = tmp_path / "plan.json"
    p.write_bytes(b"the old plan")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        with pytest.raises(OSError):
            write_atomic(p, b"x" * 5000, what="f")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, before)
    assert p.read_bytes() == b"the old plan"
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]
