"""End-to-end soundness of certificates on a small trained model: PGD finds nothing."""

import copy
import types

import pytest
import torch
from helpers import train_tiny

from lofast.bounds.compose import propagate
from lofast.bounds.spectral import Guarantee, SpectralMethod
from lofast.bounds.stages import radius_maps
from lofast.certification.attack import pgd_l2
from lofast.certification.certificate import Certifier, CertifySettings
from lofast.certification.pipeline import _batch_records
from lofast.checkpoint import default_checkpoint_path, load_checkpoint
from lofast.config import preset
from lofast.data.sample import load_bundled_sample
from lofast.errors import CertificationError
from lofast.models.layers import SLL, Head, LayerProject, PatchEmbed
from lofast.models.vit import create_model

EPS = torch.tensor([0.02, 0.05, 0.1, 0.2], dtype=torch.float64)


@pytest.fixture(scope="module")
def trained():
    return train_tiny()


@pytest.fixture(scope="module")
def trained_with_position_bias():
    return train_tiny(position_bias=True)


@pytest.fixture(scope="module")
def trained_with_live_attention():
    """Wq = Wk = I with every head's ||A_l|| fixed at 4: scores vary by up to 1 across tokens."""
    return train_tiny(position_bias=True, score_norm=4.0, query_key="identity")


@pytest.fixture(scope="module")
def trained_with_coordinate_values():
    """As trained_with_live_attention in its first block, with Wv = Wo = I scaled to every
    head's ||B_l|| = 0.5: zeta in closed form (``coordinate_jacobian.coordinate_first_order_norm``)."""
    model, x, y = train_tiny(position_bias=True, score_norm=8.0, query_key="identity",
                             value_output="identity", value_norm=0.5, live_blocks=1,
                             live_first=True)
    assert model.structure()[2].coordinate_values is not None  # the first attention block
    return model, x, y


@pytest.fixture(scope="module")
def trained_with_plain_head():
    """A head without last-layer normalisation, its rows scaled to norms 0.3-3 (far from the
    unit rows of a normalised head)."""
    model, x, y = train_tiny(normalized_head=False)
    with torch.no_grad():
        head = model.stages[-1].weight
        head.mul_(torch.linspace(0.3, 3.0, len(head))[:, None]
                  / torch.linalg.vector_norm(head, dim=1, keepdim=True))
    return model, x, y


