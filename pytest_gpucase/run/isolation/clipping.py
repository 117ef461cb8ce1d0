"""Text cut to its head and its tail, with what was omitted between them.

Used in both processes: the parent keeps the head and the tail of the child's fds 1 and 2
(``_Capture``), the child clips each string of its result before sending it, and the parent
clips what it reads again (``clip``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["CAPTURE_HEAD", "CAPTURE_TAIL", "TEXT_HEAD", "TEXT_TAIL", "clip"]

CAPTURE_HEAD = 16 * 1024
CAPTURE_TAIL = 48 * 1024
# The longest string of a result that reaches a report: its head and tail, and how much
# was cut between them (a 50 MB exception message must not be printed twice).
TEXT_HEAD = 4 * 1024
TEXT_TAIL = 12 * 1024

# A terminal escape sequence (colour, cursor, an OSC hyperlink or title): CSI, OSC ended by
# BEL or ST, or a two-byte escape. A cut is moved off one, so that no fragment ("red\x1b[",
# "[31mred") is left either side of the omitted bytes.
_ESCAPE = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)"
                     rb"|[ -/]*[0-Z\\^-~])")
_UNFINISHED = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[ -/]*)\Z")  # cut short
_ESCAPE_ROOM = 512  # the longest sequence a cut is moved off; a longer one is cut as text


class _Capture:
    """Keep the head and the tail of a stream, and count what fell between them.

    ``marks`` maps a line the stream may hold (a label the child writes, say) to what the
    omission marker says when that line begins in the omitted part, where the reader would
    otherwise never learn that it was there.
    """

    def __init__(self, head: int = CAPTURE_HEAD, tail: int = CAPTURE_TAIL,
                 marks: Mapping[str, str] | None = None) -> None:
        self.head_limit, self.tail_limit = head, tail
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.lost = b""  # the last bytes dropped, just before the tail: a sequence may span
        self.marks = {line.encode(): said for line, said in (marks or {}).items()
                      if 0 < len(line.encode()) <= tail}
        self.omitted_marks: list[str] = []  # what the omission marker says, in stream order

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        excess = len(self.tail) - self.tail_limit
        if excess > 0:
            for line, said in self.marks.items():
                # One that begins in the bytes dropped now: all of it is still in the tail,
                # which keeps more than a line's length past them. One search (memchr speed)
                # of what is dropped anyway.
                if said not in self.omitted_marks and self.tail.find(
                        line, 0, excess + len(line) - 1) >= 0:
                    self.omitted_marks.append(said)
            self.lost = (self.lost + self.tail[max(0, excess - _ESCAPE_ROOM):excess])[
                -_ESCAPE_ROOM:]
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        head, tail = bytes(self.head), bytes(self.tail)
        if not self.dropped:
            return (head + tail).decode(errors="replace")
        unfinished = _UNFINISHED.search(head, max(0, len(head) - _ESCAPE_ROOM))
        if unfinished is not None:
            head = head[:unfinished.start()]  # a sequence the cut began
        start = self.lost.rfind(b"\x1b")
        if start >= 0:
            spanning = _ESCAPE.match(self.lost + tail[:_ESCAPE_ROOM], start)
            if spanning is not None and spanning.end() > len(self.lost):
                tail = tail[spanning.end() - len(self.lost):]  # the rest of one it ended
        omitted = self.dropped + len(self.head) - len(head) + len(self.tail) - len(tail)
        said = "".join(f"; {text}" for text in self.omitted_marks)
        return (head.decode(errors="replace") + f"\n[... {omitted} bytes omitted{said} ...]\n"
                + tail.decode(errors="replace"))


_MARKER_ROOM = 48  # "\n[... N bytes omitted ...]\n" for any N a result can have


def clip(text: str, head: int = TEXT_HEAD, tail: int = TEXT_TAIL) -> str:
    """``text`` cut to its first ``head`` and last ``tail`` bytes, with what was omitted.

    Text clipped already (by the child; the parent clips what it reads again) is left
    as it is: the room for the "[... N bytes omitted ...]" line keeps its count true.
    """
    limit = head + tail + _MARKER_ROOM
    if len(text) <= limit and len(text.encode(errors="replace")) <= limit:
        return text
    capture = _Capture(head, tail)
    capture.add(text.encode(errors="replace"))
    return capture.text()
