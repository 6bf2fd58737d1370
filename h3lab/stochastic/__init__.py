"""Stochastic steppers: SDE transitions for RL on H3 -- Flow-GRPO's `flow_sde`, DanceGRPO's `dance_sde`,
coefficient-preserving `cps` -- as pure math (`transitions.py`: the Gaussian of one pass in H3's sign convention, its
exact float32 log-density, the seeded per-pass noise) and as named steppers of a `RunSpec` (`steppers.py`: the
parameters sealed in `RunSpec.stepper_params`, a MixGRPO window, the per-pass record the trajectory seals), and
a sealed pass read back for training (`records.py`: `recorded_transition`, `PassTransition.logprob(v)`).

May import: the foundations, `run`, `schema`.
"""

from .records import PassTransition, recorded_transition
from .steppers import SDEStepper, sde_steppers  # importing it registers flow_sde, dance_sde, cps
from .transitions import (
    MODALITIES,
    NOISE_SCHEME,
    SDE_KINDS,
    TransitionError,
    gaussian_logprob,
    noise_seed,
    pass_noise,
    transition_logprob,
    transition_mean_std,
    tree_sum,
)

__all__ = ["MODALITIES", "NOISE_SCHEME", "PassTransition", "SDE_KINDS", "SDEStepper", "TransitionError",
           "gaussian_logprob", "noise_seed", "pass_noise", "recorded_transition", "sde_steppers", "transition_logprob",
           "transition_mean_std", "tree_sum"]
