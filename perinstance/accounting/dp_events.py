"""One point's run of DP-SGD's sum rule as a dp_accounting event (docs/accounting.md §3.1, §8.2): each step is the
Poisson-subsampled Gaussian of noise multiplier σ·Γ/Δ* (the point's sensitivity Δ* against noise σΓ), so that a
caller can compose the point's run with other mechanisms in dp_accounting's accountants.

Pure: numpy and dp_accounting; no torch and no I/O.
"""

from collections import Counter
from collections.abc import Iterable

import dp_accounting
import numpy as np

from perinstance.accounting import rdp_composition


def sum_rule_event(steps: Iterable[tuple[float, float, int, float]], rounding: float) -> dp_accounting.DpEvent:
    """The composition of `steps`, each (σ, q, count, Δ*/Γ): `count` steps of PoissonSampledDpEvent(q,
    GaussianDpEvent(σ/level)), with level the ratio rounded up to a multiple of `rounding` (0: exact) as the
    composition rounds it (rdp_composition.sensitivity_levels, §5). A step at level 0 reveals nothing about the
    point (no event); no steps at all is NoOpDpEvent."""
    counts = Counter()
    for noise_multiplier, sample_rate, count, ratio in steps:
        levels = rdp_composition.sensitivity_levels(rounding, [ratio])
        level = float(levels[np.searchsorted(levels, min(ratio, 1.0), side="left")])
        if level > 0:
            counts[(noise_multiplier / level, sample_rate)] += count
    events = [dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), count)
        for (noise_multiplier, sample_rate), count in counts.items()]
    if not events:
        return dp_accounting.NoOpDpEvent()
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)
