"""Per-instance privacy accounting of DP-SGD (see docs/accounting.md; the Python API: docs/api.md).

The package is layered; imports flow one way, lowest layer first (tests/test_layers.py holds this):

    accounting/   pure math (numpy/scipy, no torch): imports no other subpackage
    files/        file formats, atomic writes, result files, checkpoints
    persample/    the per-sample gradient engine: per-sample norms and clipped sums of any model
    train/        datasets, models, DP-SGD training, runs, torchrun ranks
    measure/      per-sample gradient rows, Poisson batches, coupling, the measurement (sharded too)
    analysis/     the accountants on result files: per-step guarantees, composition, the report
    audit/        the simulated audit and the membership attack
    plots/        figures
    experiments/  reproduce.py's experiments, presets and report
    cli/          the command line: one module per command, their shared flags

errors.py, console.py, openmp_settings.py and malloc_settings.py stay here at the package top: the base every
layer may import. api/ is the public Python API on top of every layer; it is imported on first use (PEP
562), so that importing a pure-math module of the package does not import torch. cli/ is the command line on
top of everything; experiments/ runs the commands' mains that cli/reproduce.py hands it (it imports no
command), and __main__.py (`python -m perinstance`) imports cli/ alone.

Importing the package, or any module of it, changes nothing in the process: no environment variable, no
allocator or thread setting, no global random generator, no matplotlib backend. The settings for a machine
that other processes share are applied by the command line's entry points (the `perinstance` command and the
scripts), before they first import torch; `apply_shared_machine_settings` applies them for a library user.
"""

from perinstance import malloc_settings, openmp_settings

__version__ = "0.1.0"
__all__ = ["IndividualAccountant", "IndividualFilter", "__version__", "apply_shared_machine_settings", "sensitivities"]
# The public API's names, imported from perinstance/api/ on first use.
API_NAMES = ("IndividualAccountant", "IndividualFilter", "sensitivities")


def apply_shared_machine_settings() -> dict[str, object]:
    """The command line's settings for a machine that other processes share, for this process: torch's
    OpenMP threads sleep instead of spinning while they wait (OMP_WAIT_POLICY=PASSIVE added to os.environ,
    unless a wait policy is set already; openmp_settings.py), and glibc's malloc keeps the memory a training
    step frees for the next one (malloc_settings.py; unless malloc is tuned through the environment). Call
    it before the first `import torch`: libgomp reads the wait policy then (later it reaches only child
    processes). Returns what it set: {"environment": the variables added, "malloc": whether malloc was set}.
    """
    return {"environment": openmp_settings.add_wait_policy(), "malloc": malloc_settings.keep_freed_memory()}


def __getattr__(name: str) -> object:
    if name in API_NAMES:
        from perinstance import api

        return getattr(api, name)
    raise AttributeError(f"module 'perinstance' has no attribute {name!r}")
