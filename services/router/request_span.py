"""A request's span in its trace: opened when the router accepts the request, with
OpenTelemetry's ``gen_ai.*`` request attributes, and closed when it ends, with what it did
(usage, finish reason, steps, tokens accepted per step, time in speculation and in
verification). While tracing is off both are no-ops."""

from __future__ import annotations

from opentelemetry.trace import Status, StatusCode

from services.router.request import GenRequest
from specinfer import tracing


def open_request_span(req: GenRequest, model: str) -> None:
    """``req.span``: a child of the current span (the API call that carries it)."""
    if not tracing.enabled():
        return
    params = req.params
    attributes = {"gen_ai.operation.name": req.operation, "gen_ai.request.model": model,
                  "gen_ai.request.max_tokens": req.max_tokens,
                  "gen_ai.request.temperature": params.temperature,
                  "gen_ai.request.top_p": params.top_p, "gen_ai.request.top_k": params.top_k,
                  "specinfer.sequence_id": req.id, "specinfer.speculation": req.speculation}
    if req.constraint is not None:  # structured output (tools: a grammar of calls)
        attributes["specinfer.constraint"] = "tools" if req.tools else req.constraint.kind
    if params.seed is not None and params.seed < 2**63:  # OTLP integers are 64-bit signed
        attributes["gen_ai.request.seed"] = params.seed
    req.span = tracing.request_span(f"{req.operation} {model}".strip(), attributes)


def close_request_span(req: GenRequest, reason: str, exc: Exception | None = None) -> None:
    """End ``req.span``; ``reason``: stop, length, abort or error (``exc``: the error)."""
    span = req.span
    if not span.is_recording():
        return
    steps = req.accepted_per_step
    span.set_attributes({
        "gen_ai.usage.input_tokens": len(req.prompt_ids),
        "gen_ai.usage.output_tokens": len(req.generated),
        "gen_ai.response.finish_reasons": [reason],
        "specinfer.steps": len(steps),
        "specinfer.mean_accepted_tokens_per_step": sum(steps) / len(steps) if steps else 0.0,
        "specinfer.speculative_steps": req.speculative_steps,
        "specinfer.drafted_tokens": req.drafted,
        "specinfer.speculate_seconds": req.speculate_s,
        "specinfer.verify_seconds": req.verify_s,
        "specinfer.cached_prompt_tokens": req.reused_tokens,
    })
    if req.first_token_at:
        span.set_attribute("specinfer.time_to_first_token_seconds",
                           req.first_token_at - req.created)
    if exc is not None:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
    span.end()
