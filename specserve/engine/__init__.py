"""The speculative decoding engine: pure torch + transformers. Never imports ray or fastapi."""
from .engine import CompletionOutput, SpeculativeEngine
from .feature_drafter import FeatureDrafterProposer, FeatureDrafterSpec
from .history import History
from .model_runner import CacheMiss, ModelRunner, RowInput
from .proposers import (
    DrafterSpec, DraftModelProposer, DraftModelSpec, LayerSkipProposer, LayerSkipSpec, PredictionProposer,
    PredictionSpec, PromptLookupProposer, PromptLookupSpec, Proposal, Proposer,
)
from .sampling import SamplingParams
from .step import RequestMetrics, StepOutput
from .verifier import TargetVerifier, Verdict

__all__ = [
    "CacheMiss", "CompletionOutput", "DrafterSpec", "FeatureDrafterProposer", "FeatureDrafterSpec", "DraftModelProposer", "DraftModelSpec", "History", "LayerSkipProposer",
    "LayerSkipSpec", "ModelRunner", "PredictionProposer", "PredictionSpec", "PromptLookupProposer", "PromptLookupSpec", "Proposal", "Proposer",
    "RequestMetrics", "RowInput", "SamplingParams", "SpeculativeEngine", "StepOutput", "TargetVerifier", "Verdict",
]