@pytest.fixture(scope="module")
def with_strong_spread_attention(trained_with_position_bias):
    """The biased model with every head's Wq_l, Wk_l replaced by random weights whose singular
    values spread by a ratio of 100, rescaled to ||A_l|| / s = 4 (the benchmarks'
    ``live_attention.with_live_attention``); labelled by its own predictions, which strong
    random scores change."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "live_attention.py"
    spec = importlib.util.spec_from_file_location("live_attention", path)
    live_attention = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(live_attention)
    model, x, _ = trained_with_position_bias
    live = live_attention.with_live_attention(model, 4.0, seed=0, spread=100.0)
    spectra = live_attention.score_spectra(live)
    assert all(abs(row["strength_max"] - 4.0) < 1e-6 and abs(row["strength_min"] - 4.0) < 1e-6
               and row["spread_max"] > 5.0 for row in spectra)
    with torch.no_grad():
        return live, x, live(x).argmax(dim=1)


@pytest.fixture(scope="module")
def certificate(trained):
    model, x, y = trained
    return Certifier(model, CertifySettings()).certify(x, y)


def test_model_learned_and_some_samples_certify(trained, certificate):
    _, _, y = trained
    assert (certificate.predictions == y).float().mean() > 0.9
    assert certificate.certified(EPS)[:, 0].any()
    assert certificate.guarantee is Guarantee.EXACT  # the default, as the CLI's
    assert certificate.failure_probability == 0


@pytest.mark.parametrize("kind, model_name", [("lanczos", "trained"), ("verified", "trained"),
                                               ("verified", "trained_with_position_bias"),
                                               ("verified", "trained_with_live_attention"),
                                               ("verified", "trained_with_coordinate_values"),
                                               ("verified", "with_strong_spread_attention"),
                                               ("verified", "trained_with_plain_head")])
def test_certified_samples_survive_pgd(kind, model_name, request):
    """Attack every sample just inside its certified radius: that ball contains the ball of
    every eps it is certified at, so one strong attack there checks all its verdicts. Both
    certificate-grade methods: randomized Lanczos and the Cholesky-verified default of the CLI;
    and models whose attention has position biases, and input-dependent scores (up to
    ||A_l|| / s = 4 with spread singular values)."""
    model, x, y = request.getfixturevalue(model_name)
    certificate = Certifier(model, CertifySettings(method=SpectralMethod(kind=kind))).certify(x, y)
    radius = certificate.radius()
    inside = radius > 0
    assert inside.sum() >= 5
    verdicts = certificate.certified(EPS)
    assert torch.equal(verdicts.any(dim=1), verdicts.any(dim=1) & inside)
    model64 = copy.deepcopy(model).double()
    broken = pgd_l2(model64, x[inside].double(), y[inside], radius[inside] * 0.999,
                    steps=50, restarts=3)
    assert not broken.any(), "PGD broke a certified sample"
    # the attack is real: at 20x the radius it breaks most of them
    broken = pgd_l2(model64, x[inside].double(), y[inside], radius[inside] * 20, steps=50,
                    restarts=1)
    assert broken.float().mean() > 0.5


def test_the_jacobian_slack_trades_radius_for_proofs_and_stays_sound(
        with_strong_spread_attention, monkeypatch):
    """``--jacobian-slack``: at 0 every live sample gets the per-sample proofs, at 1 none does
    (they are made to fail here), and the radii order accordingly, sample by sample; PGD breaks
    none of the loosest certificates. (The model with Wq = Wk = I is no subject: the default
    makes no per-sample proof there.)"""
    from lofast.bounds import attention_norms

    model, x, y = with_strong_spread_attention
    default = Certifier(model, CertifySettings()).certify(x, y).radius()
    tight = Certifier(model, CertifySettings(jacobian_slack=0.0)).certify(x, y).radius()

    def unused(*args, **kwargs):
        raise AssertionError("a per-sample proof was made")

    monkeypatch.setattr(attention_norms, "verified_first_order_norm", unused)
    monkeypatch.setattr(attention_norms, "softmax_first_order_norm", unused)
    loose = Certifier(model, CertifySettings(jacobian_slack=1.0)).certify(x, y).radius()
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="per-sample proof"):  # the default makes them
        monkeypatch.setattr(attention_norms, "verified_first_order_norm", unused)
        monkeypatch.setattr(attention_norms, "softmax_first_order_norm", unused)
        Certifier(model, CertifySettings()).certify(x, y)
    # (where two settings take the same bound, the radii may differ in the last bit: the
    # samples left to a strategy form other batches, whose products round otherwise)
    assert (loose <= default * (1 + 1e-12)).all() and (default <= tight * (1 + 1e-12)).all()
    assert (loose < default).any() and (loose > 0).sum() >= 5
    inside = loose > 0
    broken = pgd_l2(copy.deepcopy(model).double(), x[inside].double(), y[inside],
                    loose[inside] * 0.999, steps=50, restarts=3)
    assert not broken.any(), "PGD broke a certified sample"


def test_verdicts_only_keeps_every_verdict_with_fewer_proofs(with_strong_spread_attention):
    """``verdicts_at``: at each of its eps, the same verdicts as the full certificate; every
    radius the cheap pass's (no per-sample proof) or the full one's, the full one's on every
    sample whose verdict the proofs change, the cheap one's on some that a proof would
    tighten but not enough to change a verdict (the screen's lower estimates); PGD breaks
    none of them (they are at most the full radii, which
    ``test_certified_samples_survive_pgd`` attacks). The chosen eps split the samples: some
    certified by the cheap pass, some only by the proofs, some by neither."""
    model, x, y = with_strong_spread_attention
    full = Certifier(model, CertifySettings()).certify(x, y)
    tight = full.radius()
    first = Certifier(model, CertifySettings(verdicts_at=1e-12)).certify(x, y)
    cheap = first.radius()
    at = float(cheap[cheap > 0].quantile(0.75))
    eps = torch.tensor([at / 4, at / 2, at], dtype=torch.float64)
    fast = Certifier(model, CertifySettings(verdicts_at=eps.tolist())).certify(x, y)
    radius = fast.radius()
    assert ((cheap < at) & (tight >= at)).any() and ((cheap >= at) & (tight > cheap)).any()
    assert ((tight < at) & (tight > 0)).any()
    assert torch.equal(fast.certified(eps), full.certified(eps))
    # the samples left to the proofs form other batches, whose products round otherwise
    assert (cheap <= radius * (1 + 1e-12)).all() and (radius <= tight * (1 + 1e-12)).all()
    refined = torch.isclose(radius, tight, rtol=1e-9, atol=0)
    assert (refined | (radius == cheap)).all()
    changed = (first.certified(eps) != full.certified(eps)).any(dim=1)
    assert changed.any() and refined[changed].all()
    tightened = (cheap < at) & (tight > cheap * (1 + 1e-9))
    assert (tightened & ~refined).any() and (tightened & refined).any()
    assert fast.guarantee is Guarantee.EXACT and fast.failure_probability == 0
    inside = radius > 0
    broken = pgd_l2(copy.deepcopy(model).double(), x[inside].double(), y[inside],
                    radius[inside] * 0.999, steps=50, restarts=3)
    assert not broken.any(), "PGD broke a verdicts-only certificate"


def test_the_proofs_pass_of_verdicts_only_makes_the_full_walks_proofs(
        with_strong_spread_attention):
    """``make_proofs`` on the same samples builds the same per-model proofs (the blocks'
    deflations, the larger ones among them) in verdicts-only mode as in the full walk, though
    the screen would skip some of those samples: no batch then pays for a per-model proof,
    and its time is its samples' own. Its certificates are unchanged."""
    from lofast.bounds.attention_spec import AttentionSpec

    model, x, y = with_strong_spread_attention

    def proofs_made(settings):
        certifier = Certifier(model, settings)
        certifier.make_proofs(x, y)
        return certifier, [sorted(spec._deflations) for spec in certifier.structure
                           if isinstance(spec, AttentionSpec)]

    _, full = proofs_made(CertifySettings())
    assert any(large for block in full for _, large in block)  # a larger deflation among them
    # at a tiny eps the cheap bounds settle every verdict: the screen would make no proof
    assert proofs_made(CertifySettings(verdicts_at=1e-12))[1] == full
    first = Certifier(model, CertifySettings(verdicts_at=1e-12)).certify(x, y).radius()
    at = float(first[first > 0].quantile(0.75))
    certifier, verdicts = proofs_made(CertifySettings(verdicts_at=at))
    assert verdicts == full
    def held():
        return [{key: id(made) for key, made in spec._deflations.items()}
                for spec in certifier.structure if isinstance(spec, AttentionSpec)]

    before = held()
    fast = certifier.certify(x, y)
    assert held() == before  # nothing new made in the batch
    alone = Certifier(model, CertifySettings(verdicts_at=at)).certify(x, y)
    assert torch.equal(fast.certified(torch.tensor([at], dtype=torch.float64)),
                       alone.certified(torch.tensor([at], dtype=torch.float64)))


def test_verdicts_only_makes_no_proof_where_nothing_is_deferred(monkeypatch):
    """The shipped default holds attention at its reference: no sample needs a per-sample
    proof, so even at an eps no sample reaches the cheap walk is the certificate, every
    radius the full one's."""
    from lofast.bounds.attention_norms import DeferredProofs

    model = load_checkpoint(default_checkpoint_path())
    x, y = load_bundled_sample().subset(range(16)).to_tensors()
    full = Certifier(model, CertifySettings()).certify(x, y).radius()

    def unused(*args):
        raise AssertionError("a deferred proof was made")

    monkeypatch.setattr(DeferredProofs, "make", unused)
    fast = Certifier(model, CertifySettings(verdicts_at=10.0)).certify(x, y)
    assert fast.bounded.any() and torch.equal(fast.radius(), full)


@pytest.mark.parametrize("value", [-0.05, 0.0, float("nan"), float("inf"), True, "abc"])
def test_verdicts_at_is_a_positive_radius(value):
    with pytest.raises(CertificationError, match="verdicts_at"):
        CertifySettings(verdicts_at=value)
    with pytest.raises(CertificationError, match="verdicts_at"):
        CertifySettings(verdicts_at=[0.05, value])
    with pytest.raises(CertificationError, match="at least one verdicts_at"):
        CertifySettings(verdicts_at=[])
    assert CertifySettings(verdicts_at="36/255").verdicts_at == (36 / 255,)
    assert CertifySettings(verdicts_at=[0.1, "0.05", 0.1]).verdicts_at == (0.05, 0.1)
    assert "verdicts at eps 0.05, 0.1" in CertifySettings(verdicts_at=(0.1, 0.05)).describe()
    assert "verdicts" not in CertifySettings().describe()


def live_block_of_65_tokens(depth=1):
    """A float64 model of ``depth`` 65-token blocks of width 48 (patch 4, 2 heads of 24) with
    position biases and strong live attention, six images and its own predictions as labels."""
    config = preset("tiny", patch_size=4, depth=depth, width=48, position_bias=True)
    model = create_model(config, seed=0).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "query" in name or "key" in name:
                p.mul_(8.0)
            elif name.endswith("position_bias"):
                p.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(2))
    x = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return model, x, model(x).argmax(dim=1)


