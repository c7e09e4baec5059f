"""Whether two final math answers are equal, with slime's meaning (the MATH / DeepScaleR grader slime uses for
``--rm-type math`` and ``deepscaler``), written anew for vime.

Two tests, either suffices:

1. **Same string** after the MATH benchmark's light normalisation (:func:`mathd_form`): spacing, ``\\left``/
   ``\\right``, degrees, ``\\$``, ``\\%``, a trailing ``\\text{ unit}``, ``k = `` prefixes, ``\\frac12`` and ``a/b``
   spelled as ``\\frac{a}{b}``, ``0.5`` as ``\\frac{1}{2}``.
2. **Same value** after a heavier normalisation (:func:`plain_form`: units, ``$``/``%``, thousands separators,
   ``million``, LaTeX to plain text, mixed numbers, lower case), element by element for tuples and intervals
   (their brackets must match), where sympy may prove ``truth − given = 0`` only if neither side is a plain
   fraction (``2/4`` is not ``1/2``: an unreduced fraction is wrong), both or neither are integers (an integer
   answer must be written as one), and the expression is small (at most two unknown letters, no ``^{``/``^(`` and
   no multi-digit exponent: sympy could hang).
"""

from __future__ import annotations

import re

import sympy
from sympy.parsing import sympy_parser

# ------------------------------------------------------------------------------------------ 1. same string
_TEXT_ONLY_RE = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def _unwrap_text(answer: str) -> str:
    """``\\text{...}`` around the whole answer removed."""
    match = _TEXT_ONLY_RE.search(answer)
    return match.group("text") if match else answer


def _braced_sqrt_arguments(text: str) -> str:
    """``\\sqrt3`` → ``\\sqrt{3}`` (one-character arguments get braces); ``ValueError`` for a ``\\sqrt`` without one."""
    head, *rest = text.split("\\sqrt")
    if any(not part for part in rest):
        raise ValueError("\\sqrt without an argument")
    return head + "".join(
        "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]) for part in rest
    )


def _braced_frac_arguments(text: str) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\frac1{b}`` → ``\\frac{1}{b}``; the text unchanged if a ``\\frac`` has
    one character after it, ``ValueError`` if none."""
    head, *rest = text.split("\\frac")
    out = [head]
    for part in rest:
        if not part:
            raise ValueError("\\frac without arguments")
        if part.startswith("{"):
            out.append("\\frac" + part)
        elif len(part) < 2:
            return text
        elif part[1] == "{":
            out.append("\\frac{" + part[0] + "}" + part[1:])
        else:
            out.append("\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:])
    return "".join(out)


def _slash_as_frac(text: str) -> str:
    """``3/4`` (two integers written plainly) → ``\\frac{3}{4}``."""
    parts = text.split("/")
    if len(parts) == 2 and all(re.fullmatch(r"[+-]?\d+", p.strip()) for p in parts):
        numerator, denominator = int(parts[0]), int(parts[1])
        if text == f"{numerator}/{denominator}":
            return f"\\frac{{{numerator}}}{{{denominator}}}"
    return text


def mathd_form(answer: str) -> str:
    """The MATH benchmark's normal form of an answer (test 1 of the module docstring). An answer the rules cannot
    handle (two ``\\text{ `` units, a dangling ``\\sqrt``) is compared as written."""
    answer = _unwrap_text(answer.strip()).strip()
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    for removed in ("^{\\circ}", "^\\circ", "\\$"):
        text = text.replace(removed, "")
    if "\\text{ " in text:  # a unit on the right
        parts = text.split("\\text{ ")
        if len(parts) != 2:
            return answer
        text = parts[0]
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5"
        text = sides[1]
    try:
        text = _braced_frac_arguments(_braced_sqrt_arguments(text).replace(" ", ""))
    except ValueError:
        return answer
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_as_frac(text)


# ------------------------------------------------------------------------------------ LaTeX to plain text
# Symbols as text (what sympy then reads); a command not listed here is dropped and its argument kept.
_SYMBOLS = {
    "pi": "pi", "infty": "inf", "cup": "U", "cdot": "*", "times": "*", "cap": "∩", "setminus": "∖", "in": "∈",
    "to": "→", "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥", "ne": "≠", "neq": "≠", "pm": "±", "mp": "∓",
    "circ": "∘", "ldots": "…", "dots": "…", "cdots": "⋯", "mid": "|", "angle": "∠", "lfloor": "⌊", "rfloor": "⌋",
    "lceil": "⌈", "rceil": "⌉", "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε",
    "varepsilon": "ε", "theta": "θ", "lambda": "λ", "mu": "μ", "sigma": "σ", "phi": "φ", "varphi": "φ",
    "omega": "ω", "Delta": "Δ", "Omega": "Ω",
}  # fmt: skip
_FUNCTIONS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "ln",
              "log", "lg", "exp", "min", "max", "sup", "inf", "lim", "det", "gcd", "deg", "dim", "arg", "Pr"}  # fmt: skip
_SPACES = {",": " ", ";": " ", ":": " ", " ": " ", "quad": "  ", "qquad": "  ", "!": ""}
_DROPPED_WITH_ARGUMENT = ("mbox",)


def _read_argument(text: str, i: int) -> tuple[str, int]:
    """The argument of a command at ``text[i:]``: a braced group's content, or one character; and the index after
    it. ``ValueError`` when there is none."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        raise ValueError("command without its argument")
    if text[i] != "{":
        if text[i] == "\\":
            name = re.match(r"\\([A-Za-z]+|.)", text[i:]).group(0)
            return name, i + len(name)
        return text[i], i + 1
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j], j + 1
    raise ValueError("unbalanced braces")


