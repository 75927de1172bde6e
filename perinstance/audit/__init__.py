"""Attacks that check the accountants from below: the simulated DP-SGD audit and the loss-threshold
membership attack on trained runs (docs/audit.md).

May import accountants/, measure/, train/, files/, accounting/ and the package top.
"""
