"""Score a table of hard reward cases with slime's own ``rm_hub`` and write them, with slime's scores, as JSON.

vime's unit test ``tests/unit/test_slime_reward_agreement.py`` checks that vime's built-in rewards give the same
scores. This script imports slime, not vime; run it once against a slime source tree (its ``rm_hub`` needs sympy and
pylatexenc, which vime's environment does not have, so they go in a separate folder)::

    git --git-dir SLIME.git archive 624b824a8 slime | tar -x -C /tmp/slime_src
    python -m pip install --target /tmp/slime_extra pylatexenc
    PYTHONPATH=/tmp/slime_src:/tmp/slime_extra python tools/slime_reward_cases.py --slime-commit 624b824a8 \\
        --out tests/unit/data/slime_reward_cases.json

Each case goes through slime's ``async_rm`` (its ``--rm-type`` dispatch, ``boxed_`` prefix included). A case where
slime raises is stored with the exception's type instead of a score.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

GPQA = {"choices": ["red", "green", "blue", "black"]}

# (rm_type, response, label, metadata): the hard cases, by reward type.
CASES: list[tuple[str, str, Any, dict | None]] = [
    # math: the answer must be the last \boxed{}; trailing text, box spellings, units, fractions, tuples
    ("math", "9*2 = 18\nAnswer: 18", "18", None),
    ("math", "9*2 = 18. The answer is 18.", "18", None),
    ("math", "9*2 = 18\nso \\boxed{18}", "18", None),
    ("math", "\\boxed{18}", 18, None),
    ("math", "\\boxed{18}", "\\boxed{18}", None),
    ("math", "\\boxed{18}", "The answer is $\\boxed{18}$.", None),
    ("math", "\\boxed{17}. Wait, no: \\boxed{18}", "18", None),
    ("math", "\\boxed{18} is what I got, then \\boxed{17}", "18", None),
    ("math", "\\fbox{18}", "18", None),
    ("math", "\\boxed 18", "18", None),
    ("math", "\\boxed{18", "18", None),
    ("math", "\\boxed{18.0}", "18", None),
    ("math", "\\boxed{18.5}", "18", None),
    ("math", "\\boxed{ 18 }", "18", None),
    ("math", "\\boxed{18 \\text{ cm}}", "18", None),
    ("math", "\\boxed{18\\text{cm}}", "18", None),
    ("math", "\\boxed{18 meters}", "18", None),
    ("math", "\\boxed{18^\\circ}", "18", None),
    ("math", "\\boxed{18^{\\circ}}", "18", None),
    ("math", "\\boxed{\\$18}", "18", None),
    ("math", "\\boxed{50\\%}", "50", None),
    ("math", "\\boxed{1,234}", "1234", None),
    ("math", "\\boxed{1234}", "1,234", None),
    ("math", "\\boxed{x = 18}", "18", None),
    ("math", "\\boxed{\\text{18}}", "18", None),
    ("math", "\\boxed{-5}", "-5", None),
    ("math", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", None),
    ("math", "\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", None),
    ("math", "\\boxed{\\frac12}", "\\frac{1}{2}", None),
    ("math", "\\boxed{1/2}", "\\frac{1}{2}", None),
    ("math", "\\boxed{0.5}", "\\frac{1}{2}", None),
    ("math", "\\boxed{\\frac{1}{2}}", "0.5", None),
    ("math", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", None),
    ("math", "\\boxed{2/4}", "1/2", None),
    ("math", "\\boxed{7 3/4}", "31/4", None),
    ("math", "\\boxed{\\frac{31}{4}}", "7\\frac{3}{4}", None),
    ("math", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}", None),
    ("math", "\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", None),
    ("math", "\\boxed{\\pi}", "\\pi", None),
    ("math", "\\boxed{2\\pi}", "6.28", None),
    ("math", "\\boxed{10^{6}}", "1000000", None),
    ("math", "\\boxed{3 million}", "3000000", None),
    ("math", "\\boxed{(1, 2)}", "(1,2)", None),
    ("math", "\\boxed{[1, 2)}", "(1,2)", None),
    ("math", "\\boxed{(2, 1)}", "(1,2)", None),
    ("math", "\\boxed{1, 2}", "1,2", None),
    ("math", "\\boxed{x^2+2x+1}", "(x+1)^2", None),
    ("math", "\\boxed{\\text{B}}", "B", None),
    ("math", "\\boxed{b}", "B", None),
    ("math", "\\boxed{3}", "", None),
    ("math", "no answer here", "18", None),
    ("math", "\\boxed{0}", 0, None),
    ("math", "\\boxed{1\\,000}", "1000", None),
    ("math", "\\boxed{\\frac{\\pi}{2}}", "\\pi/2", None),
    ("math", "\\boxed{90^\\circ}", "\\frac{\\pi}{2}", None),
    ("math", "\\boxed{(-\\infty, 3) \\cup (4, 5)}", "(-\\infty,3)\\cup(4,5)", None),
    ("math", "\\boxed{\\text{(A)}}", "A", None),
    ("math", "\\boxed{k = 2}", "2", None),
    ("math", "\\boxed{\\sqrt{3}}", "3^{1/2}", None),
    ("math", "\\boxed{1\\frac{1}{2}}", "\\frac{3}{2}", None),
    ("math", "\\boxed{12 \\text{ inches}}", "12", None),
    ("math", "\\boxed{4 days}", "4", None),
    ("math", "\\boxed{\\ln 2}", "2", None),
    # deepscaler: only the part after </think> (or between ###Response markers) counts; boxed answers
    ("deepscaler", "<think>hmm</think> so \\boxed{18}", "18", None),
    ("deepscaler", "<think>hmm</think> so \\boxed{18}", 18, None),
    ("deepscaler", "\\boxed{18}", "18", None),
    ("deepscaler", "<think>\\boxed{18}</think> Answer: 18", "18", None),
    ("deepscaler", "<think>a</think><think>b</think>\\boxed{18}", "18", None),
    ("deepscaler", "###Response \\boxed{0.5}", "\\frac{1}{2}", None),
    ("deepscaler", "###Response: \\boxed{7}", "the answer is $\\boxed{7}$", None),
    ("deepscaler", "###Response first ###Response \\boxed{5}", "5", None),
    ("deepscaler", "</think>\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", None),
    ("deepscaler", "</think>\\boxed{18 \\text{ cm}}", "18", None),
    ("deepscaler", "</think>\\boxed{18}", "", None),
    ("deepscaler", "</think>\\boxed{(1,2)}", "(1, 2)", None),
    # dapo: the last "Answer:" line in the final 300 characters, normalised, against an integer label
    ("dapo", "Answer: 18", "18", None),
    ("dapo", "work\nAnswer: 12\nmore work\nanswer : 18", "18", None),
    ("dapo", "Answer: $1,234$", "1234", None),
    ("dapo", "Answer: \\boxed{18}", "18", None),
    ("dapo", "Answer: x = 18", "18", None),
    ("dapo", "Answer: 18.0", "18", None),
    ("dapo", "Answer: 18.", "18", None),
    ("dapo", "Answer: 18 dollars", "18", None),
    ("dapo", "Answer: 18 apples", "18", None),
    ("dapo", "Answer: 18 cm", "18", None),
    ("dapo", "Answer: 45^\\circ", "45", None),
    ("dapo", "Answer: \\text{18}", "18", None),
    ("dapo", "Answer: \\frac{36}{2}", "18", None),
    ("dapo", "Answer: 18", "18.0", None),
    ("dapo", "Answer: 18", "\\boxed{18}", None),
    ("dapo", "Answer: 18\n" + "x" * 400, "18", None),
    ("dapo", "no answer line", "18", None),
    ("dapo", "Answer: 1/2", "1/2", None),
    ("dapo", "Answer: \\frac12", "\\frac{1}{2}", None),
    # f1: SQuAD-style token F1, yes/no answers must match exactly
    ("f1", "The answer is Paris", "Paris", None),
    ("f1", "The Eiffel Tower, in Paris.", "eiffel tower", None),
    ("f1", "an apple", "the apple", None),
    ("f1", "yes", "no", None),
    ("f1", "yes it is", "yes", None),
    ("f1", "no", "no", None),
    ("f1", "Paris", "yes", None),
    ("f1", "", "", None),
    ("f1", "the", "a", None),
    ("f1", "Paris Paris London", "Paris London", None),
    # gpqa: option letters from "answer is X", a trailing standalone letter, or the option's text
    ("gpqa", "Reasoning... The answer is (C).", "C", GPQA),
    ("gpqa", "<think>A?</think> Answer: B", 1, GPQA),
    ("gpqa", "Answer: B", "blue", GPQA),
    ("gpqa", "Answer: C", "blue", GPQA),
    ("gpqa", "It must be green.", "green", GPQA),
    ("gpqa", "B is correct", "B", GPQA),
    ("gpqa", "Final answer: D", "D", GPQA),
    ("gpqa", "the answer: c", "C", GPQA),
    ("gpqa", "The answer is A. No wait, the answer is B.", "B", GPQA),
    ("gpqa", "The answer is clearly B", "B", GPQA),
    ("gpqa", "I pick A, not B", "B", GPQA),
    ("gpqa", "Option E", "E", None),
    ("gpqa", "Answer: B", "B", {"correct_letter": "C", **GPQA}),
    ("gpqa", "Answer: Y", "Y", {"valid_letters": ["W", "X", "Y", "Z"]}),
    ("gpqa", "nothing", "C", GPQA),
    ("gpqa", "The reasoning is correct, so B", "B", None),
    ("gpqa", "Answer: B", 0, {"correct_letter": "B", **GPQA}),
    ("gpqa", "Answer: B", 7, GPQA),
    ("gpqa", "I would say blue", "C", {"correct_answer": "blue"}),
    ("gpqa", "Answer: D", "D", {"choices": {"A": "x", "B": "y"}}),
    # boxed_<type>: the last \boxed{} stands for the whole response
    ("boxed_f1", "I think \\boxed{Paris}, not London", "Paris", None),
    ("boxed_f1", "Paris", "Paris", None),
    ("boxed_gpqa", "A, B or \\boxed{C}", "C", GPQA),
    ("boxed_gpqa", "\\boxed{the answer is B}", "B", GPQA),
    ("boxed_math", "\\boxed{18}", "18", None),
    ("f1", "Paris", ["Paris", "France"], None),
]


async def _slime_score(rm_type: str, response: str, label: Any, metadata: dict | None) -> dict[str, Any]:
    from slime.rollout.rm_hub import async_rm
    from slime.utils.types import Sample

    args = SimpleNamespace(rm_type=rm_type, custom_rm_path=None, rm_url=None)
    sample = Sample(response=response, label=label, metadata=dict(metadata or {}))
    try:
        return {"score": await async_rm(args, sample)}
    except Exception as exc:  # a case slime cannot score: record what it raised
        return {"raises": type(exc).__name__}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slime-commit", required=True, help="the slime commit the source tree is at")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cases = []
    for rm_type, response, label, metadata in CASES:
        result = asyncio.run(_slime_score(rm_type, response, label, metadata))
        cases.append(
            {"rm_type": rm_type, "response": response, "label": label, "metadata": metadata, **result}
        )
    header = {
        "slime_commit": args.slime_commit,
        "command": "PYTHONPATH=<slime src>:<pylatexenc dir> python tools/slime_reward_cases.py "
        f"--slime-commit {args.slime_commit} --out {args.out} (see the tool's docstring)",
        "python": sys.version.split()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"generated_by": header, "cases": cases}, indent=1, ensure_ascii=False) + "\n"
    )
    print(f"{len(cases)} cases -> {args.out}")


if __name__ == "__main__":
    main()
