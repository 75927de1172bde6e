"""Figures: the accountants' plots and the audit figures (matplotlib).

May import every layer below it (it uses files/) and the package top.
"""
