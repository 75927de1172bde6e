"""The accountants on result files: the per-step guarantees of the sum and mean rules (and GLA's statistic)
from the measured rows, their composition over a run, the rows read and checked (reading), and the output
tables and summaries (report). The mathematics they apply is accounting/'s.

May import measure/, train/, persample/, files/, accounting/ and the package top.
"""
