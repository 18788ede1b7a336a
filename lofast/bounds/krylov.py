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

LinearMap = Callable[[Tensor], Tensor]


def fixed_unit_vector(size: int, device: torch.device) -> Tensor:
    """A fixed pseudo-random unit vector (size,) (seed 0, drawn on the CPU): the same start for
    every sample, so that a sample's bound does not depend on its batch."""
    x = torch.randn(size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (x / torch.linalg.vector_norm(x)).to(device)


def lanczos_ritz(gram: LinearMap, start: Tensor, m: int) -> Tensor:
    """Largest Ritz value (clamped at 0) of m Lanczos steps on the symmetric PSD maps ``gram``
    ((B, N) -> (B, N)) from the unit vectors ``start`` (B, N), with full reorthogonalisation
    (CGS2) and breakdown handling; at most lambda_max in exact arithmetic. Returns (B,)."""
    tridiagonal, _ = _lanczos(gram, start, m)
    return torch.linalg.eigvalsh(tridiagonal)[:, -1].clamp_min(0.0)


def lanczos_ritz_pair(gram: LinearMap, start: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """``lanczos_ritz`` and its Ritz vectors (B, N), unit (an estimate of the top eigenvector,
    for starting later iterations)."""
    tridiagonal, basis = _lanczos(gram, start, m)
    values, vectors = torch.linalg.eigh(tridiagonal)
    ritz = (vectors[:, None, :, -1] @ basis)[:, 0]  # (B, N)
    ritz = ritz / torch.linalg.vector_norm(ritz, dim=1, keepdim=True).clamp_min(1e-300)
    return values[:, -1].clamp_min(0.0), ritz


def lanczos_ritz_vectors(gram: LinearMap, start: Tensor, m: int,
                         count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` largest Ritz values (B, count), in descending order, and their unit Ritz
    vectors (B, count, N) after m Lanczos steps (see ``lanczos_ritz``): estimates of the top
    eigenpairs (count <= m), for deflation. No guarantee attaches to them."""
    tridiagonal, basis = _lanczos(gram, start, m)
    values, vectors = torch.linalg.eigh(tridiagonal)
    top = vectors[..., -count:].flip(-1)  # (B, m, count)
    ritz = top.mT @ basis  # (B, count, N)
    ritz = ritz / torch.linalg.vector_norm(ritz, dim=-1, keepdim=True).clamp_min(1e-300)
    return values[..., -count:].flip(-1), ritz


def _lanczos(gram: LinearMap, start: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """m Lanczos steps (see ``lanczos_ritz``): the tridiagonal matrices (B, m, m) and the bases
    (B, m, N)."""
    batch, dim = start.shape
    basis = start.new_zeros(batch, m, dim)
    alpha = start.new_zeros(batch, m)
    beta = start.new_zeros(batch, m)
    scale = start.new_zeros(batch)  # running max ||A q_i|| <= lambda_max(A)
    broken = torch.zeros(batch, dtype=torch.bool, device=start.device)
    q = start
    for j in range(m):
        basis[:, j] = q
        w = gram(q)
        alpha[:, j] = (q * w).sum(dim=1)
        scale = torch.maximum(scale, torch.linalg.vector_norm(w, dim=1))
        if j == m - 1:
            break
        previous = basis[:, : j + 1]
        for _ in range(2):  # CGS2: removes alpha_j q_j, beta_{j-1} q_{j-1} and rounding drift
            # row-vector products (1 x N)(N x j+1) and (1 x j+1)(j+1 x N): the fastest layout
            coefficients = torch.bmm(w[:, None, :], previous.mT)  # (B, 1, j + 1)
            w = w - torch.bmm(coefficients, previous)[:, 0]
        norm = torch.linalg.vector_norm(w, dim=1)
        # Breakdown: span(q_0..q_j) is an exact invariant subspace of A + E, ||E|| <= beta_j (the
        # recursion so far is that of A + E). Zero the sample's recursion: its later vectors are
        # 0, adding zero rows and columns to T, which keep its top eigenvalue (T is PSD).
        broken = broken | (norm <= BREAKDOWN_TOL * scale)
        beta[:, j] = torch.where(broken, 0.0, norm)
        q = torch.where(broken[:, None], 0.0, w / torch.where(broken, 1.0, norm)[:, None])
    tridiagonal = (torch.diag_embed(alpha) + torch.diag_embed(beta[:, :-1], offset=1)
                   + torch.diag_embed(beta[:, :-1], offset=-1))
    return tridiagonal, basis


def power_iterate(gram: LinearMap, start: Tensor, iterations: int) -> Tensor:
    """Power iteration on symmetric PSD maps ``gram`` ((B, N) -> (B, N)) from unit vectors
    ``start`` (B, N); returns the final unit vectors (a vector is kept where gram maps it to 0)."""
    x = start
    for _ in range(iterations):
        y = gram(x)
        norm = torch.linalg.vector_norm(y, dim=1, keepdim=True)
        x = torch.where(norm > 0, y / torch.where(norm > 0, norm, 1.0), x)
    return x
