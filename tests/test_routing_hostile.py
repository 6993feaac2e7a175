"""Routing as a hostile producer and an operator on a bad day probe it: rules that cost the worker its memory or its event
loop, cache entries and ids that try to cross tenants, Redis refusing or forgetting."""

from __future__ import annotations

import pytest

from consumer.rules import MATCH_CHARS, RouteRule, RuleClassifier, RuleError, compile_rule


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        ("regex", "x{5000}"),  # can never match the 4096 characters a rule reads
        ("regex", "(?:(?:x{64}){64}){64}"),  # 262144: 60 MB to compile; x{100000000} asked for gigabytes
        ("regex", r"[a-z]{2000}\d{3000}"),
        ("keyword", "ab" * 3000),  # a 2 MB keyword took 6 s to compile, in each worker
        ("prefix", "x" * (MATCH_CHARS + 1)),
        ("regex", "a" * (MATCH_CHARS + 1)),
    ],
)
def test_a_rule_that_cannot_match_what_rules_read_is_refused_before_it_is_compiled(kind, pattern, monkeypatch):
    """`routes add --kind regex 'x{100000000}'` was compiled as given: the regex package builds a counted repeat out, so
    it asked for gigabytes (the kernel killed the command; a stored rule would kill each worker at start). A pattern
    longer than the MATCH_CHARS characters a rule reads, or counting its way past them, is refused as a RuleError
    before the regex package sees it."""
    import consumer.rules as rules

    compiled = []
    real = rules.regex.compile
    monkeypatch.setattr(rules.regex, "compile", lambda p, *a, **k: compiled.append(p) or real(p, *a, **k))
    with pytest.raises(RuleError, match=str(MATCH_CHARS)):
        compile_rule(RouteRule(0, "acme", kind, pattern, "legal"))
    assert compiled == []


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(?:ab){2048}", r"\p{L}{10}", r"x{0,100000}", r"(?:foo){e<=2}",
                                     r"[{]{5}", r"contract\s+#\d+", r"(?#{99999})refund"])  # fmt: skip
def test_counted_repeats_within_what_rules_read_still_compile(pattern):
    compile_rule(RouteRule(0, "acme", "regex", pattern, "legal"))


def test_a_stored_rule_past_the_bound_is_skipped_and_named(caplog):
    """A rule stored before `routes add` checked the bound (or by hand) is skipped with a warning naming it; the tenant's
    other rules still serve."""
    classifier = RuleClassifier((RouteRule(5, "acme", "regex", "(?:(?:x{64}){64}){64}", "legal", 0),
                                 RouteRule(6, "acme", "keyword", "help", "billing", 1)))  # fmt: skip
    assert classifier.classify("acme", "help me").id == 6
    said = [r.getMessage() for r in caplog.records if "routing rule 5" in r.getMessage()]
    assert len(said) == 1 and "lorabatch routes remove 5" in said[0]
