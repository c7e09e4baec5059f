"""``--rm-type f1``: SQuAD-style token-level F1 between the response and the label."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (as the SQuAD script does)."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-level F1 of the normalised ``prediction`` against the normalised ``ground_truth``."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)  # both empty → 1.0, one empty → 0.0
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def compute_f1_reward(response: str, label: Any) -> float:
    """F1 in [0, 1]; a list label holds several acceptable answers and the best match counts."""
    if label is None:
        raise ValueError("rm_type 'f1' needs a label; the sample's label is None (check --label-key)")
    golds = label if isinstance(label, list | tuple) else [label]
    return max((f1_score(response, str(gold)) for gold in golds), default=0.0)
