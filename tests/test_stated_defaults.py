"""One default per flag: what docs/accountants.md, docs/commands.md and docs/api.md say a flag's default is, is
the default docs/flags.md gives (the parser's, or the one its help states where the parser's is None:
tests/test_flags.py effective_default); what docs/api.md's signatures give as a default is the function's own.

Every sentence of those pages that says "default" is either one of STATEMENTS below (page, the words with the
value, the flag and the scripts it is about), each read back and compared, or one of NOT_A_FLAG_DEFAULT. A new
sentence about a default fails here until it is listed, so none goes unchecked."""

import inspect
import math
import os
import re

import pytest
from conftest import ROOT
from test_flags import effective_default, flag_actions, script_parsers

from perinstance import api
from perinstance.api import DEFAULT_ORDERS, CanaryScoreAuditor, IndividualAccountant, IndividualFilter

ACCOUNTANTS = ("eps_delta.py", "renyi_per_instance_sum.py", "renyi_per_instance_mean.py",
               "renyi_per_instance_sum_compo.py")
COMPOSE = ("renyi_per_instance_sum_compo.py",)
TRAINING = ("train_dpsgd.py", "compute_sensitivity.py")
ACCOUNTANTS_MD, COMMANDS_MD, API_MD = (os.path.join("docs", name) for name in ("accountants.md", "commands.md",
                                                                                "api.md"))

# (page, a regular expression whose group `value` is the stated default, flag, scripts[, the case it is about])
STATEMENTS = [
    (ACCOUNTANTS_MD, r"`--res-dir`\s+defaults to `(?P<value>[^`]+)`", "--res-dir", ACCOUNTANTS),
    (ACCOUNTANTS_MD, r"`--out PATH` \(always CSV\): default `(?P<value>[^`]+)`", "--out", ACCOUNTANTS),
    (ACCOUNTANTS_MD, r"The per-step scripts default to (?P<value>\d+)\.", "--alpha",
     ("renyi_per_instance_sum.py", "renyi_per_instance_mean.py")),
    (ACCOUNTANTS_MD, r"The composition defaults to (?P<value>\d+\s+orders from [\d.]+ to \d+)", "--alpha", COMPOSE),
    (ACCOUNTANTS_MD, r"`--delta` \(`eps_delta.py` and the composition; default (?P<value>[^)]+)\)", "--delta",
     ("eps_delta.py", "renyi_per_instance_sum_compo.py")),
    (ACCOUNTANTS_MD, r"`(?P<value>exact)` \(default\)", "--method", ("eps_delta.py",)),
    (ACCOUNTANTS_MD, r"or a multiple of T such as `3T`; default (?P<value>[\de]+), as in the paper", "--holder-p",
     ("eps_delta.py",)),
    (ACCOUNTANTS_MD, r"picks the Gaussian mechanism's ε_G: (?P<value>analytic) \(Balle & Wang 2018\), the default",
     "--gaussian", ("eps_delta.py",)),
    (ACCOUNTANTS_MD, r"The sum rule by Rényi DP defaults to `(?P<value>[^`]+)`", "--holder-b", COMPOSE, "sum rule"),
    (ACCOUNTANTS_MD, r"The mean rule and `--accountant pld` take `(?P<value>\w+)` only,\s+their default", "--holder-b",
     COMPOSE, "mean rule"),
    (ACCOUNTANTS_MD, r"`(?P<value>coupling)` \(default\)", "--estimator", ("renyi_per_instance_mean.py",)),
    (ACCOUNTANTS_MD, r"picks the (?P<value>joint) Monte-Carlo mean \(default\)", "--aggregate",
     ("renyi_per_instance_mean.py",)),
    (ACCOUNTANTS_MD, r"which per-step ρ to compose; default\s+`(?P<value>[^`]+)`", "--kind", COMPOSE),
    (ACCOUNTANTS_MD, r"certified event\. Default: (?P<value>δ_size)", "--failure",
     ("eps_delta.py", "renyi_per_instance_mean.py", "renyi_per_instance_sum_compo.py")),
    (ACCOUNTANTS_MD, r"multiple of R·Γ; default (?P<value>[\d.]+)", "--rounding", COMPOSE),
    (ACCOUNTANTS_MD, r"`(?P<value>rdp)` \(default\) composes", "--accountant", COMPOSE),
    (ACCOUNTANTS_MD, r"`(?P<value>rdp)` stays the default", "--accountant", COMPOSE),
    (ACCOUNTANTS_MD, r"the discretisation of the privacy loss, default\s+(?P<value>[\de.-]+)", "--pld-interval",
     COMPOSE),
    (COMMANDS_MD, r"`--dataset` \(`(?P<value>[^`]+)` default", "--dataset", TRAINING),
    (COMMANDS_MD, r"sigma calibrated by Opacus, default (?P<value>\d+)", "--eps", TRAINING),
    (COMMANDS_MD, r"`--res-name` in `--res-dir` \(default `(?P<value>[^`]+)`\)", "--res-dir",
     ("compute_sensitivity.py",)),
    (COMMANDS_MD, r"`--res-name` \(in `--res-dir`, default `(?P<value>[^`]+)`\)", "--res-dir", ACCOUNTANTS),
    (COMMANDS_MD, r"- `(?P<value>mnist-embedded)` \(the default everywhere\)", "--dataset", TRAINING),
    (COMMANDS_MD, r"to `--out-dir` \(default `(?P<value>[^`]+)`\)", "--out-dir", ("report.py",)),
    (COMMANDS_MD, r"`--filter-order λ` \(default: (?P<value>of the orders 1\.25\.\.64, the one at which uniform DP-SGD[^,]+),",
     "--filter-order", TRAINING),
    (COMMANDS_MD, r"`--filter-every K` \(default (?P<value>\d+)\)", "--filter-every", TRAINING),
    (COMMANDS_MD, r"`--filter-margin m`\s+\(default (?P<value>[\d.]+) when K > 1\)", "--filter-margin", TRAINING),
    (API_MD, r"the scripts' default `(?P<value>[^`]+)`\s+for the sum rule", "--holder-b", COMPOSE, "sum rule"),
    (API_MD, r"(?P<value>[\d.]+) is the scripts' `--rounding` default", "--rounding", COMPOSE),
]
# (page, a regular expression whose group `value` is a default of the Python API, the callable, its parameter)
API_STATEMENTS = [
    (ACCOUNTANTS_MD, r"`get_epsilon\(holder_b=(?P<value>[^)]+)\)` defaults to", "get_epsilon", "holder_b"),
    (API_MD, r"`holder_b=(?P<value>math\.inf)` composes along this one observed trajectory \(Yu et al.'s individual"
             r"\s+accounting; §4 with one run\), the default here", "get_epsilon", "holder_b"),
]
# Sentences with the word that state no default value of a flag or of the API.
NOT_A_FLAG_DEFAULT = {
    ACCOUNTANTS_MD: ["reproduces the ε of Opacus's default"],
    COMMANDS_MD: ["(the default\n`--save-name` is built from them)", "its one meaning, type, default and accepted"],
    API_MD: ["together with Opacus's default orders", "(default: all)"],
}


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


