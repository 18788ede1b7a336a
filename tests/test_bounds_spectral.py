"""Spectral norms with a guarantee: dense and Lanczos bound the true norm from above, tightly;
power iteration is an estimate from below and says so."""

import math

import numpy as np
import pytest
import torch

from lofast.bounds import krylov, spectral, verified
from lofast.bounds.krylov import BREAKDOWN_TOL
from lofast.bounds.spectral import (
    ROUNDING_MARGIN,
    Guarantee,
    SpectralMethod,
    kw_failure_bound,
    lanczos_plan,
    matrix_norm_upper,
    operator_norm,
    weakest_guarantee,
)

SLACK = SpectralMethod().relative_slack


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """These are many tiny tensor operations: one thread avoids the OpenMP synchronisation that
    dominates them (and stalls badly when other processes share the two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def with_singular_values(batch, rows, cols, values, seed):
    """(batch, rows, cols) matrices U diag(values) V^T with random orthogonal U, V."""
    rng = np.random.default_rng(seed)
    out = np.zeros((batch, rows, cols))
    for b in range(batch):
        u, _ = np.linalg.qr(rng.standard_normal((rows, len(values))))
        v, _ = np.linalg.qr(rng.standard_normal((cols, len(values))))
        out[b] = (u * values) @ v.T
    return torch.from_numpy(out)


def explicit_norm(M, kind, generator=None, **options):
    """operator_norm of explicit matrices (B, m, k) given as matrix-free maps on (B, k)."""
    method = SpectralMethod(kind=kind, **options)
    return operator_norm(lambda x: (M @ x[..., None])[..., 0],
                         lambda y: (M.mT @ y[..., None])[..., 0],
                         (M.shape[2],), M.shape[0], method, generator=generator)


def exact_norm(M):
    """Spectral norms of a batch (..., m, k), by numpy's LAPACK SVD (independent of torch)."""
    return torch.from_numpy(np.linalg.norm(M.numpy(), ord=2, axis=(-2, -1)))


def cases():
    rng = np.random.default_rng(0)
    clustered = 1.0 - 1e-7 * np.arange(40)  # many top singular values within 4e-6
    graded = np.logspace(0, -12, 30)  # condition number 1e12
    return {
        "square": torch.from_numpy(rng.standard_normal((3, 40, 40))),
        "wide": torch.from_numpy(rng.standard_normal((2, 7, 90))),
        "tall": torch.from_numpy(rng.standard_normal((2, 90, 7))),
        # smaller side 290 > 276 default steps: the Kuczynski-Wozniakowski path (eps > 0)
        "large": torch.from_numpy(rng.standard_normal((2, 300, 290))),
        "ill-conditioned": with_singular_values(2, 60, 50, graded, 1),
        "clustered": with_singular_values(1, 300, 290, clustered, 2),
        "rank-deficient": with_singular_values(3, 50, 60, np.array([3.0, 2.0, 0.5]), 3),
        "scaled": 1e-150 * torch.from_numpy(rng.standard_normal((2, 20, 30))),
    }


CASES = cases()


@pytest.mark.parametrize("kind, tolerance", [("dense", ROUNDING_MARGIN + 1e-12),
                                             ("verified", 2 * SLACK)])
@pytest.mark.parametrize("name", list(CASES))
def test_deterministic_norm_is_a_tight_upper_bound(name, kind, tolerance):
    """dense: within the rounding margin; verified (Cholesky): within (1 + 2 slack)."""
    M = CASES[name]
    exact = exact_norm(M)
    bound = explicit_norm(M, kind)
    assert bound.dtype == torch.float64 and bound.shape == exact.shape
    assert (bound >= exact).all()
    assert (bound <= exact * (1 + tolerance)).all()
    assert SpectralMethod(kind=kind).guarantee is Guarantee.EXACT


@pytest.mark.parametrize("name", list(CASES))
def test_lanczos_is_a_tight_upper_bound(name):
    M = CASES[name]
    exact = exact_norm(M)
    g = torch.Generator().manual_seed(1)
    lanczos = explicit_norm(M, "lanczos", g)
    assert (lanczos >= exact).all()
    assert (lanczos <= exact * (1 + SLACK + 1e-12)).all()


@pytest.mark.parametrize("name", ["square", "rank-deficient", "large"])
def test_power_is_an_estimate_from_below(name):
    M = CASES[name]
    exact = exact_norm(M)
    g = torch.Generator().manual_seed(2)
    power = explicit_norm(M, "power", g, power_iterations=30)
    assert (power <= exact * (1 + 1e-12)).all()
    assert (power >= 0.5 * exact).all()
    assert SpectralMethod(kind="power").guarantee is Guarantee.ESTIMATE
    assert "NOT" in SpectralMethod(kind="power").describe()


