"""The accountants' command side: the sum and mean rules over result files, composition over a run, the
report, and compute_sensitivity's command (single process and sharded over torchrun ranks).

May import measure/, train/, files/, accounting/ and the package top.
"""
