"""Chat templates for a base model whose tokenizer has none (`python -m strider.data --chat-template NAME|FILE`,
as LLaMA-Factory's --template): the common formats, each written here as Jinja that a tokenizer's
apply_chat_template renders. Each renders a conversation's prefix as a prefix of the whole (what the loss mask
needs: encode_chat finds each assistant turn by rendering up to it and through it), and with
add_generation_prompt the header an assistant turn starts with. An assistant turn's target is its content and
its end-of-turn marker, as transformers' assistant masks have it.

The markers are text: a tokenizer that lacks them as special tokens splits them into ordinary tokens (the
model learns them as such); a base model meant for a format usually has its tokens already."""
import os

# Where a system message has no turn of its own (Gemma, Mistral), it opens the next user turn.
_FOLD_SYSTEM = "{%- set ns = namespace(system='') %}"

TEMPLATES = {
    # OpenAI's ChatML (Qwen, Yi, many fine-tunes): <|im_start|>role\ncontent<|im_end|>\n
    "chatml": (
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"),
    # ChatML with Qwen2.5's default system message when the conversation has none.
    "qwen": (
        "{%- if messages and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"),
    # Llama 3: headers, content trimmed, <|eot_id|> ends each turn.
    "llama3": (
        "{{- bos_token }}{%- for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{%- endif %}"),
    # Gemma: user and model turns; a system message opens the next user turn.
    "gemma": (
        "{{- bos_token }}" + _FOLD_SYSTEM + "{%- for m in messages %}"
        "{%- if m['role'] == 'system' %}{%- set ns.system = (m['content'] | trim) + '\\n\\n' %}"
        "{%- else %}{%- set role = 'model' if m['role'] == 'assistant' else 'user' %}"
        "{{ '<start_of_turn>' + role + '\\n' + ns.system + (m['content'] | trim) + '<end_of_turn>\\n' }}"
        "{%- set ns.system = '' %}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"),
    # Mistral: [INST] user [/INST] answer</s>; a system message opens the next user turn.
    "mistral": (
        "{{- bos_token }}" + _FOLD_SYSTEM + "{%- for m in messages %}"
        "{%- if m['role'] == 'system' %}{%- set ns.system = m['content'] + '\\n\\n' %}"
        "{%- elif m['role'] == 'user' %}{{ '[INST] ' + ns.system + m['content'] + ' [/INST]' }}"
        "{%- set ns.system = '' %}"
        "{%- else %}{{ ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}"),
}


def chat_template(name_or_file: str) -> str:
    """The Jinja text of a built-in template by name, or of a file."""
    if name_or_file in TEMPLATES:
        return TEMPLATES[name_or_file]
    if os.path.isfile(name_or_file):
        with open(name_or_file, encoding="utf-8") as f:
            return f.read()
    raise ValueError(f"--chat-template {name_or_file!r}: not a built-in template ({', '.join(TEMPLATES)}) nor a "
                     "file")


def require_chat_template(tokenizer, where: str):
    """Refuses a tokenizer without a chat template, naming the option that gives it one."""
    if getattr(tokenizer, "chat_template", None):
        return
    raise ValueError(f"the tokenizer {where} has no chat template (a base model's usually has none), and chat data "
                     f"needs one: give --chat-template NAME ({', '.join(TEMPLATES)}) or --chat-template FILE "
                     "(a Jinja template)")
