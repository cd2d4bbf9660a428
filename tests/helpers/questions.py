"""Question files written by the tests, in the project's JSONL layout (question, answers, ctxs)."""

from __future__ import annotations

import json


def write_questions(path, rows, blank_after: int | None = None) -> str:
    """`rows` (QARow) to `path`, one JSON object a line; `blank_after=i` puts an empty line after row i (a file a
    reader must refuse or skip). Returns the path as a string, for a config override."""
    lines = []
    for i, r in enumerate(rows):
        record = {"question": r.question, "answers": list(r.answers)}
        record["ctxs"] = [{"title": c.title, "text": c.text} for c in r.contexts]
        lines.append(json.dumps(record) + "\n")
        if i == blank_after:
            lines.append("\n")
    path.write_text("".join(lines))
    return str(path)
