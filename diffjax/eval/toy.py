"""The one-row noise-cancelling toy: when does subtracting a second softmax map help?

`trial` and `lambda_study`, printed by ``python -m diffjax.eval.toy``; the model, its seeds and
its numbers: docs/evaluation.md#the-noise-cancelling-toy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def draws(n: int, num_draws: int) -> np.ndarray:
  """The noise of ``num_draws`` rows: float64 [num_draws, 2, n] (c, e per row)."""
  return np.stack([np.random.default_rng(s).standard_normal((2, n)) for s in range(num_draws)])


def _logits(
  noise_Rx2xN: jax.Array, rho: float, gap: float, sigma: float
) -> tuple[jax.Array, jax.Array]:
  c_RxN, e_RxN = noise_Rx2xN[:, 0], noise_Rx2xN[:, 1]
  z1_RxN = (sigma * c_RxN).at[:, 0].add(gap)
  z2_RxN = sigma * (rho * c_RxN + jnp.sqrt(1.0 - rho**2) * e_RxN)
  return z1_RxN, z2_RxN


def _share(w_RxN: jax.Array) -> jax.Array:
  return jnp.abs(w_RxN[:, 0]) / jnp.sum(jnp.abs(w_RxN), axis=-1)


@dataclasses.dataclass(frozen=True)
class ToyResult:
  """Means over the draws: needle share of the single and the differential row, and the
  needle's weight in each."""

  n: int
  rho: float
  share_single: float
  share_diff: float
  weight_single: float
  weight_diff: float


def trial(
  n: int,
  rho: float,
  *,
  lam: float = 0.8,
  gap: float = 3.0,
  sigma: float = 1.0,
  num_draws: int = 1000,
  noise: np.ndarray | None = None,
) -> ToyResult:
  """One setting of the toy, averaged over ``num_draws`` rows (seeds 0..num_draws-1)."""
  noise_Rx2xN = jnp.asarray(draws(n, num_draws) if noise is None else noise, jnp.float32)
  z1_RxN, z2_RxN = _logits(noise_Rx2xN, rho, gap, sigma)
  a1_RxN = jax.nn.softmax(z1_RxN, axis=-1)
  d_RxN = a1_RxN - lam * jax.nn.softmax(z2_RxN, axis=-1)
  return ToyResult(
    n=n,
    rho=rho,
    share_single=float(jnp.mean(_share(a1_RxN))),
    share_diff=float(jnp.mean(_share(d_RxN))),
    weight_single=float(jnp.mean(a1_RxN[:, 0])),
    weight_diff=float(jnp.mean(d_RxN[:, 0])),
  )


@dataclasses.dataclass(frozen=True)
class LambdaStudy:
  """Mean needle share under four choices of λ, for one (n, rho).

  ``fixed``: λ = ``lam`` for every row; ``best_single``: the one λ (on the grid) that
  maximises the mean share, with its value ``best_single_lambda`` (V1: one λ per layer);
  ``per_row_unit``: each row's own best λ in [0, 1] (what a per-token σ(λ) can reach, V2);
  ``per_row``: each row's own best λ on the whole grid, with the rows' mean λ.
  """

  n: int
  rho: float
  single_map: float
  fixed: float
  best_single: float
  best_single_lambda: float
  per_row_unit: float
  per_row: float
  per_row_mean_lambda: float


def lambda_study(
  n: int,
  rho: float,
  *,
  lam: float = 0.8,
  gap: float = 3.0,
  sigma: float = 1.0,
  num_draws: int = 1000,
  lambda_max: float = 2.0,
  grid: int = 201,
) -> LambdaStudy:
  """How much of the needle share a per-row λ gains over one λ for all rows."""
  noise_Rx2xN = jnp.asarray(draws(n, num_draws), jnp.float32)
  z1_RxN, z2_RxN = _logits(noise_Rx2xN, rho, gap, sigma)
  a1_RxN = jax.nn.softmax(z1_RxN, axis=-1)
  a2_RxN = jax.nn.softmax(z2_RxN, axis=-1)
  lams_L = jnp.linspace(0.0, lambda_max, grid)
  # share_LxR[l, r]: row r's needle share with λ = lams_L[l].
  share_LxR = jax.lax.map(lambda l: _share(a1_RxN - l * a2_RxN), lams_L)
  mean_L = jnp.mean(share_LxR, axis=1)
  unit = lams_L <= 1.0
  best_row_R = jnp.argmax(share_LxR, axis=0)
  return LambdaStudy(
    n=n,
    rho=rho,
    single_map=float(jnp.mean(_share(a1_RxN))),
    fixed=float(jnp.mean(_share(a1_RxN - lam * a2_RxN))),
    best_single=float(jnp.max(mean_L)),
    best_single_lambda=float(lams_L[jnp.argmax(mean_L)]),
    per_row_unit=float(jnp.mean(jnp.max(jnp.where(unit[:, None], share_LxR, -1.0), axis=0))),
    per_row=float(jnp.mean(jnp.max(share_LxR, axis=0))),
    per_row_mean_lambda=float(jnp.mean(lams_L[best_row_R])),
  )


def main(argv=None) -> None:
  import argparse  # pylint: disable=import-outside-toplevel

  argparse.ArgumentParser(
    prog="python -m diffjax.eval.toy",
    description="Prints the noise-cancelling toy's needle shares (1,000 draws per setting) and "
    "the table of a single λ per layer against a λ per row.",
  ).parse_args(argv)
  print("needle share (|weight on needle| / total |weight|), 1,000 draws per setting")
  for rho in (0.0, 0.5, 0.9, 0.99):
    r = trial(32, rho)
    print(
      f"n=32    rho={rho:<4}  share: single {r.share_single:.3f}  diff {r.share_diff:.3f}  "
      f"needle weight {r.weight_single:.3f} -> {r.weight_diff:.3f}"
    )
  for n in (128, 512, 2048, 8192):
    r = trial(n, 0.9)
    print(f"n={n:<5}  rho=0.9   share: single {r.share_single:.3f}  diff {r.share_diff:.3f}")
  print()
  print(
    "| n | rho | single map | λ = 0.8 | best single λ (value) | per-row λ in [0, 1] | "
    "per-row λ in [0, 2] (mean λ) |"
  )
  print("|---|---|---|---|---|---|---|")
  for n, rho in ((32, 0.0), (32, 0.5), (32, 0.9), (32, 0.99), (512, 0.9)):
    s = lambda_study(n, rho)
    print(
      f"| {n} | {rho} | {s.single_map:.3f} | {s.fixed:.3f} | {s.best_single:.3f} "
      f"({s.best_single_lambda:.2f}) | {s.per_row_unit:.3f} | {s.per_row:.3f} "
      f"({s.per_row_mean_lambda:.2f}) |"
    )


if __name__ == "__main__":
  main()
