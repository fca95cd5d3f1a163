"""How long to speculate: γ per step from live measurements (ARCHITECTURE §1.3).

A step with γ drafts per row costs γ draft forwards over B tokens plus one target forward over
B(γ+1) tokens, and yields, per row with acceptance rate α, (1 - α^(γ+1)) / (1 - α) tokens in
expectation. The policy fits each model's forward time as a + b·(tokens in the forward) from what
it measures, estimates α per request (shrunk towards the running global rate), and picks the γ in
[0, max_gamma] with the most expected tokens per second. As the batch grows the target's cost per
token rises on compute-bound hardware, and γ falls, to 0 where speculation does not pay.
"""
from __future__ import annotations

from dataclasses import dataclass


class LinearCost:
    """seconds ≈ a + b·n, fitted by exponentially weighted least squares over (n, seconds)."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._s = [0.0] * 5  # Σw, Σw·n, Σw·n², Σw·t, Σw·n·t

    def observe(self, n: int, seconds: float) -> None:
        d = self.decay
        w, wn, wnn, wt, wnt = (x * d for x in self._s)
        self._s = [w + 1, wn + n, wnn + n * n, wt + seconds, wnt + n * seconds]

    @property
    def ready(self) -> bool:
        return self._s[0] > 0

    def coefficients(self) -> tuple[float, float]:
        w, wn, wnn, wt, wnt = self._s
        if w == 0:
            return 0.0, 0.0
        spread = w * wnn - wn * wn
        if spread <= 1e-9 * max(w * wnn, 1e-30):  # one size seen so far: all cost is fixed
            return wt / w, 0.0
        b = max((w * wnt - wn * wt) / spread, 0.0)
        a = max((wt - b * wn) / w, 0.0)
        return a, b

    def predict(self, n: int) -> float:
        a, b = self.coefficients()
        return a + b * n


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a row gains from one step with γ drafts at acceptance rate α (Leviathan eq. 1)."""
    alpha = min(max(alpha, 0.0), 0.999)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class AcceptanceEstimate:
    """Acceptance rate as accepted / (accepted + rejections), exponentially forgetting."""

    accepted: float = 0.0
    trials: float = 0.0

    def observe(self, num_accepted: int, num_draft: int, decay: float) -> None:
        if num_draft <= 0:
            return
        rejected = 1 if num_accepted < num_draft else 0
        self.accepted = self.accepted * decay + num_accepted
        self.trials = self.trials * decay + num_accepted + rejected

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior * prior_weight) / (self.trials + prior_weight)


class SpeculationPolicy:
    def __init__(
        self,
        max_gamma: int,
        adaptive: bool = True,
        prior_alpha: float = 0.6,
        probe_every: int = 16,
    ) -> None:
        self.max_gamma = max_gamma
        self.adaptive = adaptive
        self.probe_every = probe_every
        self.target_cost = LinearCost()
        self.draft_cost = LinearCost()
        self.overhead = 0.0  # host seconds per forward call, EMA
        self.global_alpha = AcceptanceEstimate()
        self.prior_alpha = prior_alpha
        self._steps_without_drafts = 0

    # -- what we learn ----------------------------------------------------------------------
    def alpha(self, estimate: AcceptanceEstimate) -> float:
        overall = self.global_alpha.rate(self.prior_alpha, 4.0)
        return estimate.rate(overall, 4.0)

    def observe_acceptance(self, estimate: AcceptanceEstimate, num_accepted: int, num_draft: int) -> None:
        estimate.observe(num_accepted, num_draft, decay=0.9)
        self.global_alpha.observe(num_accepted, num_draft, decay=0.995)

    def observe_costs(self, model: str, timings: list[tuple[int, float]]) -> None:
        """(tokens, seconds) forwards of "target" or "draft" outside any step (calibration)."""
        for n, seconds in timings:
            (self.target_cost if model == "target" else self.draft_cost).observe(n, seconds)

    def observe_step(self, wall: float, forwards: list[tuple[str, int, float]]) -> None:
        """forwards: (model "target"|"draft", tokens, seconds) of each forward in the step."""
        for model, n, seconds in forwards:
            (self.target_cost if model == "target" else self.draft_cost).observe(n, seconds)
        host = max(wall - sum(s for _, _, s in forwards), 0.0) / max(len(forwards), 1)
        self.overhead = host if self.overhead == 0.0 else 0.9 * self.overhead + 0.1 * host

    # -- what we decide -----------------------------------------------------------------------
    def step_time(self, batch: int, gamma: int) -> float:
        verify = self.target_cost.predict(batch * (gamma + 1)) + self.overhead
        return verify + gamma * (self.draft_cost.predict(batch) + self.overhead)

    def best_gamma(self, alphas: list[float]) -> int:
        """The γ with the most expected tokens per second for a batch with these acceptance rates."""
        if not self.adaptive or self.max_gamma == 0:
            return self.max_gamma
        if not (self.target_cost.ready and self.draft_cost.ready):
            return self.max_gamma  # nothing measured yet: speculate and learn
        batch = len(alphas)
        rates = [
            sum(expected_tokens(a, g) for a in alphas) / max(self.step_time(batch, g), 1e-9)
            for g in range(self.max_gamma + 1)
        ]
        return max(range(len(rates)), key=rates.__getitem__)

    def choose(self, alphas: list[float]) -> int:
        """γ for the next step; after probe_every steps without drafts, one short probe step."""
        gamma = self.best_gamma(alphas)
        if gamma == 0 and self.adaptive and self.max_gamma > 0:
            self._steps_without_drafts += 1
            if self._steps_without_drafts >= self.probe_every:
                self._steps_without_drafts = 0
                return 1
        else:
            self._steps_without_drafts = 0
        return gamma
