"""What every benchmark row reports of a run: tokens and seconds, drafts, acceptance."""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

from specserve.engine.step import per_token_alpha


@dataclass(kw_only=True)
class SpeedAndAcceptance:
    """For benchmark rows that count tokens, seconds, accepted drafts and rejections."""

    tokens: int
    seconds: float
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0

    def add_metrics(self, metrics) -> None:
        """Add one request's engine metrics (RequestMetrics) to this row's counts."""
        self.steps += metrics.num_steps
        self.drafted += metrics.num_draft_tokens
        self.accepted += metrics.num_accepted_tokens
        self.rejections += metrics.num_rejections

    def as_dict(self, *leave_out: str) -> dict:
        """The row's fields for JSON, less those named: the row's own required fields, then these
        counts, then its other fields."""
        values = asdict(self)
        counts = [f.name for f in fields(SpeedAndAcceptance)]
        first = [f.name for f in fields(self) if f.name not in counts
                 and f.default is MISSING and f.default_factory is MISSING]
        order = first + counts + [k for k in values if k not in first and k not in counts]
        return {k: values[k] for k in order if k not in leave_out}

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability under the geometric model (MLE); 0 with no trials."""
        return per_token_alpha(self.accepted, self.rejections) or 0.0
