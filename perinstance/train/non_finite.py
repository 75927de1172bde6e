"""Training and measuring stopped by a value that is not finite (persample/finite.py), in one line that says
whose it is.

A value made at the parameters of a step (an output, a loss, a per-sample gradient norm that is NaN or ±inf) is
the code's that made it: the user's --model, --loss or --dataset, named with its spec, the example and the step.
It is the learning rate's only where the suite's own code made it (a built-in network, the default
cross-entropy), or where the parameters themselves stop being finite after a step whose values were finite:
"training diverged", as before. A new run stopped by the user's code is removed whole (training.train): once the
code is fixed, its file's sha256 differs from run.json's, so the run could not be resumed anyway.

The trainer reads nothing back per step to check (training.LOSS_READ_STEPS): each step keeps its per-sample
losses, norms and whether each example's outputs are finite on the device (StepLog), and folds the norms into
the batch loss it returns (NaN where one is not; a loss that is not finite makes it so itself); the loop reads
those losses every few steps, as it did, and only then are the kept values looked at.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from perinstance.errors import UsageError
from perinstance.persample import batches, gradients
from perinstance.persample.finite import (
    GRADIENT,
    IN_LOSS,
    IN_MODEL,
    INPUT,
    LOSS,
    OUTPUT,
    NonFinite,
    NonFiniteValues,
    finite_examples,
    first_non_finite,
    source_of,
)
from perinstance.train import runs, user_code


class UserCodeStop(UsageError):
    """A value that the user's own code (--model, --loss, --dataset) made not finite."""


def user_parts(run: runs.RunConfig, found: NonFinite, source: str | None = None) -> dict[str, str]:
    """{flag: spec} of the user's code that made `found` (`source`: gradient_source of a gradient, None where
    unknown: then the model and the loss both), {} where that code is the suite's own."""
    model = run.model if user_code.is_spec(run.model) else None
    if found.kind == INPUT:
        return {"--dataset": run.dataset}
    if found.kind == OUTPUT:
        parts = {"--model": model}
    elif found.kind == LOSS:
        parts = {"--loss": run.loss}
    else:
        parts = {"--model": model} if source == IN_MODEL else {"--loss": run.loss} if source == IN_LOSS else \
            {"--model": model, "--loss": run.loss}
    return {flag: spec for flag, spec in parts.items() if spec}


def what_happened(found: NonFinite, source: str | None = None) -> str:
    """`found` in words, after the spec that made it: "gave an output that is not finite (nan)"."""
    if found.kind == INPUT:
        return f"holds an input value that is not finite ({found.value:g})"
    if found.kind == OUTPUT:
        return f"gave an output that is not finite ({found.value:g})"
    if found.kind == LOSS:
        return f"gave a loss that is not finite ({found.value:g}; the model's outputs are finite)"
    where = {IN_LOSS: "the loss's gradient in the outputs", IN_MODEL: "the backward through the model"}.get(source)
    return (f"gave a gradient that is not finite (||g|| = {found.value:g}; the outputs and the loss are finite"
            f"{', so it is made by ' + where if where else ''})")


def user_code_stop(parts: dict[str, str], found: NonFinite, example: str, when: str,
                   source: str | None = None) -> UserCodeStop:
    """The one-line error naming the user's code (`parts`, user_parts) that made `found` for `example` `when`."""
    return UserCodeStop("/".join(parts), f"{' with '.join(parts.values())} {what_happened(found, source)} for "
                                         f"{example} {when}")


def at_step(run: runs.RunConfig, step: int) -> str:
    """When a value of training step `step` was made, for an error."""
    if step == 1:
        return f"at step 1 of {run.total_steps} (the initial parameters θ_0)"
    return (f"at step {step} of {run.total_steps} (the parameters θ_{step - 1}; if it appears only after training "
            "for a while, a smaller --lr may avoid it)")