def test_matrix_norm_upper_on_batched_explicit_matrices():
    rng = np.random.default_rng(4)
    for shape in [(5, 3), (3, 5), (2, 4, 6, 9), (1, 1)]:
        M = torch.from_numpy(rng.standard_normal(shape))
        exact = torch.from_numpy(np.asarray(np.linalg.norm(M.numpy(), ord=2, axis=(-2, -1))))
        upper = matrix_norm_upper(M.float())  # float32 input is promoted to float64
        assert upper.dtype == torch.float64 and upper.shape == shape[:-2]
        assert (upper >= exact.to(upper) * (1 - 1e-6)).all()  # exact of the float32 input
        upper64 = matrix_norm_upper(M)
        assert (upper64 >= exact).all() and (upper64 <= exact * (1 + 2 * ROUNDING_MARGIN)).all()
    assert matrix_norm_upper(torch.zeros(3, 4, 4)).eq(0).all()
    with pytest.raises(ValueError):
        matrix_norm_upper(torch.ones(3))


def test_matrix_norm_upper_on_zero_tiny_and_huge_matrices():
    """Matrices whose Gram matrix would underflow or overflow are rescaled exactly first; in one
    batch with ordinary ones, each still gets its own tight upper bound; a NaN or an infinite
    entry gets +inf."""
    rng = np.random.default_rng(5)
    M = torch.from_numpy(rng.standard_normal((5, 6, 9)))
    M[1] *= 1e-200  # squares underflow to zero
    M[2] = 0.0
    M[3] *= 1e200  # squares overflow
    M[4] *= 2.0 ** -310  # diagonal just outside the unscaled range
    exact = torch.from_numpy(np.asarray(np.linalg.norm(M.numpy(), ord=2, axis=(-2, -1))))
    for matrices, norms in ((M, exact), (M.mT, exact), (M[1], exact[1])):
        upper = matrix_norm_upper(matrices)
        assert upper.shape == norms.shape
        assert (upper >= norms).all() and (upper <= norms * (1 + 2 * ROUNDING_MARGIN)).all()
    assert matrix_norm_upper(M)[2] == 0
    M[3, 0, 0], M[4, 1, 1] = math.nan, math.inf  # no bound but +inf, and no eigensolver error
    upper = matrix_norm_upper(M, per_sample=True)
    assert upper[3] == math.inf and upper[4] == math.inf
    assert (upper[[0, 1, 2]] == matrix_norm_upper(M[[0, 1, 2]])).all()


def test_proved_norms_of_the_accelerator_route():
    """What ``matrix_norm_upper`` runs on an accelerator for batches of Grams above 32 x 32 (a
    Cholesky proof after a 32-step Lanczos estimate): an upper bound within PROVED_NORM_SLACK of
    the dense float64 norm, for both orientations, a dominant direction, 40 singular values
    within 4e-8, and the zero, tiny and huge matrices the rescaled route takes (a too low
    estimate's retry: ``test_verified_retries_a_too_low_estimate``)."""
    rng = np.random.default_rng(6)
    M = torch.from_numpy(rng.standard_normal((8, 40, 70)))
    M[0, :, :5] += 10.0 * torch.from_numpy(rng.standard_normal((40, 1)))  # a dominant direction
    u, _, v = torch.linalg.svd(M[1], full_matrices=False)
    clustered = 1.0 - 1e-9 * torch.arange(40, dtype=torch.float64)  # all within 4e-8
    M[1] = u @ torch.diag(clustered) @ v
    M[2] = 0.0
    M[3] *= 1e-200
    M[4] *= 1e200
    M[5] *= 2.0 ** -310  # the Gram's diagonal just outside the unscaled range
    exact = torch.linalg.matrix_norm(M, ord=2)
    for matrices in (M, M.mT):
        upper = spectral._proved_norms(matrices.clone())
        assert (upper >= exact).all()
        assert (upper <= exact * (1 + 1.01 * spectral.PROVED_NORM_SLACK)).all()
        assert upper[2] == 0


