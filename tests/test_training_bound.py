"""The differentiable training bound: gradients, agreement with the certifier, the loss."""

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from lofast.bounds.attention import attention_sensitivity
from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.compose import ProjectionStep
from lofast.bounds.estimate import (
    attention_sensitivity_estimate,
    attention_sensitivity_estimates,
    column_space_factors,
    stacked_weight_factors,
    top_singular_value,
    top_singular_value_estimate,
)
from lofast.bounds.spectral import SpectralMethod
from lofast.bounds.stages import radius_maps
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.config import TrainConfig, preset
from lofast.errors import LofastError
from lofast.models.layers import Attention
from lofast.models.vit import create_model
from lofast.training.bound import TrainingBound
from lofast.training.objective import (
    attention_reward,
    head_pair_norms,
    scheduled_eps,
    training_loss,
)

DENSE = SpectralMethod(kind="dense")


def small_model(seed=0, position_bias=False):
    # small attention caps keep every quantity in a range where float64 differences are clean
    config = preset("tiny", num_classes=5, attn_radius=2.0, final_radius=1.5,
                    position_bias=position_bias)
    model = create_model(config, seed=seed).double()
    if position_bias:  # attention far from uniform, whatever the scores
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("position_bias"):
                    p.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(seed))
    return model


def images(batch, seed=1):
    return torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed),
                      dtype=torch.float64)


def converged_radius(model, x, eps, iterations=2000):
    bound = TrainingBound(iterations, generator=torch.Generator().manual_seed(0))
    return bound(model, x, eps)


