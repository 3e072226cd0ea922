"""Side-by-side benchmarks: each scenario against a raw baseline, in the same run.

Run ``python -m benchmarks [--quick] [--json PATH]`` (or ``nox -s bench``). See
``measure.py`` for how rounds, medians and ratios are taken.
"""
