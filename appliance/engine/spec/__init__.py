"""Speculative decoding that never changes the output: drafts from prompt lookup or a draft
model, verified by the target in one forward (the design is in speculator.py)."""
from .cost import (DECAY, K_CHOICES, MIN_GAIN, PRIOR_ACCEPT, PRIOR_WEIGHT, Acceptance, CostModel,
                   DraftCost, Option, expected_tokens, plan_options)
from .lookup import NgramIndex
from .policy import Exactness, Policy, decide
from .speculator import Drafting, Speculator

__all__ = ["DECAY", "K_CHOICES", "MIN_GAIN", "PRIOR_ACCEPT", "PRIOR_WEIGHT", "Acceptance", "CostModel",
           "DraftCost", "Option", "expected_tokens", "plan_options", "NgramIndex", "Exactness", "Policy",
           "decide", "Drafting", "Speculator"]
