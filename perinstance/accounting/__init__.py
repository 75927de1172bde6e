"""The pure mathematics of the accountants (docs/accounting.md), one module per contract section.

Small functions on numpy arrays: numpy, scipy, pandas (row frames) and dp_accounting only; no torch, no
I/O. Imports nothing from the package but errors.py: every other layer may import it.
"""
