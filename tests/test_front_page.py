"""The front page and the documentation around it: README.md fits on a screen and gives both set-up commands,
CI runs exactly those, docs/README.md lists every page, and no user-facing page is a dated work log or points
at a tracker its reader cannot see."""

import os
import re
import shlex

import pytest
from conftest import ROOT

DOCS = os.path.join(ROOT, "docs")
USER_FACING = ["README.md", "CHANGELOG.md"] + [os.path.join("docs", name) for name in sorted(os.listdir(DOCS))
                                               if name.endswith(".md")]
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
MONTH = "|".join(month[:3] for month in MONTHS)
# A date (27 Nov, 27 Nov 2026, November 27) or a reference to the project's own tracker (issue 27, #27).
DATED_OR_TRACKER = re.compile(rf"\b\d{{1,2}} ({MONTH})[a-z]*\b|\b({MONTH})[a-z]* \d{{1,2}}\b|"
                              r"\bissues? \d+|(?<![\w/])#\d+\b")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


def code_blocks(text, heading):
    """The shell lines of the ``` blocks of the section `heading`."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```\n(.*?)```", section, re.S) for line in block.splitlines() if line]


def ci_commands():
    return [shlex.split(line) for line in read(os.path.join(".ci", "run")).splitlines()
            if line and not line.startswith(("#", "set ", "cd "))]


def test_the_readme_fits_on_a_screen_and_gives_both_set_up_commands():
    text = read("README.md")
    assert len(text.splitlines()) <= 200
    main_job, tests = code_blocks(text, "## The main job, and the tests")
    assert main_job == "pip install . && perinstance reproduce"
    assert tests == 'pip install ".[test]" && python -m pytest -q -n auto'


def test_ci_installs_and_runs_what_the_readme_says():
    main_job, tests = code_blocks(read("README.md"), "## The main job, and the tests")
    install, ruff, browser, pytest_run, self_test, job = ci_commands()
    readme_install, readme_tests = (shlex.split(part) for part in tests.split(" && "))
    assert install[:4] == ["python3", "-m", "pip", "install"] and install[-1] == readme_install[-1] == ".[test]"
    assert ruff == ["python3", "-m", "ruff", "check", "."]
    assert browser[:3] == ["command", "-v", "chromium"]  # installed where missing, for the test of report.html
    assert pytest_run[1:] == readme_tests[1:] and readme_tests[0] == "python"
    assert self_test == ["perinstance", "audit", "--self-test"]  # the one-run audit's positive controls
    assert job == shlex.split(main_job.split(" && ")[1])


def test_the_index_lists_every_page():
    index = read(os.path.join("docs", "README.md"))
    pages = {name for name in os.listdir(DOCS) if name.endswith(".md") and name != "README.md"}
    assert {page for page in pages if f"]({page})" not in index} == set()
    assert "](figures/quick_report.md)" in index


@pytest.mark.parametrize("path", USER_FACING)
def test_no_user_facing_page_is_dated_or_points_at_a_tracker(path):
    found = [match.group(0) for match in DATED_OR_TRACKER.finditer(read(path))]
    assert found == [], path


def test_a_date_and_a_tracker_reference_are_seen():
    assert DATED_OR_TRACKER.search("measured on 27 Nov 2026")
    assert DATED_OR_TRACKER.search("the targets of issue 27")
    assert DATED_OR_TRACKER.search("see #12")
    assert not DATED_OR_TRACKER.search("pytorch/opacus#571 and 16 Xeon cores, 2 min 43 s")