@pytest.mark.parametrize("position_bias", [False, True])
def test_training_bound_agrees_with_the_certifier_stage_by_stage(position_bias):
    """Training and certification walk the stages with one function (``radius_maps``): the
    same maps in the same order, equal where no norm is estimated, and converged power
    iteration reproduces the certifier's attention maps from below, so the end-to-end radius
    too. Long patch tokens (a large embedding bias) beside the zero class token: the first
    LayerProject contracts only because the walk leaves the constant class token out. With
    position biases both evaluate attention at the biased scores."""
    model = small_model(position_bias=position_bias)
    with torch.no_grad():
        model.stages[0].bias.fill_(6.0 / model.config.width ** 0.5)  # patch norms ~6 > R
    x = images(6)
    certifier = Certifier(model, CertifySettings(method=DENSE))
    with torch.no_grad():  # at the predicted labels: the certificate bounds every sample
        predicted = model(x.to(torch.float64)).argmax(dim=1)
    certificate = certifier.certify(x, predicted)
    assert certificate.bounded.all()
    bound = TrainingBound(1000, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, activations = model.forward_with_activations(x)
        estimated = radius_maps(model.structure(differentiable=True), activations, bound)
    assert [type(step) for step in estimated] == [type(step) for step in certificate.steps]
    assert any(isinstance(step, ProjectionStep) and (step.min_norm > 2.0).all()
               for step in estimated)  # a projection that contracts (R = 2)
    eps = torch.tensor([0.01, 0.1, 0.5], dtype=torch.float64).expand(6, -1)
    for mine, theirs in zip(estimated, certificate.steps):
        ratio = mine.delta(eps) / theirs.delta(eps)
        assert (ratio <= 1 + 1e-6).all() and (ratio >= 1 - 1e-4).all(), (type(mine), ratio)
    bound.iterations = 1  # warm-started from the converged vectors
    _, radius = bound(model, x, 0.1)  # the training entry point: the same walk, composed
    reference = certificate.feature_radius(torch.tensor([0.1]))[:, 0]
    assert (radius <= reference * (1 + 1e-6)).all() and (radius >= reference * (1 - 1e-4)).all()


def test_kept_warm_starts_are_few_and_start_the_samples_in_turn():
    """The bound keeps WARM_STARTS vectors per attention stage (its state does not grow with the
    batch) and starts sample i of the next batch from vector i mod WARM_STARTS: one power step
    on 16 images repeated three times gives each copy the radius of one step on the 16 images
    alone, from the same kept vectors (from another sample's vector it would not)."""
    model = small_model(position_bias=True)
    kept = TrainingBound.WARM_STARTS
    x = images(kept, seed=3)
    bound = TrainingBound(5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bound(model, x.repeat(2, 1, 1, 1), 0.1)  # keeps the vectors of these 16 images
        state = bound.state()
        assert state and all(v.shape[0] == kept and v.untyped_storage().nbytes() == v.nbytes
                             for v in state.values())  # copies, not views of the batch's
        bound.iterations = 1
        _, alone = bound(model, x, 0.1)
        bound.load_state(state, x.device)
        _, repeated = bound(model, x.repeat(3, 1, 1, 1), 0.1)
        bound.load_state(state, x.device)
        _, few = bound(model, x[:3], 0.1)  # fewer samples than vectors: the first vectors
    assert torch.allclose(repeated, alone.repeat(3), rtol=1e-12, atol=0)
    assert torch.allclose(few, alone[:3], rtol=1e-12, atol=0)


def test_explicit_norms_equal_the_certifiers():
    """The per-sample score and value norms (formed from thin factors) are the certifier's
    (whose explicit norms are upper bounds a few ulps above the exact ones). Gaussian weights:
    a model's capped weights can have equal singular values, which would hide a swapped factor."""
    g = torch.Generator().manual_seed(5)
    heads, d, dh = 2, 24, 6
    query, key, value = (torch.randn(heads, d, dh, generator=g, dtype=torch.float64)
                         for _ in range(3))
    output = torch.randn(heads, dh, d, generator=g, dtype=torch.float64)
    w = AttentionSpec(query, key, value, output, residual=True, scale=dh ** 0.5)
    tokens = torch.randn(4, 5, d, generator=g, dtype=torch.float64) / d ** 0.5
    exact = attention_sensitivity(tokens, w, score_bound="relaxed", method=DENSE)
    estimate, _ = attention_sensitivity_estimate(tokens, w, iterations=1)
    for name in ("score_sensitivity", "value_norm", "score_weight_norm", "value_weight_norm",
                 "centered_score_sensitivity", "centered_value_norm"):
        assert torch.allclose(getattr(estimate, name), getattr(exact, name), rtol=1e-6), name
    # Gaussian tokens share no common vector, yet centring takes something off
    assert (exact.centered_score_sensitivity < exact.score_sensitivity).all()


def test_softmax_first_order_estimate_converges_to_the_certifiers():
    """The refinement's ||D_X|| by power steps (with gradients) approaches the dense value from
    below, and the refined delta is never above the unrefined one."""
    g = torch.Generator().manual_seed(6)
    heads, d, dh = 2, 16, 4
    query, key, value = (torch.randn(heads, d, dh, generator=g, dtype=torch.float64)
                         for _ in range(3))
    output = torch.randn(heads, dh, d, generator=g, dtype=torch.float64)
    query.requires_grad_(True)
    w = AttentionSpec(query, key, value, output, residual=True, scale=dh ** 0.5)
    tokens = torch.randn(3, 5, d, generator=g, dtype=torch.float64) / d ** 0.5
    exact = attention_sensitivity(tokens, w, score_bound="relaxed", softmax_jacobian=True,
                                  method=DENSE)
    estimate, vectors = attention_sensitivity_estimate(tokens, w, iterations=500,
                                                       softmax_jacobian=True)
    assert vectors.shape == (3, 2, 5, d)
    ratio = estimate.softmax_first_order / exact.softmax_first_order
    assert (ratio <= 1 + 1e-9).all() and (ratio >= 1 - 1e-4).all(), ratio
    eps = torch.tensor([0.01, 0.1, 1.0], dtype=torch.float64).expand(3, -1)
    unrefined, _ = attention_sensitivity_estimate(tokens, w, iterations=500)
    assert (estimate.delta(eps) <= unrefined.delta(eps) * (1 + 1e-9)).all()
    assert (estimate.delta(eps)[:, 0] < unrefined.delta(eps)[:, 0]).all()
    (grad,) = torch.autograd.grad(estimate.softmax_first_order.sum(), query)
    assert grad.abs().sum() > 0


def test_softmax_first_order_estimate_is_the_cheap_bound_where_attention_is_near_uniform():
    """Like the certifier, the estimate skips the refinement's power steps where its cheap bound
    is negligible next to zeta, takes that bound, and hands the start vectors back unchanged."""
    g = torch.Generator().manual_seed(8)
    heads, d, dh = 2, 16, 4
    query, key = (1e-3 * torch.randn(heads, d, dh, generator=g, dtype=torch.float64)
                  for _ in range(2))
    value = torch.randn(heads, d, dh, generator=g, dtype=torch.float64) / d ** 0.5
    output = torch.randn(heads, dh, d, generator=g, dtype=torch.float64) / d ** 0.5
    w = AttentionSpec(query, key, value, output, residual=True, scale=dh ** 0.5)
    tokens = torch.randn(3, 5, d, generator=g, dtype=torch.float64) / d ** 0.5
    exact = attention_sensitivity(tokens, w, score_bound="relaxed", softmax_jacobian=True,
                                  method=DENSE)
    start = torch.randn(3, 2, 5, d, generator=g, dtype=torch.float64)
    estimate, vectors = attention_sensitivity_estimate(tokens, w, start=start, iterations=50,
                                                       softmax_jacobian=True)
    assert torch.equal(vectors[:, 1], start[:, 1])
    assert torch.allclose(estimate.softmax_first_order, exact.softmax_first_order, rtol=1e-6)
    assert (estimate.softmax_first_order < 1e-3 * estimate.zeta).all()


def test_warm_started_estimate_is_close_after_a_few_steps():
    """Two power steps from the previous batch's vectors: within 2 % of the dense zeta."""
    model = small_model()
    spec = model.structure()[2]
    w = AttentionSpec(spec.query, spec.key, spec.value, spec.output, spec.residual, spec.scale)
    _, acts = model.forward_with_activations(images(8))
    tokens = acts[2].detach()
    exact = attention_sensitivity(tokens, w, method=DENSE).zeta
    generator = torch.Generator().manual_seed(0)
    _, vectors = attention_sensitivity_estimate(tokens[:4], w, iterations=30, generator=generator)
    estimate, _ = attention_sensitivity_estimate(tokens[4:], w, start=vectors, iterations=2)
    assert (estimate.zeta <= exact[4:] * (1 + 1e-9)).all()
    assert (estimate.zeta >= exact[4:] * 0.98).all(), (estimate.zeta, exact[4:])


def test_column_space_factors_keep_the_norms_of_products():
    """One batched QR gives factors R_i of W_i with ||Y W_i^T|| = ||Y R_i^T|| and
    ||W_i W_j^T|| = ||R_i R_j^T||, as the training estimate uses them, with gradients."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(4, 32, 6, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3)]
    factors = column_space_factors(*weights)
    assert factors.shape == (3, 4, 6, 6)
    y = torch.randn(4, 5, 6, generator=g, dtype=torch.float64)
    for i, (weight, factor) in enumerate(zip(weights, factors)):
        assert torch.allclose(torch.linalg.matrix_norm(y @ factor.mT, ord=2),
                              torch.linalg.matrix_norm(y @ weight.mT, ord=2), rtol=1e-10)
        other = weights[(i + 1) % 3]
        assert torch.allclose(
            torch.linalg.matrix_norm(factor @ factors[(i + 1) % 3].mT, ord=2),
            torch.linalg.matrix_norm(weight @ other.mT, ord=2), rtol=1e-10)
    factors.sum().backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in weights)


def test_weight_factors_of_all_blocks_at_once_are_each_blocks_own():
    """The training bound makes every block's weights-only factors in one batch (one QR, one
    norm estimate): each block's are those it gets alone, with the norms ||A_l||, ||B_l||."""
    model = create_model(preset("tiny", depth=3, position_bias=True), seed=1)
    blocks = [s for s in model.structure(differentiable=True) if isinstance(s, AttentionSpec)]
    assert len(blocks) == 3
    stacked = stacked_weight_factors(blocks, torch.float64)
    for j, w in enumerate(blocks):
        alone = stacked_weight_factors([w], torch.float64)
        for name in ("query", "key", "value", "output", "score_weight_norm",
                     "value_weight_norm"):
            torch.testing.assert_close(getattr(stacked, name)[j], getattr(alone, name)[0],
                                       rtol=1e-12, atol=1e-14)
        exact = (torch.linalg.matrix_norm(w.score_matrices(), ord=2),
                 torch.linalg.matrix_norm(w.value_matrices(), ord=2))
        torch.testing.assert_close(stacked.score_weight_norm[j], exact[0], rtol=1e-4, atol=0)
        torch.testing.assert_close(stacked.value_weight_norm[j], exact[1], rtol=1e-4, atol=0)


@pytest.mark.parametrize("rows, cols", [(17, 16), (16, 17), (5, 5)])
def test_per_sample_norm_estimate_is_close_from_below(rows, cols):
    """Repeated squaring of the Gram matrix: never above the dense norm and within 1e-4 of it,
    even for the nearly equal top singular values some Gaussian matrices have (ratio up to
    0.997 here); where the top value is well separated, the gradient is the dense norm's."""
    g = torch.Generator().manual_seed(7)
    M = torch.randn(64, rows, cols, generator=g, dtype=torch.float64, requires_grad=True)
    estimate = top_singular_value_estimate(M)
    dense = torch.linalg.matrix_norm(M, ord=2)
    assert (estimate <= dense * (1 + 1e-12)).all()
    assert (estimate >= dense * (1 - 1e-4)).all(), (estimate / dense).min()
    (grad,) = torch.autograd.grad(estimate.sum(), M)
    (dense_grad,) = torch.autograd.grad(dense.sum(), M)
    singular = torch.linalg.svdvals(M.detach())
    separated = singular[:, 1] < 0.9 * singular[:, 0]
    assert separated.sum() > 32
    assert torch.allclose(grad[separated], dense_grad[separated], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weight_norm_of_nearly_equal_top_singular_values(dtype):
    """The weights' norms (no solver): the dense norm and its gradient where the top two
    singular values differ by a relative 1e-3 (capped, orthogonally initialised weights)."""
    g = torch.Generator().manual_seed(3)
    left = torch.linalg.qr(torch.randn(6, 48, 32, generator=g, dtype=torch.float64)).Q
    right = torch.linalg.qr(torch.randn(6, 32, 32, generator=g, dtype=torch.float64)).Q
    singular = torch.linspace(1.0, 0.5, 32, dtype=torch.float64).repeat(6, 1)
    singular[:, 1] = 1.0 - 1e-3
    dense_input = (left * singular[:, None, :]) @ right.mT
    M = dense_input.to(dtype).requires_grad_()
    norm = top_singular_value(M)
    dense_M = M.detach().to(torch.float64).requires_grad_()
    dense = torch.linalg.matrix_norm(dense_M, ord=2)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    assert torch.allclose(norm.double(), dense, rtol=tolerance)
    (grad,) = torch.autograd.grad(norm.sum(), M)
    (dense_grad,) = torch.autograd.grad(dense.sum(), dense_M)
    assert torch.allclose(grad.double(), dense_grad, atol=1e-3 if dtype == torch.float32 else 1e-8)
    # the same with the wide matrices
    assert torch.allclose(top_singular_value(M.mT).double(), dense, rtol=tolerance)


def test_per_sample_norm_estimate_of_degenerate_matrices():
    """Equal singular values (an orthogonal matrix) and the zero matrix, with a zero gradient."""
    orthogonal = torch.linalg.qr(torch.randn(4, 8, 8, dtype=torch.float64)).Q
    assert torch.allclose(top_singular_value_estimate(orthogonal),
                          torch.ones(4, dtype=torch.float64))
    zero = torch.zeros(2, 3, 4, requires_grad=True)
    value = top_singular_value_estimate(zero)
    value.sum().backward()
    assert torch.equal(value, torch.zeros(2)) and torch.equal(zero.grad, torch.zeros(2, 3, 4))


@pytest.mark.parametrize("position_bias", [False, True])
def test_gradient_matches_finite_differences(position_bias):
    """d radius / d parameters along a random direction, against central differences."""
    model = small_model(seed=2, position_bias=position_bias)
    x = images(3, seed=4)
    eps = 0.2
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # orthogonal initial weights have no differentiable top singular value
        for p in params:
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) * p.abs().mean())
    direction = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]

    model.eval()  # exact caps: the bound's own gradient (training's estimated caps: test_models)
    bound = TrainingBound(2000, generator=torch.Generator().manual_seed(0))

    def objective():
        logits, radius = bound(model, x, eps)
        return radius.double().sum() + 0.1 * logits.sum()

    value = objective()
    bound.iterations = 20  # the differences start from the converged vectors
    grads = torch.autograd.grad(value, params)
    analytic = sum((gr * d).sum() for gr, d in zip(grads, direction)).item()
    h = 1e-6
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.add_(h * d)
        up = objective().item()
        for p, d in zip(params, direction):
            p.sub_(2 * h * d)
        down = objective().item()
        for p, d in zip(params, direction):
            p.add_(h * d)
    numeric = (up - down) / (2 * h)
    assert analytic == pytest.approx(numeric, rel=1e-4, abs=1e-8)


