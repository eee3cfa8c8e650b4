"""Experiment configs: `get_config(arg)` files; sweeps as `get_sweep(arg)` beside them."""
