"""Expert-parallel all-to-all traffic per training step: measured, the exact figure for the run's routing, and the
balanced figure ``fxshard plan`` states.

A tiny Qwen3-MoE (``tests/models/hf_qwen3_moe.py``: 2 MoE layers, hidden H = 32, E = 4 experts, top-2) trains 2
steps at ``--ep N`` through ``fxshard.train.launch.train`` (the code ``fxshard run`` runs) on gloo.  Two records
are taken on every rank, independently:

- **measured**: the bytes each all-to-all sends to *other* ranks, counted where the traffic table counts the
  other axes (:class:`benchmarks.comm.CollectiveCounter`, at the dispatcher), from the call's own split sizes:
  the rows a rank keeps for its own experts never cross the network;
- **routing**: the model's own cumulative rows per expert (the ``offsets`` each ``rt.exchange_counts`` call gets,
  before any exchange), in call order.

The exact figure is computed here from the routing of every rank of the ep group: rank r sends, per exchange, the
rows it routes to experts held elsewhere (dispatch) and, back, the rows the other ranks routed to its experts
(combine), each ``H`` fp32 values; backward sends the same rows' gradients the other way; the counts all-to-all
sends (N−1)/N of E int32.  Measured ÷ exact must be 1 on every rank.  The balanced figure assumes uniform routing:
``L · (4 · b·S·k · H · 4 + 4E) · (N−1)/N`` bytes per microbatch, what ``fxshard plan`` states (``ep_alltoall``);
real routing is not uniform, so measured ÷ balanced is not 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.comm import CollectiveCounter
from benchmarks.common import markdown_table, spawn

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "hf_qwen3_moe.py"
STEPS = 2
LAYOUTS = ((2, 2), (4, 4))  # (dp, ep)


class ExchangeCounter(CollectiveCounter):
    """:class:`CollectiveCounter`, and for each all-to-all the bytes it sends to other ranks (``leaving``, by
    its input split sizes; an empty list is an even split), while ``rt.exchange_counts`` records the routing."""

    def __init__(self):
        super().__init__()
        self.leaving = {"calls": 0, "bytes": 0}
        self.routing: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "c10d" and func._overloadpacket.__name__ == "alltoall_base_":
            _, x, group, _, send = args[:5]
            group = dist.ProcessGroup.unbox(group)  # the dispatcher holds it as a ScriptObject
            row = x.element_size() * (x[0].numel() if x.dim() and x.shape[0] else 0)
            send = list(send) or [x.shape[0] // group.size()] * group.size()
            self.leaving["calls"] += 1
            self.leaving["bytes"] += row * (sum(send) - send[group.rank()])
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __enter__(self):
        import fxshard.runtime as rt

        self._rt, self._exchange = rt, rt.exchange_counts

        def recorded(offsets, group):
            self.routing.append([int(v) for v in offsets.detach().to(torch.int64)])
            return self._exchange(offsets, group)

        rt.exchange_counts = recorded
        return super().__enter__()

    def __exit__(self, *exc):
        self._rt.exchange_counts = self._exchange
        return super().__exit__(*exc)


def _worker(rank: int, world: int, out: str) -> dict:
    from fxshard.train.launch import train
    from fxshard.train.options import RunOptions

    counter = ExchangeCounter()
    with counter:
        train(Path(out), RunOptions(STEPS), log=lambda *_: None)
    kinds = {k: v for phase in counter.counts.values() for k, v in phase.items()}
    return {"rank": rank, "leaving": counter.leaving, "routing": counter.routing,
            "all_to_all_input_bytes": kinds.get("all_to_all", {}).get("bytes", 0)}


def exact_bytes(routing: list[list[list[int]]], me: int, hidden_bytes: int, count_bytes: int = 4) -> int:
    """Bytes rank ``me`` of an ep group sends to the others over all the exchanges recorded, from every rank's
    routing (``routing[r][i]``: rank r's cumulative rows per expert at its i-th exchange): per exchange the rows it
    routes to other ranks' experts and the rows they routed to its experts, each twice (forward, and their
    gradients backward), ``hidden_bytes`` each; and (N−1)/N of the E counts."""
    ep = len(routing)
    total = 0
    for i in range(len(routing[me])):
        rows = [torch.diff(torch.tensor(r[i]), prepend=torch.zeros(1, dtype=torch.int64)) for r in routing]
        mine = rows[0].numel() // ep
        owner = torch.arange(rows[0].numel()) // mine  # the ep rank holding each expert
        out = int(rows[me][owner != me].sum())  # dispatch: my rows for experts elsewhere
        back = sum(int(rows[s][owner == me].sum()) for s in range(ep) if s != me)  # combine: theirs, back
        total += 2 * (out + back) * hidden_bytes + (ep - 1) * mine * count_bytes
    return total


def run(workdir: Path, layouts=LAYOUTS, log=print) -> dict:
    from fxshard.capture.modelfile import load_model_file
    from fxshard.cost.costs import plan_costs
    from fxshard.driver import compile as compile_model
    from fxshard.ir.context import Layout

    config = load_model_file(MODEL).build_model(0).config
    hidden_bytes = config.hidden_size * 4  # fp32 rows
    rows = []
    for dp, ep in layouts:
        layout = Layout(dp=dp, ep=ep)
        name = f"dp={dp} ep={ep}"
        out = workdir / f"experts-dp{dp}-ep{ep}"
        compile_model(MODEL, layout, out=out)
        log(f"traffic: {name}")
        per_rank = spawn(_worker, layout.world_size, str(out))
        stated = plan_costs(MODEL, layout).ranks[0]["ep_alltoall"]
        ranks = []
        for r in per_rank:
            group = [p for p in per_rank if p["rank"] // ep == r["rank"] // ep]  # r's ep group, in ep order
            exact = exact_bytes([p["routing"] for p in group], r["rank"] % ep, hidden_bytes)
            ranks.append({"rank": r["rank"], "calls": r["leaving"]["calls"] / STEPS,
                          "measured_bytes": r["leaving"]["bytes"] / STEPS, "exact_bytes": exact / STEPS,
                          "input_bytes": r["all_to_all_input_bytes"] / STEPS})
        rows.append({"layout": name, "ranks": ranks, "balanced_bytes": stated.value,
                     "balanced_expr": str(stated.expr)})
    return {"model": str(MODEL.relative_to(ROOT)), "steps": STEPS, "rows": rows}


def markdown(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        first = r["ranks"][0]
        ratios = [x["measured_bytes"] / x["exact_bytes"] for x in r["ranks"]]
        rows.append([r["layout"], f"{first['calls']:.0f} all_to_all", f"{first['measured_bytes'] / 1e3:.3f}",
                     f"{first['exact_bytes'] / 1e3:.3f}", f"**{ratios[0]:.3f}**",
                     f"{min(ratios):.3f}–{max(ratios):.3f}",
                     f"`{r['balanced_expr']}` = {r['balanced_bytes'] / 1e3:.3f}",
                     f"{first['measured_bytes'] / r['balanced_bytes']:.3f}"])
    head = (f"{result['model']}, per training step (mean of {result['steps']}), rank 0 unless said: bytes the "
            "all-to-alls send to other ranks (the rows for a rank's own experts stay), counted at the dispatcher "
            "from each call's split sizes; exact = the bytes the exchange must send given the run's routing counts "
            "(every rank's, recorded before the exchange); balanced = `fxshard plan`'s figure under uniform routing.")
    return head + "\n\n" + markdown_table(["layout", "collectives per step", "measured kB", "exact kB",
                                           "measured ÷ exact", "÷ exact, every rank", "balanced (plan) kB",
                                           "measured ÷ balanced"], rows)


def traffic_markdown(traffic: dict) -> str:
    """The table of the traffic part's ``experts`` result (``benchmarks.run``; a result from before it: a line)."""
    return markdown(traffic["experts"]) if "experts" in traffic else "not measured in this run"
