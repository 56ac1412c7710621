"""The spawn harness the multi-process tests use (it lives in the library, shared with the benchmarks), and the
comparison of a distributed run with single-device training that the mixture-of-experts tests share."""

from fxshard.testing import spawn

__all__ = ["assert_matches_single_device", "spawn"]


def assert_matches_single_device(case: str, path, layout, per_rank: list, manifest, want: list[float], single: dict,
                                 rel: float) -> list[dict]:
    """Every rank's step losses within ``rel`` of one device's ``want``, and the trained parameters, gathered from
    the ranks' states (``per_rank``: (losses, state, ...) per rank), within ``fxshard verify``'s share of the update
    of one device's ``single``; returns the per-parameter rows of the comparison."""
    from fxshard.capture.modelfile import load_model_file
    from fxshard.tools.verify import DEFAULT_PARAM_RTOL, compare_parameters, gather_parameters, update_share

    for rank, (losses, *_) in enumerate(per_rank):
        for step, (got, ref) in enumerate(zip(losses, want, strict=True), start=1):
            assert abs(got - ref) <= rel * abs(ref), f"{case} rank {rank} step {step}: {got} vs {ref}"
    params = gather_parameters(manifest, states={r: st for r, (_, st, *_) in enumerate(per_rank)})
    initial = dict(load_model_file(path).build_model(0).named_parameters(remove_duplicate=False))
    rows = compare_parameters(params, single, initial)
    assert {r["fqn"] for r in rows} == set(single)
    share = update_share(rows)
    worst = max(rows, key=lambda r: r["diff_sq"])["fqn"]
    assert share <= DEFAULT_PARAM_RTOL[layout.dtype], f"{case}: parameters differ by {share:.2e} of the update ({worst})"
    return rows
