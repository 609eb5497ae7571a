"""nbval over the notebooks (`make test`): every notebook renders the recorded results, GPU or not.

nbval compares each checked cell's output with the one the notebook was saved with, and those
show data/results/. On a GPU machine the notebooks would otherwise run live (a benchmark, a
matrix of SGLang servers) and print other numbers. The kernels nbval starts inherit this
process's environment.
"""
import os
import re

import pytest

from sm120_workbook.hardware import RECORDED_ONLY_ENV

os.environ.setdefault(RECORDED_ONLY_ENV, "1")
SKIPPED_HERE = re.compile(r"SKIPPED\b.*\bon this machine\b")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A cell whose live part could not run here prints a line "SKIPPED ... on this machine: why"
    (SKIPPED_HERE; not the "SKIPPED ctx=..." of a live run that goes on), then renders the
    recorded results. nbval would report it as passed, with the line unseen: report it
    as skipped instead, with that line as the reason (`-ra` prints it), as a GPU test would be."""
    outcome = yield
    report = outcome.get_result()
    outputs = getattr(item, "test_outputs", None)
    if call.when != "call" or not report.passed or not outputs:
        return
    said = [line.strip() for out in outputs if out.get("output_type") == "stream" and out.get("name") == "stdout"
            for line in out.get("text", "").splitlines() if SKIPPED_HERE.match(line.strip())]
    if said:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), getattr(item, "cell_num", 0), said[0])
