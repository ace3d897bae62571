"""HTTP text-generation API in the style of Megatron-LM's text generation server (Flask), and a
small page at `/` to try it from a browser (app.inference.web_page).

    PUT or POST /api   {"prompts": ["..."], "tokens_to_generate": 32, "temperature": 0.8,
                        "top_k": 0, "top_p": 0.9, "top_p_decay": 0.0, "top_p_bound": 0.0,
                        "random_seed": 1234, "beam_width": 1, "length_penalty": 1.0}
    200 -> {"text": [prompt + continuation, ...], "generated_text": [...],
            "generated_tokens": [[ids], ...], "prefill_tokens_per_s": ..., "decode_tokens_per_s": ...}
    400 -> {"error": "..."} for bad JSON, unknown or ill-typed fields, bad sampling values,
           empty or over-long prompts, too many prompts or beams; the server keeps serving.
    413 -> {"error": "..."} for a body over `max_request_bytes`.

Every input is bounded: the body's size, the number of prompts (and beams), and prompt tokens +
tokens to generate (the model's positions). Requests are checked as they arrive, concurrently;
the valid ones wait in turn for the model (a lock around the session: one generation at a
time), and each is broadcast by rank 0 to every rank of the model (InferenceSession.generate).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Tuple

from app.inference.sampling import SamplingConfig
from app.inference.session import GenerationParams, InferenceSession, prompt_too_long
from app.inference.web_page import PAGE

logger = logging.getLogger(__name__)

_FIELDS = {  # name: (type, default)
    "prompts": (list, None), "tokens_to_generate": (int, 64), "temperature": (float, 1.0),
    "top_k": (int, 0), "top_p": (float, 0.0), "top_p_decay": (float, 0.0),
    "top_p_bound": (float, 0.0), "random_seed": (int, None), "beam_width": (int, 1),
    "length_penalty": (float, 1.0), "greedy": (bool, False),
}
_IGNORED_FALSE = ("logprobs", "add_BOS", "stop_on_eol", "stop_on_double_eol",
                  "prevent_newline_after_colon", "no_log")


class RequestError(ValueError):
    """A request the API refuses with 400; the message says which field and why."""


def parse_request(body: Any, max_batch: int) -> Tuple[list, GenerationParams]:
    """Validated (prompts, params) of a JSON request body, or RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key in body:
        if key in _IGNORED_FALSE:
            if body[key]:
                raise RequestError(f"{key}=true is not supported by this server")
        elif key not in _FIELDS:
            raise RequestError(f"unknown field {key!r}; allowed: {', '.join(sorted(_FIELDS))}")
    values: Dict[str, Any] = {}
    for key, (kind, default) in _FIELDS.items():
        value = body.get(key, default)
        if value is None:
            if key == "prompts":
                raise RequestError("'prompts' is required: a list of strings")
            values[key] = None
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise RequestError(f"{key} must be of type {kind.__name__}, got {value!r}")
        values[key] = value
    prompts = values["prompts"]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise RequestError("'prompts' must be a non-empty list of non-empty strings")
    if len(prompts) > max_batch:
        raise RequestError(f"{len(prompts)} prompts exceed the server's batch limit of {max_batch}")
    if values["beam_width"] > max_batch:
        raise RequestError(f"beam_width {values['beam_width']} exceeds the server's batch limit "
                           f"of {max_batch}")
    greedy = values["greedy"] or (values["top_k"] == 0 and values["top_p"] == 0.0
                                  and values["random_seed"] is None and values["temperature"] == 1.0)
    try:
        sampling = SamplingConfig(greedy=greedy or values["beam_width"] > 1,
                                  temperature=values["temperature"], top_k=values["top_k"],
                                  top_p=values["top_p"], top_p_decay=values["top_p_decay"],
                                  top_p_bound=values["top_p_bound"], seed=values["random_seed"])
        params = GenerationParams(values["tokens_to_generate"], sampling, values["beam_width"],
                                  values["length_penalty"])
    except ValueError as exc:
        raise RequestError(str(exc)) from exc
    return prompts, params


def create_app(session: InferenceSession, max_batch: int = 64,
               max_request_bytes: int = 1 << 20):
    """The Flask application serving `session` at /api (PUT and POST) and its page at /."""
    from flask import Flask, Response, jsonify, request  # optional: only the server needs it
    app = Flask("gpt2_text_generation")
    app.config["MAX_CONTENT_LENGTH"] = max_request_bytes
    lock = threading.Lock()

    @app.route("/", methods=["GET"])
    def page():
        return Response(PAGE, mimetype="text/html")

    @app.errorhandler(413)
    def too_large(_):
        return jsonify(error=f"the request body exceeds the server's limit of "
                             f"{max_request_bytes} bytes"), 413

    @app.route("/api", methods=["PUT", "POST"])
    def api():
        body = request.get_json(silent=True)
        if body is None:
            return jsonify(error="the request body is not valid JSON (Content-Type: "
                                 "application/json)"), 400
        try:
            prompts, params = parse_request(body, max_batch)
            for prompt in prompts:
                problem = prompt_too_long(session, prompt, params.max_new_tokens)
                if problem:
                    raise RequestError(problem)
        except RequestError as exc:
            return jsonify(error=str(exc)), 400
        with lock:  # one request at a time across all ranks
            try:
                out = session.generate(prompts, params)
            except ValueError as exc:  # every rank refused the same request
                return jsonify(error=str(exc)), 400
        results = out["results"]
        return jsonify(text=[r["prompt"] + r["generated_text"] for r in results],
                       generated_text=[r["generated_text"] for r in results],
                       generated_tokens=[r["generated_tokens"] for r in results],
                       prefill_tokens_per_s=out["prefill_tokens_per_s"],
                       decode_tokens_per_s=out["decode_tokens_per_s"])

    return app
