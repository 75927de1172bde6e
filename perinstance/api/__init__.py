"""The public Python API: per-instance privacy of DP-SGD for any training loop (docs/api.md).

`IndividualAccountant` (accountant.py) composes each point's privacy over the steps of a run; `sensitivities`
(sensitivity.py) measures Δ* (docs/accounting.md §2, sum rule) at a model's current parameters.
"""

from perinstance.api.accountant import ACCOUNTANTS, DEFAULT_ORDERS, RATIO_TOLERANCE, IndividualAccountant
from perinstance.api.sensitivity import sensitivities

__all__ = ["ACCOUNTANTS", "DEFAULT_ORDERS", "RATIO_TOLERANCE", "IndividualAccountant", "sensitivities"]
