"""Drafters propose tokens for the target to verify."""

from .base import Draft, Drafter, Picker, Steering, empty_draft, pick_argmax
from .model import ModelDrafter
from .ngram import HybridDrafter, NgramDrafter, NgramIndex, NgramLookup

__all__ = ["Draft", "Drafter", "HybridDrafter", "ModelDrafter", "NgramDrafter", "NgramIndex", "NgramLookup", "Picker",
           "Steering", "empty_draft", "pick_argmax"]