def test_per_sample_product_norms_by_their_factors_on_65_tokens(monkeypatch):
    """||X B_l||, ||X A_l||, ||X A_l^T|| and their centred forms (65 x 48 products of rank 24)
    from 24 x 24 problems (``spectral.product_norm_upper``) against the formed products'
    eigensolver, on a 65-token block with position biases and strong live attention: radii
    within 1e-9 of each other, and PGD breaks none of the certificates."""
    from lofast.bounds import attention

    model, x, y = live_block_of_65_tokens()
    factored = []
    original = attention.product_norm_upper
    monkeypatch.setattr(attention, "product_norm_upper",
                        lambda A, right: factored.append(A.shape) or original(A, right))
    radius = Certifier(model, CertifySettings()).certify(x, y).radius()
    assert len(factored) == 5 and {shape[-1] for shape in factored} == {24}
    monkeypatch.setattr(attention, "_smaller_by_factor", lambda right, product: False)
    formed = Certifier(model, CertifySettings()).certify(x, y).radius()
    assert (radius > 0).all()
    assert torch.allclose(radius, formed, rtol=1e-9, atol=0)
    broken = pgd_l2(model, x, y, radius * 0.999, steps=50, restarts=3)
    assert not broken.any(), "PGD broke a certified sample"


def test_the_certifier_draws_all_blocks_reference_norms_in_one_run(monkeypatch):
    """Under a Lanczos method the reference norms of a model's blocks (65 tokens, position
    biases, the probabilistic reference forced from 65 x 48 coordinates) come from one batched
    run before the first batch (``VerifiedNorms.prepare``): radii the same to the bit as with
    each block's norm drawn alone when the walk first needs it."""
    from lofast.bounds import attention_spec
    from lofast.certification import certificate

    model, x, y = live_block_of_65_tokens(depth=3)
    monkeypatch.setattr(attention_spec, "PROBABILISTIC_REFERENCE_SIZE", 65 * 48)
    settings = CertifySettings(method=SpectralMethod(kind="lanczos"))
    runs = []
    original = attention_spec.operator_norm

    def recording(apply, adjoint, shape, batch, *args, **kwargs):
        runs.append((tuple(shape), batch, "start" in kwargs))
        return original(apply, adjoint, shape, batch, *args, **kwargs)

    monkeypatch.setattr(attention_spec, "operator_norm", recording)
    together = Certifier(model, settings).certify(x, y).radius()
    assert runs[0] == ((65, 48), 3, True)  # the three blocks' ||T_R||, before anything else
    assert [run for run in runs if run[2]] == [runs[0]]
    monkeypatch.setattr(certificate.VerifiedNorms, "prepare", lambda self, structure: None)
    runs.clear()
    alone = Certifier(model, settings).certify(x, y).radius()
    assert [run for run in runs if run[2]] == [((65, 48), 1, True)] * 3
    assert (together > 0).any() and torch.equal(together, alone)


