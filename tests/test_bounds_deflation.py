"""The deflated norm bound (``lofast.bounds.deflation``) against dense float64 singular values:
upper bounds on random and adversarial perturbations of a reference, tight near it."""

import math

import pytest
import torch

from lofast.bounds import deflation as deflation_module
from lofast.bounds.deflation import Deflation, deflate_gram, deflated_norm_bound
from lofast.bounds.verified import GRAM_BLOCKS, gamma, gram_with_error

F64 = torch.float64


@pytest.fixture(autouse=True, params=["dense", "lanczos"])
def eigensolver(request, monkeypatch):
    """Every test with the reference's eigenpairs from the dense solver (these sizes) and again
    from Lanczos (the path of references larger than DENSE_SIZE)."""
    if request.param == "lanczos":
        monkeypatch.setattr(deflation_module, "DENSE_SIZE", 0)


def operator(size, values, seed):
    """U diag(values) V^T (size x size) with random orthogonal U, V; values padded with ones."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=F64)).Q
    V = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=F64)).Q
    sigma = torch.ones(size, dtype=F64)
    sigma[: len(values)] = torch.tensor(values, dtype=F64)
    return U @ torch.diag(sigma) @ V.T, U, V


def reference_deflation(T):
    gram, error = gram_with_error(T[None])
    return deflate_gram(-gram[0], float(error[0]))


def products(J, basis, dtype=torch.float64):
    """Rows J v_j and J^T J v_j (1, k, N) computed in ``dtype``, and the rounding r of that
    arithmetic (gamma_N ||J||_F per product, Higham eq. 3.5)."""
    Jc, Vc = J.to(dtype), basis.to(dtype)
    Y = (Jc @ Vc).T
    Z = (Jc.T @ Y.T).T
    unit = torch.finfo(dtype).eps / 2
    size = J.shape[0]
    r = size * unit / (1 - size * unit) * torch.linalg.vector_norm(J) * 1.01
    return Y.double()[None], Z.double()[None], r


def bound(J, deflation, deviation, dtype=torch.float64):
    Y, Z, r = products(J, deflation.basis, dtype)
    norm = torch.linalg.matrix_norm(J, 2)
    return deflated_norm_bound(Y, Z, deflation, torch.tensor([deviation], dtype=F64),
                               torch.tensor([norm * 1.001]), r.reshape(1))


def test_complement_bounds_the_rest_of_the_reference():
    T, _, _ = operator(60, [3.0, 2.9, 2.8, 2.5, 2.4, 2.2, 2.1, 2.0, 1.5, 1.4], seed=1)
    deflation = reference_deflation(T)
    basis = deflation.basis
    projector = torch.eye(60, dtype=F64) - basis @ torch.linalg.solve(basis.T @ basis, basis.T)
    rest = torch.linalg.matrix_norm(T @ projector, 2)
    assert deflation.complement >= rest
    assert deflation.complement <= rest * (1 + 2e-4)
    assert deflation.size == 8  # the first size after which the spectrum drops by 5 %
    assert deflation.orthogonality < 1e-12


def test_the_complement_reads_only_the_lower_triangle_in_either_memory_order():
    """As the certifier passes it: -T^T T in Fortran order with its strict upper triangle unset
    (NaN here) and T^T T as a map; the complement still bounds the rest of T, as from the whole
    matrix in row-major order."""
    T, _, _ = operator(60, [3.0, 2.9, 2.8, 2.5, 2.4, 2.2, 2.1, 2.0, 1.5, 1.4], seed=1)
    gram, error = gram_with_error(T[None])
    stored = (-gram[0]).mT.contiguous()  # the transpose, row by row
    stored[torch.tril(torch.ones(60, 60, dtype=torch.bool), diagonal=-1)] = math.nan
    fortran = stored.mT  # -T^T T below the diagonal, NaN above
    whole = deflate_gram(-gram[0], float(error[0]))
    for deflation in (whole, deflate_gram(fortran, float(error[0]), lambda q: q @ gram[0])):
        basis = deflation.basis
        projector = torch.eye(60, dtype=F64) - basis @ torch.linalg.solve(basis.T @ basis, basis.T)
        rest = torch.linalg.matrix_norm(T @ projector, 2)
        assert rest <= deflation.complement <= rest * (1 + 2e-4)
    assert stored.isnan().sum() == 60 * 59 // 2  # read, not written


@pytest.mark.parametrize("size", [60, 700])
def test_overwrite_forms_the_deflated_matrix_in_place_with_the_same_result(size):
    """As the per-model deflations call it (at 256 tokens, a copy of an 8 GiB matrix saved):
    with overwrite the Fortran-ordered -T^T T becomes the proof's workspace, and the
    deflation is the one computed from an untouched copy, to the bit."""
    T, _, _ = operator(size, [3.0, 2.9, 2.8, 2.5, 2.4, 2.2, 2.1, 2.0, 1.5, 1.4], seed=2)
    gram, error = gram_with_error(T[None])
    fortran = (-gram[0]).mT.contiguous().mT
    kept = fortran.clone()
    for_map = gram[0].clone()
    plain = deflate_gram(kept, float(error[0]), lambda q: q @ for_map)
    assert torch.equal(kept, fortran)  # not modified without overwrite
    pointer = fortran.data_ptr()
    overwritten = deflate_gram(fortran, float(error[0]), lambda q: q @ for_map, overwrite=True)
    assert fortran.data_ptr() == pointer and not torch.equal(fortran, kept)
    assert torch.equal(overwritten.basis, plain.basis)
    assert torch.equal(overwritten.complement, plain.complement)


@pytest.mark.parametrize("fortran", [True, False])
def test_overwrite_writes_only_the_lower_triangle(fortran):
    """The deflated matrix is formed in the triangle the proof reads, in row blocks: the other
    triangle, often memory never written, keeps whatever it held (7.0 here) outside the
    diagonal blocks, in either memory order."""
    T, _, _ = operator(70, [3.0, 2.9, 2.8, 2.5, 2.0], seed=4)
    gram, error = gram_with_error(T[None])

    def in_order(matrix):
        return matrix.mT.contiguous().mT if fortran else matrix.contiguous()

    negated = in_order(-gram[0])
    assert negated.mT.is_contiguous() == fortran
    block = torch.tensor([70 * b // GRAM_BLOCKS for b in range(1, GRAM_BLOCKS + 1)])
    block = torch.bucketize(torch.arange(70), block, right=True)  # each index's row block
    upper = block[:, None] < block[None, :]  # above the diagonal blocks
    negated[torch.triu(torch.ones(70, 70, dtype=torch.bool), diagonal=1)] = 7.0
    # the same memory order with both triangles intact (the BLAS of some CPUs round a Fortran-
    # order Gram differently from a C-order one, so only the same order compares bit for bit)
    reference = deflate_gram(in_order(-gram[0]), float(error[0]), lambda q: q @ gram[0],
                             overwrite=True)
    deflation = deflate_gram(negated, float(error[0]), lambda q: q @ gram[0], overwrite=True)
    assert (negated[upper] == 7.0).all()
    assert not torch.equal(torch.tril(negated), torch.tril(-gram[0]))  # formed in place
    assert torch.equal(deflation.complement, reference.complement)


@pytest.mark.parametrize("first_trial_fails", [False, True])
def test_complement_proof_in_place_rebuilds_for_its_retries(first_trial_fails, monkeypatch):
    """The complement's Cholesky proof factors S' in place when S' can be formed again: from
    the kept matrix, or with overwrite from ``rebuild``; without one it factors a copy. A first
    trial that fails (forced here, after it destroyed its matrix) is retried on S' formed
    afresh: the three ways give the same complement, to the bit."""
    from lofast.bounds import verified

    factor = verified._cholesky_passes
    calls = []

    def first_fails(A, in_place=False):
        calls.append(in_place)
        passed = factor(A, in_place=in_place)
        return passed & (len(calls) > 1 or not first_trial_fails)

    T, _, _ = operator(60, [3.0, 2.9, 2.8, 2.5, 2.0, 1.5], seed=3)
    gram, error = gram_with_error(T[None])

    def negated():
        return (-gram[0]).mT.contiguous().mT

    results = {}
    for way, kwargs in (("kept", {}), ("copy", {"overwrite": True}),
                        ("rebuilt", {"overwrite": True, "rebuild": negated})):
        calls.clear()
        monkeypatch.setattr(verified, "_cholesky_passes", first_fails)
        results[way] = deflate_gram(negated(), float(error[0]), **kwargs).complement
        assert calls[0] == (way != "copy")  # in place unless S' cannot be formed again
        assert len(calls) == (2 if first_trial_fails else 1)
    assert results["kept"] == results["copy"] == results["rebuilt"]
    assert math.isfinite(float(results["kept"]))


@pytest.mark.parametrize("size", [3, 8, 61, 700])
def test_symmetric_frobenius_bound_reads_the_lower_triangle_in_blocks(size):
    """The bound on ||S||_F behind the complement's rounding term (above DENSE_SIZE): at least
    ||S||_F and at most sqrt(2) times it, from the lower triangle alone, in either memory order,
    for sizes below, at and not divisible by the number of blocks."""
    g = torch.Generator().manual_seed(size)
    lower = torch.tril(torch.randn(size, size, generator=g, dtype=F64))
    S = lower + torch.tril(lower, -1).mT
    exact = float(torch.linalg.vector_norm(S))
    upper = torch.triu(torch.ones(size, size, dtype=torch.bool), diagonal=1)
    for stored in (S.clone(), S.mT.contiguous().mT):
        stored[upper] = math.nan
        bound = deflation_module._symmetric_frobenius_upper(stored)
        assert exact <= bound <= math.sqrt(2.0) * exact * (1 + 1e-9)
        assert bound == pytest.approx(math.sqrt(2.0) * float(torch.linalg.vector_norm(lower)),
                                      rel=1e-9)


@pytest.mark.parametrize("kind", ["random", "top", "coupling", "complement-up", "complement-top"])
@pytest.mark.parametrize("size", [0.0, 1e-4, 1e-2, 0.3, 2.0])
def test_bound_dominates_the_norm(kind, size):
    T, U, V = operator(50, [3.0, 2.95, 2.9, 2.8, 2.7, 2.6, 2.5, 2.4, 1.2], seed=2)
    deflation = reference_deflation(T)
    g = torch.Generator().manual_seed(3)
    if kind == "random":
        E = torch.randn(50, 50, generator=g, dtype=F64)
    elif kind == "top":  # pushes the top singular value up
        E = U[:, :1] @ V[:, :1].T
    elif kind == "coupling":  # maps the complement into the top output direction
        E = U[:, :1] @ V[:, 20:21].T
    elif kind == "complement-up":  # raises a complement direction above the top
        E = U[:, 30:31] @ V[:, 30:31].T
    else:  # makes a complement direction the top one
        E = U[:, :1] @ V[:, 40:41].T * 3
    E = E / torch.linalg.matrix_norm(E, 2) * size
    J = T + E
    exact = torch.linalg.matrix_norm(J, 2)
    upper, ritz = bound(J, deflation, size * (1 + 1e-12))
    assert upper >= exact, (upper, exact)
    assert ritz <= exact * (1 + 1e-12)
    if size <= 1e-2 and kind != "complement-up":  # second order near the reference
        assert upper <= exact * (1 + 1e-6) + size ** 2, (upper, exact)


def test_bound_is_second_order_where_the_triangle_inequality_is_first_order():
    T, _, _ = operator(40, [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3, 1.0], seed=4)
    deflation = reference_deflation(T)
    g = torch.Generator().manual_seed(5)
    E = torch.randn(40, 40, generator=g, dtype=F64)
    for size in (1e-1, 1e-2, 1e-3):
        J = T + E / torch.linalg.matrix_norm(E, 2) * size
        exact = torch.linalg.matrix_norm(J, 2)
        upper, _ = bound(J, deflation, size)
        triangle = torch.linalg.matrix_norm(T, 2) + size
        assert exact <= upper <= exact + 5 * size ** 2
        assert upper < triangle - 0.1 * size


def test_large_sizes_get_past_a_flat_top_cluster():
    """A reference whose top 40 singular values lie within 1 % of each other (as n copies of
    I + B_l's top values do): the first sizes find no gap and leave a complement at the top, so
    the bound near it is +inf or first order; the larger candidates stop at the first size past
    the cluster, whose complement is at most the cluster's next singular value (1.5), and the
    bound is second order."""
    from lofast.bounds.deflation import DEFLATION_SIZES, LARGE_DEFLATION_SIZES

    values = [2.0 - 0.0005 * i for i in range(40)] + [1.5] * 10
    T, _, _ = operator(120, values, seed=6)
    gram, error = gram_with_error(T[None])
    small = deflate_gram(-gram[0], float(error[0]), sizes=DEFLATION_SIZES)
    large = deflate_gram(-gram[0], float(error[0]), sizes=LARGE_DEFLATION_SIZES)
    assert small.size == max(DEFLATION_SIZES) and small.complement > 1.97
    assert large.size == 64 and large.complement <= 1.5 * (1 + 1e-3)
    g = torch.Generator().manual_seed(7)
    E = torch.randn(120, 120, generator=g, dtype=F64)
    J = T + E / torch.linalg.matrix_norm(E, 2) * 0.05
    exact = torch.linalg.matrix_norm(J, 2)
    first, _ = bound(J, small, 0.05)
    second, _ = bound(J, large, 0.05)
    assert first > exact + 0.02
    assert exact <= second <= exact + 5 * 0.05 ** 2


def test_the_large_deflation_takes_the_lanczos_steps_of_the_size_it_chooses(monkeypatch):
    """Lanczos grows size by size and stops at the first size past the flat top: 3 k + 20
    steps for k = 64 (and the complement's estimate), not those of the largest candidate
    (512, capped at N = 400), and its Ritz vectors still leave a complement at the cluster's
    next singular value."""
    from lofast.bounds.deflation import COMPLEMENT_LANCZOS_STEPS, LARGE_DEFLATION_SIZES

    monkeypatch.setattr(deflation_module, "DENSE_SIZE", 0)
    values = [2.0 - 0.0005 * i for i in range(40)] + [1.5] * 10
    T, _, _ = operator(400, values, seed=8)
    gram, error = gram_with_error(T[None])
    S = gram[0]
    calls = []

    def counted(q):
        calls.append(q.shape[0])
        return q @ S

    large = deflate_gram(-S, float(error[0]), counted, sizes=LARGE_DEFLATION_SIZES)
    assert large.size == 64 and large.complement <= 1.5 * (1 + 1e-3)
    assert len(calls) <= 3 * 64 + 20 + COMPLEMENT_LANCZOS_STEPS


def test_a_poor_basis_is_sound():
    # a random subspace instead of the top singular vectors: the complement holds the top, and
    # the bound can exceed the triangle inequality ||T_R|| + delta (callers keep the smaller)
    T, _, _ = operator(40, [2.0, 1.9, 1.5], seed=6)
    g = torch.Generator().manual_seed(7)
    basis = torch.linalg.qr(torch.randn(40, 8, generator=g, dtype=F64)).Q
    gram, error = gram_with_error(T[None])
    negated = -gram[0] + 4.0 * (basis @ basis.T)
    from lofast.bounds.verified import verified_norm_from_negated_gram
    complement = verified_norm_from_negated_gram(
        negated[None], gram_error=error + 4.0 * gamma(8) * 8 + 1e-12, lower_only=True)[0]
    poor = Deflation(basis=basis, orthogonality=1e-13, complement=complement,
                     ritz=torch.zeros(9, dtype=F64))
    E = torch.randn(40, 40, generator=g, dtype=F64)
    J = T + 0.05 * E / torch.linalg.matrix_norm(E, 2)
    exact = torch.linalg.matrix_norm(J, 2)
    upper, _ = bound(J, poor, 0.05)
    assert exact <= upper < 1.1 * (torch.linalg.matrix_norm(T, 2) + 0.05)


def test_a_basis_that_is_not_quite_orthonormal():
    T, _, _ = operator(30, [2.0, 1.9, 1.8, 1.2], seed=8)
    deflation = reference_deflation(T)
    g = torch.Generator().manual_seed(9)
    eye = torch.eye(deflation.size, dtype=F64)
    noise = torch.randn(deflation.size, deflation.size, generator=g, dtype=F64)
    skewed = deflation.basis @ (eye + 1e-7 * noise)
    eta = float(torch.linalg.matrix_norm(skewed.T @ skewed - eye, 2)) * 1.01
    # the complement bound must hold for the skewed basis: use the whole norm of T (valid)
    loose = Deflation(basis=skewed, orthogonality=eta, complement=torch.linalg.matrix_norm(T, 2),
                      ritz=deflation.ritz)
    J = T + 1e-3 * torch.randn(30, 30, generator=g, dtype=F64) / 30
    exact = torch.linalg.matrix_norm(J, 2)
    upper, _ = bound(J, loose, float(torch.linalg.matrix_norm(J - T, 2)))
    assert upper >= exact


def test_rounding_is_accounted_for_in_single_precision():
    # products formed in float32 (errors near 1e-7, far above the bound's slack near the
    # reference) with their rounding bound passed in: still an upper bound
    T, _, _ = operator(64, [3.0, 2.99, 2.98, 2.5, 2.4, 2.3, 2.2, 2.1, 1.0], seed=10)
    deflation = reference_deflation(T)
    g = torch.Generator().manual_seed(11)
    for trial in range(5):
        E = torch.randn(64, 64, generator=g, dtype=F64)
        J = T + 1e-6 * E / torch.linalg.matrix_norm(E, 2)
        exact = torch.linalg.matrix_norm(J, 2)
        upper, _ = bound(J, deflation, 1e-6, dtype=torch.float32)
        assert upper >= exact, trial
        assert upper <= exact * (1 + 1e-3)


def test_unverifiable_samples_get_infinity():
    T, _, _ = operator(20, [2.0, 1.5], seed=12)
    deflation = reference_deflation(T)
    Y, Z, r = products(T, deflation.basis)
    Y = torch.cat([Y, torch.full_like(Y, math.nan)])
    Z = torch.cat([Z, Z])
    zero, three = torch.zeros(2, dtype=F64), torch.full((2,), 3.0, dtype=F64)
    upper, _ = deflated_norm_bound(Y, Z, deflation, zero, three, r.expand(2))
    assert math.isfinite(upper[0]) and upper[1] == math.inf
    with pytest.raises(ValueError, match="do not match"):
        deflated_norm_bound(Y[:, :1], Z, deflation, zero, three, r.expand(2))


def test_an_unproven_complement_bounds_nothing(monkeypatch):
    # a deflation whose Cholesky proof fails gives +inf, never an unproven number
    from lofast.bounds import deflation as module

    def fail(*args, **kwargs):
        raise ValueError("could not verify")

    monkeypatch.setattr(module, "verified_norm_from_negated_gram", fail)
    T, _, _ = operator(20, [2.0, 1.5], seed=13)
    deflation = reference_deflation(T)
    assert deflation.complement == math.inf
    upper, _ = bound(T, deflation, 0.0)
    assert upper[0] == math.inf


def test_a_nearly_null_complement():
    # deflating all but one direction of a rank-deficient reference: the complement's top
    # eigenvalue is 0 up to rounding, and its proof must not fail on that noise
    T, _, _ = operator(12, [2.0, 1.5, 1.0] + [0.0] * 9, seed=14)
    gram, error = gram_with_error(T[None])
    deflation = deflate_gram(-gram[0], float(error[0]), sizes=(11,))
    assert deflation.size == 11 and 0.0 <= deflation.complement < 1e-5


@pytest.mark.parametrize(("tokens", "residual"), [(5, True), (17, True), (6, False)])
def test_uniform_reference_deflation_from_the_single_token_proof(tokens, residual):
    """For uniform attention U, T_U(G) = H G + U G B is deflated from the d x d Gram matrix of
    its single-token reference (``deflate_gram``'s tokens): against the dense (n d) x (n d)
    operator, the basis is orthonormal within its eta, the complement bounds T_U on the
    orthogonal complement of the basis and is within the proof's slack of it. Without the non-mean part (rest = 0) the complement
    would fall below the true one: the term is needed."""
    from lofast.bounds.attention_spec import AttentionSpec

    g = torch.Generator().manual_seed(tokens)
    h, d, dh = 2, 8, 4
    spec = AttentionSpec(query=torch.randn(h, d, dh, generator=g, dtype=F64),
                         key=torch.randn(h, d, dh, generator=g, dtype=F64),
                         value=0.4 * torch.randn(h, d, dh, generator=g, dtype=F64),
                         output=0.4 * torch.randn(h, dh, d, generator=g, dtype=F64),
                         residual=residual, scale=2.0)
    deflation = spec.deflation(tokens)
    B = spec.value_matrices().sum(dim=0)
    eye_n, eye_d = torch.eye(tokens, dtype=F64), torch.eye(d, dtype=F64)
    U = torch.full((tokens, tokens), 1.0 / tokens, dtype=F64)
    # vec(G) row-major: T(G) = H G + U G B acts as H (x) I + U (x) B^T
    T = (1.0 if residual else 0.0) * torch.kron(eye_n, eye_d) + torch.kron(U, B.T.contiguous())
    V = deflation.basis
    assert V.shape[0] == tokens * d
    gram = V.T @ V
    assert torch.linalg.matrix_norm(gram - torch.eye(V.shape[1], dtype=F64), 2) <= \
        deflation.orthogonality
    outside = torch.eye(tokens * d, dtype=F64) - V @ torch.linalg.solve(gram, V.T)
    rest = torch.linalg.matrix_norm(T @ outside, 2)
    # (the non-mean part has norm exactly ||H||: the dense product rounds around it)
    assert rest <= deflation.complement * (1 + 1e-12) and deflation.complement <= \
        rest * (1 + 1e-3) + 1e-9
    f = spec.first_order_factors
    from lofast.bounds.first_order import first_order_negated_gram

    if residual:  # the non-mean part is what keeps the complement at ||H|| = 1
        single = torch.ones((h, 1, 1), dtype=F64)
        negated, error = first_order_negated_gram(single[None], f)
        unlifted = deflate_gram(negated[0], float(error[0]), tokens=tokens, rest=0.0)
        assert float(unlifted.complement) * f.unit < rest * (1 - 1e-3)


@pytest.mark.parametrize(("scale", "settled"), [(1e-6, 3), (1e-2, 2), (1.0, 0), (30.0, 0)])
def test_joint_top_matches_the_joint_eigenvalue(scale, settled, monkeypatch):
    """``_joint_top``'s fixed-point estimate of the top eigenvalue of [[K, S^(1/2)],
    [S^(1/2), c I]] against the 2k x 2k eigensolver, with c below, near and above
    lambda_max(K): the iteration settles for a small S (near the reference) with c well below
    lambda_max(K), its extrapolated estimate within JOINT_TOLERANCE, and the eigensolver
    answers for the rest."""
    from lofast.bounds.deflation import JOINT_TOLERANCE, TRIAL_STEPS, _joint_top

    g = torch.Generator().manual_seed(int(scale * 1e6) % 1000)
    k = 12
    A = torch.randn(4, k, k, generator=g, dtype=F64)
    K = A @ A.mT
    C = torch.randn(4, k, k, generator=g, dtype=F64) * scale
    S = C @ C.mT
    top = torch.linalg.eigvalsh(K)[:, -1]
    c = top * torch.tensor([0.5, 0.9, 0.999, 1.2], dtype=F64)
    values, vectors = torch.linalg.eigh(S)
    root = (vectors * values.clamp_min(0.0).sqrt()[:, None, :]) @ vectors.mT
    eye = torch.eye(k, dtype=F64).expand(4, -1, -1)
    joint = torch.cat([torch.cat([K, root], dim=2), torch.cat([root, c[:, None, None] * eye],
                                                               dim=2)], dim=1)
    exact = torch.linalg.eigvalsh(joint)[:, -1]
    eigensolved = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh",
                        lambda M: eigensolved.append(M.shape[0]) or eigh(M))
    estimate = _joint_top(K, S, c, top, torch.linalg.vector_norm(S, dim=(1, 2)))
    assert sum(eigensolved) == 4 - settled
    assert torch.allclose(estimate, exact, rtol=2 * JOINT_TOLERANCE, atol=0.0), (estimate, exact)
    # the trials start one TRIAL_STEPS increment above the estimate: there t* is passed
    assert (estimate * (1 + TRIAL_STEPS[0]) > exact).all()



def exact_grams(seed):
    """A reference with a clustered top deflated, J near it with a coupling between the
    deflated subspace and its complement, and the exact float64 K = V^T M V and
    S = C^T C (C = P M V, P the projector off range(V)) as dense references."""
    T, U, Vs = operator(48, [3.0, 2.98, 2.96, 2.94, 2.9, 2.85, 2.8, 2.75, 1.5], seed=seed)
    deflation = reference_deflation(T)
    J = T + 0.05 * U[:, :1] @ Vs[:, 30:31].T
    V = deflation.basis
    M = J.T @ J
    projector = torch.eye(48, dtype=F64) - V @ torch.linalg.solve(V.T @ V, V.T)
    C = projector @ M @ V
    Y, Z = (J @ V).T, (M @ V).T
    norm = torch.linalg.matrix_norm(J, 2) * (1 + 1e-12)
    return J, deflation, Y, Z, Y @ Y.T, C.T @ C, norm


def top_pair(A):
    """A's top singular pair (a, b) as a rank-one unit matrix a b^T (same shape as A)."""
    U, _, Vh = torch.linalg.svd(A)
    return U[:, :1] @ Vh[:1]


def test_the_coupling_gram_bounds_its_error_from_the_rows_of_the_adjoint():
    """Rows Z off by as much as the stated adjoint rounding allows, along Z's top singular
    pair, where the error of Z Z^T is largest (about 2 ||Z|| e_Z): S = Z Z^T - K K stays within
    e_S of the exact C^T C, and that error takes most of e_S (halving the e_Z term of e_S
    fails this)."""
    _J, deflation, Y, Z, _, S_exact, norm = exact_grams(seed=21)
    budget = 1e-6
    rate = budget / float(torch.linalg.vector_norm(Y))
    shifted = Z + budget * top_pair(Z)
    _K, S, _, e_s = deflation_module.deflated_grams(
        Y[None], shifted[None], torch.zeros(1, dtype=F64), torch.tensor([rate], dtype=F64),
        norm.reshape(1), deflation.orthogonality)
    error = torch.linalg.vector_norm(S[0] - S_exact)
    assert error <= e_s[0], (error, e_s)
    assert error >= 0.6 * e_s[0], (error, e_s)


def test_the_ritz_gram_bounds_its_error_from_the_rows_of_the_product():
    """Rows Y off by the stated error along their top singular pair (the error of Y Y^T is
    then about 2 ||Y|| e_Y) and Z = Y J exactly: K stays within e_K of the exact V^T M V with
    most of e_K taken (halving the e_Y term fails this), and S within e_S of C^T C."""
    J, deflation, Y, _, K_exact, S_exact, norm = exact_grams(seed=22)
    budget = 1e-6
    shifted = Y + budget * top_pair(Y)
    K, S, e_k, e_s = deflation_module.deflated_grams(
        shifted[None], (shifted @ J)[None], torch.tensor([budget], dtype=F64),
        torch.zeros(1, dtype=F64), norm.reshape(1), deflation.orthogonality)
    error = torch.linalg.vector_norm(K[0] - K_exact)
    assert error <= e_k[0] and error >= 0.6 * e_k[0], (error, e_k)
    assert torch.linalg.vector_norm(S[0] - S_exact) <= e_s[0]



def test_the_coupling_gram_bounds_the_error_of_the_square_of_k():
    """Rows Y off along their top singular pair and Z exact (its stated error nu e_Y unused):
    K K then carries about 2 ||K|| e_K of error into S = Z Z^T - K K, which e_S covers with
    most of it taken (dropping the e_K term of e_S fails this)."""
    _J, deflation, Y, Z, _, S_exact, norm = exact_grams(seed=24)
    budget = 1e-6
    shifted = Y + budget * top_pair(Y)
    _, S, _, e_s = deflation_module.deflated_grams(
        shifted[None], Z[None], torch.tensor([budget], dtype=F64), torch.zeros(1, dtype=F64),
        norm.reshape(1), deflation.orthogonality)
    error = torch.linalg.vector_norm(S[0] - S_exact)
    assert error <= e_s[0] and error >= 0.5 * e_s[0], (error, e_s)

def test_the_grams_of_exact_rows_are_within_rounding():
    """With exact products (no stated error) K and S are the dense references up to the
    float64 rounding of their own Grams: e_K and e_S are tiny next to S, whose smallness
    (second order near the reference) the bound relies on."""
    _J, deflation, Y, Z, K_exact, S_exact, norm = exact_grams(seed=23)
    zero = torch.zeros(1, dtype=F64)
    K, S, e_k, e_s = deflation_module.deflated_grams(Y[None], Z[None], zero, zero,
                                                     norm.reshape(1), deflation.orthogonality)
    assert torch.linalg.vector_norm(K[0] - K_exact) <= e_k[0]
    assert torch.linalg.vector_norm(S[0] - S_exact) <= e_s[0]
    assert e_s[0] < 1e-9 * torch.linalg.vector_norm(S_exact)

@pytest.mark.parametrize(("scale", "reliable"), [(1e-7, True), (1e-4, True), (3.0, False)])
def test_perturbed_top_estimates_the_joint_eigenvalue_near_the_reference(scale, reliable):
    """``_perturbed_top``'s second-order estimate of t*, the top eigenvalue of
    [[K, S^(1/2)], [S^(1/2), c I]], against the 2k x 2k eigensolver: for a small S (near the
    reference, c well below lambda_max(K)) it is reliable and within 1e-9 of t* relative;
    for a large S, or c above lambda_max(K), it says it is not reliable (the caller then
    takes ``_joint_top``)."""
    g = torch.Generator().manual_seed(31)
    k = 16
    A = torch.randn(3, k, k, generator=g, dtype=F64)
    K = A @ A.mT
    C = torch.randn(3, k, k, generator=g, dtype=F64) * scale
    S = C @ C.mT
    values, vectors = torch.linalg.eigh(K)
    top = values[:, -1]
    c = top * torch.tensor([0.5, 0.8, 1.2], dtype=F64)
    s_values, s_vectors = torch.linalg.eigh(S)
    root = (s_vectors * s_values.clamp_min(0.0).sqrt()[:, None, :]) @ s_vectors.mT
    eye = torch.eye(k, dtype=F64).expand(3, -1, -1)
    joint = torch.cat([torch.cat([K, root], dim=2),
                       torch.cat([root, c[:, None, None] * eye], dim=2)], dim=1)
    exact = torch.linalg.eigvalsh(joint)[:, -1]
    estimate, settled = deflation_module._perturbed_top(values, vectors, S, c)
    assert settled.tolist() == [reliable, reliable, False]  # c above the top: never
    if reliable:
        assert torch.allclose(estimate[:2], exact[:2], rtol=1e-9, atol=0.0), (estimate, exact)
