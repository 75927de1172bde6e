"""Your own network, data and loss from the command line: `--model PATH.py:NAME` or `--model package.module:NAME`,
and `--dataset` and `--loss` alike (docs/flags.md, "Your own model, data and loss").

A spec names a Python file (or an importable module) and an attribute of it. The model's attribute is a
class or a factory returning an `nn.Module`, called with those of `in_channels`, `image_size`, `num_classes`
and `input_shape` that its signature names; the dataset's is a function returning `(train, test)`, each a
torch Dataset of `(input, target)` pairs or a pair `(inputs, targets)` of tensors, called with `data_root`
when it names it; the loss's is a function (or any callable object) of `(outputs, targets)` returning one loss per
example. run.json records each spec with the sha256 of its file's text, so that a run is never resumed or
measured with a changed file (`check_unchanged`, `build_model`, `load_loss`).
"""

import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import random
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from perinstance.errors import USER_FILES, UsageError, describe
from perinstance.persample import fallback_norms, finite
from perinstance.persample.batches import LossFn
from perinstance.persample.fallback_norms import USER_MODEL_MARK

# PATH.py:NAME or dotted.module:NAME. The built-in prefixes of --dataset (imagefolder:, scatternet:, first:)
# are recognised before a spec is looked for (data.py), so "imagefolder:x" is never read as module:name.
SPEC = re.compile(r"^(?P<source>.+\.py|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<name>[A-Za-z_]\w*)$")
SPEC_FORMS = "PATH.py:NAME or package.module:NAME"
# The seed of torch's, numpy's and Python's global generators while a dataset function runs (restored after):
# data drawn at random is then the same in every process, so its fingerprint names it.
DATASET_SEED = 0


@dataclass(frozen=True)
class Source:
    """The file behind a spec, as run.json records it."""

    spec: str
    path: str | None  # the file's absolute path (None: a module without a file)
    sha256: str | None  # of the file's bytes when it was imported

    def to_json(self) -> dict:
        return {"spec": self.spec, "path": self.path, "sha256": self.sha256}


def is_spec(text: str) -> bool:
    """Whether `text` is a spec (PATH.py:NAME or package.module:NAME) rather than a built-in name."""
    return isinstance(text, str) and SPEC.match(text) is not None


# Modules imported from files in this process, by (absolute path, sha256 of the text): a script that builds a
# model at every checkpoint imports the file once, and a changed file is imported afresh.
_file_modules = {}


def _import_file(path: str, flag: str):
    if not os.path.isfile(path):
        raise UsageError(flag, f"{path}: no such file (expected {SPEC_FORMS})")
    try:
        with open(path, "rb") as handle:
            text = handle.read()
    except OSError as error:
        raise UsageError(flag, f"cannot read {path}: {error.strerror or error}") from None
    digest = hashlib.sha256(text).hexdigest()
    key = (os.path.abspath(path), digest)
    if key not in _file_modules:
        name = f"perinstance_user_code_{re.sub(r'[^A-Za-z0-9_]', '_', os.path.basename(path)[:-3])}_{digest[:12]}"
        module_spec = importlib.util.spec_from_file_location(name, key[0])
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look a class's module up there
        try:
            # The bytes hashed are the bytes run: the file cannot change between the two.
            exec(compile(text, key[0], "exec"), module.__dict__)
        except Exception as error:
            del sys.modules[name]
            raise UsageError(flag, f"importing {path} failed: {describe(error, key[0])}") from None
        _file_modules[key] = module
    return _file_modules[key], Source(spec="", path=key[0], sha256=digest)