def test_gradient_reaches_every_attention_weight():
    model = small_model(position_bias=True)
    _, radius = converged_radius(model, images(2), 0.1, iterations=5)
    radius.sum().backward()
    for name, p in model.named_parameters():
        if "weights" in name or "position_bias" in name:  # query/key/value/output, bias
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_certified_loss_raises_non_true_logits_by_the_radius():
    model = small_model()
    logits = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 3])
    radius = torch.tensor([0.0, 0.1, 0.2, 0.3], dtype=torch.float64)
    config = TrainConfig(loss="certified", train_eps=0.1, temperature=0.5)
    loss = training_loss(model, logits, labels, config, radius)
    raised = logits + radius[:, None] * head_pair_norms(model, labels)
    expected = torch.nn.functional.cross_entropy(raised / 0.5, labels)
    assert torch.allclose(loss, expected)
    mixed = training_loss(model, logits, labels,
                          TrainConfig(loss="certified", train_eps=0.1, temperature=0.5,
                                      clean_mix=0.25), radius)
    clean = torch.nn.functional.cross_entropy(logits / 0.5, labels)
    assert torch.allclose(mixed, 0.75 * expected + 0.25 * clean)
    # the radius only ever makes the loss larger: it worsens every non-true logit
    assert loss > training_loss(model, logits, labels, config, torch.zeros(4, dtype=torch.float64))


