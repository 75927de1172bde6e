"""requirements.txt (the paper repository's layout, `pip install -r requirements.txt`) lists exactly the runtime
dependencies of pyproject.toml's [project.dependencies], in the same order and the same version bounds."""

import os
import tomllib

from conftest import ROOT


def requirement_lines(path):
    """The requirement lines of a requirements file: without comments and blank lines."""
    with open(path, encoding="utf-8") as handle:
        lines = [line.split("#", 1)[0].strip() for line in handle]
    return [line for line in lines if line]


def test_requirements_are_pyproject_dependencies():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    assert requirement_lines(os.path.join(ROOT, "requirements.txt")) == dependencies
    assert dependencies  # two empty lists would pass unnoticed
