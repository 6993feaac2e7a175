"""OpenAI Batch API files: what `submit` reads and what `results --format openai` writes, checked with the
`openai` package's own types (ChatCompletion, Completion, BatchError) over answers of the real engine."""

from __future__ import annotations

import asyncio
import json
import re
import unicodedata
import uuid
from pathlib import Path
from typing import Any

import pytest
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict
from typer.testing import CliRunner

from consumer.broker import ensure_topics
from consumer.cli import build_app
from consumer.config import load_settings
from consumer.kafka import make_producer
from consumer.offline import run_offline
from consumer.openai_batch import (
    CHAT, COMPLETIONS, from_openai_line, index_parts, request_id_for, to_openai_dlq_line, to_openai_line,
)
from consumer.outcomes import engine_error_field
from consumer.schemas import BatchManifest, DlqRecord, ErrorInfo, Job, OpenAIRequest, Result
from consumer.batch_file import prepare
from consumer.submit import produce_jobs, read_manifest
from engine.config import EngineConfig

IDENT = re.compile(r"^[A-Za-z0-9_.:@/\-]{1,128}$")  # schemas.Ident


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    status_code: int
    request_id: str
    body: dict


class _Error(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    code: str
    message: str


class BatchOutputLine(BaseModel):
    """One line of an OpenAI Batch output file, as the Batch API documents it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    custom_id: str
    response: _Response | None
    error: _Error | None


def check_line(line: dict, asked: dict) -> Any:
    """`line` is a valid output line for the input line `asked`; returns the parsed openai body (or None)."""
    line = json.loads(json.dumps(line))  # what the file holds
    parsed = BatchOutputLine.model_validate(line)
    assert parsed.custom_id == asked["custom_id"], (parsed.custom_id, asked["custom_id"])
    if parsed.error is not None:
        BatchError.model_validate(line["error"])
        if parsed.response is not None:
            assert parsed.response.status_code >= 400
            err = parsed.response.body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == parsed.error.code
        return None
    assert parsed.response is not None and parsed.response.status_code == 200
    body = parsed.response.body
    kind = ChatCompletion if asked["url"] == CHAT else Completion
    model = kind.model_validate(body)
    assert set(body) <= set(kind.model_fields), set(body) - set(kind.model_fields)  # no field OpenAI lacks
    assert model.model == asked["body"].get("model", model.model)  # echoed as asked, not name@version
    assert model.created > 0 and len(model.choices) == 1
    if asked["url"] == CHAT:
        assert model.object == "chat.completion" and model.choices[0].message.role == "assistant"
        assert isinstance(model.choices[0].message.content, str)
    else:
        assert model.object == "text_completion" and isinstance(model.choices[0].text, str)
    assert model.usage.total_tokens == model.usage.prompt_tokens + model.usage.completion_tokens
    return model


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _chat(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": "support", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, **body}}


def _comp(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": {"model": "support", "prompt": "once upon", "max_tokens": 6, **body}}


UNICODE_IDS = ["línea 1 ✓", "with spaces", "emoji 🚀 id", "tab\there", "cid-" + "0" * 32, "a" * 129, "多语言", '"quoted"\\']


@pytest.fixture(scope="module")
def answered(demo_set, tmp_path_factory):
    """An OpenAI input file of both endpoints (logprobs, unicode ids, n: 1, a job over the engine's limit) run on the
    engine: (input lines, Prepared, results by request id)."""
    tmp = tmp_path_factory.mktemp("openai")
    lines = [
        _chat("chat-logprobs", logprobs=True, top_logprobs=3),
        _chat("chat-plain", n=1, temperature=0.7, seed=5, stop="\n", user="u-1"),
        _chat("chat-parts", messages=[{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                      {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]),
        _chat("chat-no-logprobs", logprobs=False, max_completion_tokens=4, max_tokens=None),
        _comp("comp-logprobs", logprobs=2),
        _comp("comp-zero-logprobs", logprobs=0),
        _comp("comp-ids", prompt=[5, 6, 7, 8]),
        _comp("comp-list", prompt=["a list of one"], n=None, stream=False, presence_penalty=0, metadata={"k": "v"}),
        _comp("comp-too-many", max_tokens=9999),
        _chat("chat-too-many", max_tokens=9999),
        _comp("comp-versioned", model="support@1"),
        *[(_chat if i % 2 else _comp)(cid) for i, cid in enumerate(UNICODE_IDS)],
    ]
    path = _write(tmp / "in.jsonl", lines)
    prepared = prepare(path, "local", "b1")
    assert prepared.errors == []
    jobs = _write(tmp / "jobs.jsonl", [j.model_dump_json(exclude_none=True) for j in prepared.jobs])
    cfg = EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_new_tokens=16, max_prompt_tokens=200)
    adapter = next(iter(demo_set["adapters"].values()))
    results = {}
    for text in run_offline(cfg, {"support": adapter, "support@1": adapter}, jobs):
        r = Result.model_validate({"tenant_id": "local", **json.loads(text)})
        results[r.request_id] = r
    return lines, prepared, results


def test_every_output_line_parses_as_openai_types(answered):
    """Every answer, of either endpoint, with or without logprobs, succeeded or failed, is a Batch output line
    whose body the openai package's ChatCompletion or Completion reads, custom_id exact and model as asked."""
    lines, prepared, results = answered
    by_custom = {line["custom_id"]: line for line in lines}
    assert len(results) == len(lines)
    seen = set()
    for rid, request in prepared.openai.items():
        line = to_openai_line(results[rid], request, created=1764633600)
        check_line(line, by_custom[request.custom_id])
        seen.add(request.custom_id)
    assert seen == set(by_custom)


def test_logprobs_come_in_each_endpoint_shape(answered):
    """Chat: choices[].logprobs.content entries with top_logprobs; completions: tokens, token_logprobs,
    top_logprobs (dicts) and text_offset, one per generated token."""
    lines, prepared, results = answered
    by_custom = {line["custom_id"]: line for line in lines}
    index = {req.custom_id: rid for rid, req in prepared.openai.items()}

    def parsed(cid):
        return check_line(to_openai_line(results[index[cid]], prepared.openai[index[cid]], 1), by_custom[cid])

    chat = parsed("chat-logprobs")
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens > 0
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 and isinstance(e.bytes, list) for e in content)
    assert parsed("chat-plain").choices[0].logprobs is None
    assert parsed("chat-no-logprobs").usage.completion_tokens <= 4

    comp = parsed("comp-logprobs")
    lp = comp.choices[0].logprobs
    n = comp.usage.completion_tokens
    assert n > 0 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(isinstance(d, dict) and 1 <= len(d) <= 2 for d in lp.top_logprobs)
    assert all(len(d) == 0 for d in parsed("comp-zero-logprobs").choices[0].logprobs.top_logprobs)
    assert parsed("comp-ids").usage.prompt_tokens == 4
    assert parsed("comp-versioned").model == "support@1"


def test_a_failed_job_is_an_error_line_naming_the_field_and_range(answered):
    """max_tokens over the engine's limit: `error` with the code, and a 400 response whose param names body.max_tokens
    and whose message gives the allowed range; the native result names the field too (never `field: null`)."""
    lines, prepared, results = answered
    for cid in ("comp-too-many", "chat-too-many"):
        rid = request_id_for(cid, "b1")
        native = results[rid]
        assert native.status == "failed" and native.error.field == "max_new_tokens"
        assert "1..16" in native.error.message
        line = to_openai_line(native, prepared.openai[rid], 1)
        check_line(line, {"custom_id": cid})
        assert line["error"]["code"] == "max_new_tokens_too_large"
        assert line["response"]["status_code"] == 400
        assert line["response"]["body"]["error"]["param"] == "body.max_tokens"


@pytest.mark.parametrize(("code", "status"), [("invalid_job", 400), ("unknown_adapter", 404), ("adapter_forbidden", 403),
                                              ("quota_exceeded", 429), ("engine_failed", 500), ("result_too_large", 500)])
def test_error_lines_carry_the_http_status(code, status):
    request = OpenAIRequest(custom_id="x y", url=CHAT, model="m")
    failed = Result(request_id="cid-1", tenant_id="t", status="failed", error=ErrorInfo(code=code, message="why", field="adapter"))
    line = to_openai_line(failed, request, 1)
    check_line(line, {"custom_id": "x y"})
    assert line["response"]["status_code"] == status and line["response"]["body"]["error"]["param"] == "body.model"


def test_a_dead_lettered_job_is_an_error_line_without_response():
    line = to_openai_dlq_line("cid-2", OpenAIRequest(custom_id="ü", url=COMPLETIONS), ErrorInfo(code="message_too_large", message="m"))
    check_line(line, {"custom_id": "ü"})
    assert line["response"] is None and line["error"] == {"code": "message_too_large", "message": "m"}


@pytest.mark.parametrize(("field", "asked", "param"), [
    ("messages.0.content", None, "messages.0.content"),  # a native job's: the path once, not messages.0.content.0.content
    ("input_ids.2", None, "input_ids.2"),
    ("messages.0.content", OpenAIRequest(custom_id="c", url=CHAT), "body.messages.0.content"),
    ("input_ids.2", OpenAIRequest(custom_id="c", url=COMPLETIONS), "body.prompt.2"),
    ("priority", OpenAIRequest(custom_id="c", url=CHAT), "priority"),
])
def test_a_nested_field_is_named_once(field, asked, param):
    """An error inside a list names its path as the job or the line has it; a field the line has no name for (a native
    job's) doubled its path."""
    failed = Result(request_id="r", tenant_id="t", status="failed", error=ErrorInfo(code="invalid_job", message="m", field=field))
    assert to_openai_line(failed, asked, 1)["response"]["body"]["error"]["param"] == param


def test_a_native_batch_written_as_openai_is_a_completion():
    """Results of native jobs (no OpenAI line known) come out as /v1/completions answers of the resolved adapter."""
    ok = Result(request_id="r", tenant_id="t", adapter="support@2", status="succeeded", text="hi", finish_reason="eos")
    line = to_openai_line(ok, None, 7)
    model = check_line(line, {"custom_id": "r", "url": COMPLETIONS, "body": {}})
    assert model.model == "support@2" and model.choices[0].finish_reason == "stop"


REFUSED = [
    (_chat("a", n=2), "body.n: 2; only 1 is supported; send n copies with their own custom_id"),
    (_comp("a", n=3), "body.n: 3; only 1 is supported"),
    (_comp("a", best_of=2), "body.best_of: 2; only 1 is supported"),
    (_chat("a", n=True), "body.n: true; only 1 is supported"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}},
     "url: '/v1/embeddings' is not supported; lorabatch serves /v1/chat/completions and /v1/completions"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": {"model": "m", "input": "x"}},
     "url: '/v1/responses' is not supported"),
    ({"custom_id": "a", "body": {"model": "m", "prompt": "x"}}, "url: missing; lorabatch serves /v1/chat/completions and /v1/completions"),
    ({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}, "method: 'GET'; OpenAI batch lines are POST"),
    ({"custom_id": "a", "url": CHAT, "body": {}, "extra": 1}, "extra: not a field of an OpenAI batch line"),
    ({"custom_id": "a", "url": CHAT, "body": "x"}, "body: missing or not an object"),
    (_chat("a", stream=True), "body.stream: true; batch results are not streamed"),
    (_chat("a", tools=[]), "body.tools: not supported by lorabatch; remove it (supported: "),
    (_chat("a", logit_bias={"1": 5}), "body.logit_bias: not supported by lorabatch"),
    (_chat("a", presence_penalty=0.5), "body.presence_penalty: 0.5; only 0 is supported"),
    (_chat("a", response_format={"type": "json_object"}), "body.response_format: "),
    (_chat("a", prompt="x"), "body.prompt: a field of /v1/completions, not of /v1/chat/completions"),
    (_comp("a", messages=[]), "body.messages: a field of /v1/chat/completions, not of /v1/completions"),
    ({"custom_id": "a", "url": CHAT, "body": {"model": "m"}}, "body.messages: missing"),
    ({"custom_id": "a", "url": COMPLETIONS, "body": {"model": "m"}}, "body.prompt: missing"),
    (_comp("a", prompt=["one", "two"]), "body.prompt: use one string or one list of token ids"),
    (_comp("a", prompt=[]), "body.prompt: use one string"),
    (_comp("a", prompt={"x": 1}), "body.prompt: use one string"),
    (_chat("a", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
     "body.messages.0.content.0: a part of type 'image_url'; only text parts"),
    (_chat("a", messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
     "body.messages.0.content.0.text: int, not a string"),
    (_chat("a", messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]),
     "body.messages.0.content.0.text: NoneType, not a string"),
    (_chat("a", messages=[{"role": "user", "content": [{"type": ["text"]}]}]), "body.messages.0.content.0: a part of type \"['text']\""),
    (_chat("a", messages=[{"role": "user", "content": ["plain"]}]), "body.messages.0.content.0: a part of type 'str'"),
    (_chat("a", messages=[{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]),
     "body.messages.0.content: holds a lone UTF-16 surrogate"),
    ('{"prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}", "the JSON nests too deeply"),
    (_chat("a", messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]),
     "body.messages.0.tool_calls: not supported by lorabatch; send the conversation as text"),
    (_chat("a", messages=[{"role": "assistant", "content": None, "refusal": "no"}]), "body.messages.0.refusal: not supported"),
    (_chat("a", top_logprobs=2), "body.top_logprobs: needs logprobs: true"),
    (_chat("a", logprobs=3), "body.logprobs: 3; use true or false"),
    (_comp("a", logprobs=True), "body.logprobs: true; use an integer 0..20"),
    (_chat("a", max_tokens=4, max_completion_tokens=4), "body.max_completion_tokens: give it or max_tokens, not both"),
    ({**_chat("a"), "custom_id": 5}, "custom_id: missing or not a non-empty string"),
    ({**_chat("a"), "custom_id": ""}, "custom_id: missing or not a non-empty string"),
    ({**_chat("a"), "custom_id": "x" * 5000}, "custom_id: 5000 characters, over 4096"),
    ('{"custom_id": "\\ud800", "url": "/v1/completions", "body": {"prompt": "x"}}', "custom_id: holds a lone surrogate"),
    # the job's own checks, named by the line's field
    (_chat("a", max_tokens="5"), "body.max_tokens: Input should be a valid integer"),
    (_chat("a", max_tokens=0), "body.max_tokens: Input should be greater than or equal to 1"),
    (_comp("a", max_tokens=200_000), "body.max_tokens: Input should be less than or equal to 131072"),
    (_chat("a", top_logprobs=21, logprobs=True), "body.top_logprobs: Input should be less than or equal to 20"),
    (_chat("a", temperature=9), "body.temperature: Input should be less than or equal to 5"),
    (_chat("a", model="no spaces allowed"), "body.model: String should match pattern"),
    (_chat("a", messages=[{"role": "wizard", "content": "x"}]), "body.messages.0.role: Input should be"),
    (_comp("a", prompt=[1, -1]), "body.prompt.1: Input should be greater than or equal to 0"),
]


@pytest.mark.parametrize(("line", "said"), REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_unsupported_lines_are_refused_by_name(tmp_path, line, said):
    """Each refusal is a rejected line (line 2) that names the line's own field and the fix; the good line goes on."""
    out = prepare(_write(tmp_path / "in.jsonl", [_chat("good"), line]), "acme", "b")
    assert [j.request_id for j in out.jobs] == ["b:good"]
    assert len(out.errors) == 1 and out.errors[0].startswith("line 2: "), out.errors
    assert said in out.errors[0], out.errors[0]


@pytest.mark.parametrize("line", [_chat("a", n=1), _chat("a", n=None), _chat("a", stream=False), _chat("a", presence_penalty=0.0),
                                  _chat("a", frequency_penalty=0), _chat("a", metadata={"x": "y"}, store=False, service_tier="auto"),
                                  _chat("a", response_format={"type": "text"}), _chat("a", stop=None, seed=None, temperature=None),
                                  _chat("a", messages=[{"role": "user", "content": "x", "name": "bob"}]),
                                  _chat("a", user="jane.doe+batch@example.com"), _chat("a", user="名前 with spaces"),
                                  # an earlier answer's message as the openai package dumps it (message.model_dump())
                                  _chat("a", messages=[{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": "a", "refusal": None, "tool_calls": None,
                                                        "function_call": None, "audio": None},
                                                       {"role": "user", "content": "again"}])])
def test_neutral_fields_are_accepted(tmp_path, line):
    """Fields that ask for nothing the engine does not do anyway (n: 1, stream: false, a zero penalty, null) are taken."""
    out = prepare(_write(tmp_path / "in.jsonl", [line]), "acme", "b")
    assert out.errors == [] and len(out.jobs) == 1


def test_any_user_is_a_stable_routing_key(tmp_path):
    """OpenAI's `user` may be any string: a plain one is the job's user_id, any other the same hash every time."""
    out = prepare(_write(tmp_path / "in.jsonl", [_chat("a", user="u-1"), _chat("b", user="jane+x@example.com"),
                                                 _chat("c", user="jane+x@example.com"), _chat("d", user="other one")]), "acme", "b")
    assert out.errors == []
    users = [j.user_id for j in out.jobs]
    assert users[0] == "u-1" and users[1] == users[2] != users[3] and all(IDENT.match(u) for u in users)


def test_an_empty_user_names_no_user(tmp_path):
    """`user: ""` (a client library's unset default) is a string OpenAI takes, and names no end user: the line was
    refused (`body.user: String should have at least 1 character`); it is a job without a user_id."""
    out = prepare(_write(tmp_path / "in.jsonl", [_chat("a", user=""), _comp("b", user="")]), "acme", "b")
    assert out.errors == [] and [j.user_id for j in out.jobs] == [None, None]


def test_custom_ids_map_to_distinct_request_ids(tmp_path):
    """Any custom_id gets a valid request id; different custom ids never share one (a plain id that looks like a
    hashed one is hashed too); Unicode forms are not folded; the same custom_id twice is refused by name."""
    tricky = ["a", "a b", "A", "a\u00e9", unicodedata.normalize("NFD", "a\u00e9"), request_id_for("a b", "b"), "x" * 126, "x" * 127,
              " ", "\u0000nul", "line\nbreak", "/slash:colon@at", *UNICODE_IDS]
    ids = [request_id_for(c, "b") for c in tricky]
    assert all(IDENT.match(i) for i in ids), ids
    assert len(set(ids)) == len(tricky)
    assert request_id_for("a", "b") == "b:a" and request_id_for("x" * 126, "b") == "b:" + "x" * 126
    out = prepare(_write(tmp_path / "in.jsonl", [_chat(c) for c in tricky] + [_chat("a b")]), "acme", "b")
    assert [r.custom_id for r in out.openai.values()] == tricky
    assert out.errors == [f"line {len(tricky) + 1}: custom_id 'a b' appears twice (first on line 2); custom ids are unique per batch"]
    assert {j.request_id: j for j in out.jobs}.keys() == out.openai.keys()


def test_a_custom_id_is_a_request_of_its_batch(tmp_path):
    """OpenAI's custom ids are unique within a batch only: the same `request-1` in two batches is two requests (as the
    request id itself, the second batch's took the first's answer); the same batch submitted again keeps its ids (its
    answers are replayed, not run twice); ids never meet across batches (batch ids hold no newline), whatever ':'
    either holds."""
    lines = [_chat("request-1"), _chat("request-2")]
    first = prepare(_write(tmp_path / "a.jsonl", lines), "acme", "batch-a")
    again = prepare(_write(tmp_path / "b.jsonl", lines), "acme", "batch-a")
    other = prepare(_write(tmp_path / "c.jsonl", lines), "acme", "batch-b")
    assert [j.request_id for j in first.jobs] == [j.request_id for j in again.jobs] == ["batch-a:request-1", "batch-a:request-2"]
    assert [j.request_id for j in other.jobs] == ["batch-b:request-1", "batch-b:request-2"]
    assert [r.custom_id for r in other.openai.values()] == ["request-1", "request-2"]
    pairs = [("a", "b:c"), ("a:b", "c"), ("a", "b\nc"), ("a", "b c"), ("x" * 100, "y" * 40), ("cid-1", "z"), ("b", "cid-2")]
    ids = [request_id_for(c, b) for b, c in pairs]
    assert len(set(ids)) == len(pairs) and all(IDENT.match(i) for i in ids), ids
    assert ids[0] == "a:b:c" and ids[1].startswith("cid-") and ids[4].startswith("cid-")


def test_index_parts_split_and_refuse():
    """The OpenAI index goes into manifest parts under the limit, every entry once; an entry that fits no part is refused."""
    index = {request_id_for(f"custom {i} ✓", "b1"): OpenAIRequest(custom_id=f"custom {i} ✓", url=CHAT, model="support") for i in range(200)}
    parts = index_parts("b1", "acme", index, "in.jsonl", "2026-12-01T00:00:00+00:00", 2048)
    assert len(parts) > 1 and all(p.request_ids == [] for p in parts)
    assert {k: v for p in parts for k, v in p.openai.items()} == index
    assert all(len(p.model_dump_json()) < 2048 for p in parts)
    assert index_parts("b1", "acme", {}, "s", "", 2048) == []
    with pytest.raises(ValueError, match="does not fit a batch manifest"):
        index_parts("b1", "acme", {"r": OpenAIRequest(custom_id="y" * 3000, url=CHAT)}, "s", "", 2048)


@pytest.mark.parametrize(("code", "message", "job", "field"), [
    ("max_new_tokens_too_large", "", {"prompt": "x"}, "max_new_tokens"),
    ("prompt_too_long", "", {"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("invalid_input_ids", "", {"input_ids": [1]}, "input_ids"),
    ("invalid_sampling_params", "sampling: top_p=2; use", {"prompt": "x"}, "top_p"),
    ("invalid_sampling_params", "sampling: nonsense", {"prompt": "x"}, None),
    ("unknown_adapter", "", {"prompt": "x"}, "adapter_ref"),
    ("engine_failed", "", {"prompt": "x"}, None),
])
def test_engine_refusals_name_their_field(code, message, job, field):
    assert engine_error_field(code, message, Job.model_validate({"request_id": "r", "tenant_id": "t", **job})) == field


def test_results_cli_answers_in_the_shape_asked(broker, tmp_path):
    """submit's manifest keeps each line's custom_id, url and model (in parts of its own under a small limit);
    `results --format openai` writes every line in its endpoint's shape, custom ids exact, DLQ'd jobs as error lines."""
    run = uuid.uuid4().hex[:8]
    overrides = {"kafka.bootstrap_servers": broker.bootstrap, "kafka.jobs_topic": f"{run}.jobs", "kafka.results_topic": f"{run}.results",
                 "kafka.dlq_topic": f"{run}.dlq", "kafka.batches_topic": f"{run}.batches", "kafka.partitions": 1,
                 "kafka.max_message_bytes": 4096}
    s = load_settings(None, overrides)
    k = s.kafka
    asyncio.run(ensure_topics(k.bootstrap_servers, [k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], 1))
    config = tmp_path / "lorabatch.toml"
    config.write_text("[kafka]\n" + "".join(f"{key.split('.', 1)[1]} = {json.dumps(v)}\n" for key, v in overrides.items()))
    lines = [(_chat if i % 2 else _comp)(f"{cid} #{i}") for i, cid in enumerate(UNICODE_IDS * 6)]
    lines.append(_comp("dead letter"))
    runner = CliRunner()
    app = build_app()
    out = runner.invoke(app, ["submit", str(_write(tmp_path / "in.jsonl", lines)), "--tenant", "acme", "--batch-id", "b1", "-c", str(config)])
    assert out.exit_code == 0, out.output
    manifest = asyncio.run(read_manifest(k, "acme", "b1"))
    assert [r.custom_id for r in manifest.openai.values()] == [line["custom_id"] for line in lines]
    jobs = {rid: req for rid, req in manifest.openai.items()}

    async def answer() -> None:
        producer = make_producer(k)
        await producer.start()
        try:
            for rid, req in jobs.items():
                if req.custom_id == "dead letter":
                    record = DlqRecord(error=ErrorInfo(code="malformed_json", message="m"), source_topic=k.jobs_topic, source_partition=0,
                                       source_offset=0, raw="", raw_b64="", request_id=rid, tenant_id="acme", batch_id="b1")
                    await producer.send_and_wait(k.dlq_topic, record.model_dump_json().encode())
                    continue
                r = Result(request_id=rid, tenant_id="acme", batch_id="b1", adapter="support@1", status="succeeded", text="ok ✓",
                           output_ids=[1, 2], finish_reason="length")
                await producer.send_and_wait(k.results_topic, r.model_dump_json().encode())
        finally:
            await producer.stop()

    asyncio.run(answer())
    dest = tmp_path / "out.jsonl"
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "--format", "openai", "-o", str(dest),
                              "--timeout", "30", "-c", str(config)])
    assert out.exit_code == 0, out.output
    written = [json.loads(x) for x in dest.read_text(encoding="utf-8").splitlines()]
    assert [w["custom_id"] for w in written] == [line["custom_id"] for line in lines]
    for w, asked in zip(written, lines):
        body = check_line(w, asked)
        if asked["custom_id"] == "dead letter":
            assert w["response"] is None and w["error"]["code"] == "malformed_json"
        else:
            assert body.model == "support" and body.choices[0].finish_reason == "length"
    # the manifest parts hold no request ids of their own beyond the batch's
    assert manifest.request_ids == list(jobs)
    assert isinstance(manifest, BatchManifest)


def test_an_error_names_max_completion_tokens_where_the_line_gave_that():
    """A line that gave its limit as max_completion_tokens has an over-the-limit error's param name it (it named
    body.max_tokens, a field the line did not have); a line with max_tokens, or neither, keeps body.max_tokens."""
    from consumer.openai_batch import from_openai_line

    failed = Result(request_id="r", tenant_id="t", status="failed",
                    error=ErrorInfo(code="max_new_tokens_too_large", message="over", field="max_new_tokens"))
    for field, param in (("max_completion_tokens", "body.max_completion_tokens"), ("max_tokens", "body.max_tokens"), (None, "body.max_tokens")):
        body = {"model": "support", "messages": [{"role": "user", "content": "x"}], **({field: 300} if field else {})}
        parsed = from_openai_line({"custom_id": "c", "method": "POST", "url": CHAT, "body": body}, "b")
        assert parsed.request.max_tokens_field == (field if field == "max_completion_tokens" else None)
        line = to_openai_line(failed, parsed.request, 1)
        assert line["response"]["body"]["error"]["param"] == param
