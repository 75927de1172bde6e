"""The package's layers (perinstance/__init__.py), checked from the import statements alone (ast, no import).

Imports flow one way: a module may import its own subpackage, a lower layer and the base modules at the
package top, never a higher layer. The pure mathematics (accounting/) imports no torch and no other
subpackage. The command line (cli/) is the top layer: its parsers, typed requests and mains import every
layer, and no layer imports a command-line type. A reproduction (experiments/) runs the commands, but it
imports none: cli/reproduce.py hands it every command's main by script name (experiments/commands.py
`Commands`), so the arrow runs from cli/ down. No module is over MAX_LINES lines.
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "perinstance"
# Lowest first: each layer may import the ones before it.
# api is the public Python API (perinstance/api/) on top of every layer but the command line.
LAYERS = ("accounting", "files", "persample", "train", "measure", "analysis", "audit", "plots", "experiments", "api",
          "cli")
BASE = ("errors", "console", "openmp_settings", "malloc_settings")
# The package top's only imports of a layer: __init__.py's lazy export of IndividualAccountant and sensitivities
# (the API), and __main__.py's `python -m perinstance` (the `perinstance` command).
TOP_IMPORTS = {("perinstance.__init__", "perinstance.api"), ("perinstance.__main__", "perinstance.cli.main")}
PURE = "accounting"
# The pure layer's only third-party imports: array math, and the accounting library it is checked against.
PURE_THIRD_PARTY = {"numpy", "scipy", "pandas", "dp_accounting"}
MAX_LINES = 500


def imported_modules(source, module):
    """Dotted names of every module `source` (the text of `module`) imports, at any depth: `from a import b`
    gives a.b for a package a and a otherwise, resolved against the package's folders."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[:-node.level]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                folder = ROOT.joinpath(*candidate.split("."))
                names.append(candidate if folder.with_suffix(".py").exists() or folder.is_dir() else base)
    return names


def layer_of(module):
    """The layer of a perinstance module, "base" for the package top, None outside the package."""
    parts = module.split(".")
    if parts[0] != "perinstance":
        return None
    if len(parts) < 2 or parts[1] in BASE or parts[1] in ("__init__", "__main__"):
        return "base"
    return parts[1]


def violations(imports):
    """Every broken rule in {module: [imported module, ...]}, one line each."""
    found = []
    for module, targets in sorted(imports.items()):
        own = layer_of(module)
        for target in targets:
            layer = layer_of(target)
            top = target.split(".")[0]
            if own == PURE and layer is None and top not in sys.stdlib_module_names and top not in PURE_THIRD_PARTY:
                found.append(f"{module} (pure math) imports {target}")
            if layer is None or layer == own or (module, target) in TOP_IMPORTS:
                continue
            if layer == "base":
                if own == PURE and target.split(".")[-1] != "errors" and target != "perinstance":
                    found.append(f"{module} (pure math) imports {target}")
                continue
            if layer not in LAYERS:
                found.append(f"{module} imports {target}, which is in no layer")
            elif own == "base":
                found.append(f"{module} (package top) imports the layer {layer}")
            elif own == PURE:
                found.append(f"{module} (pure math) imports the subpackage {layer}")
            elif LAYERS.index(layer) > LAYERS.index(own):
                found.append(f"{module} ({own}) imports upward: {target} ({layer})")
    return found


def package_modules():
    """{dotted name: path} of every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts)] = path
    return modules


def package_imports():
    return {module: imported_modules(path.read_text(), module) for module, path in package_modules().items()}


def test_the_package_keeps_its_layers():
    assert violations(package_imports()) == []


def test_an_upward_import_is_flagged():
    imports = package_imports()
    imports["perinstance.files.storage"] = imports["perinstance.files.storage"] + ["perinstance.measure.coupling"]
    assert violations(imports) == ["perinstance.files.storage (files) imports upward: perinstance.measure.coupling "
                                   "(measure)"]


def test_torch_or_a_subpackage_in_the_pure_math_is_flagged():
    source = "import numpy as np\nimport torch\nfrom perinstance.files import storage\n"
    imports = {"perinstance.accounting.example": imported_modules(source, "perinstance.accounting.example")}
    assert violations(imports) == ["perinstance.accounting.example (pure math) imports torch",
                                   "perinstance.accounting.example (pure math) imports the subpackage files"]


def test_a_lazy_import_counts():
    source = "def draw():\n    import torch\n    from perinstance.plots import plots\n"
    imports = {"perinstance.train.example": imported_modules(source, "perinstance.train.example")}
    assert violations(imports) == ["perinstance.train.example (train) imports upward: perinstance.plots.plots (plots)"]


def test_the_layers_are_subpackages_whose_init_imports_nothing():
    subpackages = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    assert len(subpackages) >= 5
    assert sorted(LAYERS) == subpackages
    for name in subpackages:
        tree = ast.parse((PACKAGE / name / "__init__.py").read_text())
        assert ast.get_docstring(tree), name
        # The API's __init__ re-exports its public names; no other layer's imports anything.
        assert name == "api" or not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))], \
            name
    assert {path.stem for path in PACKAGE.glob("*.py")} == {"__init__", "__main__", *BASE}


def test_no_module_is_over_the_line_limit():
    lengths = {module: len(path.read_text().splitlines()) for module, path in package_modules().items()}
    assert {module: count for module, count in lengths.items() if count > MAX_LINES} == {}
