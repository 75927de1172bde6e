"""IndividualAccountant.attach (docs/api.md): the real steps of an Opacus DPOptimizer recorded by themselves.

DPOptimizer keeps one step hook, which PrivacyEngine gives to its own accountant; attach chains it: the hook set
here measures Δ* when due, calls the previous hook (so Opacus's accountant advances exactly as without it), then
records the step. DPOptimizer calls its hook only for the steps it takes, after clipping and noise and before the
wrapped optimizer's update (opacus/optimizers/optimizer.py, pre_step): the parameters are then those the step's
gradients were computed at, θ_{t−1} (docs/accounting.md §2, §4), and BatchMemoryManager's skipped steps, which
return before the hook, are never counted.
"""

import warnings
from collections.abc import Callable, Sequence

from opacus.data_loader import DPDataLoader
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer, DPPerLayerOptimizer
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler, UniformWithReplacementSampler
from torch import nn
from torch.utils.data import DataLoader

from perinstance.api import arguments
from perinstance.api.examples import examples
from perinstance.api.sensitivity import check_loss_fn, check_model, measured_sensitivities
from perinstance.train.clipping import Transform


class Attached:
    """What attach returns: detach() gives the optimizer its previous step hook back (the accountant then records
    nothing more); a context manager that detaches on exit."""

    def __init__(self, optimizer: DPOptimizer, hook: Callable, previous: Callable | None) -> None:
        self.optimizer, self.hook, self.previous = optimizer, hook, previous

    def detach(self) -> None:
        """Stop recording: the optimizer's step hook is the one it had before attach."""
        if self.optimizer.step_hook is not self.hook:
            raise ValueError("optimizer: its step hook is no longer the one attach set (detached already, or "
                             "replaced since); nothing to detach")
        self.optimizer.step_hook = self.previous

    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def attach(accountant: object, optimizer: DPOptimizer, model: nn.Module, data: DataLoader, *, every: int = 1,
           points: Sequence[int] | None = None, loss_fn: Callable | None = None) -> Attached:
    """Record in `accountant` every real step of `optimizer` (σ its noise_multiplier, q the Poisson rate of `data`,
    times its accumulated_iterations as Opacus's own accountant counts it), with Δ*/C of `points` (default: every
    point of data's dataset) measured by `sensitivities` at the step's parameters every `every` steps, from the
    first, and held in between (those steps are labelled held: the composition is then a held-Δ* estimate, §4).
    model: the network (or its Opacus wrapper) whose parameters the optimizer updates; loss_fn as for
    `sensitivities`. Arguments are checked here, each bad one a one-line TypeError or ValueError."""
    check_private(optimizer, model, loss_fn)
    sample_rate = poisson_rate(data)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer >= 1 (measure Δ* every that many steps), not {every!r}")
    chosen = examples(data, points)  # checks points and the data's form
    count = len(chosen.index) if chosen.index is not None else len(data.dataset)
    if count != accountant.num_points:
        raise ValueError(f"points: {count} points, but the accountant follows {accountant.num_points}")
    if optimizer.step_hook is not None and getattr(optimizer.step_hook, "perinstance_accountant", None) is accountant:
        raise ValueError("optimizer: this accountant is attached to it already")
    if random_in_training(model):
        warnings.warn("model has dropout active in training: Δ* is measured without it (eval mode), so every "
                      "step's Δ* counts as held and the per-point ε is a held-Δ* estimate", stacklevel=3)
    previous = optimizer.step_hook
    state = {"steps": 0, "ratios": None}

    def hook(optim):
        due = state["steps"] % every == 0
        if due:
            clip_bound = arguments.positive_finite("clip_bound", optim.max_grad_norm)
            # A value that is not finite stops the step before the optimizer updates the parameters.
            state["ratios"] = measured_sensitivities(model, chosen, Transform("flat", clip_bound), loss_fn,
                                                     f"at step {state['steps'] + 1} since attach") / clip_bound
        if previous is not None:
            previous(optim)
        accountant.step(noise_multiplier=optim.noise_multiplier, sample_rate=sample_rate * optim.accumulated_iterations,
                        sensitivity_ratios=state["ratios"], measured=due and not random_in_training(model))
        state["steps"] += 1

    hook.perinstance_accountant = accountant
    optimizer.attach_step_hook(hook)
    return Attached(optimizer, hook, previous)


def check_private(optimizer: object, model: object, loss_fn: object) -> None:
    """A one-line TypeError or ValueError where `optimizer` is not an Opacus DPOptimizer that clips every gradient
    to one fixed bound, `model` not the network whose parameters it updates (or one the engine cannot measure),
    or `loss_fn` not a function."""
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(f"optimizer must be Opacus's DPOptimizer (as PrivacyEngine.make_private returns it), not "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, DPPerLayerOptimizer | AdaClipDPOptimizer) or isinstance(optimizer.max_grad_norm, list):
        raise ValueError(f"optimizer: {type(optimizer).__name__} does not clip every gradient to one fixed bound; "
                         "make it private with clipping='flat'")
    check_loss_fn(loss_fn)
    check_model(model)
    if {id(param) for param in optimizer.params} != {id(param) for param in model.parameters() if param.requires_grad}:
        raise ValueError("model: its trainable parameters are not those the optimizer updates; give the model "
                         "make_private returned with this optimizer")


def poisson_rate(data: object) -> float:
    """The Poisson sample rate of a DataLoader made private with poisson_sampling=True (Opacus's DPDataLoader, or
    any loader whose batch sampler is Opacus's uniform sampler with replacement); anything else is refused: no
    accountant here covers shuffled batches."""
    sampler = getattr(data, "batch_sampler", None)
    if isinstance(data, DPDataLoader) or isinstance(sampler, UniformWithReplacementSampler
                                                    | DistributedUniformWithReplacementSampler):
        return float(sampler.sample_rate)
    raise ValueError(f"data must be the DataLoader that make_private returned with poisson_sampling=True (Poisson "
                     f"batches, which every accountant here assumes), not a {type(data).__name__} with "
                     f"{type(sampler).__name__ if sampler is not None else 'no batch sampler'}")


def random_in_training(model: nn.Module) -> bool:
    """Whether `model`, as it trains now, draws at random (dropout), so that its training-mode gradients are not
    the eval-mode ones that sensitivities measures."""
    return model.training and any(
        (isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0)
        or (isinstance(module, nn.MultiheadAttention) and module.dropout > 0) for module in model.modules())

