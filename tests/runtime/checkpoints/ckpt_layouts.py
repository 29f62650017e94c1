"""Tiny LLaMA models laid out as one rank of a plan, and checkpoint workers for the tests.

A layout names how a 4-layer LLaMA is split over the ranks of a run:
``full`` (this rank holds everything), ``pp`` (rank r holds stage r of a
pipeline over all ranks, uneven when the ranks do not divide the layers, with
the model's ordinary FQNs kept), ``tp`` (every rank holds DTensor shards of the
attention and MLP weights), ``dp`` (every rank holds a full replica) and
``hetero`` (three ranks, two replicas: ranks 0-1 a tp=2 replica, rank 2 a
plain one). Each layout is "trained" for two optimizer steps
whose values depend on the seed, so a loader built with another seed starts
from different numbers and only matches after loading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import LlamaConfig, LlamaForCausalLM

from potluck.errors import ConfigError
from potluck.runtime.checkpoints.storage import (
    apply_training_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    training_state,
)

NUM_LAYERS = 4
SAVED_LR = 1e-3


def tiny_llama_config(hidden_size: int = 32) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=NUM_LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=260,
                       max_position_embeddings=64)


def keep_stage(model: LlamaForCausalLM, stage: int, num_stages: int) -> LlamaForCausalLM:
    """Drop everything outside ``stage`` of an even pipeline split; FQNs stay as they were."""
    start, end = (round(s * NUM_LAYERS / num_stages) for s in (stage, stage + 1))
    model.model.layers = nn.ModuleDict(
        {str(i): model.model.layers[i] for i in range(start, end)}
    )
    if stage > 0:
        model.model.embed_tokens = None
    if stage < num_stages - 1:
        model.model.norm = None
        model.lm_head = None
    return model


def shard_tensor_parallel(model: LlamaForCausalLM, mesh: DeviceMesh) -> LlamaForCausalLM:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {}
    for i in range(NUM_LAYERS):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def build(layout: str, rank: int, world_size: int, seed: int, lr: float = SAVED_LR,
          hidden_size: int = 32) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """This rank's model part and optimizer under ``layout``, after two seeded steps."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size))
    if layout == "pp":
        model = keep_stage(model, rank, world_size)
    elif layout == "tp":
        model = shard_tensor_parallel(model, DeviceMesh("cpu", list(range(world_size))))
    elif layout == "hetero":
        mesh = DeviceMesh("cpu", [0, 1])  # every rank joins in making the group
        if rank < 2:
            model = shard_tensor_parallel(model, mesh)
    elif layout not in ("full", "dp"):
        raise ValueError(layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    for _ in range(2):
        for param in model.parameters():
            param.grad = param.detach() * 0.5 + 0.01
        optimizer.step()
    return [model], [optimizer]


def full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """Flat ``section/key -> value`` with DTensors gathered (a collective under tp)."""
    from torch.distributed.tensor import DTensor

    flat = {}
    for section in ("model", "optim"):
        for key, value in state[section].items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            flat[f"{section}/{key}"] = value.clone() if torch.is_tensor(value) else value
    return flat


def save(layout: str, rank: int, world_size: int, out_dir: Path, seed: int = 0,
         step: int = 3) -> None:
    """Save under ``layout``; under ``hetero`` only the first replica writes (rank 2 passes {})."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts, optimizers = build(layout, rank, world_size, seed)
    state = training_state(parts, optimizers)
    written = {} if layout == "hetero" and rank == 2 else state
    save_checkpoint(out_dir, step, written, {"step": step, "layout": layout})
    torch.save(full_tensors(state), out_dir / f"saved_rank{rank}.pt")


def load(layout: str, rank: int, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Load the latest checkpoint under ``layout``; check it against what was saved."""
    parts, optimizers = build(layout, rank, world_size, seed=100, lr=5e-2)
    state = training_state(parts, optimizers)
    before = full_tensors(state)
    trainer_state = load_checkpoint(latest_checkpoint(out_dir), state)
    apply_training_state(parts, optimizers, state)
    after = full_tensors(training_state(parts, optimizers))
    saved: dict[str, Any] = {}
    for file in sorted(out_dir.glob("saved_rank*.pt")):
        saved.update(torch.load(file, weights_only=False))
    assert any(not _same(before[k], saved[k]) for k in before), "loader started equal"
    for key, value in after.items():
        assert _same(value, saved[key]), f"{key} differs after loading"
    assert all(group["lr"] == SAVED_LR for group in optimizers[0].param_groups)
    torch.save(sorted(after), out_dir / f"loaded_keys_{layout}_rank{rank}.pt")
    return trainer_state


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def save_then_load(rank: int, world_size: int, save_layout: str, load_layout: str,
                   out_dir: Path) -> None:
    """Worker: save under one layout, then load under another, in the same run."""
    save(save_layout, rank, world_size, out_dir)
    dist.barrier()
    load(load_layout, rank, world_size, out_dir)


def hetero_round_trip(rank: int, world_size: int, out_dir: Path) -> None:
    """Worker: uneven pipeline -> heterogeneous replicas -> uneven pipeline."""
    save("pp", rank, world_size, out_dir, step=3)
    dist.barrier()
    load("hetero", rank, world_size, out_dir)
    dist.barrier()
    save("hetero", rank, world_size, out_dir, seed=7, step=4)
    dist.barrier()
    load("pp", rank, world_size, out_dir)


def save_worker(rank: int, world_size: int, layout: str, out_dir: Path) -> None:
    save(layout, rank, world_size, out_dir)


def load_worker(rank: int, world_size: int, layout: str, out_dir: Path) -> None:
    load(layout, rank, world_size, out_dir)


def mismatch_worker(rank: int, world_size: int, out_dir: Path) -> None:
    """Worker: only rank 1 asks for a wider model; every rank must raise, none may hang."""
    save("pp", rank, world_size, out_dir)
    hidden_size = 48 if rank == 1 else 32
    parts, optimizers = build("pp", rank, world_size, seed=1, hidden_size=hidden_size)
    try:
        load_checkpoint(latest_checkpoint(out_dir), training_state(parts, optimizers))
    except ConfigError as err:
        assert "does not fit this model" in str(err) and "(32," in str(err)
        return
    raise AssertionError("loading a wider model did not fail")


def damaged_file_worker(rank: int, world_size: int, out_dir: Path) -> None:
    """Worker: save under ``pp``, damage a file only rank 1 hashes; every rank must raise the
    same error naming it, none may hang or read the checkpoint."""
    save("pp", rank, world_size, out_dir)
    checkpoint = latest_checkpoint(out_dir)
    names = sorted(json.loads((checkpoint / "manifest.json").read_text())["files"])
    damaged = names[1::world_size][0]  # the files are hashed round-robin by rank
    dist.barrier()
    if rank == 0:
        with open(checkpoint / damaged, "r+b") as file:
            file.seek(-8, 2)
            file.write(b"\xff" * 8)
    dist.barrier()
    parts, optimizers = build("pp", rank, world_size, seed=1)
    try:
        load_checkpoint(checkpoint, training_state(parts, optimizers))
    except ConfigError as err:
        assert f"{damaged} does not match its sha256" in str(err), err
        return
    raise AssertionError("a damaged checkpoint loaded")
