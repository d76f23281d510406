"""Chat prompts with vLLM's options (add_generation_prompt, continue_final_message,
add_special_tokens, chat_template_kwargs), through the plain template and a real transformers
tokenizer's own chat template."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from moeflow.engine.tokenizer import ByteTokenizer
from moeflow.server.chat import render_chat

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if not loop.last or not continue_open %}</s>"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
            "{% if mood %}({{ mood }}){% endif %}")


@pytest.fixture(scope="module")
def hf_tokenizer():
    vocab = {c: i for i, c in enumerate(["<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    t.chat_template = TEMPLATE.replace("continue_open", "continue_final_message")
    return t


def test_plain_template_options():
    tok = ByteTokenizer(512)
    assert render_chat(tok, MESSAGES).text == "<|user|>\nHi\n<|assistant|>\nHello\n<|assistant|>\n"
    assert render_chat(tok, MESSAGES, add_generation_prompt=False).text == "<|user|>\nHi\n<|assistant|>\nHello\n"
    open_ = render_chat(tok, MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert open_.text == "<|user|>\nHi\n<|assistant|>\nHello" and open_.token_ids == list(open_.text.encode())


def test_model_template_options(hf_tokenizer):
    p = render_chat(hf_tokenizer, MESSAGES)
    assert p.text == "[user]Hi</s>[assistant]Hello</s>[assistant]"
    assert p.token_ids == hf_tokenizer.encode(p.text, add_special_tokens=False)  # the template wrote its own
    assert p.token_ids[0] != hf_tokenizer.bos_token_id
    assert render_chat(hf_tokenizer, MESSAGES, add_special_tokens=True).token_ids == [hf_tokenizer.bos_token_id] + p.token_ids
    p = render_chat(hf_tokenizer, MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert p.text == "[user]Hi</s>[assistant]Hello"
    assert render_chat(hf_tokenizer, MESSAGES, template_kwargs={"mood": "calm"}).text.endswith("[assistant](calm)")
