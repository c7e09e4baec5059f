"""``--rm-type f1``: SQuAD-style token-level F1 between the response and the label, as in slime."""

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


_EXACT_ONLY = ("yes", "no", "noanswer")  # answers that are right or wrong, never partly right


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-level F1 of the normalised ``prediction`` against the normalised ``ground_truth``, as slime's: 0 when
    they share no token (so also when either is empty after normalisation), and 0 unless equal when either is
    ``yes``, ``no`` or ``noanswer``."""
    prediction, ground_truth = normalize_answer(prediction), normalize_answer(ground_truth)
    if prediction != ground_truth and (prediction in _EXACT_ONLY or ground_truth in _EXACT_ONLY):
        return 0.0
    pred_tokens, gold_tokens = prediction.split(), ground_truth.split()
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
