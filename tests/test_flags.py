"""One vocabulary: every flag name has one meaning in every script (issue 11, item 3).

MEANINGS below is the allowed meaning of each flag name: its destination, value type, shape,
default type and a phrase its help must contain. A flag added to a script, or reused with
another meaning, fails here until the table (and docs/flags.md, generated from it and the
parsers) is updated on purpose:

    python tests/test_flags.py > docs/flags.md
"""

import argparse
import importlib.util
import os
import re
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from perinstance.cli.options import Parser, Switch, add_training_args  # noqa: E402
from perinstance.errors import UsageError  # noqa: E402

SCRIPTS = ["train_dpsgd.py", "compute_sensitivity.py", "eps_delta.py", "renyi_per_instance_sum.py",
           "renyi_per_instance_mean.py", "renyi_per_instance_sum_compo.py", "reproduce.py", "audit.py",
           "membership_inference.py", "report.py"]
DOC = os.path.join(ROOT, "docs", "flags.md")
TRAINING = ("train_dpsgd.py", "compute_sensitivity.py")


@dataclass(frozen=True)
class Meaning:
    """What a flag name means wherever it appears. `type`: the argparse type function's name
    (str when none); `nargs` and `action` as argparse has them; `defaults`: the type names its
    default may have; `phrase`: in every help text of the flag; `closed`: its values are a
    fixed set, so every script gives `choices=`."""

    text: str
    dest: str
    phrase: str
    type: str = "str"
    nargs: object = None
    action: str = "store"
    defaults: tuple = ("str",)
    closed: bool = False


FLOAT = ("float",)
INT = ("int",)
NONE = ("NoneType",)
LIST = ("list",)

