"""The API's checks of its arguments: each bad value is a one-line ValueError that names the argument."""

import math

from perinstance.accounting import numerics


def number(name: str, value: object) -> float:
    """`value` as a float, or a one-line ValueError naming `name`."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, not {value!r}") from None


def positive_finite(name: str, value: object) -> float:
    """`value` as a finite float > 0, or a one-line ValueError naming `name`."""
    value = number(name, value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, not {value!r}")
    return value


def sample_rate(value: object) -> float:
    """A Poisson sample rate in (0, 1], or a one-line ValueError naming sample_rate."""
    value = number("sample_rate", value)
    if not 0 < value <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], not {value!r}")
    return value


def probability(name: str, value: object) -> float:
    """`value` as a float in (0, 1) (a δ), or a one-line ValueError naming `name` (numerics.check_probability)."""
    value = number(name, value)
    numerics.check_probability(name, value)
    return value
