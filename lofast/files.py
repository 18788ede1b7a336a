"""Writing files so that a reader never sees half of one: every output of lofast goes through here."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from lofast.errors import LofastError


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call write(tmp_path) on a temporary file beside ``path``, then rename it into place: the
    path holds the old file or the whole new one, never a part. The temporary file is removed
    if ``write`` (or the rename) raises, and the exception propagates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary shared files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