def test_product_norms_from_r_by_r_problems():
    """``product_norm_upper``: ||A B^T|| for per-sample A (B, h, n, r) and fixed B (h, d, r)
    from r x r problems, an upper bound within 2 ROUNDING_MARGIN of the dense float64 norm for
    ordinary factors; for a B of singular values down to 1e-7, a B with a zero and with a
    repeated column, and zero, tiny and huge A, never looser than the bound of the formed
    product by more than 2 ROUNDING_MARGIN, and never below the norm; +inf for a NaN."""
    rng = np.random.default_rng(7)
    A = torch.from_numpy(rng.standard_normal((6, 3, 20, 5)))
    B = torch.from_numpy(rng.standard_normal((3, 12, 5)))
    exact = torch.linalg.matrix_norm(A @ B.mT, ord=2)
    upper = spectral.product_norm_upper(A, spectral.product_factor(B))
    assert upper.shape == (6, 3)
    assert (upper >= exact).all() and (upper <= exact * (1 + 2 * ROUNDING_MARGIN)).all()
    u, _, v = torch.linalg.svd(B[0], full_matrices=False)
    B[0] = u @ torch.diag(10.0 ** -torch.arange(5.0, dtype=torch.float64) ** 1.75) @ v
    B[1, :, 0] = 0.0
    B[2, :, 1] = B[2, :, 2]
    A[0] = 0.0
    A[1] *= 1e-200
    A[2] *= 1e200
    A[3, 0, 0, 0] = math.nan
    finite = torch.isfinite(A).flatten(2).all(dim=2)
    exact = torch.linalg.matrix_norm(torch.where(finite[..., None, None], A, 0.0) @ B.mT, ord=2)
    upper = spectral.product_norm_upper(A, spectral.product_factor(B))
    formed = matrix_norm_upper(A[finite] @ B.expand(6, -1, -1, -1)[finite].mT, per_sample=True)
    assert (upper[finite] >= exact[finite]).all()
    assert (upper[finite] <= formed * (1 + 2 * ROUNDING_MARGIN)).all()
    assert (upper[0] == 0).all() and upper[3, 0] == math.inf


def test_products_go_by_their_factors_below_half_both_sides_and_32_off_the_cpu():
    """``takes_the_factors``: a rank at most half of both sides of the product, and on an
    accelerator (the meta device stands in) at most 32, beyond which its r x r eigensolver
    would loop."""
    for device, rank, expected in [("cpu", 16, True), ("cpu", 40, True), ("cpu", 41, False),
                                   ("meta", 16, True), ("meta", 32, True), ("meta", 40, False)]:
        product = torch.empty(4, 8, 80, 128, device=device)
        assert spectral.takes_the_factors(rank, product) is expected, (device, rank)
    assert not spectral.takes_the_factors(16, torch.empty(4, 8, 17, 128))


def test_product_norms_cover_the_rounding_of_a_nearly_singular_factor(monkeypatch):
    """B's two columns 2^22 v and 2^22 v + w (integers) make B^T B nearly singular, and its
    float64 Gram and square root lose the small direction along which A = a (1, -1) reads B:
    the r x r eigenvalue alone falls below the exact ||A B^T|| = a ||w|| (the products are
    exact in float64). The rounding term E sends such samples to the formed product; the
    mutation that drops E fails."""
    generator = torch.Generator().manual_seed(1)
    cases = []
    for _ in range(20):
        v = torch.randint(-3, 4, (512,), generator=generator).double()
        w = torch.randint(-1, 2, (512,), generator=generator).double()
        B = torch.stack([2.0 ** 22 * v, 2.0 ** 22 * v + w], dim=1)
        A = torch.randint(1, 4, (2, 1), generator=generator).double() * torch.tensor([1.0, -1.0])
        exact = torch.linalg.matrix_norm(A @ B.mT, ord=2)
        factor = spectral.product_factor(B)
        assert spectral.product_norm_upper(A, factor) >= exact
        cases.append((A, factor, exact))
    monkeypatch.setattr(spectral, "_product_rounding", lambda A, *rest: A.new_zeros(()))
    assert any(spectral.product_norm_upper(A, factor) < exact for A, factor, exact in cases)


def test_matrix_norm_upper_proves_per_sample_matrices_above_32_only_off_the_cpu(monkeypatch):
    for device, shape, proved in (("meta", (2, 3, 33, 40), True), ("meta", (2, 3, 40, 33), True),
                                  ("meta", (1, 33, 40), True), ("meta", (2, 3, 32, 40), False),
                                  ("cpu", (2, 3, 33, 40), False)):
        assert spectral._takes_the_proof(torch.zeros(shape, device=device)) is proved
    proved = []
    monkeypatch.setattr(spectral, "_proved_norms", lambda M: proved.append(M.shape) or M[..., 0, 0])
    monkeypatch.setattr(spectral, "_takes_the_proof", lambda M: True)
    M = torch.randn(2, 3, 40, 50, dtype=torch.float64)
    assert matrix_norm_upper(M, per_sample=True).shape == (2, 3) and proved == [(6, 40, 50)]
    assert matrix_norm_upper(M[0, 0], per_sample=True).shape == ()  # a lone matrix: a scalar
    matrix_norm_upper(M)  # weights and other per-model matrices: the exact route everywhere
    assert proved == [(6, 40, 50), (1, 40, 50)]


