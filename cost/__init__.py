"""The cost model: a machine profile (profile.py; measured by ``python -m autopar
calibrate``, the ``autopar.calibrate`` package above this one) and the step-time predictor
that reads it (predict.py). It predicts and never measures: nothing here imports the
runtime or calibration."""
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
