"""L3 routing rules: per-tenant keyword, regex and prefix rules that map a prompt to an adapter.

Rules live in the database (`lorabatch routes add|list|remove`) and are matched in their order; the
first match wins. A classifier is anything with `classify(tenant_id, text)`; the rules are the
built-in one, and a learned intent classifier can stand in its place.
"""

from __future__ import annotations

import logging
import time
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
# Nor can a rule take the worker's memory or its event loop as it is compiled (each worker compiles every rule at start and
# at each rule change). The regex package builds a counted repeat out in full: `x{100000000}` asked for gigabytes (the
# kernel killed `routes add`, and would kill each worker over a stored rule), `x{1000000}` 270 MB and 0.4 s, and a 2 MB
# keyword took 6 s. A rule is matched against a prompt's first MATCH_CHARS characters, so a pattern longer than that, or
# whose counted repeats ask for more characters than that ({n} and {n,} counts multiplied through their groups), cannot
# match anything a rule reads anyway: it is refused.
MAX_PATTERN_CHARS = MATCH_CHARS
# Nor by staying under the timeout: `(a|aa)+$` takes 29 ms over 22 a's and a '!', so a producer sending such prompts held
# the event loop 29 ms a job for ever, the rule never reaching MATCH_TIMEOUT_S. Rules match 4096 characters in microseconds
# (0.06 ms for a case-blind alternation with `.*`); a match over SLOW_MATCH_S (twice the interpreter's 5 ms switch
# interval, so that waiting for another thread's turn does not count) counts its time against the rule, the count
# draining at SLOW_SHARE of the time passing, and a rule whose count reaches MATCH_TIMEOUT_S is skipped as a timed-out
# one is: a producer's prompts cost at most SLOW_MATCH_S a job and rule, or that share of the time.
SLOW_MATCH_S = 0.01
SLOW_SHARE = 0.01
_COUNT = regex.compile(r"\{([0-9]*)(?:,([0-9]*))?\}")
_GROUP_HEAD = regex.compile(r"\(\?(?:P?<[A-Za-z_][A-Za-z0-9_]*>|<[=!]|[=!>|:]|[A-Za-z^-]*[:)])")  # (?:, (?P<n>, (?<=, (?i)


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
    if len(rule.pattern) > MAX_PATTERN_CHARS:
        raise RuleError(f"rule pattern is {len(rule.pattern)} characters long; rules read a prompt's first {MATCH_CHARS} "
                        f"characters, so give at most {MAX_PATTERN_CHARS}")
    if rule.kind == "keyword":
        return regex.compile(rf"(?<!\w){regex.escape(rule.pattern)}(?!\w)", regex.IGNORECASE)
    if rule.kind == "prefix":
        return regex.compile(rf"\s*{regex.escape(rule.pattern)}", regex.IGNORECASE)
    if (wants := repeated_chars(rule.pattern)) > MATCH_CHARS:
        raise RuleError(f"regex {rule.pattern[:80]!r} repeats its way to {wants} characters at least ({{n}} counts multiplied "
                        f"through their groups), and rules read a prompt's first {MATCH_CHARS}; lower the counts")
    try:
        return regex.compile(rule.pattern)
    except (regex.error, OverflowError, RecursionError, ValueError, MemoryError) as e:
        raise RuleError(f"regex {rule.pattern[:200]!r} does not compile: {e}; fix the pattern") from e