def _import_module(dotted: str, flag: str):
    if os.getcwd() not in sys.path:  # a module beside the command, as `python -m` finds it
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(dotted)
    except ModuleNotFoundError as error:
        raise UsageError(flag, f"no module named {error.name!r} (expected {SPEC_FORMS}; a path must end in .py)") \
            from None
    except Exception as error:
        raise UsageError(flag, f"importing {dotted} failed: {describe(error, getattr(error, 'filename', ''))}") \
            from None
    path = getattr(module, "__file__", None)
    digest = None
    if path is not None:
        with open(path, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
    return module, Source(spec="", path=path and os.path.abspath(path), sha256=digest)


def load_object(spec: str, flag: str) -> tuple[Any, Source]:
    """The attribute that `spec` names, and its Source; a one-line UsageError for a bad spec."""
    match = SPEC.match(spec) if isinstance(spec, str) else None
    if match is None:
        raise UsageError(flag, f"{spec!r} is not {SPEC_FORMS}")
    source, name = match["source"], match["name"]
    if source.endswith(".py"):
        module, origin = _import_file(source, flag)
    else:
        module, origin = _import_module(source, flag)
    if not hasattr(module, name):
        defined = sorted(key for key, value in vars(module).items()
                         if not key.startswith("_") and callable(value) and getattr(value, "__module__", None)
                         == module.__name__)
        raise UsageError(flag, f"{source} has no {name!r} (it defines: {', '.join(defined) or 'nothing callable'})")
    if origin.path is not None:  # an exception raised in it later (a model's forward) is told in one line
        USER_FILES.setdefault(origin.path, {})[flag] = spec
    return getattr(module, name), Source(spec=spec, path=origin.path, sha256=origin.sha256)


def _call(target, available: dict, spec: str, flag: str, what: str):
    """`target(**arguments)` with the arguments of `available` that its signature names."""
    if not callable(target):
        raise UsageError(flag, f"{spec} is a {type(target).__name__}, not {what}")
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        parameters = {}
    arguments = {key: value for key, value in available.items() if key in parameters}
    missing = [key for key, parameter in parameters.items()
               if key not in arguments and parameter.default is inspect.Parameter.empty
               and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)]
    if missing:
        offered = ", ".join(available) or "none"
        raise UsageError(flag, f"{spec} needs {', '.join(missing)}, which is not passed (passed when named: "
                               f"{offered}); give it a default")
    try:
        return target(**arguments)
    except UsageError:
        raise
    except Exception as error:
        path = inspect.getsourcefile(target) if inspect.isfunction(target) or inspect.isclass(target) else None
        raise UsageError(flag, f"{spec} raised {describe(error, path or '')}") from None


# --- models --------------------------------------------------------------------------------------

def model_arguments(input_shape: tuple, num_classes: int) -> dict:
    """What a model's class or factory may receive: num_classes and input_shape (one input's shape, without the
    batch dimension) always; in_channels and image_size (C and H) when one input is C×H×W."""
    arguments = {"num_classes": num_classes, "input_shape": tuple(input_shape)}
    if len(input_shape) == 3:
        arguments = {"in_channels": input_shape[0], "image_size": input_shape[1], **arguments}
    return arguments


def build_model(spec: str, input_shape: tuple, num_classes: int, dp: bool = True,
                recorded: dict | None = None) -> nn.Module:
    """A fresh `nn.Module` from `spec`. With `recorded` (run.json's entry of the run), the file must be the one
    the run was trained with. Under DP, a layer that mixes the examples of a batch is refused."""
    target, source = load_object(spec, "--model")
    if recorded is not None:
        check_source(recorded, source, "--model", "the run was trained with it")
    model = _call(target, model_arguments(input_shape, num_classes), spec, "--model",
                  "a class or function returning a torch.nn.Module")
    if not isinstance(model, nn.Module):
        raise UsageError("--model", f"{spec} returned a {type(model).__name__}, not a torch.nn.Module")
    if not any(param.requires_grad for param in model.parameters()):
        raise UsageError("--model", f"{spec} has no trainable parameter")
    if dp:
        refuse_sample_mixing(model, spec)
    problem = fallback_norms.recurrent_problem(model)
    if problem is not None:
        raise UsageError("--model", f"{spec}: {problem}")
    setattr(model, USER_MODEL_MARK, True)
    return model


@contextmanager
def checked_as_user_model(model: nn.Module) -> Iterator[None]:
    """Within the block, `model` carries USER_MODEL_MARK, as a model built from a spec does: a network that
    the caller built may tie a weight to two layers or use a layer's weight outside its forward, which the fast
    engine's closed forms cannot see. The mark is removed after (unless the model already had it)."""
    if getattr(model, USER_MODEL_MARK, False):
        yield
        return
    setattr(model, USER_MODEL_MARK, True)
    try:
        yield
    finally:
        delattr(model, USER_MODEL_MARK)


def refuse_sample_mixing(model: nn.Module, spec: str) -> None:
    """A layer that mixes the examples of a batch (`sample_mixing`) is a one-line error naming it and the fix."""
    problem = sample_mixing(model)
    if problem is not None:
        raise UsageError("--model", f"{spec}: {problem}")


