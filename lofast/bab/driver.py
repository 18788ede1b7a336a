"""Branch and bound over ReLU activation patterns, independent of the bounding method.

The threat set (an l2 ball around one input) is split into subdomains by fixing ReLUs to one of
their two linear pieces: a split neuron (layer, index) is either active (its pre-activation
z >= 0, so relu(z) = z) or inactive (z <= 0, so relu(z) = 0). A domain is a set of such
decisions; its two children split one more neuron and together cover it. A `Bounder` computes,
for a batch of domains, lower bounds on the margins z_y - z_j over each domain, treating every
split as a constraint inside the bound (the split neuron's relaxation replaced by its exact
piece), so a child's bound is never looser than what its parent's relaxation gives there.

Guarantee: `branch_and_bound` returns "verified" only when every leaf of the tree has been
closed by a proven positive lower bound on all its margins (or was proven empty); since the
leaves cover the ball, every margin is then positive on the whole ball. Nothing is ever dropped
unproven: the time limit, the domain limit or an unsplittable leaf end the search as "unknown".
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from lofast.errors import LofastError
from lofast.runtime import TimeLimit, alarm, is_out_of_memory, memory_guard

Neuron = tuple[int, int]  # (ReLU layer, index into that layer's flattened pre-activations)
Splits = Mapping[Neuron, bool]  # neuron -> True: active (z >= 0), False: inactive (z <= 0)

HEURISTICS = ("babsr", "widest")
VERDICTS = ("verified", "falsified", "unknown")


@dataclass
class BoundBatch:
    """What a bounder returns for D domains, S margins and ReLU layers of n_l neurons.

    lower: (D, S) lower bounds on the margins over each domain; +inf in a row whose domain the
        bounder proved empty (its splits contradict each other on the ball).
    pre_lower, pre_upper: per ReLU layer (D, n_l), bounds on the pre-activations over each
        domain with its splits applied (a split neuron has pre_lower >= 0 or pre_upper <= 0).
    coefficients: per ReLU layer (D, S, n_l), the coefficient of each ReLU output in the
        linear function whose minimum gave `lower`, or None (the bounder has none). Only used
        to choose which neuron to split, never for soundness.
    candidates: (D, *input shape) points inside the threat set, each one where the domain's
        worst bound is attained by the bounder's linearisation, or None. Checked with the
        bounder's `margins` for a counterexample; never used for soundness.
    """

    lower: Tensor
    pre_lower: list[Tensor]
    pre_upper: list[Tensor]
    coefficients: list[Tensor] | None = None
    candidates: Tensor | None = None


class Bounder(Protocol):
    """Sound margin bounds for one input over subdomains of its threat set."""

    def root(self) -> BoundBatch:
        """Bounds for the whole threat set (one domain, no splits); may use a stronger, slower
        method than `bound`."""

    def bound(self, splits: Sequence[Splits], deadline: float | None) -> BoundBatch:
        """Bounds for each domain given by its splits (D = len(splits)). deadline: a
        time.perf_counter() value after which the bounder should return what it has (only an
        optimisation may stop early; every returned bound must be sound)."""

    def margins(self, points: Tensor) -> Tensor:
        """The exact margins (D, S) of the network at concrete points (D, *input shape)."""


@dataclass(frozen=True)
class BabSettings:
    """timeout: wall-clock seconds for one input (None: no limit), the root bound included.
    max_domains: the most open domains kept at once (a memory guard: each holds its splits).
    batch_size: subdomains bounded per bounder call (children of batch_size / 2 parents).
    heuristic: "babsr" (split the neuron whose relaxation costs the bound most, by the
        coefficients; the widest when the bounder gives none) or "widest" (the unstable neuron
        with the largest pre-activation interval)."""

    timeout: float | None = None
    max_domains: int = 200_000
    batch_size: int = 32
    heuristic: str = "babsr"

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise LofastError(f"timeout must be positive seconds or None, not {self.timeout!r}")
        if self.max_domains < 1 or self.batch_size < 2:
            raise LofastError("max_domains must be at least 1 and batch_size at least 2")
        if self.heuristic not in HEURISTICS:
            raise LofastError(f"heuristic must be one of {', '.join(HEURISTICS)}, "
                              f"not {self.heuristic!r}")


@dataclass(frozen=True)
class BabResult:
    """The outcome for one input.

    verdict: "verified" (every margin is positive on the whole threat set), "falsified" (a
        concrete point in the threat set has a margin < 0) or "unknown".
    lower_bound: a proven lower bound on the smallest margin over the threat set (the minimum
        over the leaves of the tree), or None when not even the root was bounded.
    domains: domains bounded, the root included.
    seconds: wall-clock time spent.
    reason: why not verified ("time limit", "domain limit", ...), None when verified.
    counterexample: the violating point when falsified.
    """

    verdict: str
    lower_bound: float | None
    domains: int
    seconds: float
    reason: str | None = None
    counterexample: Tensor | None = field(default=None, repr=False)


@dataclass
class Domain:
    """An open subdomain: its splits, its margin lower bounds (S,) and the neuron to split
    next (chosen when it was bounded)."""

    splits: dict[Neuron, bool]
    lower: Tensor
    branch: Neuron

    @property
    def worst(self) -> float:
        return float(self.lower.min())


def split(domain: Domain) -> tuple[dict[Neuron, bool], dict[Neuron, bool]]:
    """The splits of the two children of `domain`: its branch neuron active, then inactive.
    Every point of the parent lies in one of them (z >= 0 or z <= 0)."""
    if domain.branch in domain.splits:
        raise ValueError(f"neuron {domain.branch} is split already")
    return {**domain.splits, domain.branch: True}, {**domain.splits, domain.branch: False}


def _unstable(batch: BoundBatch, d: int, splits: Splits) -> tuple[Tensor, Tensor, Tensor]:
    """(lower, upper) of domain d's pre-activations, all layers flattened into one vector, and
    a mask of the unstable ones (lower < 0 < upper) that are not split yet (a bounder that
    honours the splits reports those as stable anyway)."""
    lo = torch.cat([t[d] for t in batch.pre_lower])
    up = torch.cat([t[d] for t in batch.pre_upper])
    unstable = (lo < 0) & (up > 0)
    offsets = [0]
    for t in batch.pre_lower:
        offsets.append(offsets[-1] + t.shape[1])
    for layer, index in splits:
        unstable[offsets[layer] + index] = False
    return lo, up, unstable


def _neuron(batch: BoundBatch, flat: int) -> Neuron:
    for layer, t in enumerate(batch.pre_lower):
        if flat < t.shape[1]:
            return layer, flat
        flat -= t.shape[1]
    raise IndexError(flat)


def choose_widest(batch: BoundBatch, d: int, splits: Splits) -> Neuron | None:
    """The unstable neuron of domain d (whose splits are given) with the widest
    pre-activation interval, or None."""
    lo, up, unstable = _unstable(batch, d, splits)
    if not unstable.any():
        return None
    width = torch.where(unstable, up - lo, -torch.inf)
    return _neuron(batch, int(width.argmax()))


def choose_babsr(batch: BoundBatch, d: int, splits: Splits) -> Neuron | None:
    """BaBSR-style choice for domain d: the unstable neuron whose upper relaxation costs the
    lower bound most, -min(A, 0) * u (-l) / (u - l) summed over the margins not yet proven
    positive (A: the coefficient of the ReLU output, u (-l) / (u - l): the intercept of the
    upper line). The widest when the bounder gives no coefficients or no score is positive."""
    if batch.coefficients is None:
        return choose_widest(batch, d, splits)
    lo, up, unstable = _unstable(batch, d, splits)
    if not unstable.any():
        return None
    open_margins = batch.lower[d] <= 0  # (S,)
    a = torch.cat([t[d] for t in batch.coefficients], dim=-1)  # (S, n)
    cost = (-a[open_margins].clamp(max=0)).sum(dim=0)
    intercept = torch.where(unstable, up * (-lo) / (up - lo), 0.0)
    score = torch.where(unstable, cost * intercept, -torch.inf)
    if not score.max() > 0:
        return choose_widest(batch, d, splits)
    return _neuron(batch, int(score.argmax()))


CHOOSERS: dict[str, Callable[[BoundBatch, int, Splits], Neuron | None]] = {
    "babsr": choose_babsr, "widest": choose_widest}


def _clean(lower: Tensor) -> Tensor:
    """NaN (a failed bound) becomes -inf: it must never close a domain."""
    return torch.nan_to_num(lower.detach().double(), nan=-math.inf, posinf=math.inf,
                            neginf=-math.inf)


def _falsify(bounder: Bounder, batch: BoundBatch) -> Tensor | None:
    """A candidate point whose exact margins include a negative one, or None."""
    if batch.candidates is None:
        return None
    margins = bounder.margins(batch.candidates)
    bad = (margins < 0).any(dim=1).nonzero()
    return batch.candidates[int(bad[0])] if len(bad) else None


def branch_and_bound(bounder: Bounder, settings: BabSettings = BabSettings(),
                     device: torch.device | None = None) -> BabResult:
    """Verify one input by branch and bound with `bounder` (see the module docstring).

    The queue holds the open domains, worst lower bound first; each round takes up to
    batch_size / 2 of them, bounds their 2 children in one bounder call, closes the children
    whose margins are all proven positive (or that are empty) and queues the rest with the
    neuron to split next. Stops with "unknown" when the time limit passes (checked between
    calls, and each call is interrupted by SIGALRM where available), when more than
    max_domains domains are open, when an open domain has no unstable neuron left to split, or
    when the process runs out of memory (on Linux CPUs a temporary address-space limit,
    `lofast.runtime.memory_guard`, makes that an exception rather than a killed process).
    """
    start = time.perf_counter()
    deadline = None if settings.timeout is None else start + settings.timeout
    choose = CHOOSERS[settings.heuristic]
    domains = 0
    lower_bound: float | None = None

    def result(verdict: str, reason: str | None, point: Tensor | None = None) -> BabResult:
        return BabResult(verdict, lower_bound, domains, time.perf_counter() - start, reason,
                         point)

    def remaining() -> float | None:
        return None if deadline is None else deadline - time.perf_counter()

    heap: list[tuple[float, int, Domain]] = []
    order = itertools.count()  # ties broken by age: deterministic
    closed = math.inf  # the smallest bound of a closed leaf
    try:
        with memory_guard(device or torch.device("cpu")), alarm(remaining()):
            root = bounder.root()
        domains = 1
        lower = _clean(root.lower)[0]
        lower_bound = float(lower.min())
        point = _falsify(bounder, root)
        if point is not None:
            return result("falsified", "counterexample found", point)
        if lower_bound > 0:
            return result("verified", None)
        branch = choose(root, 0, {})
        if branch is None:
            return result("unknown", "no unstable ReLU to split")
        heapq.heappush(heap, (lower_bound, next(order), Domain({}, lower, branch)))
        while heap:
            left = remaining()
            if left is not None and left <= 0:
                return result("unknown", "time limit")
            parents = [heapq.heappop(heap)[2]
                       for _ in range(min(len(heap), settings.batch_size // 2))]
            children = [s for p in parents for s in split(p)]
            try:
                with memory_guard(device or torch.device("cpu")), alarm(left):
                    batch = bounder.bound(children, deadline)
            except BaseException:
                for p in parents:  # still open: they count in the bound reported
                    heapq.heappush(heap, (p.worst, next(order), p))
                raise
            domains += len(children)
            point = _falsify(bounder, batch)
            if point is not None:
                return result("falsified", "counterexample found", point)
            lowers = _clean(batch.lower)
            stuck = None
            for c, splits in enumerate(children):
                # the parent's bound holds on the child too (a subset): keep the better one
                lower = torch.maximum(lowers[c], parents[c // 2].lower)
                worst = float(lower.min())
                if worst > 0:
                    closed = min(closed, worst)
                    continue
                branch = choose(batch, c, splits)
                if branch is None:
                    stuck = worst
                heapq.heappush(heap, (worst, next(order), Domain(splits, lower, branch)))
            lower_bound = min(closed, heap[0][0]) if heap else closed
            if stuck is not None:
                return result("unknown", f"a subdomain with no unstable ReLU left has margin "
                                         f"lower bound {stuck:.4g} <= 0")
            if len(heap) > settings.max_domains:
                return result("unknown", f"domain limit ({settings.max_domains} open domains)")
        return result("verified", None)
    except TimeLimit:
        if heap:
            lower_bound = min(closed, heap[0][0])
        return result("unknown", "time limit")
    except Exception as error:  # only exhaustion becomes a result; the rest is a bug
        if not is_out_of_memory(error):
            raise
        if heap:
            lower_bound = min(closed, heap[0][0])
        return result("unknown", "out of memory")
