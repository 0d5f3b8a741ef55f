"""bench/fidelity/grounding.py: a grounding repair is a catch, a false alarm or other, by what
the unchecked blend answered."""

from __future__ import annotations

import json

from bench.fidelity.grounding import rows, tally


def sample(case: int, contains: float, identical: bool, reason: str | None = None) -> dict:
    return {
        "case": case,
        "order": 0,
        "score": {"contains": contains},
        "identical": identical,
        "repair_reason": reason,
        "repair_span": "1769" if reason == "grounding" else None,
    }


def test_repairs_are_judged_by_the_unchecked_answer(tmp_path):
    off = [
        sample(0, 0.0, False),
        sample(1, 1.0, True),
        sample(2, 1.0, False),
        sample(3, 0.0, False),
    ]
    on = [
        sample(0, 1.0, True, "grounding"),  # wrong without the check, fixed: a catch
        sample(1, 1.0, True, "grounding"),  # full's answer anyway: a false alarm
        sample(2, 1.0, False, "grounding"),
        sample(3, 0.0, False, "margin"),  # wrong and not repaired for grounding: missed
    ]
    path = tmp_path / "report.json"
    modes = [{"mode": "off", "samples": off}, {"mode": "on", "samples": on}]
    path.write_text(json.dumps({"options": {}, "modes": modes}))
    by_row = rows(path)
    counts = tally(by_row["off"], by_row["on"])
    assert counts["grounding repairs"] == 3
    assert (counts["catch"], counts["false alarm"], counts["other"]) == (1, 1, 1)
    assert (counts["fixed"], counts["missed"]) == (1, 1)
    assert (counts["wrong without"], counts["wrong with"]) == (2, 1)
