"""Training DP-SGD: datasets, models, clipping, the random streams, the training loop, the description of a
run (runs, run_plan, planned_run), point selections and the torchrun ranks.

May import persample/, files/, accounting/ and the package top.
"""
