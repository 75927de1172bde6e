"""The mechanism of a run as the accountants see it (accounting.md §1), and its worst-case baseline.

`Mechanism` is built from a run (runs.RunConfig) or from the rows of a result file, so the
noise std and the data-independent baseline are computed in one place whichever the source.
Pure: numbers in, numbers out.
"""

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

import perinstance
from perinstance.accounting import batch_sizes, certified_radius, exact_eps_delta, rdp_composition


def rule_noise_std(noise_multiplier: ArrayLike, clip_bound: ArrayLike, batch_size: ArrayLike,
                   rule: ArrayLike) -> np.ndarray:
    """accounting.md §1: σΓ in sum units, σΓ/B_exp in mean units (elementwise on arrays)."""
    return noise_multiplier * clip_bound / np.where(np.asarray(rule) == "mean", batch_size, 1.0)


@dataclass(frozen=True)
class Mechanism:
    """T steps of Poisson sampling at rate q, transform bounded by Γ, noise std σΓ (accounting.md
    §1), analysed under `rule` (sum or mean; it may differ from the rule the run was trained with:
    a per-step analysis needs only θ)."""

    noise_multiplier: float  # σ
    clip_bound: float  # Γ
    sample_rate: float  # q
    batch_size: int  # B_exp
    dataset_size: int  # N
    total_steps: int  # T
    rule: str

    @classmethod
    def of_run(cls, run: "perinstance.train.runs.RunConfig", rule: str | None = None) -> "Mechanism":
        """The mechanism of a runs.RunConfig, analysed under `rule` (default: the trained rule)."""
        return cls(noise_multiplier=run.noise_multiplier, clip_bound=run.clip_bound, sample_rate=run.sample_rate,
                   batch_size=run.batch_size, dataset_size=run.dataset_size, total_steps=run.total_steps,
                   rule=rule or run.update_rule)

    @property
    def noise_std(self) -> float:
        """The Gaussian's std in the units of the analysed rule."""
        return float(rule_noise_std(self.noise_multiplier, self.clip_bound, self.batch_size, self.rule))

    def baseline_rdp(self, orders: ArrayLike, steps: int | None = None) -> np.ndarray:
        """The data-independent RDP of `steps` steps (default T) at `orders` (accounting.md §3.1)."""
        steps = self.total_steps if steps is None else steps
        return rdp_composition.baseline_rdp(self.noise_multiplier, self.sample_rate, orders, steps)

    def baseline_eps(self, delta: float, steps: int | None = None,
                     orders: ArrayLike = rdp_composition.COMPOSITION_ORDERS) -> tuple[float, float]:
        """The worst-case ε after `steps` steps (default T) at `delta`, and the order that gives it."""
        eps, order = rdp_composition.rdp_to_eps(orders, self.baseline_rdp(orders, steps), delta)
        return float(eps), float(order)

    def per_step_baseline_eps(self, delta: float, size_delta: float | None = None) -> tuple[float, int, float]:
        """The data-independent ε of one step at `delta` under the analysed rule (accounting.md §3.3).

        Sum rule: Δ = Γ against σΓ. Mean rule, its own baseline: Δ̄_k = 2Γ/(k+1) (Δ̄_0 = Γ) against
        σΓ/B_exp over every size k ≥ k_min of the other points' batch, weighted by π_k (§3.2), with
        δ_size = P(k < k_min) spent from δ (§3.4; `size_delta` default δ/(10·T)). Every size up to
        k_hi is evaluated, so no lumping loosens it. Returns (ε, k_min, δ_size); k_min = 0 and
        δ_size = 0 for the sum rule.
        """
        if self.rule == "sum":
            return float(exact_eps_delta.per_step_eps([[1 / self.noise_multiplier]], delta, self.sample_rate)[0]), 0, 0.0
        others = self.dataset_size - 1
        size_delta = delta / (10 * self.total_steps) if size_delta is None else size_delta
        k_min = batch_sizes.size_threshold(others, self.sample_rate, size_delta)
        delta_size = batch_sizes.size_failure(others, self.sample_rate, k_min)
        sizes = batch_sizes.size_grid(others, self.sample_rate, k_min, others + 1)
        weights = np.exp(batch_sizes.lumped_size_log_weights(sizes, others, self.sample_rate))
        bound = certified_radius.baseline_mean_sensitivity(self.clip_bound, sizes)
        eps = exact_eps_delta.per_step_eps(bound[None, :] / self.noise_std, delta, self.sample_rate, weights[None, :],
                                           delta_size)
        return float(eps[0]), k_min, delta_size