def sample_mixing(model: nn.Module) -> str | None:
    """A layer that Opacus's ModuleValidator refuses because it mixes the examples of a batch (BatchNorm, an
    InstanceNorm with running statistics) breaks per-example privacy: what to say of the first one (naming it and
    the fix), None where there is none. Other layers Opacus's hooks lack (MultiheadAttention, a custom module)
    are covered by the engine or torch.func."""
    from opacus.validators import ModuleValidator

    for name, module in model.named_modules():
        mixing = isinstance(module, nn.modules.batchnorm._BatchNorm | nn.modules.instancenorm._InstanceNorm)
        validator = ModuleValidator.VALIDATORS.get(type(module))
        if mixing and validator is not None and validator(module):
            return (f"layer {name or '(the model)'} ({type(module).__name__}) mixes the examples of a batch, which "
                    "breaks per-example privacy (Opacus's ModuleValidator refuses it too); use nn.GroupNorm instead")
    return None


# --- losses --------------------------------------------------------------------------------------

def load_loss(spec: str, recorded: dict | None = None) -> LossFn:
    """The per-example loss that `spec` names: a function, or any callable object (an `nn.Module` loss with
    reduction="none"), of (outputs, targets) returning one loss per example. With `recorded` (run.json's entry of
    the run), the file must be the one the run was trained with."""
    target, source = load_object(spec, "--loss")
    if recorded is not None:
        check_source(recorded, source, "--loss", "the run was trained with it")
    if inspect.isclass(target):
        raise UsageError("--loss", f"{spec} is a class; name a function of (outputs, targets), or an instance "
                                   f"defined in the file (e.g. loss = {target.__name__}(...))")
    if not callable(target):
        raise UsageError("--loss", f"{spec} is not callable (a {type(target).__name__} object); name a function of "
                                   "(outputs, targets)")
    return target


def check_loss(loss_fn: LossFn, spec: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """`loss_fn` on the model's outputs of the first two examples (without gradients): an exception raised in it,
    or a value that is not one loss per example, is a one-line error naming the spec, before anything is trained."""
    count = min(2, len(targets))
    with torch.no_grad():
        outputs = model(inputs[:count])  # an exception of the model's own is the model's (errors.user_code_error)
        try:
            losses = loss_fn(outputs, targets[:count])
        except Exception as error:
            raise UsageError("--loss", f"{spec} raised {describe(error, _code_file(loss_fn))}") from None
    if not isinstance(losses, torch.Tensor) or losses.dim() == 0 or len(losses) != count:
        got = f"shape {tuple(losses.shape)}" if isinstance(losses, torch.Tensor) else f"a {type(losses).__name__}"
        raise UsageError("--loss", f"{spec} returned {got} for {count} examples; it must return one loss per "
                                   f"example, shape ({count},) or ({count}, ...) summed per example (e.g. "
                                   "reduction='none')")
    if not losses.is_floating_point():
        raise UsageError("--loss", f"{spec} returned {str(losses.dtype).removeprefix('torch.')} values; a loss "
                                   "is floating point, differentiable in the outputs")


def _code_file(function: object) -> str:
    """The file of a function's code (of a callable object's class), "" where there is none."""
    try:
        return inspect.getsourcefile(function if inspect.isfunction(function) else type(function)) or ""
    except TypeError:
        return ""


# --- datasets ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Examples:
    """One split of a user's dataset as tensors: inputs (N × input shape) and targets (N × target shape: class
    indices, regression values, token ids, ...)."""

    inputs: torch.Tensor
    targets: torch.Tensor


def load_examples(spec: str, data_root: str, class_labels: bool = True) -> tuple[Examples, Examples, Source]:
    """The (train, test) splits that the dataset function of `spec` returns, as tensors, and its Source.
    class_labels: the targets must be class indices, as the default loss (cross-entropy) takes them; False for a
    run with a --loss of its own, whose targets are taken as the dataset gives them."""
    target, source = load_object(spec, "--dataset")
    with _seeded_generators(DATASET_SEED):
        splits = _call(target, {"data_root": data_root}, spec, "--dataset", "a function returning (train, test)")
    if not isinstance(splits, tuple | list) or len(splits) != 2:
        raise UsageError("--dataset", f"{spec} returned {_kind(splits)}, not a pair (train, test)")
    train, test = (_examples(split, spec, name, class_labels)
                   for split, name in zip(splits, ("train", "test"), strict=True))
    if train.inputs.shape[1:] != test.inputs.shape[1:] or train.inputs.dtype != test.inputs.dtype:
        raise UsageError("--dataset", f"{spec}: train inputs are {_shape(train.inputs)} but test inputs "
                                      f"{_shape(test.inputs)}")
    if train.targets.shape[1:] != test.targets.shape[1:] or train.targets.dtype != test.targets.dtype:
        raise UsageError("--dataset", f"{spec}: train labels are {_shape(train.targets)} but test labels "
                                      f"{_shape(test.targets)}")
    return train, test, source


class _seeded_generators:
    """torch's, numpy's and Python's global generators seeded for the block, their states restored after."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self.states = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
        torch.manual_seed(self.seed)
        np.random.seed(self.seed)
        random.seed(self.seed)

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.states[0])
        np.random.set_state(self.states[1])
        random.setstate(self.states[2])


def _kind(value) -> str:
    return f"a {type(value).__name__}" + (f" of length {len(value)}" if isinstance(value, tuple | list) else "")


def _shape(tensor: torch.Tensor) -> str:
    return f"{'×'.join(map(str, tensor.shape[1:])) or 'scalars'} of {str(tensor.dtype).removeprefix('torch.')}"


def target_classes(*splits: torch.Tensor) -> int:
    """`num_classes` of a spec's data, from the targets of its splits: the largest integer target + 1 (class
    indices; token ids: the vocabulary the targets use), or, for floating or boolean targets, how many values one
    target holds (1 for a scalar), the width of the output a model needs. At least 1."""
    if splits[0].is_floating_point() or splits[0].dtype == torch.bool:
        return max(1, math.prod(splits[0].shape[1:]))
    return max(1, max((int(targets.max()) for targets in splits if targets.numel()), default=0) + 1)


def describe_targets(targets: torch.Tensor) -> str:
    """What one split's targets are, in words, for an error: "scalars of float32", "6 values of int64 per point"."""
    shape = "×".join(map(str, targets.shape[1:]))
    kind = str(targets.dtype).removeprefix("torch.")
    text = f"{shape} values of {kind} per point" if shape else f"scalars of {kind}"
    negative = targets.dtype != torch.bool and not targets.is_floating_point() and bool((targets < 0).any())
    return text + (" with negative values" if negative else "")


