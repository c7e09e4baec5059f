"""A small in-memory BM25 retriever (Okapi BM25, k1 = 1.5, b = 0.75) over a JSONL corpus of ``{"id", "title",
"text"}`` rows. Enough for a few thousand passages; for Wikipedia-scale corpora put a real search server behind
:func:`examples.search.generate_with_search.search` instead."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words."""
    return _WORD.findall(text.lower())


class BM25:
    """Ranks documents for a query by BM25 over their title and text."""

    def __init__(self, docs: list[dict], k1: float = 1.5, b: float = 0.75):
        self.docs, self.k1, self.b = docs, k1, b
        self.counts = [Counter(words(f"{d['title']} {d['text']}")) for d in docs]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.average_length = sum(self.lengths) / max(len(docs), 1)
        frequency = Counter(word for counts in self.counts for word in counts)
        n = len(docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in frequency.items()}

    @classmethod
    def from_jsonl(cls, path: str | Path) -> BM25:
        return cls([json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()])

    def score(self, query: list[str], i: int) -> float:
        counts, norm = self.counts[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.average_length)
        return sum(
            self.idf.get(w, 0.0) * counts[w] * (self.k1 + 1) / (counts[w] + norm) for w in query if counts[w]
        )

    def search(self, query: str, k: int = 3) -> list[dict]:
        """The ``k`` best documents (best first); documents sharing no word with the query are left out."""
        terms = words(query)
        scored = [(self.score(terms, i), i) for i in range(len(self.docs))]
        ranked = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))
        return [self.docs[i] for _, i in ranked[:k]]
