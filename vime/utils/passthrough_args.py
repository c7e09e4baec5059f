"""Mirror another program's argparse flags under a prefix (``--vllm-*``, ``--router-*``).

The mirrored flags are generated from the upstream parser at run time, so every flag of the installed
version is available without a hand-kept list. Each mirrored flag validates its value with the upstream
type/action (errors name the prefixed flag) and records the tokens the user typed, so the upstream
command line can be rebuilt exactly (:func:`passthrough_cli_args`).
"""

from __future__ import annotations

import argparse
from typing import Any

_RECORD_ATTR = "_passthrough_tokens"


class _PassthroughAction(argparse.Action):
    """A ``--<prefix>-<flag>``: sets the value :meth:`value` gives and records the raw tokens for replay."""

    def __init__(self, option_strings, dest, prefix: str, **kw):
        super().__init__(option_strings, dest, **kw)
        self.prefix = prefix

    def value(self, namespace, raw: list[str], upstream_option: str) -> Any:
        raise NotImplementedError

    def __call__(self, parser, namespace, values, option_string=None):
        raw = [] if values is None else [values] if isinstance(values, str) else list(values)
        upstream_option = "--" + option_string.removeprefix(f"--{self.prefix}-")
        setattr(namespace, self.dest, self.value(namespace, raw, upstream_option))
        records = getattr(namespace, _RECORD_ATTR, None)
        if records is None:
            records = {}
            setattr(namespace, _RECORD_ATTR, records)
        records.setdefault(self.prefix, []).append((upstream_option, raw, self.nargs))


class _MirrorAction(_PassthroughAction):
    """Parses ``--<prefix>-<flag>`` like upstream ``--<flag>``."""

    def __init__(self, option_strings, dest, upstream: argparse.Action, upstream_parser, **kw):
        super().__init__(option_strings, dest, **kw)
        self.upstream = upstream
        self.upstream_parser = upstream_parser

    def _convert(self, raw: str) -> Any:
        value = raw
        if self.upstream.type is not None:
            try:
                value = self.upstream.type(raw)
            except Exception as exc:  # upstream types raise ValueError, TypeError, ArgumentTypeError...
                raise argparse.ArgumentError(self, f"invalid value {raw!r}: {exc}") from None
        if self.upstream.choices is not None and value not in self.upstream.choices:
            choices = ", ".join(map(str, self.upstream.choices))
            raise argparse.ArgumentError(self, f"invalid choice {raw!r} (choose from {choices})")
        return value

    def value(self, namespace, raw: list[str], upstream_option: str) -> Any:
        converted = [self._convert(v) for v in raw]
        scratch = argparse.Namespace(**{self.upstream.dest: getattr(namespace, self.dest, None)})
        if self.upstream.nargs == 0:
            call_values: Any = []
        elif self.upstream.nargs in (None, "?"):
            call_values = converted[0] if converted else self.upstream.const
        else:
            call_values = converted
        self.upstream(self.upstream_parser, scratch, call_values, upstream_option)
        value = getattr(scratch, self.upstream.dest)
        # validated; a value of an upstream type (a config object, an enum) is kept as typed: see is_plain
        return value if is_plain(value) else (raw[0] if len(raw) == 1 else raw)


class CacheMiss(Exception):
    """A :class:`CachedMirrorAction` met tokens it has no record of."""


class CachedMirrorAction(_PassthroughAction):
    """A mirrored flag answered from earlier parses instead of the upstream parser: ``parsed[(upstream_option,
    raw_tokens, repr(value_before))]`` is the value the mirrored flag gave those tokens when the flag held
    ``value_before``; tokens not there raise :class:`CacheMiss`."""

    def __init__(self, option_strings, dest, parsed: dict[tuple, Any], **kw):
        super().__init__(option_strings, dest, **kw)
        self.parsed = parsed

    def value(self, namespace, raw: list[str], upstream_option: str) -> Any:
        key = (upstream_option, tuple(raw), repr(getattr(namespace, self.dest, None)))
        if key not in self.parsed:
            raise CacheMiss(upstream_option)
        return self.parsed[key]