def latex_to_text(latex: str) -> str:
    """Plain text of a LaTeX answer: ``\\frac{a}{b}`` → ``a/b`` (no parentheses added, as slime's converter),
    ``\\sqrt{x}`` → ``sqrt(x)``, ``\\pi`` → ``pi``, ``\\cdot``/``\\times`` → ``*``, groups' braces dropped, text
    and font commands reduced to their argument. ``ValueError`` for a command missing its argument."""
    out: list[str] = []
    i = 0
    while i < len(latex):
        char = latex[i]
        if char in "{}$":
            i += 1
            continue
        if char != "\\":
            out.append(char)
            i += 1
            continue
        name = re.match(r"\\([A-Za-z]+|.?)", latex[i:]).group(1)
        i += 1 + len(name)
        if name.isalpha():
            while i < len(latex) and latex[i] == " ":
                i += 1
        if name in ("frac", "dfrac", "tfrac", "binom"):
            numerator, i = _read_argument(latex, i)
            denominator, i = _read_argument(latex, i)
            sep = "/" if name != "binom" else ""
            out.append(
                (" " if name != "binom" else "") + latex_to_text(numerator) + sep + latex_to_text(denominator)
            )
        elif name == "sqrt":
            if latex.startswith("[", i):  # the root's index is dropped
                i = latex.index("]", i) + 1
            radicand, i = _read_argument(latex, i)
            out.append(f"sqrt({latex_to_text(radicand)})")
        elif name in _DROPPED_WITH_ARGUMENT:
            _, i = _read_argument(latex, i)
        elif name in _SPACES:
            out.append(_SPACES[name])
        elif name in _SYMBOLS:
            out.append(_SYMBOLS[name])
        elif name in _FUNCTIONS:  # \\ln 2 → ln2
            out.append(name)
        elif not name.isalpha():  # \{ \} \% \$ \_ ...: the character itself
            out.append(name)
        # any other command (\text, \mathrm, \left, \overline, ...) is dropped; what follows stays
    return "".join(out)


# -------------------------------------------------------------------------------------------- 2. same value
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")  # fmt: skip
_THOUSANDS_RE = re.compile(r"(\d),(\d\d\d)($|\D)")
_PLAIN_FRACTION_RE = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_BRACKETS = "()[]"


