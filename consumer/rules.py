"""L3 routing rules: per-tenant keyword, regex and prefix rules that map a prompt to an adapter.

Rules live in the database (`lorabatch routes add|list|remove`) and are matched in their order; the
first match wins. A classifier is anything with `classify(tenant_id, text)`; the rules are the
built-in one, and a learned intent classifier can stand in its place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

RuleKind = Literal["keyword", "regex", "prefix"]
KINDS: tuple[str, ...] = ("keyword", "regex", "prefix")

# Only the head of a prompt is matched: a rule should read intent, and a pathological regex over a
# megabyte prompt must not stall the event loop.
MATCH_CHARS = 4096


class RuleError(ValueError):
    retriable = False


@dataclass(frozen=True)
class RouteRule:
    id: int
    tenant_id: str
    kind: RuleKind
    pattern: str
    adapter: str  # name or name@version
    position: int = 0


def compile_rule(rule: RouteRule) -> re.Pattern:
    """The rule as one regex; a bad pattern is refused when the rule is added, not when a job arrives."""
    if rule.kind not in KINDS:
        raise RuleError(f"rule kind {rule.kind!r} is unknown; use one of {', '.join(KINDS)}")
    if not rule.pattern:
        raise RuleError("rule pattern is empty; give the keyword, prefix or regex to match")
    if rule.kind == "keyword":
        return re.compile(rf"(?<!\w){re.escape(rule.pattern)}(?!\w)", re.IGNORECASE)
    if rule.kind == "prefix":
        return re.compile(rf"\s*{re.escape(rule.pattern)}", re.IGNORECASE)
    try:
        return re.compile(rule.pattern)
    except re.error as e:
        raise RuleError(f"regex {rule.pattern!r} does not compile: {e}; fix the pattern") from e


class Classifier(Protocol):
    def classify(self, tenant_id: str, text: str) -> RouteRule | None: ...


class RuleClassifier:
    def __init__(self, rules: Iterable[RouteRule]):
        self._by_tenant: dict[str, list[tuple[RouteRule, re.Pattern]]] = {}
        for rule in sorted(rules, key=lambda r: (r.tenant_id, r.position, r.id)):
            self._by_tenant.setdefault(rule.tenant_id, []).append((rule, compile_rule(rule)))

    def classify(self, tenant_id: str, text: str) -> RouteRule | None:
        head = text[:MATCH_CHARS]
        for rule, rx in self._by_tenant.get(tenant_id, ()):
            hit = rx.match(head) if rule.kind == "prefix" else rx.search(head)
            if hit:
                return rule
        return None
