"""The Jacobian norm of blocks whose scores and values act on each head's own coordinates
(``lofast.bounds.coordinate_jacobian``), against the block's dense autograd Jacobian and PGD."""

import pytest
import torch
from test_bounds_attention import (
    EPS,
    VERIFIED,
    make_tokens,
    make_weights,
    own_coordinates,
    pgd_lower_bound,
)
from test_bounds_near_reference import dense_norms

from lofast.bounds.attention import attention_probabilities, attention_sensitivity
from lofast.bounds.attention_spec import AttentionSpec
from lofast.bounds.coordinate_jacobian import coordinate_jacobian_norm

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def coordinate_block(h, d, dh, n, residual, score=6.0, alpha=0.7, beta=0.6, seed=0,
                     score_order=None):
    """query_key=identity and value_output=identity at score scale ``score`` (A_l = score Pi_l),
    B_l = alpha beta Pi_l, with a position bias; the scores' coordinates may be listed in
    another order (the same sets)."""
    bias = make_weights(h, d, dh, residual, seed, bias_tokens=n).position_bias
    value = own_coordinates(h, d, dh)
    scores = own_coordinates(h, d, dh, score_order)
    root = score ** 0.5
    return AttentionSpec(query=root * scores, key=root * scores, value=alpha * value,
                         output=beta * value.mT, residual=residual, scale=(d / h) ** 0.5,
                         position_bias=bias)


CONFIGS = [  # h, d, dh, n, residual: one wide head (dh > n) as in lofast-live, several heads,
    (1, 10, 10, 4, True),  # heads narrower than the token count, coordinates in no head
    (2, 12, 6, 4, True),
    (3, 9, 3, 5, False),
    (2, 10, 4, 5, True),
]


@pytest.mark.parametrize("h, d, dh, n, residual", CONFIGS)
@pytest.mark.parametrize("score", [0.5, 6.0, 30.0])
def test_jacobian_bound_dominates_the_autograd_norm(h, d, dh, n, residual, score):
    w = coordinate_block(h, d, dh, n, residual, score=score, seed=h + d)
    assert w.coordinate_attention is not None
    X = make_tokens(3, n, d, 1.0, seed=7)
    X = 0.8 * X[:, :1] + 0.4 * X  # alike tokens, as in the trained models
    _, exact, softmax = dense_norms(X, w)
    assert (softmax > 5e-3 * exact).all()  # attention is live: D_X matters
    sens = attention_sensitivity(X, w, method=VERIFIED, softmax_jacobian=True,
                                 score_bound="relaxed")
    bound = sens.refined_first_order
    assert (bound >= exact).all(), (bound, exact)
    # the verified norm of each small operator is within the method's slack of it
    tight = exact * (1 + 2 * VERIFIED.relative_slack)
    if dh > n:  # the part off the tokens' span is r I + c P_l itself: the bound is the norm
        assert (bound <= tight).all(), (bound, exact)
    direct = coordinate_jacobian_norm(X, attention_probabilities(X, w), w.coordinate_attention,
                                      residual, w.scale, VERIFIED)
    assert (direct <= tight).all()  # max_l ||F_l|| is never above the whole


def test_heads_may_list_their_coordinates_in_any_order():
    order = torch.tensor([3, 0, 5, 1, 4, 2, 7, 6])
    w = coordinate_block(2, 8, 4, 5, True, seed=3)
    shuffled = coordinate_block(2, 8, 4, 5, True, seed=3, score_order=torch.arange(8).flip(0))
    assert w.coordinate_attention is not None
    assert shuffled.coordinate_attention is None  # other sets of coordinates per head
    within = coordinate_block(2, 8, 4, 5, True, seed=3,
                              score_order=torch.cat([order[:4].sort().values.flip(0),
                                                     order[4:].sort().values]))
    assert within.coordinate_attention is None  # head 0 would compare other coordinates
    same_sets = coordinate_block(2, 8, 4, 5, True, seed=3,
                                 score_order=torch.tensor([2, 0, 3, 1, 7, 5, 4, 6]))
    assert same_sets.coordinate_attention is not None
    X = make_tokens(2, 5, 8, 1.0, seed=4)
    _, exact, _ = dense_norms(X, same_sets)
    bound = attention_sensitivity(X, same_sets, method=VERIFIED, softmax_jacobian=True,
                                  score_bound="relaxed").refined_first_order
    assert (bound >= exact).all()


def test_learned_scores_keep_the_general_path():
    w = coordinate_block(1, 8, 8, 4, True)
    learned = AttentionSpec(query=w.query + 1e-3 * torch.ones_like(w.query), key=w.key,
                            value=w.value, output=w.output, residual=True, scale=w.scale,
                            position_bias=w.position_bias)
    assert w.coordinate_values is not None and learned.coordinate_values is not None
    assert learned.coordinate_attention is None


@pytest.mark.parametrize("residual", [True, False])
def test_delta_with_the_coordinate_jacobian_dominates_pgd(residual):
    w = coordinate_block(1, 8, 8, 5, residual, score=20.0, seed=5)
    X = make_tokens(3, 5, 8, 1.0, seed=6)
    attack = pgd_lower_bound(X, w, EPS, restarts=3, steps=150)
    sens = attention_sensitivity(X, w, method=VERIFIED, softmax_jacobian=True)
    assert sens.jacobian is not None
    assert (sens.delta(EPS[None].expand(3, -1)) >= attack).all()
