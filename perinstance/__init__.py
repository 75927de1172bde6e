"""Per-instance privacy accounting of DP-SGD (see docs/accounting.md)."""
