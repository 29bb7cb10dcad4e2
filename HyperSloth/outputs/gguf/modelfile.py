"""The Ollama Modelfile beside a GGUF: FROM the file, the chat template in Ollama's Go-template syntax and the
stop tokens.

A Jinja chat template cannot be translated to Go templates in general, so the template is recognised by its
turn markers (ChatML as in Qwen and the tiny model, Llama 3, Gemma, Mistral [INST]); for another, the Modelfile
says so and leaves TEMPLATE out, and Ollama falls back to the GGUF's own tokenizer.chat_template.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    name: str
    marker: str  # a string the Jinja template contains
    template: str  # Ollama's TEMPLATE
    stops: tuple[str, ...]  # end-of-turn tokens


FORMATS: tuple[ChatFormat, ...] = (
    ChatFormat("chatml", "<|im_start|>",
               "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n",
               ("<|im_end|>",)),
    ChatFormat("llama3", "<|start_header_id|>",
               "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
               "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
               ("<|eot_id|>",)),
    ChatFormat("gemma", "<start_of_turn>",
               "{{- range .Messages }}<start_of_turn>{{ if eq .Role \"assistant\" }}model{{ else }}{{ .Role }}{{ end }}"
               "\n{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n",
               ("<end_of_turn>",)),
    ChatFormat("mistral", "[INST]",
               "{{- range .Messages }}{{ if eq .Role \"user\" }}[INST] {{ .Content }} [/INST]"
               "{{ else if eq .Role \"assistant\" }}{{ .Content }}</s>{{ end }}{{ end }}",
               ("[INST]", "</s>")),
)


def chat_format(chat_template: str | None) -> ChatFormat | None:
    """The known format whose turn marker the Jinja template contains, or None."""
    for known in FORMATS:
        if chat_template and known.marker in chat_template:
            return known
    return None


def modelfile_text(gguf_file: str, chat_template: str | None, eos_token: str | None) -> str:
    """An Ollama Modelfile for `gguf_file` (a name in the same folder)."""
    known = chat_format(chat_template)
    stops = list(known.stops if known else ())
    if eos_token and eos_token not in stops:
        stops.append(eos_token)
    lines = ["# Written by hypersloth-export. In this folder: ollama create NAME -f Modelfile; ollama run NAME",
             f"FROM ./{gguf_file}"]
    if known is not None:
        lines += [f"# chat template: {known.name} (the same turns as the model's Jinja template)",
                  f'TEMPLATE """{known.template}"""']
    else:
        lines.append("# chat template: not a known format; Ollama uses the GGUF's tokenizer.chat_template")
    lines += [f'PARAMETER stop "{_quoted(stop)}"' for stop in stops]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
