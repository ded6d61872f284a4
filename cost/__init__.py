"""The cost model: a machine profile measured by ``python -m autopar calibrate``
(profile.py, calibrate.py) and the step-time predictor that reads it."""
from .predict import StepTime, format_step_time, predict_step
from .profile import (
    COLLECTIVE_KINDS,
    AlphaBeta,
    Curve,
    Profile,
    ProfileNotFound,
    default_profile,
    default_profile_path,
)

__all__ = ["AlphaBeta", "Curve", "Profile", "ProfileNotFound", "COLLECTIVE_KINDS",
           "default_profile", "default_profile_path", "StepTime", "format_step_time",
           "predict_step"]