def test_matrix_norm_upper_svd_route(monkeypatch):
    # above GRAM_LIMIT the norm comes from the SVD instead of the Gram matrix
    monkeypatch.setattr(spectral, "GRAM_LIMIT", 10)
    M = CASES["ill-conditioned"]
    exact = exact_norm(M)
    upper = matrix_norm_upper(M)
    assert (upper >= exact).all() and (upper <= exact * (1 + 2 * ROUNDING_MARGIN)).all()


def test_lanczos_taken_in_stages_matches_one_run():
    # a deflation grows its run size by size: m steps in stages are m steps at once, to the bit
    g = torch.Generator().manual_seed(41)
    A = torch.randn(3, 90, 90, generator=g, dtype=torch.float64)
    A = A @ A.mT

    def gram(q):
        return (A @ q[..., None])[..., 0]

    start = torch.randn(3, 90, generator=g, dtype=torch.float64)
    start = start / torch.linalg.vector_norm(start, dim=1, keepdim=True)
    whole = krylov.LanczosRun(gram, start, 40)
    whole.advance(40)
    staged = krylov.LanczosRun(gram, start, 60)
    for m in (7, 7, 23, 40):
        staged.advance(m)
    assert torch.equal(staged.tridiagonal(), whole.tridiagonal())
    assert torch.equal(staged.basis, whole.basis)
    values, vectors = staged.ritz_pairs(5)
    assert torch.equal(values, whole.ritz_pairs(5)[0])
    assert torch.allclose(values[:, 0], torch.linalg.eigvalsh(A)[:, -1], rtol=1e-10)
    assert torch.allclose(staged.ritz_values()[:, :5], values, rtol=1e-12)
    assert vectors.shape == (3, 5, 90)
    for bad in (39, 61):
        with pytest.raises(ValueError, match="cannot advance"):
            staged.advance(bad)


@pytest.mark.parametrize("dim", [1, 2, 25, 276, 277, 289, 640, 2176, 8320, 10**5])
@pytest.mark.parametrize("p, r", [(1e-9, 1e-3), (1e-3, 1e-2), (1e-12, 1e-4)])
def test_lanczos_plan_satisfies_the_kw_bound(dim, p, r):
    method = SpectralMethod(failure_probability=p, relative_slack=r)
    plan = lanczos_plan(dim, method)
    assert 1 <= plan.steps <= dim
    if plan.eps == 0.0:  # full Krylov space: exact in exact arithmetic
        assert plan.steps == dim
        return
    assert kw_failure_bound(dim, plan.steps, plan.eps) <= p
    assert kw_failure_bound(dim, plan.steps - 1, plan.eps) > p  # and no step wasted
    # the returned bound sqrt(xi / ((1 - eps)(1 - tol))) (1 + margin) is (1 + r) sqrt(xi)
    inflation = (1 + ROUNDING_MARGIN) / math.sqrt((1 - plan.eps) * (1 - BREAKDOWN_TOL))
    assert inflation == pytest.approx(1 + r, rel=1e-13)


def test_kw_bound_formula():
    # 1.648 sqrt(N) exp(-(2k - 1) sqrt(eps)) with k = steps - 1
    assert kw_failure_bound(100, 11, 0.01) == pytest.approx(1.648 * 10 * math.exp(-1.9))


def test_default_step_counts():
    assert lanczos_plan(640, SpectralMethod()).steps == 276
    assert lanczos_plan(8320, SpectralMethod()).steps == 290


def test_breakdown_is_handled():
    g = torch.Generator().manual_seed(6)
    n = 300  # above the default step count (271 here), so the recursion must stop early
    identity = torch.eye(n, dtype=torch.float64)
    u, v = torch.randn(2, n, generator=g, dtype=torch.float64)
    rank_one = 2.5 * torch.outer(u / u.norm(), v / v.norm())
    random = torch.randn(n, n, generator=g, dtype=torch.float64)
    M = torch.stack([identity, rank_one, torch.zeros(n, n, dtype=torch.float64), random])
    exact = exact_norm(M)
    for kind in ("lanczos", "dense"):
        result = explicit_norm(M, kind, torch.Generator().manual_seed(7))
        assert torch.isfinite(result).all()
        assert (result >= exact).all()
        assert (result <= exact * (1 + SLACK + 1e-12)).all()
    assert explicit_norm(M, "power", g)[2] == 0


