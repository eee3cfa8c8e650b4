"""Entry points a researcher runs, from the repository root: `python -m experiments.train ...`.

train (any config), demo (`make demo`), sweep + ablate (get_sweep axes x seeds ->
tables), calc_errors (a calculator run's failures by class). Running them as
modules puts the repository root on `sys.path`, so configs import `configs`
without path edits.
"""
