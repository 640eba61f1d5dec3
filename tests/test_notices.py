"""The one collector of notes and warnings: said once each, repeats counted, notes before warnings."""

from autotuner.notices import Notices


def test_a_repeated_notice_is_said_once_with_its_count_and_notes_come_first():
    said = Notices().warn("w1", "w2", "w1").note("n1").note("n1", "n2")
    assert said.lines() == ["note: n1 (2 times)", "note: n2", "warning: w1 (2 times)", "warning: w2"]
    assert Notices().lines() == []