MEANINGS = {
    # --- the training run (perinstance/cli/options.py add_training_args) -------------------------
    "--dataset": Meaning("the dataset: mnist-embedded, MNIST, FashionMNIST, CIFAR10, synthetic, imagefolder:PATH, "
                         "scatternet:DATASET (fixed ScatterNet features of its images), first:N:DATASET (its first N "
                         "training points), holdout:M:DATASET (its training points but M drawn at random, which "
                         "become the test set), or your own PATH.py:NAME or package.module:NAME (a function returning "
                         "(train, test)) (reproduce.py: replaces the preset's)", "dataset", "imagefolder:PATH",
                         # reproduce.py's None: not given, the preset's dataset is used.
                         defaults=("str", "NoneType")),
    "--data-root": Meaning("where torchvision datasets live, and cache/ with scatternet: features", "data_root",
                           "torchvision datasets"),
    "--model": Meaning("the network: built in, or your own PATH.py:NAME or package.module:NAME (a class or function "
                       "returning an nn.Module)", "model", "PATH.py:NAME", "model_flag"),
    "--loss": Meaning("the per-example loss: cross-entropy on class indices when left out, or your own PATH.py:NAME "
                      "or package.module:NAME (a function of (outputs, targets) returning one loss per example)",
                      "loss", "one loss per example", "loss_flag", defaults=NONE),
    "--norm-type": Meaning("normalisation layers of resnet20", "norm_type", "normalisation", closed=True),
    "--batch-size": Meaning("expected batch size B_exp of training; q = B_exp/N", "batch_size", "B_exp", "int",
                            defaults=INT),
    "--lr": Meaning("learning rate", "lr", "learning rate", "positive_float", defaults=FLOAT),
    "--optimizer": Meaning("optimizer applied to the privatised update", "optimizer", "privatised update",
                           closed=True),
    "--momentum": Meaning("heavy-ball momentum in [0, 1)", "momentum", "momentum", "momentum_float", defaults=FLOAT),
    "--gamma": Meaning("learning-rate decay factor at each --dec-lr epoch", "gamma", "decay factor",
                       "positive_float", defaults=FLOAT),
    "--dec-lr": Meaning("epochs at which the learning rate decays by --gamma", "dec_lr", "learning rate decays",
                        "non_negative_float", nargs="*", defaults=LIST),
    "--epochs": Meaning("training length in epochs; T = round(epochs·N/B_exp)", "epochs", "epochs",
                        "positive_float", defaults=("int", "float")),
    "--dp": Meaning("1: DP-SGD, 0: non-private SGD (the paper repository's spelling of --no-dp)", "dp",
                    "non-private", "int", defaults=INT, closed=True),
    "--no-dp": Meaning("non-private SGD, the same as --dp 0", "dp", "--dp 0", nargs=0, action="store_const",
                       defaults=NONE),
    "--eps": Meaning("target ε of the training guarantee; sigma is calibrated to it", "eps",
                     "target ε of the training guarantee", "positive_float", defaults=NONE),
    "--sigma": Meaning("the noise multiplier sigma: noise std sigma·Γ (sum rule)", "sigma", "noise multiplier sigma",
                       "positive_float", defaults=NONE),
    "--target-delta": Meaning("δ of the training guarantee, the target δ that pairs with --eps", "delta",
                              "δ of the training guarantee", "probability", defaults=FLOAT),
    "--cn": Meaning("clipping norm C", "cn", "clipping norm", "positive_float", defaults=FLOAT),
    "--clipping": Meaning("per-sample transform h: flat clipping, psac or psasc scaling", "clipping",
                          "per-sample transform", closed=True),
    "--scale-r": Meaning("r of psac/psasc", "scale_r", "psac", "positive_float", defaults=NONE),
    "--scale-s": Meaning("s of psasc", "scale_s", "psasc", "positive_float", defaults=NONE),
    "--reduction": Meaning("update rule, sum or mean (compute_sensitivity.py: the rule analysed)", "reduction",
                           "update rule", closed=True),
    "--seed": Meaning("seed of the training run: initialisation, batches and noise", "seed", "seed of the run",
                      "non_negative_int", defaults=INT),
    "--less-point": Meaning("train without this training point", "less_point", "without this training point",
                            "int", defaults=NONE),
    "--save-freq": Meaning("checkpoint every this many steps", "save_freq", "checkpoint every", "int",
                           defaults=NONE),
    "--save-steps": Meaning("checkpoint at these steps too", "save_steps", "checkpoint at these steps", nargs="+",
                            defaults=NONE),
    "--save-name": Meaning("run folder name under --models-dir", "save_name", "<models-dir>/<save-name>",
                           defaults=NONE),
    "--id": Meaning("tag appended to the default run name", "id", "tag", defaults=NONE),
    "--models-dir": Meaning("folder that holds the run folders", "models_dir", "run folders"),
    "--overwrite": Meaning("replace this script's existing output (train_dpsgd.py: the run folder; "
                           "compute_sensitivity.py: the result file; accountants: --out)", "overwrite", "replace",
                           "zero_or_one", nargs="?", action="Switch", defaults=INT),
    "--device": Meaning("torch device: cpu, cuda, cuda:N or auto", "device", "cuda:N", "device_flag"),
    "--eval-freq": Meaning("test accuracy every this many steps", "eval_freq", "test accuracy", "int",
                           defaults=NONE),
    "--track-points": Meaning("points whose ‖h(g)‖ is recorded at every step", "track_points", "every step",
                              nargs="*", defaults=NONE),
    "--total-steps": Meaning("the run's number of steps T, instead of --epochs", "total_steps", "number of steps T",
                             "positive_int", defaults=NONE),
    "--track-every": Meaning("measure the --track-points every K steps, each clipped at its held bound in between "
                             "(§12.4)", "track_every", "every K steps", "positive_int", defaults=NONE),
    "--budget-eps": Meaning("the individual filter: every point's guarantee ε at --target-delta", "budget_eps",
                            "guarantee ε", "positive_float", defaults=NONE),
    "--budgets": Meaning("the individual filter: per-point or per-group budgets, a CSV with columns point and eps",
                         "budgets", "columns point", defaults=NONE),
    "--filter-order": Meaning("the individual filter's Rényi order λ_f, fixed before training", "filter_order",
                              "Rényi order λ_f", "order_float", defaults=NONE),
    "--filter-every": Meaning("the individual filter measures Δ* every K steps, each point clipped at its held bound "
                              "in between (§12.4)", "filter_every", "every K steps", "positive_int", defaults=NONE),
    "--filter-margin": Meaning("m of per-point clipping between measurements: each point clipped at min(Γ, (1 + m)·Δ*)",
                               "filter_margin", "between measurements", "non_negative_float", defaults=NONE),
    "--canaries": Meaning("white-box gradient canaries of the one-run audit: M, each in the run with probability 1/2",
                          "canaries", "white-box gradient canaries", "non_negative_int", defaults=NONE),
    "--canary-norms": Meaning("the canaries' norms as multiples of Γ, one equal group each", "canary_norms",
                              "multiples of the bound Γ", defaults=NONE),
    "--input-canaries": Meaning("crafted input canaries of the one-run audit: M examples through the sampler, "
                                "per-sample gradients and clipping, each in the run with probability 1/2",
                                "input_canaries", "crafted input canaries", "non_negative_int", defaults=NONE),
    # --- several runs (train_dpsgd.py) ---------------------------------------------------------
    "--seeds": Meaning("one training run per seed, instead of --seed", "seeds", "one run per seed", nargs="+",
                       defaults=NONE),
    "--less-points": Meaning("leave-one-out runs: one without each of these points", "less_points",
                             "one run without each", nargs="+", defaults=NONE),
    # --- which run, which points, which checkpoints ---------------------------------------------
    "--run": Meaning("the run: a name in --models-dir, or a run folder", "run", "--models-dir, or a",
                     defaults=NONE),
    "--nondp-run": Meaning("the non-private run compared with --run", "nondp_run", "--no-dp", defaults=NONE),
    "--points": Meaning("training points: indices, ranges 0-99, all, random:N", "points", "random:N", nargs="+",
                        defaults=NONE),
    "--steps": Meaning("the accountants: keep only rows at these steps (as --points)", "steps", "keep only rows at "
                       "these steps", nargs="+", defaults=NONE),
    "--spread": Meaning("N points spanning the range of Δ*, instead of --points", "spread", "spanning", "int",
                        defaults=NONE),
    "--stage": Meaning("checkpoints: fractions of training in [0, 1], initial, middle, final, all "
                       "(membership_inference.py: one, not all)", "stage",
                       "of training in [0, 1]", nargs="+", defaults=LIST),
    # --- the measurement (compute_sensitivity.py) -----------------------------------------------
    "--exp": Meaning("the guarantee the rows are for: eps_delta or renyi", "exp", "Rényi guarantee", closed=True),
    "--estimator": Meaning("mean rule: coupling (accounting.md §3.2) or jensen (GLA's statistic S)", "estimator",
                           "jensen: GLA's statistic", closed=True),
    "--res-name": Meaning("the result file <res-dir>/<res-name>.csv, or .parquet (compute_sensitivity.py: "
                          "above 100,000 rows)", "res_name", "<res-dir>/<res-name>.csv",
                          defaults=NONE),
    "--res-dir": Meaning("folder of the result files", "res_dir", "folder of the result files"),
    "--part-points": Meaning("under torchrun: points per unit of work and part file", "part_points",
                             "under torchrun", "int", defaults=NONE),
    "--mc-seed": Meaning("seed of every Monte-Carlo draw (default: the run's seed)", "mc_seed",
                         "seed of every Monte-Carlo draw", "non_negative_int", defaults=NONE),
    "--num-batches": Meaning("mean rule: Δ_B draws per point (coupling) or sets of α batches per target (jensen)",
                             "num_batches", "Δ_B draws", "int", defaults=NONE),
    "--mc-blocks": Meaning("coupling: independent blocks the draws are split into", "mc_blocks", "blocks", "int",
                           defaults=INT),
    "--size-delta": Meaning("coupling: δ_size, the probability of the batch sizes below k_min left out",
                            "size_delta", "δ_size", "probability", defaults=NONE),
    "--max-sizes": Meaning("coupling: most grid sizes in [k_min, k_hi]", "max_sizes", "grid sizes", "int",
                           defaults=INT),
    "--histogram-precision": Meaning("coupling: Δ_B stored as histograms, each sample rounded up onto the grid "
                                     "Γ·(1+R)^-j (an upper bound)", "histogram_precision", "rounded UP",
                                     "positive_float", defaults=NONE),
    "--alpha": Meaning("Rényi orders α, the output column alpha (compute_sensitivity.py: the one integer order GLA's "
                       "statistic is measured at)", "alpha", "Rényi order", "finite_float", nargs="+",
                       defaults=LIST),
    "--num-iters": Meaning("jensen: target batches B_0", "num_iters", "target batches", "int", defaults=INT),
    "--direction": Meaning("jensen: D(P‖Q) (remove), D(Q‖P) (add) or both", "direction", "D(P||Q)", closed=True),
    "--no-train": Meaning("fail instead of training a run that has no checkpoints", "no_train", "instead of training",
                          nargs=0, action="store_true", defaults=("bool",)),
    # --- the accountants (perinstance/cli/options.py and the four scripts) ------------------------------
    "--res-file": Meaning("the sensitivity CSV read, by path (instead of --res-name)", "res_file", "sensitivity CSV",
                          defaults=NONE),
    "--out": Meaning("the output CSV", "out", "output CSV", defaults=NONE),
    "--filter": Meaning("keep only rows with COLUMN=VALUE (repeatable)", "filter", "keep only rows",
                        action="append", defaults=LIST),
    "--delta": Meaning("δ of the reported guarantee (train_dpsgd.py, compute_sensitivity.py: the paper "
                       "repository's spelling of --target-delta)", "delta", "δ of the reported guarantee",
                       "probability", defaults=FLOAT),
    "--method": Meaning("per-step (ε, δ): exact (§3.3) or GLA's Hölder formula", "method", "Hölder formula",
                        closed=True),
    "--holder-p": Meaning("Hölder exponent p of one step (--method holder only)", "holder_p", "Hölder exponent p",
                          defaults=NONE),
    "--holder-b": Meaning("Hölder exponent b of the composition: a number, inf, or a multiple of T",
                          "holder_b", "Hölder exponent b", defaults=NONE),
    "--gaussian": Meaning("--method holder: the Gaussian mechanism's ε, analytic or classic", "gaussian",
                          "Gaussian mechanism", defaults=NONE, closed=True),
    "--failure": Meaning("mean rule: β, the failure probability of the certified event", "failure",
                         "β of the certified event", "probability", defaults=NONE),
    "--aggregate": Meaning("jensen: joint Monte-Carlo mean or GLA's per-target average (not a bound)", "aggregate",
                           "per-target", closed=True),
    "--rounding": Meaning("sum rule: Δ* rounded up to multiples of ROUNDING·Γ before the RDP or PLD lookup", "rounding",
                          "ROUNDING·Γ", "non_negative_float", defaults=FLOAT),
    "--kind": Meaning("mean rule: compose the certified bound or the Monte-Carlo estimate", "kind", "certified",
                      closed=True),
    "--accountant": Meaning("compose by Rényi DP or by privacy loss distributions (PLD)", "accountant",
                            "privacy loss distributions", closed=True),
    "--pld-interval": Meaning("--accountant pld: discretisation of the privacy loss", "pld_interval",
                              "discretisation of the privacy loss", "positive_float", defaults=FLOAT),
    # --- reproduce.py -------------------------------------------------------------------------------
    "--preset": Meaning("the configuration reproduced", "preset", "configuration", closed=True),
    "--set": Meaning("FIELD=VALUE: replace a field of the preset (repeatable)", "set", "field of the preset",
                     action="append", defaults=LIST),
    # report.py's None: figures/<run>/, named by the run.
    "--out-dir": Meaning("folder of the figures and report.md", "out_dir", "report.md", defaults=("str", "NoneType")),
    "--groups": Meaning("a CSV of columns point and group: the composed ε per group beside the per-class breakdown, "
                        "and each point's group in points.csv", "groups", "columns point and group", defaults=NONE),
    # --- audit.py and membership_inference.py -----------------------------------------------------
    "--rule": Meaning("update rule audited (default: the run's)", "rule", "update rule audited", defaults=NONE,
                      closed=True),
    "--trials": Meaning("simulated steps per point, with x* and as many without it", "trials", "simulated steps",
                        "int", defaults=INT),
    "--statistic": Meaning("the audit's test statistic", "statistic", "the test", closed=True),
    "--one-run": Meaning("audit the canaries of --run, group by group (one-run audit)", "one_run", "canaries of --run",
                         nargs=0, action="store_true", defaults=("bool",)),
    "--in-scores": Meaning("scores of the held-in canaries (higher = member): one number a line, or .npy",
                           "in_scores", "held-in canaries", defaults=NONE),
    "--out-scores": Meaning("scores of the held-out canaries: one number a line, or .npy", "out_scores",
                            "held-out canaries", defaults=NONE),
    "--significance": Meaning("significance level of the one-run lower bounds", "significance", "significance level",
                              "probability", defaults=FLOAT),
    "--self-test": Meaning("train and audit the one-run audit's positive controls (planted faults) and correct runs",
                           "self_test", "positive controls", nargs=0, action="store_true", defaults=("bool",)),
    "--upper-batches": Meaning("mean rule: batches of Δ_B behind the estimate of eps_upper", "upper_batches",
                               "eps_upper", "int", defaults=INT),
    "--figure": Meaning("the output figure", "figure", "figure (default", defaults=NONE),
    "--eps-csv": Meaning("per-instance composed ε of the DP run (renyi_per_instance_sum_compo.py output)", "eps_csv",
                         "composed ε", defaults=NONE),
    "--splits": Meaning("random half/half splits averaged", "splits", "splits", "int", defaults=INT),
}

