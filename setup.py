"""Copies the shipped checkpoints (the repository's checkpoints/, their one source) into the
built package, so that a wheel or a non-editable install finds the shipped models: exactly the
models of checkpoints/registry.json, each checked against its registered SHA-256 (an untracked
or replaced file in checkpoints/ is never shipped), with the registry (figures and
regression reference included) and the model card."""

import hashlib
import json
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DOCUMENTS = ("registry.json", "README.md")


def shipped_files(source: Path) -> list[Path]:
    """The files to ship from ``source`` (checkpoints/): the documents and every registered
    model, whose bytes must match the registry."""
    registry = json.loads((source / "registry.json").read_text(encoding="utf-8"))
    files = [source / name for name in DOCUMENTS]
    for name, entry in sorted(registry["models"].items()):
        path = source / entry["file"]
        if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
            raise SystemExit(f"{path} is not the registered {name} (SHA-256 differs)")
        files.append(path)
    return files


class BuildPyWithCheckpoints(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).resolve().parent / "checkpoints"
        target = Path(self.build_lib) / "lofast" / "checkpoints"
        target.mkdir(parents=True, exist_ok=True)
        for path in shipped_files(source):
            shutil.copy2(path, target / path.name)


setup(cmdclass={"build_py": BuildPyWithCheckpoints})
