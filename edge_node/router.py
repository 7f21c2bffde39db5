"""The on-device router: decides per request whether the local model answers or the cloud does.

Every router returns a :class:`RouteDecision` with a score (higher means escalate), the threshold
it was compared with, a short reason a person can read, and the state of the cloud budget.

The cloud budget (:class:`CloudBudget`) turns a target share of cloud calls into a threshold that
follows the traffic: it is the matching quantile of the most recent scores, nudged by how far the
realized share has strayed from the target, so the share holds when the traffic mix shifts.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from protocol.messages import InferRequest, RouteDecision, route_decision, unicode_text

BUDGET_FORMAT = "mesh-router-budget/1"
BudgetValue = float | int | str | bool | None


@runtime_checkable
class Router(Protocol):
    @property
    def threshold(self) -> float:
        """The score at or above which the next router-decided request escalates."""
        ...

    def score(self, request: InferRequest) -> tuple[float, list[str]]:
        """Score of ``request`` (higher: escalate), and the main reasons."""
        ...


class CloudBudget:
    """Keeps the share of router-decided escalations at ``share`` on any traffic mix.

    The threshold is a quantile of the last ``window`` scores (seeded with the training
    distribution) at level ``1 - share + bias``, where ``bias`` integrates the error: each
    escalation adds ``gain * (1 - share)``, each local answer subtracts ``gain * share``. The
    quantile follows a shift in the mix within a few dozen requests, and the integral pays back
    what it let through meanwhile. Since ``bias`` stays within a range of width ``1 + gain``,
    over ANY ``n`` consecutive decisions the escalations differ from ``share * n`` by at most
    ``1 / gain + 1`` (34 at the default gain): within 5 points for every n >= 690, whatever the
    traffic, and in practice far less (README, "The router").

    With ``threshold`` set, the threshold is fixed instead (nothing tracks; shares are still
    counted). ``cap_per_minute`` bounds router-decided escalations in any 60 s; beyond it the
    local model answers (the integral counts a capped request as the escalation it asked for,
    so a binding cap does not wind it up; the bound above is on those requests). Forced
    routes (``route=local|cloud``) are counted, never capped, and do not enter the share. With
    ``state_file`` set, the state survives restarts.
    """

    def __init__(
        self,
        share: float,
        seed_scores: Iterable[float] = (),
        *,
        threshold: float | None = None,
        window: int = 30,
        gain: float = 0.03,
        report_window: int = 500,
        cap_per_minute: int | None = None,
        state_file: str | Path | None = None,
        fingerprint: str = "",
        save_every: int = 50,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.share = min(1.0, max(0.0, share))
        self.fixed = threshold
        self.window = max(1, window)
        self.gain = gain
        self.cap = cap_per_minute
        self.state_file = Path(state_file).expanduser() if state_file else None
        self.fingerprint = fingerprint
        self.save_every = max(1, save_every)
        self._clock = clock
        self._order: deque[float] = deque()
        self._sorted: list[float] = []
        self._seed(seed_scores)
        self.bias = 0.0
        """Integral correction: the threshold sits at quantile ``1 - share + bias``."""
        self._recent: deque[int] = deque(maxlen=max(1, report_window))
        self._recent_cloud = 0
        self._cap_times: deque[float] = deque()
        self.totals = {
            "auto": 0,
            "cloud": 0,
            "capped": 0,
            "forced_local": 0,
            "forced_cloud": 0,
            "mid_answer": 0,
            "local_busy": 0,
        }
        self.restored = self._load()
        self._unsaved = 0

    # -- the threshold ---------------------------------------------------------------------
    def _seed(self, scores: Iterable[float]) -> None:
        """Fill the window with ``window`` evenly spaced quantiles of ``scores`` (a sorted
        quantile table such as the training distribution's, or any sample)."""
        values = sorted(float(s) for s in scores)
        if not values:
            return
        for i in range(self.window):
            self._push(_interpolate(values, (i + 0.5) / self.window))

    def _push(self, score: float) -> None:
        self._order.append(score)
        bisect.insort(self._sorted, score)
        if len(self._order) > self.window:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    @property
    def level(self) -> float:
        """The share of recent scores the threshold lets through (target minus correction)."""
        return min(1.0, max(0.0, self.share - self.bias))

    @property
    def threshold(self) -> float:
        if self.fixed is not None:
            return self.fixed
        level = self.level
        if level <= 0.0 or not self._sorted:
            return 1.0
        if level >= 1.0:
            return 0.0
        return _interpolate(self._sorted, 1.0 - level)

    # -- decisions -------------------------------------------------------------------------
    def decide(self, score: float) -> tuple[bool, float, bool]:
        """Account for one router-decided request: (escalate, threshold used, capped)."""
        threshold = self.threshold
        wanted = score >= threshold and not (self.fixed is None and self.level <= 0.0)
        capped = False
        now = self._clock()
        if wanted:
            capped = self._cap_full(now)
        escalate = wanted and not capped
        if escalate and self.cap is not None:
            self._cap_times.append(now)
        if self.fixed is None:
            self._push(score)
            # The controller is judged on what it asked for: a binding cap must not wind it up.
            # Not clamped: the level is, and at level 0 nothing escalates (bias falls), at
            # level 1 everything does (bias rises), so bias stays within 1 + gain anyway.
            self.bias += self.gain * (float(wanted) - self.share)
        if len(self._recent) == self._recent.maxlen:
            self._recent_cloud -= self._recent[0]
        self._recent.append(int(escalate))
        self._recent_cloud += int(escalate)
        self.totals["auto"] += 1
        self.totals["cloud"] += int(escalate)
        self.totals["capped"] += int(capped)
        self._changed()
        return escalate, threshold, capped

    def record_forced(self, route: str) -> None:
        self.totals[f"forced_{route}"] += 1
        self._changed()

    def mid_answer(self) -> bool:
        """Whether a request the router kept local may escalate on its own low confidence:
        not past the per-minute cap. Counted apart (``mid_answer``), on top of the router's
        share; an allowed one takes a place under the cap."""
        return self.beyond_share("mid_answer")

    def local_busy(self) -> bool:
        """Whether a request the router kept local may go to the cloud because the local model
        has no room for it (a slot or a place in its wait queue): as :meth:`mid_answer`,
        counted as ``local_busy``."""
        return self.beyond_share("local_busy")

    def beyond_share(self, kind: str) -> bool:
        """An escalation the router did not choose, counted as ``kind`` on top of its share:
        whether the per-minute cap allows it (then it takes a place under the cap)."""
        if self.cap is not None:
            now = self._clock()
            if self._cap_full(now):
                self.totals["capped"] += 1
                self._changed()
                return False
            self._cap_times.append(now)
        self.totals[kind] += 1
        self._changed()
        return True

    def _cap_full(self, now: float) -> bool:
        """Whether the per-minute cap is reached now (False without one); forgets the places
        taken more than a minute ago."""
        if self.cap is None:
            return False
        while self._cap_times and self._cap_times[0] <= now - 60.0:
            self._cap_times.popleft()
        return len(self._cap_times) >= self.cap

    def snapshot(self, capped: bool = False) -> dict[str, BudgetValue]:
        """The budget as a RouteDecision carries it (see README, "The router")."""
        recent = len(self._recent)
        used = None
        if self.cap is not None:
            now = self._clock()
            used = sum(1 for t in self._cap_times if t > now - 60.0)
        return {
            "policy": "threshold" if self.fixed is not None else "share",
            "target": None if self.fixed is not None else self.share,
            "realized": round(self._recent_cloud / recent, 4) if recent else None,
            "window": recent,
            "level": None if self.fixed is not None else round(self.level, 4),
            "auto": self.totals["auto"],
            "cloud": self.totals["cloud"],
            "forced_local": self.totals["forced_local"],
            "forced_cloud": self.totals["forced_cloud"],
            "mid_answer": self.totals["mid_answer"],
            "local_busy": self.totals["local_busy"],
            "cap_per_minute": self.cap,
            "cap_used": used,
            "capped": capped,
        }

    # -- persistence -----------------------------------------------------------------------
    def _changed(self) -> None:
        self._unsaved += 1
        if self.state_file is not None and self._unsaved >= self.save_every:
            self.save()

    def save(self) -> bool:
        """Write the state file atomically; False (and routing unaffected) when it cannot."""
        if self.state_file is None:
            return False
        body = {
            "format": BUDGET_FORMAT,
            "model": self.fingerprint,
            "share": self.share,
            "scores": list(self._order),
            "bias": self.bias,
            "recent": "".join(str(r) for r in self._recent),
            "totals": self.totals,
            "cap_times": [round(t, 3) for t in self._cap_times],
            "saved_at": round(self._clock(), 3),
        }
        tmp = self.state_file.with_name(f".{self.state_file.name}.{os.getpid()}.tmp")
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(body, separators=(",", ":")))
            os.replace(tmp, self.state_file)
        except OSError:
            return False
        self._unsaved = 0
        return True

    def _load(self) -> bool:
        """Restore a saved state made with the same weights; anything else starts fresh."""
        if self.state_file is None:
            return False
        try:
            body = json.loads(self.state_file.read_text())
            if body.get("format") != BUDGET_FORMAT or body.get("model") != self.fingerprint:
                return False
            scores = [float(s) for s in body["scores"]][-self.window :]
            recent = [int(c == "1") for c in str(body["recent"])]
            totals = {k: int(body["totals"].get(k, 0)) for k in self.totals}
            bias = float(body["bias"])
            cap_times = [float(t) for t in body.get("cap_times", [])]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return False
        for score in scores:  # the oldest seed values make room for the saved scores
            self._push(score)
        if math.isclose(float(body.get("share", -1.0)), self.share):
            self.bias = min(self.share + self.gain, max(self.share - 1.0 - self.gain, bias))
            for r in recent[-(self._recent.maxlen or 1) :]:
                self._recent.append(r)
            self._recent_cloud = sum(self._recent)
        self.totals = totals
        self._cap_times.extend(sorted(cap_times))
        return True


