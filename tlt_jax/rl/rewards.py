"""0/1 rewards for math answers written by real models (GSM8K, MATH-style datasets).

The reward pipeline is: find the completion's final answer (``extract_final_answer``), bring it
and the reference to a canonical string (``normalize_answer``), then compare them as numbers when
both parse as numbers and as strings otherwise (``answers_match``). When the optional package
``math_verify`` is installed, ``math_reward`` asks it first and falls back to these rules when it
says no or raises; it is never a dependency of this package.

So the reward depends on the install: an answer that only ``math_verify`` accepts (an equivalent
expression such as ``2\\sqrt{2}`` for ``\\sqrt{8}``) scores 1 with it and 0 without it.
``math_scorer()`` says which scorer runs here; the job prints it at its start and saves it in its
first metrics row (``reward_scorer``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import math
import re
import threading
from types import ModuleType

REL_TOL = 1e-6  # relative tolerance of numeric answer comparison

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_SPACE = re.compile(r"\\boxed\s+([^\s${}]+)")  # ``\boxed 42`` (no braces), rare but seen
_GSM8K = re.compile(r"####\s*((?:(?!####)[^\n])*)")  # up to the line's end or the next ####
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# "the answer is X", "Answer: X", and the wordier "the answer to this problem is X"
_ANSWER_IS = re.compile(r"answer(?:\s+(?:to|of|for)\b[^.\n:]{0,60}?)?(?:\s+is\b\s*:?|\s*:)[ \t]*"
                        r"([^\n]+)", re.IGNORECASE)
_LAST_EQUALS = re.compile(r"\s=\s")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")


def _braced(text: str, open_at: int) -> int | None:
  """Index of the ``}`` closing the ``{`` at ``open_at``, or None if the braces never balance."""
  depth = 0
  i = open_at
  while i < len(text):
    char = text[i]
    if char == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
      i += 2  # an escaped brace does not count
      continue
    if char == "{":
      depth += 1
    elif char == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return None


def extract_boxed(text: str) -> str | None:
  """Content of the last complete ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces kept), or None.

  An unbalanced (truncated) box is skipped.
  """
  found = None
  found_end = -1
  pos = 0
  while True:
    match = _BOX_START.search(text, pos)
    if match is None:
      break
    close = _braced(text, match.end() - 1)
    if close is None:  # unbalanced (e.g. a truncated completion): skip this box
      pos = match.end()
      continue
    found, found_end = text[match.end():close].strip(), close
    pos = close + 1  # boxes nested inside this one are part of its content
  spaced = None
  for spaced in _BOX_SPACE.finditer(text):
    pass
  if spaced is not None and spaced.start() > found_end:
    return spaced.group(1).strip()
  return found


def _trim_phrase(answer: str) -> str:
  """An answer phrase cut at the end of its sentence, without markdown emphasis or a final dot."""
  end = _SENTENCE_END.search(answer)
  if end is not None:
    answer = answer[:end.start()]
  equals = list(_LAST_EQUALS.finditer(answer))
  if equals:  # "is 7 - 4 = 3": the result after the last " = "
    answer = answer[equals[-1].end():]
  return answer.strip().strip("*_").strip().rstrip(".").strip()


def extract_final_answer(text: str) -> str | None:
  """The final answer of a completion, or None if it states none.

  Tried in order: the last ``\\boxed{}``; GSM8K's ``#### 42``; the last ``<answer>...</answer>``;
  the last "the answer is X" / "Answer: X" / "the answer to ... is X" phrase (up to the end of its
  sentence; when it is a worked line such as "7 - 4 = 3", what follows its last " = ").
  """
  boxed = extract_boxed(text)
  if boxed is not None:
    return boxed
  for pattern in (_GSM8K, _ANSWER_TAG):
    matches = [m.group(1).strip() for m in pattern.finditer(text)]
    matches = [m for m in matches if m]
    if matches:
      return matches[-1]
  phrases = [_trim_phrase(m.group(1)) for m in _ANSWER_IS.finditer(text)]
  phrases = [p for p in phrases if p]
  return phrases[-1] if phrases else None


_UNWRAP = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox)\s*\{")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LEADING_VAR = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?=\S)")
_COMMAND_SPACE = re.compile(r"\s+")


def _unwrap_commands(s: str) -> str:
  """``\\text{abc}`` (and ``\\mathrm``, ``\\textbf``, ...) replaced by ``abc``."""
  while True:
    match = _UNWRAP.search(s)
    if match is None:
      return s
    close = _braced(s, match.end() - 1)
    if close is None:
      return s[:match.start()] + s[match.end():]
    s = s[:match.start()] + s[match.end():close] + s[close + 1:]


def _drop_spaces(s: str) -> str:
  """Whitespace removed, except one space where a LaTeX command runs into a letter (``\\pi r``)."""

  def keep(match: re.Match) -> str:
    before, after = s[:match.start()], s[match.end():]
    if re.search(r"\\[A-Za-z]+$", before) and after[:1].isalpha():
      return " "
    return ""

  return _COMMAND_SPACE.sub(keep, s)


def normalize_answer(s: str) -> str:
  """Canonical answer: no ``$``, spaces, ``\\text{}``, ``\\left``, ``x =``, ``1,000`` commas."""
  s = s.strip()
  boxed = extract_boxed(s)
  if boxed is not None and _BOX_START.match(s) and _braced(s, s.index("{")) == len(s) - 1:
    s = boxed  # the whole string is one box
  s = s.replace("\u2212", "-").replace("{,}", ",")
  s = s.replace("\\$", "").replace("$", "")
  s = _unwrap_commands(s)
  s = re.sub(r"\\left\b|\\right\b", "", s)
  s = re.sub(r"\\[dt]frac", r"\\frac", s)
  s = re.sub(r"\^\s*\{?\\circ\}?", "", s)  # degrees
  s = s.replace("\\%", "").replace("%", "")
  s = re.sub(r"\\[,;:! ]", " ", s)  # LaTeX thin/medium spaces
  s = s.strip()
  s = _LEADING_VAR.sub("", s)
  s = _drop_spaces(s)
  s = s.strip("*").rstrip(".")
  if _THOUSANDS.fullmatch(s):
    s = s.replace(",", "")
  return s


_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_SLASH = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))/((?:\d+\.?\d*|\.\d+))")
_FRAC = re.compile(r"([+-]?)\\frac(?:\{([+-]?(?:\d+\.?\d*|\.\d+))\}|(\d))"
                   r"(?:\{((?:\d+\.?\d*|\.\d+))\}|(\d))")


def parse_number(s: str) -> float | None:
  """Value of a normalized int, decimal, ``a/b`` or ``\\frac{a}{b}`` answer; None otherwise."""
  if _NUMBER.fullmatch(s):
    return float(s)
  match = _SLASH.fullmatch(s)
  if match is not None:
    num, den = float(match.group(1)), float(match.group(2))
    return num / den if den != 0 else None
  match = _FRAC.fullmatch(s)
  if match is not None:
    sign, num_braced, num_digit, den_braced, den_digit = match.groups()
    num, den = float(num_braced or num_digit), float(den_braced or den_digit)
    if den == 0:
      return None
    return (-1.0 if sign == "-" else 1.0) * num / den
  return None


def answers_match(answer: str, reference: str) -> bool:
  """Whether two answers agree after ``normalize_answer``: as numbers (1e-6 relative) or as text."""
  a, b = normalize_answer(answer), normalize_answer(reference)
  x, y = parse_number(a), parse_number(b)
  if x is not None and y is not None:
    return math.isclose(x, y, rel_tol=REL_TOL, abs_tol=0.0)
  return a == b and a != ""


@functools.lru_cache(maxsize=1)
def load_math_verify() -> ModuleType | None:
  """The ``math_verify`` module when it is installed, else None (looked up once)."""
  try:
    return importlib.import_module("math_verify")
  except ImportError:
    return None


def math_scorer() -> str:
  """Which scorer ``math_reward`` runs in this install, in words (the job's start line and its
  ``reward_scorer`` metric): ``math_verify`` with its version, then this module's rules, or
  this module's rules alone."""
  if load_math_verify() is None:
    return ("this package's answer rules (tlt_jax.rl.rewards), math_verify not installed: "
            "`pip install math-verify` accepts more equivalent answers")
  try:
    version = importlib.metadata.version("math-verify")
  except importlib.metadata.PackageNotFoundError:  # imported from a path, not installed
    version = "(version unknown)"
  return (f"math_verify {version} first, then this package's answer rules "
          "(tlt_jax.rl.rewards) where it says no")


