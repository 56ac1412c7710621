"""Chat and prompt-completion rows to token ids and a loss mask, for ``data tokenize --format chat``.

A conversation is rendered once, with the tokenizer folder's own chat template (``tokenizer_config.json``'s
``chat_template`` or ``chat_template.jinja``, through transformers' ``apply_chat_template``), and tokenized
once. Which tokens are trained (mask 1: the token is a target, predicted from the one before it) is decided by
one of two methods, the first that applies:

- **generation markers**: a template whose assistant turns sit inside ``{% generation %}`` blocks gives its
  own mask: transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)``, ids and mask as it
  returns them (every token that overlaps a marked span);
- **prefix renderings** (what TRL does for templates without markers, as Qwen2's and Llama 3's): assistant
  message ``i`` is the text between the rendering of ``messages[:i]`` with the generation prompt and the
  rendering of ``messages[:i + 1]``; the whole conversation is tokenized with character offsets and every
  token that overlaps such a span is trained (the same rule as transformers').  The renderings must extend one
  another; a template that rewrites earlier turns (Qwen3 drops old reasoning) is refused by row, with the fix
  (a template with markers, ``--chat-template FILE``).

So the assistant's reply and its end-of-turn tokens are trained; the generation prompt
(``<|im_start|>assistant``) and every other role's tokens are not::

    renderer = ChatRenderer.load(Path("tok"), train_on="assistant")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    row = renderer.render(chat, "chats.jsonl:1")
    row.ids, row.mask          # int64 ids, uint8 mask (1 on "Hello<|im_end|>\\n")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fxshard.errors import DataError

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
TRAIN_ON = ("assistant", "last-assistant", "all")
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
MARKERS, PREFIXES = "generation markers", "prefix renderings"


@dataclass(frozen=True)
class Rendered:
    """One example: its token ids (int64) and loss mask (uint8, 1 where the token is a trained target)."""

    ids: np.ndarray
    mask: np.ndarray

    def trained(self) -> int:
        """Targets the loss counts: a mask of 1 past the first token (nothing predicts the first)."""
        return int(self.mask[1:].sum())


def load_hf_tokenizer(folder: Path):
    """The transformers tokenizer of a local folder (never a download, never remote code)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"--tokenizer {folder}: chat data is rendered with transformers' chat templates; "
                        "install transformers (pip install transformers)") from None
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise DataError(f"--tokenizer {folder}: no tokenizer.json or tokenizer_config.json; give a local "
                        "Hugging Face tokenizer folder (as save_pretrained writes it)")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # a malformed folder: named, not a traceback through transformers
        raise DataError(f"--tokenizer {folder}: transformers could not load it ({type(e).__name__}: {e})") \
            from None


def mask_overlapping(offsets, spans: list[tuple[int, int]], count: int) -> np.ndarray:
    """1 for every token whose character offsets overlap one of ``spans`` (sorted): transformers' rule."""
    mask = np.zeros(count, dtype=np.uint8)
    k = 0
    for t, (lo, hi) in enumerate(offsets):
        while k < len(spans) and lo >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if hi > spans[k][0]:
            mask[t] = 1
    return mask


def last_run(mask: np.ndarray) -> np.ndarray:
    """Only the last run of ones of ``mask`` (the last assistant turn of a marked template's mask)."""
    ones = np.flatnonzero(mask)
    if not len(ones):
        return mask
    gaps = np.flatnonzero(np.diff(ones) > 1)
    first = ones[gaps[-1] + 1] if len(gaps) else ones[0]
    out = np.zeros_like(mask)
    out[first:ones[-1] + 1] = 1
    return out


