"""Copies the shipped checkpoints (the repository's checkpoints/, their one source) into the
built package, so that a wheel or a non-editable install finds the default model."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("*.safetensors", "reference.json", "README.md")


class BuildPyWithCheckpoints(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).resolve().parent / "checkpoints"
        target = Path(self.build_lib) / "lofast" / "checkpoints"
        target.mkdir(parents=True, exist_ok=True)
        for pattern in SHIPPED:
            for path in source.glob(pattern):
                shutil.copy2(path, target / path.name)


setup(cmdclass={"build_py": BuildPyWithCheckpoints})
