"""Branch and bound: the driver's splitting, bookkeeping and limits on tiny ReLU networks with the
plain-torch bounder (no auto_LiRPA needed), verified results checked against dense sampling of a
2-D input; with auto_LiRPA, beta-CROWN on a tiny lofast model against PGD and alpha-CROWN."""

import functools
import itertools
import json
import math
import time

import pytest
import torch
from torch import nn

from lofast.bab import (
    BabSettings,
    BoundBatch,
    Domain,
    SequentialBounder,
    branch_and_bound,
    choose_babsr,
    choose_widest,
    split,
)
from lofast.errors import LofastError


def relu_net(seed, widths=(2, 12, 12, 3)):
    """Linear/ReLU layers with weights drawn from an explicit generator (stable across runs)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        linear = nn.Linear(n_in, n_out).double()
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n_out, n_in, generator=g, dtype=torch.float64)
                                / math.sqrt(n_in))
            linear.bias.copy_(0.5 * torch.randn(n_out, generator=g, dtype=torch.float64))
        layers += [linear] if i == len(widths) - 2 else [linear, nn.ReLU()]
    return nn.Sequential(*layers)


X = torch.tensor([0.3, -0.2], dtype=torch.float64)
DISC = None


def disc_points():
    """A dense grid of the unit disc and 4,000 points of its circle (about 130,000 points)."""
    global DISC
    if DISC is None:
        g = torch.linspace(-1, 1, 401, dtype=torch.float64)
        grid = torch.cartesian_prod(g, g)
        angle = torch.linspace(0, 2 * math.pi, 4001, dtype=torch.float64)
        DISC = torch.cat([grid[grid.norm(dim=1) <= 1],
                          torch.stack([angle.cos(), angle.sin()], dim=1)])
    return DISC


def sampled_min(bounder, eps):
    """The smallest margin over the sampled ball: above the true minimum, close to it."""
    return float(bounder.margins(X + eps * disc_points()).min())


def radius(net, label):
    """The sampled robustness radius of X (bisection on sampled_min)."""
    bounder = SequentialBounder(net, X, label, 1.0)
    lo, hi = 0.0, 5.0
    for _ in range(25):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sampled_min(bounder, mid) > 0 else (lo, mid)
    return lo


@functools.cache
def network_and_radius(seed):
    """relu_net(seed), the label of X and its sampled radius (one bisection per seed)."""
    net = relu_net(seed)
    y = label(net)
    return net, y, radius(net, y)


def label(net):
    with torch.no_grad():
        return int(net(X).argmax())


class Recording:
    """A bounder that records every call's splits and bounds (and can be slowed down)."""

    def __init__(self, inner, delay=0.0):
        self.inner, self.delay, self.calls = inner, delay, []

    def root(self):
        batch = self.inner.root()
        self.calls.append(([{}], batch))
        return batch

    def bound(self, splits, deadline):
        time.sleep(self.delay)
        batch = self.inner.bound(splits, deadline)
        self.calls.append((list(splits), batch))
        return batch

    def margins(self, points):
        return self.inner.margins(points)


@pytest.fixture(scope="module")
def hard_case(one_thread):
    """Seed 6 at half its radius: neither intervals nor CROWN certify the root, BaB can.
    Returns (net, label, eps, radius)."""
    net, y, r = network_and_radius(6)
    return net, y, 0.5 * r, r


# --- the driver's pieces ---------------------------------------------------------------------



def subdomain_bounds_hold(calls, pre, margins, tolerance):
    """Every bounder call's lower bound holds at the sampled points whose ReLU pattern lies in
    its subdomain (pre[layer] (points, neurons) the pre-activations); returns how many
    subdomains held a sampled point."""
    checked = 0
    for splits, batch in calls:
        for d, domain in enumerate(splits):
            inside = torch.ones(len(margins), dtype=torch.bool)
            for (layer, index), active in domain.items():
                inside &= pre[layer][:, index] >= 0 if active else pre[layer][:, index] <= 0
            checked += int(inside.any())
            assert (margins[inside] >= batch.lower[d] - tolerance).all()
    return checked

