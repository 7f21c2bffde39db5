"""``mesh bench failover``'s hub part names each answer that stood still, not only the worst
silence: the last stop needed a local print to see which answers a leader kill held up."""

from __future__ import annotations

from mesh.testing.chaos import Outcome
from mesh_app.bench import failover


def _answer(*gaps: float, attempts: int = 1) -> Outcome:
    times = [0.0]
    for gap in gaps:
        times.append(times[-1] + gap)
    return Outcome("correct", attempts=attempts, token_times=times)


def test_the_hub_part_names_each_answer_that_stood_still() -> None:
    assert [failover.via_of(i) for i in range(failover.REQUESTS)] == ["sdk", "sdk", "edge", "edge"]
    outcomes = [_answer(0.02, 0.02), _answer(0.02, 0.23, 0.02, attempts=2), _answer(0.099)]
    outcomes.append(_answer(0.02, 0.63))
    still = failover.stood_still(outcomes, "leader kill", 2)
    assert still == [
        {"fault": "leader kill", "step": 2, "via": "sdk", "s": 0.23, "attempts": 2},
        {"fault": "leader kill", "step": 2, "via": "edge", "s": 0.63, "attempts": 1},
    ]
    hub = {"election_s": [4.2], "stood_still": still}
    text = failover.render({"hub": hub})
    assert (
        "stood still 0.1 s or longer: leader kill (step 2) via sdk 0.23 s, 2 attempt(s), "
        "leader kill (step 2) via edge 0.63 s, 1 attempt(s)"
    ) in text
    quiet = failover.render({"hub": {"election_s": [4.2], "stood_still": []}})
    assert "stood still 0.1 s or longer: none" in quiet
