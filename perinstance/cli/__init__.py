"""The command line: one module per command (its flags, its typed request and its `main`), the flags they
share (options), and the `perinstance` command that dispatches to them.

May import every other layer and the package top.
"""
