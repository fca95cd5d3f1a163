"""How long to speculate: γ per step from live measurements (docs/architecture.md §1).

A step with γ drafts per row costs γ draft forwards over B tokens plus one target forward over
B(γ+1) tokens, and yields, per row whose next planned draft is drafted and accepted with chance ρ,
(1 - ρ^(γ+1)) / (1 - ρ) tokens in expectation. The policy learns each model's forward time per
number of tokens from what it measures (prefills excluded), estimates ρ per request (shrunk towards
the running global rate), and picks the γ in [0, max_gamma] with the most expected tokens per
second. As the batch grows the target's cost per token rises on compute-bound hardware, and γ
falls, to 0 where speculation does not pay.

A drafter may decline a row's planned positions (a confidence floor, a short prompt lookup). A
declined position yields nothing, so ρ counts it as a miss; but it is cheap: the verify narrows to
the longest run any row drafted, and a loop that checks on the host stops once no row drafts on.
So the policy also learns per request how often the drafter drafts the next planned position (the
offer rate κ), and prices a step's forwards at the widths that rate gives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


SWITCH_MARGIN = 1.05  # drafting must promise 5% more tokens per second than not drafting
MAX_STAY_LIFT = 0.2  # staying on takes only not losing at α up to this much above the estimate
PROBE_SHARE = 0.03  # a probe's extra cost may be at most this share of the time since the last one
QUIET_PROBE_SHARE = 0.005  # the same where drafting would not pay even at the optimistic rate
NEWCOMER_SHARE = 0.10  # the same for a probe that tries a request no step has drafted for yet
MIN_NEWCOMER_SHARE = 0.02  # ... halving to this after each such probe that did not turn drafting on
PRIOR_WEIGHT = 4.0  # trials' worth of weight of the prior (overall: prior_alpha; a row: the overall rate)
ROW_DECAY = 0.97  # per step: how fast a request's own acceptance estimate forgets
MAX_OPTIMISTIC_ALPHA = 0.95  # a probe plans for at most this acceptance rate
BRANCH_MARGIN = 0.01  # a pipelined step's branch must save this share of the step's predicted time
ALTERNATE_PRIOR = 0.3  # before measuring: how often a draft's runner-up is the target's token where it rejects


class TokenCost:
    """Seconds of one forward as a function of the tokens it processes, learned per size.

    Cost is not linear in tokens: on a CPU going from 1 to 2 tokens costs much more than from 30 to
    31 (a matrix-vector product becomes a matrix product), while on a GPU small sizes cost about
    the same. So each size keeps its own running mean (sizes above 64 share buckets of 1/8 octave),
    and an unmeasured size is interpolated between its measured neighbours.

    The load moves: calibration (dummy forwards at start-up, `calibrate`) runs on a quiet
    machine, live steps beside everything else a server does, and the machine's own load changes
    while a size goes unmeasured (a batch of 8 that drafts never decodes 8 tokens alone). So the
    table keeps a load level, a running mean over live forwards (of any size) of live /
    calibrated cost, and each size's cost is read at today's level: a size known only from
    calibration times the level, a live size times level now / level when it was last measured.
    Without that, a batch of 8 compared 8 tokens measured during a load spike (or under load) with
    16 tokens at their idle or later cost, and drafting looked cheaper than it is.
    """

    def __init__(self, decay: float = 0.8, level_decay: float = 0.9) -> None:
        self.decay = decay
        self.level_decay = level_decay
        self._mean: dict[int, tuple[float, float]] = {}  # bucket -> (seconds, level when measured), live
        self._calibrated: dict[int, float] = {}  # bucket -> seconds, from calibration
        self._level: float | None = None  # live / calibrated cost, running mean (None: no ratio yet)

    @staticmethod
    def bucket(n: int) -> int:
        if n <= 64:
            return n
        step = 1 << (n.bit_length() - 4)  # 8 buckets per octave
        return round(n / step) * step

    def observe(self, n: int, seconds: float) -> None:
        key = self.bucket(n)
        calibrated = interpolate(self._calibrated, key) if self._calibrated else None
        if calibrated:
            ratio = seconds / calibrated
            self._level = ratio if self._level is None else self.level_decay * self._level + (1 - self.level_decay) * ratio
        old = self._mean.get(key)
        value = seconds if old is None else self.decay * old[0] * self.level() / old[1] + (1 - self.decay) * seconds
        self._mean[key] = (value, self.level())

    def calibrate(self, n: int, seconds: float) -> None:
        self._calibrated[self.bucket(n)] = seconds

    @property
    def ready(self) -> bool:
        return bool(self._mean or self._calibrated)

    def level(self) -> float:
        """Live / calibrated cost, a running mean over live forwards (1 before any)."""
        return 1.0 if self._level is None else self._level

    def table(self) -> dict[int, float]:
        """{tokens: seconds} at every size measured or calibrated, at today's level."""
        return {k: self.predict(k) for k in sorted({*self._calibrated, *self._mean})}

    def predict(self, n: int) -> float:
        level = self.level()
        table = {k: c * level for k, c in self._calibrated.items()}
        table.update({k: value * level / then for k, (value, then) in self._mean.items()})
        return interpolate(table, self.bucket(n))