def test_reorthogonalisation_repeats_where_a_pass_cancels(monkeypatch):
    # w = q_0 + 1e-10 r (r orthogonal to the basis): one pass leaves a vector of norm 1e-10
    # whose components along the basis are rounding of w's, about 1e-16: 1e-6 of it; the second
    # pass, run for that sample alone, restores orthogonality to working precision
    g = torch.Generator().manual_seed(10)
    n, j = 400, 30
    frame = torch.linalg.qr(torch.randn(n, j + 2, generator=g, dtype=torch.float64)).Q.mT
    previous = frame[:j].expand(3, j, n).contiguous()
    r = frame[j]
    w = torch.stack([frame[0] + 1e-10 * r, frame[j + 1] + 0.3 * frame[1], 1e-10 * r])

    def leftover(out):
        return ((previous @ out[:, :, None])[:, :, 0].norm(dim=1) / out.norm(dim=1))

    out, norm = krylov._reorthogonalise(w, previous)
    assert torch.allclose(norm, out.norm(dim=1), rtol=0, atol=0)
    assert leftover(out)[0] < 1e-14 and (leftover(out) < 1e-14).all()
    for sample in range(3):  # each sample's bits do not depend on its batch
        alone, _ = krylov._reorthogonalise(w[sample: sample + 1], previous[sample: sample + 1])
        assert torch.equal(alone[0], out[sample])
    monkeypatch.setattr(krylov, "REPEAT_BELOW", 0.0)  # one pass only: the first sample drifts
    once, _ = krylov._reorthogonalise(w, previous)
    assert leftover(once)[0] > 1e-9
    assert torch.equal(once[1:], out[1:])  # the others took one pass anyway


def test_lanczos_basis_stays_orthonormal_through_clusters():
    # four clusters of 50 eigenvalues 1e-9 wide: the Krylov space nearly closes every 4 steps
    # (beta ~ 1e-8 of the norm), the case where reorthogonalisation matters
    g = torch.Generator().manual_seed(11)
    centres = torch.tensor([1.0, 0.7, 0.4, 0.1], dtype=torch.float64)
    values = (centres[:, None] + 1e-9 * torch.rand(4, 50, generator=g, dtype=torch.float64))
    rotation = torch.linalg.qr(torch.randn(200, 200, generator=g, dtype=torch.float64)).Q
    A = (rotation * values.flatten()) @ rotation.mT
    A = (A + A.mT) / 2
    start = torch.randn(2, 200, generator=g, dtype=torch.float64)
    start = start / start.norm(dim=1, keepdim=True)
    run = krylov.LanczosRun(lambda q: q @ A, start, 40)
    run.advance(40)
    tridiagonal, basis = run.tridiagonal(), run.basis
    for b in range(2):
        kept = basis[b][basis[b].norm(dim=1) > 0]
        assert kept.shape[0] >= 12
        eye = torch.eye(kept.shape[0], dtype=torch.float64)
        assert (kept @ kept.mT - eye).abs().max() < 1e-13
    top = torch.linalg.eigvalsh(tridiagonal)[:, -1]
    exact = torch.linalg.eigvalsh(A)[-1]
    assert (top <= exact * (1 + 1e-14)).all() and (top >= exact - 1e-8).all()


def test_determinism_for_a_seed():
    M = CASES["large"]
    runs = [explicit_norm(M, kind, torch.Generator().manual_seed(8))
            for kind in ("lanczos", "lanczos", "power", "power")]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[2], runs[3])


def test_operator_norm_on_matrix_shaped_inputs():
    # maps on (B, n, d) -> (B, n, n): G -> G C^T with C (B, n, d); norm = ||C||
    g = torch.Generator().manual_seed(9)
    C = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    exact = exact_norm(C)
    for kind in ("dense", "lanczos"):
        result = operator_norm(lambda G: G @ C.mT, lambda Y: Y @ C, (4, 6), 3,
                               SpectralMethod(kind=kind), generator=g)
        assert (result >= exact).all() and (result <= exact * (1 + SLACK + 1e-12)).all()


