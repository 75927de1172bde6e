"""Per-sample gradients of layers the fast norms engine (perinstance/persample/layer_pass.py) does not cover.

The engine's closed forms hold for the layers of layer_pass.SQUARED_NORMS (Linear on inputs with any leading
dimensions, Conv1d and Conv2d with zero padding, GroupNorm, LayerNorm, RMSNorm, Embedding, self-attention),
each applied once per forward through its own `forward`, to inputs whose first dimension is the examples. Any
other trainable layer of a model (attention to other keys than its queries, a custom module, a layer applied
twice, a parameter shared by two layers, a layer whose input is changed in place after it read it) falls back,
layer by layer, to torch.func: vmap over the examples of grad of each example's loss with respect to those
layers' parameters alone. Recurrent layers (GRU, LSTM, RNN) torch.func cannot take are refused in one line naming
Opacus's replacement. Both parts are exact, so ||g_i||² is the sum of the two and the
clipped sum u(B) of accounting.md §1 is the engine's per-layer sums plus Σ_i w_i·g_i of the fallback layers.
Which layers fall back is printed once per process.

Models built from a --model spec, and models given to the public API's `sensitivities`, always go through
here (USER_MODEL_MARK), so that every layer is checked at every pass, as does any model with a
trainable layer of a type (or a Conv2d padding) the engine lacks; another model (this suite's own networks)
keeps the engine's own checks (a layer applied twice is an error there). A covered layer whose closed form
disagrees with torch.func on the first examples a process sees (its weights also used outside its forward)
falls back too, as does a layer with a parameter that another layer shares. The pass runs the model in eval
mode (dropout off), in training as in measurement.
"""

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from perinstance.persample import batches, finite, layer_forms, layer_pass
from perinstance.persample.layer_pass import eval_mode

# torch.func has no batching rule for some fused kernels (CPU attention) and runs them per example; the
# result is exact, the warning is about speed only.
NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented"
# Set on every model built from a spec, and on a model given to the public API while it is measured
# (user_code.checked_as_user_model): every pass of it then goes through here, each layer checked, instead of
# trusting that the fast engine covers it.
USER_MODEL_MARK = "perinstance_user_model"

# Each distinct line of which layers fall back, printed once per process.
_announced = set()
# Recurrent layers whose per-example gradients torch.func cannot take (an in-place update of the hidden state
# inside vmap), and the layer of opacus.layers that computes the same function from Linear layers.
RECURRENT_REPLACEMENTS = {nn.GRU: "opacus.layers.DPGRU", nn.RNN: "opacus.layers.DPRNN", nn.LSTM: "opacus.layers.DPLSTM"}


def _owners(model):
    """(name, module, its own trainable parameters) of every module that owns one."""
    owners = [(name, module, layer_pass.own_trainable_parameters(module)) for name, module in model.named_modules()]
    return [(name, module, params) for name, module, params in owners if params]


def needs_fallback(model: nn.Module, owners: list | None = None) -> bool:
    """Whether per-sample gradients of `model` go through this module: a model built from a spec (or given to the
    public API), or one the engine does not cover (`engine_covers`). `owners`: layer_pass.parameter_owners(model),
    where the caller has it."""
    return checked(model) or not engine_covers(layer_pass.parameter_owners(model) if owners is None else owners)


def checked(model: nn.Module) -> bool:
    """Whether `model` carries USER_MODEL_MARK (built from a spec, or given to the public API): every pass of it
    goes through here, its covered layers checked against torch.func."""
    return getattr(model, USER_MODEL_MARK, False)


def engine_covers(owners: list) -> bool:
    """Whether the engine has a closed form for every trainable layer of a model (`owners`:
    layer_pass.parameter_owners of it): each of a type it covers in settings it takes
    (layer_pass.closed_form_applies), none sharing a parameter with another. A layer may still fall back when its
    pass is checked (a weight used outside its forward)."""
    shared = any(len(params) < len(layer_pass.own_trainable_parameters(module)) for module, params in owners)
    return not shared and all(type(module) in layer_pass.SQUARED_NORMS and layer_pass.closed_form_applies(module)
                              for module, _ in owners)


def _covered(layer, application, count):
    """Whether the engine's closed form holds for this application of `layer` (layer_pass.record_application) in a
    pass of `count` examples: a layer and settings it covers, the examples along the first dimension of the
    layer's input and output, the input not changed in place after the layer read it."""
    layer_input, version, output = application
    if type(layer) not in layer_pass.SQUARED_NORMS or not layer_pass.closed_form_applies(layer) or output is None \
            or layer_pass.modified_in_place(layer_input, version):
        return False
    if layer_input.dim() == 0 or len(layer_input) != count or len(output.shape) == 0 or output.shape[0] != count:
        return False
    if isinstance(layer, nn.Linear):
        return layer_input.dim() >= 2
    if isinstance(layer, nn.Conv2d | nn.Conv1d):
        return layer_input.dim() == (4 if isinstance(layer, nn.Conv2d) else 3)
    if isinstance(layer, nn.LayerNorm | nn.RMSNorm):
        return layer_input.dim() > len(layer.normalized_shape)
    return True


