"""The experiments of reproduce.py: presets, the command cache, one module per experiment (each names the
findings and figures it produces) and the report writer.

May import every layer below it (plots/ and down) and the package top; the commands it runs it imports not:
perinstance/cli/reproduce.py hands it their mains (commands.Commands).
"""