@pytest.mark.parametrize("kind", ["verified", "lanczos"])
def test_the_accelerator_route_of_per_sample_norms_on_65_tokens(kind, monkeypatch):
    """What a GPU runs for per-sample matrices above 32 x 32 (a Cholesky proof in place of the
    eigensolver, ``spectral._proved_norms``), forced on the CPU for a 65-token block with
    position biases and strong live attention: every radius at most the CPU route's and within
    1e-5 of it, and PGD breaks none of the certificates."""
    from lofast.bounds import spectral

    model, x, y = live_block_of_65_tokens()
    settings = CertifySettings(method=SpectralMethod(kind=kind))
    cpu_route = Certifier(model, settings).certify(x, y).radius()
    proved = []
    original = spectral._proved_norms
    monkeypatch.setattr(spectral, "_takes_the_proof",
                        lambda M: min(M.shape[-2:]) > spectral.BATCHED_EIGENSOLVER_SIZE)
    monkeypatch.setattr(spectral, "_proved_norms", lambda M: proved.append(M.shape) or original(M))
    radius = Certifier(model, settings).certify(x, y).radius()
    # ||P_l - R_l||; X B_l, X A_l and the like (65 x 48) go by their factors on every device
    assert {shape[1:] for shape in proved} == {(65, 65)}
    assert (radius > 0).all() and (radius <= cpu_route).all()
    assert (radius >= cpu_route * (1 - 1e-5)).all()
    broken = pgd_l2(model, x, y, radius * 0.999, steps=50, restarts=3)
    assert not broken.any(), "PGD broke a certified sample"


def test_jacobian_slack_is_checked_and_named():
    for bad in (float("nan"), -0.1, 1.5, True, "0.1"):
        with pytest.raises(CertificationError, match="jacobian_slack"):
            CertifySettings(jacobian_slack=bad)
    with pytest.raises(CertificationError, match="differs"):
        CertifySettings(method=SpectralMethod(kind="dense"), jacobian_slack=0.5)
    assert CertifySettings().describe() == "lofast + softmax Jacobian"  # records as before
    assert CertifySettings(jacobian_slack=0.01).describe() == "lofast + softmax Jacobian"
    settings = CertifySettings(jacobian_slack=0.1, guarantee="probabilistic")
    assert settings.method.jacobian_slack == 0.1 and settings.method.kind == "lanczos"
    assert settings.describe() == "lofast + softmax Jacobian, Jacobian slack 0.1"
    assert CertifySettings(jacobian_slack=0.1).describe() == settings.describe()  # "auto"


@pytest.mark.parametrize("kind, model_name", [("lanczos", "trained"), ("verified", "trained"),
                                               ("verified", "trained_with_position_bias")])
def test_feature_bound_exceeds_pgd_feature_deviation(kind, model_name, request):
    """The composed radius bounds the pooled-feature change: maximise that change with PGD."""
    model, x, y = request.getfixturevalue(model_name)
    certifier = Certifier(model, CertifySettings(method=SpectralMethod(kind=kind)))
    x, y = x[:8].double(), y[:8]
    cert = certifier.certify(x, y)
    features = torch.nn.Sequential(*certifier.model.stages[:-1])
    for eps in (0.05, 0.3):
        bound = cert.feature_radius(torch.tensor([eps], dtype=torch.float64))[:, 0]
        with torch.no_grad():
            clean = features(x)
        best = torch.zeros(len(x), dtype=torch.float64)
        for restart in range(3):
            delta = (torch.randn_like(x) * (0.0 if restart == 0 else 1.0) + 1e-4).requires_grad_()
            opt = torch.optim.Adam([delta], lr=eps / 10)
            for _ in range(50):
                d = delta * torch.clamp(eps / delta.flatten(1).norm(dim=1), max=1)[:, None, None, None]
                dev = (features(x + d) - clean).norm(dim=1)
                best = torch.maximum(best, dev.detach())
                opt.zero_grad()
                (-dev.sum()).backward()
                opt.step()
        assert (best <= bound * (1 + 1e-9)).all()
        assert (best > 0.05 * bound).all()  # the attack really tried


