"""The closing note's table from the rows the adversarial tests append.

    LORABATCH_ADVERSARIAL_REPORT=/tmp/adversarial.jsonl pytest tests/adversarial
    python -m tests.adversarial.report /tmp/adversarial.jsonl

A scenario run more than once shows its last row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (("scenario", "scenario"), ("outcome", "outcome"), ("cases", "cases"), ("lost", "lost"),
           ("double_billed", "double-billed"), ("published_twice", "published >1"), ("dead_workers", "dead workers"),
           ("unbilled", "unbilled"), ("busy_gap_us", "busy - attributed (us)"), ("dlq", "DLQ records"))


def render(rows: list[dict]) -> str:
    last = {r["scenario"]: r for r in rows}
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " | why it failed |",
             "|" + "---|" * (len(COLUMNS) + 1)]
    for r in last.values():
        why = (r.get("failure") or "").replace("|", "\\|")[:160]
        lines.append("| " + " | ".join(str(r.get(key, "")) for key, _ in COLUMNS) + f" | {why} |")
    totals = {key: sum(int(r.get(key) or 0) for r in last.values()) for key, _ in COLUMNS[2:]}
    lines.append("| **total** | " + f"{sum(r.get('outcome') == 'passed' for r in last.values())}/{len(last)} passed | "
                 + " | ".join(str(totals[key]) for key, _ in COLUMNS[2:]) + " | |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.adversarial.report REPORT.jsonl", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in Path(argv[0]).read_text().splitlines() if line.strip()]
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
