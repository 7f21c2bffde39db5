"""The local model's own confidence over the first tokens of its answer, and the rule that
escalates a local answer to the cloud when it runs low (mid-answer escalation).

Pure: readings in, a decision out. The readings come from the backend
(:class:`mesh.backends.base.ScoringBackend`): per token, the entropy of the model's next-token
distribution and the log-probability of its most likely token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mesh.config import ConfidenceSettings


@dataclass(frozen=True)
class Confidence:
    tokens: int
    """Tokens read."""
    mean_entropy: float
    """Mean entropy of the next-token distribution, in nats (higher: less sure)."""
    max_entropy: float
    mean_logprob: float
    """Mean log-probability of the most likely next token (lower: less sure)."""
    min_logprob: float

    def as_dict(self) -> dict[str, float | int]:
        return {k: v if isinstance(v, int) else round(v, 4) for k, v in asdict(self).items()}


def summarise(readings: Sequence[tuple[float, float]]) -> Confidence | None:
    """The confidence over ``readings`` (entropy, top log-probability); None without any."""
    if not readings:
        return None
    entropies = [e for e, _ in readings]
    tops = [t for _, t in readings]
    return Confidence(
        tokens=len(readings),
        mean_entropy=sum(entropies) / len(entropies),
        max_entropy=max(entropies),
        mean_logprob=sum(tops) / len(tops),
        min_logprob=min(tops),
    )


class ConfidenceGate:
    """Escalates a local answer whose first ``window_tokens`` tokens were drawn with a mean
    entropy above ``max_mean_entropy``."""

    def __init__(self, settings: ConfidenceSettings) -> None:
        self.settings = settings

    @property
    def window(self) -> int:
        return self.settings.window_tokens

    def escalate(self, confidence: Confidence) -> tuple[bool, str]:
        """Whether to hand the request to the cloud, and why (for the answer's explanation)."""
        limit = self.settings.max_mean_entropy
        low = confidence.mean_entropy > limit
        verdict = ">" if low else "<="
        return low, (
            f"local confidence {'low' if low else 'ok'}: mean entropy "
            f"{confidence.mean_entropy:.2f} {verdict} {limit:g} nats over the first "
            f"{confidence.tokens} tokens"
        )