def test_a_plain_head_is_certified_by_its_own_pair_norms(trained_with_plain_head):
    """Scaling a plain head's weight and bias by c scales every logit margin and every pair norm
    ||w_y - w_j|| by c, so the radii stay where they are: the certificate reads the head's own
    rows (a rule that took them as unit rows would grow the radii c times)."""
    model, x, y = trained_with_plain_head
    assert not model.stages[-1].normalized
    torch.testing.assert_close(model.structure()[-1].weight,
                               model.stages[-1].weight.detach().double())
    # the pair norms the margin test reads, against a dense float64 reference on the raw rows
    rows = model.stages[-1].weight.detach().double()
    torch.testing.assert_close(model.structure()[-1].pair_norms(y),
                               torch.cdist(rows, rows)[y], rtol=1e-12, atol=1e-12)
    radius = Certifier(model, CertifySettings()).certify(x, y).radius()
    assert (radius > 0).sum() >= 5
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        scaled.stages[-1].weight.mul_(8.0)
        scaled.stages[-1].bias.mul_(8.0)
        torch.testing.assert_close(scaled(x), 8.0 * model(x))
    torch.testing.assert_close(Certifier(scaled, CertifySettings()).certify(x, y).radius(),
                               radius, rtol=1e-9, atol=1e-12)


def test_verdicts_monotone_and_consistent_with_radius(certificate):
    verdicts = certificate.certified(EPS)
    assert (verdicts[:, 1:] <= verdicts[:, :-1]).all()
    radius = certificate.radius()
    for k, eps in enumerate(EPS.tolist()):
        assert torch.equal(verdicts[:, k], radius > eps) or \
            ((verdicts[:, k] != (radius > eps)) <= ((radius - eps).abs() < 1e-9)).all()



def test_only_samples_a_radius_can_certify_get_bounds(trained, monkeypatch):
    """The certifier bounds only the samples with every margin positive: the others get radius
    0, no verdict and an infinite feature radius, and the bounded ones get exactly the
    certificate that a batch of them alone gets (the per-sample work is theirs only)."""
    model, x, y = trained
    x, y = x[:12], y[:12].clone()
    y[::3] = (y[::3] + 1) % model.config.num_classes  # a third labelled wrongly
    certifier = Certifier(model, CertifySettings())
    walked = []
    original = radius_maps

    def counting(structure, activations, rules):
        walked.append(len(activations[0]))
        return original(structure, activations, rules)

    monkeypatch.setattr("lofast.certification.certificate.radius_maps", counting)
    mixed = certifier.certify(x, y)
    keep = mixed.bounded
    assert torch.equal(keep, (mixed.margins > 0).all(dim=1))
    assert 0 < int(keep.sum()) < 12 and not keep[::3].any()
    assert walked == [int(keep.sum())]
    alone = certifier.certify(x[keep], y[keep])
    assert alone.bounded.all()
    assert torch.equal(mixed.radius()[keep], alone.radius())
    assert torch.equal(mixed.feature_radius(EPS)[keep], alone.feature_radius(EPS))
    assert torch.equal(mixed.certified(EPS)[keep], alone.certified(EPS))
    assert (mixed.radius()[~keep] == 0).all() and not mixed.certified(EPS)[~keep].any()
    assert torch.isinf(mixed.feature_radius(EPS)[~keep]).all()
    walked.clear()
    wrong = certifier.certify(x[~keep], y[~keep])  # nothing to bound: no walk, no error
    assert walked == [] and wrong.steps == [] and not wrong.bounded.any()
    assert (wrong.radius() == 0).all() and not wrong.certified(EPS).any()
    records, _ = _batch_records(certifier, x, y, list(range(12)), [0.02, 0.1], {})
    for record, bounded in zip(records, keep.tolist()):
        for result in record.results.values():
            assert (result.bound is not None) == bounded
            assert result.reason == (None if bounded else "misclassified")

def test_first_projection_bound_skips_the_class_token(monkeypatch):
    """The class token enters the first LayerProject unperturbed, so only the patch tokens' norms
    set its local factor. On the shipped defaults the class token has been the shortest there
    (width 128: norm 0.72, patches 2.3 to 6.2; width 256: 0.64, patches 3.1 to 6.8 on the first
    30 bundled images); on images whose patch tokens all lie outside the ball, this takes the
    factor from 1 to about 1/(r - eps). Checked against PGD on the projected tokens,
    which must stay below the bound and come close to it."""
    model = load_checkpoint(default_checkpoint_path())
    x, y = load_bundled_sample().subset(list(range(30))).to_tensors()
    x = x.double()
    # the method only matters for the attention stages, which this test does not look at
    exact = CertifySettings(method=SpectralMethod(kind="verified"))
    certifier = Certifier(model, exact)
    prefix = torch.nn.Sequential(*certifier.model.stages[:2])  # embedding, first LayerProject
    with torch.no_grad():
        norms = certifier.model.stages[0](x).norm(dim=-1)  # (B, n) entering the projection
    outside = (norms[:, 1:].min(dim=1).values > 1.05) & (norms[:, 0] < 1.0)
    assert outside.sum() >= 6
    x, y = x[outside][:6], y[outside][:6]

    def first_two_steps(certifier):  # the certifier's own walk, over its first two stages
        _, activations = certifier.model.forward_with_activations(x)
        # (the walk maps every stage before the last spec it is given, taken as the head)
        steps = radius_maps(certifier.structure[:3], activations[:2], certifier.norms)
        assert len(steps) == 2
        return steps

    steps = first_two_steps(certifier)
    monkeypatch.setattr(PatchEmbed, "constant_tokens", 0)
    every_token = first_two_steps(Certifier(model, exact))
    for eps in (0.02, 0.2):
        radius = torch.full((len(x), 1), eps, dtype=torch.float64)
        bound = propagate(steps, radius)[:, 0]
        ratio = bound / propagate(every_token, radius)[:, 0]
        assert (ratio <= 1).all()
        if eps == 0.02:  # the patch tokens stay outside the ball: factor below 1
            assert (ratio < 1).all() and ratio.mean() < 0.85
        with torch.no_grad():
            clean = prefix(x)
        best = torch.zeros(len(x), dtype=torch.float64)
        for restart in range(3):
            g = torch.Generator().manual_seed(restart)
            delta = torch.randn(x.shape, generator=g, dtype=torch.float64)
            delta = (delta * eps / delta.flatten(1).norm(dim=1)[:, None, None, None])
            delta.requires_grad_()
            opt = torch.optim.Adam([delta], lr=eps / 20)
            for _ in range(100):
                norm = delta.flatten(1).norm(dim=1)[:, None, None, None]
                d = delta * (eps / norm)  # on the sphere: the deviation grows with the step
                dev = (prefix(x + d) - clean).flatten(1).norm(dim=1)
                best = torch.maximum(best, dev.detach())
                opt.zero_grad()
                (-dev.sum()).backward()
                opt.step()
        assert (best <= bound * (1 + 1e-9)).all()
        assert (best >= 0.7 * bound).all()


