"""Measuring a checkpoint: per-sample gradient rows, the Poisson batches and the coupling of the mean
rule, and the measurement that writes the sensitivity rows.

May import train/, persample/, files/, accounting/ and the package top.
"""