def _without_thousands_separators(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, _THOUSANDS_RE.sub(r"\1\2\3", text)
    return text


def _as_integer(text: str) -> int | None:
    """The integer ``text`` denotes (``"1,234"``, ``"18.0"``), or None."""
    try:
        value = float(_without_thousands_separators(text))
        if abs(value - round(value)) > 1e-7:
            return None
    except (ValueError, OverflowError):  # not a number, or inf / nan
        return None
    return int(float(text.replace(",", "")))


def plain_form(answer: str) -> str:
    """The heavier normal form of test 2 of the module docstring, in lower case without spaces."""
    text = _unwrap_text(answer)
    text = text.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    text = text.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in (("million", 6), ("billion", 9), ("trillion", 12)):
        text = text.replace(word, f"*10^{power}")
    for unit in _UNITS:
        text = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", text)
    text = re.sub(r"\^ *\\circ", "", text)
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    text = re.sub(r",\\! *", "", text)
    try:  # a number with an integral value, "18.0", as "18"
        value = float(text)
        if abs(value - round(value)) <= 1e-7:
            text = str(round(value))
    except (ValueError, OverflowError):
        pass
    if "\\" in text:
        try:
            text = latex_to_text(text).strip()
        except ValueError:
            pass
    text = re.sub(r"- *", "-", text)
    text = re.sub(r"([0-9]) +([0-9])", r"\1+\2", text)  # a mixed number: 7 3/4 = 7+3/4
    text = text.replace(" ", "").replace("{", "").replace("}", "").lower()
    integer = _as_integer(text)
    return text if integer is None else str(integer)


def _elements(text: str) -> list[str]:
    """A tuple's or an interval's elements (brackets at both ends, none inside); else the text as one element."""
    text = _without_thousands_separators(text)
    if not text:
        return []
    inner = text[1:-1]
    if (
        len(text) > 2
        and text[0] in _BRACKETS
        and text[-1] in _BRACKETS
        and not any(c in inner for c in _BRACKETS)
    ):
        return [element.strip() for element in inner.split(",")]
    return [text]


def _small_enough(expression: str) -> bool:
    letters = {c for c in expression.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expression or "^(" in expression:
        return False
    return not re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expression)


def _sympy_says_equal(truth: str, given: str) -> bool:
    expression = f"({truth})-({given})"
    if not _small_enough(expression):
        return False
    names = {key: value for key, value in vars(sympy).items() if not key.startswith("_")}
    transformations = sympy_parser.standard_transformations + (
        sympy_parser.implicit_multiplication_application,
    )
    try:
        difference = sympy_parser.parse_expr(
            expression.replace("^", "**"),
            local_dict={},
            global_dict={"__builtins__": {}, **names},  # sympy's names only: no Python builtins to run
            transformations=transformations,
        )
        return sympy.simplify(difference) == 0
    except Exception:  # sympy cannot read or simplify it: not shown equal
        return False


def _same_value(given: str, truth: str) -> bool:
    truth, given = plain_form(truth), plain_form(given)
    if truth == given:
        return True
    if not given:
        return False
    truth_elements, given_elements = _elements(truth), _elements(given)
    if len(truth_elements) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # another kind of interval or tuple
    if len(truth_elements) != len(given_elements):
        return False
    for t, g in zip(truth_elements, given_elements, strict=True):
        if _PLAIN_FRACTION_RE.search(t) and _PLAIN_FRACTION_RE.search(g):
            equal = t == g  # fractions must be written the same (reduced)
        elif (_as_integer(t) is None) != (_as_integer(g) is None):
            equal = False  # an integer must be given as an integer
        else:
            equal = _sympy_says_equal(t, g)
        if not equal:
            return False
    return True


def answers_equal(given: str, truth: str) -> bool:
    """Whether the final answer ``given`` equals ``truth`` (both bare answers, no ``\\boxed``), with slime's
    meaning (see the module docstring)."""
    return mathd_form(given) == mathd_form(truth) or _same_value(given, truth)
