"""The membership attack (loss threshold, per class) on the main run and the non-private run, against the
main run's composed ε per class (docs/audit.md).

Finding 14 (attack accuracy per model and its correlation with the class ε); figure 8, drawn by
membership_inference.py.
"""

import os

from perinstance.audit import membership
from perinstance.experiments.commands import MEMBERSHIP_FIGURE, RES_DIR, Commands
from perinstance.experiments.config import ReproduceConfig


def membership_attack(commands: Commands, config: ReproduceConfig, main_name: str, nodp_name: str, out_dir: str,
                      device: str) -> dict:
    """membership_inference.py on both runs (cached by its command); the summary per model (membership_summary: with
    each model's test accuracy)."""
    eps_csv = os.path.join(RES_DIR, f"{main_name}_compo.csv")
    membership_rows = commands.account("membership_inference.py", ["--run", main_name, "--nondp-run", nodp_name,
                                                                   "--eps-csv", eps_csv, "--figure",
                                                                   os.path.join(out_dir, MEMBERSHIP_FIGURE), "--device", device],
                                       os.path.join(RES_DIR, f"{main_name}_membership.csv"), eps_csv)
    return membership.membership_summary(membership_rows)
