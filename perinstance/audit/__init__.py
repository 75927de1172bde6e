"""Attacks that check the accountants from below: the simulated DP-SGD audit and the loss-threshold
membership attack on trained runs (docs/audit.md).

May import analysis/, measure/, train/, persample/, files/, accounting/ and the package top.
"""
