"""SGLang's native ``/generate`` for plug-ins written for slime, answered by vLLM's token-in/token-out completions.

slime's custom generate functions call SGLang's own API through the router::

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 64, ...},
                              "return_logprob": True})
    output["text"], output["meta_info"]["output_token_logprobs"]    # [(log_prob, token_id, None), ...]
    output["meta_info"]["finish_reason"]["type"]                    # "stop" | "length" | "abort"

vLLM has no such route. :func:`vime.utils.http_utils.post` (slime's ``slime.utils.http_utils.post`` after the
rename) sends a POST whose URL path ends in ``/generate`` and whose body is SGLang's request (it has ``input_ids``
or ``text``) to ``/v1/completions`` on the same host (vime's router spreads it over the engines) and gives the
answer back in SGLang's shape, with the translation below; the ``args`` a plug-in is handed answer
``args.sglang_router_ip/port`` with the router's address.

Request: ``input_ids`` (token ids) or ``text``, ``sampling_params``, ``return_logprob``, ``logprob_start_len`` (>= 0:
also the prompt tokens' log-probs, ``meta_info["input_token_logprobs"]``, as slime's OPD teacher call asks), and
``stream: false``. Sampling fields take SGLang's names (``max_new_tokens`` (default 128, as SGLang),
``min_new_tokens``, ``no_stop_trim``, ``sampling_seed``, ``regex``, ``json_schema``, ``ebnf``, ...) or vLLM's (what
vime hands a generate function: ``max_tokens``, ...); where both are given, SGLang's wins. ``no_stop_trim``
defaults to true (slime's default): the text keeps a matched stop string, as the token ids always do.
``max_new_tokens: 0`` (score only) is answered by a one-token request whose token is dropped (vLLM needs >= 1).
Anything else (batches, images, top-log-probs...) is refused with the field's name.

:class:`SamplingParams` is the dict vime hands a custom generate function: vLLM's field names, readable and
writable under SGLang's too (``params["max_new_tokens"]`` is ``params["max_tokens"]``), so a slime plug-in's
``sampling_params["max_new_tokens"]`` reads the response budget.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# SGLang sampling field -> vLLM completions field
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
}
# SGLang constrained decoding -> key of vLLM's ``structured_outputs``
_STRUCTURED = {"regex": "regex", "json_schema": "json", "ebnf": "grammar"}
_SAME_NAME = {
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "n",
}  # fmt: skip
_VLLM_ONLY = {"max_tokens", "min_tokens", "include_stop_str_in_output", "seed", "structured_outputs"}
_REQUEST_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "stream"}


def is_generate_url(url: str) -> bool:
    """Whether ``url`` is SGLang's native generate route (its path ends in ``/generate``)."""
    return urlsplit(url).path.rstrip("/").endswith("/generate")


def is_sglang_generate(url: str, payload: dict | None) -> bool:
    """Whether a POST is an SGLang ``/generate`` request (the route, and a body with ``input_ids`` or ``text``),
    which vime answers through vLLM."""
    return (
        is_generate_url(url) and isinstance(payload, dict) and ("input_ids" in payload or "text" in payload)
    )


