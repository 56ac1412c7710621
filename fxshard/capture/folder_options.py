"""The options of a Hugging Face folder given where a model file goes (``fxshard compile FOLDER``, ``plan``,
``verify``), declared once (:mod:`fxshard.flags`).

A leaf without torch, as the layout's flags are: the command line declares these before torch loads::

    >>> [f.flag for f in flags(FolderOptions)]
    ['--task', '--trust-remote-code']
"""

from __future__ import annotations

from dataclasses import dataclass

from fxshard.flags import flags, option

__all__ = ["FolderOptions", "TASK_NAMES", "flags"]

# the tasks fxshard writes a model file and an example batch for (fxshard/capture/hf_folder.py's TASKS)
TASK_NAMES = ("causal-lm", "seq2seq-lm", "sequence-classification", "token-classification", "masked-lm",
              "question-answering")


@dataclass(frozen=True)
class FolderOptions:
    task: str | None = option(None, "MODEL is a Hugging Face folder: the head to build, where config.json's "
                                    f"architectures does not say it: {'|'.join(TASK_NAMES)}")
    trust_remote_code: bool = option(False, "MODEL is a Hugging Face folder whose config.json maps the model to "
                                            "Python files in the folder (auto_map): run that code, in the compile "
                                            "and on every rank of every run")

    @property
    def given(self) -> list[str]:
        """The flags set: refused for a model file, which says all of this itself."""
        return [f for f, v in (("--task", self.task), ("--trust-remote-code", self.trust_remote_code)) if v]
