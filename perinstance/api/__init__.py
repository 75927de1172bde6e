"""The public Python API: per-instance privacy of DP-SGD for any training loop (docs/api.md).

`IndividualAccountant` (accountant.py) composes each point's privacy over the steps of a run; `IndividualFilter`
(filter.py) keeps each point within a budget (an individual Rényi filter, docs/accounting.md §12); `sensitivities`
(sensitivity.py) measures Δ* (docs/accounting.md §2, sum rule) at a model's current parameters;
`CanaryScoreAuditor` (perinstance/audit/canary_auditor.py) gives lower bounds on ε from one run's canary scores.
"""

from perinstance.api.accountant import ACCOUNTANTS, DEFAULT_ORDERS, RATIO_TOLERANCE, IndividualAccountant
from perinstance.api.filter import IndividualFilter
from perinstance.api.sensitivity import sensitivities
from perinstance.audit.canary_auditor import CanaryScoreAuditor

__all__ = ["ACCOUNTANTS", "DEFAULT_ORDERS", "RATIO_TOLERANCE", "CanaryScoreAuditor", "IndividualAccountant",
           "IndividualFilter", "sensitivities"]
