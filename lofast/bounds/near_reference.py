"""Fast deterministic bounds on an attention block's first-order operators when attention is
input-dependent but near a fixed reference (ours).

Notation of ``bounds.attention``: T_X(G) = H G + sum_l P_l G B_l with B_l = Wv_l Wo_l, and
D_X(G) = sum_l J_l(G A_l X^T + X A_l G^T) X B_l / s with J_l the row-wise softmax Jacobian at X;
the block's Jacobian at X is T_X + D_X. The reference T_R has a fixed R_l in place of P_l.
Wv_l are the column blocks of Wv = [Wv_1 ... Wv_h] (d x h dv) and Wo_l the row blocks of
Wo = [Wo_1; ...; Wo_h] (h dv x d).

1. Head structure. For any (n, n) matrices F_l,
   sum_l F_l G Wv_l Wo_l = [F_1 G Wv_1, ..., F_h G Wv_h] Wo, hence
   ||sum_l F_l G B_l||_F <= ||Wo|| (sum_l ||F_l||^2 ||G Wv_l||_F^2)^(1/2)
                         <= ||Wo|| ||Wv|| max_l ||F_l|| ||G||_F
   (sum_l ||G Wv_l||_F^2 = ||G Wv||_F^2). With F_l = P_l - R_l, ||T_X - T_R|| is at most the
   smaller of sum_l ||P_l - R_l|| ||B_l|| and ||Wv|| ||Wo|| max_l ||P_l - R_l||: a maximum over
   heads instead of a sum (``head_deviation_bound``).

2. A cheap bound on ||D_X|| (``softmax_first_order_bound``). Each row of J_l(E) sums to zero
   (J_l(E) 1 = 0) and J_l ignores a constant added to a row of E, so for the centred tokens
   X~ = X - 1 c^T (any c; we take the mean token)
       D_X(G) = sum_l J_l(G A_l X~^T + X A_l G^T) X~ B_l / s = D1(G) + D2(G)
   (the rows of G A_l X^T - G A_l X~^T are constant). Row i of J_l(E) is e_i^T J_li with
   J_li = diag(p) - p p^T for the row p of P_l, symmetric. Let N_li = J_li X~ Wv_l (n x dv):
   the deviations of the tokens from their p-weighted mean, weighted by p, small when attention
   is concentrated or the tokens alike. Row i of D1(G) is g_i^T Wq_l M_li Wo_l summed over l,
   M_li = (X~ Wk_l)^T N_li (dh x dv), i.e. g_i^T [Wq_1 .. Wq_h] diag_l(M_li) Wo, so
       ||D1|| <= ||Wq|| ||Wo|| max_{l,i} ||M_li|| / s.
   Row i of D2(G) is sum_l q_li^T (G Wk_l)^T N_li Wo_l with q_li = Wq_l^T x_i, and by 1.
   ||D2(G)||_F^2 <= ||Wo||^2 sum_{l,i} ||N_li||^2 ||G Wk_l q_li||^2 / s^2
               <= ||Wo||^2 sum_l ||diag_i(||N_li||) X Wq_l||^2 ||G Wk_l||_F^2 / s^2, so
       ||D2|| <= ||Wo|| ||Wk|| max_l ||diag_i(||N_li||) X Wq_l|| / s.

3. The Jacobian by deflation (``deflated_first_order_bound``). ||T_X + D_X - T_R|| <=
   ||T_X - T_R|| + ||D_X||, so ``bounds.deflation`` bounds ||T_X|| and ||T_X + D_X|| from k
   products with each and its adjoint, with a term of second order in the deviation: near the
   reference the bound on the Jacobian is below zeta + ||D_X|| (the triangle inequality), and
   it replaces both in the refined bound of ``bounds.attention``.

As elsewhere in ``lofast.bounds``, the per-sample data (P_l and the token products X Wq_l, ...)
as computed in float64 define the operators; the explicit matrix norms carry
``spectral.ROUNDING_MARGIN`` and the products with the deflation basis carry explicit rounding
bounds (``jacobian_rounding``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lofast.bounds.deflation import Deflation, deflated_norm_bound
from lofast.bounds.first_order import sample_chunks
from lofast.bounds.softmax_terms import row_softmax_jacobian
from lofast.bounds.spectral import matrix_norm_upper
from lofast.bounds.verified import gamma

# The second-order refinement computes ||D_X|| only where its cheap upper bound exceeds this
# fraction of zeta (below it, the refinement could change the bound by less than that fraction).
SOFTMAX_NEGLIGIBLE = 1e-3


def head_deviation_bound(deviation: Tensor, value_weight_norm: Tensor,
                         stacked_norm: Tensor) -> Tensor:
    """Upper bound (B,) on ||sum_l F_l (x) B_l^T|| (the map G -> sum_l F_l G B_l) given
    deviation (B, h) >= ||F_l||, value_weight_norm (h,) >= ||B_l|| and
    stacked_norm >= ||Wv|| ||Wo|| (a scalar tensor): 1. of the module docstring."""
    summed = (deviation * value_weight_norm).sum(dim=1)
    return torch.minimum(summed, stacked_norm * deviation.amax(dim=1))


def softmax_first_order_bound(X: Tensor, probs: Tensor, x_query: Tensor, key: Tensor,
                              value: Tensor, stacked_norms: tuple[Tensor, Tensor, Tensor],
                              scale: float) -> Tensor:
    """Deterministic upper bound (B,) on ||D_X||: ||D1|| + ||D2||, 2. of the module docstring.

    X (B, n, d) float64 tokens; probs (B, h, n, n); x_query (B, h, n, dh) X Wq_l; key Wk_l
    (h, d, dh); value Wv_l (h, d, dv); stacked_norms: upper bounds (||Wq||, ||Wk||, ||Wo||) on
    the whole matrices (scalar tensors); scale s. Frobenius norms bound ||N_li|| and ||M_li||,
    both from ``weighted_deviation_norms`` on the computed X~ Wv_l and W_l = X~ Wk_l.
    Rounding of those operands: X~ Wv_l is computed with at most d + 2 roundings per term from
    X (the centring included), so it lies within gamma_{d+2} (||X~ Wv_l||_F + ||X~||_F ||Wv_l||_F)
    of the exact one in Frobenius norm, and N_li, linear in it with norm at most 2
    (||p_i||_2 <= 1), moves by twice that; 2 gamma_{n+d+4} (...) covers it with room. W_l alike
    (2 gamma_{n+d+4} (||W_l||_F + ||X~||_F ||Wk_l||_F)), entering M_li = W_l^T N_li through
    ||N_li||.
    """
    n, d = X.shape[1], X.shape[2]
    query_norm, key_norm, output_norm = stacked_norms
    centred = X - X.mean(dim=1, keepdim=True)
    x_value = torch.einsum("bnd,hde->bhne", centred, value)  # X~ Wv_l (B, h, n, dv)
    x_key = torch.einsum("bnd,hde->bhne", centred, key)  # X~ Wk_l (B, h, n, dh)
    frob = torch.linalg.vector_norm
    value_f = frob(value, dim=(1, 2))  # ||Wv_l||_F
    slip = 2.0 * gamma(n + d + 4) * (frob(x_value, dim=(2, 3))
                                     + frob(centred, dim=(1, 2))[:, None] * value_f)  # (B, h)
    inflate = 1.0 + 2.0 ** -40
    deviation, crossed = weighted_deviation_norms(probs, x_value, x_key)
    mixed_norm = deviation + slip[..., None]  # (B, h, n) >= ||N_li||
    key_f = frob(x_key, dim=(2, 3))[..., None] * inflate  # (B, h, 1)
    key_slip = 2.0 * gamma(n + d + 4) * (frob(x_key, dim=(2, 3)) + frob(centred, dim=(1, 2))[
        :, None] * frob(key, dim=(1, 2)))  # (B, h) >= ||W_l - computed W_l||_F
    product = (crossed + key_f * slip[..., None]
               + key_slip[..., None] * mixed_norm)  # >= ||M_li||_F of the exact operands
    first = query_norm * output_norm * product.amax(dim=(1, 2))
    second = output_norm * key_norm * matrix_norm_upper(mixed_norm[..., None] * x_query,
                                                             per_sample=True).amax(dim=1)
    return (first + second) / scale * inflate


def weighted_deviation_norms(probs: Tensor, values: Tensor, keys: Tensor,
                             route: str | None = None) -> tuple[Tensor, Tensor]:
    """Upper bounds (..., n) on ||N_i||_F and ||K^T N_i||_F, where N_i (n, dv) has rows
    p_ij (V_j - v_i), v_i = sum_k p_ik V_k, for probs p (..., n, n), values V (..., n, dv) and
    keys K (..., n, dh), all float64 and exact as stored. No N_i is formed.

    ||N_i||_F^2 = sum_j q_ij ||V_j||^2 - 2 v_i . c_i + ||v_i||^2 s_i with q = p o p,
    c_i = sum_j q_ij V_j and s_i = sum_j q_ij. ||K^T N_i||_F by the cheaper of two routes
    (``route`` forces one): "direct", the (dh x dv) matrices K^T N_i = A_i - k_i v_i^T with
    A_i = sum_j p_ij K_j V_j^T and k_i = sum_j p_ij K_j (n^2 dh dv flops); "gram", its square
    <K K^T, N_i N_i^T> = p_i^T (H o G) p_i - 2 sum_j p_ij (p G)_ij (p H)_ij + ||v_i||^2 p_i^T H p_i
    with H = K K^T, G = V V^T (n^2 (dh + dv) + 3 n^3 flops).

    Rounding. Each value is a sum of products of the stored entries, every term passing through
    at most 4 n + dh + dv + 10 roundings, so the computed value is off by at most gamma of that
    count times the sum of its terms' absolute values (Higham, Lemma 3.3 and eq. 3.5). With
    r_i = sum_k p_ik ||V_k|| (Cauchy-Schwarz and Minkowski on |V_j|, |V_k|) that sum is at most
    e_i = sum_j q_ij (||V_j|| + r_i)^2 for ||N_i||_F^2, f_i^2 for the gram route's square and
    f_i for the direct route's matrix in Frobenius norm, f_i = sum_j p_ij ||K_j|| (||V_j|| + r_i).
    A square root then carries sqrt(gamma e_i): about 1e-7 ||V|| when N_i cancels to nothing.
    e_i and f_i are sums of nonnegative terms, each within that gamma relatively (inflated by
    twice it); the Frobenius norm of a computed (dh x dv) matrix, a sum of dh dv squares, is
    within gamma_{dh dv + 1}.
    """
    n, dv, dh = probs.shape[-1], values.shape[-1], keys.shape[-1]
    if route is None:
        route = "direct" if dh * dv < dh + dv + 3 * n else "gram"
    count = 4 * n + dh + dv + 10
    upper = 1.0 + 2.0 * gamma(count)  # a computed sum of nonnegative terms, made an upper bound
    inflate = 1.0 + 2.0 ** -40
    frob = torch.linalg.vector_norm
    squares = probs.square()  # q
    mixed = probs @ values  # v_i (..., n, dv)
    value_norms = frob(values, dim=-1)  # ||V_j|| (..., n)
    spread = (probs @ value_norms[..., None])[..., 0]  # r_i
    square_sum = squares.sum(dim=-1)  # s_i
    weighted = squares @ torch.stack([value_norms.square(), value_norms], dim=-1)
    squared = (weighted[..., 0] - 2.0 * (mixed * (squares @ values)).sum(dim=-1)
               + mixed.square().sum(dim=-1) * square_sum)
    magnitude = (weighted[..., 0] + 2.0 * spread * weighted[..., 1]
                 + square_sum * spread.square()) * upper  # >= e_i
    deviation = ((squared.clamp_min(0.0) + gamma(count) * magnitude) * inflate).sqrt()
    key_norms = frob(keys, dim=-1)
    reach = ((probs * key_norms[..., None, :]) * (value_norms[..., None, :] + spread[..., None])
             ).sum(dim=-1) * upper  # >= f_i
    if route == "direct":
        outer = (keys[..., :, None] * values[..., None, :]).flatten(-2)  # K_j V_j^T
        crossed = (probs @ outer) - ((probs @ keys)[..., :, None] * mixed[..., None, :]).flatten(-2)
        crossed = frob(crossed, dim=-1) * (1.0 + gamma(dh * dv + 1)) + gamma(count) * reach
    else:
        keys_gram, values_gram = keys @ keys.mT, values @ values.mT  # H, G
        square = ((probs @ (keys_gram * values_gram)) * probs
                  - 2.0 * probs * (probs @ values_gram) * (probs @ keys_gram)).sum(dim=-1)
        square = square + mixed.square().sum(dim=-1) * ((probs @ keys_gram) * probs).sum(dim=-1)
        crossed = ((square.clamp_min(0.0) + gamma(count) * reach.square()) * inflate).sqrt()
    return deviation * inflate, crossed * inflate


@dataclass(frozen=True)
class JacobianData:
    """Per-sample data of T_X and D_X for products with many vectors.

    probs (B, h, n, n) P_l; x_query, x_key (B, h, n, dh) X Wq_l, X Wk_l; x_value (B, h, n, dv)
    X Wv_l; projections (d, h (dv + 2 dh)) [Wv_1 .. Wv_h | Wq_1 .. Wq_h | Wk_1 .. Wk_h];
    output (h dv, d) Wo; residual r (H = r I); scale s."""

    probs: Tensor
    x_query: Tensor
    x_key: Tensor
    x_value: Tensor
    projections: Tensor
    output: Tensor
    residual: float
    scale: float

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(h, n, dv, dh)."""
        return (self.x_value.shape[1], self.x_value.shape[2], self.x_value.shape[3],
                self.x_query.shape[3])

    @functools.cached_property
    def scaled_values(self) -> Tensor:
        """X Wv_l / s (B, h, n, dv): the values as the softmax part reads them."""
        return self.x_value / self.scale

    @functools.cached_property
    def covariances(self) -> Tensor:
        """C_li = sum_m P_l[i, m] k_m v_m^T - kbar_i vbar_i^T (B, h, n, dh, dv): the key-value
        covariance of token i's attention row, k = X Wk_l, v = X Wv_l / s, kbar = P_l k,
        vbar = P_l v. It carries the part of a score change that meets X's own keys through
        the softmax Jacobian: sum_m J_l(E)[i, m] v_m = a_i^T C_li for E[i, m] = a_i . k_m and
        any a (n, dh), so the products need no (n x n) scores for that part where
        ``query_side_by_scores`` says so (``jacobian_apply``, ``jacobian_adjoint``).
        Every term of C_li is a term of the scores' evaluation with one rounding path
        replaced by another of no more roundings: ``jacobian_rounding`` covers both."""
        values = self.scaled_values
        _, _, dv, dh = self.shape
        outer = (self.x_key[..., :, None] * values[..., None, :]).flatten(-2)  # (B, h, n, dh dv)
        first = (self.probs @ outer).unflatten(-1, (dh, dv))
        means = (self.probs @ self.x_key)[..., :, None] * (self.probs @ values)[..., None, :]
        return first - means


