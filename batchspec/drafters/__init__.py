"""Drafters propose tokens for the target to verify."""

from .base import SHARED_CATCH_UP, CatchUp, Draft, Drafter, NoDrafter, Picker, Steering, empty_draft, pick_argmax
from .model import ModelDrafter
from .ngram import HybridDrafter, NgramDrafter, NgramIndex, NgramLookup

__all__ = ["SHARED_CATCH_UP", "CatchUp", "Draft", "Drafter", "HybridDrafter", "ModelDrafter", "NgramDrafter", "NgramIndex", "NgramLookup", "NoDrafter", "Picker",
           "Steering", "empty_draft", "pick_argmax"]
