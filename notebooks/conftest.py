"""nbval over the notebooks (`make test`): every notebook renders the recorded results, GPU or not.

nbval compares each checked cell's output with the one the notebook was saved with, and those
show data/results/. On a GPU machine the notebooks would otherwise run live (a benchmark, a
matrix of SGLang servers) and print other numbers. The kernels nbval starts inherit this
process's environment.
"""
import os

from sm120_workbook.hardware import RECORDED_ONLY_ENV

os.environ.setdefault(RECORDED_ONLY_ENV, "1")
