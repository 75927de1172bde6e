"""Per-instance privacy accounting of DP-SGD (see docs/accounting.md)."""

# First, before any module of the package imports torch: torch's OpenMP threads must not spin-wait on a
# machine that other processes share (see the module).
from perinstance import openmp_settings  # noqa: F401
