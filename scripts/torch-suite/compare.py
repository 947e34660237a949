#!/usr/bin/env python3
"""Compares the per-test outcomes of two torch-suite logs (run.sh writes
OUT_DIR/MODE.log with pytest -v), e.g. native.log and streamalloc.log of
one test file:

    scripts/torch-suite/compare.py OUT_DIR/native.log OUT_DIR/streamalloc.log

Prints each log's count of every outcome, then each test whose outcome
differs or that ran in one log only. Exit status: 0 every outcome the same,
1 some differ, 2 a log unreadable or without a single outcome line (a run
that stopped before its tests, say)."""

import re
import sys
from collections import Counter

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
# pytest -v: "file.py::Class::test[param] OUTCOME" then a reason in
# parentheses and/or the progress "[ 42%]"; not a summary line, which
# starts with its outcome ("FAILED file.py::test - message").
OUTCOME_NAMES = "|".join(OUTCOMES)
OUTCOME_LINE = re.compile(rf"^(?!(?:{OUTCOME_NAMES}) )(\S.*?::\S.*?) ({OUTCOME_NAMES})(?= |$)")


def read_outcomes(path):
    """{test id: outcome} of a log. A test reported twice (an error in
    teardown after a pass) keeps its worse outcome, ERROR."""
    outcomes = {}
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            match = OUTCOME_LINE.match(line.rstrip("\n"))
            if match is None:
                continue
            test, outcome = match.groups()
            if outcomes.get(test) != "ERROR":
                outcomes[test] = outcome
    return outcomes


def counts_line(name, outcomes):
    counts = Counter(outcomes.values())
    listed = ", ".join(f"{counts[o]} {o.lower()}" for o in OUTCOMES if counts[o])
    return f"{name}: {listed} ({len(outcomes)} tests)"


def main(argv):
    if len(argv) != 3:
        print("usage: compare.py LOG_A LOG_B", file=sys.stderr)
        return 2
    logs = []
    for path in argv[1:]:
        try:
            outcomes = read_outcomes(path)
        except OSError as error:
            print(f"compare: cannot read {path}: {error.strerror}", file=sys.stderr)
            return 2
        if not outcomes:
            print(f"compare: no test outcomes in {path} (pytest -v lines 'file::test OUTCOME')", file=sys.stderr)
            return 2
        logs.append((path, outcomes))
    (name_a, a), (name_b, b) = logs
    print(counts_line(name_a, a))
    print(counts_line(name_b, b))
    differ = [(test, a.get(test, "not run"), b.get(test, "not run"))
              for test in sorted(a.keys() | b.keys()) if a.get(test) != b.get(test)]
    for test, outcome_a, outcome_b in differ:
        print(f"differs: {test}: {outcome_a} / {outcome_b}")
    print(f"{len(differ)} of {len(a.keys() | b.keys())} tests differ" if differ else "every outcome the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
