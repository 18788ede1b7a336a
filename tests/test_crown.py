"""CROWN fallback: the export computes the model's function, and (alpha-)CROWN certificates are
sound (bounds below every margin reachable in the ball, no certified sample broken by PGD).

Tests that need auto_LiRPA take the `lirpa` fixture and are skipped when it is not installed;
the export and the "not installed" error are checked everywhere.
"""

import sys

import pytest
import torch

from lofast import crown
from lofast import runtime as limits
from lofast.certification.attack import pgd_l2
from lofast.config import preset
from lofast.crown import (
    FallbackResult,
    MarginBounder,
    crown_available,
    crown_verify,
    export_plain,
    margin_spec,
)
from lofast.errors import LofastError
from lofast.models.layers import LayerProject
from lofast.models.vit import create_model


def randomized_model(config, seed=0, dtype=torch.float64):
    """A model whose biases, SLL rescalings, class token and positions are all non-trivial, so
    that every term of every stage matters (fresh models have many zeros)."""
    model = create_model(config, seed=seed).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "log_q", "cls_token", "position")):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def small_model(seed=0, depth=2, position_bias=False):
    """The tiny preset on 16x16 images (5 tokens): fast enough for CROWN in a unit test."""
    return randomized_model(preset("tiny", image_size=16, depth=depth,
                                   position_bias=position_bias), seed=seed)


def images_and_predictions(model, n, seed=0):
    """Random images and the model's own predictions as labels (a random model has no 'true'
    labels worth certifying; the certificate is about keeping the prediction)."""
    size = model.config.image_size
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, size, size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        y = model(x).argmax(dim=1)
    return x, y


@pytest.fixture(scope="module")
def lirpa():
    if not crown_available():
        pytest.skip("auto_LiRPA is not installed")
    # auto_LiRPA runs many small tensor operations; with a second thread they slow down badly
    # whenever the CPU is shared, so pin one thread for predictable test times.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- export (no auto_LiRPA needed) -----------------------------------------------------------

EXPORT_CONFIGS = {
    "tiny": preset("tiny"),
    "patch16": preset("tiny", patch_size=16, heads=4),
    # class-token pooling, a projection before every SLL layer, none before pooling
    "cls-pool": preset("tiny", pool="cls", mlp_radius=0.8, final_radius=None),
    "position-bias": preset("tiny", position_bias=True),
}


@pytest.mark.parametrize("config", EXPORT_CONFIGS.values(), ids=EXPORT_CONFIGS.keys())
def test_export_computes_the_same_logits(config):
    model = randomized_model(config)
    x = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = export_plain(model)
    with torch.no_grad():
        expected, activations = model.forward_with_activations(x)
        logits = plain(x)
    assert logits.dtype == torch.float64
    assert torch.allclose(logits, expected, rtol=0, atol=1e-10)
    # the comparison is meaningful: some LayerProject actually shrinks tokens
    radii = [s.radius for s in model.stages if isinstance(s, LayerProject)]
    inputs = [a for s, a in zip(model.stages, activations) if isinstance(s, LayerProject)]
    assert any((a.norm(dim=-1) > r).any() for a, r in zip(inputs, radii))

    model32 = model.float()
    plain32 = export_plain(model32)
    with torch.no_grad():
        assert torch.allclose(plain32(x.float()), model32(x.float()), rtol=0, atol=1e-5)


def test_export_bakes_constants():
    model = randomized_model(preset("tiny"))
    plain = export_plain(model)
    assert not list(plain.parameters())  # only buffers: nothing to train, nothing to perturb
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        before = plain(x)
        for p in model.parameters():
            p.add_(1.0)
        assert torch.equal(plain(x), before)


def test_export_refuses_a_model_whose_forward_pass_departs_from_its_specs():
    """The export is built from the specs: of a model with a hook that scales its logits it
    would be another function, and CROWN's verdicts would be about that one."""
    model = randomized_model(preset("tiny"))
    model.stages[-1].register_forward_hook(lambda module, inputs, out: out * 10)
    with pytest.raises(LofastError, match="cannot export this model for CROWN: .* forward hook"):
        export_plain(model)


def test_margin_spec_rows():
    spec = margin_spec(torch.tensor([0, 2]), 3, torch.float64)
    expected = torch.tensor([[[1.0, -1, 0], [1, 0, -1]], [[-1, 0, 1], [0, -1, 1]]])
    assert torch.equal(spec, expected.double())


