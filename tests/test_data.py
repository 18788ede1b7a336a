"""Data readers: tiny fixtures written in the real formats, round trips, cache, download, errors."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import os
import pickle
import struct
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lofast.data import CIFAR10_MD5, ImageDataset, download_cifar10, imagefolder, load_dataset
from lofast.errors import DataError

CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck")
SHARED_ARCHIVE = Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg.tar.gz"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test caches into its own folder, never into ~/.cache."""
    monkeypatch.setenv("LOFAST_CACHE_DIR", str(tmp_path / "cache"))


def _message(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------
# Fixture writers


class _Py2Pickler(pickle._Pickler):
    """Writes str and bytes as Python 2 `str` (BINSTRING), exactly as the official CIFAR-10
    batches were written by cPickle; Python 3's protocol 2 would use _codecs.encode instead."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj):
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<I", len(raw)) + raw)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str
    dispatch[str] = _save_py2_str


def _pickle(obj, py2: bool = False) -> bytes:
    if not py2:
        return pickle.dumps(obj, protocol=2)
    out = io.BytesIO()
    _Py2Pickler(out, protocol=2).dump(obj)
    # numpy 1 (and the official files) name the module numpy.core.multiarray.
    return out.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def _random_split(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    return images, rng.integers(0, 10, n).astype(np.int64)


def _batch(images: np.ndarray, labels: np.ndarray, name: str) -> dict:
    return {
        b"batch_label": name.encode(),
        b"labels": [int(v) for v in labels],
        b"data": images.transpose(0, 3, 1, 2).reshape(len(images), 3072),  # channel-major rows
        b"filenames": [f"img_{i}.png".encode() for i in range(len(images))],
    }


@pytest.fixture
def cifar(tmp_path):
    """An official-format cifar-10-batches-py folder: 5 train batches of 3 images, a test batch
    of 4. Returns (folder, {split: (images, labels)}), images as (N, 32, 32, 3)."""
    return _write_cifar(tmp_path / "cifar", py2=False)


def _write_cifar(root: Path, py2: bool) -> tuple[Path, dict]:
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train = [_random_split(rng, 3) for _ in range(5)]
    for i, (images, labels) in enumerate(train, start=1):
        (folder / f"data_batch_{i}").write_bytes(_pickle(_batch(images, labels, f"b{i}"), py2))
    test = _random_split(rng, 4)
    (folder / "test_batch").write_bytes(_pickle(_batch(*test, "test"), py2))
    meta = {b"label_names": [c.encode() for c in CIFAR_CLASSES], b"num_vis": 3072}
    (folder / "batches.meta").write_bytes(_pickle(meta, py2))
    expected = {
        "train": (np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train])),
        "test": test,
    }
    return folder, expected


def _tar(source: Path, archive: Path, arcname: str | None = None) -> Path:
    mode = "w:gz" if archive.name.endswith(("gz", "tgz")) else "w"
    with tarfile.open(archive, mode) as tar:
        tar.add(source, arcname=arcname if arcname is not None else source.name)
    return archive


def _write_folder(root: Path, images: dict[str, dict[str, np.ndarray]], fmt: str = "PNG"):
    """Write {"<split>/<class>": {file stem: (H, W, 3) array}} under `root`."""
    for where, files in images.items():
        folder = root / where
        folder.mkdir(parents=True, exist_ok=True)
        for stem, array in files.items():
            Image.fromarray(array).save(folder / f"{stem}.{fmt.lower()}", fmt)


@pytest.fixture
def folder(tmp_path):
    """An image folder whose classes and files are created out of order, with a grayscale PNG,
    a hidden file and a non-image. Returns (root, expected test images, expected labels)."""
    rng = np.random.default_rng(1)
    img = {k: rng.integers(0, 256, (6, 5, 3), dtype=np.uint8) for k in "abcde"}
    gray = rng.integers(0, 256, (6, 5), dtype=np.uint8)
    root = tmp_path / "imgs"
    _write_folder(root, {"test/zebra": {"b": img["a"], "a": img["b"]},
                         "test/ant": {"c": img["c"]},
                         "train/ant": {"x": img["d"]},
                         "train/mole": {"y": img["e"]}})  # a class only train has
    Image.fromarray(gray).save(root / "test/ant/d.png")
    (root / "test/ant/.hidden.png").write_bytes(b"not an image")
    (root / "test/ant/notes.txt").write_text("ignored")
    expected = np.stack([img["c"], np.repeat(gray[:, :, None], 3, axis=2), img["b"], img["a"]])
    # classes: ant, mole, zebra; test has ant (c, d) then zebra (a.png, b.png)
    return root, expected, np.array([0, 0, 2, 2])


def test_a_sixteen_bit_grey_png_keeps_its_tones():
    """PIL's RGB conversion clips 16-bit grey values above 255 (nearly all of them); the
    reader scales them to 8 bits instead, as an 8-bit export of the same image would."""
    grey = np.linspace(0, 65535, 6 * 5).reshape(6, 5).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(grey).save(buffer, "PNG")
    decoded = imagefolder.decode_image(buffer.getvalue(), "grey16.png")
    assert decoded.shape == (6, 5, 3) and decoded.dtype == np.uint8
    expected = np.rint(grey / 257).astype(np.uint8)
    for channel in range(3):
        np.testing.assert_array_equal(decoded[..., channel], expected)


# ---------------------------------------------------------------------------------------------
# ImageDataset


def _toy(labels) -> ImageDataset:
    n = len(labels)
    images = np.arange(n * 2 * 2 * 3, dtype=np.uint8).reshape(n, 2, 2, 3)
    return ImageDataset(images, np.asarray(labels, dtype=np.int64), ("a", "b", "c"), "toy")


def test_subset_accepts_slices_lists_arrays_and_masks():
    ds = _toy([0, 1, 2, 0, 1])
    assert ds.subset(slice(1, 3)).labels.tolist() == [1, 2]
    assert ds.subset([4, 0]).labels.tolist() == [1, 0]
    assert np.array_equal(ds.subset(np.array([4, 0])).images, ds.images[[4, 0]])
    assert ds.subset(ds.labels == 0).labels.tolist() == [0, 0]
    assert len(ds.subset([])) == 0
    sub = ds.subset(slice(None, None, -1))
    assert (sub.classes, sub.name) == (ds.classes, ds.name)
    x, _ = sub.to_tensors()  # negative strides must not reach torch.from_numpy
    assert torch.equal(x[0], ds.subset([4]).to_tensors()[0][0])


def test_first_per_class_orders_by_class_then_position():
    ds = _toy([2, 0, 1, 0, 2, 0, 1])
    picked = ds.first_per_class(2)
    assert picked.labels.tolist() == [0, 0, 1, 1, 2, 2]
    assert np.array_equal(picked.images, ds.images[[1, 3, 2, 6, 0, 4]])
    assert ds.first_per_class(3).labels.tolist() == [0, 0, 0, 1, 1, 2, 2]  # short classes: all
    assert len(ds.first_per_class(0)) == 0


def test_to_tensors_layout_dtype_and_range():
    ds = _toy([0, 1])
    x, y = ds.to_tensors()
    assert x.shape == (2, 3, 2, 2) and x.dtype == torch.float32 and x.is_contiguous()
    assert y.dtype == torch.int64 and y.tolist() == [0, 1]
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert x[1, 2, 1, 0].item() == pytest.approx(ds.images[1, 1, 0, 2] / 255.0)
    y[0] = 2
    assert ds.labels[0] == 0  # the tensors do not alias the data set


# ---------------------------------------------------------------------------------------------
# CIFAR-10 python format


@pytest.mark.parametrize("py2", [False, True], ids=["py3-protocol2", "py2-cpickle"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_cifar_batches_round_trip(tmp_path, py2, split):
    folder, expected = _write_cifar(tmp_path / "c", py2)
    for path in (folder, folder.parent):  # the batches folder, or a folder containing it
        ds = load_dataset(path, split)
        assert (ds.name, ds.classes) == ("cifar10", CIFAR_CLASSES)
        assert ds.images.dtype == np.uint8 and ds.labels.dtype == np.int64
        assert np.array_equal(ds.images, expected[split][0])
        assert np.array_equal(ds.labels, expected[split][1])


def test_cifar_archive_read_without_extracting(cifar, tmp_path):
    folder, expected = cifar
    (tmp_path / "dl").mkdir()
    archive = _tar(folder, tmp_path / "dl" / "cifar-10-python.tar.gz")
    for path in (archive, archive.parent):
        ds = load_dataset(path, "train", "cifar10")
        assert np.array_equal(ds.images, expected["train"][0])
        assert np.array_equal(ds.labels, expected["train"][1])
    assert sorted(p.name for p in archive.parent.iterdir()) == ["cifar-10-python.tar.gz"]


class _Evil:
    """Unpickling this runs `func(arg)`: what a malicious batch would do."""

    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


@pytest.mark.parametrize("payload", ["system", "exec", "nested"])
def test_malicious_pickle_is_refused_without_running(cifar, tmp_path, payload):
    folder, _ = cifar
    marker = tmp_path / "pwned"
    evil = {
        "system": _Evil(os.system, f"touch {marker}"),
        "exec": _Evil(exec, f"open({str(marker)!r}, 'w').close()"),
        # hidden inside an otherwise valid batch
        "nested": {b"data": np.zeros((1, 3072), np.uint8),
                   b"labels": [_Evil(os.system, f"touch {marker}")]},
    }[payload]
    (folder / "test_batch").write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(DataError) as excinfo:
        load_dataset(folder, "test")
    assert "test_batch" in _message(excinfo) and "refusing" in _message(excinfo)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("batch", "fragment"),
    [
        ({b"labels": [0]}, "needs keys"),
        ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, "shape"),
        ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "uint8"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "1 labels for 2 images"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "labels must lie"),
        ({b"data": np.zeros((1, 3072), np.uint8), b"labels": ["cat"]}, "not integers"),
        ([1, 2, 3], "expected a pickled dict"),
    ],
    ids=["no-data", "wrong-width", "wrong-dtype", "label-count", "label-range", "label-type",
         "not-dict"],
)
def test_bad_cifar_batch(cifar, batch, fragment):
    folder, _ = cifar
    (folder / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=fragment) as excinfo:
        load_dataset(folder, "test")
    assert str(folder / "test_batch") in _message(excinfo)


def test_truncated_pickle_and_missing_batch(cifar):
    folder, _ = cifar
    data = (folder / "data_batch_2").read_bytes()
    (folder / "data_batch_2").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="corrupt pickle") as excinfo:
        load_dataset(folder, "train")
    assert "data_batch_2" in _message(excinfo)
    (folder / "test_batch").unlink()
    with pytest.raises(DataError, match="missing CIFAR-10 file.*test_batch"):
        load_dataset(folder, "test")


def test_cifar_meta_must_name_ten_classes(cifar):
    folder, _ = cifar
    meta = folder / "batches.meta"
    meta.write_bytes(pickle.dumps({b"label_names": [b"a", b"b"]}, 2))
    with pytest.raises(DataError, match="labels must lie in"):  # the labels go up to 9
        load_dataset(folder, "test")
    meta.write_bytes(pickle.dumps({b"label_names": [b"c%d" % i for i in range(11)]}, 2))
    with pytest.raises(DataError, match="needs 10 classes, found 11") as excinfo:
        load_dataset(folder, "test")
    assert str(folder) in _message(excinfo)
    meta.write_bytes(pickle.dumps({b"names": []}, 2))
    with pytest.raises(DataError, match="no 'label_names'") as excinfo:
        load_dataset(folder, "test")
    assert str(meta) in _message(excinfo)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 download from a local server


@pytest.fixture
def server(tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 serving tmp_path/www; yields (www folder, base URL, hits)."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    www = tmp_path / "www"
    www.mkdir()
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            hits.append(self.path)

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{httpd.server_address[1]}", hits
    httpd.shutdown()
    httpd.server_close()


def test_download_good_checksum_then_reuse(cifar, server, tmp_path, monkeypatch):
    folder, expected = cifar
    www, base, hits = server
    archive = _tar(folder, www / "fake.tar.gz")
    monkeypatch.setenv("LOFAST_CIFAR10_URL", f"{base}/fake.tar.gz")
    monkeypatch.setenv("LOFAST_CIFAR10_MD5", hashlib.md5(archive.read_bytes()).hexdigest())
    target = tmp_path / "new" / "data"
    ds = load_dataset(target, "test", "cifar10", download=True)
    assert np.array_equal(ds.images, expected["test"][0])
    assert sorted(p.name for p in target.iterdir()) == ["cifar-10-python.tar.gz"]
    load_dataset(target, "train", download=True)  # already there: no second download
    assert len(hits) == 1


@pytest.mark.parametrize("problem", ["checksum", "missing"])
def test_download_failure_leaves_nothing(cifar, server, tmp_path, problem):
    folder, _ = cifar
    www, base, _ = server
    _tar(folder, www / "fake.tar.gz")
    url = f"{base}/fake.tar.gz" if problem == "checksum" else f"{base}/absent.tar.gz"
    target = tmp_path / "dl"
    with pytest.raises(DataError, match="checksum mismatch" if problem == "checksum" else "404"):
        download_cifar10(target, url=url, md5=CIFAR10_MD5, timeout=10)
    assert list(target.iterdir()) == []


def test_download_only_for_cifar(tmp_path):
    with pytest.raises(DataError, match="only fetches CIFAR-10"):
        load_dataset(tmp_path, "test", "svhn", download=True)


# ---------------------------------------------------------------------------------------------
# SVHN .mat


@pytest.fixture
def svhn_arrays():
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (7, 32, 32, 3), dtype=np.uint8)
    digits = np.array([0, 1, 2, 9, 0, 5, 3])
    X = np.ascontiguousarray(images.transpose(1, 2, 3, 0))  # (32, 32, 3, N) as SVHN stores it
    y = np.where(digits == 0, 10, digits).astype(np.float64).reshape(-1, 1)
    return X, y, images, digits


def _savemat(path: Path, compress: bool = False, **arrays) -> Path:
    scipy_io = pytest.importorskip("scipy.io")
    scipy_io.savemat(path, arrays, do_compression=compress)
    return path


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "compressed"])
@pytest.mark.parametrize("x_dtype", [np.uint8, np.float64])
def test_svhn_round_trip(tmp_path, svhn_arrays, compress, x_dtype):
    X, y, images, digits = svhn_arrays
    _savemat(tmp_path / "test_32x32.mat", compress, X=X.astype(x_dtype), y=y,
             extra=np.ones((2, 3)))  # another variable, skipped
    for path in (tmp_path, tmp_path / "test_32x32.mat"):
        ds = load_dataset(path, "test")
        assert (ds.name, ds.classes) == ("svhn", tuple("0123456789"))
        assert np.array_equal(ds.images, images)
        assert ds.labels.tolist() == digits.tolist()


@pytest.mark.parametrize(
    ("arrays", "fragment"),
    [
        ({"X": "X"}, "no variable y"),
        ({"X": "X", "y": "short"}, "one label per image"),
        ({"X": "flat", "y": "y"}, "must have shape"),
        ({"X": "X", "y": "big"}, "labels must be integers in 1..10"),
        ({"X": "X", "y": "cell"}, "cell array"),
    ],
    ids=["no-y", "count-mismatch", "X-shape", "label-range", "y-cell"],
)
def test_bad_svhn_file(tmp_path, svhn_arrays, arrays, fragment):
    X, y, _, _ = svhn_arrays
    values = {"X": X, "y": y, "short": y[:-1], "flat": X.reshape(32, -1),
              "big": y + 1, "cell": np.array([[1], [2]], dtype=object)}
    path = _savemat(tmp_path / "test_32x32.mat", **{k: values[v] for k, v in arrays.items()})
    with pytest.raises(DataError, match=fragment) as excinfo:
        load_dataset(path, "test", "svhn")
    assert str(path) in _message(excinfo)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "bad-zlib"])
def test_damaged_mat_file(tmp_path, svhn_arrays, damage):
    X, y, _, _ = svhn_arrays
    path = _savemat(tmp_path / "train_32x32.mat", damage == "bad-zlib", X=X, y=y)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) - 1000],
                      "garbage": b"\x00" * 300,
                      "bad-zlib": data[:140] + b"\xff" * 64 + data[204:]}[damage])
    with pytest.raises(DataError) as excinfo:
        load_dataset(path, "train")
    assert str(path) in _message(excinfo)


def test_a_compressed_mat_element_is_inflated_within_the_limit_and_whole(tmp_path, svhn_arrays,
                                                                        monkeypatch):
    # zeros deflate about 1000:1: an element is inflated only up to MAX_MEMBER_BYTES (the
    # limit lowered here below the test arrays' 21 kB), and a stream cut short stays refused
    X, y, _, _ = svhn_arrays
    path = _savemat(tmp_path / "test_32x32.mat", True, X=X, y=y)
    monkeypatch.setattr("lofast.data._util.MAX_MEMBER_BYTES", 4096)
    with pytest.raises(DataError, match="inflating to more than 4,096 bytes") as excinfo:
        load_dataset(path, "test")
    assert str(path) in _message(excinfo)
    monkeypatch.undo()
    assert len(load_dataset(path, "test")) == 7
    data = bytearray(path.read_bytes())
    mtype, size = struct.unpack_from("<II", data, 128)  # the first element's tag
    assert mtype == 15  # miCOMPRESSED
    struct.pack_into("<II", data, 128, 15, size // 2)  # the stream's first half alone
    path.write_bytes(bytes(data[: 136 + size // 2]))
    with pytest.raises(DataError, match="incomplete or truncated stream"):
        load_dataset(path, "test")


def test_svhn_split_must_match(tmp_path, svhn_arrays):
    X, y, _, _ = svhn_arrays
    path = _savemat(tmp_path / "train_32x32.mat", X=X, y=y)
    with pytest.raises(DataError, match="'train' split"):
        load_dataset(path, "test")
    with pytest.raises(DataError, match="no test_32x32.mat"):
        load_dataset(tmp_path, "test", "svhn")


# ---------------------------------------------------------------------------------------------
# Image folders


def test_image_folder_png_exact_as_dir_and_archives(folder, tmp_path):
    root, images, labels = folder
    sources = [
        root,
        tmp_path,  # the root one folder down
        _tar(root, tmp_path / "nested.tar.gz"),  # imgs/test/... inside
        _tar(root, tmp_path / "flat.tar", arcname="."),  # ./test/... inside
        _tar(root, tmp_path / "flat.tgz", arcname=""),  # test/... inside
    ]
    for source in sources:
        ds = load_dataset(source, "test")
        assert (ds.name, ds.classes) == ("folder", ("ant", "mole", "zebra")), source
        assert np.array_equal(ds.images, images), source
        assert np.array_equal(ds.labels, labels), source
    train = load_dataset(sources[2], "train", "folder")
    assert train.classes == ("ant", "mole", "zebra") and train.labels.tolist() == [0, 1]


def test_image_folder_jpeg_approximate(tmp_path):
    smooth = np.broadcast_to(np.linspace(0, 255, 16, dtype=np.uint8)[:, None, None],
                             (16, 16, 3)).copy()
    _write_folder(tmp_path / "j", {"test/grad": {"0": smooth}}, fmt="JPEG")
    (tmp_path / "j/test/grad/0.jpeg").rename(tmp_path / "j/test/grad/1.JPG")  # suffix case
    ds = load_dataset(tmp_path / "j", "test", "folder")
    assert ds.images.shape == (1, 16, 16, 3)
    assert np.abs(ds.images[0].astype(int) - smooth).mean() < 4


def test_image_folder_as_cifar10(tmp_path):
    rng = np.random.default_rng(3)
    layout = {f"test/{c}": {"0": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)}
              for c in CIFAR_CLASSES}
    _write_folder(tmp_path / "ok", layout)
    ds = load_dataset(tmp_path / "ok", "test", "cifar10")
    assert (ds.name, ds.classes, len(ds)) == ("cifar10", CIFAR_CLASSES, 10)

    _write_folder(tmp_path / "few", {"test/cat": layout["test/cat"]})
    with pytest.raises(DataError, match="needs 10 classes"):
        load_dataset(tmp_path / "few", "test", "cifar10")
    _write_folder(tmp_path / "big", {f"test/{c}": {"0": np.zeros((8, 8, 3), np.uint8)}
                                     for c in CIFAR_CLASSES})
    with pytest.raises(DataError, match="32x32"):
        load_dataset(tmp_path / "big", "test", "cifar10")


@pytest.mark.parametrize("packed", [False, True], ids=["folder", "tar"])
def test_a_folder_of_large_images_is_refused_as_cifar10_at_its_first_header(tmp_path,
                                                                           monkeypatch, packed):
    # images of another size fail at the first file, from its header, with no pixel decoded
    # (a folder of 224x224 images used to be decoded whole before the 32x32 check)
    _write_folder(tmp_path / "big", {f"test/{c}": {str(i): np.zeros((48, 40, 3), np.uint8)
                                                   for i in range(3)} for c in CIFAR_CLASSES})
    path = _tar(tmp_path / "big", tmp_path / "big.tar") if packed else tmp_path / "big"
    loads = []
    original = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda image: loads.append(1) or original(image))
    with pytest.raises(DataError, match="image is 48x40, expected 32x32") as excinfo:
        load_dataset(path, "test", "cifar10")
    first = f"{path}:big/test/{CIFAR_CLASSES[0]}/0.png" if packed else str(
        path / "test" / CIFAR_CLASSES[0] / "0.png")
    assert first in _message(excinfo)
    assert loads == []


def test_image_folder_size_mismatch_names_file(tmp_path):
    _write_folder(tmp_path / "m", {"test/a": {"0": np.zeros((4, 4, 3), np.uint8)},
                                   "test/b": {"0": np.zeros((5, 4, 3), np.uint8)}})
    with pytest.raises(DataError, match="5x4, expected 4x4") as excinfo:
        load_dataset(tmp_path / "m", "test")
    assert str(tmp_path / "m/test/b/0.png") in _message(excinfo)


def test_corrupt_jpeg_names_file(folder, tmp_path):
    root, _, _ = folder
    jpeg = io.BytesIO()
    Image.fromarray(np.zeros((6, 5, 3), np.uint8)).save(jpeg, "JPEG")
    (root / "test/zebra/c.jpg").write_bytes(jpeg.getvalue()[:40])
    with pytest.raises(DataError, match="cannot decode image") as excinfo:
        load_dataset(root, "test")
    assert str(root / "test/zebra/c.jpg") in _message(excinfo)
    archive = _tar(root, tmp_path / "bad.tar.gz")
    with pytest.raises(DataError, match="cannot decode image") as excinfo:
        load_dataset(archive, "test")
    assert f"{archive}:imgs/test/zebra/c.jpg" in _message(excinfo)


@pytest.mark.parametrize("damage", ["truncated", "bad-gzip", "bad-deflate"])
def test_damaged_archive(folder, tmp_path, damage):
    root, _, _ = folder
    data = _tar(root, tmp_path / "a.tar.gz").read_bytes()
    damaged = {"truncated": data[: len(data) // 2],
               "bad-gzip": b"\x1f\x8b" + b"\x00" * 100,
               "bad-deflate": data[:20] + b"\xff" * 200 + data[220:]}[damage]
    path = tmp_path / "damaged.tar.gz"
    path.write_bytes(damaged)
    with pytest.raises(DataError, match="corrupt or truncated archive") as excinfo:
        load_dataset(path, "test")
    assert str(path) in _message(excinfo)


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_archive_cut_anywhere_is_refused(folder, tmp_path, suffix):
    # tarfile alone reads an archive cut at (or inside) a header block as a smaller valid one,
    # and its gzip reader ignores a missing trailer: cut at every block boundary and at points
    # between them, none may load
    root, expected, _ = folder
    data = _tar(root, tmp_path / f"a{suffix}").read_bytes()
    assert np.array_equal(load_dataset(tmp_path / f"a{suffix}", "test").images, expected)
    if suffix == ".tar":  # up to the first zero block after the last member (the rest pads)
        with tarfile.open(tmp_path / "a.tar") as tar:
            last = tar.getmembers()[-1]
        end = last.offset_data + -(-last.size // 512) * 512
        cuts = sorted(set(range(512, end + 512, 512)) | {end + 100, end + 511, 700})
    else:  # anywhere: the gzip trailer counts too
        cuts = sorted(set(range(97, len(data), 97)) | {len(data) - 1, len(data) - 8})
    assert len(cuts) > 10
    for cut in cuts:
        path = tmp_path / f"cut{suffix}"
        path.write_bytes(data[:cut])
        with pytest.raises(DataError, match="corrupt or truncated archive"):
            load_dataset(path, "test")


@pytest.mark.parametrize("kind", ["cifar", "folder"])
def test_an_archive_member_declaring_more_than_the_limit_is_refused_unread(tmp_path, kind):
    # a tar.gz of a few kB whose member header declares 5 GiB (a gzip bomb would inflate to
    # it): refused by its size before a byte of it is read, naming the member; read as it
    # was, it ended as a truncated archive once 5 GiB had been asked for
    name = "cifar-10-batches-py/test_batch" if kind == "cifar" else "imgs/test/cat/a.png"
    member = tarfile.TarInfo(name)
    member.size = 5 << 30
    path = tmp_path / ("cifar-10-python.tar.gz" if kind == "cifar" else "bomb.tar.gz")
    path.write_bytes(gzip.compress(member.tobuf(tarfile.USTAR_FORMAT) + bytes(4096)))
    with pytest.raises(DataError, match=r"a member of 5,368,709,120 bytes; lofast reads at "
                                        r"most 4,294,967,296") as excinfo:
        load_dataset(path, "test")
    assert f"{path}:{name}" in _message(excinfo)


def test_truncated_cifar_archive(cifar, tmp_path):
    folder, _ = cifar
    data = _tar(folder, tmp_path / "cifar-10-python.tar.gz").read_bytes()
    path = tmp_path / "cut" / "cifar-10-python.tar.gz"
    path.parent.mkdir()
    # a valid gzip of half the tar: detection (first member) succeeds, reading then fails
    raw = gzip.decompress(data)
    path.write_bytes(gzip.compress(raw[: len(raw) // 2]))
    with pytest.raises(DataError, match="corrupt or truncated archive") as excinfo:
        load_dataset(path.parent, "train")
    assert str(path) in _message(excinfo)


def test_missing_empty_and_unknown(tmp_path, folder):
    root, _, _ = folder
    cases = [
        (lambda: load_dataset(tmp_path / "nope", "test"), "does not exist"),
        (lambda: load_dataset(tmp_path / "empty", "test"), "no data found"),
        (lambda: load_dataset(root, "val"), "unknown split 'val'"),
        (lambda: load_dataset(root, "test", "imagenet"), "unknown dataset 'imagenet'"),
        (lambda: load_dataset(root / "test/ant/notes.txt", "test"), "unknown data file"),
        (lambda: load_dataset(root, "test", "svhn"), "no data found"),
    ]
    (tmp_path / "empty").mkdir()
    for call, fragment in cases:
        with pytest.raises(DataError, match=fragment) as excinfo:
            call()
        assert str(tmp_path) in _message(excinfo)
    (root / "train").rename(root / "training")
    with pytest.raises(DataError, match="no 'train' folder"):
        load_dataset(root, "train")
    for image in (root / "test").rglob("*.png"):
        image.unlink()
    with pytest.raises(DataError, match="no .jpg, .jpeg or .png images"):
        load_dataset(root, "test")


def test_archive_without_data(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/readme.txt").write_text("hello")
    archive = _tar(tmp_path / "docs", tmp_path / "docs.tar.gz")
    with pytest.raises(DataError, match="neither CIFAR-10 batches nor"):
        load_dataset(archive, "test")


# ---------------------------------------------------------------------------------------------
# Cache


def _forbid_decoding(monkeypatch):
    def fail(data, location):
        raise AssertionError(f"decoded {location} despite the cache")
    monkeypatch.setattr(imagefolder, "decode_image", fail)


def test_cache_hit_corrupt_rebuild_and_invalidation(folder, tmp_path, monkeypatch):
    root, images, labels = folder
    archive = _tar(root, tmp_path / "data.tar.gz")
    cache = tmp_path / "mycache"
    first = load_dataset(archive, "test", cache_dir=cache)
    (entry,) = cache.glob("*.npz")
    with monkeypatch.context() as patch:
        _forbid_decoding(patch)
        second = load_dataset(archive, "test", cache_dir=cache)
    assert np.array_equal(second.images, first.images)
    assert np.array_equal(second.labels, labels)
    assert (second.classes, second.name) == (first.classes, "folder")

    entry.write_bytes(entry.read_bytes()[:100])  # corrupt: rebuilt, not an error
    assert np.array_equal(load_dataset(archive, "test", cache_dir=cache).images, images)
    with monkeypatch.context() as patch:
        _forbid_decoding(patch)
        load_dataset(archive, "test", cache_dir=cache)  # and the rebuilt entry is good again

    # a changed source is decoded afresh
    _write_folder(root, {"test/zebra": {"e": images[0]}})
    os.utime(_tar(root, archive), ns=(1, 1))
    assert len(load_dataset(archive, "test", cache_dir=cache)) == 5
    assert len(list(cache.glob("*.npz"))) == 1  # one entry per source and split
    assert not list(cache.glob(".*.tmp"))  # no temporary files


def test_cache_default_dir_and_unwritable_dir(folder, tmp_path, monkeypatch):
    root, images, _ = folder
    load_dataset(root, "test")
    assert len(list((tmp_path / "cache").glob("folder-dir-test-*.npz"))) == 1  # $LOFAST_CACHE_DIR
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    ds = load_dataset(root, "test", cache_dir=blocker / "cache")  # cannot be created: no cache
    assert np.array_equal(ds.images, images)


# ---------------------------------------------------------------------------------------------
# The shared CIFAR-10 JPEG copy (only a few members, to stay fast)


@pytest.mark.skipif(not SHARED_ARCHIVE.is_file(), reason="shared CIFAR-10 archive not present")
def test_shared_archive_sample(tmp_path):
    sample = tmp_path / "sample.tar.gz"
    with tarfile.open(SHARED_ARCHIVE, "r|gz") as src, tarfile.open(sample, "w:gz") as dst:
        for count, member in enumerate(src):
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
            if count == 30:
                break
    ds = load_dataset(sample, "test", "folder")
    assert ds.classes[0] == "airplane" and ds.images.shape[1:] == (32, 32, 3)
    assert len(ds) >= 25 and set(ds.labels.tolist()) == {0}
