"""Loss-threshold membership inference per class, on a DP run and a non-private run (Yu et al., Appendix D).

    python membership_inference.py --run quick-mnist-embedded-sum --nondp-run quick-mnist-embedded-nodp \
        --eps-csv res/quick-mnist-embedded-sum_compo_inf.csv

Per class, the attack of Sablayrolles et al. 2019 ("member" when the loss is below a threshold)
sees the class's test points and as many of its training points; the threshold is chosen on a
random half of each and its balanced accuracy measured on the other half, over --splits random
splits. Next to it: the class's test accuracy, and the mean per-instance composed ε of the class's
training points under DP (column eps of a renyi_per_instance_sum_compo.py output, --eps-csv).
The Pearson r across classes says whether the classes that pay more ε are the ones the attack
succeeds on more often.
"""

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from perinstance.audit import membership
from perinstance.cli import options
from perinstance.cli.options import HELP_FORMAT, Parser, add_device_argument, non_negative_int
from perinstance.errors import UsageError
from perinstance.files import fileio
from perinstance.plots import audit_plots
from perinstance.train import runs

COLUMNS = ["model", "class", "class_name", "members", "nonmembers", "attack_accuracy", "attack_advantage",
           "accuracy_std", "test_accuracy", "mean_eps", "splits", "step", "run"]


@dataclass(frozen=True)
class MembershipRequest:
    run: str
    nondp_run: str
    eps_csv: str
    models_dir: str
    data_root: str
    stage: str | float  # a stage name or a fraction (options.parse_stages)
    splits: int
    mc_seed: int | None
    out: str | None
    figure: str | None
    device: str


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    parser.add_argument("--run", required=True, help="the DP run: a name under --models-dir, or a run folder")
    parser.add_argument("--nondp-run", required=True,
                        help="the same configuration trained with --no-dp: a name under --models-dir, or a folder")
    parser.add_argument("--eps-csv", required=True,
                        help="per-instance composed ε of the DP run (renyi_per_instance_sum_compo.py output)")
    parser.add_argument("--models-dir", default="models", help="folder that holds the run folders")
    parser.add_argument("--data-root", default="./data", help="where torchvision datasets live")
    parser.add_argument("--stage", nargs="+", default=["final"],
                        help="checkpoint of each run attacked, one: a fraction of training in [0, 1], initial, "
                             "middle or final (default)")
    parser.add_argument("--splits", type=int, default=20, help="random half/half splits averaged (default 20)")
    parser.add_argument("--mc-seed", type=non_negative_int, default=None,
                        help="seed of every Monte-Carlo draw: the members drawn and the splits (default: the DP "
                             "run's seed)")
    parser.add_argument("--out", default=None, help="output CSV (default res/<run>_membership.csv)")
    parser.add_argument("--figure", default=None, help="figure (default figures/<run>_membership.png)")
    add_device_argument(parser)
    return parser


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> MembershipRequest:
    args = build_parser(prog).parse_args(argv)
    if args.splits <= 0:
        raise UsageError("--splits", f"must be > 0, got {args.splits}")
    stages = options.parse_stages(args.stage)
    if len(stages) != 1 or stages == ["all"]:
        raise UsageError("--stage", "give one checkpoint: a fraction, initial, middle or final (not all)")
    if not os.path.isfile(args.eps_csv):
        raise UsageError("--eps-csv", f"no file {args.eps_csv} (renyi_per_instance_sum_compo.py writes it)")
    return MembershipRequest(run=args.run, nondp_run=args.nondp_run, eps_csv=args.eps_csv, models_dir=args.models_dir,
                   data_root=args.data_root, stage=stages[0], splits=args.splits, mc_seed=args.mc_seed, out=args.out,
                   figure=args.figure, device=args.device)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    request = parse_args(argv, prog)
    opened, differing = membership.open_pair(request.run, request.nondp_run, request.models_dir, request.data_root)
    private = opened["DP"]
    labels = private.dataset.train_y.numpy()
    class_eps, class_eps_delta = membership.class_mean_eps(request.eps_csv, labels, private.config.total_steps)
    out = request.out or os.path.join("res", f"{private.name}_membership.csv")
    figure = request.figure or os.path.join("figures", f"{private.name}_membership.png")
    for flag, path in (("--out", out), ("--figure", figure)):  # their missing folders are created with them
        fileio.check_output(path, flag)
    started = time.time()
    seed = private.config.seed if request.mc_seed is None else request.mc_seed
    members = membership.class_members(labels, private.dataset.test_y.numpy(), private.dataset.num_classes, seed)
    frames = []
    for model, run in opened.items():
        step = runs.resolve_stages([request.stage], run.saved_steps(), run.config.total_steps)[0]
        frame = membership.attack_by_class(run, step, members, request.splits, seed, request.device)
        frames.append(frame.assign(model=model, step=step, run=run.name, splits=request.splits,
                                   class_name=[private.dataset.class_names[label] for label in frame["class"]],
                                   mean_eps=frame["class"].map(class_eps)))
    rows = pd.concat(frames, ignore_index=True)[COLUMNS]
    fileio.write_csv(out, rows)
    by_model = {model: rows[rows["model"] == model] for model in opened}
    summaries = membership.membership_summary(rows)
    audit_plots.plot_class_attack(
        by_model["DP"]["class_name"].tolist(), by_model["DP"]["mean_eps"].to_numpy(),
        {model: frame["attack_accuracy"].to_numpy() for model, frame in by_model.items()},
        {model: frame["accuracy_std"].to_numpy() for model, frame in by_model.items()},
        {model: frame["test_accuracy"].to_numpy() for model, frame in by_model.items()}, figure,
        delta=class_eps_delta, descriptions={
            model: f"lr {run.config.lr:g}, test accuracy {summaries[model]['test_accuracy']:.3f}"
            for model, run in opened.items()})

    print(rows.drop(columns=["run", "splits"]).to_string(index=False, float_format=lambda value: f"{value:.4g}"),
          end="\n\n")
    if differing:
        print(f"note: the two runs differ in {', '.join(differing)} besides privacy; the comparison is not "
              "of the same configuration")
    for model, summary in summaries.items():
        print(f"{model:>12}: mean attack accuracy {summary['mean_attack_accuracy']:.4f}, Pearson r across "
              f"{summary['classes']} classes with the class's mean ε: attack accuracy {summary['pearson_attack']:.3f}, "
              f"test accuracy {summary['pearson_test']:.3f}")
    print(f"attacked {len(opened)} runs in {time.time() - started:.0f}s; wrote {out} and {figure}")

