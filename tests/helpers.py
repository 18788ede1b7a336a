"""Models and data shared by several test modules (imported by name: pytest puts tests/ on
sys.path)."""

import copy
import dataclasses
import functools

import numpy as np
import torch
from PIL import Image

from lofast.config import preset
from lofast.models.vit import create_model


def synthetic_images(n, generator):
    """Four classes told apart by colour and a stripe: learnable in seconds, with real margins."""
    labels = torch.randint(0, 4, (n,), generator=generator)
    base = torch.rand(n, 3, 32, 32, generator=generator) * 0.3 + 0.35
    colour = torch.eye(3)[labels % 3] * 0.3
    images = base + colour[:, :, None, None] * (labels[:, None, None, None] < 3)
    images[labels == 3, :, 12:20, :] += 0.3
    return images.clamp(0, 1), labels


def train_tiny(**options):
    """The tiny preset (patch 16, 5 tokens) trained for 100 steps on the synthetic images: a
    fresh copy of the model (and test images), trained once per process and options."""
    model, test_x, test_y = _trained_tiny(tuple(sorted(options.items())))
    return copy.deepcopy(model), test_x.clone(), test_y.clone()


@functools.cache
def _trained_tiny(options):
    options = dict(options)
    torch.manual_seed(0)
    config = dataclasses.replace(preset("tiny"), patch_size=16, num_classes=4, **options)
    model = create_model(config, seed=0)
    if config.position_bias:  # a strongly non-uniform reference attention from the start
        with torch.no_grad():
            for stage in model.stages:
                if getattr(stage, "position_bias", None) is not None:
                    stage.position_bias.normal_(0.0, 2.0)
    g = torch.Generator().manual_seed(0)
    x, y = synthetic_images(512, g)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        idx = torch.randint(0, len(x), (128,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]) * 4, y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    test_x, test_y = synthetic_images(64, torch.Generator().manual_seed(1))
    return model, test_x, test_y


def write_image_folder(root, per_class, seed):
    rng = np.random.default_rng(seed)
    colours = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]])
    for split, count in (("train", per_class), ("test", per_class // 2)):
        for c, colour in enumerate(colours):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                noise = rng.integers(-40, 40, (32, 32, 3))
                pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")


def record_lines(path):
    """The decoded record lines of a `lofast certify --out` file, without its header line, its
    sessions' lines and the marks of finished runs."""
    import json
    from pathlib import Path

    lines = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if "index" in line]


def assert_one_clear_error(result, *needles):
    """A CLI result that failed with one readable error line naming every needle: a non-zero
    exit, no traceback."""
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    # ours print "error: ...", click's own option checks "Error: ..." after a usage line
    assert sum("error:" in line.lower() for line in result.output.splitlines()) == 1, \
        result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert len(result.output) < 2000, result.output[:300]  # a line a person can read