def completions_url(generate_url: str) -> str:
    """The ``/v1/completions`` URL on the host of an SGLang ``/generate`` URL."""
    parts = urlsplit(generate_url)
    path = parts.path.rstrip("/").removesuffix("/generate") + "/v1/completions"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class SamplingParams(dict):
    """vLLM sampling fields that also answer to SGLang's names (``max_new_tokens`` ↔ ``max_tokens``,
    ``min_new_tokens`` ↔ ``min_tokens``, ``no_stop_trim`` ↔ ``include_stop_str_in_output``, ``sampling_seed`` ↔
    ``seed``): reading, writing, ``in``, ``get``, ``pop`` and ``setdefault`` under either name reach one entry, kept
    under vLLM's name (what iteration, ``dict(...)`` and JSON show). A slime plug-in reading
    ``sampling_params["max_new_tokens"]`` gets the response budget vime set as ``max_tokens``."""

    @staticmethod
    def _key(key: Any) -> Any:
        return _RENAMED.get(key, key) if isinstance(key, str) else key

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(self._key(key))

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(self._key(key), value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(self._key(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(self._key(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self._key(key), default)

    def pop(self, key: Any, *default: Any) -> Any:
        return super().pop(self._key(key), *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return super().setdefault(self._key(key), default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        items = dict(*args, **kwargs).items()
        # where both names are given, SGLang's wins (as in a /generate request)
        for key, value in sorted(items, key=lambda item: item[0] in _RENAMED):
            self[key] = value

    def __ior__(self, other: Any) -> SamplingParams:
        self.update(other)
        return self

    def copy(self) -> SamplingParams:
        return SamplingParams(self)


def vllm_sampling_fields(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """SGLang (or vLLM) sampling fields as vLLM completion-request fields."""
    unknown = set(sampling_params) - _SAME_NAME - _VLLM_ONLY - set(_RENAMED) - set(_STRUCTURED)
    if unknown:
        raise ValueError(
            f"SGLang sampling_params {sorted(unknown)} have no vLLM equivalent here; supported: "
            f"{sorted(_SAME_NAME | set(_RENAMED) | set(_STRUCTURED))} (or vLLM's {sorted(_VLLM_ONLY)})"
        )
    fields = {k: v for k, v in sampling_params.items() if k in _SAME_NAME | _VLLM_ONLY and v is not None}
    fields.setdefault("max_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    fields.setdefault("include_stop_str_in_output", True)
    for sglang_name, vllm_name in _RENAMED.items():
        if sampling_params.get(sglang_name) is not None:
            fields[vllm_name] = sampling_params[sglang_name]
    structured = dict(fields.pop("structured_outputs", None) or {})
    for sglang_name, vllm_name in _STRUCTURED.items():
        value = sampling_params.get(sglang_name)
        if value is not None:
            structured[vllm_name] = json.loads(value) if sglang_name == "json_schema" else value
    if structured:
        fields["structured_outputs"] = structured
    return fields


def vllm_request(payload: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The ``/v1/completions`` body for an SGLang ``/generate`` payload, and whether it only scores the input
    (``max_new_tokens: 0``)."""
    unknown = set(payload) - _REQUEST_KEYS
    if unknown:
        raise ValueError(
            f"SGLang /generate fields {sorted(unknown)} are not supported by vime's vLLM translation; supported: "
            f"{sorted(_REQUEST_KEYS)}"
        )
    if payload.get("stream"):
        raise ValueError("SGLang /generate with stream=true: vime answers whole responses only")
    if ("input_ids" in payload) == ("text" in payload):
        raise ValueError("an SGLang /generate payload needs exactly one of input_ids and text")
    prompt = payload.get("input_ids", payload.get("text"))
    one_prompt = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    )
    if not one_prompt:
        raise ValueError(
            "SGLang /generate: give one prompt (a list of token ids or a string); batches are refused"
        )
    request = vllm_sampling_fields(payload.get("sampling_params") or {})
    score_only = request["max_tokens"] == 0
    if score_only:
        request["max_tokens"] = 1
    request.update(prompt=prompt, return_token_ids=True, return_tokens_as_token_ids=True)
    if payload.get("return_logprob"):
        request["logprobs"] = 0
        if payload.get("logprob_start_len", -1) >= 0:  # SGLang's -1: output tokens only
            request["prompt_logprobs"] = 0
    return request, score_only


def sglang_output(
    response: dict[str, Any], choice: dict[str, Any], payload: dict[str, Any], score_only: bool
) -> dict[str, Any]:
    """One vLLM completion choice in SGLang's ``/generate`` answer shape."""
    token_ids = [] if score_only else list(choice.get("token_ids") or [])
    prompt_ids = list(choice.get("prompt_token_ids") or payload.get("input_ids") or [])
    finish = {"type": "length" if score_only else choice.get("finish_reason")}
    if choice.get("stop_reason") is not None and not score_only:
        finish["matched"] = choice["stop_reason"]
    meta: dict[str, Any] = {
        "id": response.get("id"),
        "finish_reason": finish,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(token_ids),
    }
    if payload.get("return_logprob"):
        log_probs = [] if score_only else (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(log_probs) != len(token_ids):
            raise ValueError(f"vLLM returned {len(token_ids)} tokens but {len(log_probs)} log-probs")
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(log_probs, token_ids, strict=True)]
        if choice.get("prompt_logprobs") is not None:
            start = payload["logprob_start_len"]
            meta["input_token_logprobs"] = [
                [(entry or {}).get(str(t), {}).get("logprob"), t, None]
                for entry, t in zip(choice["prompt_logprobs"][start:], prompt_ids[start:], strict=True)
            ]
    return {
        "text": "" if score_only else choice.get("text") or "",
        "output_ids": token_ids,
        "meta_info": meta,
    }
