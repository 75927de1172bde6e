"""The non-private run: the main run's configuration trained without DP (its own learning rate, nodp_lr), the
reference model of the membership attack (membership.py).

No finding or figure of its own: finding 14 and figure 8 compare it with the main run.
"""

import dataclasses

from perinstance.experiments.commands import Commands
from perinstance.experiments.config import NODP_RUN_FIELDS, ReproduceConfig, training_flags, variant_tag


def train_nonprivate(commands: Commands, config: ReproduceConfig, preset: str, name: str, device: str) -> str:
    """Train the non-private run (skipped by train_dpsgd.py when it is there already); its name."""
    nodp_name = f"{name}{variant_tag(config, preset, NODP_RUN_FIELDS)}-nodp"
    nodp = dataclasses.replace(config, lr=config.nodp_lr, save_steps="")
    commands.run("train_dpsgd.py", [*training_flags(nodp, device), "--no-dp", "--save-name", nodp_name])
    return nodp_name
