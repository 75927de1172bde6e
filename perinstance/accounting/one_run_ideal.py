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
- IdealisedRun: every canary group of a run drawn together, as the run states it or with a fault (other noise,
  rate or signal, the mean rule's division by the realised batch size);
- run_flagged, flagged_runs: the audit's verdict on an idealised run against what a run states, and how many of
  many replicates it flags;
- false_alarm_rate: how often the audit flags an idealised run that meets the claim (the test's level).
"""

from dataclasses import dataclass

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


@dataclass(frozen=True)
class IdealisedRun:
    """§11.11: every canary group of a run, drawn together by the idealised mechanism (nothing from other points
    on the canaries' directions).

    Group g has members[g] canaries in the run and as many out. At each of `steps` steps every canary in the run is
    drawn with probability sample_rate, and x_t (units of Γ) is what the drawn ones add plus
    noise_multiplier·N(0, 1): signals[g] for a drawn canary of group g under the sum rule (expected_batch None);
    under the mean rule, signals[g]·B_exp/|B_t| with B_exp = expected_batch and |B_t| the examples of step t's batch
    (other_examples real points drawn at sample_rate, and every canary drawn, of every group), plus
    noise_before_division·(B_exp/|B_t|)·N(0, 1): noise added to the sum before the division by |B_t|.
    """

    signals: tuple[float, ...]
    members: tuple[int, ...]
    steps: int
    noise_multiplier: float
    sample_rate: float
    expected_batch: float | None = None
    other_examples: int = 0
    noise_before_division: float = 0.0

    def projections(self, rng: np.random.Generator) -> list[np.ndarray]:
        """One run: x per group (2·members[g] canaries × steps, the members first)."""
        drawn = [rng.random((count, self.steps)) < self.sample_rate for count in self.members]
        if self.expected_batch is None:
            weight = np.ones(self.steps)
        else:
            batch = rng.binomial(self.other_examples, self.sample_rate, self.steps) + sum(
                draws.sum(axis=0) for draws in drawn)
            weight = self.expected_batch / np.maximum(batch, 1)
        noise = np.hypot(self.noise_multiplier, self.noise_before_division * weight)
        return [np.concatenate([signal * draws * weight, np.zeros(draws.shape)])
                + noise * rng.standard_normal((2 * draws.shape[0], self.steps))
                for signal, draws in zip(self.signals, drawn, strict=True)]


def run_flagged(claimed: IdealisedRun, projections: list[np.ndarray], significance: float) -> bool:
    """§11.7-§11.8: the audit's verdict on one run's x (per group, members first, as IdealisedRun.projections
    gives them) against what `claimed` states (the sum rule, each group's signal its canaries' norm c): some
    group's curve at noise multiplier σ/c rejected by its likelihood-ratio scores at significance/groups."""
    level = significance / len(claimed.signals)
    for norm, count, group in zip(claimed.signals, claimed.members, projections, strict=True):
        curve = one_run_fdp.subsampled_gaussian_curve(claimed.noise_multiplier / norm, claimed.sample_rate,
                                                      claimed.steps).curve
        scores = likelihood_ratio_scores(group, norm=norm, noise_multiplier=claimed.noise_multiplier,
                                         sample_rate=claimed.sample_rate)
        if one_run_fdp.curve_rejected(curve, scores[:count], scores[count:], significance=level):
            return True
    return False


def flagged_runs(rng: np.random.Generator, claimed: IdealisedRun, actual: IdealisedRun, *, significance: float,
                 replicates: int) -> int:
    """§11.11: of `replicates` idealised runs drawn as `actual` (the mechanism that runs), how many the audit flags
    against `claimed` (what the run states: the sum rule, same groups and steps)."""
    if claimed.expected_batch is not None:
        raise ValueError("the claim is the sum rule's accounting: claimed.expected_batch must be None")
    if claimed.members != actual.members or claimed.steps != actual.steps:
        raise ValueError("the claimed and the actual run must have the same groups and steps")
    return sum(run_flagged(claimed, actual.projections(rng), significance) for _ in range(replicates))


def false_alarm_rate(rng: np.random.Generator, groups: ArrayLike, members: ArrayLike, *, steps: int,
                     noise_multiplier: float, sample_rate: float, significance: float, replicates: int) -> float:
    """§11.11: the share of `replicates` idealised runs meeting the claim (one group of `members[g]` canaries in
    and as many out per norm `groups[g]`) that the audit flags: some group's claimed curve rejected by its
    likelihood-ratio scores at significance/groups (Bonferroni)."""
    run = IdealisedRun(signals=tuple(np.asarray(groups, dtype=float).tolist()),
                       members=tuple(np.asarray(members, dtype=int).tolist()), steps=steps,
                       noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return flagged_runs(rng, run, run, significance=significance, replicates=replicates) / replicates
