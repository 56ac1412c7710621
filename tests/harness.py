"""The spawn harness the multi-process tests use (it lives in the library, shared with the benchmarks), and the
comparison of a distributed run with single-device training that the mixture-of-experts tests share."""

from fxshard.testing import spawn

__all__ = ["assert_matches_single_device", "compile_and_train", "run_options", "single_device", "spawn",
           "train_and_record"]


def run_options(steps: int, optim, checkpoint=None):
    """``fxshard run``'s options for ``steps`` steps of ``optim``, with a CheckpointConfig's folder, saves and
    resume."""
    from fxshard.train.options import RunOptions

    if checkpoint is None:
        return RunOptions(steps, optim)
    return RunOptions(steps, optim, checkpoint=checkpoint.folder, save_every=checkpoint.save_every,
                      resume=checkpoint.resume, overwrite=checkpoint.overwrite, keep_last=checkpoint.keep_last,
                      allow_changed_model=checkpoint.allow_changed_model)


def assert_matches_single_device(case: str, path, layout, per_rank: list, manifest, want: list[float], single: dict,
                                 rel: float) -> list[dict]:
    """Every rank's step losses within ``rel`` of one device's ``want``, and the trained parameters, gathered from
    the ranks' states (``per_rank``: (losses, state, ...) per rank), within ``fxshard verify``'s share of the update
    of one device's ``single``; returns the per-parameter rows of the comparison."""
    from fxshard.capture.modelfile import load_model_file
    from fxshard.check.verify import compare_parameters, default_tolerances, gather_parameters, update_share

    for rank, (losses, *_) in enumerate(per_rank):
        for step, (got, ref) in enumerate(zip(losses, want, strict=True), start=1):
            assert abs(got - ref) <= rel * abs(ref), f"{case} rank {rank} step {step}: {got} vs {ref}"
    params = gather_parameters(manifest, states={r: st for r, (_, st, *_) in enumerate(per_rank)})
    initial = dict(load_model_file(path).for_layout(layout).build_model(0).named_parameters(remove_duplicate=False))
    rows = compare_parameters(params, single, initial)
    assert {r["fqn"] for r in rows} == set(single) - set(manifest.tied)  # a tied weight: under the name kept
    share = update_share(rows)
    worst = max(rows, key=lambda r: r["diff_sq"])["fqn"]
    assert share <= default_tolerances(layout)[1], f"{case}: parameters differ by {share:.2e} of the update ({worst})"
    return rows


def train_and_record(out: str, steps: int, optim) -> tuple[list[float], dict, dict]:
    """A spawn target: train the compiled folder ``out`` for ``steps``; this rank's losses, trained tensors by
    name and measured model-state bytes."""
    from pathlib import Path

    from fxshard.train.launch import train
    from fxshard.train.options import RunOptions

    state: dict = {}
    memory: dict = {}
    losses = train(Path(out), RunOptions(steps, optim), log=lambda *_: None, final_state=state, memory=memory)
    return losses, state, memory


def compile_and_train(cases: dict, tmp_path_factory, steps: int) -> dict:
    """Compile each case (``name: (model path, Layout, OptimConfig)``) and train each world size's cases in one
    spawn.  ``{case: (per-rank results of train_and_record, manifest)}``, or a CaseFailure naming the case's own
    compile error or traceback (so one bad case fails one test)."""
    from fxshard.codegen.manifest import read_manifest
    from fxshard.driver import compile as compile_model
    from fxshard.testing import CaseFailure, spawn_cases

    folders: dict = {}
    results: dict = {}
    for case, (path, layout, optim) in cases.items():
        out = tmp_path_factory.mktemp(case)
        try:
            compile_model(path, layout, out=out)
        except Exception as e:
            results[case] = CaseFailure(f"compile failed: {type(e).__name__}: {e}")
            continue
        folders.setdefault(layout.world_size, []).append((case, out, optim))
    for world, items in folders.items():
        found = spawn_cases(train_and_record, world, [(case, (str(o), steps, opt)) for case, o, opt in items])
        for case, out, _ in items:
            results[case] = found[case] if isinstance(found[case], CaseFailure) else (found[case], read_manifest(out))
    return results


_SINGLE: dict[tuple, tuple[list[float], dict]] = {}


def single_device(path, steps: int, optim, dtype: str = "fp32", layout=None, chunks: int = 1
                  ) -> tuple[list[float], dict]:
    """One device's losses and trained parameters by FQN (cached per model, steps, optimizer, dtype, the
    ``layout``'s LoRA adapters, which the model is built with, and its fp8 recipe, run on ``chunks`` parts of each
    batch: the manifest's dp x microbatches)."""
    from fxshard.capture.lora import LoraOptions

    lora = LoraOptions.from_layout(layout) if layout is not None else None
    fp8 = layout.fp8_recipe if layout is not None else None
    key = (path, steps, optim, dtype, lora, fp8, chunks if fp8 else 1)
    if key not in _SINGLE:
        from fxshard.capture.modelfile import load_model_file
        from fxshard.train.reference import reference_losses

        final: dict = {}
        losses = reference_losses(load_model_file(path, lora), steps, optim, dtype=dtype, final_state=final, fp8=fp8,
                                  chunks=key[-1])
        _SINGLE[key] = (losses, final)
    return _SINGLE[key]
