"""Files from users read and written as files from anywhere: bounded, typed, atomic.

A plan file may come from a colleague, a bug report or a script gone wrong. Reading it must not
hang (a FIFO with no writer), exhaust memory (a symlink to ``/dev/zero``), or surface a parser's
internals (``RecursionError`` on ``[[[[...``, ``ValueError`` on an integer of 5,000 digits);
writing it must not destroy the previous file when the disk fills up. Each function raises
:class:`FileRefusedError` (one line, naming the file and what to do) for what it refuses and
lets ``OSError`` through for what the operating system refuses (no such file, no permission).

The module knows nothing of plans: :mod:`planner.plan` sets the limits and turns the refusal
into its own error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from planner.errors import FileRefusedError

__all__ = ["FileRefusedError", "parse_json", "read_regular_file", "write_atomic"]


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _check_regular(st: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FileRefusedError(f"{what} is {_kind(st.st_mode)}, not a regular file; give the path "
                               "of a file on disk")


def _too_large(what: str, max_bytes: int) -> FileRefusedError:
    return FileRefusedError(f"{what} is larger than {max_bytes:,} bytes, more than any such file "
                            "needs; check that the path names the right file")


def read_regular_file(path: str | os.PathLike, *, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed), at most ``max_bytes``.

    Refused: directories, FIFOs, devices and sockets (checked before opening, and again on the
    opened descriptor, which is opened non-blocking so that a FIFO swapped in between cannot
    block), and files over ``max_bytes`` (by their size, and while reading, since files under
    ``/proc`` report size 0). ``what`` names the file in messages (``"plan file p.json"``)."""
    _check_regular(os.stat(path), what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        _check_regular(st, what)
        if st.st_size > max_bytes:
            raise _too_large(what, max_bytes)
        chunks, n = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - n))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            n += len(chunk)
            if n > max_bytes:
                raise _too_large(what, max_bytes)
    finally:
        os.close(fd)


def parse_json(text: str, *, what: str, max_depth: int) -> Any:
    """``json.loads(text)`` within limits: nesting at most ``max_depth`` deep (checked on the
    text before parsing, so no recursion limit is reached), integers Python converts (up to
    4,300 digits). The caller bounds each value's range: ``NaN``, ``Infinity`` and ``1e400``
    (infinity) arrive as floats, so that the field holding them is named."""
    _check_depth(text, what, max_depth)
    try:
        return json.loads(text)
    except RecursionError:  # unbalanced brackets the depth check leaves to the parser
        raise FileRefusedError(f"{what} nests arrays or objects deeper than the JSON reader "
                               f"goes (this format has {max_depth} levels at most)") from None
    except json.JSONDecodeError as e:
        raise FileRefusedError(f"{what} is not valid JSON: {e}") from None
    except ValueError as e:  # an integer past Python's int/str conversion limit
        raise FileRefusedError(f"{what} holds a number beyond any field's range "
                               f"({str(e).split(':')[0]})") from None


_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')


def _check_depth(text: str, what: str, max_depth: int) -> None:
    """Refuse text whose arrays and objects nest more than ``max_depth`` deep, all in C (a
    64 MiB file takes well under a second): escaped backslashes and quotes out, everything but
    brackets and quotes out, strings out (every other piece between quotes), then one level of
    innermost pairs peeled per pass. Brackets no pass can peel are unbalanced: the parser
    reports them."""
    b = text.encode("utf-8", "surrogatepass").replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(b.translate(None, _NOT_STRUCTURE).split(b'"')[::2])
    for _ in range(max_depth):
        if not brackets:
            return
        brackets = _INNERMOST.sub(b"", brackets)
    if _INNERMOST.search(brackets):
        raise FileRefusedError(f"{what} nests arrays or objects more than {max_depth} levels deep; "
                               "this format has fewer")


def write_atomic(path: str | os.PathLike, data: bytes, *, what: str) -> None:
    """Write ``data`` to ``path`` so that the file is either the old one or the new one, never a
    part: a temporary file beside it is written, flushed to disk and renamed over it (a full
    disk leaves the old file and no temporary behind). A symlink keeps pointing at the file it
    names, which is replaced; an existing file keeps its permission bits. Refused: a path that
    exists and is not a regular file (a directory, ``/dev/null``)."""
    target = Path(os.path.realpath(path))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None:
        _check_regular(st, what)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o666)  # the umask applies, as to any new file
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dir(target.parent)


def _sync_dir(directory: Path) -> None:
    """Flush the rename to disk where the platform allows opening a directory (POSIX)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