def test_certifier_computes_the_capped_weights_once(trained, certificate, monkeypatch):
    from lofast.models import layers

    model, x, y = trained
    certifier = Certifier(model, CertifySettings())
    fresh = copy.deepcopy(certifier.model)
    fresh.hold_effective_weights(False)
    with torch.no_grad():  # the held weights are the ones computed afresh
        assert torch.equal(certifier.model(x.double()), fresh(x.double()))
    caps = []
    monkeypatch.setattr(layers, "spectral_cap", lambda w, cap: caps.append(w) or w)
    held = certifier.certify(x, y)
    assert caps == []  # no SVD per batch: the copy holds its effective weights
    rescaled = [s for s in certifier.model.stages if isinstance(s, SLL)]  # and SLL's t
    assert rescaled and all(s.held_rescaling is not None for s in rescaled)
    assert torch.equal(held.margins, certificate.margins)
    assert torch.equal(held.radius(), certificate.radius())


def test_each_certifier_owns_its_per_model_quantities(trained, certificate):
    """No cache outlives a Certifier: a second one of the same weights builds its own stage
    specs (and their verified norms) and gives the same certificate; a model differing in one
    weight gets its own certificate too."""
    model, x, y = trained
    first, second = Certifier(model), Certifier(copy.deepcopy(model))
    assert second.structure is not first.structure
    assert all(a is not b for a, b in zip(first.structure, second.structure))
    assert torch.equal(second.certify(x, y).radius(), certificate.radius())
    changed = copy.deepcopy(model)
    with torch.no_grad():
        weight = changed.stages[0].weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0, dtype=weight.dtype))
    alone, again = Certifier(changed).certify(x, y), Certifier(changed).certify(x, y)
    assert torch.equal(alone.radius(), again.radius())


def _nudge_in_place(model):
    with torch.no_grad():
        model.stages[0].bias.add_(0.5)


def _nudge_through_data(model):  # PyTorch counts no version for this one
    weight = model.stages[0].weight.data
    weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0, dtype=weight.dtype))


def _load_other_weights(model):
    other = create_model(model.config)
    model.load_state_dict(other.state_dict())


def _narrow_the_first_projection(model):
    assert isinstance(model.stages[1], LayerProject)
    model.stages[1].radius = 0.5


@pytest.mark.parametrize("change", [_nudge_in_place, _nudge_through_data, _load_other_weights,
                                    _narrow_the_first_projection])
def test_a_certifier_refuses_once_its_model_changed(trained, change):
    """The certifier's copy and proofs are of the weights it was made for: certifying after
    the caller changed the model would certify a model the caller no longer has (the stale
    radii differ from a new certifier's), so it raises instead, naming the first change."""
    model, x, y = trained
    model = copy.deepcopy(model)
    certifier = Certifier(model)
    before = certifier.certify(x, y)
    change(model)
    with pytest.raises(CertificationError, match="model changed after this Certifier"):
        certifier.certify(x, y)
    with pytest.raises(CertificationError, match="stages.[01]"):
        certifier.make_proofs(x, y)
    if change is not _nudge_through_data:  # the old answer would have been wrong
        assert not torch.equal(Certifier(model).certify(x, y).radius(), before.radius())


def test_a_certifier_refuses_once_its_own_copy_changed(trained, certificate):
    model, x, y = trained
    certifier = Certifier(copy.deepcopy(model))
    with torch.no_grad():
        certifier.model.stages[0].bias.add_(0.5)  # the copy's forward pass would move, not its specs
    with pytest.raises(CertificationError, match="Certifier.model.*stages.0.bias"):
        certifier.certify(x, y)


def test_a_certifier_goes_on_where_the_model_keeps_its_values(trained, certificate):
    """A change of mode, dtype or device that keeps every value is no change of the model."""
    model, x, y = trained
    model = copy.deepcopy(model)
    certifier = Certifier(model)
    model.train()
    model.double()
    assert torch.equal(certifier.certify(x, y).radius(), certificate.radius())
    model.float().eval()
    assert torch.equal(certifier.certify(x, y).radius(), certificate.radius())
    model.half()  # rounds the weights: a different model
    with pytest.raises(CertificationError, match="model changed"):
        certifier.certify(x, y)


