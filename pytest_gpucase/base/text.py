"""Text made inert for the place it is written: a terminal, Markdown, one line.

Every text the plugin prints or renders comes from a child, a case file, a report or a node
id, and is written where markup or a terminal would act on it: each function makes it inert
for one place. The patterns have bounded quantifiers only, so that a hostile text costs
linear time.
"""

from __future__ import annotations

import html
import re

__all__ = ["html_text", "markdown_code", "markdown_text", "one_line", "terminal_safe"]

_TERMINAL = re.compile(
    r"\x1b\[[0-?]{0,64}[ -/]{0,16}[@-~]"          # CSI: colours, cursor moves, screen clears
    r"|\x1b\][^\x07\x1b]{0,4096}(?:\x07|\x1b\\)"  # OSC: window titles, hyperlinks, clipboard
    r"|\r\n?"
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# Backslash-escapable punctuation that GitHub Markdown acts on anywhere in a line; an
# underscore inside a word (sm_80, ce_class4) cannot start emphasis, so it is left alone.
_MARKDOWN = re.compile(r"[\\`*\[\]<|#&~]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
# What starts a block when it begins a line: a quote, a list item, a setext underline.
_MARKDOWN_LINE_START = re.compile(r"[>+=-]|\d{1,9}[.)]")


def terminal_safe(text: str) -> str:
    """``text`` with no terminal control left: escapes removed, other controls shown as ``\\xNN``.

    Newlines and tabs stay; a carriage return becomes a newline, so that a progress bar
    cannot overwrite what was printed before it. Bidirectional overrides are shown as
    ``\\u202e`` and the like: they would make a line read differently from what it holds.
    """
    def replace(found: re.Match[str]) -> str:
        control = found.group(0)
        if len(control) > 1 and control[0] == "\x1b":
            return ""   # a whole escape sequence; a lone ESC is shown below
        if control[0] == "\r":
            return "\n"
        code = ord(control)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _TERMINAL.sub(replace, text)


def one_line(text: str, limit: int | None = None) -> str:
    """``text`` made safe for the terminal on one line (runs of whitespace, newlines
    included, become one space), cut to ``limit`` characters with an ellipsis."""
    line = " ".join(terminal_safe(text).split())
    return line if limit is None or len(line) <= limit else line[:limit - 1] + "…"


def html_text(text: str) -> str:
    """``text`` as HTML character data or an attribute value: markup escaped, and no
    control, escape sequence or bidirectional override left (shown as ``\\xNN``)."""
    return html.escape(terminal_safe(text))


def markdown_text(text: str) -> str:
    """``text`` as literal Markdown on one line (messages hold ``*``, ``|``, ``__init__``)."""
    line = _MARKDOWN.sub(lambda found: "\\" + found.group(0), one_line(text))
    return "\\" + line if _MARKDOWN_LINE_START.match(line) else line


def markdown_code(text: str) -> str:
    """``text`` as one Markdown code span, whatever backticks or newlines it holds."""
    line = one_line(text)
    longest = max((len(run) for run in re.findall(r"`+", line)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if line.startswith("`") or line.endswith("`") else ""
    return f"{fence}{pad}{line}{pad}{fence}"