def test_missing_auto_lirpa_gives_install_hint(monkeypatch):
    crown.auto_lirpa.cache_clear()
    monkeypatch.setitem(sys.modules, "auto_LiRPA", None)  # makes `import auto_LiRPA` fail
    try:
        assert not crown_available()
        model = small_model()
        x, y = images_and_predictions(model, 1)
        with pytest.raises(LofastError, match="pip install --no-deps"):
            crown_verify(model, x, y, 0.1)
    finally:
        crown.auto_lirpa.cache_clear()


# --- CROWN (auto_LiRPA) ----------------------------------------------------------------------


def worst_margins(model, x, y, eps, steps=40):
    """Per image and class j != y, the smallest z_y - z_j found in the l2 ball: random points
    (inside, on the sphere, and clipped to [0,1]) and projected gradient descent on each margin.
    Returns (B, K-1), the classes ordered as in margin_spec."""
    b, k = len(x), model.config.num_classes
    spec = margin_spec(y, k, x.dtype)  # (B, K-1, K)
    g = torch.Generator().manual_seed(1)
    worst = torch.full((b, k - 1), torch.inf, dtype=x.dtype)

    def update(points):  # points (B, m, C, H, W)
        with torch.no_grad():
            logits = model(points.flatten(0, 1)).reshape(b, -1, k)
        margins = torch.einsum("bjk,bmk->bmj", spec, logits).min(dim=1).values
        torch.minimum(worst, margins, out=worst)

    m = 128
    directions = torch.randn(b, m, *x.shape[1:], generator=g, dtype=x.dtype)
    directions /= directions.flatten(2).norm(dim=2)[:, :, None, None, None]
    radii = eps * torch.rand(b, m, generator=g, dtype=x.dtype) ** (1 / x[0].numel())
    radii[:, : m // 4] = eps  # a quarter on the sphere
    points = x[:, None] + radii[:, :, None, None, None] * directions
    update(points)
    update(points.clamp(0, 1))  # still in the ball: clipping only moves towards x

    # gradient descent on each margin separately: (B*(K-1)) copies of the images
    xs = x.repeat_interleave(k - 1, dim=0)
    rows = spec.flatten(0, 1)  # (B*(K-1), K)
    delta = torch.zeros_like(xs, requires_grad=True)
    for _ in range(steps):
        margin = (model(xs + delta) * rows).sum(dim=1)
        grad, = torch.autograd.grad(margin.sum(), delta)
        with torch.no_grad():
            step = grad / grad.flatten(1).norm(dim=1).clamp_min(1e-12)[:, None, None, None]
            delta -= 0.2 * eps * step
            delta *= (eps / delta.flatten(1).norm(dim=1).clamp_min(eps))[:, None, None, None]
    with torch.no_grad():
        found = (model(xs + delta) * rows).sum(dim=1).reshape(b, k - 1)
    return torch.minimum(worst, found)


@pytest.mark.crown
@pytest.mark.parametrize("method, eps, position_bias", [
    ("crown", 0.05, False), ("crown", 0.3, False), ("alpha-crown", 0.15, False),
    ("crown", 0.05, True)])
def test_bounds_lie_below_every_reachable_margin(lirpa, method, eps, position_bias):
    # alpha-CROWN is many times slower: one image, one block, a few steps
    model = small_model(depth=1 if method == "alpha-crown" else 2, position_bias=position_bias)
    n = 1 if method == "alpha-crown" else 3
    x, y = images_and_predictions(model, n)
    lower = MarginBounder(model, eps, method, alpha_iterations=4).margin_bounds(x, y)
    assert lower.shape == (n, model.config.num_classes - 1)
    assert torch.isfinite(lower).all()
    reachable = worst_margins(model, x, y, eps)
    assert (lower <= reachable + 1e-9).all(), (reachable - lower).min()
    # and the bounds are not vacuous at the small radius
    if eps <= 0.05:
        assert (lower > 0).all()


@pytest.mark.crown
def test_certified_samples_resist_pgd(lirpa):
    model = small_model(seed=2)
    with torch.no_grad():
        model.stages[-1].bias.zero_()  # no class preference: margins from tiny to large
    x, y = images_and_predictions(model, 64, seed=2)
    with torch.no_grad():
        top2 = model(x).topk(2, dim=1).values
    order = (top2[:, 0] - top2[:, 1]).argsort()
    x, y = x[order[::11]], y[order[::11]]  # 6 samples, the smallest margin first
    certified_any = broken_any = False
    for eps in (0.05, 0.1):
        results = crown_verify(model, x, y, eps, batch_size=3)
        assert len(results) == len(x)
        certified = torch.tensor([r.certified for r in results])
        broken = pgd_l2(model, x, y, eps, steps=50, restarts=3)
        assert not (certified & broken).any()
        certified_any |= bool(certified.any())
        broken_any |= bool(broken.any())
        for r in results:
            assert r.certified == (r.reason is None) and r.seconds > 0
            assert r.margin_bound is not None and r.certified == (r.margin_bound > 0)
    assert certified_any and broken_any  # both sides of the check were exercised


@pytest.mark.crown
def test_time_limit_is_a_result_not_an_error(lirpa):
    model = small_model()
    x, y = images_and_predictions(model, 3)
    results = crown_verify(model, x, y, 0.05, timeout=1e-3, batch_size=2)
    assert all(not r.certified and r.reason.startswith("time limit") for r in results)
    # after an interrupted computation the verifier starts over cleanly
    assert all(r.certified for r in crown_verify(model, x[:1], y[:1], 0.05, timeout=60))


@pytest.mark.crown
def test_failures_are_isolated_per_sample(lirpa, monkeypatch):
    model = small_model()
    x, y = images_and_predictions(model, 4)
    y[1] = (y[1] + 1) % model.config.num_classes
    original = MarginBounder.margin_bounds

    def flaky(self, images, labels, max_seconds=None):
        if len(images) > 1:  # the whole batch fails: each sample is retried alone
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        if torch.equal(images[0], x[2]):
            raise NotImplementedError("some operator")
        if torch.equal(images[0], x[3]):
            raise MemoryError
        return original(self, images, labels, max_seconds)

    monkeypatch.setattr(MarginBounder, "margin_bounds", flaky)
    results = crown_verify(model, x, y, 0.05, batch_size=4)
    assert results[0].certified and results[0].reason is None
    assert results[1] == FallbackResult(False, "misclassified", 0.0)
    assert not results[2].certified and results[2].reason == "unsupported by auto_LiRPA: some operator"
    assert not results[3].certified and results[3].reason == "out of memory"

    def nan_bounds(self, images, labels, max_seconds=None):
        return torch.full((len(images), 9), torch.nan, dtype=torch.float64)

    monkeypatch.setattr(MarginBounder, "margin_bounds", nan_bounds)
    assert crown_verify(model, x[:1], y[:1], 0.05)[0].reason == "non-finite bounds"


@pytest.mark.crown
def test_invalid_arguments(lirpa):
    model = small_model()
    x, y = images_and_predictions(model, 2)
    for kwargs in ({"method": "beta-crown"}, {"eps": -1.0}, {"timeout": 0.0},
                   {"batch_size": 0}):
        arguments = {"eps": 0.1} | kwargs
        with pytest.raises(LofastError):
            crown_verify(model, x, y, **arguments)
    with pytest.raises(LofastError, match="shape"):
        crown_verify(model, x[:, :, :8], y, 0.1)
    with pytest.raises(LofastError, match="labels"):
        crown_verify(model, x, y + 100, 0.1)


def test_memory_guard_turns_exhaustion_into_an_exception(monkeypatch):
    if limits.available_memory() is None or limits.address_space() is None:
        pytest.skip("no /proc: the memory guard is inactive")
    monkeypatch.setattr(limits, "available_memory", lambda: 0)  # nothing left
    # the guard limits address space: reserving 1 GiB fails under it, whether or not the
    # pages are ever touched (torch.empty touches none: no second of page faults)
    with pytest.raises(RuntimeError, match="allocate"), limits.memory_guard(torch.device("cpu")):
        torch.empty(2**28)
    assert torch.empty(2**28).numel() == 2**28  # the limit is lifted afterwards


def test_time_limit_restores_the_grad_mode():
    """An interrupt that lands while a library has switched gradients off must not leave them
    off for the rest of the process."""
    import time

    assert torch.is_grad_enabled()
    with pytest.raises(limits.TimeLimit), limits.alarm(0.05):
        torch.set_grad_enabled(False)  # what a library does without a context manager
        time.sleep(5)
    assert torch.is_grad_enabled()
