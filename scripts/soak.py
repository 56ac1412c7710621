"""The soak test (issue 32, item 15): train, kill a rank with ``kill -9`` at random moments, resume, repeat; then
check the end state against a run that was never interrupted.

    python scripts/soak.py                                   # `make soak`: 2,000 steps, 10 kills, a save every 50
    python scripts/soak.py --steps 200 --kills 3 --save-every 20 --work out/soak-short   # the short version

It compiles MODEL (samples/gpt.py) at tp=2·dp=2, trains it ``--steps`` steps in one uninterrupted ``fxshard run``
(the reference), then again in a second checkpoint folder while, ``--kills`` times, it sends SIGKILL to one rank
process (a random rank, by pid: a child of the ``fxshard run`` it started whose environment says ``RANK``) once the
run has trained a randomly drawn step and a random part of a step more, waits for the launcher to end, and starts
``fxshard run --resume``.  Every draw comes from ``--seed``, before anything runs, so a run can be repeated (the
moments within a step depend on the machine's load).  At the end it checks, and exits 1 unless all hold:

- the final checkpoints are equal bit for bit: every parameter, its Adam state (``exp_avg``, ``exp_avg_sq``,
  ``step``) and the index's trainer state (batches, learning-rate schedule, data position);
- every step the soak trained, including the steps it trained again after a kill, has the reference's loss bit for bit;
- every checkpoint kept (both folders, every ``step-<N>``) proves its content: each tensor read back has the digest
  its save recorded (each resume already read its step through the same check: a damaged save would have stopped it);
- no orphan: every process seen under the driver (it is the children's subreaper, so an orphan becomes its child
  and stays visible) has ended;
- no stray file: the checkpoint folder holds only ``step-<N>`` folders (each with its index, model file and shards),
  ``latest`` and ``.lock``; the compiled folder gained nothing in the soak; the runs' own ``TMPDIR`` holds nothing
  but torch's per-user compile cache (``torchinductor_<user>``, which torch keeps by design);
- host memory does not grow: each rank's RSS (``/proc/PID/status`` VmRSS, sampled every second), from its first
  sample after its first save to its last, grows by at most ``--rss-growth`` in every segment that trained at least
  two saves' worth of steps (shorter segments are listed, not judged).

It prints a Markdown summary (each kill: the rank, the step, whether the save of the last step trained was lost, the
step resumed from, the steps lost, the seconds down; wall times; RSS first and last per rank and segment; what the
checksums cost: hashing one rank's shard, as each save does, and reading it back with and without the check, as each
resume does), writes it to ``--results`` when given, and the figures as JSON to ``WORK/soak.json``
(tests/scripts/test_soak.py reads them).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_DIR = re.compile(r"step-\d{8}")
STEP_FILE = re.compile(r"index\.json|model\.py|shard-[\w-]+\.safetensors")
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Kill:
    target: int  # the step after which the kill is due
    fraction: float  # and this part of a step's time later
    rank: int
    pid: int = 0
    after_step: int = 0  # the last step the run had trained when the signal went
    last_trained: int = 0  # the last step it finished (its metrics line written) before the launcher ended
    during_save: bool = False  # the save of last_trained did not complete (the kill came before or during it)
    resumed_from: int = 0
    steps_lost: int = 0
    down_s: float = 0.0  # from the signal to the launcher's exit
    launcher_rc: int | None = None


@dataclass
class Segment:
    name: str
    first_step: int = 0
    last_step: int = 0
    wall_s: float = 0.0
    rss_kib: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # rank -> [(step, VmRSS kB)]

    def rss(self, save_every: int) -> dict[int, tuple[int, int]]:
        """Per rank: the first sample after the segment's first save (its first if it saved none) and the last."""
        out = {}
        for rank, samples in sorted(self.rss_kib.items()):
            warm = [s for s in samples if s[0] > self.first_step - 1 + save_every] or samples
            out[rank] = (warm[0][1], samples[-1][1])
        return out


