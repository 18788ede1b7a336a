"""Every norm strategy of ``lofast.bounds.attention_norms`` against the same dense float64
references: ||T_X|| materialised, ||T_X + D_X|| from the block's autograd Jacobian and
||D_X|| their difference. Each strategy's candidate must lie above the reference quantity it
bounds, on every sample it ran on, in every block shape and method where it applies."""

import functools

import pytest
import torch
from test_bounds_attention import DENSE, LANCZOS, VERIFIED, make_tokens, make_weights
from test_bounds_coordinate_jacobian import coordinate_block
from test_bounds_near_reference import dense_norms, live_block, patterned_tokens

from lofast.bounds import attention
from lofast.bounds.attention import attention_sensitivity
from lofast.bounds.attention_norms import (
    STRATEGIES,
    DeferredProofs,
    DeflatedReference,
    NormBounds,
    attention_norms,
    merge,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# (name, block, tokens, method, first_order): near the reference and far from it, with and
# without a position bias and a residual, heads on their own coordinates, every method kind
CASES = [
    ("near, position bias", lambda: live_block(6, 12, 3, 4, 0.05, seed=3),
     lambda: patterned_tokens("alike", 3, 6, 12, seed=4), VERIFIED, "lofast"),
    ("live, position bias", lambda: live_block(6, 16, 4, 4, 0.3, seed=15),
     lambda: patterned_tokens("alike", 4, 6, 16, seed=16), VERIFIED, "lofast"),
    ("far, position bias", lambda: live_block(5, 12, 3, 4, 3.0, seed=17),
     lambda: patterned_tokens("random", 3, 5, 12, seed=18), VERIFIED, "lofast"),
    ("far, uniform, no residual", lambda: live_block(5, 12, 3, 4, 3.0, seed=5, biased=False,
                                                     residual=False),
     lambda: patterned_tokens("random", 3, 5, 12, seed=6), VERIFIED, "lofast"),
    ("far, Lanczos", lambda: live_block(5, 12, 3, 4, 3.0, seed=17),
     lambda: patterned_tokens("random", 3, 5, 12, seed=18), LANCZOS, "lofast"),
    ("dense", lambda: make_weights(2, 8, 4, True, seed=7, gain=2.0, bias_tokens=4),
     lambda: make_tokens(3, 4, 8, 1.0, seed=8), DENSE, "lofast"),
    ("naive", lambda: make_weights(2, 8, 4, True, seed=7, gain=2.0),
     lambda: make_tokens(3, 4, 8, 1.0, seed=8), DENSE, "naive"),
    ("own coordinates", lambda: coordinate_block(2, 12, 6, 4, True, score=6.0, seed=14),
     lambda: make_tokens(3, 4, 12, 1.0, seed=7), VERIFIED, "lofast"),
]

# strategies whose candidate is the method's own norm (or a closed form): within the method's
# slack of the reference, so the test also fails when one of them is scaled down or up
TIGHT = {"MethodFirstOrder": "zeta", "MethodSoftmax": "softmax", "CoordinateFirstOrder": "zeta"}


# the product bound on ||D_X|| each traced driver started from (the driver tightens its own)
SOFTMAX_STARTS: dict[int, torch.Tensor] = {}


@functools.cache
def traced(case: int):
    """Every strategy's candidate in the driver's order, the driver's own final bounds, the
    dense references, and the block of CASES[case] as ``attention_sensitivity`` builds it."""
    _, spec, tokens, method, first_order = CASES[case]
    w, X = spec(), tokens()
    captured = {}
    real = attention.attention_norms

    def capture(block, softmax, cheap=False):
        captured["block"], captured["softmax"] = block, softmax.clone()
        captured["random"] = block.generator.get_state()  # Lanczos draws its starts from it
        return real(block, softmax, cheap)

    attention.attention_norms = capture
    try:
        final = attention_sensitivity(X, w, method=method, softmax_jacobian=True,
                                      first_order=first_order,
                                      generator=torch.Generator().manual_seed(0))
    finally:
        attention.attention_norms = real
    block = captured["block"]
    block.generator.set_state(captured["random"])
    SOFTMAX_STARTS[case] = captured["softmax"].clone()
    bounds = NormBounds(zeta=torch.full((X.shape[0],), torch.inf, dtype=torch.float64),
                        softmax=captured["softmax"])
    candidates = []
    for strategy in STRATEGIES:  # the driver's loop, each candidate kept
        if not strategy.applies(block):
            continue
        rows = strategy.rows(block, bounds)
        if not bool(rows.any()):
            continue
        candidate = strategy.bound(block, bounds, rows)
        candidates.append((type(strategy).__name__, candidate))
        merge(bounds, candidate)
        bounds.zeta_is_tight = bounds.zeta_is_tight or strategy.closed_form
    first, whole, softmax = dense_norms(X, w)
    return (candidates, bounds, final, {"zeta": first, "jacobian": whole, "softmax": softmax},
            block)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_the_traced_loop_is_the_driver(case):
    _, bounds, final, _, _ = traced(case)
    assert torch.equal(bounds.zeta, final.zeta)
    assert torch.equal(bounds.softmax, final.softmax_first_order)
    assert (bounds.jacobian is None) == (final.jacobian is None)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_the_cheap_walk_defers_every_proof_and_never_bounds_below_the_full_one(case):
    """Without its per-sample proofs the walk's bounds are no smaller than the full walk's,
    the same where it defers none, and it defers every sample a proof ran on in the full walk
    (the certifier's verdicts-only pass refines exactly those)."""
    candidates, full, _, _, block = traced(case)
    block.generator.set_state(torch.Generator().manual_seed(0).get_state())
    cheap = attention_norms(block, SOFTMAX_STARTS[case].clone(), True)
    proved = torch.zeros_like(cheap.deferred)
    for name, candidate in candidates:
        if any(type(s).__name__ == name and s.per_sample_proof for s in STRATEGIES):
            proved |= candidate.rows
    assert torch.equal(cheap.deferred & proved, proved)
    for quantity in ("zeta", "softmax", "jacobian"):
        tight, loose = getattr(full, quantity), getattr(cheap, quantity)
        if tight is None:
            continue
        assert (loose >= tight).all(), quantity
        kept = ~cheap.deferred
        assert torch.equal(loose[kept], tight[kept]), quantity


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_the_deferred_proofs_lower_estimates_lie_below_the_dense_norms(case):
    """What the verdicts-only screen assumes no proof goes below: ||T_X|| and the Jacobian's
    norm ||T_X + D_X|| from below, on every sample: within 20 % of the dense norms, within
    1e-3 near the reference (one vector near its top: a screen that gave up, with zeros, or
    one 0.1 % above, fails here)."""
    _, _, _, reference, block = traced(case)
    rows = torch.ones(block.X.shape[0], dtype=torch.bool)
    first_order, jacobian = DeferredProofs(block, SOFTMAX_STARTS[case], rows).lower_estimates(rows)
    for value, exact in ((first_order, reference["zeta"]), (jacobian, reference["jacobian"])):
        assert (value <= exact).all(), (CASES[case][0], value, exact)
        near = CASES[case][0].startswith(("near", "live"))
        assert (value >= exact * (0.999 if near else 0.8)).all(), (CASES[case][0], value, exact)


@pytest.mark.parametrize("strategy", sorted({type(s).__name__ for s in STRATEGIES}))
def test_every_strategy_bounds_the_dense_norms(strategy):
    ran = 0
    for case in range(len(CASES)):
        candidates, _, _, reference, _ = traced(case)
        for name, candidate in candidates:
            if name != strategy:
                continue
            for quantity in ("zeta", "softmax", "jacobian"):
                value = getattr(candidate, quantity)
                if value is None:
                    continue
                ran += 1
                exact = reference[quantity][candidate.rows]
                assert (value >= exact * (1 - 1e-12)).all(), (CASES[case][0], quantity,
                                                              value, exact)
                if TIGHT.get(strategy) == quantity and CASES[case][3] is not LANCZOS:
                    assert (value <= exact * (1 + 2e-3)).all(), (CASES[case][0], value, exact)
    assert ran, f"{strategy} ran in none of the cases"


@pytest.mark.parametrize("closed_form", [False, True])
def test_the_first_deflation_leaves_to_the_larger_what_it_cannot_settle(closed_form):
    # Its bound is at least c + delta (complement plus deviation). Where the larger deflation
    # follows, a sample whose c + delta exceeds ||T_R|| goes straight to it; where zeta is in
    # closed form (no larger deflation), only one above ||T_R|| by more than the slack is left
    block = traced(1)[4]
    slack = block.method.jacobian_slack
    base = block.deflation().complement + block.head_deviation  # (B,) c + delta, D_X apart
    ratios = torch.tensor([0.7, 1.0 + slack / 20, 1.0 + 2 * slack, 1.0 + 2 * slack],
                          dtype=torch.float64)
    softmax = block.reference_norm * ratios - base  # the bounds on ||D_X|| that put c + delta
    assert len(base) == 4 and bool((softmax >= 0).all())  # at those multiples of ||T_R||
    bounds = NormBounds(zeta=torch.ones(4, dtype=torch.float64), softmax=softmax,
                        loose=torch.tensor([True, True, True, False]))
    bounds.zeta_is_tight = closed_form
    rows = DeflatedReference(large=False).rows(block, bounds)
    assert rows.tolist() == [True, closed_form, False, False]
