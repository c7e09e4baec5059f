"""Chat conversations as training tokens: the token ids of a whole conversation under the tokenizer's chat
template, and the loss mask that trains only the assistant turns (SFT, ``vime.rollout.sft_rollout``).

The mask is found from the template itself, for any template family: an assistant turn's tokens are those that
rendering ``messages[:i + 1]`` adds to rendering ``messages[:i]`` with the generation prompt (so the
``<|im_start|>assistant\\n``-style header is not trained, the content and end-of-turn tokens are). This needs a
template that renders every prefix of the conversation as a prefix of the whole; one that rewrites earlier turns
(e.g. drops past reasoning) is refused with the turn where it happens.
"""

from __future__ import annotations

from typing import Any


def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool, kwargs: dict) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            add_generation_prompt=generation_prompt,
            return_dict=False,
            **kwargs,
        )
    )


def tokenize_conversation(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """``(token_ids, loss_mask)`` of ``messages``: mask 1 on the tokens of each assistant turn (content and
    end-of-turn tokens), 0 elsewhere; a message with ``"step_loss_mask": 0`` (slime's key) is not trained."""
    kwargs = chat_template_kwargs or {}
    token_ids = _render(tokenizer, messages, tools, False, kwargs)
    mask = [0] * len(token_ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or message.get("step_loss_mask", 1) != 1:
            continue
        if i == 0:
            raise ValueError("the conversation starts with an assistant message: nothing prompts it")
        start = _render(tokenizer, messages[:i], tools, True, kwargs)
        end = _render(tokenizer, messages[: i + 1], tools, False, kwargs)
        if token_ids[: len(start)] != start or token_ids[: len(end)] != end:
            raise ValueError(
                f"message {i} (assistant): the chat template renders the conversation up to this turn differently "
                "from the start of the whole conversation (it rewrites earlier turns), so the turn's tokens cannot "
                "be located; use a template that renders prefixes stably, or write the samples' tokens and "
                "loss_mask in a custom --rollout-function-path"
            )
        mask[len(start) : len(end)] = [1] * (len(end) - len(start))
    return token_ids, mask
