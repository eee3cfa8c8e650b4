"""A run: its config and validation, composition, the RL loop, the SFT warm-up, saved runs.

Above `mtrl_jax.train` (the jitted train step, its objectives and optimizer):
this package turns a config into a validated `Experiment` (`run.config`,
`run.inputs`, `run.experiment`, `run.checks`), builds the run's parts
(`run.components`), runs the loop (`run.rl`, `run.warmup`, `run.evaluate`)
and reads saved runs back (`run.saved`); `run.recipes` is the recipe API.
"""