@dataclass(frozen=True)
class ProjectedBasis:
    """The sample-independent products of k vectors G_j (k, n, d) that ``jacobian_apply``
    reads: tokens (n, k, d) the vectors token-major; value (h, dv, n, k) G_j Wv_l feature-major
    [l, e, m, j]; query (h, n k, dh) G_j Wq_l; key (h, dh, k n) (G_j Wk_l)^T. Formed once per
    model (``AttentionSpec.deflation_products``): at k = 288 they are 1.9e9 flops, as much as
    a sample's products."""

    tokens: Tensor
    value: Tensor
    query: Tensor
    key: Tensor


def project_basis(basis: Tensor, projections: Tensor, heads: int,
                  value_width: int) -> ProjectedBasis:
    """``ProjectedBasis`` of the vectors basis (k, n, d) with the stacked projections
    [Wv_1 .. Wv_h | Wq_1 .. Wq_h | Wk_1 .. Wk_h] (d, h (dv + 2 dh)), dv = value_width."""
    count, n, d = basis.shape
    dv = value_width
    dh = (projections.shape[1] - heads * dv) // (2 * heads)
    tokens = basis.transpose(0, 1).contiguous()  # [i, j, f]
    v, q, k = (tokens.view(n * count, d) @ projections).split(
        [heads * dv, heads * dh, heads * dh], dim=-1)
    return ProjectedBasis(
        tokens=tokens,
        value=v.reshape(n, count, heads, dv).permute(2, 3, 0, 1).contiguous(),
        query=q.reshape(n, count, heads, dh).permute(2, 0, 1, 3).reshape(heads, n * count, dh),
        key=k.reshape(n, count, heads, dh).permute(2, 3, 1, 0).reshape(heads, dh, count * n))