def test_split_gives_two_children_that_cover_the_parent():
    parent = Domain({(0, 3): True}, torch.tensor([-0.1]), (1, 5))
    active, inactive = split(parent)
    assert active == {(0, 3): True, (1, 5): True}
    assert inactive == {(0, 3): True, (1, 5): False}
    with pytest.raises(ValueError):
        split(Domain(active, torch.tensor([-0.1]), (1, 5)))  # already split there


def test_children_bounds_are_sound_and_never_looser_with_intervals(hard_case):
    net, y, eps, _r = hard_case
    for method in ("ibp", "crown"):
        bounder = SequentialBounder(net, X, y, eps, method)
        root = bounder.root()
        branch = choose_widest(root, 0, {})
        children = split(Domain({}, root.lower[0], branch))
        batch = bounder.bound(children)
        if method == "ibp":  # smaller intervals everywhere: never a looser bound
            assert (batch.lower >= root.lower - 1e-12).all()
        layer, index = branch
        assert batch.pre_lower[layer][0, index] >= 0 and batch.pre_upper[layer][1, index] <= 0
        # every sampled point lies in a child, whose bound holds there
        points = X + eps * disc_points()
        z = points @ net[0].weight.T + net[0].bias
        if layer == 1:
            z = z.relu() @ net[2].weight.T + net[2].bias
        margins = bounder.margins(points)
        for c, inside in enumerate((z[:, index] >= 0, z[:, index] <= 0)):
            assert inside.any()
            assert (margins[inside] >= batch.lower[c] - 1e-9).all()


def test_every_bounded_domain_holds_on_its_points(hard_case):
    """Soundness of the splits as constraints: in every subdomain BaB bounded, the sampled
    points that satisfy its splits have margins above its bound."""
    net, y, eps, _r = hard_case
    recording = Recording(SequentialBounder(net, X, y, eps * 1.1))
    branch_and_bound(recording, BabSettings(timeout=20, batch_size=8))
    points = X + 1.1 * eps * disc_points()
    z1 = points @ net[0].weight.T + net[0].bias
    z2 = z1.relu() @ net[2].weight.T + net[2].bias
    pre = (z1, z2)
    margins = recording.inner.margins(points)
    assert subdomain_bounds_hold(recording.calls, pre, margins, 1e-9) > 20


def test_bookkeeping(hard_case):
    net, y, eps, _r = hard_case
    recording = Recording(SequentialBounder(net, X, y, eps))
    result = branch_and_bound(recording, BabSettings(timeout=20, batch_size=8))
    assert result.verdict == "verified" and result.reason is None
    assert result.lower_bound > 0
    sizes = [len(splits) for splits, _ in recording.calls]
    assert sizes[0] == 1 and result.domains == sum(sizes)
    assert all(s <= 8 and s % 2 == 0 for s in sizes[1:])
    seen = set()
    for splits, _ in recording.calls[1:]:
        for active, inactive in zip(splits[::2], splits[1::2]):
            # the two children of one parent: the same splits but one, taken both ways
            (neuron, value), = set(active.items()) - set(inactive.items())
            assert value and inactive[neuron] is False
            key = frozenset(active.items())
            assert key not in seen  # no domain is bounded twice
            seen.add(key)


def test_bab_certifies_what_intervals_and_crown_cannot(hard_case):
    net, y, eps, _r = hard_case
    assert sampled_min(SequentialBounder(net, X, y, eps), eps) > 0  # true: it is robust
    for method in ("ibp", "crown"):
        assert SequentialBounder(net, X, y, eps, method).root().lower.min() <= 0
    result = branch_and_bound(SequentialBounder(net, X, y, eps), BabSettings(timeout=20))
    assert result.verdict == "verified" and result.domains > 1
    # intervals alone cannot use a split's active side: no certificate, but no false one
    ibp = branch_and_bound(SequentialBounder(net, X, y, eps, "ibp"), BabSettings(timeout=5))
    assert ibp.verdict == "unknown"