def _interpolate(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolating linearly between neighbours."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def budget_of(router: Router) -> CloudBudget | None:
    """The router's cloud budget (routers without one have none)."""
    budget: CloudBudget | None = getattr(router, "budget", None)
    return budget


def decide(router: Router, request: InferRequest) -> RouteDecision:
    """Apply the client's override, else the router's score against its (budgeted) threshold."""
    budget = budget_of(router)
    if request.route != "auto":
        if budget is not None:
            budget.record_forced(request.route)
        return route_decision(
            request.route,
            f"client asked for route={request.route}",
            budget.snapshot() if budget is not None else None,
            forced=True,
        )
    score, reasons = router.score(request)
    if not 0.0 <= score <= 1.0:  # NaN too: a router's fault is told here, not at the client
        raise ValueError(f"the router's score {score!r} is not a probability")
    if budget is None:
        threshold = router.threshold
        escalate, capped = score >= threshold, False
    else:
        escalate, threshold, capped = budget.decide(score)
    decision: Literal["local", "cloud"] = "cloud" if escalate else "local"
    signals = ", ".join(reasons[:3])
    if escalate:
        why = f"score {score:.2f} >= {threshold:.2f}: {signals or 'overall profile'}"
    elif capped and budget is not None:
        why = (
            f"score {score:.2f} >= {threshold:.2f} ({signals or 'overall profile'}), but the "
            f"cloud cap of {budget.cap} escalations per minute is reached"
        )
    else:
        detail = f"weak signals: {signals}" if signals else "no complexity signal"
        why = f"score {score:.2f} < {threshold:.2f} ({detail})"
    return route_decision(  # not validated: the edge's own values, and checked
        decision,
        unicode_text(why),
        budget.snapshot(capped) if budget is not None else None,
        score=round(score, 4),
        threshold=round(threshold, 4),
    )


_MULTI_STEP = re.compile(
    r"\b(step[- ]by[- ]step|explain|prove|derive|why|compare|analy[sz]e|calculate|solve|"
    r"how many|how much|design|implement|write (a|an|the) (function|program|essay|proof))\b",
    re.IGNORECASE,
)
# Each number is tried from its first digit only (``(?<!\d)``): from every digit of a long run
# of them, the search backtracked through the rest (20,000 digits: 3 s on the event loop).
_MATH = re.compile(r"(?<!\d)\d+(?:\.\d+)?\s*(?:[-+*/^=%]\s*\d|(?:%|percent|dollars|km|hours)\b)")
SCORED_CHARS = 16_384
"""The heuristic router reads a prompt's first characters only (as the learned one does)."""
_CODE = re.compile(r"```|\bdef \w+\(|\bclass \w+|;\s*$|#include|\bSELECT\b", re.MULTILINE)


class HeuristicRouter:
    """A transparent first router: length, math, code and multi-step wording, as a logistic
    score. Cheap (a few regex passes), explainable, and replaced by the learned router later."""

    def __init__(self, threshold: float = 0.5, budget: CloudBudget | None = None) -> None:
        self.threshold = threshold
        self.budget = budget

    def score(self, request: InferRequest) -> tuple[float, list[str]]:
        full = request.text()
        words = len(full.split())
        text = full[:SCORED_CHARS]
        signals: list[tuple[float, str]] = []
        if words > 40:
            signals.append((min(2.0, words / 80), f"long prompt ({words} words)"))
        if _MATH.search(text):
            signals.append((1.2, "arithmetic"))
        if _CODE.search(text):
            signals.append((1.2, "code"))
        if _MULTI_STEP.search(text):
            signals.append((1.0, "multi-step wording"))
        if request.turns() > 3:
            signals.append((0.5, f"{request.turns()} turns"))
        logit = -1.6 + sum(weight for weight, _ in signals)
        signals.sort(key=lambda s: -s[0])
        return 1.0 / (1.0 + math.exp(-logit)), [why for _, why in signals]