class _LouderHead(Head):
    """A subclass that changes the head's forward pass and keeps the spec of the head."""

    def forward(self, x):
        return super().forward(x) * 10


def _louder_by_hook(model):
    model.stages[-1].register_forward_hook(lambda module, inputs, out: out * 10)


def _louder_by_subclass(model):
    model.stages[-1].__class__ = _LouderHead


def _louder_by_instance_method(model):
    head = model.stages[-1]
    head.forward = types.MethodType(lambda self, x: Head.forward(self, x) * 10, head)


@pytest.mark.parametrize("louder, named", [
    (_louder_by_hook, "module stages.* has a forward hook"),
    (_louder_by_subclass, "stage .* \\(_LouderHead\\) defines its forward pass without a spec"),
    (_louder_by_instance_method, "module stages.* has a forward method of its own")])
def test_a_model_whose_forward_pass_departs_from_its_specs_is_refused(
        trained, louder, named, monkeypatch):
    """Logits scaled by 10 behind the specs' back: the specs bound the model without it, the
    margins grow tenfold, and the radii with them, which PGD breaks. So the certifier refuses
    such a model, made so before it or after; a subclass that changes nothing is taken."""
    from lofast.certification import certificate as certificate_module

    model, x, y = trained
    louder_model = copy.deepcopy(model)
    louder(louder_model)
    with pytest.raises(CertificationError, match=f"cannot certify this model: {named}"):
        Certifier(louder_model)
    later = copy.deepcopy(model)
    certifier = Certifier(later)
    louder(later)
    with pytest.raises(CertificationError, match=f"cannot certify this model now: {named}"):
        certifier.certify(x, y)
    monkeypatch.setattr(certificate_module, "foreign_part", lambda model: None)
    radius = Certifier(louder_model).certify(x, y).radius()  # what it would have certified
    inside = radius > 0
    assert pgd_l2(louder_model.double(), x[inside].double(), y[inside],
                  radius[inside] * 0.999, steps=50, restarts=2).any()


def test_a_subclass_that_keeps_the_forward_pass_of_its_stage_is_taken(trained, certificate):
    model, x, y = trained
    model = copy.deepcopy(model)
    model.stages[-1].__class__ = type("SameHead", (Head,), {})
    assert torch.equal(Certifier(model).certify(x, y).radius(), certificate.radius())


def test_a_hook_for_every_module_or_a_model_not_lofasts_is_refused(trained):
    model = trained[0]
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *arguments: None)
    try:
        with pytest.raises(CertificationError, match="registered for every module"):
            Certifier(model)
    finally:
        handle.remove()
    with pytest.raises(CertificationError, match="takes a LipschitzViT .* not Sequential"):
        Certifier(torch.nn.Sequential(*model.stages))
    subclassed = copy.deepcopy(model)
    subclassed.__class__ = type("OwnViT", (type(model),), {})  # may walk its stages otherwise
    with pytest.raises(CertificationError, match="of type OwnViT, not LipschitzViT"):
        Certifier(subclassed)
    bare = copy.deepcopy(model)
    bare.stages.insert(1, torch.nn.Identity())
    with pytest.raises(CertificationError, match="stage 1 \\(Identity\\) has no spec"):
        Certifier(bare)


