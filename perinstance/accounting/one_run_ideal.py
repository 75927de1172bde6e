"""Canary statistics, and the idealised mechanism the one-run audit is held against (docs/accounting.md §11.10,
§11.11): pure numpy.

A canary of norm c (a multiple of Γ) is seen through x_t, the projection of step t's privatised sum ũ_t on its
unit direction, in units of Γ: in the accountant's model x_t = c·s_t + n_t + σ·N(0, 1) with s_t ~ Bernoulli(q)
when the canary is in the run (0 when it is out) and n_t what the other points put on the direction.

- likelihood_ratio_scores: Σ_t log(1 − q + q·exp((c·x_t − c²/2)/σ²)), the log-likelihood ratio of "in" against
  "out" when n_t = 0 (the most powerful statistic there, by Neyman and Pearson);
- summed_scores: Σ_t x_t, the last-iterate statistic (plain SGD at a constant learning rate: (θ_0 − θ_T)/η);
- simulated_projections: x for the idealised mechanism (n_t = 0) with the run's m, q, T and σ/c;
- statistics: both statistics' scores, by the suffix of their result columns;
- false_alarm_rate: how often the audit flags an idealised run that meets the claim (the test's level).
"""

import numpy as np
from numpy.typing import ArrayLike

from perinstance.accounting import one_run_fdp


def likelihood_ratio_scores(projections: ArrayLike, *, norm: float, noise_multiplier: float,
                            sample_rate: float) -> np.ndarray:
    """§11.10: per canary (rows of `projections`, one column per step, units of Γ) the summed log-likelihood
    ratio of the subsampled Gaussian step, written as logaddexp(log(1 − q), log q + (c·x − c²/2)/σ²)."""
    projections = np.asarray(projections, dtype=float)
    exponent = (norm * projections - norm * norm / 2) / noise_multiplier**2
    with np.errstate(divide="ignore"):
        return np.logaddexp(np.log1p(-sample_rate), np.log(sample_rate) + exponent).sum(axis=-1)


def summed_scores(projections: ArrayLike) -> np.ndarray:
    """§11.10: Σ_t x_t per canary, the projection of the summed privatised updates."""
    return np.asarray(projections, dtype=float).sum(axis=-1)


def simulated_projections(rng: np.random.Generator, included: ArrayLike, *, steps: int, norm: float,
                          noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """§11.11: x (canaries × steps, units of Γ) of the idealised mechanism: c·Bernoulli(q) for a canary in the run,
    plus σ·N(0, 1), nothing from other points."""
    included = np.asarray(included, dtype=bool)
    sampled = (rng.random((*included.shape, steps)) < sample_rate) & included[..., None]
    return norm * sampled + noise_multiplier * rng.standard_normal((*included.shape, steps))


def statistics(projections: ArrayLike, *, norm: float, noise_multiplier: float,
               sample_rate: float) -> dict[str, np.ndarray]:
    """§11.10: the scores of both statistics, by the suffix of their result columns: "" the likelihood ratio,
    "_summed" the summed projection."""
    return {"": likelihood_ratio_scores(projections, norm=norm, noise_multiplier=noise_multiplier,
                                        sample_rate=sample_rate),
            "_summed": summed_scores(projections)}


def false_alarm_rate(rng: np.random.Generator, groups: ArrayLike, members: ArrayLike, *, steps: int,
                     noise_multiplier: float, sample_rate: float, significance: float, replicates: int,
                     chunk: int = 100) -> float:
    """§11.11: the share of `replicates` idealised runs meeting the claim (one group of `members[g]` canaries in
    and as many out per norm `groups[g]`) that the audit flags: some group's claimed curve rejected by its
    likelihood-ratio scores at significance/groups (Bonferroni)."""
    groups, members = np.asarray(groups, dtype=float), np.asarray(members, dtype=int)
    level = significance / groups.size / len(one_run_fdp.GUESS_FRACTIONS)
    flagged = np.zeros(replicates, dtype=bool)
    for norm, count in zip(groups.tolist(), members.tolist(), strict=True):
        curve = one_run_fdp.subsampled_gaussian_curve(noise_multiplier / norm, sample_rate, steps).curve
        included = np.repeat([True, False], count)
        for start in range(0, replicates, chunk):
            block = min(chunk, replicates - start)
            scores = likelihood_ratio_scores(
                simulated_projections(rng, np.broadcast_to(included, (block, included.size)), steps=steps, norm=norm,
                                      noise_multiplier=noise_multiplier, sample_rate=sample_rate),
                norm=norm, noise_multiplier=noise_multiplier, sample_rate=sample_rate)
            counts = [one_run_fdp.top_guesses(row[included], row[~included]) for row in scores]
            guesses, correct = (np.concatenate(part) for part in zip(*counts, strict=True))
            margins = one_run_fdp.fdp_margins(curve.inverse_blow_up, included.size, guesses, correct, level)
            flagged[start:start + block] |= (margins.reshape(block, -1) > 0).any(axis=1)
    return float(flagged.mean())