@dataclass
class _Split:
    """One forward pass: the covered layers with their inputs and outputs (None for a GroupNorm layer with
    parameter rows), the names of the parameters that fall back (in model.named_parameters() order), the logits
    and per-example losses, and the covered GroupNorm layers' parameter rows (layer_forms.group_norm_rows)."""

    layers: list
    inputs: list
    outputs: list
    fallback: list
    logits: object
    losses: torch.Tensor
    group_norm_rows: dict

    def layer_norms(self) -> tuple:
        """layer_pass.layer_norms of the covered layers."""
        return layer_pass.layer_norms(self.layers, self.inputs, self.outputs, self.losses, self.group_norm_rows)


# The engine's closed form of a layer holds only if its parameters are used by its own forward alone; a parent
# that also calls F.linear(x, self.layer.weight) is invisible to hooks. So the first pass of each structure
# (model class, parameter names) in a process compares every covered layer's closed form with torch.func on
# CHECK_EXAMPLES examples; the layers that disagree fall back from then on. {structure: names of those layers}
_wrongly_covered = {}
CHECK_EXAMPLES = 2
# Float32 closed forms and torch.func agree to ~1e-6 relative; a missed use of a parameter changes far more.
CHECK_RTOL = 1e-3


def _split_forward(model, inputs, labels, check=True, loss_fn=None):
    owners = _owners(model)
    problem = recurrent_problem(model)
    if problem is not None:
        raise ValueError(problem)
    owner_count = {}
    for _, _, params in owners:
        for param in params:
            owner_count[param] = owner_count.get(param, 0) + 1
    calls, rows = {}, {}  # rows: GroupNorm's per-sample γ and β from the backward itself, as in the engine's pass

    def record(layer, layer_inputs, output):
        # A GroupNorm layer with rows needs neither its input nor its output, and the forward frees them.
        calls.setdefault(layer, []).append(
            (None, None, None) if layer in rows else layer_pass.record_application(layer_inputs[0], output))

    modules = [module for _, module, _ in owners]
    with layer_forms.group_norm_rows(modules, rows):
        logits = layer_pass.forward_with_hook(model, modules, record, inputs)
    structure = (type(model), tuple(name for name, _ in model.named_parameters()))
    if check and structure not in _wrongly_covered:
        first = slice(0, CHECK_EXAMPLES)
        _wrongly_covered[structure] = _check_closed_forms(model, batches.take(inputs, first),
                                                          batches.take(labels, first), loss_fn)
    wrong = _wrongly_covered.get(structure, set())
    count = batches.count(inputs)
    covered, falling = [], []
    for name, module, params in owners:
        applications = calls.get(module, [])
        if name not in wrong and len(applications) == 1 and all(owner_count[param] == 1 for param in params) \
                and (module in rows or _covered(module, applications[0], count)):
            covered.append(module)
        else:
            falling.append((name, module, params))
    if check:
        _announce(covered, falling)
    # Only trainable parameters: a frozen one has no gradient to clip or to count in ||g_i||.
    falling_params = {param for _, _, params in falling for param in params}
    fallback = [name for name, param in model.named_parameters() if param in falling_params]
    return _Split(covered, [calls[layer][0][0] for layer in covered], [calls[layer][0][2] for layer in covered],
                  fallback, logits, batches.per_example_loss(logits, labels, loss_fn),
                  {layer: rows[layer] for layer in covered if layer in rows})


def recurrent_problem(model: nn.Module) -> str | None:
    """What to say of a recurrent layer of `model` that torch.func cannot take per example (RECURRENT_REPLACEMENTS;
    trainable or not, as the check of the closed forms runs the whole forward under vmap), naming it and Opacus's
    replacement; None where there is none."""
    for name, module in model.named_modules():
        replacement = RECURRENT_REPLACEMENTS.get(type(module))
        if replacement is not None:
            return (f"layer {name or '(the model)'} ({type(module).__name__}): no per-sample gradients here "
                    f"(torch.func cannot take them per example); use {replacement}, the same layer built from Linear "
                    "layers")
    return None


def _check_closed_forms(model, inputs, labels, loss_fn=None):
    """Names of the layers the engine would cover whose closed-form ||g_i||² differs from torch.func's, and of
    those it does not cover on these examples (a Linear layer whose input is not batch-first shows its examples
    along the first dimension only when their number is that of the positions): they fall back from then on.
    A value that is not finite tells nothing of the closed forms: finite.NonFiniteValues, for the callers to refuse
    (the model's or the loss's, persample/finite.py)."""
    split = _split_forward(model, inputs, labels, check=False, loss_fn=loss_fn)
    _, norms_by_layer = split.layer_norms()
    layer_names = {module: name for name, module in model.named_modules()}
    parameter_names = {param: name for name, param in model.named_parameters()}
    fallback = set(split.fallback)
    wrong = {name for name, _, params in _owners(model) if any(parameter_names[param] in fallback for param in params)}
    with torch.no_grad():
        for layer, closed in zip(split.layers, norms_by_layer, strict=True):
            own = [parameter_names[param] for param in layer.parameters(recurse=False) if param.requires_grad]
            direct = sum(grad.reshape(len(grad), -1).square().sum(dim=1)
                         for grad in per_example_gradients(model, own, inputs, labels, loss_fn))
            finite.check_values(split.losses, direct.sqrt(), split.logits)
            finite.check_values(split.losses, closed.squared.sqrt(), split.logits)
            if not torch.allclose(closed.squared, direct, rtol=CHECK_RTOL, atol=CHECK_RTOL * float(direct.max())):
                wrong.add(layer_names[layer])
    return wrong


