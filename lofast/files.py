"""Writing files so that a reader never sees half of one: every output of lofast goes through here."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from lofast.errors import LofastError


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call write(tmp_path) on a temporary file beside ``path``, then rename it into place: the
    path holds the old file or the whole new one, never a part. The temporary file is removed
    if ``write`` (or the rename) raises, and the exception propagates: an OSError for a failed
    write, also where torch or safetensors report one as RuntimeError or SafetensorError (a
    full disk), so that every caller and the command line's one error line see it as such."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary shared files
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, RuntimeError) or type(e).__name__ == "SafetensorError":
            reason = (str(e).splitlines() or [type(e).__name__])[0]
            raise OSError(errno.EIO, f"write failed ({reason}); what was there is unchanged",
                          str(path)) from None
        raise


def check_writable(path: Path) -> None:
    """Refuse, in one line, an output path whose folder cannot take a new file (read-only, or
    a regular file where a folder should be), by creating and removing a temporary file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise LofastError(f"cannot write {path}: {e.strerror or e}") from None
    if path.is_dir():
        raise LofastError(f"{path} is a folder, not a file to write")


# The longest line a record file may hold (a record with many eps and counterexamples is a few
# kB): a file without line breaks is refused after this many bytes, not read whole.
MAX_LINE_BYTES = 1 << 20


def check_readable(path: Path, what: str,
                   error: type[LofastError] = LofastError) -> os.stat_result:
    """Refuse, in one line, a path that is not a regular file: missing, a folder, or a FIFO or
    device, whose reading could wait forever (a FIFO) or never end (/dev/zero)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path} is a folder, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path} is {_kind(st.st_mode)}, not a {what} (a regular file)")
    return st


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def read_lines(handle: BinaryIO, path: Path) -> Iterator[bytes]:
    """The lines of an open binary file, each with its line break (the last one may lack it);
    LofastError at a line longer than MAX_LINE_BYTES, before reading more of it."""
    while True:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES:
            raise LofastError(f"{path}: a line longer than {MAX_LINE_BYTES} bytes; not a lofast "
                              "record file")
        yield line
