"""GLA's statistic S per point, step and order (renyi_per_instance_mean.py --estimator jensen;
docs/accounting.md §3.2), kept to reproduce the paper: not the mean rule's guarantee (that is
perinstance/analysis/mean_rule.py).
"""

import math

import pandas as pd
from numpy.typing import ArrayLike

from perinstance.accounting import renyi_step
from perinstance.accounting.guarantees import Direction, Kind
from perinstance.analysis.reading import Loaded, check_unique, check_values
from perinstance.console import warn
from perinstance.errors import UsageError

AGGREGATE_LABEL = {"joint": "joint", "per-target": "per-target (not an upper bound)"}


def gla_statistic_rdp(loaded: Loaded, orders: ArrayLike, aggregate: str) -> tuple[pd.DataFrame, str]:
    """renyi_per_instance_mean.py --estimator jensen: GLA's statistic ρ̂_J per point, step, order and
    direction (§3.2, kept to reproduce the paper): (rows, description)."""
    keys = ["point", "step", "alpha"]
    check_values(loaded, ~loaded.rows["direction"].isin([Direction.REMOVE.value, Direction.ADD.value]),
                 lambda row: f"direction {row['direction']!r} is neither remove nor add")
    check_unique(loaded, keys + ["direction", "target_batch", "sample"])
    rows = loaded.rows
    missing = sorted(set(orders) - set(rows["alpha"]))
    if missing:
        raise UsageError("--alpha", f"no renyi_statistic rows at order {missing[0]:g} (measured: "
                         f"{', '.join(str(order) for order in sorted(rows['alpha'].unique()))})")
    rows = rows[rows["alpha"].isin(orders)]
    by_direction = keys + ["direction"]

    def one(group):
        alpha = dict(zip(by_direction, group.name, strict=True))["alpha"]
        return renyi_step.rdp_mean_rule(group["value"].to_numpy(), loaded.mechanism.noise_std, alpha, aggregate,
                                        group["target_batch"].to_numpy())

    per_direction = rows.groupby(by_direction).apply(one, include_groups=False).rename("rdp").reset_index()
    both = per_direction.groupby(keys).filter(lambda group: len(group) == 2)
    maximum = both.groupby(keys, as_index=False)["rdp"].max().assign(direction=Direction.MAX.value)
    result = pd.concat([per_direction, maximum], ignore_index=True).assign(
        kind=Kind.GLA_STATISTIC.value, rdp_min=math.nan, rdp_max=math.nan,
        samples=rows.groupby(by_direction).size().median(), k_min=math.nan, k_star=math.nan, k_star_at_k_min=0,
        delta_fail=math.nan, estimator=f"jensen {AGGREGATE_LABEL[aggregate]}")
    if aggregate == "per-target":
        warn("--aggregate per-target averages per-target-batch values (GLA's way): by Jensen it is never above the "
             "joint estimate and is NOT an upper bound")
    if Direction.MAX not in set(result["direction"]):
        warn("only one direction was measured: no max over directions is reported")
    return result, (f"GLA's statistic for {rows['point'].nunique()} points (mean rule, noise std "
                    f"{loaded.mechanism.noise_std:.4g}, aggregate {AGGREGATE_LABEL[aggregate]}): not a measure of the "
                    "point's influence and not the mean rule's guarantee (accounting.md §3.2)")
