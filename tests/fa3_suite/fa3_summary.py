"""The record of one run of FA3's test file: outcome counts, skips and left-out cases by key (fa3_features), and the
failures grouped into classes, written as summary.json and summary.md. Fed from pytest reports by fa3_plugin.py;
plain data here so the CPU tests can build one without a GPU."""
from __future__ import annotations

import collections
import dataclasses
import json
import linecache
import pathlib
import re
from typing import Dict, List

from fa3_features import FEATURES, skip_key

# Examples kept per failure class: enough to rerun one, not a copy of the junit file.
_EXAMPLES = 3
_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(\.\d+)?([eE][-+]?\d+)?")
_OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|out of memory", re.IGNORECASE)
FAILED_FILE = "failed.json"


def function_of(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def _normalized(text: str) -> str:
    """A message with its numbers replaced, so that one kind of failure at many shapes is one class."""
    return _NUMBER.sub("N", text)[:200]


def failure_class(nodeid: str, path: str, lineno: int, message: str) -> str:
    """One class per test function and kind of failure, from where the exception was raised (pytest's reprcrash):
    an assertion by the source line that failed (in FA3's file: which of out, dQ, dK, dV), any other exception by
    its message with the numbers taken out."""
    first = (message or "unknown failure").strip().splitlines()[0]
    if first.startswith(("assert ", "AssertionError")):
        source = linecache.getline(path, lineno).strip() if path else ""
        what = f"AssertionError at {pathlib.PurePath(path or '?').name}:{lineno}: {source}"
    else:
        what = _normalized(first)
    return f"{function_of(nodeid)}: {what}"


@dataclasses.dataclass
class Summary:
    """Counts of one run. `left_out` holds the cases deselected at collection (never run), `dropped` the sub-cases
    a case's own loop skipped (the case ran the rest)."""
    passed: int = 0
    failed: int = 0
    errors: int = 0
    selected: int = 0
    skipped: Dict[str, int] = dataclasses.field(default_factory=collections.Counter)
    left_out: Dict[str, int] = dataclasses.field(default_factory=collections.Counter)
    dropped: Dict[str, int] = dataclasses.field(default_factory=collections.Counter)
    failures: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    context: Dict[str, object] = dataclasses.field(default_factory=dict)

    def add_skip(self, message: str) -> None:
        self.skipped[skip_key(message)] += 1

    def add_failure(self, cls: str, nodeid: str, phase: str) -> None:
        if phase == "call":
            self.failed += 1
        else:
            self.errors += 1
        self.failures.setdefault(cls if phase == "call" else f"error in {phase}: {cls}", []).append(nodeid)

    def ok(self) -> bool:
        """What issue 39 asks: something ran, nothing failed, and every skip is a feature dash_attn does not offer
        (a skip for the time budget or the machine means the record is incomplete)."""
        return (self.passed > 0 and self.failed == 0 and self.errors == 0
                and all(key.startswith("feature:") for key in self.skipped))

    def as_dict(self) -> dict:
        classes = sorted(self.failures.items(), key=lambda kv: -len(kv[1]))
        return {
            "ok": self.ok(), "passed": self.passed, "failed": self.failed, "errors": self.errors,
            "selected": self.selected,
            "skipped": dict(sorted(self.skipped.items())),
            "left_out": dict(sorted(self.left_out.items())),
            "dropped_subcases": dict(sorted(self.dropped.items())),
            "failure_classes": [{"class": cls, "count": len(ids), "examples": ids[:_EXAMPLES]} for cls, ids in classes],
            "features_not_offered": {feature.key: feature.reason for feature in FEATURES},
            "context": self.context,
        }

    def markdown(self) -> str:
        data = self.as_dict()
        lines = [f"# FA3 test_flash_attn.py against dash_attn: {'OK' if data['ok'] else 'NOT OK'}", "",
                 f"passed {self.passed}, failed {self.failed}, errors {self.errors}, "
                 f"skipped {sum(self.skipped.values())}, left out at collection {sum(self.left_out.values())}, "
                 f"sub-cases dropped {sum(self.dropped.values())}", ""]
        for title, counts in (("Skipped", data["skipped"]), ("Left out at collection", data["left_out"]),
                              ("Sub-cases dropped inside cases", data["dropped_subcases"])):
            lines += [f"## {title}", ""] + ([f"- {key}: {n}" for key, n in counts.items()] or ["- none"]) + [""]
        lines += ["## Failure classes", ""]
        lines += ([f"- {c['count']} x {c['class']}\n  e.g. {c['examples'][0]}" for c in data["failure_classes"]]
                  or ["- none"])
        lines += ["", "## Not offered (tests/fa3_suite/fa3_features.py)", ""]
        lines += [f"- feature:{key}: {reason}" for key, reason in data["features_not_offered"].items()]
        lines += ["", "## Context", ""] + [f"- {key}: {value}" for key, value in self.context.items()]
        return "\n".join(lines) + "\n"

    def write(self, folder: pathlib.Path) -> None:
        """summary.json and summary.md, and failed.json: every failing case's node id by class (summary.json keeps
        a few examples a class; a serial retry needs them all)."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "summary.json").write_text(json.dumps(self.as_dict(), indent=1, default=str) + "\n")
        (folder / "summary.md").write_text(self.markdown())
        (folder / FAILED_FILE).write_text(json.dumps(self.failures, indent=1) + "\n")

    @classmethod
    def load(cls, folder: pathlib.Path) -> "Summary":
        data = json.loads((folder / "summary.json").read_text())
        return cls(passed=data["passed"], failed=data["failed"], errors=data["errors"], selected=data["selected"],
                   skipped=collections.Counter(data["skipped"]), left_out=collections.Counter(data["left_out"]),
                   dropped=collections.Counter(data["dropped_subcases"]),
                   failures=json.loads((folder / FAILED_FILE).read_text()), context=data["context"])

    def memory_failures(self) -> List[str]:
        """The classes of cases that ran out of GPU memory (beside other workers on the one GPU, typically)."""
        return [cls for cls in self.failures if _OUT_OF_MEMORY.search(cls)]

    def fold_retry(self, retry: "Summary", classes: List[str]) -> None:
        """Replaces the failures of `classes` by the outcomes of their cases run again (`retry`, a run of exactly
        those cases): a case counts once, with its retry's outcome; the context says how many were retried."""
        retried = 0
        for cls in classes:
            ids = self.failures.pop(cls)
            retried += len(ids)
            if cls.startswith("error in "):
                self.errors -= len(ids)
            else:
                self.failed -= len(ids)
        self.passed += retry.passed
        self.failed += retry.failed
        self.errors += retry.errors
        self.skipped.update(retry.skipped)
        self.dropped.update(retry.dropped)
        for cls, ids in retry.failures.items():
            self.failures.setdefault(cls, []).extend(ids)
        self.context["serial_retry"] = {"cases": retried, "passed": retry.passed,
                                        "failed": retry.failed + retry.errors,
                                        "why": "out of GPU memory beside the other workers"}