def mixing_route(device: torch.device, n: int, count: int,
                 per_sample: bool | None = None) -> str:
    """How ``_mix_tokens`` forms P_l V_le for n tokens and count vectors k: "batch", one product
    for the whole batch (off the CPU, or per_sample=False); per sample, "heads" where n > k,
    (n x n) by (n x dv k) a head and the result transposed into place (h n dv k copied a
    sample), else "features", a product per head and feature that copies P_l dv times
    (h dv n^2). At 257 tokens, k = 32 "heads" copies 8 times less and its products are wide
    (two EPYC threads: 9 against 44-63 ms a sample a block); at 17 tokens, k = 288 "features"
    is faster (3.4-3.8 against 4.6-4.7 ms)."""
    if not (device.type == "cpu" if per_sample is None else per_sample):
        return "batch"
    return "heads" if n > count else "features"


def _mix_tokens(probs: Tensor, value: Tensor, per_sample: bool | None = None) -> Tensor:
    """P_l V_le for every sample, head l and feature e: probs (B, h, n, n), value
    (h, dv, n, k), shared by the samples -> (B, h, dv, n, k) [b, l, e, i, j], by
    ``mixing_route``. per_sample (default: on a CPU): products per sample, where broadcasting
    the shared value over the samples would copy it once per sample; elsewhere one product for
    the whole batch (a GPU's chunks hold hundreds of samples, and copying is cheaper there than
    a launch per sample). Every entry is the same sum of n products on every route."""
    route = mixing_route(probs.device, probs.shape[-1], value.shape[-1], per_sample)
    if route == "batch":
        return torch.matmul(probs[:, :, None], value)
    batch, heads, n, _ = probs.shape
    _, dv, _, count = value.shape
    out = value.new_empty(batch, heads, dv, n, count)
    if route == "heads":
        token_major = value.transpose(1, 2).reshape(heads, n, dv * count)  # [l, m, (e, j)]
        product = value.new_empty(heads, n, dv * count)
        for b in range(batch):
            torch.bmm(probs[b], token_major, out=product)
            out[b].copy_(product.view(heads, n, dv, count).transpose(1, 2))
        return out
    flat = value.view(heads * dv, n, count)
    for b in range(batch):
        torch.bmm(probs[b, :, None].expand(heads, dv, n, n).reshape(heads * dv, n, n), flat,
                  out=out[b].view(heads * dv, n, count))
    return out


