"""The labelled routing data, read in place from ``../shared/routing`` (never copied here).

Each row is a benchmark prompt with whether a weaker model (standing in for the local model) and
a stronger one (the cloud) answered it correctly. Prompts listed as contaminated are dropped.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol.errors import ErrorCode, MeshError

WEAK = "mistralai/Mixtral-8x7B-Instruct-v0.1"
STRONG = "gpt-4-1106-preview"


def default_data_dir() -> Path:
    """``shared/routing`` beside the project checkout."""
    return Path(__file__).resolve().parents[3] / "shared" / "routing"


@dataclass
class Dataset:
    prompts: list[str]
    weak: np.ndarray
    """1 where the local (weak) model answered correctly."""
    strong: np.ndarray
    """1 where the cloud (strong) model answered correctly."""
    subject: np.ndarray
    dropped: int = 0
    """Rows left out because their prompt is listed as contaminated."""

    @property
    def local_fails(self) -> np.ndarray:
        """The router's training label."""
        return (1 - self.weak).astype(np.int8)

    @property
    def escalation_helps(self) -> np.ndarray:
        """The local model is wrong and the cloud is right: the label AUC is reported against."""
        return ((self.weak == 0) & (self.strong == 1)).astype(np.int8)

    def classes(self, target: str) -> tuple[np.ndarray, int]:
        """Training classes and their number; class 0 is always "the local model is right".
        ``three_class``: 1 both wrong, 2 escalation helps; ``local_wrong``: 1 local wrong."""
        if target == "local_wrong":
            return self.local_fails.astype(np.int64), 2
        if target == "three_class":
            return (self.local_fails + self.escalation_helps).astype(np.int64), 3
        raise ValueError(f"unknown router target {target!r}")

    @property
    def outcome(self) -> np.ndarray:
        """The four (local, cloud) outcomes as 0..3, for stratified folds."""
        return (2 * self.weak + self.strong).astype(np.int8)

    def subset(self, index: np.ndarray) -> Dataset:
        return Dataset(
            [self.prompts[i] for i in index],
            self.weak[index],
            self.strong[index],
            self.subject[index],
        )


def load_dataset(root: str | Path | None = None) -> Dataset:
    root = Path(root) if root else default_data_dir()
    # MMLU subjects, GSM8K, or both: a directory with either is labelled data.
    gsm8k = root / "gsm8k" / "gsm8k_responses.csv"
    files = [*sorted((root / "mmlu").glob("mmlu_*.csv")), *([gsm8k] if gsm8k.is_file() else [])]
    if not files:
        raise MeshError(
            f"routing data not found under {root} (expected mmlu/mmlu_*.csv, "
            "gsm8k/gsm8k_responses.csv or both); pass --data DIR",
            code=ErrorCode.UNAVAILABLE,
            retryable=False,
        )
    contaminated: set[str] = set()
    for listing in sorted(root.glob("*/contaminated_prompts.jsonl")):
        for line in listing.read_text(encoding="utf-8").splitlines():
            if line.strip():
                contaminated.add(json.loads(line)["eval_prompt"])
    csv.field_size_limit(sys.maxsize)
    prompts: list[str] = []
    weak: list[bool] = []
    strong: list[bool] = []
    subjects: list[str] = []
    dropped = 0
    for path in files:
        subject = "gsm8k" if path.parent.name == "gsm8k" else path.stem.removeprefix("mmlu_")
        with path.open(newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                if row["prompt"] in contaminated:
                    dropped += 1
                    continue
                prompts.append(row["prompt"])
                weak.append(row[WEAK].strip() == "True")
                strong.append(row[STRONG].strip() == "True")
                subjects.append(subject)
    return Dataset(
        prompts,
        np.array(weak, np.int8),
        np.array(strong, np.int8),
        np.array(subjects),
        dropped,
    )


def subject_groups(data: Dataset) -> np.ndarray:
    """A group id per row: subjects that share an identical prompt are merged, so no prompt
    text sits on both sides of a held-out-subject split."""
    parent = {name: name for name in sorted(set(data.subject.tolist()))}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    first_seen: dict[str, str] = {}
    for prompt, subject in zip(data.prompts, data.subject.tolist(), strict=True):
        other = first_seen.setdefault(prompt, subject)
        a, b = root(other), root(subject)
        if a != b:
            parent[max(a, b)] = min(a, b)
    ids = {name: i for i, name in enumerate(sorted({root(n) for n in parent}))}
    return np.array([ids[root(s)] for s in data.subject.tolist()])


def prompt_groups(prompts: list[str]) -> np.ndarray:
    """An id per distinct prompt text: identical prompts must land in the same fold."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(p, len(ids)) for p in prompts])
