"""vLLM's token-in/token-out generate route (``POST /inference/v1/generate``, served with ``--enable-scale-out``)
spoken with ``/v1/completions`` shapes, for requests that need its per-token weight versions
(``--flush-cache-interval``, :mod:`vime.utils.inflight`).

Its answer gives every choice ``weight_versions``: spans ``{"version", "start", "end"}`` over the output tokens, each
sampled by the weights labelled ``version`` (``/update_weight_version``); a request paused in place by a weight sync
and resumed on newer weights gets one span per version. The body vime sends to ``/v1/completions`` maps onto it:
the prompt ids become ``token_ids``, every sampling field goes into ``sampling_params``, and the answer is asked in
``text`` mode (text, and the sampled tokens' log-probs, as the completion's). vllm-router forwards the route.
"""

from __future__ import annotations

from typing import Any

GENERATE_PATH = "/inference/v1/generate"
ENGINE_FLAG = "--enable-scale-out"
# /v1/completions fields that are no sampling parameters (the rest of a completion body is)
_REQUEST_FIELDS = ("model", "prompt", "return_token_ids", "return_tokens_as_token_ids")


def generate_body(completion: dict[str, Any]) -> dict[str, Any]:
    """The generate-route body for a ``/v1/completions`` body with token ids as its prompt."""
    sampling = {key: value for key, value in completion.items() if key not in _REQUEST_FIELDS}
    return {
        "model": completion["model"],
        "token_ids": list(completion["prompt"]),
        "output_mode": "text",
        "sampling_params": sampling,
    }


def as_completion(answer: dict[str, Any]) -> dict[str, Any]:
    """The generate route's answer shaped as a completion's ``{"choices": [...]}``: each choice's ``index``,
    ``text``, ``token_ids``, ``finish_reason``, ``stop_reason``, ``routed_experts``, ``logprobs.token_logprobs`` (the
    sampled tokens') and ``weight_versions`` (the spans, as vLLM gives them)."""
    choices = []
    for choice in answer["choices"]:
        content = (choice.get("logprobs") or {}).get("content") or []
        choices.append(
            {
                "index": choice["index"],
                "text": choice.get("text") or "",
                "token_ids": choice.get("token_ids") or [],
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "routed_experts": choice.get("routed_experts"),
                "logprobs": {"token_logprobs": [entry["logprob"] for entry in content]},
                "weight_versions": choice.get("weight_versions"),
            }
        )
    return {"choices": choices}


def token_version_spans(
    choice: dict[str, Any], offset: int, sent_version: int
) -> tuple[list[list[int]], list[int]]:
    """A returned choice's ``[version, start, end)`` spans over the whole response (its tokens start at response
    position ``offset``) and the versions in order. Tokens no span labels with an integer version (an answer
    without spans, or an engine this run never labelled) count as ``sent_version``, the version the request was sent
    at, as do the choice's versions when it generated no token."""
    count = len(choice.get("token_ids") or [])
    pieces: list[tuple[int, int, int]] = []  # (version, start, end) over the choice's tokens
    covered = 0
    for span in choice.get("weight_versions") or []:
        label = str(span["version"])
        version = int(label) if label.lstrip("-").isdigit() else sent_version
        start, end = int(span["start"]), int(span["end"])
        if start > covered:  # an unlabelled stretch
            pieces.append((sent_version, covered, start))
        if end > start:
            pieces.append((version, start, end))
        covered = max(covered, end)
    if covered < count:
        pieces.append((sent_version, covered, count))
    spans: list[list[int]] = []
    for version, start, end in pieces:
        if spans and spans[-1][0] == version and spans[-1][2] == offset + start:
            spans[-1][2] = offset + end
        else:
            spans.append([version, offset + start, offset + end])
    versions: list[int] = []
    for version, _, _ in spans:
        if not versions or versions[-1] != version:
            versions.append(version)
    return spans, versions or [sent_version]
