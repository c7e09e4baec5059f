"""Names of the built-in rewards (``--rm-type``) and the parse-time check of a name.

The names live here, below the parser, so that ``vime.utils.arg_validation`` can check ``--rm-type`` without
importing the reward implementations (``vime.rollout.rm_hub``, which implements every name listed here).
"""

from __future__ import annotations

# Rule-based rewards in rm_hub, then the remote one (slime's names and meanings).
RM_TYPES = ("math", "gsm8k", "f1", "exact", "deepscaler", "dapo", "gpqa", "random", "remote_rm")
# boxed_<type>: the last \boxed{} stands for the whole response; math, deepscaler and dapo pick their answers out
# themselves (slime's boxed_math scores 0 whatever the answer)
BOXABLE = ("exact", "f1", "gsm8k", "gpqa")
# slime's names that vime cannot provide, and why
REFUSED = {
    "ifbench": "slime clones allenai/IFBench's instruction checkers from GitHub at run time, and they are no pip "
    "package; vime fetches no code. Wrap them in your own reward with --custom-rm-path",
}


def check_rm_type(rm_type: str | None) -> str:
    """``rm_type`` if it names a built-in reward (``boxed_<type>`` included), else ``ValueError`` saying why."""
    base = rm_type.removeprefix("boxed_") if rm_type else rm_type
    if base in REFUSED:
        raise ValueError(f"--rm-type {rm_type}: {REFUSED[base]}")
    if base not in RM_TYPES or (base != rm_type and base not in BOXABLE):
        raise ValueError(
            f"unknown --rm-type {rm_type!r}; valid: {', '.join(RM_TYPES)}, or boxed_<type> with a type that reads "
            f"the whole response ({', '.join(BOXABLE)}) (or set --custom-rm-path)"
        )
    return rm_type
