"""L3 routing rules: per-tenant keyword, regex and prefix rules that map a prompt to an adapter.

Rules live in the database (`lorabatch routes add|list|remove`) and are matched in their order; the
first match wins. A classifier is anything with `classify(tenant_id, text)`; the rules are the
built-in one, and a learned intent classifier can stand in its place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

import regex

log = logging.getLogger(__name__)

RuleKind = Literal["keyword", "regex", "prefix"]
KINDS: tuple[str, ...] = ("keyword", "regex", "prefix")

# Only the head of a prompt is matched: a rule should read intent, and a pathological regex over a
# megabyte prompt must not stall the event loop.
MATCH_CHARS = 4096
# Nor over a short one: `(a|aa)+$` backtracks exponentially in the length of a run of a's (4.7 s at 26 of them with
# Python's re), holding the worker's event loop, its other tenants and its SIGTERM. Rules are matched with the `regex`
# package, whose matching stops at a timeout; a rule that reaches it matches nothing and is skipped from then on, with
# a warning naming it. Keyword and prefix rules are escaped text and never take long.
MATCH_TIMEOUT_S = 0.05


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


def compile_rule(rule: RouteRule) -> regex.Pattern:
    """The rule as one regex; a bad pattern is refused when the rule is added, not when a job arrives."""
    if rule.kind not in KINDS:
        raise RuleError(f"rule kind {rule.kind!r} is unknown; use one of {', '.join(KINDS)}")
    if not rule.pattern:
        raise RuleError("rule pattern is empty; give the keyword, prefix or regex to match")
    if rule.kind == "keyword":
        return regex.compile(rf"(?<!\w){regex.escape(rule.pattern)}(?!\w)", regex.IGNORECASE)
    if rule.kind == "prefix":
        return regex.compile(rf"\s*{regex.escape(rule.pattern)}", regex.IGNORECASE)
    try:
        return regex.compile(rule.pattern)
    except (regex.error, OverflowError, RecursionError, ValueError) as e:
        raise RuleError(f"regex {rule.pattern!r} does not compile: {e}; fix the pattern") from e


class Classifier(Protocol):
    def classify(self, tenant_id: str, text: str) -> RouteRule | None: ...


class RuleClassifier:
    def __init__(self, rules: Iterable[RouteRule]):
        self.rules = tuple(rules)  # as given: a registry refresh with the same rules keeps this classifier
        self._by_tenant: dict[str, list[tuple[RouteRule, regex.Pattern]]] = {}
        self.slow: set[int] = set()  # ids of the rules that reached MATCH_TIMEOUT_S: skipped since
        for rule in sorted(self.rules, key=lambda r: (r.tenant_id, r.position, r.id)):
            try:
                compiled = compile_rule(rule)
            except RuleError as e:  # stored before `routes add` checked it, or by hand: the tenant's other rules still serve
                log.warning("routing rule %d of tenant %r is skipped: %s (`lorabatch routes remove %d`)", rule.id, rule.tenant_id, e, rule.id)
                continue
            self._by_tenant.setdefault(rule.tenant_id, []).append((rule, compiled))

    def classify(self, tenant_id: str, text: str) -> RouteRule | None:
        head = text[:MATCH_CHARS]
        for rule, rx in self._by_tenant.get(tenant_id, ()):
            if rule.id in self.slow:
                continue
            try:
                hit = rx.match(head, timeout=MATCH_TIMEOUT_S) if rule.kind == "prefix" else rx.search(head, timeout=MATCH_TIMEOUT_S)
            except TimeoutError:
                self.slow.add(rule.id)
                log.warning("routing rule %d of tenant %r (%s %r) took over %.0f ms to match a prompt and is skipped from now "
                            "on; replace it with a pattern that does not backtrack (`lorabatch routes remove %d`)", rule.id,
                            rule.tenant_id, rule.kind, rule.pattern[:80], MATCH_TIMEOUT_S * 1000, rule.id)  # fmt: skip
                continue
            if hit:
                return rule
        return None
