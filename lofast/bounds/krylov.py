"""Krylov iterations on batched symmetric linear maps: Lanczos Ritz values and vectors with full
reorthogonalisation, and power iteration. They estimate a top eigenvalue from below (in exact
arithmetic): never a bound on their own; ``spectral`` and ``verified`` turn them into bounds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Lanczos breakdown: beta_j <= BREAKDOWN_TOL * max_i ||A q_i|| means span(q_0..q_j) is invariant
# up to a perturbation E of A with ||E|| <= beta_j <= BREAKDOWN_TOL * lambda_max(A); this factor
# is added to the bound. It sits a few decades above the rounding noise of a reorthogonalised
# residual (about m u) so that true breakdowns are caught, and far below ROUNDING_MARGIN.
BREAKDOWN_TOL = 1e-12

# Reorthogonalisation (``_reorthogonalise``): a second Gram-Schmidt pass where the first left
# less than this share of the vector's norm (the DGKS criterion's 1 / sqrt(2)).
REPEAT_BELOW = 2.0 ** -0.5

LinearMap = Callable[[Tensor], Tensor]


def fixed_unit_vector(size: int, device: torch.device) -> Tensor:
    """A fixed pseudo-random unit vector (size,) (seed 0, drawn on the CPU): the same start for
    every sample, so that a sample's bound does not depend on its batch."""
    x = torch.randn(size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (x / torch.linalg.vector_norm(x)).to(device)


def lanczos_ritz(gram: LinearMap, start: Tensor, m: int) -> Tensor:
    """Largest Ritz value (clamped at 0) of m Lanczos steps on the symmetric PSD maps ``gram``
    ((B, N) -> (B, N)) from the unit vectors ``start`` (B, N), with full reorthogonalisation
    (``_reorthogonalise``) and breakdown handling; at most lambda_max in exact arithmetic.
    Returns (B,)."""
    run = LanczosRun(gram, start, m)
    run.advance(m)
    return torch.linalg.eigvalsh(run.tridiagonal())[:, -1].clamp_min(0.0)


def lanczos_ritz_pair(gram: LinearMap, start: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """``lanczos_ritz`` and its Ritz vectors (B, N), unit (an estimate of the top eigenvector,
    for starting later iterations)."""
    run = LanczosRun(gram, start, m)
    run.advance(m)
    values, vectors = run.ritz_pairs(1)
    return values[:, 0].clamp_min(0.0), vectors[:, 0]


class LanczosRun:
    """Lanczos steps (see ``lanczos_ritz``) on ``gram`` from ``start`` (B, N), up to
    ``capacity`` of them, taken in stages: ``advance(m)`` continues the recurrence to m steps,
    so a caller that needs more steps than it first thought (a deflation whose size depends on
    the Ritz values) pays for the steps it takes, not for the most it might need. Each step
    removes alpha_j q_j and beta_(j-1) q_(j-1) (the three-term recurrence), then
    reorthogonalises against every earlier vector (``_reorthogonalise``). m steps taken in any
    stages give the same numbers as m steps at once."""

    def __init__(self, gram: LinearMap, start: Tensor, capacity: int) -> None:
        batch, dim = start.shape
        self.gram = gram
        self.capacity = capacity
        self.steps = 0
        self._basis = start.new_zeros(batch, capacity, dim)
        self._alpha = start.new_zeros(batch, capacity)
        self._beta = start.new_zeros(batch, capacity)
        self._scale = start.new_zeros(batch)  # running max ||A q_i|| <= lambda_max(A)
        self._broken = torch.zeros(batch, dtype=torch.bool, device=start.device)
        self._q = start
        self._pending: Tensor | None = None  # A q_(steps-1), its residual not yet taken

    def advance(self, m: int) -> None:
        """Continue to m steps in all (at most ``capacity``; fewer than taken is an error)."""
        if not self.steps <= m <= self.capacity:
            raise ValueError(f"cannot advance a Lanczos run of {self.steps} steps (capacity "
                             f"{self.capacity}) to {m}")
        for j in range(self.steps, m):
            if self._pending is not None:
                self._next_vector(j - 1, self._pending)
            self._basis[:, j] = self._q
            w = self.gram(self._q)
            self._alpha[:, j] = (self._q * w).sum(dim=1)
            self._scale = torch.maximum(self._scale, torch.linalg.vector_norm(w, dim=1))
            self._pending = w
        self.steps = max(self.steps, m)

    def _next_vector(self, j: int, w: Tensor) -> None:
        """q_(j+1) from w = A q_j: the three-term step, reorthogonalisation and breakdown."""
        w = w - self._alpha[:, j, None] * self._q
        if j > 0:
            w = w - self._beta[:, j - 1, None] * self._basis[:, j - 1]
        w, norm = _reorthogonalise(w, self._basis[:, : j + 1])
        # Breakdown: span(q_0..q_j) is an exact invariant subspace of A + E, ||E|| <= beta_j (the
        # recursion so far is that of A + E). Zero the sample's recursion: its later vectors are
        # 0, adding zero rows and columns to T, which keep its top eigenvalue (T is PSD).
        self._broken = self._broken | (norm <= BREAKDOWN_TOL * self._scale)
        self._beta[:, j] = torch.where(self._broken, 0.0, norm)
        self._q = torch.where(self._broken[:, None], 0.0,
                              w / torch.where(self._broken, 1.0, norm)[:, None])
        self._pending = None

    @property
    def basis(self) -> Tensor:
        """The Lanczos vectors so far (B, m, N)."""
        return self._basis[:, : self.steps]

    def tridiagonal(self) -> Tensor:
        """The tridiagonal matrices (B, m, m) of the steps so far."""
        m = self.steps
        alpha, beta = self._alpha[:, :m], self._beta[:, : max(m - 1, 0)]
        return (torch.diag_embed(alpha) + torch.diag_embed(beta, offset=1)
                + torch.diag_embed(beta, offset=-1))

    def ritz_values(self) -> Tensor:
        """All Ritz values of the steps so far (B, m), descending."""
        return torch.linalg.eigvalsh(self.tridiagonal()).flip(-1)

    def ritz_pairs(self, count: int) -> tuple[Tensor, Tensor]:
        """The ``count`` largest Ritz values (B, count), descending, and their unit Ritz
        vectors (B, count, N) of the steps so far (count <= m): estimates of the top
        eigenpairs, for deflation. No guarantee attaches to them."""
        values, vectors = torch.linalg.eigh(self.tridiagonal())
        top = vectors[..., -count:].flip(-1)  # (B, m, count)
        ritz = top.mT @ self.basis  # (B, count, N)
        ritz = ritz / torch.linalg.vector_norm(ritz, dim=-1, keepdim=True).clamp_min(1e-300)
        return values[..., -count:].flip(-1), ritz


def _reorthogonalise(w: Tensor, previous: Tensor) -> tuple[Tensor, Tensor]:
    """w (B, N) less its components along the orthonormal rows of previous (B, j, N), and its
    norm (B,): classical Gram-Schmidt, applied a second time to the samples whose first pass
    left less than REPEAT_BELOW of their norm: so much cancelled that the pass's rounding may
    leave w out of orthogonality (Daniel, Gragg, Kaufman & Stewart 1976; after the three-term
    step that happens only near an invariant subspace: 4 of 3,448 steps at 257 tokens). Each
    pass reads every earlier vector, the memory-bound part of a step, so the second runs only
    for those samples, on an accelerator too: choosing them waits for the device once a step,
    far less than a pass over a chunk's basis (hundreds of MB at 257 tokens) takes. A sample's
    result does not depend on the others in its batch."""
    before = torch.linalg.vector_norm(w, dim=1)
    w = _gram_schmidt_pass(w, previous)
    norm = torch.linalg.vector_norm(w, dim=1)
    again = (norm < REPEAT_BELOW * before).nonzero()[:, 0]
    if again.numel() > 0:
        w, norm = w.clone(), norm.clone()
        w[again] = _gram_schmidt_pass(w[again], previous[again])
        norm[again] = torch.linalg.vector_norm(w[again], dim=1)
    return w, norm


def _gram_schmidt_pass(w: Tensor, previous: Tensor) -> Tensor:
    """w (B, N) - sum_i (w . p_i) p_i over the rows p_i of previous (B, j, N): row-vector
    products (1 x N)(N x j) and (1 x j)(j x N), the fastest layout."""
    coefficients = torch.bmm(w[:, None, :], previous.mT)  # (B, 1, j)
    return w - torch.bmm(coefficients, previous)[:, 0]


def power_iterate(gram: LinearMap, start: Tensor, iterations: int) -> Tensor:
    """Power iteration on symmetric PSD maps ``gram`` ((B, N) -> (B, N)) from unit vectors
    ``start`` (B, N); returns the final unit vectors (a vector is kept where gram maps it to 0)."""
    x = start
    for _ in range(iterations):
        y = gram(x)
        norm = torch.linalg.vector_norm(y, dim=1, keepdim=True)
        x = torch.where(norm > 0, y / torch.where(norm > 0, norm, 1.0), x)
    return x
