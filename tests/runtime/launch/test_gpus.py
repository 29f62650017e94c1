"""One backend for the whole world, spawn for GPU ranks, and the CUDA device each GPU is."""

from __future__ import annotations

import pytest
from runtime_helpers import TINY_LLAMA, make_plan, pipe

from potluck.cluster.spec import parse_cluster
from potluck.errors import ConfigError
from potluck.runtime.launch.gpus import StartMethod, cuda_ordinal, start_method, world_backend
from potluck.runtime.options import TrainOptions

MIXED = parse_cluster("nodes:\n  - {name: box, gpu: rtx3090, gpus_per_node: 2}\n"
                      "  - {name: cpu, gpu: cpu, gpus_per_node: 2}\n", "mixed.yaml")
TWO_PIPES = [pipe([(1, (0, 2)), (1, (2, 4))], 1, 2)]


def _plan(device_ids):
    return make_plan(TINY_LLAMA, TWO_PIPES, cluster=MIXED, device_ids=device_ids)


def _mixed_replicas():
    """Two replicas, a GPU's and a CPU's, summing gradients every step: no backend runs it."""
    return make_plan(TINY_LLAMA, [pipe([(1, (0, 4))], 1, 2)] * 2, cluster=MIXED,
                     device_ids=["box.0:0", "cpu.0:0"])


def test_every_rank_a_gpu_is_nccl_every_rank_a_cpu_or_emulated_is_gloo():
    gpus, cpus = _plan(["box.0:0", "box.0:1"]), _plan(["cpu.0:0", "cpu.0:1"])
    assert world_backend(gpus, emulate=False) == "nccl"
    assert world_backend(cpus, emulate=False) == "gloo"
    assert world_backend(gpus, emulate=True) == "gloo"
    assert world_backend(_plan(["box.0:0", "cpu.0:0"]), emulate=True) == "gloo"


def test_cpu_ranks_summing_with_gpus_are_one_clear_error():
    with pytest.raises(ConfigError) as err:
        world_backend(_mixed_replicas(), emulate=False)
    message = str(err.value)
    assert "\n" not in message
    assert "mix NVIDIA GPUs (box.0:0) with CPU ranks (cpu.0:0) in one synchronous job" in message
    assert "islands of one vendor" in message


def test_a_pipeline_from_a_gpu_to_a_cpu_runs_over_a_gloo_world():
    assert world_backend(_plan(["box.0:0", "cpu.0:0"]), emulate=False) == "gloo"


def test_gpu_ranks_are_spawned_and_cpu_or_emulated_ranks_forked_from_the_fork_server():
    gpus, cpus = _plan(["box.0:0", "box.0:1"]), _plan(["cpu.0:0", "cpu.0:1"])
    assert start_method(gpus, emulate=False) is StartMethod.SPAWN
    assert start_method(gpus, emulate=True) is StartMethod.FORK_SERVER
    assert start_method(cpus, emulate=False) is StartMethod.FORK_SERVER


def test_a_mixed_plan_is_refused_before_any_rank_starts(monkeypatch):
    import potluck.runtime.training as training

    monkeypatch.setattr(training, "run_local", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(ConfigError, match="no backend joins two vendors"):
        training.train(_mixed_replicas(), TrainOptions(progress=False))


def test_every_rank_of_a_mixed_plan_refuses_it_before_joining(monkeypatch):
    """Under torchrun (one rank per machine here) no rank may join with its own backend."""
    from potluck.runtime.launch.session import start

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, device in enumerate(["box.0:0", "cpu.0:0"]):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("POTLUCK_DEVICE", device)
        with pytest.raises(ConfigError, match="no backend joins two vendors"):
            start(_mixed_replicas())


@pytest.mark.parametrize("visible, gpu, ordinal", [
    (None, 3, 3),  # unset: CUDA numbers every GPU, as the cluster file does
    ("2,3", 3, 1),
    ("3,2", 3, 0),
    ("3", 3, 0),  # a scheduler that gives each rank its own GPU
    (" 0 , 1 ", 1, 1),
])
def test_the_cuda_device_is_the_plans_gpu_among_the_visible_ones(visible, gpu, ordinal):
    assert cuda_ordinal("box.0:3", gpu, visible) == ordinal


@pytest.mark.parametrize("visible, says", [
    ("0,1", "CUDA_VISIBLE_DEVICES=0,1 hides it"),
    ("", "CUDA_VISIBLE_DEVICES= hides it"),
    ("0,-1,3", "hides it"),  # CUDA stops reading at a negative number
    ("GPU-8f6e1b2c-aaaa-bbbb-cccc-0123456789ab", "names GPUs by UUID or MIG"),
    ("MIG-GPU-8f6e1b2c/1/0", "names GPUs by UUID or MIG"),
    ("3,3", "lists GPU 3 twice"),
    ("three", "is not a list of GPU numbers"),
])
def test_a_gpu_that_cuda_visible_devices_does_not_show_is_one_clear_error(visible, says):
    with pytest.raises(ConfigError) as err:
        cuda_ordinal("box.0:3", 3, visible)
    assert says in str(err.value) and "\n" not in str(err.value)
