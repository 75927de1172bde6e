"""The experiments of reproduce.py: presets, the command cache, one module per experiment (each names the
findings and figures it produces) and the report writer.

The top layer: may import every other layer and the package top.
"""
