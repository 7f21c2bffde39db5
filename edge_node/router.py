"""The on-device router: decides per request whether the local model answers or the cloud does.

Every router returns a :class:`RouteDecision` with a score (probability the local model would
fail), the threshold it was compared with, and a short reason a person can read.
"""

from __future__ import annotations

import math
import re
from typing import Literal, Protocol, runtime_checkable

from protocol.messages import InferRequest, RouteDecision


@runtime_checkable
class Router(Protocol):
    threshold: float

    def score(self, request: InferRequest) -> tuple[float, list[str]]:
        """Probability that the local model fails on ``request``, and the main reasons."""
        ...


def decide(router: Router, request: InferRequest) -> RouteDecision:
    """Apply the client's override, else the router's score against its threshold."""
    if request.route != "auto":
        return RouteDecision(
            decision=request.route, forced=True, reason=f"client asked for route={request.route}"
        )
    score, reasons = router.score(request)
    decision: Literal["local", "cloud"] = "cloud" if score >= router.threshold else "local"
    signals = ", ".join(reasons[:3])
    if decision == "cloud":
        why = f"score {score:.2f} >= {router.threshold:.2f}: {signals or 'overall profile'}"
    else:
        detail = f"weak signals: {signals}" if signals else "no complexity signal"
        why = f"score {score:.2f} < {router.threshold:.2f} ({detail})"
    return RouteDecision(
        decision=decision,
        score=round(score, 4),
        threshold=router.threshold,
        reason=why,
    )


_MULTI_STEP = re.compile(
    r"\b(step[- ]by[- ]step|explain|prove|derive|why|compare|analy[sz]e|calculate|solve|"
    r"how many|how much|design|implement|write (a|an|the) (function|program|essay|proof))\b",
    re.IGNORECASE,
)
_MATH = re.compile(r"\d+\s*[-+*/^=%]\s*\d+|\b\d+(\.\d+)?\s*(%|percent|dollars|km|hours)\b")
_CODE = re.compile(r"```|\bdef \w+\(|\bclass \w+|;\s*$|#include|\bSELECT\b", re.MULTILINE)


class HeuristicRouter:
    """A transparent first router: length, math, code and multi-step wording, as a logistic
    score. Cheap (a few regex passes), explainable, and replaced by the learned router later."""

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = threshold

    def score(self, request: InferRequest) -> tuple[float, list[str]]:
        text = request.text()
        words = len(text.split())
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
