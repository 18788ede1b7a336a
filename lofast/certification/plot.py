"""The robustness curve of saved runs as a PNG: certified accuracy against eps (matplotlib)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from lofast.certification.records import SampleRecord
from lofast.errors import LofastError
from lofast.files import atomic_write

INSTALL_HINT = 'pip install matplotlib  (or: pip install -e ".[report]")'
FORMATS = (".png", ".pdf", ".svg")  # what --plot writes, by the file's suffix


def check_plot_path(path: Path, inputs: Sequence[Path] = ()) -> None:
    """Refuse, in one line, a plot path with a suffix not in FORMATS, one that names an input
    (a record file would be replaced by the picture), or an existing path that is not a regular
    file (a device such as /dev/full would be replaced by the rename)."""
    if path.exists() and any(Path(i).exists() and os.path.samefile(path, i) for i in inputs):
        raise LofastError(f"--plot {path} is one of the runs to report; choose another file")
    if path.suffix.lower() not in FORMATS:
        raise LofastError(f"--plot {path}: the file name must end in {', '.join(FORMATS)}")
    if path.exists() and not path.is_file():
        raise LofastError(f"--plot {path} exists and is not a regular file")


def certified_curve(records: Sequence[SampleRecord], eps: np.ndarray) -> np.ndarray:
    """Share of samples LoFAST certifies at each eps (E,): correctly classified with a
    certified radius of at least eps (the certified set of a sample is [0, radius])."""
    radii = np.array([r.radius if r.prediction == r.label else -1.0 for r in records])
    return (radii[None, :] >= eps[:, None]).mean(axis=1)


def robustness_plot(runs: Mapping[str, Sequence[SampleRecord]], path: Path,
                    width: int = 800, height: int = 500) -> None:
    """Write a width x height PNG with, per run: the LoFAST curve from the per-sample radii
    (a lower bound on robust accuracy at every eps), the certified share at the run's eps
    values as markers (fallback verifiers included), and, where an attack ran, 1 - the
    falsified share (an upper bound on robust accuracy) as a dashed line."""
    check_plot_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise LofastError(f"plotting needs matplotlib; install it with: {INSTALL_HINT}") from None
    largest = max(max(r.radius for r in records) for records in runs.values())
    top = 1.1 * max(largest, max(e for records in runs.values() for e in records[0].eps), 1e-3)
    grid = np.linspace(0.0, top, 400)
    figure, axes = plt.subplots(figsize=(width / 100, height / 100), dpi=100)
    try:
        for name, records in runs.items():
            line, = axes.plot(grid, 100 * certified_curve(records, grid),
                              label=f"{name}: certified (LoFAST radius)")
            at = sorted(records[0].eps)
            certified = [100 * np.mean([r.results[e].certified for r in records]) for e in at]
            axes.plot(at, certified, "o", color=line.get_color(),
                      label=f"{name}: certified at the run's eps (all verifiers)")
            if any(r.attacked for r in records):
                upper = [100 * (1 - np.mean([bool(r.results[e].falsified) for r in records]))
                         for e in at]
                axes.plot(at, upper, "s--", color=line.get_color(),
                          label=f"{name}: not falsified (upper bound)")
        axes.set_xlabel("l2 radius eps (pixels in [0, 1])")
        axes.set_ylabel("accuracy (%)")
        axes.set_xlim(0, top)
        axes.set_ylim(0, 100)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
        axes.set_title("robustness curve")
        try:  # a whole file or none: written beside it, then renamed into place
            atomic_write(path, lambda tmp: figure.savefig(tmp, dpi=100,
                                                          format=path.suffix.lower()[1:]))
        except OSError as e:
            raise LofastError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(figure)
