"""Speculation-length policies (pure Python + numpy; shared by the simulator and the real engine)."""
from policies.base import BatchView, Policy, StepOutcome
from policies.registry import load_policy_file, make_policy, names, register

__all__ = ["BatchView", "Policy", "StepOutcome", "load_policy_file", "make_policy", "names", "register"]