def query_side_by_scores(data: JacobianData) -> bool:
    """Whether ``jacobian_apply`` forms the score change's query side G_j Wq_l (X Wk_l)^T as
    scores (2 h n^2 k dh operations a sample, added to the key side's before the softmax
    Jacobian) rather than by the covariances (2 h n k dh dv, and 2 h n^2 dh dv to form them
    once): where n <= dv, a few dozen tokens at most (the live default, 17 tokens and 32
    features a head: 11.6 against 13.6 ms a sample for k = 320, two Xeon threads)."""
    _, n, dv, _ = data.shape
    return n <= dv


def jacobian_apply(basis: Tensor, data: JacobianData, softmax: bool,
                   projected: ProjectedBasis | None = None) -> Tensor:
    """T_X G_j, or (T_X + D_X) G_j with ``softmax``, for the same k vectors G_j (k, n, d) for
    every sample: (B, k, n, d), contiguous (one row of length n d a vector, as
    ``deflation.deflated_norm_bound`` reads them).

    G_j Wv_l, G_j Wq_l, G_j Wk_l do not depend on the sample: ``projected`` (from
    ``project_basis``, formed here if not given). The values run feature-major,
    [b, l, e, i, j] for head l, feature e, token i and vector j: P_l mixes tokens as one
    (n x n) by (n x k) product per head and feature, the softmax part adds one product per
    head, and the output projection reads them as one (n k x h dv) operand in place, without a
    copy; a last transposed copy puts the rows in vector order."""
    heads, n, dv, dh = data.shape
    count, _, d = basis.shape
    batch = data.probs.shape[0]
    if projected is None:
        projected = project_basis(basis, data.projections, heads, dv)
    mixed = _mix_tokens(data.probs, projected.value)  # P_l G_j Wv_l [b, l, e, i, j]
    if softmax:
        # The score change E1_l(G_j) = G_j Wq_l (X Wk_l)^T + X Wq_l (G_j Wk_l)^T through J_l,
        # then (X Wv_l / s)^T. Its key side X Wq_l (G_j Wk_l)^T mixes every token m: formed,
        # [b, l, i, (j, m)]; its query side too where ``query_side_by_scores``, [b, l, (i, j), m]
        scores = (data.x_query @ projected.key).view(batch, heads, n, count, n)
        by_scores = query_side_by_scores(data)
        if by_scores:
            scores.view(batch, heads, n * count, n).add_(projected.query @ data.x_key.mT)
        row_softmax_jacobian(data.probs[:, :, :, None], scores, out=scores)  # in place
        mixed.view(batch * heads, dv, n * count).baddbmm_(
            data.scaled_values.reshape(batch * heads, n, dv).mT,
            scores.view(batch * heads, n * count, n).mT)  # feature-major as the values
        if not by_scores:  # the query side by the covariances: (G_j Wq_l)_i^T C_li
            mixed += torch.einsum("lijd,blide->bleij",
                                  projected.query.view(heads, n, count, dh), data.covariances)
    out = torch.baddbmm(projected.tokens.view(1, n * count, d).expand(batch, -1, -1),
                        mixed.view(batch, heads * dv, n * count).mT,
                        data.output.expand(batch, -1, -1), beta=data.residual)  # [b, (i, j), f]
    return out.view(batch, n, count, d).transpose(1, 2).contiguous()


