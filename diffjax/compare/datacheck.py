"""The data check: did the arms at each seed see the same batches?

The trainer logs a hash of every batch (``data/batch_hash`` in metrics.jsonl when
``log_batch_hash`` is on); a comparison is matched only if, for every seed, every arm logged
the same hash at every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def batch_hashes(metrics: Sequence[Mapping[str, float]]) -> dict[int, int]:
  """{step: batch hash} from one run's metrics rows (`diffjax.train.records.read_metrics`);
  steps without a hash are left out."""
  return {int(r["step"]): int(r["data/batch_hash"]) for r in metrics if "data/batch_hash" in r}


def check_batches(
  hashes: Mapping[tuple[str, int], Mapping[int, int]],
  arms: Sequence[str],
  seeds: Sequence[int],
  num_steps: int,
) -> dict[str, Any]:
  """Compares the logged batch hashes of the runs.

  Args:
    hashes: {(arm, seed): {step: hash}}.
    arms: the arms to compare; the first is the reference.
    seeds: the seeds to check.
    num_steps: steps 1..num_steps must have a hash in every run.

  Returns {"ok", "problems": [sentences], "per_seed": {seed: {"match", "steps_compared"}},
  "distinct_across_seeds"}; "ok" is False when two arms with the same seed saw a different
  batch at some step, or a run lacks hashes for some of steps 1..num_steps.
  """
  problems, per_seed = [], {}
  steps = range(1, num_steps + 1)
  for seed in seeds:
    ref_arm = arms[0]
    ref = hashes.get((ref_arm, seed), {})
    match = True
    for arm in arms:
      h = hashes.get((arm, seed), {})
      missing = [s for s in steps if s not in h]
      if missing:
        match = False
        problems.append(
          f"seed {seed}: {arm} has no batch hash for {len(missing)} of "
          f"{num_steps} steps (first: step {missing[0]}); was it trained without "
          "log_batch_hash?"
        )
        continue
      if arm == ref_arm or any(s not in ref for s in steps):
        continue
      differ = [s for s in steps if h[s] != ref[s]]
      if differ:
        match = False
        problems.append(
          f"seed {seed}: {arm} saw different batches than {ref_arm} at "
          f"{len(differ)} of {num_steps} steps (first: step {differ[0]})."
        )
    per_seed[str(seed)] = {"match": match, "steps_compared": num_steps}
  sequences = {seed: tuple(hashes.get((arms[0], seed), {}).get(s) for s in steps) for seed in seeds}
  distinct = len(set(sequences.values())) == len(seeds)
  return {
    "ok": not problems,
    "problems": problems,
    "per_seed": per_seed,
    "distinct_across_seeds": distinct,
  }


def mismatch_warning(check: Mapping[str, Any]) -> list[str]:
  """The heading and the list of problems that open a report when ``check`` (`check_batches`)
  is not ok: the arms did not see the same data."""
  return [
    "## WARNING: the arms did not see the same data",
    "",
    *(f"- {p}" for p in check["problems"]),
  ]
