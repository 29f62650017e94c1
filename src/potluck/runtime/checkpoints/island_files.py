"""Islands in checkpoints: each island's state, the outer state, and resuming under
another split.

Between outer steps the islands' weights differ, and so do their inner optimizers' states
at any step (DiLoCo keeps each island's inner optimizer its own). A checkpoint of a plan
whose islands synchronize rarely therefore holds, in the shared, resharding form
(:mod:`~potluck.runtime.checkpoints.storage`):

- ``model``/``optim``: island 0's weights and inner optimizer states (written as a plan
  without islands writes them, by island 0's first pipeline); ``island<i>.model`` and
  ``island<i>.optim``: island ``i``'s, written alike by its first pipeline (under ZeRO-1
  each replica of the island writes its own share there);
- ``outer`` (DiLoCo): each parameter's FP32 snapshot at its fragment's last outer step and
  its outer Nesterov momentum (zeros before the first outer step, which SGD's first step
  treats as no buffer). Both are the same on every island (they change only by the
  averaged pseudo-gradient), so island 0's first pipeline writes them.

Each rank also writes ``islands/rank_00003.safetensors``: its local weights, inner
optimizer states and exchange state (bounded staleness' bases, which differ per island)
with the counters in the file's metadata; a resume under the same plan loads them, exactly
as before.

``trainer_state.json`` says under ``islands`` how the islands were split, the outer steps
done and whether the checkpoint is a **consensus** state: one taken right after every
fragment was exchanged (one fragment, a step that is a multiple of H; bounded's pushes in
flight are applied before saving), where every island holds the same weights.
:func:`saves_at` moves ``--checkpoint-every`` up to the next such step.

A resume (:func:`island_resume`):

- the same plan: the shared state, then each rank's own file (exact);
- the same islands (count, method, H, fragments, each island's batch rows) laid out
  otherwise inside: each island loads its own ``island<i>`` sections, DiLoCo also the outer
  state (exact at any step); bounded only from a consensus checkpoint;
- another split (other islands, or none) from a consensus checkpoint, or from a
  checkpoint without islands: island 0's weights and inner optimizer states for every
  island, the outer snapshot and momentum when both runs are DiLoCo (otherwise they start
  from the weights and at zero; a run without islands drops them, saying so). Every island
  starting from island 0's AdamW moments is a choice: at a consensus point the islands'
  moments differ only by the noise of their own batches since the last exchange, island
  0's is a state one real trajectory reached, and averaging would take an exchange of
  twice the model across the slow link at every save (and an average of second moments
  is no trajectory's). The resumed run is a fresh split from that point, not a
  continuation of either run's islands;
- another split from a checkpoint that is not a consensus state: one line naming the last
  consensus checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from potluck.errors import ConfigError
from potluck.plans import Plan, SyncMethod
from potluck.plans.files import plan_to_dict
from potluck.plans.islands import Islands
from potluck.runtime.checkpoints.rank_files import rank_file, save_rank_file
from potluck.runtime.checkpoints.storage import (
    apply_training_state,
    complete_checkpoints,
    read_trainer_state,
    training_state,
)
from potluck.runtime.grads.buckets import local
from potluck.runtime.grads.islands import BoundedSync, DilocoSync
from potluck.runtime.loop.trainer import Trainer

log = logging.getLogger(__name__)

ISLANDS_DIR = "islands"
ISLANDS_KEY = "islands"  # trainer_state.json's key of split_info()
OUTER = "outer"  # the shared section of DiLoCo's snapshots and outer momentum
_OWN = "own."  # this rank's weights and inner optimizer states, by training_state's keys
_SYNC = "sync."  # the exchange's tensors


def island_file(checkpoint: Path, rank: int) -> Path:
    return rank_file(checkpoint, ISLANDS_DIR, rank)


def is_consensus(islands: Islands, done: int) -> bool:
    """Whether every island holds the same weights once ``done`` steps are done (and
    bounded's pushes in flight applied): right after an exchange of every fragment."""
    if not islands.split:
        return True
    return islands.fragments == 1 and done % islands.inner_steps == 0


def saves_at(done: int, every: int, islands: Islands) -> bool:
    """Whether ``--checkpoint-every every`` saves once ``done`` steps are done: at its
    multiples, moved up to the next consensus step where the islands have one."""
    if every <= 0:
        return False
    if not islands.split or islands.fragments > 1:
        return done % every == 0
    h = islands.inner_steps
    return done % h == 0 and done // every > (done - h) // every


def checkpoint_steps_note(every: int, islands: Islands) -> str | None:
    """What :func:`saves_at` does with ``every`` under ``islands`` (None: nothing to say)."""
    if every <= 0 or not islands.split:
        return None
    if islands.fragments > 1:
        return (f"checkpoints every {every} steps are not consensus states ({islands.fragments}"
                " fragments are never exchanged at one step): they resume under the same "
                "islands only")
    if every % islands.inner_steps == 0:
        return None
    return (f"--checkpoint-every {every} rounded up to the next outer step (every "
            f"{islands.inner_steps} steps), where the islands hold the same weights")


def first_of_island(plan: Plan, pipeline: int) -> int:
    """The pipeline that writes its island's shared state: the island's first (pipeline 0
    without islands that synchronize rarely)."""
    islands = plan.islands
    if not islands.split:
        return 0
    return min(islands.members(islands.island_of(pipeline), plan.dp))


def _signature(plan: Plan) -> dict[str, Any]:
    """What must match for each island to continue its own state: the exchange and each
    island's batch rows (its weight in the average and its data)."""
    islands = plan.islands
    rows = [sum(plan.pipelines[p].batch_share for p in islands.members(i, plan.dp))
            for i in range(islands.count)]
    return {"count": islands.count, "sync": islands.sync.value,
            "inner_steps": islands.inner_steps, "fragments": islands.fragments,
            "compression": islands.compression.value, "staleness": islands.staleness,
            "outer_lr": islands.outer_lr, "outer_momentum": islands.outer_momentum,
            "rows": rows}


def _fingerprint(plan: Plan) -> str:
    """The plan's layout and islands, hashed: equal for the same plan."""
    data = plan_to_dict(plan)
    kept = {key: data.get(key) for key in ("pipelines", "islands", "ep", "zero")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def split_info(trainer: Trainer) -> dict[str, Any] | None:
    """trainer_state.json's ``islands``: how the islands were split, the outer steps done,
    whether the state is a consensus one (None without islands that synchronize rarely)."""
    plan = trainer.model.layout.plan
    if not plan.islands.split:
        return None
    return {"signature": _signature(plan), "plan": _fingerprint(plan),
            "consensus": is_consensus(plan.islands, trainer.step_index),
            "outer_steps": _outer_steps(trainer)}


def _outer_steps(trainer: Trainer) -> int:
    """Outer steps (DiLoCo) or pushes (bounded) done: the exchange's counter."""
    if isinstance(trainer.islands, DilocoSync):
        return trainer.islands.outer_steps
    assert isinstance(trainer.islands, BoundedSync)  # split_info: islands that synchronize rarely
    return trainer.islands.pushes


def shared_state(trainer: Trainer, state: dict[str, Any], writes: bool) -> dict[str, Any]:
    """What this rank writes into the shared tensors: ``state`` (its replica's part), under
    its island's section, plus DiLoCo's outer state where it ``writes`` for island 0.
    Bounded's pushes in flight are applied first, so the weights written are the ones the
    run continues with; DiLoCo's fragments in flight stay in flight (each rank's own file
    holds them, :func:`save_island_state`): applying one early would change the run."""
    plan = trainer.model.layout.plan
    if not plan.islands.split:
        return state
    if isinstance(trainer.islands, BoundedSync):
        trainer.islands.drain()
    island = plan.islands.island_of(trainer.model.layout.role.pipeline)
    if island > 0:
        return {f"island{island}": state} if state else {}
    if writes and isinstance(trainer.islands, DilocoSync):
        return {**state, OUTER: _outer_tensors(trainer)}
    return state


def _outer_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """DiLoCo's snapshots and momentum by ``snapshot.NAME``/``momentum.NAME``, laid out as
    their parameters (a DTensor where the parameter is one), momentum zeros where unset."""
    saved = trainer.islands.state_dict()["tensors"]
    out = {}
    for name, param in trainer.model.named_parameters():
        snapshot = saved.get(f"snapshot.{name}")
        if snapshot is None:
            continue
        momentum = saved.get(f"momentum.{name}", torch.zeros_like(snapshot))
        out[f"snapshot.{name}"] = _like(snapshot, param)
        out[f"momentum.{name}"] = _like(momentum, param)
    return out


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's local part, FP32) laid out as ``param``."""
    value = value.to(local(param).device, torch.float32)
    if isinstance(param, DTensor):
        return DTensor.from_local(value, param.device_mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())
    return value


class _Mode(Enum):
    PLAIN = "plain"  # no islands here, none there
    SAME_PLAN = "same plan"  # each rank's own file
    SAME_ISLANDS = "same islands"  # each island's own sections
    CONSENSUS = "consensus"  # island 0's state for every island


@dataclass
class IslandResume:
    """How a checkpoint loads under this run's islands (:func:`island_resume`)."""

    mode: _Mode
    path: Path
    saved: Mapping[str, Any] | None  # the checkpoint's split_info (None: no islands)
    outer: dict[str, torch.Tensor] = field(default_factory=dict)  # filled by the load

    def request(self, trainer: Trainer, state: dict[str, Any]) -> dict[str, Any]:
        """The state to load: ``state`` (this rank's training state) under the section it
        comes from, and the outer state to load beside it."""
        island = trainer.model.layout.plan.islands.island_of(trainer.model.layout.role.pipeline)
        request = state
        if self.mode is _Mode.SAME_ISLANDS and island > 0:
            request = {f"island{island}": state}
        if self._loads_outer(trainer):
            self.outer = {key: _like(torch.zeros_like(local(p), dtype=torch.float32), p)
                          for name, p in trainer.model.named_parameters()
                          for key in (f"snapshot.{name}", f"momentum.{name}")}
            request = {**request, OUTER: self.outer}
        return request

    def _loads_outer(self, trainer: Trainer) -> bool:
        saved_diloco = self.saved is not None and self.saved["signature"]["sync"] == SyncMethod.DILOCO.value
        return (saved_diloco and isinstance(trainer.islands, DilocoSync)
                and self.mode in (_Mode.SAME_ISLANDS, _Mode.CONSENSUS))

    def finish(self, trainer: Trainer) -> None:
        """After the training state was applied: the exchange's state."""
        if self.mode is _Mode.SAME_PLAN:
            _load_rank_file(trainer, self.path)
        elif self.mode is not _Mode.PLAIN:
            _start_exchange(trainer, self.outer, self.saved)
        self._say(trainer)

    def _say(self, trainer: Trainer) -> None:
        if trainer.model.layout.rank != 0 or self.mode in (_Mode.PLAIN, _Mode.SAME_PLAN):
            return
        if not trainer.model.layout.plan.islands.split:
            log.warning("resuming without islands from %s: its outer optimizer state "
                        "(snapshots, momentum) is dropped", self.path)
        elif self.mode is _Mode.CONSENSUS:
            carried = "with its outer momentum" if self.outer else "outer momentum from zero"
            log.info("resuming %s under another island split from its consensus weights, "
                     "every island from island 0's inner optimizer state, %s",
                     self.path, carried)


def island_resume(trainer: Trainer, path: Path) -> IslandResume:
    """How checkpoint ``path`` resumes under this run's islands (module docstring); one
    line when it cannot."""
    plan = trainer.model.layout.plan
    saved = read_trainer_state(path).get(ISLANDS_KEY)
    if saved is not None and not _valid_info(saved):
        raise ConfigError(f"checkpoint {path}: its {ISLANDS_KEY} entry is damaged")
    if not plan.islands.split and saved is None:
        return IslandResume(_Mode.PLAIN, path, None)
    if saved is None:  # saved without islands (a consensus), or by a potluck before this one
        older = (path / ISLANDS_DIR).is_dir()
        return IslandResume(_Mode.SAME_PLAN if older else _Mode.CONSENSUS, path, None)
    if plan.islands.split and saved["plan"] == _fingerprint(plan):
        return IslandResume(_Mode.SAME_PLAN, path, saved)
    same_islands = plan.islands.split and saved["signature"] == _signature(plan)
    diloco = saved["signature"]["sync"] == SyncMethod.DILOCO.value
    if same_islands and diloco and not saved["consensus"] and plan.islands.fragments > 1:
        raise ConfigError(f"checkpoint {path} has streaming fragments in flight, which only "
                          f"the plan that saved it resumes; resume with that plan, or "
                          f"{_last_consensus(path)}")
    if same_islands and (diloco or saved["consensus"]):
        return IslandResume(_Mode.SAME_ISLANDS, path, saved)
    if saved["consensus"]:
        return IslandResume(_Mode.CONSENSUS, path, saved)
    raise ConfigError(f"checkpoint {path} is not a consensus state of its islands (they "
                      f"held different weights), so it resumes under the same split only; "
                      f"{_last_consensus(path)}")


def _valid_info(saved: Any) -> bool:
    return (isinstance(saved, dict) and isinstance(saved.get("signature"), dict)
            and "sync" in saved["signature"] and isinstance(saved.get("consensus"), bool)
            and isinstance(saved.get("outer_steps"), int) and "plan" in saved)


def _last_consensus(path: Path) -> str:
    """Where to resume from instead: the newest older consensus checkpoint, named."""
    for older in reversed(complete_checkpoints(path.parents[1])):
        info = read_trainer_state(older).get(ISLANDS_KEY)
        if info is None or (isinstance(info, dict) and info.get("consensus") is True):
            return (f"resume from {older.name}, the last consensus checkpoint (move the newer "
                    "ones away), or under the same split")
    return "resume under the same split, or train again without --resume"


def _start_exchange(trainer: Trainer, outer: Mapping[str, torch.Tensor],
                    saved: Mapping[str, Any] | None) -> None:
    """The exchange continues from the loaded state: DiLoCo's snapshots and momentum from
    ``outer`` where loaded, else the loaded weights and no momentum; bounded's bases the
    loaded weights; the outer steps counted on."""
    if not trainer.model.layout.plan.islands.split:
        return
    entries = trainer.islands.exchange.entries.values()
    prefix = "snapshot." if isinstance(trainer.islands, DilocoSync) else "base."
    tensors = {f"{prefix}{e.item.name}": e.value.detach().float().clone() for e in entries}
    tensors.update({key: local(value) for key, value in outer.items()})
    done = saved["outer_steps"] if saved is not None else 0
    counter = "outer_steps" if prefix == "snapshot." else "pushes"
    trainer.islands.load_state_dict({"tensors": tensors, "counters": {counter: done}})


def save_island_state(trainer: Trainer, checkpoint: Path) -> list[Path]:
    """Write this rank's island state into ``checkpoint``; the files written (none without
    islands that synchronize rarely)."""
    if not trainer.model.layout.plan.islands.split:
        return []
    state = trainer.islands.state_dict()
    tensors = {f"{_SYNC}{key}": value.contiguous().cpu()
               for key, value in state["tensors"].items()}
    own = training_state([trainer.model.module], [trainer.optimizer])
    for section, values in own.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OWN}{section}.{key}"] = local(value).detach().contiguous().cpu()
    return [save_rank_file(checkpoint, ISLANDS_DIR, trainer.model.layout.rank, tensors,
                           {"counters": json.dumps(state["counters"])})]


def _load_rank_file(trainer: Trainer, checkpoint: Path) -> None:
    """Load this rank's island state from ``checkpoint`` over what the shared tensors gave."""
    rank = trainer.model.layout.rank
    path = island_file(checkpoint, rank)
    if not path.is_file():
        raise ConfigError(f"checkpoint {checkpoint} holds no island state for rank {rank}")
    try:
        with safe_open(str(path), framework="pt") as file:
            counters = json.loads((file.metadata() or {})["counters"])
            saved = {key: file.get_tensor(key) for key in file.keys()}
    except (SafetensorError, KeyError, ValueError) as err:
        raise ConfigError(f"{path}: not an island state potluck wrote ({err})") from None
    _load_own(trainer, saved)
    sync = {key[len(_SYNC):]: value for key, value in saved.items() if key.startswith(_SYNC)}
    trainer.islands.load_state_dict({"tensors": sync, "counters": counters})


def _load_own(trainer: Trainer, saved: dict[str, torch.Tensor]) -> None:
    """This rank's weights and inner optimizer states into the trainer."""
    state = training_state([trainer.model.module], [trainer.optimizer])
    with torch.no_grad():
        for section, values in state.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    local(value).copy_(saved[f"{_OWN}{section}.{key}"])
    apply_training_state([trainer.model.module], [trainer.optimizer], state)
