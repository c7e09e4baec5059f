"""vime's one argument parser: vime groups + Megatron-named flags + ``--vllm-*`` + ``--router-*``.

Flags follow slime's names. ``--vllm-<flag>`` mirrors every flag of the installed vLLM server and
``--router-<flag>`` every flag of the installed vllm-router, generated from their own parsers
(``vime/utils/upstream_parsers.py``); list them with ``--help-vllm`` / ``--help-router``. slime's ``--sglang-*``
flags are mapped to the flag with their meaning or refused with the one to use (``vime/utils/sglang_flags.py``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence

from vime.utils.arg_validation import finalize_args
from vime.utils.flags import VIME_GROUPS
from vime.utils.megatron_args import add_megatron_arguments
from vime.utils.passthrough_args import add_passthrough_flags, passthrough_help
from vime.utils.refused_flags import add_refused_flags
from vime.utils.sglang_flags import translate_sglang_flags
from vime.utils.upstream_parsers import (
    VIME_OWNED_ROUTER_FLAGS,
    VIME_OWNED_VLLM_FLAGS,
    build_router_parser,
    build_vllm_serve_parser,
    cache_vllm_flag_defaults,
    cached_vllm_flag_defaults,
)

EPILOG = """\
Pass-through flags (not listed above):
  --vllm-<flag>    any flag of the installed vLLM server, e.g. --vllm-max-model-len 4096 (list: --help-vllm)
  --router-<flag>  any flag of the installed vllm-router, e.g. --router-policy cache_aware (list: --help-router)
"""


def _add_group(parser: argparse.ArgumentParser, title: str, flags: list[tuple[str, dict]]) -> None:
    group = parser.add_argument_group(title)
    for flag, kwargs in flags:
        group.add_argument(flag, **kwargs)


class VimeArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose unknown-flag errors suggest the closest known flag, and which mirrors vLLM's flags only
    when a command line uses one: building vLLM's parser imports vLLM (~3 CPU-s per driver), which a run that passes
    no ``--vllm-*`` flag (one on external engines) never needs otherwise. Such a run gets the flags' defaults from a
    cache (``upstream_parsers.cached_vllm_flag_defaults``), so its arguments are the same either way."""

    _vllm_mirrored: list[argparse.Action] | None = None

    @property
    def vllm_actions(self) -> list[argparse.Action]:
        """The mirrored ``--vllm-*`` actions."""
        return self.mirror_vllm_flags()

    def mirror_vllm_flags(self) -> list[argparse.Action]:
        """Add the ``--vllm-*`` flags (once) and cache their defaults; returns their actions."""
        if self._vllm_mirrored is None:
            own = list(self._option_string_actions)
            vllm_parser = build_vllm_serve_parser()
            self._vllm_mirrored = (
                add_passthrough_flags(self, vllm_parser, "vllm", VIME_OWNED_VLLM_FLAGS) if vllm_parser else []
            )
            cache_vllm_flag_defaults(own, mirrored_defaults(self._vllm_mirrored, own, self))
        return self._vllm_mirrored

    def error(self, message: str):  # the usage line of ~700 flags would bury the message
        self.exit(2, f"{self.prog}: error: {message}\n(run '{self.prog} --help' for the flags)\n")

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        defaults = None
        if self._vllm_mirrored is None and not self._uses_vllm_flags(args):
            defaults = cached_vllm_flag_defaults(list(self._option_string_actions))
        if defaults is None:
            self.mirror_vllm_flags()
        parsed, unknown = super().parse_known_args(args, namespace)
        for dest, value in (defaults or {}).items():
            if not hasattr(parsed, dest):  # as argparse fills a default
                setattr(parsed, dest, value)
        return parsed, unknown

    def _uses_vllm_flags(self, args: list[str]) -> bool:
        """Whether ``args`` holds a ``--vllm-*`` token that is not one of vime's own flags, or ``--help-vllm``."""
        names = {token.split("=", 1)[0] for token in args if token.startswith("--")}
        return "--help-vllm" in names or any(
            name.startswith("--vllm-") and name not in self._option_string_actions for name in names
        )

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        try:  # slime's --sglang-* flags become the vLLM/vime flags they mean, or stop here with the reason
            args = translate_sglang_flags(sys.argv[1:] if args is None else args)
        except ValueError as exc:
            self.error(str(exc))
        parsed, unknown = self.parse_known_args(args, namespace)
        flags = [token for token in unknown if token.startswith("-")]
        if unknown:
            first = (flags or unknown)[0]
            name = first.split("=", 1)[0]
            self.mirror_vllm_flags()  # the suggestions include the --vllm-* flags
            close = difflib.get_close_matches(name, list(self._option_string_actions), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            if name.startswith("--vllm-"):
                hint += " (list vLLM flags with --help-vllm)"
            elif name.startswith("--router-"):
                hint += " (list router flags with --help-router)"
            self.error(f"unrecognized argument {first}{hint}")
        return parsed


def mirrored_defaults(
    actions: list[argparse.Action], own_options: list[str], parser: argparse.ArgumentParser
) -> dict[str, object]:
    """``{dest: default}`` that ``actions`` add to a parsed namespace: the first action of each dest, unless one of
    the parser's own flags (``own_options``) has that dest already."""
    own_dests = {parser._option_string_actions[option].dest for option in own_options}
    defaults: dict[str, object] = {}
    for action in actions:
        if action.dest not in own_dests and action.default is not argparse.SUPPRESS:
            defaults.setdefault(action.dest, action.default)
    return defaults


def build_parser() -> VimeArgumentParser:
    """The full vime parser: vime groups, Megatron flags, and the pass-through flags (``--vllm-*`` mirrored when a
    command line uses one, or on reading ``parser.vllm_actions``)."""
    parser = VimeArgumentParser(
        prog="vime",
        description="vime: RL post-training with vLLM rollout (slime-compatible flags).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--help-vllm", action="store_true", help="List every --vllm-<flag> and exit.")
    parser.add_argument("--help-router", action="store_true", help="List every --router-<flag> and exit.")
    for title, flags in VIME_GROUPS:
        _add_group(parser, title, flags)
    parser.set_defaults(megatron_args_source=add_megatron_arguments(parser))
    add_refused_flags(parser)
    router_parser = build_router_parser()  # cheap; the --vllm-* flags come when needed (VimeArgumentParser)
    parser.router_actions = (
        add_passthrough_flags(parser, router_parser, "router", VIME_OWNED_ROUTER_FLAGS)
        if router_parser
        else []
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate vime's command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.help_vllm or args.help_router:
        actions, title = (
            (parser.vllm_actions, "vLLM server flags (pass as --vllm-<flag>):")
            if args.help_vllm
            else (parser.router_actions, "vllm-router flags (pass as --router-<flag>):")
        )
        print(passthrough_help(actions, title) if actions else "not installed")
        sys.exit(0)
    try:
        finalize_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args
