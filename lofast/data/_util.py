"""Helpers shared by the readers."""

from __future__ import annotations

import contextlib
import gzip
import tarfile
import zlib
from collections.abc import Iterator

from lofast.errors import DataError

# What reading a damaged tar or gzip stream can raise: tarfile.ReadError for bad headers,
# EOFError for a gzip stream cut short, zlib.error for bad deflate data, OSError (BadGzipFile)
# for a bad gzip header.
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, OSError)

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
GZIP_MAGIC = b"\x1f\x8b"

# The most bytes a reader takes from one archive member or one compressed MAT-file element (a
# CIFAR-10 batch holds 31 MB, SVHN's largest array, extra_32x32's images, 1.6 GB). A compressed
# file can declare, or inflate to, about a thousand times its own size (zeros deflate so), so
# without a bound a small file could ask for all of the machine's memory.
MAX_MEMBER_BYTES = 1 << 32


def check_member_size(size: int, location: str) -> None:
    """DataError naming ``location`` where an archive member's ``size`` (bytes, as its header
    declares) exceeds MAX_MEMBER_BYTES."""
    if size > MAX_MEMBER_BYTES:
        raise DataError(f"{location}: a member of {size:,} bytes; lofast reads at most "
                        f"{MAX_MEMBER_BYTES:,} bytes from one")


def reason(exc: BaseException) -> str:
    """The message of `exc` on one line (library messages may span several), else its type."""
    return " ".join(str(exc).split()) or type(exc).__name__


def is_tar_name(name: str) -> bool:
    """Whether a file name says it is a (possibly gzipped) tar archive."""
    return name.lower().endswith(TAR_SUFFIXES)


@contextlib.contextmanager
def open_tar_stream(path) -> Iterator[TarStream]:
    """Open a tar or tar.gz for one sequential pass (stream mode: no seeking back, no index).
    A pass that reaches the end checks that the archive is whole (``TarStream``)."""
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        # gzip.GzipFile, unlike tarfile's own gzip reader, fails on a stream cut short and
        # checks the CRC and length in the stream's trailer
        source = _CountingReader(gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw)
        with tarfile.open(fileobj=source, mode="r|") as tar:
            yield TarStream(tar, source, str(path))


class TarStream:
    """Members of a tar read in one pass: ``for member in stream`` and ``extractfile(member)``.

    tarfile ends a pass without an error where the data stops at or inside a header block, so
    an archive cut at a member boundary would read as a smaller, valid one (and tarfile's gzip
    reader ignores a missing gzip trailer). After the last member this pass therefore reads
    the rest of the archive and requires the end-of-archive block, a zero block where the next
    header would be, and (through ``gzip.GzipFile``) a complete gzip stream; otherwise it
    raises ``tarfile.ReadError`` or ``EOFError``. A member is read only if its header declares
    at most MAX_MEMBER_BYTES (DataError otherwise, before any of it is read).
    """

    def __init__(self, tar: tarfile.TarFile, source: _CountingReader, path: str) -> None:
        self._tar = tar
        self._source = source
        self._path = path

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        yield from self._tar
        end = self._tar.offset  # where the end-of-archive block begins
        self._source.read_to_end()  # raises for a gzip stream cut short or a bad CRC
        if self._source.count < end + tarfile.BLOCKSIZE:
            raise tarfile.ReadError("the archive ends without its end-of-archive block")

    def extractfile(self, member: tarfile.TarInfo):
        check_member_size(member.size, f"{self._path}:{member.name}")
        return self._tar.extractfile(member)


class _CountingReader:
    """A binary stream that counts the bytes read from it."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.count += len(data)
        return data

    def read_to_end(self) -> None:
        while self.read(1 << 16):
            pass