def interpolate(table: dict[int, float], key: int) -> float:
    """Seconds at `key` from a {bucket: seconds} table: as measured, else between the measured
    neighbours, else along the last segment (never downwards), or no cheaper than the smallest."""
    if key in table:
        return table[key]
    sizes = sorted(table)
    lower = [k for k in sizes if k < key]
    upper = [k for k in sizes if k > key]
    if lower and upper:
        lo, hi = lower[-1], upper[0]
        return table[lo] + (table[hi] - table[lo]) * (key - lo) / (hi - lo)
    if upper:  # below every measured size: no cheaper than the smallest
        return table[upper[0]]
    if len(lower) == 1:  # one size known: assume cost grows no faster than tokens
        return table[lower[0]] * max(key / max(lower[0], 1), 1.0)
    lo, hi = lower[-2], lower[-1]  # extrapolate the last segment, never downwards
    slope = max((table[hi] - table[lo]) / (hi - lo), 0.0)
    return table[hi] + slope * (key - hi)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a row gains from one step with γ drafts at acceptance rate α (Leviathan eq. 1)."""
    alpha = min(max(alpha, 0.0), 0.999)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_summed(alphas: list[float], max_gamma: int) -> list[float]:
    """[Σ over rows of expected_tokens(α, γ) for γ in 0..max_gamma], by running powers (the
    policy's every step: B·γ calls were most of its cost); rows of one rate counted at once."""
    if not alphas:
        return [0.0] * (max_gamma + 1)
    if alphas.count(alphas[0]) == len(alphas):
        return [len(alphas) * expected_tokens(alphas[0], g) for g in range(max_gamma + 1)]
    clamped = [min(max(a, 0.0), 0.999) for a in alphas]
    scales = [1.0 / (1.0 - a) for a in clamped]
    base = sum(scales)
    powers = clamped  # α^(γ+1)
    sums = []
    for _ in range(max_gamma + 1):
        sums.append(base - sum(p * c for p, c in zip(powers, scales)))
        powers = [p * a for p, a in zip(powers, clamped)]
    return sums


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


@dataclass(frozen=True)
class Widths:
    """What a batch's offer rates make of a step's forwards: the verify checks the longest run any
    row drafted (plus the bonus position), and a loop that checks on the host (`stops`) ends once
    no row drafts on."""

    reach: tuple[float, ...]  # [i] chance that some row drafts position i, i in 0..max_gamma (reach[0] = 1)
    stops: bool = False

    @staticmethod
    def full(max_gamma: int) -> "Widths":
        """Every planned position drafted (a drafter that never declines)."""
        return Widths((1.0,) * (max_gamma + 1))

    def verify(self, gamma: int) -> list[tuple[int, float]]:
        """[(positions per row, chance)] of the verify of a step with γ planned drafts."""
        reach = (*self.reach[: gamma + 1], 0.0)
        return [(i + 1, reach[i] - reach[i + 1]) for i in range(gamma + 1) if reach[i] > reach[i + 1]]

    def loop(self, gamma: int) -> float:
        """Expected forwards of the draft loop of a step with γ planned drafts: γ; or, where it
        stops, the first one and one more per position i < γ that some row drafts."""
        return sum(self.reach[:gamma]) if self.stops else float(gamma)


def offered_widths(offers: list[float], max_gamma: int, stops: bool) -> Widths:
    """Widths for rows that each draft their next planned position with chance κ_b, having drafted
    the one before: row b drafts position i with chance κ_b^i."""
    if all(k >= 1.0 for k in offers):
        return Widths.full(max_gamma)
    reach = [1.0] + [1.0 - math.prod(1.0 - k ** i for k in offers) for i in range(1, max_gamma + 1)]
    return Widths(tuple(reach), stops)


class SpeculationPolicy:
    def __init__(
        self,
        max_gamma: int,
        adaptive: bool = True,
        prior_alpha: float = 0.6,
        probe_every: int = 16,
        fused: bool = False,
        own_drafts: bool = True,
    ) -> None:
        self.max_gamma = max_gamma
        # own_drafts False: the drafter drafts nothing but the requests' predictions (`drafter:
        # {kind: prediction}`), so no step plans drafts of its own (γ 0); a predicted run still
        # takes up to max_gamma (`plan_step`)
        self.own_drafts = own_drafts
        self.adaptive = adaptive and own_drafts
        # fused: the drafts are made inside the verify's call (a drafter in the target worker), so
        # host overhead is paid once per step, not once per draft forward too
        self.fused = fused
        self.probe_every = probe_every
        self.target_cost = TokenCost()
        self.draft_cost = TokenCost()
        self.overhead = 0.0  # host seconds per call (per forward unless fused), EMA
        # batch -> measured / modelled seconds of a step's draft forwards, EMA: what γ forwards of
        # B tokens miss (a feature head's first forward re-reads each row's accepted tokens).
        # Learned from every drafting step of that batch size, whatever its γ.
        self._draft_bias: dict[int, float] = {}
        self.global_alpha = AcceptanceEstimate()  # ρ: a planned draft drafted and accepted
        self.global_offers = AcceptanceEstimate()  # κ: a planned draft drafted (`offer`)
        self._loop_stops = False  # the draft loop was seen to end before its γ forwards (`observe_step`)
        self.prior_alpha = prior_alpha
        self._steps_without_drafts = 0
        self._probe_interval = probe_every  # doubles after each probe that did not turn drafting back on
        self._newcomer_share = NEWCOMER_SHARE  # halves after each newcomer probe that did not either
        self._drafting = False  # the last step chose to draft (not a probe): `best_gamma`'s `staying`
        self._step_times: dict[tuple, float] | None = None  # within one `choose`: its predictions

    # -- what we learn ----------------------------------------------------------------------
    def overall_alpha(self) -> float:
        """The global acceptance estimate, shrunk towards prior_alpha."""
        return self.global_alpha.rate(self.prior_alpha, PRIOR_WEIGHT)

    def alpha(self, estimate: AcceptanceEstimate) -> float:
        return estimate.rate(self.overall_alpha(), PRIOR_WEIGHT)

    def observe_acceptance(self, estimate: AcceptanceEstimate, num_accepted: int, num_planned: int) -> None:
        """A row's step planned `num_planned` drafts and kept the first `num_accepted`: a position
        the drafter declined is a miss like a rejected one (it yields nothing either)."""
        estimate.observe(num_accepted, num_planned, decay=ROW_DECAY)
        self.global_alpha.observe(num_accepted, num_planned, decay=0.995)

    def observe_offers(self, estimate: AcceptanceEstimate, num_drafted: int, num_planned: int) -> None:
        """A row's step planned `num_planned` drafts and the drafter drafted the first `num_drafted`."""
        estimate.observe(num_drafted, num_planned, decay=ROW_DECAY)
        self.global_offers.observe(num_drafted, num_planned, decay=0.995)

    def offer(self, estimate: AcceptanceEstimate) -> float:
        """κ of a row: how often the drafter drafts its next planned position, having drafted the
        one before, shrunk towards the global rate (itself shrunk towards 1: a drafter that never
        declines). It prices a step's forwards (`widths`), never its yield: that is ρ's."""
        overall = self.global_offers.rate(1.0, PRIOR_WEIGHT)
        return estimate.rate(overall, PRIOR_WEIGHT)

    def widths(self, offers: list[float]) -> Widths:
        """Widths of a step for rows with these offer rates."""
        return offered_widths(offers, self.max_gamma, self._loop_stops)

    def observe_costs(self, model: str, timings) -> None:
        """Forwards (ForwardTiming) of "target" or "draft" in live steps."""
        cost = self.target_cost if model == "target" else self.draft_cost
        for f in timings:
            cost.observe(f.tokens, f.seconds)

    def calibrate_costs(self, model: str, timings) -> None:
        """Forwards (ForwardTiming) of "target" or "draft" outside any step (start-up calibration)."""
        cost = self.target_cost if model == "target" else self.draft_cost
        for f in timings:
            cost.calibrate(f.tokens, f.seconds)

    def observe_step(self, wall: float, draft_forwards, target_forwards, batch: int = 0, gamma: int = 0,
                     backlog: int = 0) -> None:
        """A step's wall time and its forwards (ForwardTiming): prefills count as model time but
        are kept out of the per-size costs, which describe decoding steps. With the step's batch
        and γ, also how its draft forwards compared with the model's, unless the draft first
        caught up on a backlog: that forward is an odd size, run eagerly where the drafts replay
        a CUDA graph (measured on an H100: a 1.1B draft's catch-up over a 128-token prompt made
        the step's drafting look 2.4x its cost, and the policy never drafted again at α 0.8). Its
        cost is learned for its own size instead. A loop that ran fewer than γ forwards stopped
        where no row drafted on (an eager loop under a confidence floor): from then on the policy
        prices a loop at the forwards the rows' offer rates give (`Widths.loop`), and the bias
        compares the forwards that ran."""
        ran = sum(1 for f in draft_forwards if not f.prefill and f.tokens > 0)  # (0 tokens: a lookup's timing)
        if batch and gamma and backlog == 0 and 0 < ran < gamma:
            self._loop_stops = True
        if batch and gamma and draft_forwards and self.draft_cost.ready and backlog == 0:
            modelled = (ran if self._loop_stops and ran else gamma) * self.draft_cost.predict(batch)
            ratio = min(max(sum(f.seconds for f in draft_forwards) / max(modelled, 1e-9), 0.25), 8.0)
            old = self._draft_bias.get(batch)
            self._draft_bias[batch] = ratio if old is None else 0.8 * old + 0.2 * ratio
        for model, forwards in (("draft", draft_forwards), ("target", target_forwards)):
            self.observe_costs(model, [f for f in forwards if not f.prefill])
        forwards = [*draft_forwards, *target_forwards]
        calls = len(target_forwards) if self.fused else len(forwards)
        host = max(wall - sum(f.seconds for f in forwards), 0.0) / max(calls, 1)
        self.overhead = host if self.overhead == 0.0 else 0.9 * self.overhead + 0.1 * host

    # -- what we decide -----------------------------------------------------------------------
    def step_time(self, batch: int, gamma: int, backlog: int = 0, widths: Widths | None = None) -> float:
        """Predicted seconds of a step: one verify of B(γ+1) tokens, then (γ > 0) the drafts: γ
        forwards of B tokens after catching up on `backlog` tokens (those it skipped in steps
        without drafts), scaled by what this batch size's drafting steps measured; plus the host
        overhead per call. widths: what the rows' offer rates give (`widths`): the verify priced
        over the widths it narrows to, the loop at its expected forwards (None: every planned one)."""
        if self._step_times is not None:  # inside `choose`: the costs cannot change until it returns
            key = (batch, gamma, backlog, widths)
            if key not in self._step_times:
                self._step_times[key] = self._step_time(batch, gamma, backlog, widths)
            return self._step_times[key]
        return self._step_time(batch, gamma, backlog, widths)

    def _step_time(self, batch: int, gamma: int, backlog: int, widths: Widths | None) -> float:
        widths = widths or Widths.full(gamma)
        # (the expected cost over the verify's widths: a forward's cost is no straight line in
        # tokens; on the CPU demo's costs at γ 2 and κ 0.41 the cost at the expected width is 4% low)
        verify = sum(p * self.target_cost.predict(batch * w) for w, p in widths.verify(gamma)) + self.overhead
        if gamma == 0:
            return verify
        loop = widths.loop(gamma)
        calls = 0 if self.fused else loop + (backlog > 0)
        drafts = self._draft_bias.get(batch, 1.0) * self._draft_seconds(batch, loop, backlog)
        return verify + drafts + calls * self.overhead

    def _draft_seconds(self, batch: int, forwards: float, backlog: int) -> float:
        catch_up = self.draft_cost.predict(backlog) if backlog > 0 else 0.0
        return catch_up + forwards * self.draft_cost.predict(batch)

    def best_gamma(self, alphas: list[float], backlog: int = 0, staying: bool = False,
                   offers: list[float] | None = None) -> int:
        """The γ with the most expected tokens per second for a batch with these rates ρ (a
        planned draft drafted and accepted) and offer rates κ (None: a drafter that never declines).

        Turning drafting on takes a predicted gain of SWITCH_MARGIN, so that predictions within
        noise of each other do not make the policy flap into steps that cost more than they give.
        Staying on (`staying`: the last step chose to draft) takes only that the γ would still gain
        at `optimistic_alpha`'s confidence bound, at most MAX_STAY_LIFT above the estimate (the bound
        is wide while few trials are in, and a useless drafter must still be dropped within a few
        steps). While it drafts, the estimate moves with every step; one that noise pushed under
        the margin would otherwise switch drafting off where it pays, to be learned again only by
        rare probes (replayed on the H100's costs, batch 1 at α 0.6 then drafted 0.06 tokens a step
        and ran at 0.91x of γ=1)."""
        if not self.adaptive or self.max_gamma == 0:
            return self.max_gamma
        if not self.ready:
            return self.max_gamma  # nothing measured yet: speculate and learn
        rates = self._rates(alphas, backlog, offers)
        best = max(range(1, len(rates)), key=rates.__getitem__)
        if rates[best] > SWITCH_MARGIN * rates[0]:
            return best
        if not staying:
            return 0
        lift = min(self.optimistic_alpha() - self.overall_alpha(), MAX_STAY_LIFT)
        hopeful = self._rates([min(a + lift, MAX_OPTIMISTIC_ALPHA) for a in alphas], backlog, offers)
        best = max(range(1, len(hopeful)), key=hopeful.__getitem__)
        return best if hopeful[best] > hopeful[0] else 0

    def _widths_for(self, alphas: list[float], offers: list[float] | None) -> Widths | None:
        """Widths for rows at these ρ and κ: a row drafts at least as often as it gains (ρ <= κ,
        which a bound or a probe's planned ρ may break), so each κ is at least its row's ρ."""
        return None if offers is None else self.widths([max(k, a) for k, a in zip(offers, alphas)])

    def _rates(self, alphas: list[float], backlog: int, offers: list[float] | None = None) -> list[float]:
        """Expected tokens per second of the batch for each γ in [0, max_gamma]."""
        batch, widths = len(alphas), self._widths_for(alphas, offers)
        return [gain / max(self.step_time(batch, g, backlog, widths), 1e-9)
                for g, gain in enumerate(expected_tokens_summed(alphas, self.max_gamma))]

    def choose(self, alphas: list[float], backlog: int = 0, newcomers: int = 0,
               offers: list[float] | None = None) -> int:
        """γ for the next step. While drafting does not pay, one probe step every probe_every
        steps, backing off to 16x that while the probes keep finding it does not pay, and never
        sooner than the steps since the last probe make its extra cost PROBE_SHARE of their time
        (a probe first catches the draft up on every token it skipped, an eager forward on a
        GPU: measured on an H100 at a batch of 16, 55 ms against an 11 ms step), or only
        QUIET_PROBE_SHARE where drafting would not pay even at `optimistic_alpha` (a large batch,
        a drafter known to be poor: such probes only watch for a change, and at 3% they cost a
        batch of 16 on the H100's costs 2.2% of its throughput). newcomers: rows that no step has
        drafted for yet (see `_newcomer_probe`). alphas: the rows' ρ; offers: their κ (`offer`)."""
        self._step_times = {}
        try:
            return self._choose(alphas, backlog, newcomers, offers)
        finally:
            self._step_times = None

    def _choose(self, alphas: list[float], backlog: int, newcomers: int, offers: list[float] | None) -> int:
        if not self.own_drafts:
            return 0
        gamma = self.best_gamma(alphas, backlog, staying=self._drafting, offers=offers)
        self._drafting = gamma > 0
        if gamma > 0 or not self.adaptive or self.max_gamma == 0:
            self._steps_without_drafts = 0
            self._probe_interval = self.probe_every
            if gamma > 0:
                self._newcomer_share = NEWCOMER_SHARE
            return gamma
        batch = len(alphas)
        self._steps_without_drafts += 1
        probe = self._newcomer_probe(batch, backlog, offers) if newcomers else 0
        if probe:
            self._steps_without_drafts = 0
            self._newcomer_share = max(self._newcomer_share / 2, MIN_NEWCOMER_SHARE)
            return probe
        if self._steps_without_drafts < self._probe_interval:
            return 0
        probe = self.probe_gamma(batch, backlog, offers)
        optimistic = [self.optimistic_alpha()] * batch
        hopeful = self.best_gamma(optimistic, offers=offers) > 0  # once caught up
        share = PROBE_SHARE if hopeful else QUIET_PROBE_SHARE
        spacing = self._spacing(batch, probe, backlog, share, self._widths_for(optimistic, offers))
        if self._steps_without_drafts < spacing:
            self._probe_interval = spacing  # priced again then, with the backlog grown
            return 0
        self._steps_without_drafts = 0
        self._probe_interval = min(2 * self._probe_interval, 16 * self.probe_every)
        return probe

    def _spacing(self, batch: int, probe: int, backlog: int, share: float, widths: Widths | None = None) -> int:
        """Steps without drafts that make a probe's extra cost `share` of their time."""
        plain = self.step_time(batch, 0)
        return math.ceil((self.step_time(batch, probe, backlog, widths) - plain) / (share * plain))

    def _newcomer_probe(self, batch: int, backlog: int, offers: list[float] | None = None) -> int:
        """γ of a probe for the rows no step has drafted for, or 0 (none due). Such a row's rate
        is the overall one, which other requests made: after a run of chat (α 0.3) a code
        request (α 0.6) was never drafted for, and the overall probes drafted one token at a
        time, too rarely to move its own estimate within its lifetime. So it is tried once with
        a full block: the γ that would pay at `MAX_OPTIMISTIC_ALPHA` (none, where even that
        would not pay), at most a share of the time since the last probe (priced as if every row
        drafted that often too): NEWCOMER_SHARE, halving after each newcomer probe that did not
        turn drafting on, down to MIN_NEWCOMER_SHARE, and back to NEWCOMER_SHARE once a step
        drafts. Under steady load where drafting does not pay, a new request joins every few
        steps and each such probe pays the draft's catch-up for nothing: at 10% each time they
        cost the draft model's own trace 6-7% at batches 2-8 (docs/engine.md)."""
        hoped = [MAX_OPTIMISTIC_ALPHA] * batch
        probe = self.best_gamma(hoped, backlog, offers=offers)
        widths = self._widths_for(hoped, offers)
        share = self._newcomer_share
        if probe == 0 or self._steps_without_drafts < self._spacing(batch, probe, backlog, share, widths):
            return 0
        return probe

    @property
    def ready(self) -> bool:
        """Whether both models' costs are known (before that, the policy drafts and learns)."""
        return self.target_cost.ready and self.draft_cost.ready

    def optimistic_alpha(self) -> float:
        """The acceptance rate drafting could still have, given what was measured: the overall
        estimate plus two standard errors over its (decayed) trials and the prior's weight."""
        rate = self.overall_alpha()
        trials = self.global_alpha.trials + PRIOR_WEIGHT
        return min(rate + 2.0 * math.sqrt(rate * (1.0 - rate) / trials), MAX_OPTIMISTIC_ALPHA)

    def probe_gamma(self, batch: int, backlog: int = 0, offers: list[float] | None = None) -> int:
        """A probe's γ: what would pay if every row accepted at `optimistic_alpha`, at least 1.
        While the estimate rests on a few trials a probe drafts a full block, so a drafter better
        than the prior is found within a few probes (a one-token probe adds at most one trial, and
        the back-off would have spaced the probes out long before the estimate moved); once many
        trials say drafting loses, the bound sits near the estimate and probes draft one token."""
        return max(self.best_gamma([self.optimistic_alpha()] * batch, backlog, offers=offers), 1)


class OverlappedPolicy(SpeculationPolicy):
    """γ for a loop that drafts the next block while the target verifies this one (the Ray
    coordinator's pipelined mode, `specserve.serve.pipeline`).

    While the target verifies γ drafts, the draft runs γ + 1 more forwards: a guess of the bonus
    token, then the next block's γ drafts after it. That prepared block is used when every row of
    the batch accepted all its drafts and the bonus equals the guess, with probability
    h = Π_b α_b^γ · β (α_b: the row's ρ, `SpeculationPolicy`; β: how often the guess was right
    after a full acceptance, measured). With k rejection-point branches per row (`max_branches`,
    greedy batches on the compiled graph) the same forwards also draft from each row's first k
    rejection points, corrected to the draft's runner-up there: B(1 + k) rows, and
    h = Π_b (α_b^γ β + β₂ (1 - α_b^k)) (β₂: how often the runner-up was the target's token where a
    branch's position was rejected, measured). So in draft-forward units D and verify time T, a
    step costs

        overlapped:  max(T(B(γ+1)), (γ+1) D(B(1+k))) + (1 - h) γ D(B)      (a miss drafts afresh first)
        sequential:  T(B(γ+1)) + γ D(B)

    (each forward plus the host overhead per call). For every γ the cheaper of the two counts;
    `overlap_pays` tells the loop whether to prepare the next block at all (at large batches h
    vanishes, and a draft slower than the verify would only delay the fresh drafts). γ = 0 still
    wins where drafting loses, exactly as in the sequential policy.
    """

    def __init__(self, max_gamma: int, adaptive: bool = True, prior_alpha: float = 0.6, probe_every: int = 16,
                 max_branches: int = 0) -> None:
        super().__init__(max_gamma, adaptive, prior_alpha, probe_every)
        self.guess = AcceptanceEstimate()  # bonus guesses right / made (rows that accepted every draft)
        # rejection-point branches (all-greedy batches): runner-ups that were the target's token / tried
        self.max_branches = max_branches
        self.alternate = AcceptanceEstimate()

    def observe_guesses(self, right: int, made: int) -> None:
        for i in range(made):
            self.guess.observe(1 if i < right else 0, 1, decay=0.99)

    def guess_rate(self) -> float:
        return self.guess.rate(self.overall_alpha(), PRIOR_WEIGHT)

    def observe_alternates(self, right: int, made: int) -> None:
        """Rows rejected at a position that had a branch: `right` of them got the runner-up."""
        for i in range(made):
            self.alternate.observe(1 if i < right else 0, 1, decay=0.99)

    def alternate_rate(self) -> float:
        return self.alternate.rate(ALTERNATE_PRIOR, PRIOR_WEIGHT)

    def branches_for(self, alphas: list[float], gamma: int) -> int:
        """Rejection-point branches per row for a step with γ drafts: each one more (up to
        `max_branches`, at most γ) while it makes the predicted pipelined step at least
        `BRANCH_MARGIN` cheaper (a branch also holds a cache copy); unmeasured or a fixed γ: all
        that are allowed."""
        top = min(self.max_branches, gamma)
        if top == 0 or not self.adaptive or not self.ready:
            return top
        best, best_time = 0, self.overlapped_time(len(alphas), gamma, alphas)
        for k in range(1, top + 1):
            seconds = self.overlapped_time(len(alphas), gamma, alphas, branches=k)
            if seconds < best_time * (1.0 - BRANCH_MARGIN):
                best, best_time = k, seconds
        return best

    def observe_overlapped_step(self, wall: float, fresh_forwards, ahead_forwards, verify_forwards) -> None:
        """A pipelined step: the fresh drafts (a miss), then the verify and the next block's
        drafting side by side; host overhead is what the wall time holds beyond that critical path."""
        for model, forwards in (("draft", [*fresh_forwards, *ahead_forwards]), ("target", verify_forwards)):
            self.observe_costs(model, [f for f in forwards if not f.prefill])
        critical = sum(f.seconds for f in fresh_forwards) + max(
            sum(f.seconds for f in verify_forwards), sum(f.seconds for f in ahead_forwards))
        host = max(wall - critical, 0.0) / max(len(fresh_forwards) + len(verify_forwards), 1)
        self.overhead = host if self.overhead == 0.0 else 0.9 * self.overhead + 0.1 * host

    def overlapped_time(self, batch: int, gamma: int, alphas: list[float], backlog: int = 0,
                        branches: int = 0) -> float:
        """Predicted seconds of a pipelined step with γ drafts per row (γ >= 1), preparing
        `branches` rejection-point blocks per row besides the full-acceptance one: the ahead call
        drafts B (1 + k) rows (k = min(branches, γ)), and a row's next block is ready when it
        accepts all γ and the bonus guess holds (α^γ β), or is rejected at one of the first k
        positions and the runner-up was the target's token there (β₂ (1 - α^k))."""
        k = min(branches, gamma)
        draft = self.draft_cost.predict(batch) + self.overhead
        ahead = self.draft_cost.predict(batch * (1 + k)) + self.overhead
        verify = self.target_cost.predict(batch * (gamma + 1)) + self.overhead
        catch_up = self.draft_cost.predict(backlog) + self.overhead if backlog > 0 else 0.0
        guess, runner_up = self.guess_rate(), self.alternate_rate() if k else 0.0
        hit = 1.0
        for a in alphas:
            a = min(max(a, 0.0), 0.999)
            hit *= a ** gamma * guess + runner_up * (1.0 - a ** k)
        return max(verify, (gamma + 1) * ahead) + (1.0 - hit) * (gamma * draft + catch_up)

    def best_overlapped_time(self, batch: int, gamma: int, alphas: list[float], backlog: int = 0) -> float:
        """overlapped_time with the branches `branches_for` would prepare."""
        return self.overlapped_time(batch, gamma, alphas, backlog, self.branches_for(alphas, gamma))

    def overlap_pays(self, alphas: list[float], gamma: int) -> bool:
        """Whether preparing the next block makes a step with γ drafts cheaper (unmeasured, or a
        fixed γ: prepare, as configured)."""
        if gamma == 0:
            return False
        if not self.adaptive or not self.ready:
            return True
        return self.best_overlapped_time(len(alphas), gamma, alphas) < self.step_time(len(alphas), gamma)

    def _rates(self, alphas: list[float], backlog: int, offers: list[float] | None = None) -> list[float]:
        """As the sequential policy's, each γ > 0 at the cheaper of a sequential or pipelined step
        (a pipelined step priced at every planned position: its ahead block is drafted whole)."""
        batch, widths = len(alphas), self._widths_for(alphas, offers)

        def rate(g: int) -> float:
            seconds = self.step_time(batch, g, backlog, widths)
            if g > 0:
                seconds = min(seconds, self.best_overlapped_time(batch, g, alphas, backlog))
            return sum(expected_tokens(a, g) for a in alphas) / max(seconds, 1e-9)

        return [rate(g) for g in range(self.max_gamma + 1)]
