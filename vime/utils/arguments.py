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
from collections import Counter
from collections.abc import Sequence

from vime.utils.arg_validation import finalize_args
from vime.utils.flags import VIME_GROUPS
from vime.utils.megatron_args import add_megatron_arguments
from vime.utils.passthrough_args import (
    CachedMirrorAction,
    CacheMiss,
    add_passthrough_flags,
    passthrough_help,
    passthrough_records,
)
from vime.utils.refused_flags import add_refused_flags
from vime.utils.sglang_flags import translate_sglang_flags
from vime.utils.upstream_parsers import (
    VIME_OWNED_ROUTER_FLAGS,
    VIME_OWNED_VLLM_FLAGS,
    build_router_parser,
    build_vllm_serve_parser,
    cache_vllm_flags,
    cached_vllm_flags,
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
    when a command line needs them: building vLLM's parser imports vLLM (~15 CPU-s per driver here). A command line
    whose ``--vllm-*`` flags and values a parse with the same vLLM met before (none, for a run on external engines)
    is parsed from a cache of that parse instead (``upstream_parsers.cached_vllm_flags``), to the same arguments;
    anything else (a new flag or value, an error, an unknown flag, ``--help-vllm``) gets the full parse."""

    _vllm_mirrored: list[argparse.Action] | None = None
    _own_options: list[str] | None = None  # the option strings before the --vllm-* flags: the cache's key
    _from_cache = False

    @property
    def vllm_actions(self) -> list[argparse.Action]:
        """The mirrored ``--vllm-*`` actions."""
        return self.mirror_vllm_flags()

    def mirror_vllm_flags(self) -> list[argparse.Action]:
        """Add the ``--vllm-*`` flags (once) and cache their defaults; returns their actions."""
        if self._vllm_mirrored is None:
            self._own_options = list(self._option_string_actions)
            vllm_parser = build_vllm_serve_parser()
            self._vllm_mirrored = (
                add_passthrough_flags(self, vllm_parser, "vllm", VIME_OWNED_VLLM_FLAGS) if vllm_parser else []
            )
            self._cache_vllm_flags(argparse.Namespace())
        return self._vllm_mirrored

    def error(self, message: str):  # the usage line of ~700 flags would bury the message
        if self._from_cache:
            raise CacheMiss(message)  # the full parse says it, with the --vllm-* flags in its suggestions
        self.exit(2, f"{self.prog}: error: {message}\n(run '{self.prog} --help' for the flags)\n")

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        mirrored = self._vllm_mirrored is not None
        if not mirrored and namespace is None:
            cache = cached_vllm_flags(list(self._option_string_actions))
            parsed = None if cache is None else self._parse_from_cache(args, cache)
            if parsed is not None:
                return parsed, []
        self.mirror_vllm_flags()
        parsed, unknown = super().parse_known_args(args, namespace)
        if not mirrored and namespace is None and not unknown:
            self._cache_vllm_flags(parsed)
        return parsed, unknown

    def _parse_from_cache(self, args: list[str], cache: dict[str, dict]) -> argparse.Namespace | None:
        """``args`` parsed with the cached ``--vllm-*`` flags in place of vLLM's parser, or None if the cache cannot
        tell: cached actions stand in for the flags ``args`` uses, with the same option strings, dest and nargs, so
        argparse splits the tokens as the full parse does."""
        names = {token.split("=", 1)[0] for token in args if token.startswith("--")}
        used = {
            name for name in names if name.startswith("--vllm-") and name not in self._option_string_actions
        }
        if "--help-vllm" in names or not used <= cache["flags"].keys():
            return None
        stand_ins = [
            self.add_argument(
                *options, dest=dest, nargs=nargs, default=cache["defaults"][dest], help=argparse.SUPPRESS,
                action=CachedMirrorAction, prefix="vllm", parsed=cache["values"],
            )
            for options, dest, nargs in dict.fromkeys(cache["flags"][name] for name in sorted(used))
        ]  # fmt: skip
        self._from_cache = True
        try:
            parsed, unknown = super().parse_known_args(args)
        except CacheMiss:
            return None
        finally:
            self._from_cache = False
            for action in stand_ins:  # as argparse removes an action whose option strings a later one takes
                self._actions.remove(action)
                self._optionals._group_actions.remove(action)
                for option in action.option_strings:
                    del self._option_string_actions[option]
        if unknown:
            return None
        for dest, value in cache["defaults"].items():
            if not hasattr(parsed, dest):  # as argparse fills a default
                setattr(parsed, dest, value)
        return parsed

    def _cache_vllm_flags(self, parsed: argparse.Namespace) -> None:
        """Cache the mirrored flags' defaults and what the full parse ``parsed`` made of the tokens of each
        ``--vllm-*`` flag it met once (so the value before them was the flag's default)."""
        defaults = mirrored_defaults(self._vllm_mirrored, self._own_options, self)
        records = passthrough_records(parsed, "vllm")
        uses = Counter(self._option_string_actions[f"--vllm-{option[2:]}"].dest for option, _, _ in records)
        flags, values = {}, {}
        for option, raw, _ in records:
            action = self._option_string_actions[f"--vllm-{option[2:]}"]
            if uses[action.dest] == 1 and action.dest in defaults:
                flags[f"--vllm-{option[2:]}"] = (tuple(action.option_strings), action.dest, action.nargs)
                values[(option, tuple(raw), repr(defaults[action.dest]))] = getattr(parsed, action.dest)
        cache_vllm_flags(self._own_options, {"defaults": defaults, "flags": flags, "values": values})

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