def training_example(run: runs.RunConfig, row: int) -> str:
    """A row of the trainer's training set in words: its real points, then its included input canaries."""
    if row >= run.dataset_size:
        return f"input canary {row - run.dataset_size}"
    return f"training example {row}"


# --- the steps between two reads of the batch losses ----------------------------------------------------------

@dataclass
class StepValues:
    """What one step's pass gave, on the device: its examples (rows of the trainer's training set), their losses,
    gradient norms (None without privacy: then `gradient_finite`, whether the summed gradient is) and whether
    each one's outputs are finite."""

    step: int
    batch: np.ndarray
    grad_norms: list = field(default_factory=list)
    outputs_finite: list = field(default_factory=list)
    losses: torch.Tensor | None = None
    gradient_finite: torch.Tensor | None = None

    def first_non_finite(self) -> NonFinite | None:
        """The step's first example with a value that is not finite; for a summed gradient that is not finite
        (without privacy) position -1, the batch's. Reads the values back."""
        if self.losses is None:
            return None
        found = first_non_finite(self.losses, _joined(self.grad_norms) if self.grad_norms else None,
                                 outputs_finite=_joined(self.outputs_finite))
        if found is None and self.gradient_finite is not None and not bool(self.gradient_finite):
            return NonFinite(-1, GRADIENT, float("nan"))
        return found


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The passes' values of one step as one tensor (the one pass's own, without a copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class StepLog:
    """The StepValues of the steps since the loop last read the batch losses."""

    def __init__(self) -> None:
        self.kept: list[StepValues] = []

    def begin(self, step: int, batch: np.ndarray) -> None:
        self.kept.append(StepValues(step, batch))

    def add(self, grad_norms: torch.Tensor | None, outputs: object, count: int) -> None:
        """One pass of the current step: its examples' norms (None without privacy) and outputs."""
        current = self.kept[-1]
        if grad_norms is not None:
            current.grad_norms.append(grad_norms)
        current.outputs_finite.append(finite_examples(outputs, count))

    def end(self, losses: torch.Tensor, summed: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The current step's mean batch loss (None for an empty batch), NaN where a gradient norm is not finite
        (a loss that is not finite makes the mean so itself), without reading it back: the values the update is
        made of. An output that is not finite whose loss and gradient are finite changes nothing here; the outputs'
        checks name the model when a loss is not (first_bad). `summed`: the summed gradient of a step without
        privacy. A few operations on the batch's values, against the thousands of a step."""
        current = self.kept[-1]
        if not len(losses):
            self.kept.pop()
            return None
        current.losses = losses
        if current.grad_norms:
            finite = torch.isfinite(_joined(current.grad_norms)).all()
        else:  # one norm of all the parameters' gradients: NaN or inf where any part is
            current.gradient_finite = finite = torch.isfinite(torch.stack(torch._foreach_norm(summed)).sum())
        return torch.where(finite, losses.mean(), float("nan"))

    def clear(self) -> None:
        self.kept = []

    def first_bad(self) -> tuple[StepValues, NonFinite] | None:
        """The first kept step with a value that is not finite, and that value."""
        for values in self.kept:
            found = values.first_non_finite()
            if found is not None:
                return values, found
        return None


@dataclass(frozen=True)
class Seen:
    """A value that is not finite that a pass met at θ_step before any loss was read (the tracked points', or the
    engine's check of a user's model, fallback_norms.py): of `example` ("tracked point 3"), with where its gradient
    stopped being finite (gradient_source, for a gradient; None where unknown)."""

    step: int
    example: str
    found: NonFinite
    source: str | None = None


def seen(model: nn.Module, inputs: object, targets: object, loss_fn: batches.LossFn | None, error: NonFiniteValues,
         step: int, example: str) -> Seen:
    """The Seen of a pass that raised `error` at θ_step over (`inputs`, `targets`), at the model's parameters still:
    its example in words (`example`), and, for a gradient, where it stopped being finite."""
    return Seen(step, example, error.found, source_of(model, inputs, targets, loss_fn, error.found))


def training_stop(run: runs.RunConfig, log: StepLog, weights_finite: Callable[[], bool],
                  diverged: Callable[[int, str], UsageError], step: int, met: Seen | None = None) -> UsageError:
    """Why training stops before or at `step`: the first kept step of `log` with a value that is not finite; else
    parameters θ_{step−1} that are not finite; else the value a pass `met` before. The user's code's error
    where its code made the value (UserCodeStop), else the learning rate's: diverged(the step, what was not
    finite) (training.diverged)."""
    bad = log.first_bad()
    if bad is not None:
        values, found = bad
        example = "the batch" if found.position < 0 else training_example(run, int(values.batch[found.position]))
        parts = user_parts(run, found)
        if parts:
            return user_code_stop(parts, found, example, at_step(run, values.step))
        loss = float(values.losses.mean())
        what = f"the loss is {loss:g}" if not np.isfinite(loss) else \
            f"the {found.kind} of {example} is {found.value:g}"
        return diverged(values.step, f"{what} at step {values.step}")
    if not weights_finite():
        return diverged(step - 1, f"the weights are not finite after step {step - 1}")
    if met is not None:
        parts = user_parts(run, met.found, met.source)
        if parts:
            return user_code_stop(parts, met.found, met.example, at_step(run, met.step + 1), met.source)
        return diverged(met.step + 1, f"the {met.found.kind} of {met.example} is {met.found.value:g} at step "
                                      f"{met.step + 1}")
    return diverged(step, f"the loss is not finite at step {step}")


# --- finding the example after a pass met a value that is not finite ------------------------------------------

def locate(model: nn.Module, inputs: object, targets: object, device: str | torch.device, per_pass: int,
           loss_fn: batches.LossFn | None = None) -> tuple[NonFinite, str | None] | None:
    """The first of the examples (`inputs`, `targets`, on the CPU or the device) with an input, output, loss or
    gradient norm that is not finite at the model's current parameters, in its current mode, and where its
    gradient stopped being finite (gradient_source, for a gradient); None where every value is finite. One norms
    pass, chunk by chunk, up to that example: for the error after a measurement met such a value."""
    count = batches.count(targets)
    for start in range(0, count, per_pass):
        span = slice(start, min(start + per_pass, count))
        chunk_inputs, chunk_targets = batches.to_device((batches.take(inputs, span), batches.take(targets, span)),
                                                        device)
        try:
            norms, losses, outputs = gradients.per_sample_norms(model, chunk_inputs, chunk_targets, loss_fn)
            found = first_non_finite(losses, norms, outputs, chunk_inputs)
        except NonFiniteValues as error:  # met by the engine's check of a user's model (fallback_norms.py)
            found = error.found
        if found is not None:
            return (NonFinite(start + found.position, found.kind, found.value),
                    source_of(model, chunk_inputs, chunk_targets, loss_fn, found))
    return None


def test_stop(run: runs.RunConfig, model: nn.Module, test_x: torch.Tensor, test_y: torch.Tensor,
              device: str | torch.device, per_pass: int, loss_fn: batches.LossFn | None, step: int) -> UsageError | None:
    """The error for a mean test loss that is not finite at θ_step: the first test example with a value that is not
    finite, where the user's code made it (UserCodeStop); None where the suite's own code did (the training
    steps' own values stop a diverging run) or no example has one."""
    located = locate(model, test_x, test_y, device, per_pass, loss_fn)
    if located is None:
        return None
    found, source = located
    parts = user_parts(run, found, source)
    if not parts:
        return None
    when = "at the initial parameters θ_0" if step == 0 else \
        f"at the parameters θ_{step} (after step {step} of {run.total_steps})"
    return user_code_stop(parts, found, f"test example {found.position}", when, source)
