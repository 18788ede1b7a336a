"""The bounds near the reference attention (``lofast.bounds.near_reference``) and the verified
method that uses them, against dense float64 operators (materialised column by column, and the
block's autograd Jacobian) and a PGD attack on the block."""

import math
from fractions import Fraction

import pytest
import torch
from test_bounds_attention import (
    EPS,
    VERIFIED,
    make_tokens,
    make_weights,
    materialised_operator,
    pgd_lower_bound,
    with_score_gain,
)

from lofast.bounds import attention, attention_norms, attention_spec, first_order, softmax_terms
from lofast.bounds.attention import (
    attention_forward,
    attention_probabilities,
    attention_sensitivity,
)
from lofast.bounds.first_order import first_order_maps
from lofast.bounds.near_reference import (
    JacobianData,
    deflated_first_order_bound,
    head_deviation_bound,
    jacobian_adjoint,
    jacobian_apply,
    jacobian_rounding,
    softmax_first_order_bound,
    weighted_deviation_norms,
)
from lofast.bounds.softmax_terms import score_factors, softmax_first_order_maps
from lofast.bounds.spectral import matrix_norm_upper

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def jacobian_data(X, w):
    P = attention_probabilities(X, w)
    q, k, v = (t.to(F64) for t in (w.query, w.key, w.value))
    projections, output = w.jacobian_weights
    return JacobianData(probs=P, x_query=torch.einsum("bnd,hde->bhne", X, q),
                        x_key=torch.einsum("bnd,hde->bhne", X, k),
                        x_value=torch.einsum("bnd,hde->bhne", X, v), projections=projections,
                        output=output, residual=1.0 if w.residual else 0.0, scale=w.scale)


def dense_norms(X, w):
    """(||T_X||, ||T_X + D_X||, ||D_X||) per sample, (B,) each: T_X materialised, the block's
    Jacobian T_X + D_X by autograd."""
    T = materialised_operator(X, w)
    n, d = X.shape[1:]
    J = torch.stack([torch.func.jacrev(lambda Z: attention_forward(Z[None], w)[0])(x)
                     .reshape(n * d, n * d) for x in X])
    norm = torch.linalg.matrix_norm
    return norm(T, ord=2), norm(J, ord=2), norm(J - T, ord=2)


def live_block(n, d, h, dh, gain, seed, biased=True, residual=True):
    """A block whose scores have the given gain over a position bias (or uniform attention)."""
    w = make_weights(h, d, dh, residual, seed, bias_tokens=n if biased else None)
    return with_score_gain(w, gain)


@pytest.mark.parametrize("query_side", ["as chosen", "by scores", "by the covariances"])
@pytest.mark.parametrize("n, d, h, dh", [(6, 16, 2, 8), (12, 8, 4, 2)],
                         ids=["adjoint by the n x d products", "adjoint by the projections"])
def test_products_match_the_maps_and_their_adjoints(n, d, h, dh, query_side, monkeypatch):
    from lofast.bounds import near_reference
    from lofast.bounds.near_reference import adjoint_by_projections, query_side_by_scores

    w = live_block(n, d, h, dh, 1.0, seed=1)
    X = make_tokens(3, n, d, 1.0, seed=2)
    data = jacobian_data(X, w)
    assert adjoint_by_projections(data) == (h * n > n + d)
    assert query_side_by_scores(data) == (n <= dh)  # make_weights: dv = dh
    if query_side != "as chosen":  # either route gives the image
        monkeypatch.setattr(near_reference, "query_side_by_scores",
                            lambda data: query_side == "by scores")
    P, q, k, v, o = (data.probs, *(t.to(F64) for t in (w.query, w.key, w.value, w.output)))
    apply_t, adjoint_t = first_order_maps(P, v, o, True)
    x_value_out = torch.einsum("bhne,hef->bhnf", data.x_value, o)
    apply_d, adjoint_d = softmax_first_order_maps(
        P, *score_factors(data.x_query, data.x_key, q, k), x_value_out, w.scale)
    g = torch.Generator().manual_seed(3)
    G = torch.randn(4, n, d, generator=g, dtype=F64)
    first, whole = jacobian_apply(G, data, False), jacobian_apply(G, data, True)
    Y = torch.randn(3, 4, n, d, generator=g, dtype=F64)
    back_first, back_whole = jacobian_adjoint(Y, data, False), jacobian_adjoint(Y, data, True)
    for j in range(4):
        Gj = G[j].expand(3, -1, -1)
        assert torch.allclose(first[:, j], apply_t(Gj), atol=1e-13)
        assert torch.allclose(whole[:, j], apply_t(Gj) + apply_d(Gj), atol=1e-13)
        assert torch.allclose(back_first[:, j], adjoint_t(Y[:, j]), atol=1e-13)
        assert torch.allclose(back_whole[:, j], adjoint_t(Y[:, j]) + adjoint_d(Y[:, j]),
                              atol=1e-13)
    # <J G, Y> = <G, J^T Y>
    assert torch.allclose((whole * Y).sum(dim=(2, 3)), (G * back_whole).sum(dim=(2, 3)),
                          rtol=1e-12)