def test_logit_annealing_weights_each_samples_cross_entropy():
    """(1 - p_y)^gamma times each sample's cross-entropy on the raised logits, against a float64
    softmax written out; gamma 0 is the plain loss; a confident sample weighs less than a
    wrong one; the weight is differentiated (autograd against finite differences)."""
    model = small_model()
    logits = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits[0, 0] += 6.0  # sample 0 confidently right
    labels = torch.tensor([0, 1, 2, 3])
    radius = torch.tensor([0.0, 0.1, 0.2, 0.3], dtype=torch.float64)
    raised = (logits + radius[:, None] * head_pair_norms(model, labels)) / 0.5
    p = torch.softmax(raised, dim=1).gather(1, labels[:, None])[:, 0]
    for gamma in (0.0, 2.0, 5.0):
        config = TrainConfig(loss="certified", train_eps=0.1, temperature=0.5,
                             logit_annealing=gamma)
        loss = training_loss(model, logits, labels, config, radius)
        assert torch.allclose(loss, ((1 - p) ** gamma * -p.log()).mean(), rtol=1e-12)
    weights = (1 - p) ** 2
    assert weights[0] < 1e-3 < weights[1:].min()
    config = TrainConfig(loss="ce", temperature=0.5, logit_annealing=2.0)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: training_loss(model, z, labels, config), (x,))
    with pytest.raises(LofastError, match="logit_annealing"):
        TrainConfig(logit_annealing=-1.0)


