"""Per-instance privacy accounting of DP-SGD (see docs/accounting.md; the Python API: docs/api.md).

The package is layered; imports flow one way, lowest layer first (tests/test_layers.py holds this):

    accounting/   pure math (numpy/scipy, no torch): imports no other subpackage
    files/        file formats, atomic writes, result files, checkpoints
    train/        datasets, models, DP-SGD training, runs, the shared flags, torchrun ranks
    measure/      per-sample gradient rows, Poisson batches, coupling, the measurement
    accountants/  the accountants' command side, the report, compute_sensitivity's command
    audit/        the simulated audit and the membership attack
    plots/        figures
    experiments/  reproduce.py's experiments, presets and report

errors.py, console.py, openmp_settings.py and malloc_settings.py stay here at the package top: the base every layer may
import. api/ is the public Python API on top of every layer; it is imported on first use (PEP
562), so that importing a pure-math module of the package does not import torch.
"""

# First, before any module of the package imports torch: torch's OpenMP threads must not spin-wait on a
# machine that other processes share, and the memory a step frees stays with this process for the next step
# instead of being faulted in again (see the modules; neither imports torch).
from perinstance import malloc_settings, openmp_settings  # noqa: F401

__all__ = ["IndividualAccountant", "sensitivities"]


def __getattr__(name: str):
    if name in __all__:
        from perinstance import api

        return getattr(api, name)
    raise AttributeError(f"module 'perinstance' has no attribute {name!r}")