@pytest.fixture(scope="module")
def optimiser_imported():
    """A process's first torch.optim optimizer imports torch._dynamo (about 2 s): done here, so
    that it is not charged to a run's time limit (beta-CROWN's multipliers use Adam)."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


# Networks whose runs all end verified or falsified within the limit on this machine (seeds 2
# and 6 spent 2 s in each of eight runs that ended "unknown", checking nothing): below the
# sampled radius every one verifies, at 0.97 of it after 23 to 341 domains.
@pytest.mark.parametrize("seed", [10, 12, 13, 17])
@pytest.mark.parametrize("heuristic", ["babsr", "widest"])
def test_verified_results_are_true(one_thread, optimiser_imported, seed, heuristic):
    net, y, r = network_and_radius(seed)
    outcomes = []
    for fraction in (0.5, 0.8, 0.9, 0.97, 1.03, 1.2):
        eps = fraction * r
        bounder = SequentialBounder(net, X, y, eps)
        result = branch_and_bound(bounder, BabSettings(timeout=2, heuristic=heuristic))
        true_min = sampled_min(bounder, eps)
        outcomes.append(result.verdict)
        if result.verdict == "verified":
            assert true_min > 0 and result.lower_bound <= true_min + 1e-9
        if result.verdict == "falsified":
            assert float(bounder.margins(result.counterexample[None]).min()) < 0
            assert float((result.counterexample - X).norm()) <= eps * (1 + 1e-9)
        if fraction > 1:
            assert result.verdict != "verified"
    assert outcomes[0] == "verified"


def test_a_planted_counterexample_is_never_verified(one_thread):
    """Class 1 wins only in a sliver of the ball near its edge (x0 >= X0 + 0.16 of eps 0.2)."""
    net = relu_net(5, (2, 6, 2))
    with torch.no_grad():
        net[0].weight[0] = torch.tensor([1.0, 0.0])
        net[0].bias[0] = -(float(X[0]) + 0.12)
        net[2].weight[:, 0] = torch.tensor([0.0, 5.0])
        net[2].weight[:, 1:] *= 0.01
        net[2].bias.copy_(torch.tensor([0.2, 0.0]) - net[2].weight[:, 1:] @ (
            net[0].weight[1:] @ X + net[0].bias[1:]).relu())
    assert label(net) == 0
    assert sampled_min(SequentialBounder(net, X, 0, 0.2), 0.2) < 0
    for method in ("ibp", "crown"):
        for heuristic in ("babsr", "widest"):
            result = branch_and_bound(SequentialBounder(net, X, 0, 0.2, method),
                                      BabSettings(timeout=5, heuristic=heuristic))
            assert result.verdict != "verified"
            if method == "crown":  # its linearisation points at the counterexample
                assert result.verdict == "falsified"


def test_time_limit_is_respected(hard_case):
    net, y, _eps, r = hard_case
    # at the radius nothing closes quickly; every call sleeps 50 ms
    slow = Recording(SequentialBounder(net, X, y, 0.999 * r, "ibp"), delay=0.05)
    result = branch_and_bound(slow, BabSettings(timeout=0.3))
    assert result.verdict == "unknown" and result.reason == "time limit"
    assert 0.3 <= result.seconds < 0.3 + 0.2
    assert result.lower_bound is not None and result.lower_bound <= 0

    class Stuck(Recording):  # one call that would take far too long is interrupted
        def bound(self, splits, deadline):
            time.sleep(5)

    start = time.perf_counter()
    result = branch_and_bound(Stuck(slow.inner), BabSettings(timeout=0.3))
    assert result.reason == "time limit" and time.perf_counter() - start < 2
    assert result.domains == 1 and result.lower_bound <= 0


def test_domain_limit_is_respected(hard_case):
    net, y, _eps, r = hard_case
    recording = Recording(SequentialBounder(net, X, y, 0.999 * r, "ibp"))
    result = branch_and_bound(recording, BabSettings(max_domains=6, batch_size=4))
    assert result.verdict == "unknown" and result.reason.startswith("domain limit")
    # at most one batch past the limit was bounded
    assert result.domains <= 1 + 6 + 2 * 4


def test_failed_bounds_never_close_a_domain():
    class Fixed:
        def __init__(self, value):
            self.value = value

        def root(self):
            return self.bound([{}], None)

        def bound(self, splits, deadline):
            d = len(splits)
            lo = torch.full((d, 1), -1.0)
            return BoundBatch(torch.full((d, 2), self.value), [lo], [torch.ones(d, 1)])

        def margins(self, points):
            raise AssertionError("no candidates were given")

    nan = branch_and_bound(Fixed(math.nan), BabSettings(timeout=1))
    assert nan.verdict == "unknown"
    assert nan.reason.startswith("a subdomain with no unstable ReLU left")  # split once
    empty = branch_and_bound(Fixed(math.inf), BabSettings(timeout=1))
    assert empty.verdict == "verified"  # +inf: the bounder proved the domain empty


def test_out_of_memory_is_a_result_and_other_errors_propagate(hard_case):
    net, y, eps, _r = hard_case

    class Failing(Recording):
        def bound(self, splits, deadline):
            raise self.error

    failing = Failing(SequentialBounder(net, X, y, eps))
    failing.error = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ...")
    result = branch_and_bound(failing, BabSettings(timeout=5))
    assert result.verdict == "unknown" and result.reason == "out of memory"
    assert result.lower_bound is not None and result.lower_bound <= 0
    failing.error = ValueError("a bug")
    with pytest.raises(ValueError):
        branch_and_bound(failing, BabSettings(timeout=5))


def test_heuristics_pick_unstable_neurons(hard_case):
    net, y, eps, _r = hard_case
    crown = SequentialBounder(net, X, y, eps).root()
    for choose in (choose_babsr, choose_widest):
        layer, index = choose(crown, 0, {})
        assert crown.pre_lower[layer][0, index] < 0 < crown.pre_upper[layer][0, index]
    ibp = SequentialBounder(net, X, y, eps, "ibp").root()
    assert ibp.coefficients is None and choose_babsr(ibp, 0, {}) == choose_widest(ibp, 0, {})


def test_invalid_settings():
    for kwargs in ({"timeout": 0}, {"max_domains": 0}, {"batch_size": 1},
                   {"heuristic": "random"}):
        with pytest.raises(LofastError):
            BabSettings(**kwargs)
    with pytest.raises(LofastError, match="alternate"):
        SequentialBounder(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)), X, 0, 0.1)


# --- beta-CROWN on a lofast model (auto_LiRPA) -----------------------------------------------


@pytest.fixture(scope="module")
def lirpa(one_thread):
    pytest.importorskip("auto_LiRPA")
    from lofast.crown import crown_available

    if not crown_available():
        pytest.skip("auto_LiRPA cannot be imported")


@pytest.fixture(scope="module")
def tiny(lirpa):
    """The randomised tiny model of test_crown (one block, 16 x 16 images) without a class
    preference, and 4 of 64 random images spread from the smallest margin up."""
    from test_crown import images_and_predictions, small_model

    model = small_model(seed=2, depth=1)
    with torch.no_grad():
        model.stages[-1].bias.zero_()
    x, y = images_and_predictions(model, 64, seed=2)
    with torch.no_grad():
        top2 = model(x).topk(2, dim=1).values
    order = (top2[:, 0] - top2[:, 1]).argsort()[::16]
    return model, x[order], y[order]


@pytest.mark.crown
def test_beta_crown_is_sound_and_at_least_alpha_crown(tiny):
    from lofast.certification.attack import pgd_l2
    from lofast.crown import crown_verify
    from lofast.crown.beta import beta_crown_verify

    model, x, y = tiny
    alpha_won = beta_won = broken_any = 0
    for eps in (0.05, 0.1):
        alpha = crown_verify(model, x, y, eps, method="alpha-crown", timeout=60)
        beta = beta_crown_verify(model, x, y, eps, timeout=60, alpha_iterations=20,
                                 settings=BabSettings(batch_size=8))
        broken = pgd_l2(model, x, y, eps, steps=50, restarts=3)
        for a, b, attacked in zip(alpha, beta, broken):
            assert not (b.certified and attacked)
            assert b.certified or not a.certified  # at least what alpha-CROWN certifies
            assert b.certified == (b.verdict == "verified") and b.domains >= 1
            assert b.margin_bound is not None and b.certified == (b.margin_bound > 0)
        alpha_won += sum(a.certified for a in alpha)
        beta_won += sum(b.certified for b in beta)
        broken_any += int(broken.sum())
    assert beta_won >= alpha_won and beta_won and broken_any  # both sides were exercised


@pytest.mark.crown
def test_beta_crown_subdomain_bounds_hold_on_their_points(lirpa):
    """Every subdomain's bound, with its splits as constraints inside auto_LiRPA, lies below
    the margins of the points (random ones on and in the ball) that satisfy its splits."""
    from test_crown import images_and_predictions, small_model

    from lofast.crown import MarginBounder
    from lofast.crown.beta import BetaCrownBounder

    model = small_model(depth=1)
    x, y = images_and_predictions(model, 2)
    x, y, eps = x[1:], y[1:], 0.2  # alpha-CROWN's bound is about -0.05 here
    bounder = BetaCrownBounder(MarginBounder(model, eps, "alpha-crown", alpha_iterations=5),
                               x, y, iterations=5)
    recording = Recording(bounder)
    result = branch_and_bound(recording, BabSettings(timeout=20, batch_size=8))
    assert result.domains > 1  # it did branch
    g = torch.Generator().manual_seed(0)
    directions = torch.randn(2000, *x.shape[1:], generator=g, dtype=torch.float64)
    directions /= directions.flatten(1).norm(dim=1)[:, None, None, None]
    scale = torch.rand(2000, generator=g, dtype=torch.float64)[:, None, None, None]
    scale[:1000] = 1.0
    points = x + eps * scale * directions
    module = bounder.module
    with torch.no_grad():
        module(points)  # records every node's value
    pre = [r.inputs[0].forward_value.reshape(len(points), -1) for r in bounder.relus]
    margins = bounder.margins(points)
    assert subdomain_bounds_hold(recording.calls, pre, margins, 1e-7) > 2


# --- command line and records ----------------------------------------------------------------


def test_fallback_fields_read_back_and_old_records_still_read():
    import json

    from lofast.certification.records import EpsResult, SampleRecord, record_from_json

    record = SampleRecord(index=3, label=1, prediction=1, margin=0.1, radius=0.0,
                          results={0.05: EpsResult(certified=False, bound=0.0, fallback={
                              "method": "beta-crown", "verdict": "unknown", "bound": -0.01,
                              "domains": 17, "seconds": 2.5})})
    assert record_from_json(json.loads(record.to_json(schema=1))) == record
    old = json.loads(record.to_json(schema=1))
    del old["fallback"], old["falsified"], old["counterexamples"]  # as files before them
    assert record_from_json(dict(old)).results[0.05].fallback is None
    with pytest.raises(ValueError):
        record_from_json({**old, "fallback": []})


@pytest.mark.crown
def test_run_fallback_writes_beta_crown_results_to_the_records(tiny):
    """What `lofast certify --fallback beta-crown` runs after LoFAST, on records LoFAST left
    open: verdicts, verifier, reasons, the fallback entry, and progress per sample."""
    from lofast.certification.pipeline import run_fallback
    from lofast.certification.records import EpsResult, SampleRecord, record_from_json

    model, x, y = tiny
    eps = [0.05, 0.1]
    records = [SampleRecord(index=i, label=int(y[i]), prediction=int(y[i]), margin=0.1,
                            radius=0.0, results={e: EpsResult(certified=False, bound=0.0)
                                                 for e in eps}) for i in range(len(x))]
    calls = []
    run_fallback(model, x, records, eps, "beta-crown", 10,
                 lambda phase, done, total: calls.append((phase, done, total)))
    assert calls[:5] == [("beta-crown at eps=0.05", done, 4) for done in range(5)]
    for r in records:
        assert record_from_json(json.loads(r.to_json(schema=1))) == r
        for result in r.results.values():
            entry = result.fallback
            if entry is None:
                continue
            assert entry["method"] == "beta-crown" and entry["domains"] >= 1
            assert result.certified == (entry["verdict"] == "verified")
            assert result.verifier == ("beta-crown" if result.certified else None)
            assert entry["seconds"] == result.fallback_seconds <= 10 + 5
            assert result.certified or result.reason.startswith("beta-crown: ")
    assert any(r.results[0.05].certified for r in records)
