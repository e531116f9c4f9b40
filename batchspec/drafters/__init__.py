"""Drafters propose tokens for the target to verify."""

from .base import Draft, Drafter, Picker, pick_argmax
from .model import ModelDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "Picker", "pick_argmax"]