def jacobian_adjoint(Y: Tensor, data: JacobianData, softmax: bool) -> Tensor:
    """T_X^T Y, or (T_X + D_X)^T Y with ``softmax``, for Y (B, k, n, d) -> (B, k, n, d),
    contiguous (``jacobian_apply``'s layout).

    Feature-major as ``jacobian_apply``: Wo_l Y^T is one product [b, (l, e), (j, i)], P_l^T
    mixes its tokens in one (dv k x n) by (n x n) product per sample and head, and the product
    with Wv^T reads the result as one operand in place. The softmax part is one more product
    (below)."""
    heads, n, dv, dh = data.shape
    batch, count, _, d = Y.shape
    flat = Y.reshape(batch, count * n, d)  # [b, (j, i), f]
    mixed = data.output @ flat.mT  # Y Wo_l^T: (B, h dv, k n) [b, (l, e), (j, i)]
    # P_l^T Y Wo_l^T: [b, l, e, j, m]
    value = (mixed.view(batch * heads, dv * count, n)
             @ data.probs.reshape(batch * heads, n, n)).view(batch, heads, dv, count, n)
    parts = data.projections.split([heads * dv, heads * dh, heads * dh], dim=1)
    out = torch.baddbmm(flat, value.view(batch, heads * dv, count * n).mT,
                        parts[0].mT.expand(batch, -1, -1), beta=data.residual)
    if softmax:
        # The score change G Wq_l (X Wk_l)^T + X Wq_l (G Wk_l)^T reads G through X Wk_l Wq_l^T
        # (by token m) and X Wq_l Wk_l^T (by token i). Its adjoint takes the softmax
        # Jacobian's output A_l[j, i, m] by token m (half 0) and transposed, A_l[j, m, i]
        # (half 1). The scores (Y Wo_l^T)_j (X Wv_l / s)^T enter it.
        values = data.scaled_values.reshape(batch * heads, n, dv)
        if adjoint_by_projections(data):
            # (A_l X Wk_l) Wq_l^T and (A_l^T X Wq_l) Wk_l^T: the token sums against the
            # (n x dh) projections, then one product with inner dimension 2 h dh
            # (the first, sum_m A_l[j, i, m] (X Wk_l)_m, is C_li (Y Wo_l^T)_ji by the
            # covariances, with no scores)
            scores = (mixed.view(batch * heads, dv, count * n).mT @ values.mT
                      ).view(batch, heads, count, n, n)  # [b, l, j, i, m]
            row_softmax_jacobian(data.probs[:, :, None], scores, out=scores)
            by_token = scores.view(batch * heads, count, n, n)
            halves = torch.stack([
                torch.einsum("blide,bleji->bljid", data.covariances,
                             mixed.view(batch, heads, dv, count, n)
                             ).reshape(batch * heads, count, n, dh),
                by_token.mT @ data.x_query.reshape(batch * heads, 1, n, dh)])  # [half, (b, l), j, i, e]
            halves = halves.view(2, batch, heads, count * n, dh).permute(1, 3, 0, 2, 4)
            weights = torch.cat([parts[1], parts[2]], dim=1).mT  # [(half, l, e), f]
            out.baddbmm_(halves.reshape(batch, count * n, 2 * heads * dh),
                         weights.expand(batch, -1, -1))
            return out.view(batch, count, n, d)
        # Otherwise one product with inner dimension 2 h n (fewer operations where h n <= n + d).
        # Its left factor is stored key-major, [b, half, l, m, (j, i)], and read transposed:
        # half 0 holds A_l[j, i, m], half 1 A_l[j, m, i]. Key-major, the scores are one wide
        # product a head (n rows by k n columns; query-major it would write rows of only n
        # entries) and every elementwise step of the softmax Jacobian is contiguous.
        left = Y.new_empty(batch, 2, heads, n, count, n)
        scores = torch.bmm(values, mixed.view(batch * heads, dv, count * n)
                           ).view(batch, heads, n, count, n)  # [b, l, m, j, i]
        key_major = data.probs.transpose(-1, -2).contiguous()[:, :, :, None]  # [b, l, m, 1, i]
        row_softmax_jacobian(key_major, scores, out=left[:, 0], dim=2)
        left[:, 1] = left[:, 0].transpose(2, 4)
        # X Wk_l Wq_l^T and X Wq_l Wk_l^T: one product per head over all samples each
        # (broadcasting the weights over the samples would copy them once per sample)
        halves_right = [torch.bmm(tokens.transpose(0, 1).reshape(heads, batch * n, dh),
                                  weight.view(d, heads, dh).permute(1, 2, 0))
                        for tokens, weight in ((data.x_key, parts[1]), (data.x_query, parts[2]))]
        right = torch.stack(halves_right).view(2, heads, batch, n, d).permute(2, 0, 1, 3, 4)
        out.baddbmm_(left.view(batch, 2 * heads * n, count * n).mT,
                     right.reshape(batch, 2 * heads * n, d))
    return out.view(batch, count, n, d)


