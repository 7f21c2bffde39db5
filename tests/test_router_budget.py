"""The cloud budget: the realized share of router-decided escalations holds when the traffic mix
shifts, forced routes are counted apart, the per-minute cap binds, the state survives restarts,
and every decision carries the budget it was made under."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_node.learned.model import WEIGHTS_PATH, RouterModel
from edge_node.learned.router import LearnedRouter
from edge_node.router import CloudBudget, decide
from edge_node.routing import create_router
from mesh.config import RouterSettings
from mesh_app.router.data import Dataset, default_data_dir, load_dataset
from protocol.messages import InferRequest, RouteDecision

DATA = default_data_dir()
EASY = "What is the capital of France?"
HARD = (
    "Janet has 3 boxes with 12 apples each. She gives away 7 apples to each of her 4 friends, "
    "then buys twice as many as she has left. How many apples does she have now?"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Replay:
    """A router that gives each prompt a score computed beforehand by the shipped model, so a
    long stream runs through ``decide`` and the budget in milliseconds."""

    def __init__(self, scores: dict[str, float], budget: CloudBudget) -> None:
        self.scores = scores
        self.budget = budget

    @property
    def threshold(self) -> float:
        return self.budget.threshold

    def score(self, request: InferRequest) -> tuple[float, list[str]]:
        return self.scores[request.text()], []


@pytest.fixture(scope="module")
def shipped() -> RouterModel:
    return RouterModel.load(WEIGHTS_PATH)


@pytest.fixture(scope="module")
def data() -> Dataset:
    if not (DATA / "mmlu").is_dir():
        pytest.skip(f"routing data not found at {DATA}")
    return load_dataset(DATA)


@pytest.fixture(scope="module")
def shifting(data: Dataset, shipped: RouterModel) -> tuple[list[str], dict[str, float]]:
    """3,000 prompts: 1,500 from the subjects where the local model fails least, then 1,500
    from those where it fails most (each half shuffled), with their shipped-model scores."""
    subjects = sorted(set(data.subject.tolist()))
    rate = {s: float(data.local_fails[data.subject == s].mean()) for s in subjects}
    ranked = sorted(subjects, key=rate.__getitem__)
    rng = np.random.default_rng(11)
    halves = []
    for part in (ranked[: len(ranked) // 2], ranked[len(ranked) // 2 :]):
        index = np.flatnonzero(np.isin(data.subject, part))
        halves.append(index[rng.permutation(len(index))[:1500]])
    stream = [data.prompts[i] for i in np.r_[halves[0], halves[1]]]
    scores = {p: shipped.probability(p) for p in set(stream)}
    return stream, scores


def window_shares(decisions: list[str], size: int) -> list[float]:
    return [
        decisions[i : i + size].count("cloud") / size
        for i in range(0, len(decisions) - size + 1, size)
    ]


@pytest.mark.parametrize("share", [0.1, 0.3, 0.5])
@pytest.mark.parametrize("order", ["easy->hard", "hard->easy"])
def test_realized_share_holds_when_the_mix_shifts(
    shifting: tuple[list[str], dict[str, float]],
    shipped: RouterModel,
    share: float,
    order: str,
) -> None:
    stream, scores = shifting
    if order == "hard->easy":
        stream = stream[1500:] + stream[:1500]
    budget = CloudBudget(share, shipped.quantiles)
    decided = [decide(Replay(scores, budget), InferRequest(prompt=p)).decision for p in stream]
    # The old policy, a threshold fixed from the training distribution, drifts on this stream.
    fixed = shipped.threshold_for_share(share)
    drifting = ["cloud" if scores[p] >= fixed else "local" for p in stream]
    budgeted, unbudgeted = window_shares(decided, 250), window_shares(drifting, 250)
    print(f"\n{order} share {share}: per 250 prompts, budget {budgeted}, fixed {unbudgeted}")
    assert max(abs(s - share) for s in unbudgeted) > 0.05  # the stream does shift
    assert all(abs(s - share) <= 0.05 for s in budgeted), budgeted
    assert decided.count("cloud") / len(decided) == pytest.approx(share, abs=0.01)


def test_the_learned_router_holds_its_share_end_to_end(
    shifting: tuple[list[str], dict[str, float]],
) -> None:
    stream, _ = shifting
    router = create_router(RouterSettings(cloud_share=0.3))
    sample = stream[::3]  # 1,000 prompts, still easy first and hard second, scored for real
    decisions = [decide(router, InferRequest(prompt=p)) for p in sample]
    shares = window_shares([d.decision for d in decisions], 250)
    print(f"\nlearned router, cloud_share 0.3, per 250 prompts: {shares}")
    assert all(abs(s - 0.3) <= 0.05 for s in shares), shares
    last = decisions[-1].budget
    assert last is not None and last["auto"] == len(sample) and last["window"] == 500
    tail = [d.decision for d in decisions[-500:]]
    assert last["realized"] == pytest.approx(tail.count("cloud") / 500, abs=1e-4)


@pytest.mark.parametrize(
    "stream",
    ["constant", "blocks", "ascending", "descending", "alternating"],
)
def test_escalations_stay_within_the_bound_on_adversarial_traffic(stream: str) -> None:
    """Over any n consecutive decisions the count strays from share * n by at most 1/gain + 1."""
    n = 4000
    rng = np.random.default_rng(5)
    scores = {
        "constant": np.full(n, 0.42),
        "blocks": np.repeat(rng.choice([0.01, 0.99], n // 400), 400),
        "ascending": np.sort(rng.random(n)),
        "descending": np.sort(rng.random(n))[::-1],
        "alternating": np.tile([0.05, 0.95], n // 2),
    }[stream]
    budget = CloudBudget(0.3, [0.1, 0.3, 0.5])
    escalated = np.array([budget.decide(float(s))[0] for s in scores], float)
    cumulative = np.r_[0.0, np.cumsum(escalated - 0.3)]
    worst = float(cumulative.max() - cumulative.min())  # over every stretch of the stream
    assert worst <= 1 / budget.gain + 1 + 1e-9
    assert abs(escalated.mean() - 0.3) < 0.01


def test_forced_routes_are_counted_but_not_in_the_share(shipped: RouterModel) -> None:
    router = LearnedRouter(shipped, 0.0, CloudBudget(0.3, shipped.quantiles))
    assert router.budget is not None
    before = router.threshold
    for _ in range(40):
        forced = decide(router, InferRequest(prompt=HARD, route="cloud"))
        assert forced.decision == "cloud" and forced.forced and forced.score is None
    decide(router, InferRequest(prompt=EASY, route="local"))
    assert router.threshold == before  # forced traffic moves nothing
    auto = decide(router, InferRequest(prompt=EASY))
    assert auto.budget is not None
    assert auto.budget["forced_cloud"] == 40 and auto.budget["forced_local"] == 1
    assert auto.budget["auto"] == 1 and auto.budget["cloud"] == 0
    assert auto.budget["realized"] == 0.0 and auto.budget["window"] == 1


def test_the_cap_answers_locally_once_reached_and_recovers(shipped: RouterModel) -> None:
    clock = Clock()
    settings = RouterSettings(threshold=0.2, cloud_cap_per_minute=3)
    router = LearnedRouter.from_settings(settings)
    assert router.budget is not None
    router.budget._clock = clock
    first = [decide(router, InferRequest(prompt=HARD)) for _ in range(5)]
    assert [d.decision for d in first] == ["cloud"] * 3 + ["local"] * 2
    capped = first[-1]
    assert capped.budget is not None and capped.budget["capped"] is True
    assert capped.budget["cap_used"] == 3 and capped.budget["cap_per_minute"] == 3
    assert "cap of 3 escalations per minute" in capped.reason
    assert capped.score is not None and capped.threshold is not None
    assert capped.score >= capped.threshold  # the router wanted the cloud; the cap said no
    forced = decide(router, InferRequest(prompt=HARD, route="cloud"))
    assert forced.decision == "cloud"  # a client's explicit route is never capped
    clock.now += 30
    assert decide(router, InferRequest(prompt=HARD)).decision == "local"
    clock.now += 31  # the first three escalations are now more than a minute old
    again = decide(router, InferRequest(prompt=HARD))
    assert again.decision == "cloud" and again.budget is not None
    assert again.budget["cap_used"] == 1 and again.budget["capped"] is False


def test_the_budget_survives_a_restart(tmp_path: Path, shipped: RouterModel) -> None:
    state = tmp_path / "state" / "budget.json"
    settings = RouterSettings(budget_state=str(state))
    router = create_router(settings)
    prompts = [EASY] * 100 + [HARD] * 100
    for prompt in prompts:
        decide(router, InferRequest(prompt=prompt))
    assert isinstance(router, LearnedRouter) and router.budget is not None
    assert state.is_file()  # written as it goes, without a shutdown hook
    router.budget.save()
    restarted = create_router(settings)
    assert isinstance(restarted, LearnedRouter) and restarted.budget is not None
    assert restarted.budget.restored
    assert restarted.threshold == pytest.approx(router.threshold)
    assert restarted.budget.snapshot() == router.budget.snapshot()
    fresh = create_router(RouterSettings())
    assert restarted.threshold != pytest.approx(fresh.threshold)  # it did learn something

    # Other weights score differently: their saved state is not reused.
    other = tmp_path / "other.json"
    body = json.loads(WEIGHTS_PATH.read_text())
    body["bias"] = [b + 0.5 for b in body["bias"]]
    other.write_text(json.dumps(body))
    elsewhere = create_router(RouterSettings(budget_state=str(state), weights=str(other)))
    assert isinstance(elsewhere, LearnedRouter) and elsewhere.budget is not None
    assert not elsewhere.budget.restored and elsewhere.budget.totals["auto"] == 0

    for broken in ("", "{", '{"format": "mesh-router-budget/1"}', "[1, 2]"):
        state.write_text(broken)
        again = create_router(settings)
        assert isinstance(again, LearnedRouter) and again.budget is not None
        assert not again.budget.restored
        assert again.threshold == pytest.approx(fresh.threshold)
        assert decide(again, InferRequest(prompt=HARD)).decision == "cloud"


def test_an_unwritable_state_file_does_not_stop_routing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    router = create_router(RouterSettings(budget_state=str(blocker / "budget.json")))
    assert isinstance(router, LearnedRouter) and router.budget is not None
    for _ in range(60):
        decide(router, InferRequest(prompt=HARD))
    assert not router.budget.save()


def test_every_decision_explains_itself_with_its_budget() -> None:
    router = create_router(RouterSettings())
    hard = decide(router, InferRequest(prompt=HARD))
    assert hard.decision == "cloud" and hard.score is not None and hard.threshold is not None
    assert f"{hard.score:.2f} >= {hard.threshold:.2f}" in hard.reason
    assert hard.budget is not None
    assert hard.budget["policy"] == "share" and hard.budget["target"] == 0.3
    assert hard.budget["realized"] == 1.0 and hard.budget["cap_per_minute"] is None
    wire = RouteDecision.model_validate_json(hard.model_dump_json())
    assert wire == hard
    old_peer = RouteDecision.model_validate({"decision": "local", "reason": "x"})
    assert old_peer.budget is None  # decisions from edges without a budget still decode

    fixed = create_router(RouterSettings(threshold=0.6))
    decisions = [decide(fixed, InferRequest(prompt=p)) for p in (HARD, EASY, HARD)]
    assert {d.threshold for d in decisions} == {0.6}
    assert decisions[-1].budget is not None and decisions[-1].budget["policy"] == "threshold"

    heuristic = create_router(RouterSettings(kind="heuristic", cloud_cap_per_minute=5))
    decision = decide(heuristic, InferRequest(prompt=HARD))
    assert decision.budget is not None and decision.budget["cap_per_minute"] == 5
