"""Every public function and method of the package has type hints (issue 24): each parameter but
self/cls and *args/**kwargs, and the return. Public: a name without a leading underscore in a module
of the package, and every method (dunders included) that a public class of the package defines or
inherits from a class of the package. Found by importing every module, so a new one is checked too.
"""

import importlib
import inspect
import pkgutil
import typing

import torch

import perinstance


def package_modules():
    """Every module of the package, imported, by dotted name."""
    names = ["perinstance"] + [info.name for info in pkgutil.walk_packages(perinstance.__path__, "perinstance.")]
    return {name: importlib.import_module(name) for name in names}


def written_here(function, module):
    """Whether `function` is source code of `module`'s file (dataclasses' generated __init__, __eq__ and
    __repr__ are compiled from strings and carry the hints of the fields, or none by design)."""
    return getattr(function, "__code__", None) is not None and function.__code__.co_filename == module.__file__


def public_functions(modules):
    """(qualified name, function) of every public function and method that a module of `modules` defines."""
    found = []
    for module in modules.values():
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value):
                found.append((f"{module.__name__}.{name}", value))
            elif inspect.isclass(value):
                found += class_methods(value, modules)
    return found


def class_methods(cls, modules):
    """Its public methods and dunders, its own and those inherited from the package's classes (the one
    that the class uses: the first along its method resolution order)."""
    found, seen = [], set()
    for owner in cls.__mro__:
        module = modules.get(owner.__module__)
        if module is None:
            continue
        for name, value in vars(owner).items():
            if name in seen or (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))):
                continue
            seen.add(name)
            function = value.__func__ if isinstance(value, staticmethod | classmethod) else value
            function = function.fget if isinstance(function, property) else function
            if inspect.isfunction(function) and written_here(function, module):
                found.append((f"{cls.__module__}.{cls.__qualname__}.{name}", function))
    return found


def missing_hints(function):
    """The parameters (and "return") of `function` that have no annotation."""
    signature = inspect.signature(function)
    missing = [parameter.name for parameter in signature.parameters.values()
               if parameter.name not in ("self", "cls")
               and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
               and parameter.annotation is inspect.Parameter.empty]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def checked_functions():
    return public_functions(package_modules())


def test_every_public_function_and_method_is_annotated():
    unannotated = {name: missing for name, function in checked_functions() if (missing := missing_hints(function))}
    assert unannotated == {}


def test_every_hint_names_a_type_that_exists():
    # A hint written as a string (a type of a higher layer, "perinstance.measure.measurement.Measurement")
    # resolves once every module is imported. torch is given: train/sampling.py imports it inside the one
    # function that draws with it, so that the accountants read the stream names without torch.
    unresolved = {}
    for name, function in checked_functions():
        try:
            typing.get_type_hints(function, localns={"torch": torch})
        except (NameError, AttributeError) as error:
            unresolved[name] = str(error)
    assert unresolved == {}


def test_the_walk_reaches_functions_methods_and_inherited_methods():
    names = {name for name, _ in checked_functions()}
    assert {"perinstance.api.sensitivity.sensitivities", "perinstance.api.accountant.IndividualAccountant.step",
            "perinstance.measure.gradient_rows.HeldRows.mean",  # inherited from the private _Rows
            "perinstance.train.nets.ScatterNet.__call__", "perinstance.measure.coupling.CouplingPlan.k_min",
            "perinstance.errors.UsageError.__init__"} <= names
    assert len(names) > 400


def test_an_unannotated_function_is_reported():
    def partly(self, flag, *args, count: int = 0, **kwargs):
        return flag

    assert missing_hints(partly) == ["flag", "return"]