def prose(path):
    """The page without its code blocks, each line as one with its neighbours (a sentence may wrap)."""
    return re.sub(r"```.*?```", "", read(path), flags=re.S)


def numbers_in(text):
    return sorted(float(number) for number in re.findall(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", text))


def agrees(stated, effective, case=None):
    """A stated default agrees with the effective one: the same number, the same words at its start, or the same
    numbers (a grid "47 orders from 1.25 to 256" against "1.25 … 256 (47 values)"). `case`: the statement is about
    the part of a default that names it ("3T for the sum rule by Rényi DP, inf for the mean rule ...")."""
    # A statement may wrap across lines of its page.
    stated, effective = " ".join(stated.strip().strip("`").lower().split()), effective.strip().lower()
    if case is not None:
        return any(part.startswith(stated) for part in re.split(r"[;,]\s+", effective) if case in part)
    try:
        return math.isclose(float(stated), float(effective), rel_tol=1e-12)
    except ValueError:
        pass
    return effective.startswith(stated) or (bool(numbers_in(stated)) and numbers_in(stated) == numbers_in(effective))


@pytest.fixture(scope="module")
def parsers():
    return script_parsers()


def flag_default(parsers, script, flag):
    action = next(action for action in flag_actions(parsers[script]) if flag in action.option_strings)
    return effective_default(action)


@pytest.mark.parametrize("page, pattern, flag, scripts, case", [(*entry, None)[:5] for entry in STATEMENTS])
def test_a_stated_default_is_the_flags_default(parsers, page, pattern, flag, scripts, case):
    found = list(re.finditer(pattern, prose(page)))
    assert len(found) == 1, f"{page}: {pattern!r} found {len(found)} times (the statement moved: update STATEMENTS)"
    stated = found[0]["value"]
    for script in scripts:
        assert agrees(stated, flag_default(parsers, script, flag), case), (page, flag, script, stated)


@pytest.mark.parametrize("page", [ACCOUNTANTS_MD, COMMANDS_MD, API_MD])
def test_every_sentence_about_a_default_is_checked(page):
    text = prose(page)
    covered = [match.span() for pattern in [entry[1] for entry in STATEMENTS + API_STATEMENTS if entry[0] == page]
               for match in re.finditer(pattern, text)]
    covered += [(text.index(words), text.index(words) + len(words)) for words in NOT_A_FLAG_DEFAULT[page]]
    unchecked = [text[max(0, match.start() - 60):match.end() + 30].replace("\n", " ")
                 for match in re.finditer(r"(?i)\bdefault(?!_)", text)
                 if not any(start <= match.start() < end for start, end in covered)]
    assert unchecked == []


@pytest.mark.parametrize("stated, effective, expected", [
    ("1e-5", "1e-05", True), ("`3T`", "3T for the sum rule by Rényi DP, inf for the mean rule", True),
    ("47 orders from 1.25 to 256", "1.25 … 256 (47 values)", True), ("none", "3T for the sum rule", False),
    ("0.01", "0.1", False), ("inf", "3T for the sum rule by Rényi DP, inf for the mean rule", False),
])
def test_agreement_is_what_it_says(stated, effective, expected):
    assert agrees(stated, effective) is expected


@pytest.mark.parametrize("stated, case, expected", [("3T", "sum rule", True), ("inf", "mean rule", True),
                                                    ("inf", "sum rule", False), ("3T", "mean rule", False)])
def test_agreement_with_one_case_of_a_default(stated, case, expected):
    assert agrees(stated, "3T for the sum rule by Rényi DP, inf for the mean rule and --accountant pld", case) is expected


def test_a_wrong_default_in_the_prose_is_caught(parsers):
    """The page's own statement, with another value, fails: --holder-b's once said 'none' in one page and 3T in
    another."""
    pattern = r"The sum rule by Rényi DP defaults to `(?P<value>[^`]+)`"
    changed = prose(ACCOUNTANTS_MD).replace("The sum rule by Rényi DP defaults to `3T`",
                                            "The sum rule by Rényi DP defaults to `inf`")
    assert not agrees(re.search(pattern, changed)["value"], flag_default(parsers, COMPOSE[0], "--holder-b"), "sum rule")


# --- docs/api.md: the signatures it prints -----------------------------------------------------------

# Where each documented callable lives.
CALLABLES = {"IndividualAccountant": IndividualAccountant, "sensitivities": api.sensitivities,
             "CanaryScoreAuditor": CanaryScoreAuditor}
for owner in (IndividualAccountant, CanaryScoreAuditor):
    CALLABLES.update({name: member for name, member in vars(owner).items()
                      if callable(member) or isinstance(member, classmethod)})
# The filter's section documents IndividualFilter's own members, some named as the accountant's (get_epsilon, step,
# attach): its signatures are read against them.
FILTER_SECTION = "## Budgets per point: `IndividualFilter`"
FILTER_CALLABLES = {"IndividualFilter": IndividualFilter} | {
    name: member for name, member in vars(IndividualFilter).items() if callable(member) or isinstance(member, classmethod)}
# A signature opens a line, a table row or a heading (a call written mid-sentence, `attach(every=k)`, is a use).
SIGNATURE = re.compile(r"^(?:\| |#+ )?`(?P<name>\w+)\((?P<parameters>[^`]*)\)(?: -> [^`]+)?`", re.M)
NAMESPACE = {"math": math, "DEFAULT_ORDERS": DEFAULT_ORDERS, "None": None, "True": True, "False": False}


def documented_defaults(text, callables=CALLABLES):
    """(callable, parameter, default text) for every `name=default` or `name: type = default` of a signature of one
    of `callables` that docs/api.md prints."""
    found = []
    for match in SIGNATURE.finditer(text):
        if match["name"] not in callables:
            continue
        for parameter in re.split(r",\s*(?![^\[]*\])", match["parameters"].replace("\\|", "|")):
            name, _, default = parameter.partition("=")
            if default:
                found.append((match["name"], name.split(":")[0].strip(), default.strip()))
    return found


def api_default(name, parameter, callables=CALLABLES):
    member = callables[name]
    function = member.__init__ if inspect.isclass(member) else getattr(member, "__func__", member)
    return inspect.signature(function).parameters[parameter].default


@pytest.mark.parametrize("page, pattern, name, parameter", API_STATEMENTS)
def test_a_stated_default_of_the_api_is_its_signatures(page, pattern, name, parameter):
    found = list(re.finditer(pattern, prose(page)))
    assert len(found) == 1, f"{page}: {pattern!r} found {len(found)} times (the statement moved: update API_STATEMENTS)"
    assert eval(found[0]["value"], dict(NAMESPACE)) == api_default(name, parameter)  # noqa: S307


def test_the_api_pages_signatures_give_the_functions_defaults():
    text = read(API_MD)
    start = text.index(FILTER_SECTION)
    end = text.index("\n## ", start + len(FILTER_SECTION))
    for section, callables, least in ((text[:start] + text[end:], CALLABLES, 15),
                                      (text[start:end], FILTER_CALLABLES, 5)):
        documented = documented_defaults(section, callables)
        assert len(documented) >= least
        for name, parameter, default in documented:
            actual = api_default(name, parameter, callables)
            assert eval(default, dict(NAMESPACE)) == actual, (name, parameter, default, actual)  # noqa: S307


def test_a_wrong_signature_default_is_caught():
    (name, parameter, default), = documented_defaults("| `get_epsilon(delta: float, *, rounding: float = 0.02)` | ε |")
    assert eval(default, dict(NAMESPACE)) != api_default(name, parameter)  # noqa: S307