def peak_allocated_bytes(run) -> int:
    """The most bytes that torch's allocations made inside run() held at once (CPU), from the
    profiler's record of every allocation and release in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        run()
    steps = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]"
                    else e.self_cpu_memory_usage) for e in recorded.events())
    held = peak = 0
    for _, change in steps:
        held += change
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("n, d, h, dh, count, batch", [
    (33, 16, 4, 4, 8, 1),  # scores dominate (h n^2 > n d)
    (65, 32, 4, 8, 6, 1),
    (5, 64, 4, 16, 16, 1),  # values dominate; the query side by scores
    (9, 64, 4, 16, 16, 3),  # the query side by scores, three samples at once
    (17, 64, 8, 8, 12, 3)])
def test_the_chunk_planner_counts_what_the_jacobian_products_hold(n, d, h, dh, count, batch):
    """``jacobian_working_elements`` (what ``deflated_first_order_bound`` sizes its chunks of
    samples by) covers the memory that ``jacobian_apply`` and ``jacobian_adjoint`` hold at once,
    and is not far above it: counting only the k n d products, as before, left out the k h n^2
    score tensors, 26 times more at 257 tokens (chunks of 27 GiB on a GPU's 0.5 GiB budget)."""
    from lofast.bounds.near_reference import jacobian_working_elements, project_basis

    w = live_block(n, d, h, dh, 1.0, seed=1)
    data = jacobian_data(make_tokens(batch, n, d, 1.0, seed=2), w)
    G = torch.randn(count, n, d, generator=torch.Generator().manual_seed(3), dtype=F64)
    heads, _, dv, _ = data.shape
    projected = project_basis(G, data.projections, heads, dv)
    for softmax in (False, True):
        peak = peak_allocated_bytes(lambda: jacobian_adjoint(
            jacobian_apply(G, data, softmax, projected), data, softmax))  # noqa: B023
        planned = 8 * batch * jacobian_working_elements(count, data, softmax)
        assert 0.5 * planned <= peak <= planned, (softmax, peak, planned)


def test_the_device_workspace_grows_with_the_devices_memory(monkeypatch):
    """Off the CPU a chunk of samples may hold 1/16 of a CUDA device's memory, from 512 MiB to
    4 GiB (a chunk costs its kernel launches whatever its size, and at 257 tokens 512 MiB holds
    one sample), unless DEVICE_WORKSPACE_ELEMENTS is set; the chunks follow it."""
    from types import SimpleNamespace

    gib = 2 ** 30
    memory = {"total": 80 * gib}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=memory["total"]))
    cuda = torch.device("cuda")
    for total, expected in ((80 * gib, 4 * gib), (141 * gib, 4 * gib), (16 * gib, gib),
                            (24 * gib, 1.5 * gib), (4 * gib, 0.5 * gib)):
        memory["total"] = total
        assert 8 * first_order.workspace_elements(cuda) == expected, total
    assert 8 * first_order.workspace_elements(torch.device("mps")) == 0.5 * gib
    per_sample = 37 * 2 ** 20  # about a 257-token sample's Jacobian products
    assert len(first_order.sample_chunks(16, per_sample, cuda)) == 16  # a 4 GiB device: 1 each
    memory["total"] = 80 * gib
    assert [len(range(16)[s]) for s in first_order.sample_chunks(16, per_sample, cuda)] == [13, 3]
    monkeypatch.setattr(first_order, "DEVICE_WORKSPACE_ELEMENTS", 1 << 26)
    assert len(first_order.sample_chunks(16, per_sample, cuda)) == 16
    assert first_order.sample_chunks(16, per_sample, torch.device("cpu")) == [
        slice(i, i + 1) for i in range(16)]  # the CPU's own budget: 16 MiB
    monkeypatch.setattr(first_order, "CPU_WORKSPACE_ELEMENTS", 1 << 29)  # as a benchmark sets it
    assert len(first_order.sample_chunks(16, per_sample, torch.device("cpu"))) == 2


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("count", [4, 7])  # fewer vectors than the 5 tokens, and more
def test_token_mixing_is_the_same_per_sample_and_for_the_whole_batch(batch, count):
    """``_mix_tokens``' ways (per sample on a CPU: a product per head where n > k, per head and
    feature where not; one for the batch elsewhere) give P_l V_le exactly, against an einsum."""
    from lofast.bounds.near_reference import _mix_tokens

    g = torch.Generator().manual_seed(batch)
    probs = torch.softmax(torch.randn(batch, 2, 5, 5, generator=g, dtype=F64), dim=-1)
    value = torch.randn(2, 3, 5, count, generator=g, dtype=F64)
    expected = torch.einsum("blim,lemj->bleij", probs, value)
    for per_sample in (True, False):
        assert torch.allclose(_mix_tokens(probs, value, per_sample), expected, rtol=1e-14,
                              atol=1e-15)