def test_eps_ramp():
    config = TrainConfig(loss="certified", train_eps=0.2, eps_ramp_epochs=4)
    assert scheduled_eps(config, 0.0) == 0.0
    assert scheduled_eps(config, 2.0) == pytest.approx(0.1)
    assert scheduled_eps(config, 10.0) == pytest.approx(0.2)
    assert scheduled_eps(TrainConfig(loss="certified", train_eps=0.2), 0.0) == 0.2


def test_reusing_effective_weights_changes_nothing():
    model = small_model()
    x = images(2)
    plain = model(x)
    with model.reusing_effective_weights():
        reused = model(x)
    assert torch.equal(plain, reused)
    assert all(s.held is None for s in model.stages if hasattr(s, "held"))


def reward_model(score_scale):
    """small_model with uncapped Wq, Wk scaled by score_scale (0: attention switched off)."""
    config = preset("tiny", num_classes=5, query_key_cap=None)
    model = create_model(config, seed=0).double()
    with torch.no_grad():
        for stage in model.stages:
            if isinstance(stage, Attention):
                stage.weights["query"].mul_(score_scale)
                stage.weights["key"].mul_(score_scale)
    return model


def test_attention_reward_is_the_margin_where_attention_is_dead():
    model = reward_model(0.0)
    x, y = images(16), torch.arange(16) % 5
    config = TrainConfig(ablation_margin=0.5)
    # every P_l(X) is the same matrix: the ablation changes nothing, the penalty is m
    assert attention_reward(model, x, model(x), y, config).item() == pytest.approx(0.5, abs=1e-12)