class _OwnedByVimeAction(argparse.Action):
    """A mirrored flag that vime sets itself: using it is an error that says what to do instead."""

    def __init__(self, option_strings, dest, fix: str, **kw):
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.fix = fix

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"vime sets this itself: {self.fix}")


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data (None, bool, number, string, or lists/dicts of them). The parsed arguments
    travel to every Ray actor of a run: a value of an upstream type there (vLLM's config objects and enums are the
    defaults of many ``--vllm-*`` flags) would make each actor import vLLM to unpickle them, seconds per process. vime
    replays the typed tokens (:func:`passthrough_cli_args`), so such a flag keeps its tokens (default: None)."""
    if value is None or type(value) in (bool, int, float, str):  # exact: an IntEnum is an int
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return type(value) in (list, tuple, set, frozenset) and all(is_plain(item) for item in value)
    if type(value) is dict:
        return all(isinstance(key, str) and is_plain(item) for key, item in value.items())
    return False


def add_passthrough_flags(
    parser: argparse.ArgumentParser,
    upstream_parser: argparse.ArgumentParser,
    prefix: str,
    owned: dict[str, str],
) -> list[argparse.Action]:
    """Add ``--{prefix}-<flag>`` for every long option of ``upstream_parser``.

    ``owned`` maps upstream dests that vime sets itself to the hint shown if a user passes them. Flags whose
    prefixed name already exists in ``parser`` (vime's own) are skipped. Returns the mirrored actions.
    """
    existing = set(parser._option_string_actions)
    mirrored = []
    for action in upstream_parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction) or not action.option_strings:
            continue
        long_options = [o for o in action.option_strings if o.startswith("--")]
        names = [f"--{prefix}-{o[2:]}" for o in long_options if f"--{prefix}-{o[2:]}" not in existing]
        if not names:
            continue
        dest = f"{prefix}_{action.dest}"
        if action.dest in owned:
            parser.add_argument(*names, dest=dest, action=_OwnedByVimeAction, fix=owned[action.dest])
            continue
        nargs = 0 if action.nargs == 0 else action.nargs
        mirrored.append(
            parser.add_argument(
                *names,
                dest=dest,
                action=_MirrorAction,
                upstream=action,
                prefix=prefix,
                upstream_parser=upstream_parser,
                nargs=nargs,
                default=action.default if is_plain(action.default) else None,
                help=argparse.SUPPRESS,
                metavar=action.metavar,
            )
        )
    return mirrored


def passthrough_records(args: argparse.Namespace, prefix: str) -> list[tuple[str, list[str], Any]]:
    """``(upstream_option, raw_tokens, nargs)`` of each ``--{prefix}-*`` flag the user passed, in their order."""
    return getattr(args, _RECORD_ATTR, {}).get(prefix, [])


def passthrough_cli_args(args: argparse.Namespace, prefix: str) -> list[str]:
    """The upstream command-line tokens for the ``--{prefix}-*`` flags the user passed, in their order."""
    tokens: list[str] = []
    for option, raw, nargs in passthrough_records(args, prefix):
        if nargs is None and len(raw) == 1 and raw[0].startswith("-"):
            tokens.append(f"{option}={raw[0]}")  # '=' keeps values such as '-1' from reading as flags
        else:
            tokens += [option, *raw]
    return tokens


def passthrough_help(actions: list[argparse.Action], title: str) -> str:
    """A help page listing the mirrored flags with the upstream help text."""
    lines = [title, ""]
    for action in actions:
        upstream_help = (action.upstream.help or "").split("\n")[0]
        if upstream_help == argparse.SUPPRESS:
            continue
        lines.append(f"  {', '.join(action.option_strings)}")
        if upstream_help:
            lines.append(f"      {upstream_help[:200]}")
    return "\n".join(lines)
