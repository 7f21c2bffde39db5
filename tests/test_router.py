"""The learned router: features, determinism, calibration, threshold policy, bad input, metrics,
and a real-mesh check that decisions and their reasons reach the client."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_node.learned.features import MAX_CHARS, SCALAR_NAMES, extract
from edge_node.learned.model import WEIGHTS_PATH, RouterModel
from edge_node.learned.router import LearnedRouter
from edge_node.router import decide
from edge_node.routing import create_router
from mesh.config import RouterSettings
from mesh_app.router.data import Dataset, default_data_dir, load_dataset
from mesh_app.router.evaluate import calibration, evaluate, roc_auc, routing_metrics
from mesh_app.router.train import TrainConfig, stratified_folds, train_on
from protocol.errors import MeshError
from protocol.messages import InferRequest
from tests.helpers import modules_loaded_by

DATA = default_data_dir()
needs_data = pytest.mark.skipif(
    not (DATA / "mmlu").is_dir(),
    reason=f"routing data not found at {DATA} (it lives in shared/routing beside the checkout)",
)
SIMPLE = "What is the capital of France?"
MATH = (
    "Janet has 3 boxes with 12 apples each. She gives away 7 apples to each of her 4 friends, "
    "then buys twice as many as she has left. How many apples does she have now?"
)


@pytest.fixture(scope="module")
def data() -> Dataset:
    if not (DATA / "mmlu").is_dir():
        pytest.skip(f"routing data not found at {DATA}")
    return load_dataset(DATA)


@pytest.fixture(scope="module")
def shipped() -> RouterModel:
    return RouterModel.load(WEIGHTS_PATH)


# -- features ----------------------------------------------------------------------------
def test_features_read_prompt_structure() -> None:
    mc = extract("Which of the following is NOT a prime?\nA. 2\nB. 3\nC. 4\nD. 5")
    named = dict(zip(SCALAR_NAMES, mc.scalars, strict=True))
    assert named["multiple choice"] == 1.0
    assert named["numeric options"] == 1.0
    assert named["negation (NOT/EXCEPT/LEAST)"] == 1.0
    plain = dict(zip(SCALAR_NAMES, extract("Say hi").scalars, strict=True))
    assert plain["multiple choice"] == 0.0 and plain["numbers"] == 0.0
    chat = dict(zip(SCALAR_NAMES, extract("a b", turns=4).scalars, strict=True))
    assert chat["conversation turns"] == pytest.approx(math.log(4))
    law = extract(
        "Is the defendant liable?\nA. Yes, because he consented.\nB. Yes, unless he was warned."
        "\nC. No, because he did not consent.\nD. No, since the statute bars the claim."
    )
    named = dict(zip(SCALAR_NAMES, law.scalars, strict=True))
    assert named["parallel options (same first word)"] == 1.0  # Yes/Yes, No/No
    assert named["conditional options (because/if/unless)"] == 1.0
    assert 0.1 < named["similar options"] < 0.5
    distinct = dict(zip(SCALAR_NAMES, mc.scalars, strict=True))
    assert distinct["similar options"] == 0.0
    assert distinct["parallel options (same first word)"] == 0.0


def test_feature_hashing_is_the_same_in_every_process() -> None:
    # Python's str hash is salted per process; the router must not depend on it.
    code = (
        "from edge_node.learned.features import extract;"
        "print(extract('the quick brown fox jumps').buckets.tolist())"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).resolve().parent.parent,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1
    assert runs.pop().strip() == str(extract("the quick brown fox jumps").buckets.tolist())


def test_the_edge_loads_only_what_scores_a_prompt() -> None:
    """Training, evaluation and the routing data are the `mesh router` tool's (mesh_app.router):
    the edge's router, made and asked as the edge does, imports none of them."""
    code = (
        "from edge_node.routing import create_router\n"
        "from mesh.config import RouterSettings\n"
        "from protocol.messages import InferRequest\n"
        "create_router(RouterSettings()).score(InferRequest(prompt='What is 2+2?'))"
    )
    loaded = [m for m in modules_loaded_by(code) if m.startswith(("edge_node.learned", "mesh_app"))]
    runtime = ["", ".features", ".model", ".router"]
    assert loaded == [f"edge_node.learned{m}" for m in runtime]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "\x00\x01\x02",
        "🙂" * 500,
        "abc \ud800 lone surrogate",
        "x" * 1_000_000,
        "Ω≈ç√∫ 中文 العربية",
        "\n" * 10_000,
    ],
    ids=["empty", "blank", "control", "emoji", "surrogate", "huge", "scripts", "newlines"],
)
def test_any_text_gets_a_probability(shipped: RouterModel, text: str) -> None:
    probability, reasons = shipped.explain(text)
    assert 0.0 <= probability <= 1.0
    assert all(isinstance(r, str) for r in reasons)


