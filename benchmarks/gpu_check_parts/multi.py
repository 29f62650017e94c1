"""The multi-GPU cases, run two at a time on disjoint GPUs.

Each case is a layout of a small LLaMA (eight blocks, so pp=4 can interleave two chunks per
rank) trained ``MULTI_STEPS`` steps in FP32 through potluck's runtime, its losses within
``MULTI_LOSS_TOLERANCE`` of one GPU's at every step: FP32 (TF32 off) so that a race, a
missed wait or a wrong reduction shows, which bf16's rounding (2e-2) would hide. A case
runs in its own process (this script with ``--case KEY --gpus N,M``) that sees only its
GPUs (``CUDA_VISIBLE_DEVICES``, the plan naming them by nvidia-smi's numbers), with NCCL's
flight recorder on (:func:`flight_recorder_env`: each rank's last collectives dumped to
the case's directory when one times out) and a ``CASE_TIMEOUT_S`` limit after which its
process group is killed. :func:`pair_rounds` packs the cases, in order, two at a time onto
disjoint GPUs; a case that needs more GPUs than are visible is skipped with the reason.

The killed-rank case kills rank 1 with SIGKILL in the middle of a step's forward pass
(``POTLUCK_SILENCE_S`` set to ``KILL_SILENCE_S``); the launcher must stop the run with an
error naming that rank and its GPU within the silence limit plus ``KILL_MARGIN_S``
(:mod:`potluck.runtime.launch.watchdog`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpu_check_parts.common import REPO, SCRIPT, Outcome, gpus_cluster, run_on_gpus, small_llama
from gpu_check_parts.memory_contract import peak_rows, rows_outcome

MULTI_GPUS = 2  # the part runs where torch.cuda.device_count() reaches this
MULTI_STEPS = 4
MULTI_LR = 3e-3
MULTI_DTYPE = "fp32"
MULTI_LOSS_TOLERANCE = 1e-4  # per step, absolute: FP32 summed in other orders
MULTI_GLOBAL_BATCH = 8
MULTI_SEQ_LEN = 64
MULTI_MICRO_BATCH = 2
CASE_TIMEOUT_S = 60.0  # one case, process start and NCCL set-up included
CASE_ESTIMATE_S = 25.0  # a round's expected duration
AT_ONCE = 2  # cases running side by side
FLIGHT_RECORDER_ENTRIES = 2000
KILL_SILENCE_S = 15.0
KILL_MARGIN_S = 10.0
KILL_STEP = 2
KILL_VICTIM = 1


@dataclass(frozen=True)
class MultiCase:
    """One layout and what it exercises; ``key`` names it on the command line."""

    name: str
    key: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    split_channels: bool = False
    priority: bool = False
    tp_overlap: int = 1  # sub-batches per micro-batch on TP stages (StageComm)
    ep: int = 1
    moe: bool = False
    stage_tps: tuple[int, ...] = ()  # a mixed-TP pipeline: each stage's TP degree
    peer_swap: bool = False  # stage 0 stashes its activations on stage 1's GPU
    kill: bool = False
    memory_check: bool = False
    reference: str | None = "reference"  # the case whose losses it must match

    @property
    def gpus(self) -> int:
        return (sum(self.stage_tps) if self.stage_tps else self.tp * self.pp) * self.dp


REFERENCE_CASE = MultiCase("one GPU (the reference)", "reference", reference=None)
MOE_REFERENCE_CASE = MultiCase("tiny MoE on one GPU (EP's reference)", "moe-reference", moe=True,
                               reference=None)
MULTI_CASES = (
    MultiCase("pp=2: NCCL sends between pipeline stages", "pp2", pp=2),
    MultiCase("dp=2: gradient buckets all-reduced over NCCL", "dp2", dp=2),
    MultiCase("dp=2 ZeRO-1: gradients reduce-scattered, updates all-gathered", "zero1", dp=2,
              zero=1),
    MultiCase("dp=2 ZeRO-2: gradients reduce-scattered per bucket", "zero2", dp=2, zero=2),
    MultiCase("tp=2: a tensor-parallel mesh", "tp2", tp=2),
    MultiCase("tp=2 with TP overlap (2 sub-batches)", "tp2-overlap", tp=2, tp_overlap=2),
    MultiCase("ep=2: a tiny MoE's experts split over 2 GPUs", "ep2", dp=2, ep=2, moe=True,
              reference="moe-reference"),
    MultiCase("pp=2 peer swap: stage 0 stashes on stage 1's GPU", "peer-swap", pp=2,
              peer_swap=True),
    MultiCase("dp=2 ZeRO-1 under the priority schedule", "priority", dp=2, zero=1, priority=True),
    MultiCase("a rank killed mid-step is named in time", "kill", dp=2, kill=True, reference=None),
    MultiCase("mixed-TP pipeline: stage tp=2 then tp=1", "mixed-tp", pp=2, stage_tps=(2, 1)),
    MultiCase("pp=4 1F1B, split channels", "pp4-1f1b", pp=4, split_channels=True),
    MultiCase("pp=4 interleaved, split channels", "pp4-interleaved", pp=4,
              schedule="interleaved", split_channels=True),
    MultiCase("pp=4 zero bubble, split channels", "pp4-zb", pp=4, schedule="zb",
              split_channels=True),
    MultiCase("dp=2 x tp=2 ZeRO-3, memory against prediction", "zero3", dp=2, tp=2, zero=3,
              memory_check=True),
)
ALL_CASES = (REFERENCE_CASE, MOE_REFERENCE_CASE, *MULTI_CASES)
RESUME_CASE = MultiCase("checkpoint on 2 GPUs, resume where 1 is visible", "resume", dp=2)


def case_by_key(key: str) -> MultiCase:
    found = [c for c in (*ALL_CASES, RESUME_CASE) if c.key == key]
    if not found:
        raise KeyError(f"no multi-GPU case {key!r}; known: {', '.join(c.key for c in ALL_CASES)}")
    return found[0]


# ---- the plans --------------------------------------------------------------------------


def multi_model():
    """The small LLaMA with eight blocks (pp=4 interleaves two chunks per rank)."""
    return replace(small_llama(), name="llama-256x8", num_layers=8)


def moe_model():
    """A tiny Mixtral (four experts, top-2), made from its config (no downloads)."""
    from potluck.model import byte_vocab
    from potluck.model.loading import model_from_hf_config

    return model_from_hf_config(dict(
        model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, hidden_size=128,
        intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=byte_vocab.VOCAB_SIZE, max_position_embeddings=256),
        "tiny-mixtral")


def multi_plan(device: str, case: MultiCase, gpus: Sequence[int] = ()):
    """``case``'s layout on ``case.gpus`` GPUs of this type: GPUs ``gpus`` of this machine
    (nvidia-smi's numbers; default its first ones)."""
    from potluck import api
    from potluck.planner.evaluate import predict

    pipeline_tp = 1 if case.stage_tps else case.tp
    pinned = case.dp * pipeline_tp * case.pp
    plan = api.plan(gpus_cluster(device, case.gpus), moe_model() if case.moe else multi_model(),
                    global_batch=MULTI_GLOBAL_BATCH, seq_len=MULTI_SEQ_LEN, dtype=MULTI_DTYPE,
                    tp=pipeline_tp, pp=case.pp, dp=case.dp, micro_batch_size=MULTI_MICRO_BATCH,
                    recompute="none", zero=case.zero, schedule=case.schedule,
                    ep=case.ep if case.moe else None).best
    assert pinned == plan.num_gpus or case.stage_tps, (case.key, plan.layout())
    plan = _with_options(plan, case)
    ids = [f"gpu.0:{n}" for n in (gpus or range(case.gpus))]
    plan = _on_gpus(plan, device, ids, case.stage_tps)
    return replace(plan, prediction=predict(replace(plan, prediction=None)))


def _with_options(plan, case: MultiCase):
    from potluck.plans import CommSchedule, StageComm
    from potluck.plans.memory import StageMemory, Swap

    plan = replace(plan, comm=CommSchedule(split_p2p_channels=case.split_channels,
                                           dp_priority_schedule=case.priority))
    if case.tp_overlap > 1:
        plan = _stages(plan, lambda k, j, s: replace(s, comm=StageComm(case.tp_overlap)))
    if case.peer_swap:
        peer = plan.pipelines[0].stages[1].devices[0]
        plan = _stages(plan, lambda k, j, s: replace(
            s, memory=StageMemory(swap=Swap.PEER, swap_peer=peer)) if (k, j) == (0, 0) else s)
    return plan


def _stages(plan, change):
    pipelines = tuple(replace(p, stages=tuple(change(k, j, s) for j, s in enumerate(p.stages)))
                      for k, p in enumerate(plan.pipelines))
    return replace(plan, pipelines=pipelines)


def _on_gpus(plan, device: str, ids: Sequence[str], stage_tps: Sequence[int]):
    """``plan``'s stages handed ``ids`` in order (each stage ``stage_tps[j]`` of them where
    given, else as many as it had), on a machine cluster that has every GPU named; a peer
    swap's target follows its stage's device."""
    free = iter(ids)
    renamed: dict[str, str] = {}

    def move(k: int, j: int, stage):
        count = stage_tps[j] if stage_tps else len(stage.devices)
        devices = tuple(next(free) for _ in range(count))
        renamed.update(zip(stage.devices, devices, strict=False))
        return replace(stage, devices=devices)

    plan = _stages(plan, move)
    plan = _stages(plan, lambda k, j, s: replace(s, memory=replace(
        s.memory, swap_peer=renamed[s.memory.swap_peer])) if s.memory.swap_peer else s)
    machine = gpus_cluster(device, 1 + max(int(i.rsplit(":", 1)[1]) for i in ids))
    from potluck.cluster.topology import Cluster

    used = set(plan.devices)
    return replace(plan, cluster=machine,
                   unused_devices=tuple(d.id for d in Cluster(machine).devices if d.id not in used))


# ---- placing cases on GPUs ----------------------------------------------------------------


@dataclass(frozen=True)
class Assigned:
    case: MultiCase
    gpus: tuple[int, ...]  # nvidia-smi's numbers


def available_gpus(visible: str | None, count: int) -> list[int]:
    """The GPU numbers (nvidia-smi's) this process may use: ``CUDA_VISIBLE_DEVICES``'s list
    (as many as CUDA shows), else ``0..count-1``."""
    if visible is None:
        return list(range(count))
    numbers = [int(e) for e in (e.strip() for e in visible.split(",")) if e and int(e) >= 0]
    return numbers[:count]


def pair_rounds(cases: Sequence[MultiCase], gpus: Sequence[int], at_once: int = AT_ONCE
                ) -> tuple[list[list[Assigned]], list[tuple[MultiCase, str]]]:
    """Rounds of at most ``at_once`` cases on disjoint GPUs, cases in order (a later one
    joins a round when the earlier left room), and the cases skipped with why."""
    skipped = [(c, f"skipped: needs {c.gpus} GPUs, {len(gpus)} visible") for c in cases
               if c.gpus > len(gpus)]
    pending = [c for c in cases if c.gpus <= len(gpus)]
    rounds: list[list[Assigned]] = []
    while pending:
        free, placed = list(gpus), []
        for case in list(pending):
            if len(placed) < at_once and case.gpus <= len(free):
                placed.append(Assigned(case, tuple(free[:case.gpus])))
                free = free[case.gpus:]
                pending.remove(case)
        rounds.append(placed)
    return rounds, skipped


def multi_estimate_s(rounds: Sequence[Sequence[Assigned]]) -> float:
    return CASE_ESTIMATE_S * len(rounds)


def flight_recorder_env(dump_dir: Path) -> dict[str, str]:
    """NCCL's flight recorder on (torch's ``ProcessGroupNCCL.hpp``): the last
    ``FLIGHT_RECORDER_ENTRIES`` collectives kept, dumped on a watchdog timeout to
    ``dump_dir/nccl_trace_rank_<rank>``."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(dump_dir / "nccl_trace_rank_")}


def case_env(assigned: Assigned, dump_dir: Path, base: Mapping[str, str]) -> dict[str, str]:
    """A case process's environment: its GPUs only, the flight recorder, the kill case's
    silence limit."""
    env = {**base, "PYTHONPATH": str(REPO / "src"), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, assigned.gpus)),
           **flight_recorder_env(dump_dir)}
    if assigned.case.kill:
        env["POTLUCK_SILENCE_S"] = f"{KILL_SILENCE_S:g}"
    return env


def case_command(device: str, assigned: Assigned, result: Path) -> list[str]:
    return [sys.executable, str(SCRIPT), "--device", device, "--case", assigned.case.key,
            "--gpus", ",".join(map(str, assigned.gpus)), "--result", str(result)]


# ---- the killed rank ----------------------------------------------------------------------


def kill_deadline_s(silence_s: float = KILL_SILENCE_S) -> float:
    """How long after the kill the run may take to stop and name the rank."""
    return silence_s + KILL_MARGIN_S


def killed_rank_verdict(message: str | None, victim: int, device_id: str, killed_at: float | None,
                        stopped_at: float, silence_s: float = KILL_SILENCE_S) -> tuple[bool, str]:
    """Whether the run stopped with an error naming ``rank victim (device_id)`` within
    :func:`kill_deadline_s` of the kill (wall-clock seconds, one machine)."""
    if killed_at is None:
        return False, "the victim never reached the step it was to die in"
    if message is None:
        return False, "the run finished without reporting the killed rank"
    took = stopped_at - killed_at
    named = f"rank {victim} ({device_id})" in message
    shown = f"stopped {took:.1f} s after the kill (at most {kill_deadline_s(silence_s):.0f} s): " \
            f"{message.splitlines()[0][:200]}"
    if not named:
        return False, f"the error does not name rank {victim} ({device_id}); {shown}"
    return took <= kill_deadline_s(silence_s), shown


def until_killed(plan, options, victim: int, step: int, stamp: str) -> list[float]:
    """A rank's training, except that rank ``victim`` kills itself (SIGKILL) in the forward
    pass of step ``step``, writing the wall-clock time to ``stamp`` first."""
    from potluck.runtime.launch.session import start
    from potluck.runtime.loop.batches import RandomTokens
    from potluck.runtime.loop.trainer import Trainer
    from potluck.runtime.models.build import build_model
    from potluck.runtime.parallel_model import parallelize

    session = start(plan, timeout_s=options.timeout_s)
    try:
        with session.guard():
            model = parallelize(build_model(plan.model), session, seed=options.seed)
            trainer = Trainer(model, lr=options.lr)
            if session.rank == victim:
                def die(*_):
                    if trainer.step_index == step:
                        Path(stamp).write_text(repr(time.time()))
                        os.kill(os.getpid(), signal.SIGKILL)
                model.stages[0].register_forward_pre_hook(die)
            shape = plan.training
            data = RandomTokens(plan.model.vocab_size, shape.seq_len, shape.global_batch, 0)
            return [trainer.step(data.replica_rows(k, *session.layout.batch_rows)).loss
                    for k in range(options.steps)]
    finally:
        session.close()


def run_kill_case(plan, options, timeout_s: float, directory: Path) -> dict:
    from potluck.runtime.launch.watchdog import RankFailure

    stamp = directory / "killed_at"
    message = None
    try:
        run_on_gpus(plan, options, timeout_s, until_killed,
                    (plan, options, KILL_VICTIM, KILL_STEP, str(stamp)))
    except RankFailure as err:
        message = str(err)
    stopped_at = time.time()
    killed_at = float(stamp.read_text()) if stamp.exists() else None
    ok, detail = killed_rank_verdict(message, KILL_VICTIM, plan.devices[KILL_VICTIM], killed_at,
                                     stopped_at)
    return {"ok": ok, "detail": detail}


# ---- one case, in its own process -----------------------------------------------------------


def multi_options(steps: int, timeout_s: float, **fields):
    from potluck import api

    return api.train_options(steps=steps, lr=MULTI_LR, seed=0, progress=False,
                             timeout_s=timeout_s, **fields)


def run_case(device: str, key: str, gpus: Sequence[int], result: Path) -> int:
    """``--case``: run case ``key`` on GPUs ``gpus`` and write what it found to ``result``
    (JSON: ``losses`` and, for a memory check, ``memory`` rows; or its ``ok`` and
    ``detail``; or the ``error``)."""
    case = case_by_key(key)
    timeout_s = CASE_TIMEOUT_S - 5.0
    try:
        plan = multi_plan(device, case, gpus)
        options = multi_options(MULTI_STEPS, timeout_s)
        if case.kill:
            found = run_kill_case(plan, options, timeout_s, result.parent)
        else:
            history = run_on_gpus(plan, options, timeout_s)
            found = {"losses": [m.loss for m in history]}
            if case.memory_check:
                from gpu_check_parts.memory_contract import predicted_totals

                rows = peak_rows(case.key, predicted_totals(plan), [m.memory for m in history])
                found["memory"] = [row.__dict__ for row in rows]
    except Exception as err:  # noqa: BLE001 - the parent reports it as this case's failure
        found = {"error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
    result.write_text(json.dumps(found))
    return 0


# ---- the rounds, from the parent --------------------------------------------------------


@dataclass
class Running:
    assigned: Assigned
    process: subprocess.Popen
    result: Path
    started: float
    log: Path
    found: dict = field(default_factory=dict)


def run_rounds(device: str, rounds: Sequence[Sequence[Assigned]], directory: Path,
               budget_s: float) -> dict[str, dict]:
    """Every round's cases side by side, each in its process for at most
    ``CASE_TIMEOUT_S`` (its process group killed then), within ``budget_s`` in all; what
    each found, by key."""
    found: dict[str, dict] = {}
    ends_at = time.monotonic() + budget_s
    for placed in rounds:
        if time.monotonic() + 5.0 >= ends_at:
            found.update({a.case.key: {"error": "not run: the check's time budget is spent"}
                          for a in placed})
            continue
        running = [_launch(device, a, directory) for a in placed]
        print(f"[multi] running {', '.join(f'{a.case.key} on GPUs {a.gpus}' for a in placed)}",
              flush=True)
        for run in running:
            found[run.assigned.case.key] = _wait(run, min(ends_at, run.started + CASE_TIMEOUT_S))
    return found


def _launch(device: str, assigned: Assigned, directory: Path) -> Running:
    case_dir = directory / assigned.case.key
    case_dir.mkdir(parents=True, exist_ok=True)
    result, log = case_dir / "result.json", case_dir / "output.txt"
    with log.open("w") as out:
        process = subprocess.Popen(case_command(device, assigned, result), cwd=REPO,
                                   env=case_env(assigned, case_dir, os.environ), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return Running(assigned, process, result, time.monotonic(), log)


def _wait(run: Running, until: float) -> dict:
    try:
        run.process.wait(timeout=max(0.0, until - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(run.process.pid, signal.SIGKILL)  # the case process and its ranks
        run.process.wait()
        dumps = sorted(p.name for p in run.result.parent.glob("nccl_trace_rank_*"))
        return {"error": f"did not finish within {CASE_TIMEOUT_S:.0f} s (flight recorder "
                         f"dumps: {', '.join(dumps) or 'none'}; output {run.log})"}
    if not run.result.exists():
        tail = [line for line in run.log.read_text().splitlines() if line.strip()][-1:]
        return {"error": f"exit code {run.process.returncode}: {tail[0] if tail else ''}"}
    return json.loads(run.result.read_text())


def losses_match(reference: list[float], losses: list[float],
                 tolerance: float = MULTI_LOSS_TOLERANCE) -> tuple[bool, str]:
    """Every step's loss finite and within ``tolerance`` of the one-GPU reference's."""
    shown = f"losses {_losses(losses)} against one GPU's {_losses(reference)}"
    if len(losses) != len(reference) or not all(math.isfinite(x) for x in losses):
        return False, shown
    worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    return worst <= tolerance, f"{shown}: largest difference {worst:.2e} (at most {tolerance:g})"


def _losses(losses: list[float]) -> str:
    return "[" + ", ".join(f"{x:.5f}" for x in losses) + "]"


def case_outcome(case: MultiCase, found: Mapping[str, dict]) -> Outcome:
    """``case``'s verdict from what every case found (its reference's losses included)."""
    from gpu_check_parts.memory_contract import MemoryRow

    mine = found.get(case.key, {"error": "not run"})
    if "error" in mine:
        return Outcome(case.name, False, mine["error"])
    if "ok" in mine:
        return Outcome(case.name, mine["ok"], mine["detail"])
    if case.reference is None:
        finite = all(math.isfinite(x) for x in mine["losses"])
        return Outcome(case.name, finite and bool(mine["losses"]),
                       f"losses {_losses(mine['losses'])}")
    reference = found.get(case.reference, {})
    if "losses" not in reference:
        return Outcome(case.name, False, f"no reference losses ({case.reference} failed)")
    ok, detail = losses_match(reference["losses"], mine["losses"])
    if case.memory_check:
        memory = rows_outcome(case.key, [MemoryRow(**row) for row in mine.get("memory", [])])
        ok, detail = ok and memory.ok, f"{detail}; memory: {memory.detail}"
    return Outcome(case.name, ok, detail)