def test_the_row_softmax_jacobian_in_place_out_of_place_and_under_vmap():
    # one owner for diag(p) - p p^T on rows: written to out (here E itself, the hot path's
    # form), to a new tensor, or batched by torch.func.vmap (the dense maps of the verified
    # norms), always the float64 reference, and vmap with no unbatched fallback (a warning)
    import warnings

    probs = torch.softmax(torch.randn(3, 5, 6, dtype=F64), dim=-1)
    E = torch.randn(4, 3, 5, 6, dtype=F64)
    reference = torch.stack([torch.einsum("hrij,hrj->hri", torch.diag_embed(probs)
                                          - probs[..., :, None] * probs[..., None, :], e)
                             for e in E])
    torch.testing.assert_close(softmax_terms.row_softmax_jacobian(probs, E.clone()), reference)
    scratch = E.clone()
    softmax_terms.row_softmax_jacobian(probs, scratch, out=scratch)
    torch.testing.assert_close(scratch, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batched = torch.func.vmap(lambda e: softmax_terms.row_softmax_jacobian(probs, e * 1.0))(E)
    torch.testing.assert_close(batched, reference)
    # rows stored key-major (the adjoint's layout): the row runs along another dimension
    key_major = E.transpose(-1, -2).contiguous()  # [.., h, r, m, i] for row i
    out = torch.empty_like(key_major)
    softmax_terms.row_softmax_jacobian(probs.transpose(-1, -2), key_major, out=out, dim=-2)
    torch.testing.assert_close(out.transpose(-1, -2), reference)


@pytest.mark.parametrize("n, d, h, dh", [(5, 16, 4, 4), (12, 8, 4, 6), (4, 16, 2, 8)],
                         ids=["adjoint by the n x d products", "adjoint by the projections",
                              "query side by scores"])
def test_rounding_bound_covers_single_precision_products(n, d, h, dh):
    # the rounding bound scales with the unit roundoff: the same products in float32 (data
    # included) stay within r * (u32 / u64) of the float64 ones
    from lofast.bounds.near_reference import query_side_by_scores

    w = live_block(n, d, h, dh, 3.0, seed=4)
    X = make_tokens(2, n, d, 2.0, seed=5)
    data = jacobian_data(X, w)
    assert query_side_by_scores(data) == (n <= dh)
    single = JacobianData(**{name: getattr(data, name).float() if torch.is_tensor(
        getattr(data, name)) else getattr(data, name) for name in data.__dataclass_fields__})
    r_first, r_whole = jacobian_rounding(data)
    ratio = 2.0 ** -24 / 2.0 ** -53
    g = torch.Generator().manual_seed(6)
    basis = torch.randn(3, n, d, generator=g, dtype=F64)
    basis = basis / basis.flatten(1).norm(dim=1)[:, None, None]
    for softmax, r in ((False, r_first), (True, r_whole)):
        exact = jacobian_apply(basis, data, softmax)
        error = (jacobian_apply(basis.float(), single, softmax).double() - exact)
        assert (error.flatten(2).norm(dim=2) <= r[:, None] * ratio).all()
        back = jacobian_adjoint(exact, data, softmax)
        error = jacobian_adjoint(exact.float(), single, softmax).double() - back
        norms = exact.flatten(2).norm(dim=2)
        assert (error.flatten(2).norm(dim=2) <= r[:, None] * ratio * norms).all()


@pytest.mark.parametrize("pattern", ["random", "equal", "one-head"])
def test_head_deviation_bound_dominates_the_materialised_norm(pattern):
    h, n, d, dv = 4, 5, 12, 3
    w = make_weights(h, d, dv, True, seed=7)
    g = torch.Generator().manual_seed(8)
    if pattern == "random":
        F = torch.randn(h, n, n, generator=g, dtype=F64)
    elif pattern == "equal":  # the same deviation in every head: the sum is loose, not the max
        F = torch.randn(1, n, n, generator=g, dtype=F64).expand(h, -1, -1)
    else:
        F = torch.zeros(h, n, n, dtype=F64)
        F[2] = torch.randn(n, n, generator=g, dtype=F64)
    B = w.value_matrices()
    exact = torch.linalg.matrix_norm(sum(torch.kron(F[l].contiguous(), B[l].T.contiguous())
                                          for l in range(h)), ord=2)
    _, _, value, output = w.stacked_norms
    bound = head_deviation_bound(matrix_norm_upper(F)[None], w.weight_norms[1], value * output)
    assert bound >= exact
    if pattern == "equal":
        summed = (matrix_norm_upper(F) * w.weight_norms[1]).sum()
        assert bound < 0.7 * summed


TOKEN_PATTERNS = ["random", "alike", "identical", "clusters", "large"]


def patterned_tokens(pattern, batch, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    X = make_tokens(batch, n, d, 1.0, seed)
    if pattern == "alike":  # a large common component, as in the trained models
        X = 0.9 * X[:, :1] + 0.3 * X
    elif pattern == "identical":  # X~ = 0: D_X = 0 and the bound must be (nearly) 0
        X = X[:, :1].expand(-1, n, -1).clone()
    elif pattern == "clusters":
        X = torch.where(torch.arange(n)[None, :, None] % 2 == 0, X[:, :1], X[:, 1:2])
        X = X + 0.01 * torch.randn(X.shape, generator=g, dtype=F64)
    elif pattern == "large":
        X = 4.0 * X
    return X


@pytest.mark.parametrize("pattern", TOKEN_PATTERNS)
@pytest.mark.parametrize("gain, biased", [(0.3, True), (1.0, True), (3.0, True), (1.0, False),
                                          (10.0, False)])
@pytest.mark.parametrize("n, d, h, dh", [(6, 12, 3, 4), (4, 12, 1, 12)],
                         ids=["heads", "one wide head"])  # dh < n and dh > n
def test_softmax_bound_dominates_the_autograd_norm(pattern, gain, biased, n, d, h, dh):
    w = live_block(n, d, h, dh, gain, seed=9, biased=biased)
    X = patterned_tokens(pattern, 3, n, d, seed=10)
    _, _, exact = dense_norms(X, w)
    data = jacobian_data(X, w)
    query, key, _, output = w.stacked_norms
    bound = softmax_first_order_bound(X, data.probs, data.x_query, w.key.to(F64),
                                      w.value.to(F64), (query, key, output), w.scale)
    # (the autograd reference carries rounding noise near 1e-15: D_X = 0 for identical tokens)
    assert (bound >= exact - 1e-13).all(), (bound, exact)
    if pattern == "identical":
        assert (bound <= 1e-12).all()


def deviation_matrices(probs, values):
    """N_i (..., n, n, dv): rows p_ij (V_j - sum_k p_ik V_k), formed explicitly."""
    mixed = probs @ values
    return probs[..., None] * (values[..., None, :, :] - mixed[..., :, None, :])


@pytest.mark.parametrize("route", ["gram", "direct", None])
@pytest.mark.parametrize("n, dv, dh", [(6, 4, 3), (5, 12, 9), (65, 16, 16)])
def test_weighted_deviation_norms_are_the_dense_norms_up_to_rounding(n, dv, dh, route):
    g = torch.Generator().manual_seed(31)
    scale = torch.logspace(-3, 3, 4, dtype=F64)[:, None, None]  # 4 matrices, 6 decades apart
    probs = torch.softmax(3.0 * torch.randn(4, n, n, generator=g, dtype=F64), dim=-1)
    values = torch.randn(4, n, dv, generator=g, dtype=F64) * scale
    keys = torch.randn(4, n, dh, generator=g, dtype=F64)
    N = deviation_matrices(probs, values)
    exact = torch.linalg.vector_norm(N, dim=(-2, -1))
    crossed = torch.linalg.vector_norm(keys[..., None, :, :].mT @ N, dim=(-2, -1))
    deviation, cross = weighted_deviation_norms(probs, values, keys, route)
    assert deviation.shape == cross.shape == (4, n)
    assert (deviation >= exact).all() and (deviation <= exact * (1 + 1e-6)).all()
    assert (cross >= crossed).all() and (cross <= crossed * (1 + 1e-6)).all()


@pytest.mark.parametrize("route", ["gram", "direct"])
@pytest.mark.parametrize("case", ["identical", "nearly identical"])
def test_weighted_deviation_norms_cover_their_rounding_under_cancellation(case, route):
    # alike values: each N_i cancels to (nearly) nothing in the expanded forms, and the bounds
    # must still exceed the exact norms of the stored floats (rational arithmetic)
    g = torch.Generator().manual_seed(32)
    n, dv, dh = 5, 3, 2
    probs = torch.softmax(torch.randn(n, n, generator=g, dtype=F64), dim=-1)
    values = torch.randn(1, dv, generator=g, dtype=F64).expand(n, dv).clone()
    if case == "nearly identical":
        values = values + 1e-9 * torch.randn(n, dv, generator=g, dtype=F64)
    keys = torch.randn(n, dh, generator=g, dtype=F64)
    deviation, cross = weighted_deviation_norms(probs, values, keys, route)
    P = [[Fraction(probs[i, j].item()) for j in range(n)] for i in range(n)]
    V = [[Fraction(values[j, v].item()) for v in range(dv)] for j in range(n)]
    K = [[Fraction(keys[j, e].item()) for e in range(dh)] for j in range(n)]
    for i in range(n):
        mean = [sum(P[i][k] * V[k][v] for k in range(n)) for v in range(dv)]
        N = [[P[i][j] * (V[j][v] - mean[v]) for v in range(dv)] for j in range(n)]
        assert Fraction(deviation[i].item()) ** 2 >= sum(x * x for row in N for x in row)
        product = sum(sum(K[j][e] * N[j][v] for j in range(n)) ** 2
                      for e in range(dh) for v in range(dv))
        assert Fraction(cross[i].item()) ** 2 >= product
    scale = torch.linalg.vector_norm(values, dim=-1).max()
    assert (deviation < 1e-6 * scale).all() and (cross < 1e-6 * scale).all()


def test_softmax_bound_is_far_below_the_product_bound_near_the_reference():
    # concentrated attention (a position bias of spread 2) and alike tokens: the product of
    # norms sum_l m_l ||X B_l|| / (2 s) that it replaces is several times larger
    w = live_block(8, 16, 4, 4, 0.5, seed=11)
    X = patterned_tokens("alike", 3, 8, 16, seed=12)
    _, _, exact = dense_norms(X, w)
    sens = attention_sensitivity(X, w, score_bound="relaxed", softmax_jacobian=True,
                                 method=VERIFIED)
    product = (sens.score_sensitivity * sens.value_norm).sum(dim=1) / (2 * sens.scale)
    assert (sens.softmax_first_order >= exact).all()
    assert (sens.softmax_first_order < 0.3 * product).all()


@pytest.mark.parametrize("gain", [1e-3, 0.05, 0.3, 1.0, 3.0])
@pytest.mark.parametrize("biased, residual", [(True, True), (False, True), (True, False)])
def test_deflated_bounds_dominate_the_dense_norms(gain, biased, residual):
    n, d, h, dh = 6, 12, 3, 4
    w = live_block(n, d, h, dh, gain, seed=13, biased=biased, residual=residual)
    X = patterned_tokens("alike", 3, n, d, seed=14)
    first, whole, softmax = dense_norms(X, w)
    data = jacobian_data(X, w)
    reference = w.reference_probabilities
    deviation = head_deviation_bound(
        first_order.reference_deviation_norms(data.probs, reference), w.weight_norms[1],
        w.stacked_norms[2] * w.stacked_norms[3])
    reference_norm, _ = w.reference_first_order
    deflation = w.deflation(n)
    bound, ritz = deflated_first_order_bound(data, deflation, reference_norm, deviation, None)
    assert (bound >= first).all() and (ritz <= first * (1 + 1e-12)).all()
    cheap = softmax * 1.5 + 1e-12  # any valid bound on ||D_X||
    bound, ritz = deflated_first_order_bound(data, deflation, reference_norm, deviation, cheap)
    assert (bound >= whole).all() and (ritz <= whole * (1 + 1e-12)).all()
    if gain <= 0.05:  # second order near the reference: far below ||T_R|| + deviation
        assert (bound <= whole * (1 + 1e-4)).all(), (bound / whole)



def test_the_deflation_products_are_made_once_per_model_and_change_no_bound(monkeypatch):
    """``AttentionSpec.deflation_products`` keeps the basis's products with the weights per
    deflation: a second batch reuses them (no second ``project_basis``), and the bound from
    them is the bound from products made afresh, to the bit."""
    from lofast.bounds import attention_spec

    n, d, h, dh = 6, 12, 3, 4
    w = live_block(n, d, h, dh, 0.3, seed=13)
    X = patterned_tokens("alike", 3, n, d, seed=14)
    data = jacobian_data(X, w)
    deviation = head_deviation_bound(
        first_order.reference_deviation_norms(data.probs, w.reference_probabilities),
        w.weight_norms[1], w.stacked_norms[2] * w.stacked_norms[3])
    reference_norm, _ = w.reference_first_order
    made = []
    original = attention_spec.project_basis
    monkeypatch.setattr(attention_spec, "project_basis",
                        lambda *args: made.append(1) or original(*args))
    deflation = w.deflation(n)
    kept = [w.deflation_products(n) for _ in range(2)]
    assert len(made) == 1 and kept[0] is kept[1]
    fresh = deflated_first_order_bound(data, deflation, reference_norm, deviation, None)
    reused = deflated_first_order_bound(data, deflation, reference_norm, deviation, None,
                                        kept[0])
    assert all(torch.equal(a, b) for a, b in zip(fresh, reused))

@pytest.mark.parametrize("seed", [0, 1])
def test_reference_norm_lies_within_its_slack_above_the_dense_norm(seed):
    # ||T_R|| for a position bias's softmax R, verified once per block from a Lanczos estimate
    n, d, h, dh = 17, 16, 4, 4
    w = make_weights(h, d, dh, True, seed, bias_tokens=n)
    R = w.reference_probabilities[None]
    dense = torch.linalg.matrix_norm(materialised_operator(make_tokens(1, n, d, 1.0, seed), w, R),
                                     ord=2)[0]
    bound, _ = w.reference_first_order
    assert dense <= bound <= dense * (1 + 3 * first_order.REFERENCE_SLACK)


@pytest.mark.parametrize("biased", [True, False], ids=["position-bias", "uniform"])
def test_verified_sensitivity_near_the_reference(monkeypatch, biased):
    # live attention near the reference: the Jacobian's norm by deflation, within 1e-3 of the
    # autograd norm and below zeta + ||D_X||, with neither Gram matrix per sample
    n, d, h, dh = 6, 16, 4, 4
    w = live_block(n, d, h, dh, 0.3, seed=15, biased=biased)
    X = patterned_tokens("alike", 4, n, d, seed=16)
    first, whole, softmax = dense_norms(X, w)
    w.reference_first_order, w.deflation(n)  # the reference's Gram matrices, once per block

    def refuse(*args, **kwargs):
        raise AssertionError("no per-sample Gram matrix near the reference")

    for module in (attention_spec, first_order):  # both call it
        monkeypatch.setattr(module, "first_order_negated_gram", refuse)
    monkeypatch.setattr(attention_norms, "softmax_first_order_norm", refuse)
    sens = attention_sensitivity(X, w, score_bound="relaxed", softmax_jacobian=True,
                                 method=VERIFIED)
    assert (sens.zeta >= first).all() and (sens.softmax_first_order >= softmax).all()
    assert (sens.jacobian >= whole).all()
    assert (sens.jacobian <= whole * (1 + 1e-3)).all()
    assert (sens.jacobian < first + softmax).all()


def test_far_from_the_reference_the_gram_matrices_take_over(monkeypatch):
    # peaked, input-dependent attention: the deflated bound is not within JACOBIAN_SLACK of its
    # estimate, and the verified zeta and ||D_X|| are computed as without it
    n, d, h, dh = 5, 12, 3, 4
    w = live_block(n, d, h, dh, 3.0, seed=17)
    X = patterned_tokens("random", 3, n, d, seed=18)
    first, whole, softmax = dense_norms(X, w)
    calls = []
    real = softmax_terms.softmax_first_order_norm

    def counting(probs, *args, **kwargs):
        calls.append(probs.shape[0])
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(attention_norms, "softmax_first_order_norm", counting)
    sens = attention_sensitivity(X, w, score_bound="relaxed", softmax_jacobian=True,
                                 method=VERIFIED)
    assert calls == [3]
    assert (sens.zeta >= first).all() and (sens.zeta <= first * (1 + 2e-3)).all()
    assert (sens.softmax_first_order >= softmax).all()
    assert (sens.softmax_first_order <= softmax * (1 + 2e-3)).all()
    assert (sens.jacobian >= whole).all()


@pytest.mark.parametrize("gain, row_norm", [(0.3, 1.0), (1.0, 1.0), (0.3, 3.0)])
def test_refined_delta_with_the_jacobian_dominates_pgd(gain, row_norm):
    n, d, h, dh = 5, 16, 4, 4
    w = live_block(n, d, h, dh, gain, seed=19)
    X = make_tokens(3, n, d, row_norm, seed=20)
    sens = attention_sensitivity(X, w, score_bound="relaxed", softmax_jacobian=True,
                                 method=VERIFIED)
    assert sens.jacobian is not None
    attack = pgd_lower_bound(X, w, EPS)
    assert (attack > 0.5 * EPS).all()
    eps = EPS[None].expand(3, -1)
    assert (sens.delta(eps) >= attack).all()
    # at the smallest radius the bound is within a few percent of the attack
    assert (sens.delta(eps)[:, 0] <= 1.05 * attack[:, 0]).all()


def test_the_jacobian_enters_the_refined_delta():
    base = {name: torch.tensor(value, dtype=F64) for name, value in [
        ("zeta", [2.0]), ("score_sensitivity", [[1.0]]), ("value_norm", [[0.5]]),
        ("score_weight_norm", [1.0]), ("value_weight_norm", [1.0])]}
    common = {**base, "scale": 2.0, "kappa": 0.5,
              "softmax_first_order": torch.tensor([0.3], dtype=F64)}
    plain = attention.AttentionSensitivity(**common)
    unrefined = attention.AttentionSensitivity(**{**common, "softmax_first_order": None})
    for value in (2.1, 1.9, math.inf):
        sens = attention.AttentionSensitivity(**common,
                                              jacobian=torch.tensor([value], dtype=F64))
        for e in (0.001, 0.01, 0.1, 1.0):
            eps = torch.tensor([e], dtype=F64)
            refined = min(value, 2.3) * e + sens.second_order_terms(eps).item()
            expected = min(unrefined.delta(eps).item(), refined)
            assert sens.delta(eps).item() == pytest.approx(expected, rel=1e-12)
            assert sens.delta(eps).item() <= plain.delta(eps).item()


def test_a_flat_topped_reference_takes_the_larger_deflation(monkeypatch):
    # a reference that keeps tokens apart (each head attends to itself) and values with a flat
    # top (I + B has 6 singular values 1.25): T_R repeats them once per token, 48 at the top, so
    # the first deflation (at most 32 vectors) finds no gap and no sample could settle there.
    # The samples go to the larger deflation, whose bound on the Jacobian lies within 1e-3 of
    # the autograd norm, with no per-sample Gram matrix; without it they would pay zeta + ||D_X||
    import dataclasses

    n, d, h, dh = 8, 16, 4, 4
    value = torch.zeros(h, d, dh, dtype=F64)
    output = torch.zeros(h, dh, d, dtype=F64)
    for coordinate in range(6):  # B = sum_l Wv_l Wo_l = 0.25 on the first 6 coordinates
        head, column = divmod(coordinate, dh)
        value[head, coordinate, column] = 0.5
        output[head, column, coordinate] = 0.5
    base = make_weights(h, d, dh, True, seed=21)
    bias = 6.0 * torch.eye(n, dtype=F64).expand(h, n, n).clone()
    w = dataclasses.replace(base, query=base.query * 2.0, key=base.key * 2.0, value=value,
                            output=output, position_bias=bias)
    X = patterned_tokens("random", 3, n, d, seed=22)
    first, whole, softmax = dense_norms(X, w)
    assert w.reference_first_order[0] > 0  # the per-model proofs, before the Gram matrices go
    assert w.deflation(n).size == 32 and w.deflation(n, True).size >= 48
    sizes = []
    real_bound = attention_norms.deflated_first_order_bound

    def recording(data, deflation, *args):
        sizes.append(deflation.size)
        return real_bound(data, deflation, *args)

    def refuse(*args, **kwargs):
        raise AssertionError("no per-sample Gram matrix")

    monkeypatch.setattr(attention_norms, "deflated_first_order_bound", recording)
    for module in (attention_spec, first_order):
        monkeypatch.setattr(module, "first_order_negated_gram", refuse)
    monkeypatch.setattr(attention_norms, "softmax_first_order_norm", refuse)
    sens = attention_sensitivity(X, w, score_bound="relaxed", softmax_jacobian=True,
                                 method=VERIFIED)
    assert sizes == [w.deflation(n, True).size]
    assert (sens.jacobian >= whole).all() and (sens.jacobian <= whole * (1 + 1e-3)).all()
    assert (sens.jacobian < first + softmax).all()


def test_the_lanczos_method_draws_the_references_proofs_too(monkeypatch):
    # with the probabilistic guarantee a large position-biased reference needs no Gram matrix:
    # ||T_R|| and the deflations' complements come from randomized Lanczos, once per model, on
    # generators of their own seeded from the certifier's seed. Each is an upper bound (against
    # the dense operator) within the method's slack, and every sample's failure probability
    # counts the three per-model draws
    from test_bounds_attention import LANCZOS, SLACK

    from lofast.bounds.attention import PER_MODEL_NORMS

    n, d, h, dh = 6, 16, 4, 4
    w = live_block(n, d, h, dh, 1.0, seed=23)
    X = patterned_tokens("random", 3, n, d, seed=24)
    first, whole, _ = dense_norms(X, w)
    # the path is taken from n d = PROBABILISTIC_REFERENCE_SIZE on (6,144 by default; 96 here)
    monkeypatch.setattr(attention_spec, "PROBABILISTIC_REFERENCE_SIZE", n * d + 1)
    assert not w.probabilistic_reference(LANCZOS)
    monkeypatch.setattr(attention_spec, "PROBABILISTIC_REFERENCE_SIZE", n * d)
    assert w.probabilistic_reference(LANCZOS) and not w.probabilistic_reference(VERIFIED)

    def refuse(*args, **kwargs):
        raise AssertionError("no Gram matrix with the probabilistic guarantee")

    for module in (attention_spec, first_order):
        monkeypatch.setattr(module, "first_order_negated_gram", refuse)
    generator = torch.Generator().manual_seed(5)
    sens = attention_sensitivity(X, w, score_bound="relaxed", softmax_jacobian=True,
                                 method=LANCZOS, generator=generator)
    assert (sens.zeta >= first).all() and (sens.jacobian >= whole).all()
    # zeta and ||D_X|| per sample; ||T_R|| and the two complements per model
    assert PER_MODEL_NORMS == 3
    assert sens.failure_probability == 5 * LANCZOS.failure_probability
    T_R = materialised_operator(X[:1], w, w.reference_probabilities[None])[0]
    exact = torch.linalg.matrix_norm(T_R, ord=2)
    bound = w.reference_norm(LANCZOS, generator)
    assert exact <= bound <= exact * (1 + 2 * SLACK)
    for large in (False, True):
        deflation = w.deflation(n, large, LANCZOS, generator)
        V = deflation.basis
        P = torch.eye(n * d, dtype=F64) - V @ torch.linalg.solve(V.mT @ V, V.mT)
        rest = torch.linalg.matrix_norm(T_R @ P, ord=2)  # sup ||T_R w|| over w orthogonal to V
        assert rest <= deflation.complement <= rest * (1 + 2 * SLACK) + 1e-12
    # the same draws whatever the order: a second spec's first call, from a fresh generator
    # with the same seed, gives the same bound
    again = live_block(n, d, h, dh, 1.0, seed=23)
    assert again.reference_norm(LANCZOS, torch.Generator().manual_seed(5)) == bound


def test_the_blocks_reference_norms_are_drawn_together_as_each_alone(monkeypatch):
    # attention_spec.reference_norms: the Lanczos reference norms of several blocks (of one
    # shape; another shape and a deterministic block beside them) in one run: each equal to the
    # bit to the one its block draws alone, each an upper bound on its dense ||T_R||; the maps
    # with a block's own weights per batch item match the dense operators
    from test_bounds_attention import LANCZOS, SLACK

    n, d, h, dh = 6, 16, 4, 4
    monkeypatch.setattr(attention_spec, "PROBABILISTIC_REFERENCE_SIZE", n * d)
    blocks = [live_block(n, d, h, dh, 1.0, seed=s) for s in (31, 32, 33)]
    other = live_block(n, 2 * d, h, dh, 1.0, seed=34)  # a shape of its own
    small = live_block(2, d, h, dh, 1.0, seed=35)  # below the size: deterministic
    assert not small.probabilistic_reference(LANCZOS)
    together = [live_block(n, d, h, dh, 1.0, seed=s) for s in (31, 32, 33)]
    alone = [w.reference_norm(LANCZOS, torch.Generator().manual_seed(5)) for w in blocks]
    attention_spec.reference_norms(together + [other, small], LANCZOS,
                                   torch.Generator().manual_seed(5))
    for w, single in zip(together, alone):
        assert len(w._probabilistic_reference) == 1
        assert w.reference_norm(LANCZOS, torch.Generator().manual_seed(5)) == single
        X = patterned_tokens("random", 1, n, d, seed=36)
        T_R = materialised_operator(X, w, w.reference_probabilities[None])[0]
        exact = torch.linalg.matrix_norm(T_R, ord=2)
        assert exact <= single <= exact * (1 + 2 * SLACK)
    assert len(other._probabilistic_reference) == 1 and not small._probabilistic_reference
    # the batched maps: item b's own block
    probs = torch.stack([w.reference_probabilities for w in together])
    value = torch.stack([w.value.double() for w in together])
    output = torch.stack([w.output.double() for w in together])
    apply, adjoint = first_order_maps(probs, value, output, True)
    G = torch.randn(3, n, d, dtype=F64, generator=torch.Generator().manual_seed(37))
    for b, w in enumerate(together):
        lone_apply, lone_adjoint = first_order_maps(probs[b: b + 1], w.value.double(),
                                                    w.output.double(), True)
        for batched, lone in ((apply, lone_apply), (adjoint, lone_adjoint)):
            expected = lone(G[b: b + 1])[0]
            assert (batched(G)[b] - expected).abs().max() <= 1e-13 * expected.abs().max()
