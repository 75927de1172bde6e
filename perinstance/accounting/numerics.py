"""Numerics shared by the accounting modules (docs/accounting.md §5): subtraction in log space, and the
domain checks (the math refuses nonsense at its boundary, as dp_accounting does).
"""

import math

import numpy as np
from numpy.typing import ArrayLike


def log_sub(log_large: ArrayLike, log_small: ArrayLike) -> np.ndarray:
    """log(exp(a) − exp(b)) for a ≥ b, −inf where they are equal."""
    gap = np.minimum(log_small - log_large, 0.0)
    with np.errstate(divide="ignore"):
        return log_large + np.log(-np.expm1(gap))


def check_sample_rate(sample_rate: float) -> None:
    """Refuse a sampling rate outside [0, 1]."""
    if not 0 <= sample_rate <= 1:
        raise ValueError(f"sample_rate must be in [0, 1], not {sample_rate!r}")


def check_probability(name: str, value: float) -> None:
    """Refuse a probability `name` outside (0, 1)."""
    if not 0 < value < 1:
        raise ValueError(f"{name} must be in (0, 1), not {value!r}")


def check_positive(name: str, value: float) -> None:
    """Refuse a `name` that is not finite and positive."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, not {value!r}")


def check_noise(noise_multiplier: float) -> None:
    """Refuse a noise multiplier that is not positive (∞ allowed: no privacy spent)."""
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, not {noise_multiplier!r}")


def check_holder_b(holder_b: float) -> None:
    """Refuse a Hölder exponent b that is not above 1."""
    if not holder_b > 1:
        raise ValueError(f"holder_b must be > 1, not {holder_b!r}")


def check_orders(orders: ArrayLike) -> None:
    """Refuse Rényi orders that are not all above 1."""
    orders = np.asarray(orders, dtype=float)
    if orders.size and not np.all(orders > 1):
        raise ValueError(f"orders must be > 1, not {orders[~(orders > 1)][0]!r}")
