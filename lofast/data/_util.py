"""Helpers shared by the readers."""

from __future__ import annotations

import tarfile
import zlib

# What reading a damaged tar or gzip stream can raise: tarfile.ReadError for bad headers,
# EOFError for a gzip stream cut short, zlib.error for bad deflate data, OSError (BadGzipFile)
# for a bad gzip header.
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, OSError)

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def reason(exc: BaseException) -> str:
    """The message of `exc` on one line (library messages may span several), else its type."""
    return " ".join(str(exc).split()) or type(exc).__name__


def is_tar_name(name: str) -> bool:
    """Whether a file name says it is a (possibly gzipped) tar archive."""
    return name.lower().endswith(TAR_SUFFIXES)


def open_tar_stream(path) -> tarfile.TarFile:
    """Open a tar or tar.gz for one sequential pass (stream mode: no seeking back, no index)."""
    return tarfile.open(path, mode="r|*")
