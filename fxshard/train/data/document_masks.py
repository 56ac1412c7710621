"""Whether a compiled model keeps attention inside each document of a packed sequence (``--pack``).

A packed sequence is exact only if each document attends to itself alone.  The compiled forward learns where
documents begin from ``position_ids`` that restart at 0; a Hugging Face model turns those into a block-diagonal
causal mask when no ``attention_mask`` is given (``transformers.masking_utils``: ``find_packed_sequence_indices``,
then ``packed_sequence_mask_function``; under ``torch.export`` the mask is always built from the position ids, so
the captured program computes it on every batch).  So ``--pack`` needs:

- ``position_ids`` among the compiled inputs (``make_inputs()`` returns them), and no ``attention_mask``;
- a transformers model whose attention implementation builds its mask through ``masking_utils`` (sdpa, eager,
  flex_attention, flash attention), whose modeling code calls ``create_causal_mask``; or a model file that declares
  its own attention restarts per document from ``position_ids`` with ``PACKED_POSITION_IDS = True``.
"""

from __future__ import annotations

import inspect
import sys

from fxshard.errors import DataError


def check_document_masks(mf, spec, options) -> None:
    """Refuse ``--pack`` for a model whose attention cannot keep to documents, naming it and the fix."""
    keys = [str(k) for k in spec.keys]
    if "position_ids" not in keys:
        raise DataError(f"--pack: {mf.path} was compiled without position_ids, so its attention cannot tell where a "
                        "packed document begins; add \"position_ids\": torch.arange(SEQ).repeat(BATCH, 1) to "
                        "make_inputs() and recompile (a Hugging Face model then masks attention per document), or "
                        "train without --pack")
    if "attention_mask" in keys:
        raise DataError(f"--pack: {mf.path} was compiled with an attention_mask input, which Hugging Face models "
                        "use instead of the position ids (no per-document mask); drop attention_mask from "
                        "make_inputs() and recompile, or train without --pack")
    if getattr(mf.module, "PACKED_POSITION_IDS", False) is True:
        return
    model = mf.build_model(meta=True)
    why = _why_not(model)
    if why:
        raise DataError(f"--pack: {mf.path}: {type(model).__name__} {why}, so attention would cross the documents of "
                        "a packed sequence; train without --pack, or (if its attention does restart per document "
                        "from position_ids) declare PACKED_POSITION_IDS = True in the model file")


def _why_not(model) -> str | None:
    """None if ``model``'s attention masks packed documents from position ids; else why not."""
    try:
        from transformers import PreTrainedModel
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:
        PreTrainedModel = None  # noqa: N806
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        return "is not a transformers model (its attention takes no document mask fxshard knows of)"
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return f"uses attention implementation {impl!r}, which builds no mask from position ids"
    source = inspect.getsource(sys.modules[type(model).__module__])
    if "create_causal_mask(" not in source and "create_sliding_window_causal_mask(" not in source:
        return f"({type(model).__module__}) builds its attention mask without transformers' masking utilities"
    return None
