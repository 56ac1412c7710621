"""A Hugging Face folder compiles as it is: fxshard writes the model file a person would write for it.

``fxshard compile FOLDER --seq 2048 --batch 8`` (and ``plan``, ``plan --auto``, ``verify``) reads the folder's
``config.json``, chooses the head (``AutoModelFor…``) from its ``architectures`` or ``--task``, and writes a model
file (``make_model()`` from the config, ``make_inputs()`` a right-padded example batch of ``--batch`` rows of
``--seq`` tokens with the task's labels) from ``templates/hf_model.py.j2``.  Everything after that is the model-file
path with ``--weights FOLDER``: nothing downstream learns a second way in, and the compiled folder's ``model.py``
is that file, readable, editable, recompiled on its own::

    with model_source(Path("qwen"), FolderOptions(), seq=2048, batch=8) as source:  # fxshard.driver's
        compile(source.model_file, Layout(tp=2), out="out/qwen", weights=source.weights)

Refused before anything is built, each with its fix: no ``config.json``; a model type or architecture transformers
does not have; a head transformers has no class for; code the folder ships (``auto_map``) without
``--trust-remote-code``; a ``--seq`` beyond the model's positions.  The folder's tensors are checked against the
model the config builds by ``--weights``' own validation (:mod:`fxshard.codegen.weights`).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jinja2

from fxshard.capture.folder_options import TASK_NAMES, FolderOptions
from fxshard.errors import ModelFileError, OptionError

CONFIG = "config.json"
# files of a tokenizer a Hugging Face folder may hold (any one makes AutoTokenizer read the folder)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class Task:
    """A head fxshard writes an example batch for: ``--task NAME``, the ``AutoModelFor…`` class that builds it and
    transformers' table of the architectures of that head (``modeling_auto.<mapping>``)."""

    name: str
    auto_class: str
    mapping: str


