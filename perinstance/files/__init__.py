"""Files: atomic writes and locks (fileio), the columnar row store (storage), accountant outputs and
result files (results, result_file) and checkpoints.

May import accounting/ and the package top (errors, console).
"""