# Accepted second spellings: alias -> (the flag it spells, the scripts that accept it).
ALIASES = {"--delta": ("--target-delta", TRAINING)}

# How docs/flags.md shows a value's type.
TYPE_TEXT = {"str": "text", "int": "integer", "positive_float": "number > 0", "non_negative_float": "number >= 0",
             "finite_float": "number", "probability": "number in (0, 1)", "momentum_float": "number in [0, 1)",
             "non_negative_int": "integer >= 0", "positive_int": "integer >= 1", "order_float": "number > 1",
             "device_flag": "cpu, cuda, cuda:N or auto",
             "model_flag": "lenet5, resnet20, mlp, linear, PATH.py:NAME or package.module:NAME",
             "loss_flag": "PATH.py:NAME or package.module:NAME"}


# --- reading the parsers ------------------------------------------------------------------------

def load_script(script):
    spec = importlib.util.spec_from_file_location(f"flags_{os.path.splitext(script)[0]}", os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_parsers():
    return {script: load_script(script).build_parser() for script in SCRIPTS}


def flag_actions(parser):
    """The parser's flags (not -h/--help): its argparse actions."""
    return [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]


def describe(action):
    """The properties of a flag that make its meaning, as MEANINGS records them."""
    return {"dest": action.dest, "type": getattr(action.type, "__name__", "str"), "nargs": action.nargs,
            "action": {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_StoreConstAction": "store_const",
                       "_AppendAction": "append"}.get(type(action).__name__, type(action).__name__)}


def meaning_problems(parsers):
    """Every way the parsers disagree with MEANINGS, ALIASES or one another (empty: one vocabulary)."""
    problems = []
    choices_seen = {}
    for script, parser in parsers.items():
        for action in flag_actions(parser):
            flag, *aliases = action.option_strings
            meaning = MEANINGS.get(flag)
            if meaning is None:
                problems.append(f"{script} {flag}: not in MEANINGS (add its one meaning there, and to docs/flags.md)")
                continue
            for alias in aliases:
                spelled, scripts = ALIASES.get(alias, (None, ()))
                if spelled != flag or script not in scripts:
                    problems.append(f"{script} {flag}: alias {alias} is not an accepted spelling of {flag} here")
            found = describe(action)
            for field, value in found.items():
                if value != getattr(meaning, field):
                    problems.append(f"{script} {flag}: {field} {value!r}, but {flag} means {getattr(meaning, field)!r}")
            default_type = type(action.default).__name__
            if default_type not in meaning.defaults:
                problems.append(f"{script} {flag}: default {action.default!r} ({default_type}); {flag}'s default "
                                f"is {' or '.join(meaning.defaults)}")
            if not action.help or meaning.phrase not in action.help:
                problems.append(f"{script} {flag}: help {action.help!r} lacks {meaning.phrase!r}, the phrase of "
                                f"its meaning ({meaning.text})")
            if meaning.closed != (action.choices is not None):
                problems.append(f"{script} {flag}: choices {action.choices!r}, but {flag} is "
                                f"{'a closed' if meaning.closed else 'an open'} set")
            if action.choices is not None:
                choices_seen.setdefault(flag, {})[script] = tuple(action.choices)
    for flag, by_script in choices_seen.items():
        if len(set(by_script.values())) > 1:
            problems.append(f"{flag}: different choices in {by_script}")
    for alias, (flag, scripts) in ALIASES.items():
        for script in scripts:
            spellings = [action.option_strings for action in flag_actions(parsers[script])]
            if [flag, alias] not in spellings:
                problems.append(f"{script}: ALIASES says {alias} spells {flag}, but the parser has no such alias")
    return problems


# --- docs/flags.md ---------------------------------------------------------------------------

def value_text(action):
    if isinstance(action, Switch):
        return "switch (or 0/1)"
    if action.nargs == 0:
        return "switch"
    kind = ", ".join(map(str, action.choices)) if action.choices is not None else \
        TYPE_TEXT.get(getattr(action.type, "__name__", "str"), "?")
    shape = {"+": "one or more: ", "*": "zero or more: "}.get(action.nargs, "")
    return shape + kind + (" (repeatable)" if describe(action)["action"] == "append" else "")


def default_text(value):
    if value is None:
        return "none"
    if isinstance(value, list):
        if not value:
            return "none"
        if len(value) > 4:
            return f"{value[0]:g} … {value[-1]:g} ({len(value)} values)"
        return " ".join(default_text(item) for item in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# Where a parser's default is None the value is decided later ("3T for the sum rule ...", "the run's seed"), and the
# help states it: "(default X)", "(default: X)" or "(WHAT, default X; ...)".
STATED_DEFAULT = re.compile(r"(?:\(|;\s|,\s)(?:(?P<qualifier>[\w-]+),\s)?default:?\s+(?P<value>(?:[^;()]|\([^()]*\))+)")


def stated_default(action):
    """The default a flag's help states ("" when it states none), each with what it is for where it says."""
    return "; ".join(match["value"].strip() + (f" ({match['qualifier']})" if match["qualifier"] else "")
                     for match in STATED_DEFAULT.finditer(action.help or ""))


def effective_default(action):
    """docs/flags.md's default of an action: the parser's, or where that is None the one its help states."""
    if action.nargs in (0, "?"):
        return "off"
    if action.default is None or action.default == []:
        return stated_default(action) or "none"
    return default_text(action.default)


def table_rows(parsers):
    """One row per flag name: (flag, aliases, meaning, value, default, scripts), sorted by flag."""
    uses = {}
    for script, parser in parsers.items():
        for action in flag_actions(parser):
            uses.setdefault(action.option_strings[0], []).append((script, action))
    rows = []
    for flag in sorted(uses):
        scripts = [script for script, _ in uses[flag]]
        actions = [action for _, action in uses[flag]]
        aliases = sorted({alias for action in actions for alias in action.option_strings[1:]})
        defaults = {script: effective_default(action) for script, action in uses[flag]}
        # The most common default, then the scripts that differ from it.
        usual = max(defaults.values(), key=list(defaults.values()).count)
        default = "; ".join([usual] + [f"{script}: {text}" for script, text in defaults.items() if text != usual])
        alias_text = ", ".join(f"`{alias}` ({', '.join(ALIASES[alias][1])})" for alias in aliases)
        meaning = MEANINGS[flag].text if flag in MEANINGS else "?"
        rows.append((f"`{flag}`", alias_text, meaning, value_text(actions[0]), default, ", ".join(scripts)))
    return rows


def flag_table(parsers=None):
    """The text of docs/flags.md."""
    parsers = script_parsers() if parsers is None else parsers
    lines = ["# Flags of every script",
             "",
             "Every flag name has one meaning in every script that takes it. The table is generated from",
             "the scripts' parsers and the meaning table of `tests/test_flags.py`, which fails when a",
             "parser, that table and this file disagree; regenerate it with",
             "`python tests/test_flags.py > docs/flags.md`.",
             "",
             "Words kept apart on purpose: `--target-delta` is the δ a run is trained for (with `--eps`),",
             "`--delta` the δ of a reported guarantee; `--holder-p` is Hölder's p of one step (`eps_delta.py",
             "--method holder`), `--holder-b` Hölder's b of the composition; `--seed` seeds a training run,",
             "`--mc-seed` the Monte-Carlo draws of a measurement, audit or attack; `--alpha` is always a list",
             "of Rényi orders (output column `alpha`). Switches (`--overwrite`, `--no-dp`, `--no-train`) take",
             "no value; the paper repository's `--overwrite 1`, `--dp 0` and `--delta` (in `train_dpsgd.py`",
             "and `compute_sensitivity.py`) are accepted spellings. Every script's `--help` starts with",
             "example commands.",
             "",
             "| flag | also accepted | meaning | value | default | scripts |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in table_rows(parsers):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines + USER_CODE_SECTION) + "\n"


# What --model, --dataset and --loss specs receive and must return (perinstance/train/user_code.py; tests/test_user_code.py
# checks each sentence).
USER_CODE_SECTION = [
    "",
    "## Your own model, data and loss: `--model`, `--dataset` and `--loss` specs",
    "",
    "`--model PATH.py:NAME` or `--model package.module:NAME` (a module importable from the current",
    "folder or `PYTHONPATH`) names a class or a function that returns a `torch.nn.Module`. It is called",
    "with keyword arguments, each only when its signature names it: `num_classes` (the largest integer",
    "target of the data + 1; for floating targets, the number of values in one target, 1 for a scalar)",
    "and `input_shape` (one input's shape without the batch dimension, a tuple)",
    "always; `in_channels` and `image_size` (C and H) when one input is C×H×W. A parameter without a",
    "default that is none of these is an error. Under DP a layer that mixes the examples of a batch",
    "(BatchNorm, Opacus's ModuleValidator refuses it) is refused: use `nn.GroupNorm`; so is a `GRU`,",
    "`LSTM` or `RNN` (use `opacus.layers.DPGRU`, `DPLSTM`, `DPRNN`). Trainable layers the fast norms",
    "engine does not cover (anything but `Linear` on batch-first inputs, `Conv1d`, `Conv2d`, `GroupNorm`,",
    "`LayerNorm`, `RMSNorm`, `Embedding` and self-attention, docs/sensitivity.md) get their per-sample",
    "gradients from torch.func, layer by layer (the list is printed once). Per-sample gradients are taken",
    "in eval mode (dropout off). An exception raised in the model's own code (its forward) ends in one",
    "line naming the flag, the spec, the exception and the file:line of the model's code.",
    "",
    "`--dataset PATH.py:NAME` or `package.module:NAME` names a function returning `(train, test)`,",
    "each a `torch.utils.data.Dataset` of `(input, label)` pairs or a pair `(inputs, labels)` of",
    "tensors or arrays; it is called with `data_root` (the `--data-root` flag) when its signature",
    "names it, with torch's, numpy's and Python's global generators seeded to 0 (restored after), so",
    "random data is the same in every process. Under the default loss the labels are class indices",
    "0, 1, ... (whole numbers, stored int64); with `--loss` they are the targets as given, any shape per",
    "point (floating ones become float32, integer ones int64). Floating inputs become float32, integer",
    "inputs (token ids) stay integers. `first:N:SPEC` takes its first N points.",
    "",
    "`--loss PATH.py:NAME` or `package.module:NAME` names the per-example loss that training, the",
    "tracked points, every measurement of `compute_sensitivity.py` and `audit.py` differentiate, in",
    "place of the cross-entropy on class indices: a function, or a callable object defined in the file",
    "(e.g. `loss = nn.CrossEntropyLoss(reduction=\"none\", label_smoothing=0.1)`), of",
    "`(outputs, targets)` for a batch, returning one loss per example, shape (n,), or (n, ...) that is",
    "summed per example (a token-level loss with `reduction=\"none\"`: one sum over the tokens). It is",
    "the Python API's `loss_fn`. It is tried on two examples before anything is written: a class, an",
    "object that is not callable, an exception, a scalar or an integer result is a one-line error",
    "naming `--loss`, as is an exception it raises later in the run (with its file:line). Where the",
    "outputs are not logits (n, classes) with one class index per point as target, correctness is not",
    "defined: the summary prints the test loss instead of a test accuracy, and the `label`, `correct`",
    "and `accuracy` columns of the result files are empty. The membership attack is per class and",
    "refuses such runs; `--input-canaries` (crafted examples with random class labels) is refused with",
    "`--loss`.",
    "",
    '**Values that are not finite.** A model whose output, a loss whose value, or either whose gradient is NaN or',
    '±inf for some example (or a dataset with such an input or label) is refused in one line that names the flag and',
    'spec, which value it is, the example and the step: training (the batches, the tracked points, the test set),',
    '`compute_sensitivity.py` and `audit.py` (the checkpoint and the point) alike. For a gradient whose output and loss',
    "are finite, the line says whether the loss's gradient in the outputs or the backward through the model made it.",
    "A new run stopped this way leaves no file (its files could not be resumed once the code is fixed: the file's",
    'sha256 would differ); a resumed one keeps the checkpoints it had. Training reads nothing more back per step:',
    "each step's per-sample losses, gradient norms and output checks stay on the device until the batch losses are",
    "read (every 16 steps and at every checkpoint). Where the suite's own network and loss make the value (weights",
    'grown too large), or the weights themselves stop being finite, the run stops as "training diverged", naming',
    '`--lr`.',
    "",
    "`run.json` records each spec with the path and sha256 of its file (`user_code`), and the loss's",
    "spec (`loss`, left out for the default). Resuming a run after its model, data or loss file",
    "changed, or measuring one (`compute_sensitivity.py --run`) after its model or loss file or its",
    "data changed, is a one-line error naming the file and the flag: restore it, or train a",
    "new run (`--overwrite`, another `--save-name` or `--id`). The default run name holds the file's",
    "name and the spec's hash.",
]


def doc_flags():
    """{flag: (aliases, scripts)} as docs/flags.md lists them."""
    listed = {}
    with open(DOC, encoding="utf-8") as handle:
        for line in handle:
            if not line.startswith("| `--"):
                continue
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            aliases = {part.split("`")[1] for part in cells[1].split("), ") if "`" in part}
            listed[cells[0].strip("`")] = (aliases, {script.strip() for script in cells[-1].split(",")})
    return listed


# --- the tests ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parsers():
    return script_parsers()


def test_every_flag_name_has_one_meaning(parsers):
    assert meaning_problems(parsers) == []


def test_every_meaning_is_used(parsers):
    used = {action.option_strings[0] for parser in parsers.values() for action in flag_actions(parser)}
    assert sorted(set(MEANINGS) - used) == []


def _clashing_parsers(parsers, define):
    """The real parsers, with eps_delta.py's replaced by one that `define`s its flags."""
    parser = Parser()
    define(parser)
    return {**parsers, "eps_delta.py": parser}


@pytest.mark.parametrize("define, expected", [
    # --delta reused for the training δ: another destination, another help.
    (lambda parser: parser.add_argument("--delta", dest="target_delta", type=float, default=1e-5,
                                        help="δ of the training guarantee"), ["dest", "help", "type"]),
    # --alpha as one number instead of a list of orders.
    (lambda parser: parser.add_argument("--alpha", type=float, default=8.0, help="Rényi order"),
     ["type", "nargs", "default"]),
    # --overwrite back to an integer flag; --model as any text, without its check of the value.
    (lambda parser: parser.add_argument("--overwrite", type=int, default=0, choices=(0, 1), help="replace"),
     ["type", "nargs", "action", "choices"]),
    (lambda parser: parser.add_argument("--model", default="lenet5", help="the network"), ["type"]),
    # A new flag that MEANINGS does not know.
    (lambda parser: parser.add_argument("--noise", type=float, help="σ"), ["not in MEANINGS"]),
    # --delta accepted as an alias where ALIASES does not allow it.
    (lambda parser: parser.add_argument("--target-delta", "--delta", dest="delta", type=float, default=1e-5,
                                        help="δ of the training guarantee"), ["alias"]),
])
def test_a_second_meaning_is_caught(parsers, define, expected):
    problems = [problem for problem in meaning_problems(_clashing_parsers(parsers, define))
                if problem.startswith("eps_delta.py")]
    text = "\n".join(problems)
    assert problems, "the clash went unnoticed"
    for word in expected:
        assert word in text, (word, text)


def test_different_choices_for_one_flag_are_caught(parsers):
    clash = _clashing_parsers(parsers, lambda parser: parser.add_argument(
        "--optimizer", default="sgd", choices=("sgd", "lamb"), help="the optimizer applied to the privatised update"))
    assert any(problem.startswith("--optimizer: different choices") for problem in meaning_problems(clash))


def test_docs_list_exactly_the_parsers_flags(parsers):
    listed = doc_flags()
    used = {}
    for script, parser in parsers.items():
        for action in flag_actions(parser):
            aliases, scripts = used.setdefault(action.option_strings[0], (set(), set()))
            aliases.update(action.option_strings[1:])
            scripts.add(script)
    assert sorted(set(listed) - set(used)) == [], "docs/flags.md lists flags that no script has"
    assert sorted(set(used) - set(listed)) == [], "flags missing from docs/flags.md"
    for flag, (aliases, scripts) in used.items():
        assert listed[flag] == (aliases, scripts), (flag, listed[flag], (aliases, scripts))


def test_docs_are_generated_from_the_parsers(parsers):
    with open(DOC, encoding="utf-8") as handle:
        assert handle.read() == flag_table(parsers), "docs/flags.md is stale: python tests/test_flags.py > docs/flags.md"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_starts_with_example_commands(parsers, script):
    text = parsers[script].format_help()
    assert f"python {script} " in text
    # The formatter keeps the docstring's line breaks, so each example is one line.
    example = next(line for line in text.splitlines() if f"python {script} " in line)
    assert example.startswith("    ")


# --- the switches and the aliases, parsed -----------------------------------------------------------

def training_parser():
    parser = Parser()
    add_training_args(parser)
    return parser


@pytest.mark.parametrize("argv, overwrite", [([], 0), (["--overwrite"], 1), (["--overwrite", "1"], 1),
                                             (["--overwrite", "0"], 0), (["--overwrite", "--seed", "3"], 1)])
def test_overwrite_is_a_switch_that_takes_the_papers_0_and_1(argv, overwrite):
    args = training_parser().parse_args(argv)
    # An int, as `type=int` stored it before: run.json and the run identity do not change.
    assert type(args.overwrite) is int and args.overwrite == overwrite


@pytest.mark.parametrize("argv, dp", [([], 1), (["--no-dp"], 0), (["--dp", "0"], 0), (["--dp", "1"], 1)])
def test_no_dp_and_the_papers_dp_0(argv, dp):
    args = training_parser().parse_args(argv)
    assert type(args.dp) is int and args.dp == dp


@pytest.mark.parametrize("flag", ["--target-delta", "--delta"])
def test_training_delta_keeps_its_run_json_key(flag):
    args = training_parser().parse_args([flag, "1e-3"])
    assert vars(args)["delta"] == 1e-3 and "target_delta" not in vars(args)


@pytest.mark.parametrize("argv, flag", [(["--overwrite", "2"], "--overwrite"), (["--dp", "2"], "--dp"),
                                        (["--model", "vgg"], "--model"), (["--device", "gpu"], "--device"),
                                        (["--device", "cuda:x"], "--device"), (["--delta", "1"], "--delta")])
def test_bad_values_are_one_line_naming_the_flag(argv, flag):
    with pytest.raises(UsageError) as error:
        training_parser().parse_args(argv)
    assert flag in str(error.value) and "\n" not in str(error.value)


def test_device_accepts_cuda_n_without_a_gpu_check_at_parse_time():
    assert training_parser().parse_args(["--device", "CUDA:3"]).device == "cuda:3"


@pytest.mark.parametrize("orders, expected", [(["4"], 4), (["2", "4"], None), (["2.5"], None)])
def test_jensen_measures_at_one_integer_order(parsers, orders, expected):
    from perinstance.cli import sensitivity

    argv = ["--exp", "renyi", "--estimator", "jensen", "--points", "0", "--res-name", "x", "--alpha", *orders]
    args = parsers["compute_sensitivity.py"].parse_args(argv)
    if expected is None:
        with pytest.raises(UsageError) as error:
            sensitivity.parse_request(vars(args), sensitivity.given_flags(argv))
        assert error.value.flag == "--alpha"
    else:
        assert sensitivity.parse_request(vars(args), sensitivity.given_flags(argv)).alpha == expected


if __name__ == "__main__":
    sys.stdout.write(flag_table())