def test_huge_prompts_are_read_up_to_a_bound(shipped: RouterModel) -> None:
    head = ("word " * (MAX_CHARS // 5 + 1))[:MAX_CHARS]
    huge = extract(head + " tail" * 200_000)
    bounded = extract(head)
    np.testing.assert_array_equal(huge.buckets, bounded.buckets)  # only the first MAX_CHARS
    assert huge.scalars[0] > bounded.scalars[0]  # but the full length still counts


def test_non_text_prompts_are_rejected_before_the_router() -> None:
    from protocol.codec import decode_request

    for payload in (b'{"prompt": 12345}', b'{"prompt": ["a"]}', b'{"prompt": {"x": 1}}'):
        with pytest.raises(MeshError) as excinfo:
            decode_request(payload)
        assert excinfo.value.code.value == "invalid_request"


# -- model, policy, explanations ---------------------------------------------------------
def test_threshold_policy(shipped: RouterModel) -> None:
    by_share = LearnedRouter.from_settings(RouterSettings(cloud_share=0.3))
    # A fresh budget starts from the training distribution's threshold, then tracks traffic.
    assert by_share.threshold == pytest.approx(shipped.threshold_for_share(0.3), abs=0.01)
    assert LearnedRouter.from_settings(RouterSettings(threshold=0.8)).threshold == 0.8
    assert (
        LearnedRouter.from_settings(RouterSettings(threshold=0.8, cloud_share=0.1)).threshold == 0.8
    )
    thresholds = [shipped.threshold_for_share(s) for s in (0.0, 0.1, 0.3, 0.6, 1.0)]
    assert thresholds == sorted(thresholds, reverse=True)  # more cloud, lower bar


@needs_data
def test_cloud_share_target_is_met_on_typical_prompts(data: Dataset) -> None:
    sample = data.prompts[::9]
    for share in (0.2, 0.5):
        router = LearnedRouter.from_settings(RouterSettings(cloud_share=share))
        routed = [decide(router, InferRequest(prompt=p)).decision for p in sample]
        assert routed.count("cloud") / len(routed) == pytest.approx(share, abs=0.05)


def test_decisions_explain_themselves_and_honour_overrides() -> None:
    router = create_router(RouterSettings())  # the edge's default: learned, 30% cloud share
    assert isinstance(router, LearnedRouter)
    simple = decide(router, InferRequest(prompt=SIMPLE))
    assert simple.decision == "local" and simple.score is not None and simple.score < 0.2
    assert "no complexity signal" in simple.reason
    hard = decide(router, InferRequest(prompt=MATH))
    assert hard.decision == "cloud" and not hard.forced
    assert hard.threshold is not None and hard.score is not None
    assert "numbers" in hard.reason and f"{hard.score:.2f} >= {hard.threshold:.2f}" in hard.reason
    forced = decide(router, InferRequest(prompt=MATH, route="local"))
    assert forced.decision == "local" and forced.forced and forced.score is None


def test_missing_or_foreign_weights_fail_clearly(tmp_path: Path) -> None:
    bogus = tmp_path / "w.json"
    bogus.write_text('{"format": "something-else"}')
    for path in (bogus, tmp_path / "absent.json"):
        with pytest.raises(MeshError) as excinfo:
            create_router(RouterSettings(weights=str(path)))
        assert "mesh router train" in str(excinfo.value)


def test_weights_round_trip(shipped: RouterModel, tmp_path: Path) -> None:
    shipped.save(tmp_path / "copy.json")
    again = RouterModel.load(tmp_path / "copy.json")
    for text in (SIMPLE, MATH, ""):
        assert again.probability(text) == pytest.approx(shipped.probability(text), abs=1e-9)
    assert WEIGHTS_PATH.stat().st_size < 256 * 1024  # small enough to ship


def test_weights_of_the_one_head_format_still_load(shipped: RouterModel, tmp_path: Path) -> None:
    """mesh-router/1 files (one logistic head, flat lists) load and score as that head."""
    body = json.loads(shipped.to_json())
    head = 1  # keep the "escalation helps" head alone, as a v1 file would hold one head
    v1 = {
        **body,
        "format": "mesh-router/1",
        "bucket_weights": body["bucket_weights"][head],
        "scalar_weights": body["scalar_weights"][head],
        "bias": body["bias"][head],
    }
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    old = RouterModel.load(tmp_path / "v1.json")
    assert old.bucket_weights.shape == (len(old.buckets), 1)
    features = extract(MATH)
    z = shipped.head_logits(features)[head]
    a, b = shipped.platt
    assert old.probability(MATH) == pytest.approx(1 / (1 + math.exp(-(a * z + b))))
    assert isinstance(old.explain(MATH)[1], list)


# -- training: determinism, reproducibility, calibration -----------------------------------
@needs_data
@pytest.mark.slow
def test_training_is_deterministic(data: Dataset) -> None:
    subset = data.subset(np.arange(0, len(data.prompts), 4))
    assert train_on(subset).to_json() == train_on(subset).to_json()


@needs_data
@pytest.mark.slow
def test_both_targets_train_a_probability_of_local_failure(data: Dataset) -> None:
    subset = data.subset(np.arange(0, len(data.prompts), 4))
    binary = train_on(subset, TrainConfig(target="local_wrong"))
    three = train_on(subset, TrainConfig(target="three_class"))
    assert binary.bucket_weights.shape[1] == 1 and three.bucket_weights.shape[1] == 2
    assert three.meta["classes"] == ["local right", "both wrong", "escalation helps"]
    for model in (binary, three):
        assert model.probability(MATH) > model.probability(SIMPLE)
    with pytest.raises(ValueError, match="unknown router target"):
        train_on(subset, TrainConfig(target="nonsense"))


@needs_data
@pytest.mark.slow
def test_shipped_weights_are_reproduced_by_the_train_command(
    data: Dataset, shipped: RouterModel
) -> None:
    """Up to the float arithmetic of the machine: numpy and OpenBLAS pick their kernels by the
    CPU and the release, and sums round differently with them. Fitted until the gradient is
    flat (``mesh_app.router.train.GTOL``), the same rows in another order move the weights by
    under 1e-4 here. Before, the fit stopped on the loss's change, where the rounding had led it:
    0.014 apart on an AMD EPYC, then 0.039 with numpy 2.4 (the CI failure)."""
    rebuilt = train_on(data)
    np.testing.assert_array_equal(rebuilt.buckets, shipped.buckets)
    np.testing.assert_allclose(rebuilt.bucket_weights, shipped.bucket_weights, atol=2e-3)
    np.testing.assert_allclose(rebuilt.scalar_weights, shipped.scalar_weights, atol=2e-3)
    for text in data.prompts[::50]:
        assert rebuilt.probability(text) == pytest.approx(shipped.probability(text), abs=1e-3)


@needs_data
@pytest.mark.slow
def test_probabilities_are_calibrated_on_unseen_prompts(data: Dataset) -> None:
    folds = stratified_folds(data.outcome, 5, seed=7)
    train_idx, test_idx = np.flatnonzero(folds != 0), np.flatnonzero(folds == 0)
    model = train_on(data.subset(train_idx), TrainConfig())
    held = data.subset(test_idx)
    probability = np.array([model.probability(p) for p in held.prompts])
    report = calibration(probability, held.local_fails)
    assert report["brier"] < report["brier_base_rate"] - 0.01  # informative, not just the mean
    assert report["ece"] < 0.05
    assert abs(probability.mean() - held.local_fails.mean()) < 0.03


# -- metrics -------------------------------------------------------------------------------
def test_auc_matches_pair_counting() -> None:
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, 60).astype(float)  # many ties
    labels = rng.integers(0, 2, 60)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    assert roc_auc(scores, labels) == pytest.approx(pairs)


def test_routing_metrics_on_a_worked_example() -> None:
    # Local right on 3 of 5 (0.6), cloud on 4 of 5 (0.8). Escalating prompts 0 and 2 gains,
    # prompt 3 loses, 1 and 4 change nothing. By share escalated (0, .2, .4, .6, .8, 1) the
    # accuracy is .6, .8, 1, 1, 1, .8 and PGR 0, 1, 2, 2, 2, 1.
    weak = np.array([0, 1, 0, 1, 1])
    strong = np.array([1, 1, 1, 0, 1])
    metrics = routing_metrics(np.array([0.9, 0.3, 0.8, 0.0, 0.2]), weak, strong)
    assert metrics["auc"] == 1.0
    assert metrics["cpt50"] == pytest.approx(0.2)
    assert metrics["cpt80"] == pytest.approx(0.2)
    assert metrics["q95"] == pytest.approx(0.2)
    assert metrics["apgr"] == pytest.approx(1.5)  # trapezoids: .1 + .3 + .4 + .4 + .3
    same = routing_metrics(np.array([0.5, 0.1]), np.array([1, 0]), np.array([1, 0]))
    assert same["apgr"] == 0.0 and same["cpt50"] == 1.0  # no gap to recover: defined, not NaN


@needs_data
@pytest.mark.slow
def test_evaluation_beats_the_baselines_on_a_sample(data: Dataset) -> None:
    sample = data.subset(np.arange(0, len(data.prompts), 3))
    report = evaluate(sample)
    stratified = report.rows["router, stratified 5-fold"]
    held_out = report.rows["router, whole subjects held out"]
    random = report.rows["baseline: random (mean of 20)"]
    assert stratified["auc_fail"] > random["auc_fail"] + 0.1
    assert held_out["auc"] > random["auc"] + 0.05
    assert held_out["q95"] < random["q95"]
    assert "router, whole subjects held out" in report.table()


# -- through the real mesh -------------------------------------------------------------------
async def test_learned_router_through_the_real_mesh(
    worker: object, edge: object, client: object
) -> None:
    from cloud_node.worker import Worker
    from edge_node.node import EdgeNode
    from mesh.client import MeshClient

    assert isinstance(worker, Worker) and isinstance(edge, EdgeNode)
    assert isinstance(client, MeshClient) and isinstance(edge.router, LearnedRouter)
    simple = await client.complete(SIMPLE, max_tokens=8, temperature=0)
    hard = await client.complete(MATH, max_tokens=8, temperature=0)
    assert simple.path == "local"
    assert simple.end.routing is not None and simple.end.routing.decision == "local"
    assert hard.path == "cloud" and hard.end.served_by == f"cloud:{worker.node_id}"
    routing = hard.end.routing
    assert routing is not None and routing.decision == "cloud" and not routing.forced
    assert routing.score is not None and routing.threshold is not None
    assert routing.score >= routing.threshold
    assert "numbers" in routing.reason  # the client sees why
    assert edge.stats.get("route.local") == 1 and edge.stats.get("route.cloud") == 1


async def test_prompt_too_long_for_the_local_model_goes_to_the_cloud(
    settings: object, conn: object, worker: object, edge_backend: object, client: object
) -> None:
    """The edge's model here gets a 256-token context (the file loaded once for every test has
    more; only the edge's check reads the setting), so a prompt of some 200 tokens is too long
    for it and cheap for the worker: a prompt too long for the default context takes a CPU
    worker over 30 s to read on 2 cores, longer than the client waits."""
    from edge_node.node import EdgeNode
    from mesh.client import MeshClient
    from mesh.config import MeshSettings

    assert isinstance(client, MeshClient) and isinstance(settings, MeshSettings)
    settings.edge.model.n_ctx = 256
    long_but_simple = "Please summarise this note. " + "The meeting is on Tuesday. " * 30
    async with EdgeNode(settings, conn, edge_backend, create_router(settings.edge.router)):  # type: ignore[arg-type]
        answer = await client.complete(long_but_simple, max_tokens=4, temperature=0)
    assert answer.end.routing is not None
    assert answer.end.routing.reason.startswith("prompt too long for the local model")
    assert "context 256" in answer.end.routing.reason
    assert answer.end.routing.decision == "cloud"
    assert answer.path == "cloud" and answer.text


def test_router_commands_read_the_data_dir_setting(tmp_path: Path) -> None:
    import os

    missing = tmp_path / "no-data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    for extra_env, flags in (
        ({"MESH_EDGE_ROUTER_DATA_DIR": str(missing)}, []),
        ({}, ["--data", str(missing)]),
    ):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "mesh_app.cli",
                "router",
                "train",
                *flags,
                "--out",
                str(tmp_path / "w.json"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, **extra_env},
            check=False,
        )
        assert result.returncode == 2
        assert f"routing data not found under {missing}" in result.stderr
        assert not (tmp_path / "w.json").exists()
