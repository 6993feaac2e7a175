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


class _Clock:
    """perf_counter for a classifier: each match of rule `slow_rule` takes `took` seconds, others nothing."""

    def __init__(self, took: float):
        self.now, self.took, self.calls = 1000.0, took, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the reading after a match
            self.now += self.took
        return self.now


def test_a_rule_kept_just_under_the_timeout_is_skipped_once_it_has_cost_the_timeout(caplog):
    """`(a|aa)+$` over 22 a's and a '!' takes 29 ms, under MATCH_TIMEOUT_S: a producer sending such prompts held the
    event loop 29 ms a job, for ever. Now matches over SLOW_MATCH_S add up; at MATCH_TIMEOUT_S the rule is skipped as a
    timed-out one is, named in the log; the tenant's other rules still match."""
    clock = _Clock(0.029)
    classifier = RuleClassifier((RouteRule(7, "acme", "regex", "(a|aa)+$", "legal", 0),), clock=clock)
    text = "a" * 22 + "!"
    assert classifier.classify("acme", text) is None and classifier.slow == set()
    assert classifier.classify("acme", text) is None and classifier.slow == {7}
    calls = clock.calls
    assert classifier.classify("acme", text) is None and clock.calls == calls  # not tried again
    said = [r.getMessage() for r in caplog.records if "routing rule 7" in r.getMessage()]
    assert len(said) == 1 and "lorabatch routes remove 7" in said[0] and "29 ms" in said[0], said


class _Paused:
    """perf_counter for a classifier whose first match is caught by a pause of `pause` seconds; later matches (and the
    same match timed again) take microseconds."""

    def __init__(self, pause: float):
        self.now, self.pause, self.calls = 1000.0, pause, 0

    def __call__(self) -> float:
        self.calls += 1
        self.now += self.pause if self.calls == 2 else 1e-5
        return self.now


def test_one_match_caught_by_a_pause_is_timed_again_and_does_not_skip_the_rule():
    """A 300 ms pause of the process (a full collection over a large heap) during one match of a rule that matches in
    microseconds: that one match alone counted 300 ms against the rule and skipped it for good, changing the tenant's
    routing. The slow match is timed again, and only a match slow twice counts."""
    classifier = RuleClassifier((RouteRule(9, "acme", "keyword", "help", "billing", 0),), clock=_Paused(0.3))
    assert classifier.classify("acme", "help me").id == 9
    assert classifier.slow == set() and classifier.classify("acme", "help me").id == 9


def test_fast_matches_and_rare_slow_ones_never_skip_a_rule():
    """A rule's matches take microseconds: those never count; nor do a few slow ones (a pause of the process) spread over
    time, as the count drains."""
    classifier = RuleClassifier((RouteRule(8, "acme", "keyword", "help", "billing", 0),), clock=_Clock(0.001))
    assert all(classifier.classify("acme", "help me").id == 8 for _ in range(1000))
    clock = _Clock(0.03)
    classifier = RuleClassifier((RouteRule(8, "acme", "keyword", "help", "billing", 0),), clock=clock)
    for _ in range(20):
        assert classifier.classify("acme", "help me").id == 8
        clock.now += 3600.0  # an hour between two such pauses
    assert classifier.slow == set()