def adjoint_by_projections(data: JacobianData) -> bool:
    """Whether ``jacobian_adjoint`` reads the score change's adjoint through the (n x dh)
    projections X Wk_l, X Wq_l and then the weights (2 k n d (n + d) operations a sample) rather
    than through the (n x d) products X Wk_l Wq_l^T, X Wq_l Wk_l^T (2 h k n^2 d): where
    h n > n + d, from a few dozen tokens (at 65 tokens, width 128, 8 heads 2.7 times fewer)."""
    heads, n, _, _ = data.shape
    return heads * n > n + data.output.shape[1]


def jacobian_rounding(data: JacobianData) -> tuple[Tensor, Tensor]:
    """(r_T, r_J) (B,): ||fl(L x) - L x|| <= r ||x|| for L = T_X, T_X + D_X and their adjoints
    as ``jacobian_apply`` and ``jacobian_adjoint`` evaluate them.

    Every output entry is a sum of products of data entries, each term carrying at most m
    roundings, so |fl - exact| <= gamma_m times the same evaluation on absolute values
    (Higham, Lemma 3.3 and eq. 3.5); m = 3 d + 3 n + 2 dh + 2 h (dv + n) + 16 exceeds every
    such path (the adjoint's score part sums 2 h n products with X Wk_l Wq_l^T and
    X Wq_l Wk_l^T, whose entries are sums of dh products and, taken absolutely, at most the
    products |X Wk_l| |Wq_l|^T that the bound below counts), plus 2 h dh where the adjoint
    goes by the projections (``adjoint_by_projections``: sums over n tokens, then over
    2 h dh; the same absolute products, associated the other way). The score change's query
    side in the image goes by scores as its key side does (``query_side_by_scores``: d + dh
    + 2 n + h dv + 8 roundings at most), or by the covariances (``JacobianData.covariances``),
    as the adjoint's first half does where it goes by the projections: those terms are the
    same products P_im k_m v_m a_i and P_im P_im' k_m' v_m a_i,
    summed over m, m' and the features in another order (at most n + d + dh + h (dv + dh) + 6
    roundings each), so their absolute evaluation is the one below.
    The absolute evaluation of T_X has Frobenius norm at most
    (r + sum_l ||P_l||_2 ||Wv_l||_F ||Wo_l||_F) ||G||_F with ||P_l||_2 <= (max column sum)^(1/2)
    for a row-stochastic P_l >= 0; that of D_X at most
    sum_l (2 / s) (||Wq_l||_F ||X Wk_l||_F + ||X Wq_l||_F ||Wk_l||_F) ||X Wv_l||_F ||Wo_l||_F
    ||G||_F (|J_l|(E) = P o |E| + P o (row sums of P o |E|) has ||.||_F <= 2 ||E||_F as every row
    of P has ||p||_2 <= 1). The adjoints have the same absolute evaluations, transposed."""
    heads = data.x_value.shape[1]
    dv, dh = data.x_value.shape[3], data.x_query.shape[3]
    n, d = data.probs.shape[-1], data.output.shape[1]
    columns = data.projections.square().sum(dim=0).split([heads * dv, heads * dh, heads * dh])
    value, query, key = (c.reshape(heads, -1).sum(dim=1).sqrt() for c in columns)  # ||W._l||_F
    output = data.output.unflatten(0, (heads, dv)).norm(dim=(1, 2))  # ||Wo_l||_F
    spread = data.probs.sum(dim=-2).amax(dim=-1).sqrt()  # (B, h) >= ||P_l||_2
    first = data.residual + (spread * value * output).sum(dim=1)
    frob = torch.linalg.vector_norm
    softmax = (2.0 / data.scale * (query * frob(data.x_key, dim=(2, 3))
                                   + frob(data.x_query, dim=(2, 3)) * key)
               * frob(data.x_value, dim=(2, 3)) * output).sum(dim=1)
    by_projections = 2 * heads * dh if adjoint_by_projections(data) else 0
    g = (gamma(3 * d + 3 * n + 2 * dh + 2 * heads * (dv + n) + 16 + by_projections)
         * (1.0 + 2.0 ** -30))
    return g * first, g * (first + softmax)