def test_attention_reward_measures_the_ablation_gap_and_can_be_learned():
    model = reward_model(6.0)
    x, y = images(16), torch.arange(16) % 5
    config = TrainConfig(ablation_margin=10.0, temperature=0.5)
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        means = model.batch_mean_attention(x)
        gap = ce(model(x, fixed_attention=means) / 0.5, y) - ce(model(x) / 0.5, y)
    reward = attention_reward(model, x, model(x), y, config)
    assert reward.item() == pytest.approx(10.0 - gap.item(), rel=1e-12)
    assert abs(gap.item()) > 1e-4  # live attention: the ablation does change the loss
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(10):  # the penalty alone, minimised: the gap grows
        optimizer.zero_grad()
        attention_reward(model, x, model(x), y, config).backward()
        optimizer.step()
    assert attention_reward(model, x, model(x), y, config).item() < reward.item() - 0.1


def test_reusing_effective_weights_is_reentrant():
    model = small_model()
    with model.reusing_effective_weights():
        held = [s.held for s in model.stages if hasattr(s, "held")]
        with model.reusing_effective_weights():
            pass
        assert [s.held for s in model.stages if hasattr(s, "held")] == held
    assert all(s.held is None for s in model.stages if hasattr(s, "held"))


def test_bad_certified_settings_are_rejected():
    from lofast.errors import LofastError

    with pytest.raises(LofastError, match="train-eps"):
        TrainConfig(loss="certified")
    with pytest.raises(LofastError, match="mix"):
        TrainConfig(loss="certified", train_eps=0.1, clean_mix=1.5)
    with pytest.raises(LofastError):
        TrainingBound(iterations=0)


def test_float32_bound_matches_float64_closely():
    model = small_model()
    x = images(4)
    _, r64 = converged_radius(model, x, 0.1, iterations=50)
    _, r32 = converged_radius(copy.deepcopy(model).float(), x.float(), 0.1, iterations=50)
    assert torch.allclose(r32.double(), r64.double(), rtol=1e-3)


ESTIMATE_FIELDS = ("zeta", "score_sensitivity", "value_norm", "score_weight_norm",
                   "value_weight_norm", "softmax_first_order", "centered_value_norm",
                   "row_score_sensitivity", "centered_score_sensitivity")


def stacked_case():
    """Four blocks for ``attention_sensitivity_estimates``: the three of a position-biased tiny
    model at their clean tokens, the first with near-zero scores (its refinement is negligible,
    so a CPU skips its power steps; the others take them), and a fourth of another batch shape
    (a group of its own); start vectors for each."""
    model = create_model(preset("tiny", depth=3, position_bias=True), seed=1).double()
    structure = model.structure(differentiable=True)
    _, activations = model.forward_with_activations(images(6))
    indices = [k for k, s in enumerate(structure) if isinstance(s, AttentionSpec)]
    blocks = [structure[k] for k in indices]
    tokens = [activations[k].detach() for k in indices]
    blocks[0] = dataclasses.replace(blocks[0], query=1e-4 * blocks[0].query,
                                    key=1e-4 * blocks[0].key)
    blocks.append(blocks[1])
    tokens.append(tokens[1][:4])
    g = torch.Generator().manual_seed(2)
    starts = [torch.randn(t.shape[0], 2, *t.shape[1:], generator=g, dtype=torch.float64)
              for t in tokens]
    return blocks, tokens, starts


