"""``fxshard generate CKPT --prompt TEXT``: a quick look at what training taught, on one process.

The model is rebuilt from a checkpoint of any layout as ``fxshard export`` rebuilds it (the checkpoint's model file,
every parameter its full tensor assembled from the saved slices), and transformers' own ``generate`` decodes:
greedy by default, sampled with ``temperature`` > 0 (and ``top_p``, seeded by ``seed``).  The tokenizer is
``tokenizer`` or the one the model file names (``TOKENIZER``: ``compile FOLDER`` writes the folder's own); ``chat``
renders the prompt as one user turn with the tokenizer's chat template.  Not a serving engine: no batching, no
KV-cache management beyond transformers', one prompt; export the checkpoint for serving::

    done = generate("ckpt", "The capital of France is", max_new_tokens=8)
    done.text, done.new_ids          # the continuation, and its token ids
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fxshard.errors import FxshardError, OptionError

TOKENIZER_ATTR = "TOKENIZER"  # the model file's name for its tokenizer folder


class GenerateError(FxshardError):
    """A checkpoint, model or tokenizer ``fxshard generate`` cannot decode with."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (``temperature`` 0), else sampled at ``temperature`` from the smallest
    set of tokens whose probability reaches ``top_p``, seeded by ``seed``."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise OptionError(f"--max-new-tokens {self.max_new_tokens}: expected 1 or more tokens to generate")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise OptionError(f"--temperature {self.temperature}: expected 0 (greedy) or a positive temperature, e.g. "
                              "0.7")
        if not 0 < self.top_p <= 1:
            raise OptionError(f"--top-p {self.top_p}: expected a probability in (0, 1], e.g. 0.9")
        if self.top_p < 1 and self.temperature == 0:
            raise OptionError(f"--top-p {self.top_p}: samples, but --temperature is 0 (greedy decoding takes the most "
                              "likely token); add --temperature, e.g. 0.7")

    def config(self, model, tokenizer):
        """transformers' ``GenerationConfig``: these choices, and nothing the model's defaults would add (a
        repetition penalty, top-k) that the command line did not ask for."""
        from transformers import GenerationConfig

        sampled = self.temperature > 0
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else \
            getattr(model.generation_config, "eos_token_id", None)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        return GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=sampled,
                                temperature=self.temperature if sampled else None,
                                top_p=self.top_p if sampled else None, top_k=0 if sampled else None,
                                eos_token_id=eos, pad_token_id=pad)


@dataclass(frozen=True)
class Generation:
    """What was decoded: the prompt's ids (after the chat template), the new ids, and the new text."""

    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    tokenizer: Path


def generate(checkpoint: str | Path, prompt: str, *, chat: bool = False, sampling: Sampling = Sampling(),
             tokenizer: str | Path | None = None, model_file: str | Path | None = None) -> Generation:
    """Decode from the trained model of ``checkpoint`` (a ``fxshard run --checkpoint`` folder, following
    ``latest``, or one ``step-*`` folder) after ``prompt``; see the module docstring."""
    from fxshard.capture.modelfile import load_model_file
    from fxshard.train.export import trained_model

    sampling.check()
    if not prompt and not chat:
        raise OptionError("--prompt is empty: give the text to continue (or --chat, to answer it)")
    model, path = trained_model(checkpoint, model_file)  # the model file's own refusals (edited copy) first
    if not callable(getattr(model, "generate", None)):
        raise GenerateError(f"{path}: its model ({type(model).__name__}) has no generate(): fxshard generate decodes "
                            "with a transformers model; export the checkpoint (fxshard export) and decode it in your "
                            "own code")
    source = Path(model_file) if model_file is not None else path / "model.py"
    folder = _tokenizer_folder(tokenizer, load_model_file(source).module, source)
    tok = _tokenizer(folder)
    ids = _prompt_ids(tok, prompt, chat, folder)
    vocab = model.get_input_embeddings().weight.shape[0]
    if max(ids, default=0) >= vocab:
        raise GenerateError(f"{folder}: the tokenizer gives id {max(ids)} for the prompt, beyond the model's "
                            f"vocabulary of {vocab}: a tokenizer of another model; give the model's own with "
                            "--tokenizer DIR")
    model.eval()
    torch.manual_seed(sampling.seed)
    with torch.no_grad():
        input_ids = torch.tensor([ids])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=sampling.config(model, tok))
    new = out[0, len(ids):].tolist()
    return Generation(ids, new, tok.decode(new, skip_special_tokens=True), folder)


def _tokenizer_folder(given: str | Path | None, module, source: Path) -> Path:
    """``--tokenizer``, else the folder the model file names in ``TOKENIZER``."""
    named = getattr(module, TOKENIZER_ATTR, None)
    folder = Path(given) if given is not None else Path(named) if isinstance(named, str | Path) else None
    if folder is None:
        raise GenerateError(f"{source} names no tokenizer ({TOKENIZER_ATTR} = \"DIR\"; `fxshard compile FOLDER` "
                            "writes the folder's own when it holds one): give one with --tokenizer DIR")
    if not folder.is_dir():
        what = "--tokenizer" if given is not None else f"{source}'s {TOKENIZER_ATTR}"
        raise GenerateError(f"{folder}: no such folder ({what}); give a Hugging Face tokenizer folder (tokenizer.json "
                            "and tokenizer_config.json) with --tokenizer DIR")
    return folder


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # a folder transformers cannot read as a tokenizer: its own words, named
        raise GenerateError(f"{folder}: not a tokenizer transformers reads ({type(e).__name__}: {e}); give a Hugging "
                            "Face tokenizer folder (tokenizer.json and tokenizer_config.json) with --tokenizer DIR"
                            ) from e


def _prompt_ids(tok, prompt: str, chat: bool, folder: Path) -> list[int]:
    """The prompt's ids: as text, or as one user turn of the chat template with the assistant's turn opened."""
    if not chat:
        return list(tok(prompt, add_special_tokens=True)["input_ids"])
    if not getattr(tok, "chat_template", None):
        raise GenerateError(f"{folder}: the tokenizer has no chat template (tokenizer_config.json's chat_template, "
                            "or chat_template.jinja); drop --chat to continue the prompt as plain text")
    return list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))
