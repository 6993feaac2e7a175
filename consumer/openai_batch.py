"""OpenAI Batch API files, both directions: an input line becomes a job, a result becomes an output line."""

from __future__ import annotations

from consumer.schemas import Result


def from_openai_line(line: dict) -> dict:
    """The native job fields of one OpenAI Batch API input line."""
    body = line.get("body")
    if not isinstance(body, dict):
        raise ValueError("body: missing or not an object; an OpenAI batch line carries the request in `body`")
    job: dict = {"request_id": line.get("custom_id")}
    if "model" in body:
        job["adapter"] = body["model"]
    for src, dst in (("prompt", "prompt"), ("messages", "messages"), ("max_tokens", "max_new_tokens"),
                     ("max_completion_tokens", "max_new_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("seed", "seed"), ("stop", "stop"), ("user", "user_id")):
        if src in body:
            job[dst] = body[src]
    if isinstance(job.get("stop"), str):
        job["stop"] = [job["stop"]]
    if body.get("logprobs") is True:
        job["logprobs"] = int(body.get("top_logprobs", 0))
    elif isinstance(body.get("logprobs"), int):
        job["logprobs"] = body["logprobs"]
    if isinstance(job.get("messages"), list):  # content parts -> plain text
        for m in job["messages"]:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
    return job



def to_openai_line(result: Result) -> dict:
    """One line of the OpenAI Batch API output file."""
    if result.status == "failed":
        assert result.error is not None
        return {"id": f"batch_req_{result.request_id}", "custom_id": result.request_id, "response": None,
                "error": {"code": result.error.code, "message": result.error.message}}
    body = {
        "id": f"cmpl-{result.request_id}", "object": "text_completion", "model": result.adapter or "base",
        "choices": [{"index": 0, "text": result.text, "finish_reason": "stop" if result.finish_reason == "eos" else result.finish_reason,
                     "logprobs": result.logprobs}],
        "usage": {"prompt_tokens": result.usage.input_tokens, "completion_tokens": result.usage.output_tokens,
                  "total_tokens": result.usage.input_tokens + result.usage.output_tokens,
                  "prompt_tokens_details": {"cached_tokens": result.usage.cached_tokens}},
    }
    return {"id": f"batch_req_{result.request_id}", "custom_id": result.request_id,
            "response": {"status_code": 200, "request_id": result.request_id, "body": body}, "error": None}