def test_calls_from_several_threads_take_turns(trained, monkeypatch):
    """The per-model proofs are made on first use and shared, and the random starts are one
    stream: two threads' batches run one after the other, each as it would alone."""
    import threading
    import time

    model, x, y = trained
    certifier = Certifier(copy.deepcopy(model))
    events, original = [], Certifier._certify

    def watched(self, images, labels):
        events.append("enter")
        time.sleep(0.05)  # long enough for the other thread to come in, if it may
        try:
            return original(self, images, labels)
        finally:
            events.append("exit")

    monkeypatch.setattr(Certifier, "_certify", watched)
    results = []
    threads = [threading.Thread(target=lambda: results.append(certifier.certify(x, y)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert events == ["enter", "exit"] * 2 and len(results) == 2
    monkeypatch.undo()
    alone = Certifier(copy.deepcopy(model))
    first, second = alone.certify(x, y), alone.certify(x, y)
    assert torch.equal(results[0].radius(), first.radius())
    assert torch.equal(results[1].radius(), second.radius())


def test_probabilistic_and_exact_agree(trained):
    model, x, y = trained
    exact = Certifier(model, CertifySettings(method=SpectralMethod(kind="dense"))).certify(x, y)
    prob = Certifier(model, CertifySettings(guarantee="probabilistic")).certify(x, y)
    assert exact.guarantee is Guarantee.EXACT and exact.failure_probability == 0
    assert prob.guarantee is Guarantee.PROBABILISTIC and 0 < prob.failure_probability <= 1e-7
    a, b = exact.feature_radius(EPS), prob.feature_radius(EPS)
    verified = Certifier(model, CertifySettings(method=SpectralMethod(kind="verified")))
    c = verified.certify(x, y)
    assert c.guarantee is Guarantee.EXACT and c.failure_probability == 0
    v = c.feature_radius(EPS)
    # the verified and Lanczos methods also bound the norm of each block's Jacobian T_X + D_X
    # directly (bounds.near_reference), below the dense method's zeta + ||D_X||; they differ
    # only where that bound is loose (Cholesky proof or Lanczos); PGD checks soundness
    for bound in (v, b):
        assert (bound >= a * 0.9).all()
        assert (bound <= a * (1 + 5e-3)).all()
    assert ((b - v).abs() <= 5e-3 * v).all()


def test_estimate_mode_is_labelled(trained):
    model, x, y = trained
    cert = Certifier(model, CertifySettings(method=SpectralMethod(kind="power"))).certify(x, y)
    assert cert.guarantee is Guarantee.ESTIMATE


def test_bound_variants_are_ordered(trained):
    model, x, y = trained
    radii = {}
    for bound in ("lofast-tight", "lofast", "naive"):
        for kappa in (0.5, 1.0):
            s = CertifySettings(bound=bound, kappa=kappa, method=SpectralMethod(kind="dense"))
            radii[bound, kappa] = Certifier(model, s).certify(x, y).radius()
    assert (radii["lofast-tight", 0.5] >= radii["lofast", 0.5] - 1e-9).all()
    assert (radii["lofast", 0.5] >= radii["naive", 0.5] - 1e-9).all()
    assert (radii["lofast", 0.5] >= radii["lofast", 1.0] - 1e-9).all()
    plain = CertifySettings(local_projection=False, method=SpectralMethod(kind="dense"))
    assert (radii["lofast", 0.5] >= Certifier(model, plain).certify(x, y).radius() - 1e-9).all()
    # the default second-order refinement only ever adds to the radius
    unrefined = CertifySettings(softmax_jacobian=False, method=SpectralMethod(kind="dense"))
    assert (radii["lofast", 0.5]
            >= Certifier(model, unrefined).certify(x, y).radius() - 1e-9).all()


def test_bad_inputs(trained):
    model, x, y = trained
    certifier = Certifier(model)
    bad = x[:2].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(CertificationError, match="NaN"):
        certifier.certify(bad, y[:2])
    with pytest.raises(CertificationError, match=r"\[0, 1\]"):
        certifier.certify(x[:2] + 2, y[:2])
    with pytest.raises(CertificationError):
        CertifySettings(bound="nope")


def test_sll_check_is_a_rigorous_proof():
    """An SLL layer passes only with a proof that diag(t) - W^T W is PSD, rounding included:
    refused when its critical scale is missed by 1e-13, accepted with the model's own margin."""
    from lofast.bounds.stages import SLLSpec, sll_scaled_norm_upper

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 48, generator=g, dtype=torch.float64)
    q = torch.rand(48, generator=g, dtype=torch.float64) + 0.5
    critical = torch.linalg.matrix_norm(weight / q.sqrt(), ord=2) ** 2  # t = c q is PSD iff c >= this
    assert 1.0 <= sll_scaled_norm_upper(weight, q * critical) <= 1.0 + 2e-6
    with pytest.raises(CertificationError, match="not provably 1-Lipschitz"):
        SLLSpec(weight, torch.zeros(48, dtype=torch.float64), q * critical * (1 - 1e-13)).check(0)
    SLLSpec(weight, torch.zeros(48, dtype=torch.float64), q * critical * (1 + 1e-4)).check(0)


def test_non_finite_position_bias_is_refused_by_the_certifier():
    """The attention spec of a bias being trained skips its NaN check (no read-back in a
    training step); the certifier's specs are detached copies and are refused, whichever
    check reaches them first."""
    from lofast.config import preset
    from lofast.models.vit import create_model

    model = create_model(preset("tiny", position_bias=True), seed=0)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if n.endswith("position_bias")).fill_(
            float("nan"))
    model.train()
    model.structure(differentiable=True)  # training: no read-back, no refusal
    model.eval()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises((CertificationError, ValueError), match="NaN"):
        Certifier(model).certify(x, torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("patch, width, chosen", [(8, 256, "exact"), (4, 96, "probabilistic")])
def test_auto_guarantee_is_exact_unless_the_model_is_large(patch, width, chosen):
    """The default guarantee "auto" resolves per model: exact for the shipped shape (17 tokens
    of width 256: 4,352 coordinates a block), probabilistic from 6,144 on (65 tokens of width
    96: 6,240), where (n d)^2 Gram matrices grow too costly; the certificate and the settings
    say which was taken, and a guarantee given by name is kept whatever the size."""
    model = create_model(preset("lofast-s", depth=1, width=width, patch_size=patch,
                                position_bias=True), seed=0).eval()
    certifier = Certifier(model)
    settings = certifier.settings
    assert CertifySettings().guarantee == "auto" and settings.guarantee == chosen
    assert settings.method.guarantee is Guarantee(chosen)
    tokens = model.config.num_tokens
    assert f"{tokens} tokens x width {width} = {tokens * width:,}" in settings.automatic
    x = load_bundled_sample().subset(range(2)).to_tensors()[0]
    with torch.no_grad():
        y = model(x).argmax(dim=1)
    certificate = certifier.certify(x, y)
    assert certificate.guarantee is Guarantee(chosen)
    assert (certificate.failure_probability > 0) == (chosen == "probabilistic")
    for name in ("exact", "probabilistic"):
        kept = Certifier(model, CertifySettings(guarantee=name)).settings
        assert kept.guarantee == name and kept.automatic is None