def test_blocks_estimated_together_are_each_blocks_own():
    """The training bound estimates every block at once, blocks of one shape stacked: each
    block's quantities, final vectors and gradients are those it gets alone (to rounding), the
    refinement's power steps taken only by the blocks that take them alone."""
    blocks, tokens, starts = stacked_case()
    tokens = [t.clone().requires_grad_(True) for t in tokens]
    together = attention_sensitivity_estimates(tokens, blocks, starts=starts, iterations=3,
                                               softmax_jacobian=True, stack=True)
    assert len(together) == 4
    for j, (w, t, start) in enumerate(zip(blocks, tokens, starts)):
        alone, alone_vectors = attention_sensitivity_estimate(t, w, start=start, iterations=3,
                                                              softmax_jacobian=True)
        sensitivity, vectors = together[j]
        for name in ESTIMATE_FIELDS:
            torch.testing.assert_close(getattr(sensitivity, name), getattr(alone, name),
                                       rtol=1e-12, atol=1e-15, msg=f"block {j}: {name}")
        torch.testing.assert_close(vectors, alone_vectors, rtol=1e-12, atol=1e-15)
        skipped = torch.equal(vectors[:, 1], start[:, 1])
        assert skipped == (j == 0), j  # near-zero scores: no power steps for the refinement
        for mine, theirs in zip(
                torch.autograd.grad((sensitivity.zeta + sensitivity.softmax_first_order).sum(),
                                    tokens, allow_unused=True, retain_graph=True),
                torch.autograd.grad((alone.zeta + alone.softmax_first_order).sum(), tokens,
                                    allow_unused=True)):
            # a block's own tokens only (the others' None alone, zero together)
            mine = torch.zeros_like(t) if mine is None else mine
            theirs = torch.zeros_like(mine) if theirs is None else theirs
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("softmax_jacobian", [False, True])
def test_blocks_of_one_shape_cost_the_operators_of_one(softmax_jacobian):
    """Stacked, blocks of one shape share their operators (an accelerator's training step waits
    on each launch): three dispatch as many as two, and two barely more than one (a stack of
    one needs fewer copies)."""
    blocks, tokens, starts = stacked_case()
    blocks, tokens = blocks[1:3] + blocks[1:2], tokens[1:3] + tokens[1:2]  # all take every step
    starts = [s[:, :2 if softmax_jacobian else 1] for s in starts[1:3] + starts[1:2]]

    benchmarks = str(Path(__file__).parents[1] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        from measure import LaunchCounter  # the benchmarks' count of launches
    finally:
        sys.path.remove(benchmarks)

    def operators(count):
        with LaunchCounter() as counter:
            attention_sensitivity_estimates(tokens[:count], blocks[:count],
                                            starts=starts[:count], iterations=2,
                                            softmax_jacobian=softmax_jacobian, stack=True)
        return counter.count

    assert operators(3) == operators(2) <= 1.05 * operators(1)


def test_training_bound_with_blocks_stacked_is_the_bound_a_block_at_a_time():
    """A training step stacks its blocks off the CPU: the radius and its gradients are those of
    a block at a time (the CPU's way), to rounding, at the first call and warm-started."""
    model = create_model(preset("tiny", depth=3, position_bias=True), seed=1).double()
    x = images(6)
    results = {}
    for stack in (False, True):
        bound = TrainingBound(2, softmax_jacobian=True, generator=torch.Generator().manual_seed(0))
        bound.stack = stack
        for call in range(2):
            model.zero_grad()
            _, radius = bound(model, x[3 * call:3 * call + 3], 0.1)
            radius.sum().backward()
            results[stack, call] = radius.detach(), [p.grad.clone() for p in model.parameters()
                                                      if p.grad is not None]
    for call in range(2):
        (radius, grads), (stacked, stacked_grads) = results[False, call], results[True, call]
        torch.testing.assert_close(stacked, radius, rtol=1e-12, atol=0)
        assert len(grads) == len(stacked_grads) > 0
        for mine, theirs in zip(stacked_grads, grads):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-14)