class ChatRenderer:
    """Renders and masks conversations with one tokenizer and chat template (see the module docstring)."""

    def __init__(self, tokenizer, train_on: str = "assistant", template: str | None = None, where: str = ""):
        if train_on not in TRAIN_ON:
            raise DataError(f"--train-on {train_on}: expected one of {', '.join(TRAIN_ON)}")
        self.tokenizer, self.train_on = tokenizer, train_on
        self.template = template if template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(self.template, dict):  # several named templates: the default one
            self.template = self.template.get("default")
        if not self.template:
            raise DataError(f"--tokenizer {where}: no chat template (tokenizer_config.json has no "
                            "chat_template and there is no chat_template.jinja); give one with "
                            "--chat-template FILE, or for rows of prompt and completion text use --format "
                            "prompt-completion")
        self.method = MARKERS if GENERATION.search(self.template) else PREFIXES

    @classmethod
    def load(cls, folder: Path, train_on: str = "assistant",
             template_file: Path | None = None) -> ChatRenderer:
        template = None
        if template_file is not None:
            if not Path(template_file).is_file():
                raise DataError(f"--chat-template {template_file}: no such file; give a Jinja chat template")
            template = Path(template_file).read_text(encoding="utf-8")
        return cls(load_hf_tokenizer(folder), train_on, template, str(folder))

    def render(self, messages, where: str) -> Rendered:
        """The ids and mask of one conversation (``where`` names its row in every refusal)."""
        return self.render_many([(where, messages)])[0]

    def render_many(self, rows: list[tuple[str, list]]) -> list[Rendered]:
        """:meth:`render` of many rows (``(where, messages)``), tokenized together (in the tokenizer's
        threads)."""
        for where, messages in rows:
            check_messages(messages, where)
        if self.method == MARKERS:
            done = self._marked(rows)
        else:
            texts, spans = zip(*(self._spans(m, where) for where, m in rows), strict=True)
            enc = self.tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
            done = [(np.asarray(ids, np.int64), mask_overlapping(offsets, s, len(ids)))
                    for ids, offsets, s in zip(enc["input_ids"], enc["offset_mapping"], spans, strict=True)]
        out = []
        for ids, mask in done:
            if self.train_on == "all":
                mask = np.ones_like(mask)
            elif self.train_on == "last-assistant" and self.method == MARKERS:
                mask = last_run(mask)
            out.append(Rendered(ids, mask))
        return out

    def _apply(self, messages, where: str, **kwargs):
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, **kwargs)
        except Exception as e:  # the template's own raise_exception, or a Jinja error: the row named
            raise DataError(f"{where}: the chat template could not render this conversation "
                            f"({type(e).__name__}: {e})") from None

    def _marked(self, rows: list[tuple[str, list]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """transformers' ids and assistant mask of each row (one batched call; row by row to name a failing
        one)."""
        try:
            out = self.tokenizer.apply_chat_template([m for _, m in rows], chat_template=self.template,
                                                     tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
        except Exception:
            for where, m in rows:
                self._apply([m], where, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            raise
        return [(np.asarray(ids, np.int64), np.asarray(mask, np.uint8))
                for ids, mask in zip(out["input_ids"], out["assistant_masks"], strict=True)]

    def _spans(self, messages, where: str) -> tuple[str, list[tuple[int, int]]]:
        """The prefix method: the rendered conversation and the character span of each trained assistant
        turn."""
        text = self._apply(messages, where, tokenize=False)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.train_on == "last-assistant":
            turns = turns[-1:]
        spans = []
        for i in turns:
            if i == 0:
                raise DataError(f"{where}: the conversation starts with an assistant message, so the "
                                "template's prefix (the generation prompt before it) cannot be rendered; "
                                "begin it with a system or user message, or use a template with {% "
                                "generation %} markers")
            before = self._apply(messages[:i], where, tokenize=False, add_generation_prompt=True)
            through = self._apply(messages[:i + 1], where, tokenize=False)
            if not through.startswith(before) or not text.startswith(through):
                raise DataError(f"{where}: the chat template renders assistant message {i} differently once "
                                "later messages follow (its renderings of the conversation's prefixes do "
                                "not extend one another), so the assistant's tokens cannot be told apart; "
                                "give a template that marks them, with {% generation %} ... {% "
                                "endgeneration %} around each assistant turn, through --chat-template FILE")
            spans.append((len(before), len(through)))
        return text, spans


def check_messages(messages, where: str) -> None:
    """Refuse a conversation that is not a list of {role, content} messages with known roles, naming the
    row."""
    if not isinstance(messages, (list, tuple)) or not messages:
        found = "an empty list" if isinstance(messages, (list, tuple)) else type(messages).__name__
        raise DataError(f"{where}: 'messages' is {found}; expected a list of messages "
                        '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]')
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: message {k} is {m!r:.80}; expected an object with a \"role\" and a "
                            "\"content\"")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {k} has the unknown role {m['role']!r}; expected one of "
                            f"{', '.join(ROLES)} (rename the role in the data)")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {k} ({m['role']}) has content {m.get('content')!r:.80}; "
                            "expected a string (fxshard renders text messages)")


class PromptCompletion:
    """``--format prompt-completion``: rows of ``prompt`` and ``completion`` text, trained on the completion.

    ``prompt + completion`` is tokenized once, with the tokenizer's own special tokens (a BOS where it adds
    one), and EOS follows unless the text already ends with it; the tokens overlapping the completion, and the
    EOS, are trained (``train_on="all"``: every token)."""

    def __init__(self, tokenizer, train_on: str = "assistant", where: str = ""):
        if train_on not in ("assistant", "all"):
            raise DataError(f"--train-on {train_on}: --format prompt-completion trains on the completion "
                            "(assistant) or on all tokens (all)")
        if tokenizer.eos_token_id is None:
            raise DataError(f"--tokenizer {where}: no eos_token in tokenizer_config.json, so a completion "
                            "cannot be ended; add one")
        self.tokenizer, self.train_on, self.method = tokenizer, train_on, "completion"

    def render_many(self, rows: list[tuple[str, dict]]) -> list[Rendered]:
        """The ids and mask of each row (``(where, record)``), tokenized together."""
        texts, spans = [], []
        for where, record in rows:
            prompt, completion = record.get("prompt"), record.get("completion")
            for name, value in (("prompt", prompt), ("completion", completion)):
                if not isinstance(value, str):
                    raise DataError(f"{where}: no string field {name!r} (found {value!r:.60}); --format "
                                    "prompt-completion reads rows {\"prompt\": \"...\", \"completion\": "
                                    "\"...\"}")
            texts.append(prompt + completion)
            spans.append([(len(prompt), len(prompt) + len(completion))])
        enc = self.tokenizer(texts, add_special_tokens=True, return_offsets_mapping=True)
        eos, out = self.tokenizer.eos_token_id, []
        for ids, offsets, span in zip(enc["input_ids"], enc["offset_mapping"], spans, strict=True):
            mask = mask_overlapping(offsets, span, len(ids))
            if not ids or ids[-1] != eos:
                ids, mask = [*ids, eos], np.append(mask, np.uint8(1))
            mask = np.ones_like(mask) if self.train_on == "all" else mask
            out.append(Rendered(np.asarray(ids, np.int64), mask))
        return out
