"""Image folders: <root>/<split>/<class>/<image>.jpg|.jpeg|.png, as a directory or a tar archive.

Classes are the class folder names of all splits together, sorted alphabetically, so that a
class name has the same label in every split even if one split lacks it. Within a class, files
are sorted by name. Hidden files (a leading ".", as in macOS "._x.jpg" files) and files of
other types are ignored. Inside an archive the root may be the archive's top or one folder below
it (e.g. cifar10-jpeg/train/cat/0001.jpg).
"""

from __future__ import annotations

import io
import os
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image

from lofast.data._util import ARCHIVE_ERRORS, open_tar_stream, reason
from lofast.data.dataset import SPLITS, ImageDataset
from lofast.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_FORMATS = ("JPEG", "PNG")  # the only decoders PIL may try: faster, and nothing unexpected


def is_image_name(name: str) -> bool:
    """Whether a file name is a (non-hidden) image this reader decodes."""
    return not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES)


def decode_image(data: bytes, location: str, size: tuple[int, int] | None = None) -> np.ndarray:
    """Decode a JPEG or PNG into (H, W, 3) uint8 RGB; DataError naming `location` if corrupt,
    or, given `size` (H, W), if the header says another size (before any pixel is decoded).

    A 16-bit grey PNG (PIL's modes "I;16" and "I") is scaled to 8 bits: PIL's own conversion
    to RGB clips every value above 255, which turns almost the whole image white."""
    try:
        with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            if size is not None and (image.height, image.width) != size:
                raise DataError(f"{location}: image is {image.height}x{image.width}, expected "
                                f"{size[0]}x{size[1]}")
            if image.mode.startswith("I"):
                grey = np.asarray(image).astype(np.float64)
                if grey.min() < 0 or grey.max() > 65535:
                    raise DataError(f"{location}: grey values outside 0 .. 65535")
                eight_bit = np.rint(grey / 257).astype(np.uint8)
                return np.repeat(eight_bit[..., None], 3, axis=2)
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            return np.asarray(rgb)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # OSError includes UnidentifiedImageError and truncated data; the others are what PIL's
        # plugins raise on malformed headers.
        raise DataError(f"{location}: cannot decode image ({reason(exc)})") from exc


class _Collector:
    """Gathers decoded images of one split, checks they share one size (``size`` (H, W) if
    given, else the first image's), then sorts them."""

    def __init__(self, size: tuple[int, int] | None = None) -> None:
        self.items: list[tuple[str, str, np.ndarray]] = []  # (class, file name, image)
        self.size = size

    def decode(self, class_name: str, file_name: str, data: bytes, location: str) -> None:
        """Decode one image file and add it; an image of another size is refused from its
        header (``decode_image``): a folder of large images meant for another model fails at
        its first file."""
        image = decode_image(data, location, self.size)
        if self.size is None:
            self.size = image.shape[:2]
        self.items.append((class_name, file_name, image))

    def dataset(self, classes: set[str], where: str) -> ImageDataset:
        if not self.items:
            raise DataError(f"{where}: no .jpg, .jpeg or .png images")
        ordered = tuple(sorted(classes))
        index = {name: i for i, name in enumerate(ordered)}
        self.items.sort(key=lambda item: (index[item[0]], item[1]))
        images = np.stack([item[2] for item in self.items])
        labels = np.array([index[item[0]] for item in self.items], dtype=np.int64)
        return ImageDataset(images, labels, ordered, "folder")


def find_folder_root(directory: Path) -> Path | None:
    """The image-folder root at or one level below `directory`: the folder that has a train/
    or test/ subfolder. None if there is none, or several one level below."""
    def has_split(folder: Path) -> bool:
        return any((folder / split).is_dir() for split in SPLITS)

    if has_split(directory):
        return directory
    nested = [d for d in directory.iterdir() if d.is_dir() and has_split(d)]
    return nested[0] if len(nested) == 1 else None


def read_folder_dir(root: Path, split: str, size: tuple[int, int] | None = None) -> ImageDataset:
    """Read `split` of the image folder at `root` (which holds train/ and/or test/), every
    image of `size` (H, W) if given, else of the first one's."""
    split_dir = root / split
    if not split_dir.is_dir():
        raise DataError(f"{root}: no '{split}' folder")
    try:
        classes = {d.name for s in SPLITS if (root / s).is_dir()
                   for d in (root / s).iterdir() if d.is_dir() and not d.name.startswith(".")}
        collector = _Collector(size)
        for class_name in sorted(classes):
            class_dir = split_dir / class_name
            if not class_dir.is_dir():
                continue
            for name in sorted(os.listdir(class_dir)):
                path = class_dir / name
                if is_image_name(name) and path.is_file():
                    collector.decode(class_name, name, path.read_bytes(), str(path))
    except OSError as exc:
        raise DataError(f"{getattr(exc, 'filename', None) or split_dir}: "
                        f"cannot read ({reason(exc)})") from exc
    return collector.dataset(classes, str(split_dir))


def _split_member(name: str, is_dir: bool) -> tuple[str, str, str, str] | None:
    """(root prefix, split, class, file) of an archive member <root>/<split>/<class>/<file>,
    where <root> is "" or one folder; file is "" for the class folder itself. None for any
    other member."""
    parts = [p for p in PurePosixPath(name).parts if p not in (".", "/")]
    if is_dir:
        parts.append("")
    if len(parts) == 3 and parts[0] in SPLITS:
        return ("", *parts)
    if len(parts) == 4 and parts[1] in SPLITS:
        return tuple(parts)
    return None


def read_folder_tar(archive: Path, split: str, size: tuple[int, int] | None = None
                    ) -> ImageDataset:
    """Read `split` of an image folder straight from a tar or tar.gz: one pass, decoding only
    the images of `split` (of `size` (H, W) if given, else of the first one's)."""
    classes: set[str] = set()
    roots: set[str] = set()
    collector = _Collector(size)
    try:
        with open_tar_stream(archive) as tar:
            for member in tar:
                parsed = _split_member(member.name, member.isdir())
                if parsed is None:
                    continue
                root, member_split, class_name, file_name = parsed
                is_image = member.isfile() and is_image_name(file_name)
                # A class folder counts even when empty, as it does in a directory.
                if class_name.startswith(".") or not (member.isdir() or is_image):
                    continue
                classes.add(class_name)
                roots.add(root)
                if is_image and member_split == split:
                    collector.decode(class_name, file_name, tar.extractfile(member).read(),
                                     f"{archive}:{member.name}")
    except ARCHIVE_ERRORS as exc:
        raise DataError(f"{archive}: corrupt or truncated archive ({reason(exc)})") from exc
    if len(roots) > 1:
        raise DataError(f"{archive}: holds several image-folder roots "
                        f"({', '.join(sorted(r or '.' for r in roots))})")
    return collector.dataset(classes, f"{archive}:{split}/")