def _announce(covered, falling):
    if not falling:
        return
    line = (f"per-sample gradients: the fast norms engine for {len(covered)} layer(s), torch.func (vmap of grad) "
            f"for {len(falling)} it does not cover: "
            + ", ".join(f"{name or '(the model)'} ({type(module).__name__})" for name, module, _ in falling))
    if line not in _announced:
        _announced.add(line)
        print(line, file=sys.stderr, flush=True)


def per_example_gradients(model: nn.Module, names: list, inputs: object, labels: object,
                          loss_fn: batches.LossFn | None = None) -> list:
    """g_i of the loss of each example (batches.per_example_loss) with respect to the parameters `names` (the
    others held fixed): one (n, *shape) tensor per name, by torch.func's vmap over the examples of grad."""
    if not names:  # every layer covered by the engine: no vmapped pass at all
        return []
    values = {name: param.detach() for name, param in model.named_parameters() if name in set(names)}

    def one(batch):
        return batches.map_tensors(lambda tensor: tensor.unsqueeze(0), batch)

    def loss(params, example, label):
        outputs = torch.func.functional_call(model, params, *batches.call_arguments(one(example)))
        return batches.per_example_loss(outputs, one(label), loss_fn).sum()

    # torch.func.grad differentiates inside; nothing outside needs a graph.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_BATCHING_RULE)
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(values, inputs, labels)
    return [grads[name] for name in names]


def _squared(layer_norms, fallback, losses):
    """||g_i||² from the covered layers' LayerNorms and the fallback layers' per-sample gradients."""
    squared = torch.zeros_like(losses.detach())
    for norms in layer_norms:
        squared = squared + norms.squared
    for grad in fallback:
        squared = squared + grad.reshape(len(grad), -1).square().sum(dim=1)
    return squared


def per_sample_norms(model: nn.Module, inputs: object, labels: object,
                     loss_fn: batches.LossFn | None = None) -> tuple[torch.Tensor, torch.Tensor, object]:
    """As gradients.per_sample_norms: ||g_i||, per-example losses, logits."""
    with eval_mode(model):
        split = _split_forward(model, inputs, labels, loss_fn=loss_fn)
        _, layer_norms = split.layer_norms()
        fallback = per_example_gradients(model, split.fallback, inputs, labels, loss_fn)
        with torch.no_grad():  # the covered layers' norms one at a time, their materialised gradients freed
            squared = _squared(layer_norms, fallback, split.losses)
    return squared.sqrt(), split.losses.detach(), batches.map_tensors(torch.Tensor.detach, split.logits)


def clipped_gradient_sum(model: nn.Module, inputs: object, labels: object,
                         weights_of_norms: Callable[[torch.Tensor], torch.Tensor],
                         loss_fn: batches.LossFn | None = None
                         ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, object]:
    """As gradients.clipped_gradient_sum: (Σ_i w_i·g_i per trainable parameter, losses, ||g_i||, logits); the
    covered layers' sums as the engine takes them (layer_pass.weighted_layer_gradients)."""
    with eval_mode(model):
        split = _split_forward(model, inputs, labels, loss_fn=loss_fn)
        grad_outputs, layer_norms = split.layer_norms()
        fallback = per_example_gradients(model, split.fallback, inputs, labels, loss_fn)
        with torch.no_grad():
            layer_norms = list(layer_norms)
            norms = _squared(layer_norms, fallback, split.losses).sqrt()
            weights = weights_of_norms(norms)
            parameters = dict(model.named_parameters())
            summed = dict(zip((parameters[name] for name in split.fallback), layer_pass.weighted_sum(fallback, weights)))
            summed.update(layer_pass.weighted_layer_gradients(split.layers, split.inputs, grad_outputs, layer_norms,
                                                              weights))
    return ([summed[param] for param in layer_pass.trainable_parameters(model)], split.losses.detach(), norms,
            batches.map_tensors(torch.Tensor.detach, split.logits))


def per_sample_gradients(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                         loss_fn: batches.LossFn | None = None) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """As gradients.per_sample_gradients, for a model Opacus's hooks may not cover: every trainable parameter's
    per-sample gradients by torch.func, per-example losses, logits."""
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    with eval_mode(model):
        with torch.no_grad():
            logits = batches.apply_model(model, inputs)
        grads = per_example_gradients(model, names, inputs, labels, loss_fn)
    return grads, batches.per_example_loss(logits, labels, loss_fn), logits
