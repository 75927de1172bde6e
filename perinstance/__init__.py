"""Per-instance privacy accounting of DP-SGD (see docs/accounting.md).

The package is layered; imports flow one way, lowest layer first (tests/test_layers.py holds this):

    accounting/   pure math (numpy/scipy, no torch): imports no other subpackage
    files/        file formats, atomic writes, result files, checkpoints
    train/        datasets, models, DP-SGD training, runs, the shared flags, torchrun ranks
    measure/      per-sample gradient rows, Poisson batches, coupling, the measurement
    accountants/  the accountants' command side, the report, compute_sensitivity's command
    audit/        the simulated audit and the membership attack
    plots/        figures
    experiments/  reproduce.py's experiments, presets and report

errors.py and console.py stay here at the package top: the base every layer may import.
"""
