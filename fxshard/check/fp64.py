"""``fxshard verify --fp64``: the same comparison with the model and its floating inputs in float64.

Some models amplify rounding in training: a ResNet whose batch norms see 4 values per channel (a 1x1 map, batch 4)
and AdamW, whose first steps move each element by about lr whatever its gradient's size, turn a last-bit difference
into 1e-4 of the loss and 7e-2 of the update within 3 steps.  Such a model trained on one device in fp32 is that far
from itself in float64, or from itself with its images in channels-last order; an fp32 comparison against one
device then cannot tell an error of the distributed program from rounding, either way.  In float64 the rounding is
2**29 times smaller, the same amplification leaves about 1e-12, and a real error (a batch statistic over a part,
a gradient not synchronized) stays as large as it is.

The float64 program is the user's own, converted where it enters: a model file written beside the compiled
folder imports the user's and converts, so compile, run and the single-device reference take it as any model
file (:func:`in_float64`)::

    path = float64_model_file("tests/models/resnet18_tiny.py", tmp)   # tmp/model_fp64.py
    mf = load_model_file(path)
    mf.build_model().conv1.weight.dtype                                # torch.float64
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxshard.files import write_text

# the file's first line, split in two literals to fit here, is one line of the written file
WRAPPER = ('''"""fxshard verify --fp64: {path}, its model's parameters and buffers and the floating tensors of its '''
           '''batches in
float64 (fxshard.check.fp64)."""

from fxshard.check.fp64 import in_float64

globals().update(in_float64({path!r}))
''')


def float64_model_file(model_file: str | Path, folder: Path) -> Path:
    """Write ``folder/model_fp64.py``, the model file ``model_file`` in float64 (:func:`in_float64`); its path."""
    return write_text(Path(folder) / "model_fp64.py", WRAPPER.format(path=str(Path(model_file).resolve())),
                      "the float64 model file")


def in_float64(path: str) -> dict[str, Any]:
    """The model-file functions of ``path`` in float64: ``make_model()`` converted by ``.double()`` (parameters
    and floating buffers), every floating tensor of ``make_inputs()``, ``make_batches()`` and each dataset example
    made float64 (integer ids and boolean masks as they are); ``loss_fn`` and ``collate`` as they are."""
    from fxshard.capture.modelfile import load_model_file

    mf = load_model_file(path)
    found: dict[str, Any] = {"make_model": lambda: mf.make_model().double(),
                             "make_inputs": lambda: to_float64(mf.make_inputs())}
    if mf.loss_fn is not None:
        found["loss_fn"] = mf.loss_fn
    module = mf.module
    if callable(getattr(module, "make_batches", None)):
        found["make_batches"] = lambda: [to_float64(b) for b in module.make_batches()]
    if callable(getattr(module, "make_dataset", None)):
        found["make_dataset"] = lambda split: Float64Dataset.of(module.make_dataset(split))
    if callable(getattr(module, "collate", None)):
        found["collate"] = module.collate
    return found


def to_float64(batch: Any) -> Any:
    """``batch`` with each floating tensor in float64."""
    return pytree.tree_map(lambda v: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v,
                           batch)


class Float64Dataset(torch.utils.data.Dataset):
    """A map-style dataset whose examples are made float64 (:func:`to_float64`)."""

    def __init__(self, dataset):
        self.dataset = dataset

    @staticmethod
    def of(dataset):
        if isinstance(dataset, torch.utils.data.IterableDataset):
            return Float64Stream(dataset)
        return Float64Dataset(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return to_float64(self.dataset[i])


class Float64Stream(torch.utils.data.IterableDataset):
    """An IterableDataset whose examples are made float64."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return (to_float64(example) for example in self.dataset)


def rounding_floor(model_file: str | Path, folder: Path, layout, steps: int, optim, seed: int,
                   reference: list[float], single: dict, distributed: list[float], trained: dict,
                   apart: set[str] = frozenset(), weights: Path | None = None, *, train):
    """One device trained in float64 as the measure of an fp32 verification that failed: how far one device in fp32
    (``reference`` losses, ``single`` trained parameters) and the distributed run (``distributed``, ``trained``) each
    are from it (:class:`fxshard.check.verify.Floor`; ``layout``: the verified one, whose --lora adapters the model
    takes; ``apart``: the quiet parameters the comparison judged apart; ``train``:
    :func:`fxshard.train.reference.reference_losses`, passed in by the driver: fxshard.check sits below fxshard.train).
    Where one device is itself beyond the tolerance, fp32 cannot judge the model, and ``--fp64`` can."""
    from fxshard.capture.modelfile import load_model_file
    from fxshard.check.verify import Floor, compare_parameters, update_share, with_weights

    mf = load_model_file(float64_model_file(model_file, folder)).for_layout(layout)
    if weights is not None:
        mf = with_weights(mf, Path(weights))
    initial = dict(mf.build_model(seed).named_parameters(remove_duplicate=False))
    exact: dict = {}
    losses = train(mf, steps, optim, seed, "fp32", final_state=exact)

    def rel(got: list[float]) -> float:
        return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, losses, strict=True))

    def share(state: dict) -> float:
        return update_share(compare_parameters(state, exact, initial), apart)

    return Floor(rel(reference), share(single), rel(distributed), share(trained))


def check_fp64(layout, weights) -> None:
    """Refuse what --fp64 cannot compare, before anything is compiled."""
    from fxshard.errors import OptionError

    if layout.dtype != "fp32":
        raise OptionError(f"--fp64 with --dtype {layout.dtype}: --fp64 verifies the program in float64, which has "
                          "no mixed-precision recipe; verify --dtype bf16 without --fp64, or --fp64 without --dtype")
    if weights is not None:
        raise OptionError(f"--fp64 with the weights of {weights} (--weights, or MODEL a Hugging Face folder): the "
                          "float64 program is built from make_model(), and the compile would read the folder's tensors "
                          "at their own dtype; verify --fp64 a model file without weights, or the folder without "
                          "--fp64")
