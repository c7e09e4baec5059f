"""SFT samples from chat conversations: tokens under the chat template, assistant turns trained, the rest not."""

import argparse

import pytest
import torch

from vime.rollout import sft_rollout
from vime.tools.make_tiny_model import build_tokenizer
from vime.utils.conversation import tokenize_conversation
from vime.utils.loss import make_reducer, sft_loss
from vime.utils.types import Sample, Status


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_assistant_turns_are_trained_and_nothing_else(tokenizer):
    messages = [
        {"role": "user", "content": "1+3="},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "no", "step_loss_mask": 0},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "5"},
    ]
    tokens, mask = tokenize_conversation(tokenizer, messages)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert tokens == _ids(tokenizer, text)
    trained = tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m])
    # the two trained assistant turns: content and end-of-turn, not the "<|im_start|>assistant\n" header
    assert trained == "4<|im_end|>\n5<|im_end|>\n"
    first = text.index("4<|im_end|>")
    assert mask.index(1) == len(_ids(tokenizer, text[:first]))


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    tok = build_tokenizer()
    # drops every assistant turn but the last one, like templates that strip past reasoning
    tok.chat_template = (
        "{%- for m in messages -%}{%- if m['role'] != 'assistant' or loop.last -%}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(ValueError, match="message 1 .*rewrites earlier turns"):
        tokenize_conversation(tok, messages)


def test_sft_rollout_builds_samples_from_conversations(tmp_path, monkeypatch):
    tok = build_tokenizer()
    monkeypatch.setitem(sft_rollout._tokenizers, "tiny", tok)
    args = argparse.Namespace(
        hf_checkpoint="tiny", input_key="messages", apply_chat_template_kwargs={}, n_samples_per_prompt=1,
        rollout_batch_size=2,
    )  # fmt: skip
    conversations = [
        [{"role": "user", "content": "7+3="}, {"role": "assistant", "content": "0"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "9+3="},
         {"role": "assistant", "content": "2"}],
    ]  # fmt: skip

    class Source:
        def get_samples(self, n):
            return [
                [Sample(index=i, prompt=c, metadata={"prompt_index": i})]
                for i, c in enumerate(conversations[:n])
            ]

    out = sft_rollout.generate_rollout(args, 0, Source())
    samples = [g[0] for g in out.samples]
    for sample, answer in zip(samples, "02", strict=True):
        assert sample.status == Status.COMPLETED and sample.reward == 0.0
        assert tok.decode(sample.tokens[-sample.response_length :]) == f"{answer}<|im_end|>\n"
        assert sample.loss_mask == [1] * sample.response_length
    assert out.metrics["rollout/trained_tokens"] == 2 * 3
    with pytest.raises(ValueError, match="no assistant turn"):
        sft_rollout.conversation_sample(args, Sample(index=5, prompt=[{"role": "user", "content": "x"}]))
    with pytest.raises(ValueError, match="--n-samples-per-prompt 1"):
        sft_rollout.generate_rollout(
            argparse.Namespace(**{**vars(args), "n_samples_per_prompt": 2}), 0, Source()
        )


def test_sft_loss_is_the_masked_negative_log_likelihood():
    log_probs = torch.tensor([-1.0, -2.0, -3.0, -0.5], requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    # two samples (3 and 1 response tokens); per-token loss over 3 trained tokens: (1 + 2 + 0.5) / 3
    reduce = make_reducer(mask, [3, 1], True, 2, 3)
    loss, metrics = sft_loss(None, {"reduce": reduce}, log_probs, None)
    assert loss.item() == pytest.approx(3.5 / 3)
    loss.backward()
    assert log_probs.grad.tolist() == pytest.approx([-1 / 3, -1 / 3, 0.0, -1 / 3])
    # per-sample mean: sample 1 (1 + 2) / 2 and sample 2 0.5, averaged over 2 samples
    reduce = make_reducer(mask, [3, 1], False, 2, 3)
    assert sft_loss(None, {"reduce": reduce}, log_probs.detach(), None)[0].item() == pytest.approx(
        (1.5 + 0.5) / 2
    )
    assert metrics["sft_loss"].item() == pytest.approx(3.5 / 3)
