"""IndividualFilter.attach (docs/api.md): the individual filter of docs/accounting.md §12 on an Opacus loop.

attach returns a DataLoader whose batch sampler draws exactly as Opacus's UniformWithReplacementSampler of the
private loader does, one uniform number per point of the whole training set from the same generator, and drops
the points that have left: every other point's draws are those of the run without a filter. Before it draws the
batch of step t, it measures Δ* of the active points at the current parameters, θ_{t−1} (the loader asks for the
next indices only when the loop asks for the next batch, after the previous optimizer.step(); a loader with
workers would prefetch, so it is refused), and applies the filter's rule (§12.2). BatchMemoryManager splits the
drawn batch as it splits Opacus's, and its skipped steps are no steps here either.

A step hook chained before Opacus's own (which advances exactly as without the filter) holds the loop to this
order: every real step of the optimizer must use the one batch drawn since the previous step, from this loader,
with the σ and clip bound the charges were computed with; otherwise it raises before the step is taken.
"""

from collections.abc import Callable, Iterator

import numpy as np
import torch
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler, UniformWithReplacementSampler
from torch import nn
from torch.utils.data import DataLoader

from perinstance.api import arguments
from perinstance.api.examples import examples
from perinstance.api.opacus_hook import check_private, poisson_rate, random_in_training
from perinstance.api.sensitivity import measured_sensitivities
from perinstance.train.clipping import Transform


class FilteredPoissonSampler(UniformWithReplacementSampler):
    """Opacus's Poisson batch sampler over all num_samples points, with `before_draw()` called before each batch
    is drawn: it returns the boolean tensor of the points the batch may hold (the filter's active points)."""

    def __init__(self, sampler: UniformWithReplacementSampler, before_draw: Callable[[], torch.Tensor]) -> None:
        super().__init__(num_samples=sampler.num_samples, sample_rate=sampler.sample_rate,
                         generator=sampler.generator, steps=sampler.steps)
        self.before_draw = before_draw

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            active = self.before_draw()
            # UniformWithReplacementSampler's own draw, then the points that left are dropped.
            drawn = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield (drawn & active).nonzero(as_tuple=False).reshape(-1).tolist()


def attach(individual_filter: object, optimizer: DPOptimizer, model: nn.Module, data: DataLoader, *, every: int,
           loss_fn: Callable | None) -> DataLoader:
    """The loader of IndividualFilter.attach (see the module's docstring): `data` is the Poisson DataLoader that
    make_private returned, over the filter's points; each bad argument a one-line TypeError or ValueError."""
    if isinstance(every, bool) or not isinstance(every, int) or every != 1:
        raise ValueError(f"every must be 1 with a filter, not {every!r}: a charge from a Δ* held since an earlier "
                         "step is no bound, and the per-point clipping that would make it one (accounting.md §12.4) "
                         "is not Opacus's")
    check_private(optimizer, model, loss_fn)
    sample_rate = poisson_rate(data)
    sampler = data.batch_sampler
    if isinstance(sampler, DistributedUniformWithReplacementSampler | FilteredPoissonSampler):
        what = "a filter's loader already" if isinstance(sampler, FilteredPoissonSampler) else "distributed"
        raise ValueError(f"data: the loader is {what}; give the DataLoader make_private returned (one process)")
    if data.num_workers > 0:
        raise ValueError(f"data: num_workers={data.num_workers} prefetches batches before the previous step's "
                         "charges are known; make the loader with num_workers=0 for a filter")
    if len(data.dataset) != individual_filter.num_points:
        raise ValueError(f"data: {len(data.dataset)} points, but the filter follows {individual_filter.num_points}")
    if random_in_training(model):
        raise ValueError("model has dropout active in training: Δ* measured without it (eval mode) does not bound "
                         "its training gradients, and a filter needs bounds")
    if getattr(optimizer.step_hook, "perinstance_filter", None) is not None:
        raise ValueError("optimizer: a filter is attached to it already")
    examples(data, None)  # checks the data's form once
    individual_filter.choose_order(optimizer.noise_multiplier, sample_rate)
    previous = optimizer.step_hook
    # The draws and real steps since attach, and the σ and C of the latest draw's charges.
    state = {"draws": 0, "steps": 0, "noise_multiplier": None, "clip_bound": None}

    def before_draw():
        if state["draws"] != state["steps"]:
            raise ValueError("data: a batch was drawn from the filter's loader before optimizer.step() took the "
                             "previous one; a filter needs exactly one step per batch drawn")
        if random_in_training(model):
            raise ValueError("model has dropout active in training: Δ* measured without it does not bound its "
                             "training gradients")
        clip_bound = arguments.positive_finite("clip_bound", optimizer.max_grad_norm)
        active = np.flatnonzero(individual_filter.active)
        ratios = np.zeros(individual_filter.num_points)
        ratios[active] = measured_sensitivities(model, examples(data, active), Transform("flat", clip_bound), loss_fn,
                                                f"at step {state['draws'] + 1} since attach").numpy() / clip_bound
        drawable = individual_filter.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=sample_rate,
                                          sensitivity_ratios=ratios)
        state.update(draws=state["draws"] + 1, noise_multiplier=optimizer.noise_multiplier, clip_bound=clip_bound)
        return torch.from_numpy(drawable)

    def hook(optim):
        if state["draws"] != state["steps"] + 1:
            raise ValueError("optimizer: this step does not use exactly one batch drawn from the loader the filter's "
                             "attach returned since the previous step (another loader, or batches accumulated)")
        if (optim.noise_multiplier, optim.max_grad_norm) != (state["noise_multiplier"], state["clip_bound"]):
            raise ValueError("optimizer: noise_multiplier or max_grad_norm changed after the step's batch was drawn "
                             "and charged")
        if previous is not None:
            previous(optim)
        state["steps"] += 1

    hook.perinstance_filter = individual_filter
    optimizer.attach_step_hook(hook)
    return DataLoader(data.dataset, batch_sampler=FilteredPoissonSampler(sampler, before_draw),
                      collate_fn=data.collate_fn, generator=data.generator, pin_memory=data.pin_memory,
                      timeout=data.timeout, worker_init_fn=data.worker_init_fn)
