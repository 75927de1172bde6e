"""What every row of an accountant's output is: its kind and direction (docs/accounting.md §3.5), and
the per-step (ε, δ) of §3.3 spread over the directions.

Kind and Direction are str-valued enums: the files hold their values, as before they were enums.
"""

import enum

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from perinstance.accounting import exact_eps_delta


class Kind(enum.StrEnum):
    """How a number was obtained (§3.5)."""

    ESTIMATE = "estimate"  # Monte Carlo, with its spread: not a bound
    HELD_ESTIMATE = "held_estimate"  # a composition that holds Δ* between measurements (§4): not a bound
    CERTIFIED = "certified"  # a bound, with probability 1 − delta_fail where it has one
    GUARANTEE = "guarantee"  # an individual filter's budget (§12.3): holds over every trajectory, not only this one
    BASELINE = "baseline"  # the data-independent bound
    GLA_STATISTIC = "gla_statistic"  # GLA's statistic, for reproducing the paper


class Direction(enum.StrEnum):
    """Which neighbouring pair a value is about (§3.3): x* removed from D (remove), added to D
    (add), the larger of the two (max); none: a measured value about neither in particular."""

    REMOVE = "remove"
    ADD = "add"
    MAX = "max"
    NONE = "none"


PAIR = (Direction.REMOVE, Direction.ADD)
REPORTED = (Direction.REMOVE, Direction.ADD, Direction.MAX)


def eps_by_direction(mu: ArrayLike, delta: float, sample_rate: float, weights: ArrayLike | None = None,
                     delta_fail: float = 0.0) -> dict[Direction, np.ndarray]:
    """§3.3: ε per direction (remove, add) and their max for mixtures of one-dimensional pairs
    (exact_eps_delta.per_step_eps): {Direction: array}."""
    eps = {direction: exact_eps_delta.per_step_eps(mu, delta, sample_rate, weights, delta_fail, direction.value)
           for direction in PAIR}
    eps[Direction.MAX] = np.maximum(eps[Direction.REMOVE], eps[Direction.ADD])
    return eps


def direction_rows(index: pd.MultiIndex, kind: str, eps_by_direction: dict[Direction, np.ndarray], delta: float,
                   **columns) -> pd.DataFrame:
    """Long rows of one kind: one per entry of `index` (a pandas MultiIndex) and direction remove,
    add, max, with `eps` from {Direction: values}; a column given as {Direction: values} takes
    each direction's values."""
    frames = []
    for direction in REPORTED:
        frame = index.to_frame(index=False).assign(
            direction=direction.value, kind=Kind(kind).value, delta=delta,
            **{name: (value[direction] if isinstance(value, dict) else value) for name, value in columns.items()})
        frame["eps"] = eps_by_direction[direction]
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)