# ---- processes -----------------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every process under ``root``."""
    children: dict[int, list[int]] = {}
    starts = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))):
            children.setdefault(st[0], []).append(int(entry))
            starts[int(entry)] = st[2]
    found, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found[pid] = starts[pid]
            todo.append(pid)
    return found


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"


def _reap() -> None:
    """Collect the exit status of our ended children (the launchers, once waited for, and adopted orphans)."""
    for pid in _descendants(os.getpid()):
        st = _stat(pid)
        if st and st[0] == os.getpid() and st[1] == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


# ---- one run ---------------------------------------------------------------------------------------------------


class Soak:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work).resolve()
        self.out, self.tmp = self.work / "compiled", self.work / "tmp"
        self.seen: dict[int, int] = {}  # every process ever seen under the driver: pid -> start time
        self.env = os.environ | {"TMPDIR": str(self.tmp)}
        rng = random.Random(args.seed)
        targets = sorted(rng.sample(range(args.save_every + 1, args.steps - 2), args.kills))
        self.kills = [Kill(t, rng.random(), rng.randrange(args.world)) for t in targets]

    def fxshard(self, *argv, log: Path) -> subprocess.Popen:
        with open(log, "a") as f:
            return subprocess.Popen([sys.executable, "-m", "fxshard.cli.app", *map(str, argv)], cwd=ROOT,
                                    env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def run_options(self, ckpt: Path, metrics: Path) -> list:
        a = self.args
        return ["run", self.out, "--steps", a.steps, "--checkpoint", ckpt, "--save-every", a.save_every,
                "--keep-last", a.keep_last, "--metrics", metrics] + (["--no-check"] if a.no_check else [])

    def segment(self, name: str, argv: list, metrics: Path, kill: Kill | None) -> tuple[Segment, int]:
        """Run one ``fxshard run`` to its end, or until ``kill`` is done and the launcher has ended."""
        seg, t0, tail = Segment(name), time.monotonic(), _Tail(metrics)
        proc = self.fxshard(*argv, log=self.work / f"{name}.log")
        ranks: dict[int, int] = {}  # pid -> rank
        last_sample = due = killed_at = 0.0
        try:
            while proc.poll() is None:
                steps = tail.read()
                for pid, start in _descendants(os.getpid()).items():
                    self.seen.setdefault(pid, start)
                    if (pid not in ranks and _stat(pid) and _stat(pid)[0] == proc.pid
                            and (r := _rank_of(pid)) is not None):
                        ranks[pid] = r
                if steps and not seg.first_step:
                    seg.first_step = steps[0][0]
                seg.last_step = steps[-1][0] if steps else seg.last_step
                if steps and time.monotonic() - last_sample >= 1.0:
                    last_sample = time.monotonic()
                    for pid, rank in ranks.items():
                        if (kib := _rss_kib(pid)) is not None:
                            seg.rss_kib.setdefault(rank, []).append((seg.last_step, kib))
                if kill and not kill.pid and steps and steps[-1][0] >= kill.target:
                    step_s = sum(s for _, _, s in steps) / len(steps)
                    due = due or time.monotonic() + kill.fraction * step_s
                    if time.monotonic() >= due:
                        killed_at = self._kill(kill, ranks, seg.last_step)
                time.sleep(0.2)
            if kill and kill.pid:
                kill.down_s, kill.launcher_rc = round(time.monotonic() - killed_at, 1), proc.returncode
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
            raise
        steps = tail.read()
        seg.last_step = steps[-1][0] if steps else seg.last_step
        seg.wall_s = round(time.monotonic() - t0, 1)
        self._settle()
        return seg, proc.returncode

    def _kill(self, kill: Kill, ranks: dict[int, int], step: int) -> float:
        """SIGKILL to ``kill.rank``'s process; the moment it went."""
        pid = [p for p, r in ranks.items() if r == kill.rank][0]
        os.kill(pid, signal.SIGKILL)
        at = time.monotonic()
        kill.pid, kill.after_step = pid, step
        return at

    def _settle(self, wait_s: float = 60.0) -> None:
        """Wait (up to ``wait_s``) for every process seen so far to end, reaping those adopted; a straggler left
        after that is an orphan, which the final check names."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _reap()
            if not any(_alive(p, s) for p, s in self.seen.items()):
                return
            time.sleep(0.2)

    # ---- the whole soak ----------------------------------------------------------------------------------------

    def run(self) -> dict:
        a, t_start = self.args, time.monotonic()
        if self.work.exists():
            shutil.rmtree(self.work)
        self.tmp.mkdir(parents=True)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        compile_log = self.work / "compile.log"
        proc = self.fxshard("compile", ROOT / a.model, "--tp", a.tp, "--dp", a.dp, "--out", self.out, log=compile_log)
        if proc.wait() != 0:
            raise SystemExit(f"compile failed: see {compile_log}")
        ref_ckpt, ref_metrics = self.work / "ref-ckpt", self.work / "ref.jsonl"
        ref, rc = self.segment("reference", self.run_options(ref_ckpt, ref_metrics), ref_metrics, None)
        if rc != 0:
            raise SystemExit(f"the reference run failed: see {self.work / 'reference.log'}")
        compiled_before = sorted(p.name for p in self.out.iterdir())
        self.soak_ckpt, metrics = self.work / "soak-ckpt", self.work / "soak.jsonl"
        segments, t_soak = [], time.monotonic()
        for i in range(a.kills + 1):
            kill = self.kills[i] if i < a.kills else None
            argv = self.run_options(self.soak_ckpt, metrics) + (["--resume"] if i else [])
            seg, rc = self.segment(f"soak-{i}", argv, metrics, kill)
            segments.append(seg)
            if kill is None and rc != 0:
                raise SystemExit(f"the last soak segment failed: see {self.work / seg.name}.log")
            if kill is not None:
                if not kill.pid:
                    raise SystemExit(f"{seg.name} ended (exit {rc}) before its kill at step {kill.target}")
                kill.resumed_from, kill.last_trained = _latest(self.soak_ckpt), seg.last_step
                kill.steps_lost = kill.last_trained - kill.resumed_from
                kill.during_save = kill.last_trained % a.save_every == 0 and kill.resumed_from < kill.last_trained
        soak_s = time.monotonic() - t_soak
        return self.report(ref, segments, ref_ckpt, ref_metrics, metrics, compiled_before, soak_s,
                           time.monotonic() - t_start)

    def report(self, ref, segments, ref_ckpt, ref_metrics, metrics, compiled_before, soak_s, total_s) -> dict:
        a = self.args
        differ, compared = compare_checkpoints(ref_ckpt, self.soak_ckpt)
        verified, damaged = verify_steps(ref_ckpt)
        more, damaged_soak = verify_steps(self.soak_ckpt)
        verified, damaged = verified + more, damaged + damaged_soak
        ref_loss = {s: loss for s, loss, _ in _Tail(ref_metrics, 0).read()}
        trained = _Tail(metrics, 0).read()
        loss_differ = [s for s, loss, _ in trained if ref_loss.get(s) != loss]
        _reap()
        orphans = sorted(p for p, s in self.seen.items() if _alive(p, s))
        stray = stray_files(self.soak_ckpt) + stray_files(ref_ckpt)
        stray += [f"{self.out}/{n}" for n in sorted(p.name for p in self.out.iterdir()) if n not in compiled_before]
        stray += [str(p) for p in self.tmp.iterdir() if not p.name.startswith("torchinductor_")]
        rss = {s.name: {r: v for r, v in s.rss(a.save_every).items()} for s in [ref, *segments]}
        judged = [s for s in [ref, *segments] if s.last_step - s.first_step + 1 >= 2 * a.save_every]
        growth = {s.name: max((last - first) / first for first, last in s.rss(a.save_every).values())
                  for s in judged if s.rss_kib}
        return {
            "steps": a.steps, "kills": [asdict(k) for k in self.kills], "save_every": a.save_every,
            "keep_last": a.keep_last, "seed": a.seed, "model": a.model, "tp": a.tp, "dp": a.dp,
            "resumes": len(segments) - 1, "steps_trained": len(trained),
            "identical": not differ, "tensors_compared": compared, "differ": differ[:20],
            "losses_compared": len(trained), "loss_differ": loss_differ[:20],
            "tensors_verified": verified, "damaged": damaged[:20], "checksum_cost": checksum_cost(self.soak_ckpt),
            "orphans": orphans, "processes_seen": len(self.seen), "stray": stray,
            "rss_kib": rss, "rss_growth": growth, "rss_ok": all(g <= a.rss_growth for g in growth.values()),
            "wall_s": {"reference": ref.wall_s, "soak": round(soak_s, 1), "total": round(total_s, 1),
                       "segments": {s.name: s.wall_s for s in segments}},
            "segments": {s.name: [s.first_step, s.last_step] for s in [ref, *segments]},
            "work": str(self.work),
        }


class _Tail:
    """(step, loss, seconds) of the whole lines a metrics file gains after byte ``offset`` (default: its present
    end), read a piece at a time."""

    def __init__(self, path: Path, offset: int | None = None):
        self.path, self.steps, self.partial = path, [], b""
        self.offset = offset if offset is not None else (path.stat().st_size if path.exists() else 0)

    def read(self) -> list[tuple[int, float, float]]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = self.partial + f.read()
            self.offset += len(data) - len(self.partial)
            *lines, self.partial = data.split(b"\n")  # the last piece is empty or a line being written
            for x in map(json.loads, lines):
                if "loss" in x:
                    self.steps.append((int(x["step"]), x["loss"], x.get("seconds", 0.0)))
        return self.steps


def _latest(ckpt: Path) -> int:
    try:
        return int((ckpt / "latest").read_text().strip().removeprefix("step-"))
    except FileNotFoundError:
        return 0


def compare_checkpoints(a: Path, b: Path) -> tuple[list[str], int]:
    """The names of the tensors (and ``trainer``, ``step``) whose bytes differ between two checkpoints, and how many
    were compared: each parameter and its Adam state."""
    from fxshard.train.checkpoint import CheckpointReader

    ra, rb = CheckpointReader(a), CheckpointReader(b)
    differ = [k for k in ("step", "trainer") if ra.index.get(k) != rb.index.get(k)]
    if set(ra.sources) != set(rb.sources):
        return differ + sorted(set(ra.sources) ^ set(rb.sources)), 0
    compared = 0
    for fqn in sorted(ra.sources):
        kinds = ["param"] + (["exp_avg", "exp_avg_sq", "step"] if ra.has_state(fqn) else [])
        for kind in kinds:
            x, y = ra.tensor(fqn, kind), rb.tensor(fqn, kind)
            compared += 1
            if x.dtype != y.dtype or x.shape != y.shape or not _same_bytes(x, y):
                differ.append(f"{fqn} {kind}")
    return differ, compared


def verify_steps(ckpt: Path) -> tuple[int, list[str]]:
    """Read every tensor of every kept step of ``ckpt`` through the digest check; (tensors verified, what failed)."""
    from fxshard.errors import FxshardError
    from fxshard.train.checkpoint import CheckpointReader

    verified, damaged = 0, []
    for step in sorted(p for p in ckpt.iterdir() if STEP_DIR.fullmatch(p.name)):
        try:
            reader = CheckpointReader(step)
            for fqn in sorted(reader.sources):
                for kind in ["param"] + (["exp_avg", "exp_avg_sq", "step"] if reader.has_state(fqn) else []):
                    reader.tensor(fqn, kind)
                    verified += 1
        except FxshardError as e:
            damaged.append(f"{step.name}: {e}")
    return verified, damaged


def checksum_cost(ckpt: Path) -> dict:
    """What the checksums cost on the latest step's largest shard (one rank's part of a save): hashing its tensors
    (the save's extra work on that rank) and reading them back with the check and without (a resume's)."""
    from safetensors import safe_open

    from fxshard.train.checkpoint import find_checkpoint
    from fxshard.train.digests import check_tensor, digests_of, tensor_digests

    step = find_checkpoint(ckpt)
    shard = max(step.glob("shard-*.safetensors"), key=lambda p: p.stat().st_size)

    def read(checked: bool) -> dict:
        with safe_open(str(shard), framework="pt") as f:
            digests = digests_of(f.metadata(), str(shard))
            return {k: check_tensor(f.get_tensor(k).clone(), digests[k], str(shard), k) if checked else
                    f.get_tensor(k).clone() for k in f.keys()}

    def seconds(fn, rounds=5):
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)  # the least disturbed by the machine's other work

    tensors = read(False)
    return {"shard": shard.name, "bytes": shard.stat().st_size, "tensors": len(tensors),
            "hash_s": seconds(lambda: tensor_digests(tensors)), "read_s": seconds(lambda: read(False)),
            "read_checked_s": seconds(lambda: read(True))}


def _same_bytes(x, y) -> bool:
    return bool((x.contiguous().reshape(-1).view(dtype=_u8()) == y.contiguous().reshape(-1).view(dtype=_u8())).all())


def _u8():
    import torch

    return torch.uint8


def stray_files(ckpt: Path) -> list[str]:
    """What a checkpoint folder holds beyond ``latest``, ``.lock`` and complete ``step-<N>`` folders."""
    stray = []
    for p in sorted(ckpt.iterdir()):
        if p.name in ("latest", ".lock"):
            continue
        if not (STEP_DIR.fullmatch(p.name) and p.is_dir()):
            stray.append(str(p))
            continue
        stray += [str(f) for f in sorted(p.iterdir()) if not STEP_FILE.fullmatch(f.name)]
        if not (p / "index.json").is_file():
            stray.append(f"{p} (no index.json)")
    return stray


# ---- the summary -----------------------------------------------------------------------------------------------


def verdicts(r: dict) -> list[tuple[str, bool, str]]:
    growth = ", ".join(f"{k} {v:+.1%}" for k, v in r["rss_growth"].items()) or "no segment long enough to judge"
    return [
        ("final parameters and Adam state equal the uninterrupted run's, bit for bit", r["identical"],
         f"{r['tensors_compared']} tensors compared" + (f"; differ: {', '.join(r['differ'])}" if r["differ"] else "")),
        ("every step trained (again after a kill too) has the uninterrupted run's loss, bit for bit",
         not r["loss_differ"], f"{r['losses_compared']} steps" + (f"; differ at {r['loss_differ']}" if r["loss_differ"]
                                                                   else "")),
        ("every checkpoint kept proves its content: each tensor has the digest its save recorded", not r["damaged"],
         f"{r['tensors_verified']} tensors verified" + (f"; damaged: {'; '.join(r['damaged'])}" if r["damaged"]
                                                         else "")),
        ("no orphan process", not r["orphans"], f"{r['processes_seen']} processes seen"
         + (f"; alive: {r['orphans']}" if r["orphans"] else "")),
        ("no stray file", not r["stray"], "; ".join(r["stray"]) or "checkpoint folders, compiled folder, TMPDIR"),
        (f"host memory does not grow (each rank's RSS, after its first save to the end, by at most "
         f"{r['rss_growth_limit']:.0%})", r["rss_ok"], growth),
    ]


def _checksum_line(c: dict) -> str:
    return (f"Checksums (XXH3-128 of every tensor, checked on every read): one rank's shard ({c['shard']}, "
            f"{c['bytes'] / 2**20:.1f} MiB, {c['tensors']} tensors) hashes in {c['hash_s'] * 1e3:.1f} ms, each save's "
            f"extra work on that rank; reading it back takes {c['read_s'] * 1e3:.1f} ms unchecked and "
            f"{c['read_checked_s'] * 1e3:.1f} ms checked, a resume's extra "
            f"{(c['read_checked_s'] - c['read_s']) * 1e3:.1f} ms (best of 5).")


def summary(r: dict) -> str:
    kills = r["kills"]
    lines = [
        "# Soak: `kill -9` a rank at random moments, resume, compare with an uninterrupted run",
        "",
        f"`{r['command']}` on {r['machine']}: {r['model']} at tp={r['tp']}·dp={r['dp']}, {r['steps']} steps, "
        f"a checkpoint "
        f"every {r['save_every']} (`--keep-last {r['keep_last']}`), {len(kills)} kills, seed {r['seed']}. "
        "The script and what it checks: `scripts/soak.py` ([trust](../../docs/trust.md#soak)).",
        "",
        "| check | result | |", "| --- | --- | --- |",
        *[f"| {name} | {'OK' if ok else 'FAILED'} | {detail} |" for name, ok, detail in verdicts(r)],
        "",
        f"Wall time: reference (uninterrupted) {r['wall_s']['reference']} s, soak {r['wall_s']['soak']} s "
        f"({r['resumes']} resumes, {r['steps_trained']} steps trained for {r['steps']}), all "
        f"{r['wall_s']['total']} s with the compile.",
        "",
        _checksum_line(r["checksum_cost"]),
        "",
        "Each kill: the step the run had trained when the signal went, the last step it finished, whether that step's "
        "save was lost with it, the step resumed from, the steps trained again, and the seconds from the signal to the "
        "launcher's exit.",
        "",
        "| kill | rank (pid) | at step | last step | its save lost | resumed from | steps lost "
        "| launcher ended after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {i + 1} | {k['rank']} ({k['pid']}) | {k['after_step']} | {k['last_trained']} | "
          f"{'yes' if k['during_save'] else 'no'} | {k['resumed_from']} | {k['steps_lost']} | {k['down_s']} s "
          f"(exit {k['launcher_rc']}) |" for i, k in enumerate(kills)],
        f"| all | | | | | | {sum(k['steps_lost'] for k in kills)} | |",
        "",
        "Each rank's RSS (MiB, `/proc/PID/status` VmRSS), first after the segment's first save and last:",
        "",
        "| segment | steps | " + " | ".join(f"rank {i}" for i in range(r["tp"] * r["dp"])) + " |",
        "| --- | --- | " + " | ".join("---" for _ in range(r["tp"] * r["dp"])) + " |",
    ]
    for name, ranks in r["rss_kib"].items():
        first, last = r["segments"][name]
        cells = [f"{a / 1024:.0f} → {b / 1024:.0f}" for a, b in (ranks.get(i, ranks.get(str(i), (0, 0)))
                                                                  for i in range(r["tp"] * r["dp"]))]
        lines.append(f"| {name} | {first}–{last} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="samples/gpt.py", help="model file, relative to the repository")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="draws the kills' steps, moments and ranks")
    p.add_argument("--rss-growth", type=float, default=0.10, help="the RSS growth allowed within a segment")
    p.add_argument("--no-check", action="store_true", help="pass --no-check to every run (skips the static checks "
                   "before each launch: the short version's time)")
    p.add_argument("--work", default="out/soak", help="folder for the compile, checkpoints, logs (emptied first)")
    p.add_argument("--results", help="also write the Markdown summary here (benchmarks/results/soak-cpu.md)")
    a = p.parse_args(argv)
    a.world = a.tp * a.dp
    if a.kills < 0 or a.save_every < 1 or a.steps - 3 - a.save_every < a.kills:
        p.error(f"--kills {a.kills} distinct kill steps do not fit between the first save ({a.save_every}) and "
                f"step {a.steps - 3}: raise --steps or lower --kills / --save-every")
    r = Soak(a).run()
    r["rss_growth_limit"] = a.rss_growth
    r["command"] = "python scripts/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    r["machine"] = f"{os.cpu_count()} CPUs ({platform.machine()}), load average {os.getloadavg()[0]:.1f} at the end"
    text = summary(r)
    Path(r["work"], "soak.json").write_text(json.dumps(r, indent=1))
    if a.results:
        Path(a.results).write_text(text)
    print(text)
    return 0 if all(ok for _, ok, _ in verdicts(r)) else 1


if __name__ == "__main__":
    sys.exit(main())