def pair_tensors(dataset: torch.utils.data.Dataset, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (input, target) pairs dataset[i], i in `indices`, as (stacked inputs, stacked targets)."""
    pairs = [dataset[index] for index in indices]
    if not pairs:
        return torch.zeros(0), torch.zeros(0)
    return (torch.stack([torch.as_tensor(pair[0]) for pair in pairs]),
            torch.stack([torch.as_tensor(pair[1]) for pair in pairs]))


def _examples(split, spec: str, which: str, class_labels: bool) -> Examples:
    """A split (a pair of tensors or arrays, or a Dataset of (input, target) pairs) as tensors: floating inputs in
    torch's default dtype (float32), integer inputs (token ids) kept integer. With `class_labels` the targets must
    be one whole number >= 0 per point, stored int64 (the default loss's class indices); without, floating targets
    are in torch's default dtype and integer ones (class indices, token ids) int64, any shape per point."""
    problem = f"{spec}: the {which} split must be a torch Dataset of (input, label) pairs or a pair (inputs, labels)"
    if isinstance(split, tuple | list) and len(split) == 2 and not isinstance(split[0], tuple | list):
        inputs, targets = split
    elif isinstance(split, torch.utils.data.TensorDataset) and len(split.tensors) == 2:
        inputs, targets = split.tensors
    elif isinstance(split, torch.utils.data.Dataset) and hasattr(split, "__len__"):
        try:
            inputs, targets = pair_tensors(split, range(len(split)))
        except (TypeError, ValueError, IndexError, RuntimeError) as error:
            raise UsageError("--dataset", f"{problem}: {' '.join(str(error).split())}") from None
    else:
        raise UsageError("--dataset", f"{problem}, not {_kind(split)}")
    try:
        inputs, targets = torch.as_tensor(inputs), torch.as_tensor(targets)
    except (TypeError, ValueError, RuntimeError) as error:
        raise UsageError("--dataset", f"{problem}: {' '.join(str(error).split())}") from None
    if len(inputs) == 0 or inputs.dim() == 0 or targets.dim() == 0 or len(inputs) != len(targets):
        raise UsageError("--dataset", f"{problem}: got {tuple(inputs.shape)} inputs and {tuple(targets.shape)} "
                                      "labels (need N >= 1 of each, one label per input)")
    for name, tensor in (("inputs", inputs), ("labels", targets)):
        if tensor.is_complex():
            raise UsageError("--dataset", f"{spec}: {which} {name} are complex; give real or integer {name}")
    if inputs.is_floating_point():
        inputs = inputs.to(torch.get_default_dtype())
    if class_labels:
        if targets.dim() != 1 or targets.dtype == torch.bool or bool((targets < 0).any()) \
                or (targets.is_floating_point() and not bool((targets == targets.round()).all())):
            raise UsageError("--dataset", f"{spec}: {which} labels are {describe_targets(targets)}, but the default "
                                          "loss (cross-entropy) takes class indices 0, 1, 2, ...; for other targets "
                                          "name your loss (--loss PATH.py:NAME)")
        targets = targets.to(torch.int64)
    elif targets.is_floating_point():
        targets = targets.to(torch.get_default_dtype())
    elif targets.dtype != torch.bool:
        targets = targets.to(torch.int64)
    for name, tensor in (("input", inputs), ("label", targets)):
        finite_rows = finite.finite_examples(tensor, len(tensor))
        if not bool(finite_rows.all()):
            index = int((~finite_rows).nonzero()[0, 0])
            value = finite.first_non_finite_element(tensor[index:index + 1])
            raise UsageError("--dataset", f"{spec}: {which} {name} {index} holds {value:g}; every value must be "
                                          "finite")
    return Examples(inputs.contiguous(), targets.contiguous())


# --- run.json --------------------------------------------------------------------------------------

def sources(model: str, dataset: str, loss: str | None = None) -> dict | None:
    """run.json's record of the files behind the --model, --dataset and --loss specs of a run (None: none is
    one)."""
    record = {}
    if is_spec(model):
        record["model"] = load_object(model, "--model")[1].to_json()
    dataset_spec = dataset_spec_of(dataset)
    if dataset_spec is not None:
        record["dataset"] = load_object(dataset_spec, "--dataset")[1].to_json()
    if loss is not None:
        record["loss"] = load_object(loss, "--loss")[1].to_json()
    return record or None


def dataset_spec_of(dataset: str) -> str | None:
    """The spec inside a --dataset value (first:N:SPEC and scatternet:SPEC wrap one), or None."""
    for prefix in ("first:", "scatternet:"):
        if dataset.lower().startswith(prefix):
            rest = dataset[len(prefix):]
            return dataset_spec_of(rest.partition(":")[2] if prefix == "first:" else rest)
    if dataset.lower().startswith("imagefolder:"):
        return None
    return dataset if is_spec(dataset) else None


def check_source(recorded: dict, current: Source, flag: str, when: str) -> None:
    """The file of `current` must be the one `recorded` (run.json's entry) describes."""
    if recorded.get("sha256") != current.sha256:
        raise UsageError(flag, f"{current.path} has changed since {when} (sha256 {str(recorded.get('sha256'))[:12]} "
                               f"then, {str(current.sha256)[:12]} now); restore the file, or train a new run "
                               "(--overwrite, or another --save-name or --id)")


def check_unchanged(recorded: dict | None, planned: dict | None, run_dir: str) -> None:
    """A run folder's recorded files against those of the run about to resume in it: a changed model, data or loss
    file is a one-line error naming it, never a run that mixes two versions."""
    for key, flag in (("model", "--model"), ("dataset", "--dataset"), ("loss", "--loss")):
        before, now = (recorded or {}).get(key), (planned or {}).get(key)
        if before is not None and now is not None and before.get("spec") == now.get("spec"):
            check_source(before, Source(**now), flag, f"{run_dir} was trained with it")


def short_name(text: str) -> str:
    """A spec as run names show it: the file's (or module's last) name and the attribute, `my_model.Net`;
    anything else unchanged. The run name's hash covers the whole spec."""
    match = SPEC.match(text) if is_spec(text) else None
    if match is None:
        return text
    source = match["source"]
    stem = os.path.basename(source)[:-3] if source.endswith(".py") else source.rsplit(".", 1)[-1]
    return f"{stem}.{match['name']}"
