"""The one-run auditor as a Python API (docs/api.md, "The one-run auditor"), in jax_privacy's vocabulary: the
scores of the canaries held in and held out, a significance and a δ; the lower bounds of docs/accounting.md §11.

    auditor = CanaryScoreAuditor(in_canary_scores, out_canary_scores)
    auditor.epsilon_one_run(significance=0.05, delta=1e-5)            # Steinke et al. (ε, δ), any mechanism
    auditor.epsilon_one_run_fdp(significance=0.05, delta=1e-5)        # f-DP, Gaussian curves
    auditor.epsilon_lower_bound(significance=0.05, delta=1e-5, sample_rate=q, steps=T)   # f-DP, DP-SGD's curves
    auditor.rejects(significance=0.05, noise_multiplier=σ / c, sample_rate=q, steps=T)    # the verdict

Pure numpy/scipy on top of perinstance/accounting (no torch).
"""

import math
import numbers

import numpy as np
from numpy.typing import ArrayLike

from perinstance.accounting import one_run_audit, one_run_fdp

THRESHOLD_STRATEGIES = one_run_audit.THRESHOLD_STRATEGIES


def _scores(name: str, scores: ArrayLike) -> np.ndarray:
    try:
        values = np.asarray(scores, dtype=float)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be numbers, not {scores!r:.60}") from None
    if values.ndim != 1 or values.size == 0 or not np.all(np.isfinite(values)):
        raise ValueError(f"{name} must be a non-empty 1-d array of finite numbers, got shape {values.shape}")
    return values


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {value!r}")
    return float(value)


def _level(significance: float, delta: float | None = None) -> None:
    for name, value in (("significance", significance), ("delta", delta)):
        if value is not None and not 0 < _number(name, value) < 1:
            raise ValueError(f"{name} must be in (0, 1), not {value!r}")


def _mechanism(sample_rate: float, steps: int, noise_multiplier: float | None = None) -> None:
    if not 0 < _number("sample_rate", sample_rate) <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], not {sample_rate!r}")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, not {steps!r}")
    if noise_multiplier is not None and not (_number("noise_multiplier", noise_multiplier) > 0
                                             and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be finite and > 0, not {noise_multiplier!r}")


def _strategy(threshold_strategy: str) -> str:
    if threshold_strategy not in THRESHOLD_STRATEGIES:
        raise ValueError(f"threshold_strategy must be one of {', '.join(THRESHOLD_STRATEGIES)}, "
                         f"not {threshold_strategy!r}")
    return threshold_strategy


class CanaryScoreAuditor:
    """Lower bounds on ε from the scores of canaries held in and held out of one training run (higher = "in").

    Every canary must have been held in or out independently with probability 1/2 before training (Steinke,
    Nasr, Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023), and the scores must be a fixed
    function of what the run released. Each bound holds with probability at least 1 − significance.
    threshold_strategy "grid" (default) tries 8 numbers of "in" guesses fixed before the scores are seen
    (docs/accounting.md §11.7); "frontier" tries every vertex of the ROC frontier, as jax_privacy's
    Bonferroni() does, to compare with its numbers (a selection no proof covers).
    """

    def __init__(self, in_canary_scores: ArrayLike, out_canary_scores: ArrayLike) -> None:
        self.in_canary_scores = _scores("in_canary_scores", in_canary_scores)
        self.out_canary_scores = _scores("out_canary_scores", out_canary_scores)

    def epsilon_one_run(self, significance: float, delta: float, *, threshold_strategy: str = "grid") -> float:
        """§11.2: the largest ε whose (ε, δ)-DP the guesses refute; holds for any mechanism."""
        _level(significance, delta)
        return one_run_audit.one_run_epsilon(self.in_canary_scores, self.out_canary_scores, significance=significance,
                                             delta=delta, thresholds=_strategy(threshold_strategy))

    def epsilon_one_run_fdp(self, significance: float, delta: float, *, threshold_strategy: str = "grid") -> float:
        """§11.3: the largest ε whose Gaussian trade-off curve at (ε, δ) the guesses refute (Mahloujifar, Melis,
        Chaudhuri, "Auditing f-Differential Privacy in One Run"): a bound on ε for a Gaussian-shaped curve."""
        _level(significance, delta)
        return one_run_audit.one_run_fdp_epsilon(self.in_canary_scores, self.out_canary_scores,
                                                 significance=significance, delta=delta,
                                                 thresholds=_strategy(threshold_strategy))

    def epsilon_clopper_pearson(self, significance: float, delta: float, *, threshold_strategy: str = "grid") -> float:
        """§11.4: log((TPR_low − δ)/FPR_high), the canaries treated as independent trials (not a one-run bound)."""
        _level(significance, delta)
        return one_run_audit.clopper_pearson_epsilon(self.in_canary_scores, self.out_canary_scores,
                                                     significance=significance, delta=delta,
                                                     thresholds=_strategy(threshold_strategy))

    def epsilon_lower_bound(self, significance: float, delta: float, *, sample_rate: float, steps: int) -> float:
        """§11.9: the ε at δ of the least private DP-SGD curve (T steps of the Poisson-subsampled Gaussian at rate
        q, any noise multiplier) that the guesses refute, the largest ε refuted, on the grid of §11.7; 0 when none
        is. A bound on ε for a mechanism whose curve has that shape (a canary of fixed norm in DP-SGD)."""
        _level(significance, delta)
        _mechanism(sample_rate, steps)
        return one_run_fdp.family_lower_bound(self.in_canary_scores, self.out_canary_scores, sample_rate=sample_rate,
                                              steps=int(steps), delta=delta, significance=significance).epsilon

    def rejects(self, significance: float, *, noise_multiplier: float, sample_rate: float, steps: int) -> bool:
        """§11.8: whether the guesses refute "the run is f-DP for the curve of T steps of the subsampled Gaussian
        with this noise multiplier (σ/c for a canary of norm c·Γ) and rate q", at `significance`."""
        _level(significance)
        _mechanism(sample_rate, steps, noise_multiplier)
        curve = one_run_fdp.subsampled_gaussian_curve(float(noise_multiplier), float(sample_rate), int(steps)).curve
        return one_run_fdp.curve_rejected(curve, self.in_canary_scores, self.out_canary_scores,
                                          significance=significance)
