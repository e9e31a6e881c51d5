"""Turning user text into prompt token ids, as mlx-lm does."""

from typing import List, Optional


def build_chat_prompt(tokenizer, messages, enable_thinking: Optional[bool] = None) -> List[int]:
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def build_prompt(
    tokenizer,
    prompt: str,
    system: Optional[str] = None,
    chat_template: bool = True,
    enable_thinking: Optional[bool] = None,
) -> List[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return build_chat_prompt(tokenizer, messages, enable_thinking)
    if system:
        prompt = f"{system}\n\n{prompt}"
    return tokenizer.encode(prompt)