def jacobian_working_elements(count: int, data: JacobianData, softmax: bool) -> int:
    """Float64 elements that ``jacobian_apply`` and then ``jacobian_adjoint`` hold at once for
    one sample and ``count`` vectors: the image and the adjoint's output (k n d each), its
    feature-major values twice (k n h dv each) and, with the softmax part, its score tensors
    (k h n^2: once as scores, twice as the adjoint's left factor, or 4 k h dh n for the two
    halves where it goes by the projections) and the query side's term (k h n^2 as scores,
    ``query_side_by_scores``, else k n h dv by the covariances), plus a few tensors of the
    sample alone (below).
    The score tensors dominate from a few dozen tokens (at 257 tokens, width 128, 8 heads:
    1.7e6 k elements, 26 times k n d), so chunks sized by k n d alone would hold 26 times
    their workspace."""
    heads, n, dv, dh = data.shape
    d = data.output.shape[1]
    scores = (heads * n * n + 4 * heads * dh * n if adjoint_by_projections(data)
              else 3 * heads * n * n)  # the adjoint's left factor, or its two halves twice
    by_scores = query_side_by_scores(data)
    query_side = heads * n * n if by_scores else heads * dv * n
    per_vector = 2 * n * d + 2 * heads * dv * n + (scores + query_side if softmax else 0)
    # and per sample: ``_mix_tokens``' copies (route "heads": the values token-major and a
    # head's product, h n dv k each; else P_l expanded over the value features), with the
    # softmax part X Wv_l / s twice, the adjoint's right factor X Wk_l Wq_l^T, X Wq_l Wk_l^T
    # (2 h n d) twice and, where used, the covariances with their outer products (h n dh dv
    # each)
    by_heads = mixing_route(data.probs.device, n, count) == "heads"
    mixing = 2 * heads * n * dv * count if by_heads else heads * dv * n * n
    covariances = (2 * heads * n * dh * dv
                   if not by_scores or adjoint_by_projections(data) else 0)
    per_sample = mixing + (2 * heads * n * dv + 4 * heads * n * d + covariances
                           if softmax else 0)
    return count * per_vector + per_sample


