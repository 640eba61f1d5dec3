"""What a command says beside its figures: notes (a choice the tool made that the user should know of)
and warnings (something the user should act on). One collector, so that every command words, groups and
prints them alike: each said once, a repeat counted rather than printed again."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Notices:
    notes: Counter[str] = field(default_factory=Counter)
    warnings: Counter[str] = field(default_factory=Counter)

    def note(self, *texts: str) -> Notices:
        self.notes.update(texts)
        return self

    def warn(self, *texts: str) -> Notices:
        self.warnings.update(texts)
        return self

    def lines(self) -> list[str]:
        """``note: ...`` then ``warning: ...`` lines, in the order first said; a repeat as ``(N times)``."""
        return [*_said("note", self.notes), *_said("warning", self.warnings)]

    def print(self, stream: TextIO | None = None) -> None:
        for line in self.lines():
            print(line, file=stream or sys.stdout)


def _said(kind: str, counts: Counter[str]) -> Iterable[str]:
    for text, count in counts.items():
        yield f"{kind}: {text}" + (f" ({count} times)" if count > 1 else "")


def say_notes(*texts: str, stream: TextIO | None = None) -> None:
    """Print each of ``texts`` as a note (the common case of a collector used once)."""
    Notices().note(*texts).print(stream)