def repeated_chars(pattern: str) -> int:
    """How many pattern items a regex's counted repeats build out to, from the pattern's text: each item counts 1, a group
    the sum of its items (all branches: each is compiled), and `{n}` or `{n,...}` after an item multiplies it by n. An
    upper bound of the shortest match for patterns without alternation, and what the regex package's compile grows with;
    `*`, `+`, `?` and `{0,n}` add nothing to it. Over-counts rather than under-counts where the text is ambiguous
    (comments in verbose mode, a brace that is a literal)."""
    stack = [[0, 0]]  # per open group: [total so far, cost of its last item]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        frame = stack[-1]
        if c == "\\":
            i += 2
            if i < n and pattern[i - 1] in "pPNxg" and pattern[i] == "{":  # \p{..}, \x{..}, \N{..}, \g{..}
                end = pattern.find("}", i)
                i = n if end < 0 else end + 1
            frame[0], frame[1] = frame[0] + 1, 1
            continue
        if c == "[":  # a set, nested sets included: one item
            depth, i = 1, i + 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            while i < n and depth:
                if pattern[i] == "\\":
                    i += 1
                elif pattern[i] == "[":
                    depth += 1
                elif pattern[i] == "]":
                    depth -= 1
                i += 1
            frame[0], frame[1] = frame[0] + 1, 1
            continue
        if c == "(":
            if pattern.startswith("(?#", i):
                end = pattern.find(")", i)
                i = n if end < 0 else end + 1
                continue
            head = _GROUP_HEAD.match(pattern, i)
            if head is not None and head.group().endswith(")"):  # (?i): flags, no group
                i = head.end()
                continue
            stack.append([0, 0])
            i = head.end() if head is not None else i + 1
            continue
        elif c == ")":
            if len(stack) > 1:
                group = stack.pop()[0]
                stack[-1][0] += group
                stack[-1][1] = group
        elif c == "{" and (count := _COUNT.match(pattern, i)) is not None and count.group(1):
            times = int(count.group(1))
            frame[0] += frame[1] * (times - 1) if times else 0
            frame[1] *= max(times, 1)
            i = count.end()
            continue
        elif c in "|*+?":
            pass
        else:
            frame[0], frame[1] = frame[0] + 1, 1
        i += 1
    while len(stack) > 1:
        group = stack.pop()[0]
        stack[-1][0] += group
    return stack[0][0]


class Classifier(Protocol):
    def classify(self, tenant_id: str, text: str) -> RouteRule | None: ...


class RuleClassifier:
    def __init__(self, rules: Iterable[RouteRule], *, clock=time.perf_counter):
        self._clock = clock
        self._strain: dict[int, tuple[float, float]] = {}  # rule id -> (its slow matches' seconds, net of the drain; when)
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
            t0 = self._clock()
            try:
                hit = rx.match(head, timeout=MATCH_TIMEOUT_S) if rule.kind == "prefix" else rx.search(head, timeout=MATCH_TIMEOUT_S)
            except TimeoutError:
                self._skip(rule, f"took over {MATCH_TIMEOUT_S * 1000:.0f} ms to match a prompt")
                continue
            if (took := (now := self._clock()) - t0) > SLOW_MATCH_S:
                retook, now = self._retime(rx, rule, head)
                took = min(took, retook)  # a pause of the process (a full collection) is not the rule's
            if took > SLOW_MATCH_S:
                strain, since = self._strain.get(rule.id, (0.0, now))
                strain = max(0.0, strain - (now - since) * SLOW_SHARE) + took
                self._strain[rule.id] = (strain, now)
                if strain >= MATCH_TIMEOUT_S:
                    self._skip(rule, f"took {took * 1000:.0f} ms to match a prompt, and over {MATCH_TIMEOUT_S * 1000:.0f} ms "
                                     f"lately in matches over {SLOW_MATCH_S * 1000:.0f} ms")  # fmt: skip
            if hit:
                return rule
        return None

    def _retime(self, rx: regex.Pattern, rule: RouteRule, head: str) -> tuple[float, float]:
        """The seconds the same match takes again, and the clock after it: a slow one counts against its rule only when it is slow twice, so
        that a pause of the process while it ran (a full collection of a large heap, a preempted thread) never skips a
        rule whose matches take microseconds."""
        t0 = self._clock()
        try:
            rx.match(head, timeout=MATCH_TIMEOUT_S) if rule.kind == "prefix" else rx.search(head, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            return MATCH_TIMEOUT_S, self._clock()
        return (now := self._clock()) - t0, now

    def _skip(self, rule: RouteRule, why: str) -> None:
        self.slow.add(rule.id)
        log.warning("routing rule %d of tenant %r (%s %r) %s and is skipped from now on; replace it with a pattern that does "
                    "not backtrack (`lorabatch routes remove %d`)", rule.id, rule.tenant_id, rule.kind, rule.pattern[:80], why,
                    rule.id)  # fmt: skip
