"""A small reader for MATLAB level-5 MAT-files: numeric arrays only, which is all SVHN needs.

Format (MATLAB "MAT-File Format", level 5): a 128-byte header (text, subsystem offset, version,
endian indicator), then a sequence of data elements. Each element has an 8-byte tag (data type,
byte count) followed by its data padded to 8 bytes, or a 4-byte "small element" tag whose data
fits in the remaining 4 bytes. A variable is a miMATRIX element (array flags, dimensions, name,
real part, optional imaginary part), possibly wrapped in a zlib-compressed miCOMPRESSED element
(unpadded at the top level). Arrays are stored column-major.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from lofast.data import _util
from lofast.data._util import reason
from lofast.errors import DataError

_HEADER_SIZE = 128
_VERSION_5 = 0x0100
_VERSION_HDF5 = 0x0200
MI_MATRIX = 14
MI_COMPRESSED = 15
_MI_UINT32 = 6
_MI_INT32 = 5

# Storage types of element data (miINT8 ... miUINT64).
_MI_DTYPES = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 9: "f8",
              12: "i8", 13: "u8"}
# Numeric array classes (mxDOUBLE_CLASS ... mxUINT64_CLASS). MATLAB may store data in a smaller
# type than its class (a double array of small integers as miUINT8), so the class decides the
# dtype of the result.
_MX_DTYPES = {6: "f8", 7: "f4", 8: "i1", 9: "u1", 10: "i2", 11: "u2", 12: "i4", 13: "u4",
              14: "i8", 15: "u8"}
_MX_NAMES = {1: "cell", 2: "struct", 3: "object", 4: "char", 5: "sparse"}
_COMPLEX_FLAG = 0x0800


class _Elements:
    """Reads consecutive data elements from a buffer.

    Inside a matrix every element is padded to 8 bytes. At the top level the byte count is taken
    as is (`padded=False`): a miCOMPRESSED element is not padded there, and a miMATRIX byte count
    is already a multiple of 8.
    """

    def __init__(self, buf: memoryview, endian: str, location: str, padded: bool = True) -> None:
        self.buf, self.endian, self.location, self.padded = buf, endian, location, padded
        self.pos = 0

    def _u32(self, pos: int) -> int:
        if pos + 4 > len(self.buf):
            raise DataError(f"{self.location}: truncated MAT element")
        return int(np.frombuffer(self.buf, f"{self.endian}u4", 1, pos)[0])

    def next(self) -> tuple[int, memoryview]:
        """(data type, data bytes) of the next element."""
        first = self._u32(self.pos)
        if first >> 16:  # small element: byte count in the upper half, data in the next 4 bytes
            mtype, nbytes, start, end = first & 0xFFFF, first >> 16, self.pos + 4, self.pos + 8
            if nbytes > 4:
                raise DataError(f"{self.location}: malformed small MAT element")
        else:
            mtype, nbytes, start = first, self._u32(self.pos + 4), self.pos + 8
            end = start + ((nbytes + 7) // 8 * 8 if self.padded else nbytes)
        if start + nbytes > len(self.buf):
            raise DataError(f"{self.location}: truncated MAT element")
        self.pos = end
        return mtype, self.buf[start:start + nbytes]

    def numbers(self, mtype: int, data: memoryview) -> np.ndarray:
        """The data of an element of numeric type `mtype` as a read-only 1-D array."""
        if mtype not in _MI_DTYPES:
            raise DataError(f"{self.location}: unsupported MAT data type {mtype}")
        dtype = np.dtype(f"{self.endian}{_MI_DTYPES[mtype]}")
        if len(data) % dtype.itemsize:
            raise DataError(f"{self.location}: MAT element of {len(data)} bytes "
                            f"is not a whole number of {dtype.name} values")
        return np.frombuffer(data, dtype)


def _read_matrix(buf: memoryview, endian: str, location: str, wanted: set[str]
                 ) -> tuple[str, np.ndarray | None]:
    """(name, array) of one miMATRIX payload; the array is None when its name is not wanted."""
    elements = _Elements(buf, endian, location)
    flags_type, flags = elements.next()
    dims_type, dims = elements.next()
    _, name_bytes = elements.next()
    if flags_type != _MI_UINT32 or len(flags) != 8 or dims_type != _MI_INT32:
        raise DataError(f"{location}: malformed MAT array header")
    name = bytes(name_bytes).decode("ascii", "replace")
    if name not in wanted:
        return name, None
    flag_word = int(elements.numbers(flags_type, flags)[0])
    mx_class = flag_word & 0xFF
    if mx_class not in _MX_DTYPES:
        kind = _MX_NAMES.get(mx_class, f"class {mx_class}")
        raise DataError(f"{location}: variable '{name}' is a {kind} array, expected numbers")
    if flag_word & _COMPLEX_FLAG:
        raise DataError(f"{location}: variable '{name}' is complex, expected real numbers")
    shape = tuple(int(d) for d in elements.numbers(dims_type, dims))
    values = elements.numbers(*elements.next())
    if values.size != int(np.prod(shape)):
        raise DataError(f"{location}: variable '{name}' has {values.size} values "
                        f"for dimensions {'x'.join(map(str, shape))}")
    return name, values.astype(_MX_DTYPES[mx_class]).reshape(shape, order="F")


def _inflate(data: memoryview, location: str) -> bytes:
    """The zlib stream ``data`` inflated, at most ``_util.MAX_MEMBER_BYTES`` of it (DataError
    beyond, before more is produced, and for a corrupt or truncated stream)."""
    inflater = zlib.decompressobj()
    try:
        inner = inflater.decompress(data, _util.MAX_MEMBER_BYTES + 1)
    except zlib.error as exc:
        raise DataError(f"{location}: corrupt compressed MAT element ({reason(exc)})") from exc
    if len(inner) > _util.MAX_MEMBER_BYTES:
        raise DataError(f"{location}: a compressed MAT element inflating to more than "
                        f"{_util.MAX_MEMBER_BYTES:,} bytes, the most lofast reads from one")
    if not inflater.eof:
        raise DataError(f"{location}: corrupt compressed MAT element (incomplete or truncated "
                        "stream)")
    return inner


def read_mat_arrays(path: Path, names: set[str]) -> dict[str, np.ndarray]:
    """The numeric variables of MAT-file `path` whose names are in `names`.

    Arrays keep MATLAB's dimensions (at least 2) and class (uint8 stays uint8, double is float64).
    Variables not asked for are skipped; names not found are simply absent from the result.
    Raises DataError for anything but a readable level-5 MAT-file.
    """
    try:
        raw = memoryview(path.read_bytes())
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({reason(exc)})") from exc
    # The header ends with a 2-byte version and the characters "MI" written as a 16-bit
    # integer, which read back as "IM" on a little-endian file.
    header = bytes(raw[:_HEADER_SIZE])
    endian = {b"IM": "<", b"MI": ">"}.get(header[126:128]) if len(header) == _HEADER_SIZE else None
    if endian is None:
        raise DataError(f"{path}: not a MATLAB 5 MAT-file")
    version = int.from_bytes(header[124:126], "little" if endian == "<" else "big")
    if version == _VERSION_HDF5:
        raise DataError(f"{path}: MATLAB 7.3 (HDF5) MAT-files are not supported; "
                        "save with -v7 or scipy.io.savemat")
    if version != _VERSION_5:
        raise DataError(f"{path}: unsupported MAT-file version 0x{version:04x}")

    found: dict[str, np.ndarray] = {}
    top = _Elements(raw[_HEADER_SIZE:], endian, str(path), padded=False)
    while top.pos < len(top.buf):
        mtype, data = top.next()
        if mtype == MI_COMPRESSED:
            # The deflated stream holds exactly one element, normally a miMATRIX.
            inner = memoryview(_inflate(data, str(path)))
            mtype, data = _Elements(inner, endian, str(path)).next()
        if mtype == MI_MATRIX and len(data):  # a zero-length matrix is an empty placeholder
            name, array = _read_matrix(data, endian, str(path), names)
            if array is not None:
                found[name] = array
    return found