def deflated_first_order_bound(data: JacobianData, deflation: Deflation, reference_norm: Tensor,
                               deviation: Tensor, softmax: Tensor | None,
                               projected: ProjectedBasis | None = None) -> tuple[Tensor, Tensor]:
    """A deterministic upper bound (B,) on ||T_X||, or on ||T_X + D_X|| given softmax (B,)
    >= ||D_X||, and its Rayleigh-Ritz estimate (B,), by ``deflation.deflated_norm_bound``
    (3. of the module docstring). deflation: of T_R, ``complement`` in the units of T_X;
    reference_norm >= ||T_R||; deviation (B,) >= ||T_X - T_R||; projected: the basis's
    ``project_basis`` (formed here if not given; ``AttentionSpec.deflation_products`` keeps it
    per model). The samples run in chunks whose products fit the device's workspace
    (``first_order.sample_chunks`` with ``jacobian_working_elements``)."""
    batch, _, n, _ = data.probs.shape
    count, d = deflation.size, data.output.shape[1]
    with_softmax = softmax is not None
    basis = deflation.basis.mT.reshape(count, n, d)
    if projected is None:
        heads, _, dv, _ = data.shape
        projected = project_basis(basis, data.projections, heads, dv)
    r_first, r_jacobian = jacobian_rounding(data)
    rounding = r_jacobian if with_softmax else r_first
    whole = deviation + softmax if with_softmax else deviation
    bounds, estimates = [], []
    for rows in sample_chunks(batch, jacobian_working_elements(count, data, with_softmax),
                              data.probs.device):
        part = JacobianData(probs=data.probs[rows], x_query=data.x_query[rows],
                            x_key=data.x_key[rows], x_value=data.x_value[rows],
                            projections=data.projections, output=data.output,
                            residual=data.residual, scale=data.scale)
        image = jacobian_apply(basis, part, with_softmax, projected)
        back = jacobian_adjoint(image, part, with_softmax)
        size = image.shape[0]
        bound, estimate = deflated_norm_bound(
            image.reshape(size, count, -1), back.reshape(size, count, -1), deflation,
            whole[rows], reference_norm + whole[rows], rounding[rows])
        bounds.append(bound)
        estimates.append(estimate)
    return torch.cat(bounds), torch.cat(estimates)