def test_method_validation_and_descriptions():
    for bad in ({"kind": "svd"}, {"failure_probability": 0.0}, {"failure_probability": 1.0},
                {"relative_slack": 0.0}, {"power_iterations": 0}):
        with pytest.raises(ValueError):
            SpectralMethod(**bad)
    assert SpectralMethod().guarantee is Guarantee.PROBABILISTIC
    assert SpectralMethod(kind="dense").guarantee is Guarantee.EXACT
    line = SpectralMethod().describe(640)
    assert line.startswith("probabilistic") and "276 steps" in line and "1e-09" in line
    assert SpectralMethod(kind="dense").describe().startswith("exact")
    assert weakest_guarantee() is Guarantee.EXACT
    assert weakest_guarantee(Guarantee.EXACT, Guarantee.PROBABILISTIC) \
        is Guarantee.PROBABILISTIC
    assert weakest_guarantee(Guarantee.ESTIMATE, Guarantee.PROBABILISTIC) is Guarantee.ESTIMATE
    with pytest.raises(ValueError):
        operator_norm(lambda x: x, lambda y: y, (3,), 1, SpectralMethod(), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Cholesky-verified norms: deterministic upper bounds, within (1 + 2 slack) of the exact norm.


def degenerate_matrices():
    """(B, m, k) batches with awkward spectra, each with its exact norm."""
    g = torch.Generator().manual_seed(10)
    n = 90  # Gram matrices above SMALL_GRAM: the Lanczos estimate path
    u, v = torch.randn(2, n, generator=g, dtype=torch.float64)
    rank_one = 3.0 * torch.outer(u / u.norm(), v / v.norm())
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    repeated = q * torch.cat([torch.full((5,), 2.0), torch.linspace(1.9, 0.1, n - 5)]).to(q)
    random = torch.randn(n, n, generator=g, dtype=torch.float64)
    base = torch.stack([torch.zeros(n, n, dtype=torch.float64), rank_one, repeated, random,
                        torch.eye(n, dtype=torch.float64)])
    return {"plain": base, "tiny": 1e-150 * base, "huge": 1e150 * base,
            "small-gram": base[:, :20, :30], "tall": torch.randn(3, 120, 70, generator=g,
                                                                   dtype=torch.float64)}


@pytest.mark.parametrize("name", list(degenerate_matrices()))
def test_verified_gram_norm_on_degenerate_batches(name):
    M = degenerate_matrices()[name]
    exact = exact_norm(M)
    gram, error = verified.gram_with_error(M)
    assert torch.equal(gram, gram.mT)
    for symmetric in (True, False):
        bound = verified.verified_gram_norm(gram, gram_error=error, symmetric=symmetric)
        assert (bound >= exact).all(), (bound, exact)
        assert (bound <= exact * (1 + 2 * SLACK)).all(), (bound / exact)
    if name == "plain":
        assert bound[0] == 0  # the zero operator: exactly 0
    # through operator_norm (materialised, rescaled, Gram, verified)
    via_operator = explicit_norm(M, "verified")
    assert (via_operator >= exact).all() and (via_operator <= exact * (1 + 2 * SLACK)).all()


def test_verified_gram_norm_reads_only_the_lower_triangle():
    g = torch.Generator().manual_seed(11)
    A = torch.randn(4, 90, 80, generator=g, dtype=torch.float64)
    gram, error = verified.gram_with_error(A)
    exact = exact_norm(A)
    garbage = gram.clone()
    upper = torch.triu(torch.ones(80, 80, dtype=torch.bool), diagonal=1)
    garbage[:, upper] = float("nan")
    bound = verified.verified_gram_norm(garbage, gram_error=error)  # symmetrised from below
    assert (bound >= exact).all() and (bound <= exact * (1 + 2 * SLACK)).all()
    # the assumption behind verified_norm_from_negated_gram: cholesky_ex and eigvalsh read
    # only the lower triangle (NaN above the diagonal changes nothing), in C and Fortran order
    S = (torch.eye(80, dtype=torch.float64) * 1e3 - gram)
    S_garbage = S.clone()
    S_garbage[:, upper] = float("nan")
    for candidate in (S_garbage, S_garbage.mT.contiguous().mT):
        assert torch.equal(torch.linalg.cholesky_ex(candidate).L, torch.linalg.cholesky_ex(S).L)
        assert torch.equal(torch.linalg.eigvalsh(candidate, UPLO="L"), torch.linalg.eigvalsh(S))
        # the proof's own factorisation (in place, on a copy) passes and leaves its input alone
        before = candidate.clone()
        assert verified._cholesky_passes(candidate).all()
        assert torch.equal(candidate.isnan(), upper.expand_as(candidate))
        assert torch.equal(candidate.nan_to_num(), before.nan_to_num())
    # a Fortran-ordered matrix given a batch dimension by indexing (strides (N, 1, N)), as the
    # deflation's complement is: the same verdict, its input left alone
    single = S_garbage[0].mT.contiguous().mT[None]
    before = single.clone()
    assert verified._cholesky_passes(single).all()
    assert torch.equal(single.nan_to_num(), before.nan_to_num())
    assert not verified._cholesky_passes(-gram[0].mT.contiguous().mT[None]).any()
    assert (torch.linalg.cholesky_ex(-gram).info > 0).all()  # and a failure is reported
    failing = -gram.mT.contiguous().mT
    assert not verified._cholesky_passes(failing).any() and torch.equal(failing, -gram)


def test_in_place_cholesky_factors_the_matrix_itself_or_a_copy():
    g = torch.Generator().manual_seed(12)
    A = torch.randn(3, 70, 60, generator=g, dtype=torch.float64)
    gram, _ = verified.gram_with_error(A)
    S = torch.eye(60, dtype=torch.float64) * 1e3 - gram
    expected = torch.linalg.cholesky(S)
    fortran = S.mT.contiguous().mT  # batched Fortran order: factored where it lies
    assert verified._cholesky_passes(fortran, in_place=True).all()
    assert torch.equal(torch.tril(fortran), expected)
    single = S[1].mT.contiguous().mT[None]  # strides (N, 1, N): a lone matrix, also in place
    assert verified._cholesky_passes(single, in_place=True).all()
    assert torch.equal(torch.tril(single[0]), expected[1])
    rows = S.clone()  # C order: LAPACK cannot factor it in place, so a copy is, as before
    assert verified._cholesky_passes(rows, in_place=True).all() and torch.equal(rows, S)
    failing = (-gram).mT.contiguous().mT
    assert not verified._cholesky_passes(failing, in_place=True).any()


@pytest.mark.parametrize("factor", [0.25, 1.0])
def test_rebuild_factors_in_place_and_rebuilds_only_failed_samples(factor):
    # with a rebuild the first trial destroys the matrices (no copy); samples whose trial fails
    # (a too-low estimate) are rebuilt for the retries: bounds equal to the copying path's
    M = degenerate_matrices()["plain"][1:]
    exact = exact_norm(M)
    gram, error = verified.gram_with_error(M)
    estimate = exact.square() * torch.tensor([factor, 1.0, factor, 1.0], dtype=torch.float64)

    def negated():
        return (-gram).mT.contiguous().mT  # exactly symmetric, batched Fortran order

    copying = verified.verified_norm_from_negated_gram(negated(), gram_error=error,
                                                       estimate=estimate)
    rebuilt = []

    def rebuild(rows):
        rebuilt.append(rows.tolist())
        return negated()[rows]

    consumed = negated()
    bound = verified.verified_norm_from_negated_gram(consumed, gram_error=error,
                                                     estimate=estimate, rebuild=rebuild)
    assert torch.equal(bound, copying)
    assert (bound >= exact).all() and (bound <= exact * (1 + 2 * SLACK)).all()
    assert not torch.equal(consumed, negated())  # factored in place
    assert rebuilt == ([] if factor == 1.0 else [[0, 2]])


@pytest.mark.parametrize("factor", [0.0, 0.25, 0.99])
def test_verified_retries_a_too_low_estimate(factor):
    M = degenerate_matrices()["plain"][1:]
    exact = exact_norm(M)
    gram, error = verified.gram_with_error(M)
    bound = verified.verified_gram_norm(gram, gram_error=error, estimate=factor * exact.square())
    assert (bound >= exact).all() and (bound <= exact * (1 + 2 * SLACK)).all()


def test_verified_doubling_when_every_estimate_is_wrong(monkeypatch):
    # the estimate and the exact-eigenvalue retry both too low: c is doubled until the
    # Cholesky proof succeeds, and the value stays an upper bound
    monkeypatch.setattr(verified, "_top_eigenvalue", lambda S: torch.zeros(S.shape[0]).to(S))
    calls = []
    passes = verified._cholesky_passes
    monkeypatch.setattr(verified, "_cholesky_passes",
                        lambda A, **kw: calls.append(1) or passes(A, **kw))
    M = degenerate_matrices()["plain"][1:]
    exact = exact_norm(M)
    gram, error = verified.gram_with_error(M)
    bound = verified.verified_gram_norm(gram, gram_error=error, estimate=1e-3 * exact.square())
    assert len(calls) > 3
    assert (bound >= exact).all() and (bound <= 2 * exact).all()


def test_verified_margins_are_tiny_but_present():
    # a nearly exact estimate: the bound is (1 + slack) sqrt(estimate) up to the rounding
    # margins, which are far below the slack
    M = degenerate_matrices()["plain"][1:]
    exact = exact_norm(M)
    gram, error = verified.gram_with_error(M)
    bound = verified.verified_gram_norm(gram, gram_error=error, estimate=exact.square(),
                                        relative_slack=1e-6)
    assert (bound >= exact * (1 + 1e-6)).all() and (bound <= exact * (1 + 1e-6 + 1e-9)).all()


def test_verified_rejects_bad_input():
    with pytest.raises(ValueError):
        verified.verified_gram_norm(torch.ones(3, 4, 5, dtype=torch.float64))
    with pytest.raises(ValueError):
        verified.verified_gram_norm(torch.eye(3, dtype=torch.float64)[None],
                                    gram_error=torch.tensor([-1.0]))
    bad = torch.eye(3, dtype=torch.float64)[None].clone()
    bad[0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        verified.verified_gram_norm(bad)
    with pytest.raises(ValueError):
        SpectralMethod(kind="verified", estimate_steps=0)
    line = SpectralMethod(kind="verified").describe()
    assert line.startswith("exact") and "Cholesky" in line


def test_gram_with_error_bounds_the_rounding():
    # against an extended-precision reference (numpy longdouble has a 64-bit mantissa on x86)
    g = torch.Generator().manual_seed(12)
    M = torch.randn(3, 200, 40, generator=g, dtype=torch.float64) * torch.logspace(0, 3, 40).to(
        torch.float64)
    gram, error = verified.gram_with_error(M)
    reference = np.einsum("bki,bkj->bij", M.numpy().astype(np.longdouble),
                          M.numpy().astype(np.longdouble))
    deviation = np.abs(gram.numpy().astype(np.longdouble) - reference)
    spectral_deviation = np.linalg.norm(deviation.astype(np.float64), ord=2, axis=(1, 2))
    assert (spectral_deviation <= error.numpy()).all()
    assert (error.numpy() <= 1e-11 * np.linalg.norm(M.numpy(), axis=(1, 2)) ** 2).all()


@pytest.mark.parametrize("size, blocks", [(1, 8), (7, 8), (61, 8), (200, 3)])
def test_mirror_lower_makes_the_symmetric_matrix_in_place(size, blocks):
    """The proof's symmetrisation on accelerators (and before a Lanczos estimate): every entry
    of the strict upper triangle becomes its mirror (NaN before), in either memory order, in
    the tensor given, with block edges that do not divide the size."""
    g = torch.Generator().manual_seed(size)
    lower = torch.tril(torch.randn(3, size, size, generator=g, dtype=torch.float64))
    expected = lower + torch.tril(lower, -1).mT
    upper = torch.triu(torch.ones(size, size, dtype=torch.bool), diagonal=1)
    for A in (lower.clone(), lower.mT.contiguous().mT):
        A[:, upper] = float("nan")
        pointer = A.data_ptr()
        assert verified.mirror_lower_(A, blocks) is A
        assert A.data_ptr() == pointer
        assert torch.equal(A, expected)


@pytest.mark.parametrize("rows, inner", [(5, 30), (16, 9), (67, 40), (40, 200)])
def test_gram_by_lower_row_blocks_is_the_gram(rows, inner):
    # wide and tall matrices, below and above the blocked size: the mirrored lower triangle is
    # the whole Gram matrix, within rounding, against an extended-precision reference
    g = torch.Generator().manual_seed(rows)
    M = torch.randn(2, rows, inner, generator=g, dtype=torch.float64)
    for matrix in (M, M.mT):
        gram, error = verified.gram_with_error(matrix)
        side = matrix if matrix.shape[-1] > matrix.shape[-2] else matrix.mT
        reference = np.einsum("bik,bjk->bij", side.numpy().astype(np.longdouble),
                              side.numpy().astype(np.longdouble))
        deviation = np.abs(gram.numpy().astype(np.longdouble) - reference).astype(np.float64)
        assert (np.linalg.norm(deviation, ord=2, axis=(1, 2)) <= error.numpy()).all()
        assert torch.equal(gram, gram.mT)


@pytest.mark.parametrize("size", [1, 7, 200])
def test_smallest_eigenvalue_exceeds_proves_only_true_floors(size):
    """``verified.smallest_eigenvalue_exceeds`` against the known spectrum of Q diag(lambda) Q^T:
    True where lambda_min clears the floor by 1e-9 of the scale, False where it lies below the
    floor by 1e-10 or more (the floor is a bound's rounding terms: dropping it would pass those),
    on the lower triangle alone, and the input is left as it was."""
    g = torch.Generator().manual_seed(size)
    floors = torch.tensor([0.0, 0.5, 0.5, 2.0, 0.0, 1e-3], dtype=torch.float64)
    lowest = floors + torch.tensor([1e-9, 1e-9, -1e-10, -1e-3, -1e-6, 1e-9], dtype=torch.float64)
    Q = torch.linalg.qr(torch.randn(len(floors), size, size, generator=g,
                                    dtype=torch.float64)).Q
    spectrum = lowest[:, None] + torch.rand(len(floors), size, generator=g,
                                            dtype=torch.float64) * 3.0
    spectrum[:, 0] = lowest
    A = (Q * spectrum[:, None, :]) @ Q.mT
    A = torch.tril(A) + torch.tril(A, -1).mT  # exactly symmetric, spectrum up to 1e-13
    expected = torch.tensor([True, True, False, False, False, True])
    before = A.clone()
    assert torch.equal(verified.smallest_eigenvalue_exceeds(A, floors), expected)
    assert torch.equal(A, before)  # not modified
    lower = torch.tril(A) + torch.triu(torch.full_like(A, math.nan), 1)  # never read
    assert torch.equal(verified.smallest_eigenvalue_exceeds(lower, floors), expected)
    kept = A
    # a NaN or infinite floor, or a NaN matrix, proves nothing
    bad = verified.smallest_eigenvalue_exceeds(kept[:2], torch.tensor([math.nan, math.inf],
                                                                      dtype=torch.float64))
    assert not bad.any()
    assert not verified.smallest_eigenvalue_exceeds(torch.full_like(kept[:1], math.nan),
                                                    floors[:1]).any()
