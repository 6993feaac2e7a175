"""OpenAI Batch API files, both directions: an input line becomes a job, a result becomes an output line.

In: `{"custom_id", "method": "POST", "url", "body"}` where `url` is `/v1/chat/completions` (`body.messages`)
or `/v1/completions` (`body.prompt`) and `body.model` names the adapter. A field that would change the
answer and that the engine cannot honour (`n` above 1, `tools`, `logit_bias`, a penalty, ...) refuses the
line by name, never silently. `custom_id` may be any string, unique within its batch: the request id is
`batch_id:custom_id` where that is a plain id, else a hash of both (`cid-` and 32 hex digits:
`request_id_for`), and the batch's manifest keeps every line's `custom_id`, `url` and `model` as written
(`OpenAIRequest`).

Out: each result becomes `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`,
`body` a `chat.completion` or a `text_completion` as the `openai` package's `ChatCompletion` and
`Completion` read them, `model` echoed as asked, `created` the batch's submission time (Unix seconds, so
collecting a batch twice writes the same file). A failed job's line carries `error` (`code`, `message`)
and a `response` with the HTTP status and `{"error": {"message", "type", "param", "code"}}` body OpenAI
answers such a request with.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime

from consumer.kafka import record_size
from consumer.schemas import BatchManifest, ErrorInfo, OpenAIRequest, Result

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
MAX_CUSTOM_ID = 4096  # characters; the manifest carries every custom_id, so a bound keeps a part's share sane

_PLAIN_ID = re.compile(r"[A-Za-z0-9_.:@/\-]{1,128}")  # schemas.Ident
_HASHED_PREFIX = "cid-"

# body field -> the job field it becomes (the same on both endpoints)
_FIELDS = {"model": "adapter_ref", "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
           "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop", "user": "user_id"}
# Fields that are refused unless they hold the value that changes nothing.
_NEUTRAL = {"n": 1, "stream": False, "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False}
_NEUTRAL_HINT = {"n": "only 1 is supported; send n copies with their own custom_id",
                 "best_of": "only 1 is supported; send copies with their own custom_id and pick the best yourself",
                 "stream": "batch results are not streamed; remove it",
                 "echo": "the prompt is not echoed; remove it"}
_IGNORED = frozenset({"metadata", "store", "service_tier"})  # they change nothing about the answer
_ASSISTANT_ONLY = ("refusal", "tool_calls", "function_call", "audio")  # an assistant message's fields, taken when null
_ENDPOINT_ONLY = {CHAT: frozenset({"messages", "logprobs", "top_logprobs", "response_format"}),
                  COMPLETIONS: frozenset({"prompt", "logprobs"})}


def request_id_for(custom_id: str, batch_id: str) -> str:
    """The request id of batch `batch_id`'s line `custom_id`: `batch_id:custom_id` where that is a plain id (and the
    batch id holds no ':'), else `cid-` + 32 hex of the sha256 of both.

    OpenAI's custom ids are unique within a batch only: files commonly number their lines `request-1`, `request-2`,
    ... in every batch. As the request id itself, a second file's `request-1` took the answer the first file's had
    been given (a request id sent again is not run again), whatever it asked. Scoped by the batch, the same file
    submitted again under the same `--batch-id` is answered from what it was answered before, and another batch's
    lines are requests of their own. No two (batch, custom id) pairs share an id: a plain one splits at its first ':'
    (the batch id has none), a hashed one holds no ':', and a batch id holds no newline.
    """
    plain = f"{batch_id}:{custom_id}"
    if ":" not in batch_id and _PLAIN_ID.fullmatch(plain) and not plain.startswith(_HASHED_PREFIX):
        return plain
    return _HASHED_PREFIX + hashlib.sha256(f"{batch_id}\n{custom_id}".encode()).hexdigest()[:32]


def is_openai_line(data: dict) -> bool:
    """An OpenAI Batch line rather than a native job (a native job has none of these fields)."""
    return any(k in data for k in ("custom_id", "url", "body", "method"))


@dataclass
class OpenAILine:
    job: dict  # native job fields, before tenant and batch are added
    request: OpenAIRequest
    names: dict[str, str] = field(default_factory=dict)  # job field -> the line's field it came from


def supported_fields(url: str) -> str:
    return ", ".join(sorted({*_FIELDS, *_ENDPOINT_ONLY[url], *_NEUTRAL, *_IGNORED} - ({"best_of", "echo"} if url == CHAT else set())))


def from_openai_line(line: dict, batch_id: str) -> OpenAILine:
    """The job of one OpenAI Batch API input line of batch `batch_id`; ValueError naming the line's field and the fix."""
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id: missing or not a non-empty string; each line needs its own custom_id")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise ValueError(f"custom_id: {len(custom_id)} characters, over {MAX_CUSTOM_ID}; shorten it")
    try:
        custom_id.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("custom_id: holds a lone surrogate (an unpaired \\ud800-\\udfff escape); send valid Unicode") from None
    extra = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if extra:
        raise ValueError(f"{extra[0]}: not a field of an OpenAI batch line (custom_id, method, url, body); remove it")
    if line.get("method", "POST") != "POST":
        raise ValueError(f"method: {_shown(line.get('method'))}; OpenAI batch lines are POST")
    url = line.get("url")
    if url not in ENDPOINTS:
        what = "missing" if url is None else f"{_shown(url)} is not supported"
        raise ValueError(f"url: {what}; lorabatch serves {CHAT} and {COMPLETIONS}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise ValueError("body: missing or not an object; an OpenAI batch line carries the request in `body`")
    for key in body:
        if key in _FIELDS or key in _IGNORED or key in _ENDPOINT_ONLY[url]:
            continue
        if key in _NEUTRAL and not (url == CHAT and key in ("best_of", "echo")):
            value = body[key]
            if _neutral(value, _NEUTRAL[key]):
                continue
            hint = _NEUTRAL_HINT.get(key, f"only {_shown(_NEUTRAL[key])} is supported; remove it")
            raise ValueError(f"body.{key}: {_shown(value)}; {hint}")
        other = [u for u in ENDPOINTS if u != url and key in _ENDPOINT_ONLY[u]]
        where = f"a field of {other[0]}, not of {url}" if other else "not supported by lorabatch"
        raise ValueError(f"body.{key}: {where}; remove it (supported: {supported_fields(url)})")
    if url == CHAT and "messages" not in body:
        raise ValueError(f"body.messages: missing; a {CHAT} line sends its conversation in messages")
    if url == COMPLETIONS and "prompt" not in body:
        raise ValueError(f"body.prompt: missing; a {COMPLETIONS} line sends a prompt")
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise ValueError("body.max_completion_tokens: give it or max_tokens, not both")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise ValueError(f"body.response_format: {_shown(rf)}; only {{\"type\": \"text\"}} is supported; remove it")

    job: dict = {"request_id": request_id_for(custom_id, batch_id)}
    names = {"request_id": "custom_id"}
    for src, dst in _FIELDS.items():
        if body.get(src) is not None:  # null is the default, as OpenAI reads it
            job[dst] = body[src]
            names[dst] = f"body.{src}"
    if isinstance(job.get("stop"), str):
        job["stop"] = [job["stop"]]
    user = job.get("user_id")
    if user == "":  # a client's unset default: it names no end user
        del job["user_id"], names["user_id"]
    elif isinstance(user, str) and not _PLAIN_ID.fullmatch(user):  # OpenAI's `user` is any string (an email)
        job["user_id"] = "uid-" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    if url == CHAT:
        job["messages"] = _messages(body["messages"])
        names["messages"] = "body.messages"
        logprobs, top = body.get("logprobs"), body.get("top_logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise ValueError(f"body.logprobs: {_shown(logprobs)}; use true or false ({CHAT}), with top_logprobs 0..20")
        if logprobs:
            job["logprobs"] = 0 if top is None else top
            names["logprobs"] = "body.top_logprobs"
        elif top is not None:
            raise ValueError("body.top_logprobs: needs logprobs: true")
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            job["input_ids"] = prompt
            names["input_ids"] = "body.prompt"
        elif isinstance(prompt, str):
            job["prompt"] = prompt
            names["prompt"] = "body.prompt"
        else:
            raise ValueError("body.prompt: use one string or one list of token ids; send several prompts as lines "
                             "of their own, each with its custom_id")
        logprobs = body.get("logprobs")
        if logprobs is not None:
            if isinstance(logprobs, bool) or not isinstance(logprobs, int):
                raise ValueError(f"body.logprobs: {_shown(logprobs)}; use an integer 0..20 ({COMPLETIONS})")
            job["logprobs"] = logprobs
            names["logprobs"] = "body.logprobs"
    model = body.get("model")
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    request = OpenAIRequest(custom_id=custom_id, url=url, model=model if isinstance(model, str) else None, max_tokens_field=limit)
    return OpenAILine(job, request, names)


def _shown(value: object) -> str:
    """A line's value in an error as the file wrote it: JSON (true, null, {"type": ...}), a string quoted, cut at 80."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _neutral(value: object, want: bool | int) -> bool:
    """`value` asks for nothing beyond the default `want` (null, or `want` itself as a JSON bool or number)."""
    if value is None:
        return True
    if isinstance(want, bool):
        return value is want
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == want


def _messages(messages: object) -> object:
    """Chat messages with text content parts joined; `developer` is the system role by its newer name."""
    if not isinstance(messages, list):
        return messages  # the job's validation names it
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        m.pop("name", None)  # a participant's name changes nothing for a template without names
        if m.get("role") == "assistant":
            for key in _ASSISTANT_ONLY:  # null in an earlier answer's message as the openai package dumps it
                if key in m and m.pop(key) is not None:
                    raise ValueError(f"body.messages.{i}.{key}: not supported by lorabatch; send the conversation as text "
                                     f"(the assistant's answer in content)")
        if m.get("role") == "developer":
            m["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                if kind != "text":
                    raise ValueError(f"body.messages.{i}.content.{j}: a part of type {str(kind)[:40]!r}; only text parts "
                                     f'({{"type": "text", "text": "..."}}) are supported')
                text = p.get("text", "")
                if not isinstance(text, str):
                    raise ValueError(f"body.messages.{i}.content.{j}.text: {type(text).__name__}, not a string; send the part's "
                                     f"text as a JSON string")
                texts.append(text)
            m["content"] = "".join(texts)
        out.append(m)
    return out


def body_field(name: str, names: dict[str, str]) -> str:
    """The line's name of a job field's error location (`max_new_tokens` -> `body.max_tokens`)."""
    head, _, rest = name.partition(".")
    return names.get(head, head) + (f".{rest}" if rest else "")


def index_parts(batch_id: str, tenant_id: str, index: dict[str, OpenAIRequest], source: str, created_at: str,
                max_message_bytes: int) -> list[BatchManifest]:
    """The batch's OpenAI index as manifest parts (no request ids of their own) of at most `max_message_bytes`."""
    if not index:
        return []
    empty = BatchManifest(batch_id=batch_id, tenant_id=tenant_id, request_ids=[], source=source, created_at=created_at)
    budget = max_message_bytes - record_size(batch_id.encode(), empty.model_dump_json().encode())
    parts: list[dict[str, OpenAIRequest]] = [{}]
    used = 0
    for rid, req in index.items():
        cost = len(rid) + len(req.model_dump_json().encode()) + 4  # "rid":{...},
        if cost > budget:
            raise ValueError(f"custom_id {req.custom_id[:80]!r} does not fit a batch manifest under "
                             f"kafka.max_message_bytes={max_message_bytes}; shorten it or raise the limit")
        if used + cost > budget:
            parts.append({})
            used = 0
        parts[-1][rid] = req
        used += cost
    return [empty.model_copy(update={"openai": part}) for part in parts]


def created_of(manifest: BatchManifest | None) -> int:
    """`created` of the batch's answers: its submission time in Unix seconds (0 when unknown)."""
    try:
        return int(datetime.fromisoformat(manifest.created_at).timestamp()) if manifest and manifest.created_at else 0
    except ValueError:
        return 0


def _status(error: ErrorInfo) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a failed job."""
    code = error.code
    if code == "quota_exceeded":
        return 429, "rate_limit_error"
    if code in ("unknown_adapter", "model_not_found"):
        return 404, "invalid_request_error"
    if code == "adapter_forbidden":
        return 403, "permission_error"
    if error.retriable or code in ("engine_failed", "result_too_large", "undeliverable", "sampling_failed", "decode_failed"):
        return 500, "server_error"
    return 400, "invalid_request_error"


def _error_line(request_id: str, request: OpenAIRequest | None, error: ErrorInfo) -> dict:
    custom_id = request.custom_id if request else request_id
    http, kind = _status(error)
    param = body_field(error.field, _job_to_body(request)) if error.field else None
    return {"id": f"batch_req_{request_id}", "custom_id": custom_id,
            "response": {"status_code": http, "request_id": request_id,
                         "body": {"error": {"message": error.message, "type": kind, "param": param, "code": error.code}}},
            "error": {"code": error.code, "message": error.message}}


def _job_to_body(request: OpenAIRequest | None) -> dict[str, str]:
    if request is None:
        return {}
    prompt = "body.messages" if request.url == CHAT else "body.prompt"
    return {"adapter_ref": "body.model", "adapter": "body.model", "max_new_tokens": f"body.{request.max_tokens_field or 'max_tokens'}",
            "user_id": "body.user",
            "messages": prompt, "prompt": prompt, "input_ids": prompt, "request_id": "custom_id",
            "logprobs": "body.top_logprobs" if request.url == CHAT else "body.logprobs",
            **{k: f"body.{k}" for k in ("temperature", "top_p", "seed", "stop")}}


def to_openai_line(result: Result, request: OpenAIRequest | None = None, created: int = 0) -> dict:
    """One line of the OpenAI Batch API output file, in the shape of the endpoint `request` asked.

    Without `request` (a batch submitted as native jobs) the line is a `/v1/completions` answer whose
    custom_id is the request id and whose model is the resolved adapter.
    """
    if result.status == "failed":
        assert result.error is not None, result
        return _error_line(result.request_id, request, result.error)
    url = request.url if request else COMPLETIONS
    model = (request.model if request else None) or result.adapter or "base"
    usage = {"prompt_tokens": result.usage.input_tokens, "completion_tokens": result.usage.output_tokens,
             "total_tokens": result.usage.input_tokens + result.usage.output_tokens,
             "prompt_tokens_details": {"cached_tokens": result.usage.cached_tokens}}
    finish = "length" if result.finish_reason == "length" else "stop"  # eos and a stop string are both `stop`
    entries = (result.logprobs or {}).get("content") if result.logprobs is not None else None
    if url == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text, "refusal": None},
                  "finish_reason": finish,
                  "logprobs": None if entries is None else {"content": entries, "refusal": None}}
        body = {"id": f"chatcmpl-{result.request_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage}
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": finish,
                  "logprobs": None if entries is None else completion_logprobs(entries)}
        body = {"id": f"cmpl-{result.request_id}", "object": "text_completion", "created": created, "model": model,
                "choices": [choice], "usage": usage}
    return {"id": f"batch_req_{result.request_id}", "custom_id": request.custom_id if request else result.request_id,
            "response": {"status_code": 200, "request_id": result.request_id, "body": body}, "error": None}


def completion_logprobs(entries: list[dict]) -> dict:
    """Chat-shaped logprobs entries in the completions shape: tokens, token_logprobs, top_logprobs, text_offset.

    text_offset is each token's character offset in the completion text (the prompt is not echoed), counted
    over the UTF-8 bytes of the tokens before it, so a character split across tokens counts once it is whole.
    """
    offsets, seen = [], b""
    for e in entries:
        offsets.append(len(seen.decode("utf-8", errors="ignore")))
        seen += bytes(e.get("bytes") or e["token"].encode("utf-8"))
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", ())} for e in entries],
            "text_offset": offsets}


def to_openai_dlq_line(request_id: str, request: OpenAIRequest | None, error: ErrorInfo) -> dict:
    """The output line of a job that went to the DLQ (no worker could read it): `error` set, no response."""
    return {"id": f"batch_req_{request_id}", "custom_id": request.custom_id if request else request_id,
            "response": None, "error": {"code": error.code, "message": error.message}}