def task_scorer(task) -> str:
  """What scores a task's completions: the task's ``scorer`` where it says (a math dataset's is
  ``math_scorer()``), else its own ``reward`` method (the built-in arithmetic task's exact check,
  the same in every install)."""
  said = getattr(task, "scorer", None)
  return said if isinstance(said, str) and said else f"{type(task).__name__}.reward, the task's own"


def math_verify_says(answer: str, reference: str) -> bool | None:
  """``math_verify``'s verdict on two extracted answers; None if it is absent or fails."""
  module = load_math_verify()
  if module is None:
    return None
  # math_verify times out with SIGALRM, which only the main thread may set: elsewhere it raises
  # (every verdict would silently fall back), so other threads run it without its timeouts.
  in_main = threading.current_thread() is threading.main_thread()
  parse_kw = {} if in_main else dict(parsing_timeout=None)
  verify_kw = {} if in_main else dict(timeout_seconds=None)
  try:
    gold = module.parse(f"$\\boxed{{{normalize_answer(reference)}}}$", **parse_kw)
    pred = module.parse(f"$\\boxed{{{normalize_answer(answer)}}}$", **parse_kw)
    return bool(module.verify(gold, pred, **verify_kw))
  except Exception:  # any failure of the optional checker: use the rules of this module
    return None


def reference_answer(reference: str) -> str:
  """The final answer in a reference (boxed, ``####``, "answer is"), else the stripped string."""
  found = extract_final_answer(reference)
  return found if found is not None else reference.strip()


def math_reward(completion: str, reference: str, use_math_verify: bool = True) -> float:
  """1.0 if the completion's final answer equals the reference (bare, boxed or ``####``), else 0.0.

  A completion that states no final answer scores 0.0. With ``math_verify`` installed (and
  ``use_math_verify``) its "equal" is accepted first; otherwise the rules of this module decide.
  """
  answer = extract_final_answer(completion)
  if answer is None:
    return 0.0
  gold = reference_answer(reference)
  if use_math_verify and math_verify_says(answer, gold):
    return 1.0
  return float(answers_match(answer, gold))
