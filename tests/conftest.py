"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere.

The backend optimisation level only changes how hard LLVM optimises the CPU
code (the XLA program is the same); level 0 halves compile time, which
dominates this suite.
"""
import os

_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")] +
    [f for f in _FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
