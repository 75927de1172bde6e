"""Per-instance privacy accounting of DP-SGD (see docs/accounting.md; the Python API: docs/api.md).

The API is imported on first use (PEP 562), so that importing a pure-math module of the package
does not import torch.
"""

# First, before any module of the package imports torch: torch's OpenMP threads must not spin-wait on a
# machine that other processes share (see the module).
from perinstance import openmp_settings  # noqa: F401

__all__ = ["IndividualAccountant", "sensitivities"]


def __getattr__(name: str):
    if name in __all__:
        from perinstance import api

        return getattr(api, name)
    raise AttributeError(f"module 'perinstance' has no attribute {name!r}")
