"""The rollout functions' output types where slime plug-ins import them (``slime.rollout.base_types``)."""

from vime.utils.types import RolloutFnEvalOutput, RolloutFnTrainOutput

__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput"]
