"""A flag that is parsed but never read is a defect (issue 15): the user asks for something and nothing happens.

Walks vime's own parser (not the --vllm-*/--router-* pass-through, which reaches the servers' own parsers, not
the refused slime flags, and not the Megatron-LM-named flags of ``megatron_args``' copy, which Megatron-LM defines)
and checks that the source of ``vime/``, ``train.py`` and ``train_async.py`` reads each flag's ``dest`` as
``args.<dest>`` (``self.args.<dest>``, ``eval_args.<dest>`` ...) or ``getattr(args, "<dest>"``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from vime.utils import megatron_args
from vime.utils.arguments import build_parser
from vime.utils.passthrough_args import _OwnedByVimeAction
from vime.utils.refused_flags import RefusedFlagAction

ROOT = Path(__file__).resolve().parents[2]
# Read indirectly, where the scan above cannot see the name: keep this short and say where.
READ_INDIRECTLY = {
    # vllm_generate.sampling_params_from_args and arg_validation read rollout_/eval_ sampling fields as
    # getattr(args, f"{prefix}_top_k") / f"rollout_{name}"
    "rollout_top_k",
}
MEGATRON_LM_NAMED = {
    flag
    for section in (
        megatron_args._MODEL,
        megatron_args._MOE,
        megatron_args._PARALLEL,
        megatron_args._OPTIM,
        megatron_args._PRECISION_CKPT_LOG,
    )
    for flag, _ in section
}


def vime_flags() -> dict[str, str]:
    """dest -> first option string of every flag vime itself defines and accepts."""
    parser = build_parser()
    passthrough = {id(action) for action in (*parser.vllm_actions, *parser.router_actions)}
    return {
        action.dest: action.option_strings[0]
        for action in parser._actions
        if action.option_strings
        and id(action) not in passthrough
        and not isinstance(action, argparse._HelpAction | RefusedFlagAction | _OwnedByVimeAction)
        and action.option_strings[0] not in MEGATRON_LM_NAMED
    }


def source() -> str:
    files = [*(ROOT / "vime").rglob("*.py"), ROOT / "train.py", ROOT / "train_async.py"]
    return "\n".join(path.read_text(encoding="utf-8") for path in files)


def is_read(dest: str, text: str) -> bool:
    """``args.<dest>`` not being assigned, or ``getattr(args, "<dest>"``."""
    attribute = rf"args\.{dest}\b(?!\s*=[^=])"
    return bool(re.search(attribute, text) or re.search(rf"getattr\(\s*[\w.]*args,\s*\"{dest}\"", text))


def test_the_scan_finds_reads_and_misses_writes():
    text = 'x = self.args.alpha\ny = getattr(args, "beta", None)\nargs.gamma_two = 1\nother.delta\n'
    assert is_read("alpha", text) and is_read("beta", text)
    assert not is_read("gamma_two", text)  # only written
    assert not is_read("gamma", text) and not is_read("delta", text)
    assert is_read("gamma_two", text + "if args.gamma_two == 1: pass\n")


def test_every_vime_flag_is_read_somewhere():
    flags, text = vime_flags(), source()
    assert len(flags) > 150, "the walk found too few flags"
    unread = sorted(
        flag for dest, flag in flags.items() if dest not in READ_INDIRECTLY and not is_read(dest, text)
    )
    assert not unread, f"flags parsed but never read: {unread}"


def test_the_indirect_list_is_still_needed():
    flags, text = vime_flags(), source()
    assert READ_INDIRECTLY <= set(flags), "an allow-listed flag no longer exists"
    assert not [dest for dest in READ_INDIRECTLY if is_read(dest, text)], (
        "now read directly: drop it from the list"
    )