TASKS = {t.name: t for t in (
    Task("causal-lm", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    Task("seq2seq-lm", "AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    Task("sequence-classification", "AutoModelForSequenceClassification",
         "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    Task("token-classification", "AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    Task("masked-lm", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    Task("question-answering", "AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
)}
assert tuple(TASKS) == TASK_NAMES


@dataclass(frozen=True)
class FolderModel:
    """What the model file of a folder says: read from ``config.json``, checked, and the example's size."""

    folder: Path
    task: Task
    architecture: str
    remote: bool  # the model's code is the folder's (auto_map), run with trust_remote_code=True
    vocab: int
    pad: int
    pad_source: str
    labels: int
    tokenizer: bool
    seq: int
    batch: int


@dataclass(frozen=True)
class ModelSource:
    """MODEL as the compiler takes it: a model file, and the folder its ranks read weights from (None: the model
    file's own weights)."""

    model_file: Path
    weights: Path | None
    folder: FolderModel | None = None

    def argv(self) -> list[str]:
        """The command-line arguments that name this model again (``fxshard plan --auto`` prints its compile)."""
        if self.folder is None:
            return [str(self.model_file)]
        f = self.folder
        return [str(f.folder), "--seq", str(f.seq), "--batch", str(f.batch), "--task", f.task.name] + (
            ["--trust-remote-code"] if f.remote else [])


def is_folder(path: str | Path) -> bool:
    """Whether MODEL names a folder (a Hugging Face one, or refused as one) rather than a model file."""
    return Path(path).is_dir()


@contextlib.contextmanager
def model_source(path: str | Path, options: FolderOptions = FolderOptions(), seq: int | None = None,
                 batch: int | None = None, weights: bool = True) -> Iterator[ModelSource]:
    """MODEL as a model file: ``path`` itself, or for a folder the model file written for it (in a temporary folder
    that lives as long as the ``with``), with the folder as its weights unless ``weights`` is False (``plan``, and
    ``compile --meta``: shapes only).  A folder's safetensors are checked where ``--weights`` reads them
    (:func:`fxshard.driver.model_source` first looks that they are there)."""
    path = Path(path)
    if not is_folder(path):
        if options.given:
            raise OptionError(f"{' and '.join(options.given)}: for a Hugging Face folder; {path} is a model file, "
                              "whose make_model() builds its own model: drop the flag")
        yield ModelSource(path, None)
        return
    folder = read_folder(path, options, seq, batch)
    with tempfile.TemporaryDirectory(prefix="fxshard-folder-") as tmp:
        from fxshard.files import write_text

        model_file = write_text(Path(tmp) / "model.py", model_file_text(folder), "the folder's model file",
                                owner="a private temporary folder")  # compile copies it into OUT
        yield ModelSource(model_file, folder.folder if weights else None, folder)


def check_model_flags(model: Path, seq: int | None, batch: int | None, auto: bool, weights: Path | None = None) -> None:
    """--seq and --batch shape a Hugging Face folder's example batch; a model file's make_inputs() shapes its own
    (--seq is then --auto's length, and plan's --batch and --seq what it evaluates at)."""
    if is_folder(model):
        if weights is not None:
            raise OptionError(f"--weights {weights}: {model} is a Hugging Face folder, read as its own weights; drop "
                              "--weights (or compile a model file with --weights FOLDER)")
        return
    if batch is not None:
        raise OptionError(f"--batch {batch}: shapes the example batch of a Hugging Face folder; {model} is a model "
                          "file, whose make_inputs() gives the batch: change it there")
    if seq is not None and not auto:
        raise OptionError(f"--seq {seq}: shapes the example batch of a Hugging Face folder, or with --auto the "
                          f"length searched at; {model} is a model file, whose make_inputs() gives the sequence: "
                          "change it there, or add --auto")


def read_folder(path: Path, options: FolderOptions, seq: int | None, batch: int | None) -> FolderModel:
    """Read and check ``path/config.json``; refuse what cannot be built, naming the fix."""
    folder = path.resolve()
    saved = _config_json(folder)
    remote = "auto_map" in saved
    if remote and not options.trust_remote_code:
        raise ModelFileError(
            f"{folder / CONFIG}: its auto_map names Python files in the folder as the model's code "
            f"({_auto_map(saved)}). Building the model runs that code: in this compile, and on every rank of every "
            "run, export and generate of what it compiles. Read it first; if you trust it, add --trust-remote-code")
    _check_example(seq, batch, folder)
    config = _config(folder, saved, remote)
    task = _task(folder, saved, config, options.task, remote)
    positions = _positions(config)
    if positions is not None and seq > positions:
        raise OptionError(f"--seq {seq}: longer than the {positions} positions {folder / CONFIG} gives the model "
                          f"(max_position_embeddings); give --seq {positions} or less")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad, pad_source = _pad(text)
    archs = saved.get("architectures") or []
    return FolderModel(folder=folder, task=task, architecture=archs[0] if archs else f"{saved['model_type']} model",
                       remote=remote, vocab=int(text.vocab_size), pad=pad, pad_source=pad_source,
                       labels=int(getattr(config, "num_labels", 2)),
                       tokenizer=any((folder / f).is_file() for f in TOKENIZER_FILES), seq=seq, batch=batch)


def model_file_text(folder: FolderModel) -> str:
    """The model file's source: deterministic (the same folder and sizes give the same bytes, so a recompile keeps
    the digest a checkpoint's resume checks)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    return env.get_template("hf_model.py.j2").render(
        folder=folder.folder, folder_literal=json.dumps(str(folder.folder)), folder_arg=shlex.quote(str(folder.folder)),
        architecture=folder.architecture, task=folder.task, tokenizer=folder.tokenizer, batch=folder.batch,
        seq=folder.seq, vocab=folder.vocab, pad=folder.pad, pad_source=folder.pad_source, labels=folder.labels,
        remote=", trust_remote_code=True" if folder.remote else "")


def _config_json(folder: Path) -> dict:
    path = folder / CONFIG
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())[:6]) or "nothing"
        raise ModelFileError(f"{folder}: no {CONFIG} (found {found}); a Hugging Face model folder, as "
                             "save_pretrained writes it, holds config.json beside its *.safetensors. Give that "
                             "folder, or a model file (MODEL.py defining make_model() and make_inputs())")
    try:
        saved = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e}); copy the folder's config.json again") from e
    if not isinstance(saved, dict):
        raise ModelFileError(f"{path}: holds a {type(saved).__name__}, expected a JSON object of the model's "
                             "configuration")
    return saved


def _auto_map(saved: dict) -> str:
    entries = saved["auto_map"] if isinstance(saved["auto_map"], dict) else {}
    return ", ".join(f"{k} -> {v}" for k, v in sorted(entries.items())[:4]) or repr(saved["auto_map"])


def _check_example(seq: int | None, batch: int | None, folder: Path) -> None:
    if seq is None or batch is None:
        missing = " and ".join(f for f, v in (("--seq", seq), ("--batch", batch)) if v is None)
        raise OptionError(f"{folder} is a Hugging Face folder: fxshard writes its example batch, --batch sequences "
                          f"(per step, over all dp ranks) of --seq tokens; found no {missing}. Give both, e.g. "
                          "--seq 2048 --batch 8")
    if seq < 2 or batch < 1:
        raise OptionError(f"--seq {seq} --batch {batch}: expected a sequence of 2 tokens or more and 1 row or more")


def _config(folder: Path, saved: dict, remote: bool):
    """The folder's configuration as transformers reads it; an unknown model type refused by name."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError as e:
        raise ModelFileError(f"{folder}: a Hugging Face folder needs transformers, which is not installed "
                             f"({e}); pip install transformers") from e
    import transformers

    model_type = saved.get("model_type")
    if not remote and model_type not in CONFIG_MAPPING_NAMES:
        raise ModelFileError(f"{folder / CONFIG}: model_type {model_type!r} is not a model transformers "
                             f"{transformers.__version__} has; upgrade transformers to a release that has it, or "
                             "compile a model file that builds the model (docs/model-file.md)")
    if not remote:
        missing = [a for a in saved.get("architectures") or [] if not hasattr(transformers, a)]
        if missing:
            raise ModelFileError(f"{folder / CONFIG}: architecture {missing[0]} is not a class transformers "
                                 f"{transformers.__version__} has (model_type {model_type!r}); upgrade transformers, "
                                 "or compile a model file that builds the model (docs/model-file.md)")
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=remote)
    except Exception as e:  # the folder's own configuration (or its code) did not read
        raise ModelFileError(f"{folder / CONFIG}: transformers could not read it: {type(e).__name__}: {e}") from e


def _task(folder: Path, saved: dict, config, asked: str | None, remote: bool) -> Task:
    """``--task``, else the head ``architectures`` names (or, for the folder's own code, ``auto_map`` holds)."""
    from transformers.models.auto import modeling_auto

    if asked is not None and asked not in TASKS:
        raise OptionError(f"--task {asked}: not a task fxshard writes an example batch for; expected one of "
                          f"{'|'.join(TASKS)}")
    auto_map = saved.get("auto_map") if isinstance(saved.get("auto_map"), dict) else {}
    archs = saved.get("architectures") or []
    task = TASKS.get(asked)
    if task is None:
        task = next((t for a in archs for t in TASKS.values() if a in _names(getattr(modeling_auto, t.mapping))),
                    None) if not remote else next((t for t in TASKS.values() if t.auto_class in auto_map), None)
    if task is None:
        said = f"architectures {archs}" if archs else "no architectures"
        raise OptionError(f"{folder / CONFIG} names {said}, not a head fxshard writes an example batch for; give "
                          f"--task {'|'.join(TASKS)} (the head to build on the folder's weights)")
    if remote:
        if task.auto_class not in auto_map:
            raise OptionError(f"--task {task.name}: {folder / CONFIG}'s auto_map has no {task.auto_class} (it has "
                              f"{', '.join(sorted(auto_map)) or 'none'}); give the task of one it has")
        return task
    if type(config) not in getattr(modeling_auto, task.auto_class)._model_mapping:
        raise OptionError(f"--task {task.name}: transformers has no {task.auto_class} for model_type "
                          f"{config.model_type!r}; give a task this model has a head for")
    return task


def _names(mapping) -> set[str]:
    """Class names of one of transformers' ``MODEL_FOR_…_MAPPING_NAMES`` (an entry may be a tuple of names)."""
    return {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}


def _positions(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _pad(config) -> tuple[int, str]:
    """The id the example pads with, and where it came from (a comment in the model file)."""
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, list | tuple) and value:
            value = value[0]
        if isinstance(value, int) and 0 <= value < config.vocab_size:
            return value, f"config.json's {key}: the padding's id"
    return 0, "config.json names no pad_token_id nor eos_token_id: id 0 pads"
