"""Predictions against published measurements of real training runs.

Megatron-LM, Narayanan et al. SC'21, Table 1 (also in the Megatron-LM README): GPT models
with s=2048, V=51200 on DGX A100 80GB nodes (8 GPUs, NVSwitch, 8x200 Gb/s InfiniBand),
full activation recomputation, Megatron-LM's execution of the time (the ``megatron-lm-2021``
preset, src/potluck/cluster/execution.py); throughput reported in their Eq. 3 FLOPs
(which count the recomputation). Korthikanti et al. 2022 (abstract): 530B on 2240 A100s,
MFU 54.2% with selective recomputation and sequence parallelism, 42.1% with full
recomputation. potluck is given each run's tp/pp/dp and recomputation and predicts the rest.

Usage: python benchmarks/published_runs.py
"""

from __future__ import annotations

from potluck.cluster import parse_cluster
from potluck.cluster.execution import preset
from potluck.model.counts import Recompute
from potluck.model.spec import MlpKind, ModelSpec, NormKind
from potluck.planner.options import SearchOptions
from potluck.planner.search import search
from potluck.plans import Schedule, TrainingShape

# (parameters B, heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU)
SC21_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200
EXECUTION = "megatron-lm-2021"  # `potluck plan --execution megatron-lm-2021` plans the same


def gpt(params_b: float, heads: int, hidden: int, layers: int) -> ModelSpec:
    return ModelSpec(
        name=f"gpt-{params_b}b", family="gpt2", hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=heads, ffn_hidden_size=4 * hidden, vocab_size=VOCAB,
        max_seq_len=SEQ, mlp=MlpKind.GELU, norm=NormKind.LAYERNORM, tied_embeddings=True,
        learned_positions=True, linear_bias=True, qkv_bias=True, dropout=True,
    )


def selene(gpus: int):
    return parse_cluster(
        f"nodes: [{{name: dgx, gpu: a100-80g-sxm, gpus_per_node: 8, count: {gpus // 8}, "
        "inter_bandwidth: 1600Gb/s, inter_latency: 5us}]"
    )


def eq3_flops(batch: int, layers: int, hidden: int) -> float:
    """SC'21 Eq. 3: FLOPs per iteration with full recomputation."""
    return 96 * batch * SEQ * layers * hidden**2 * (
        1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def predict(model: ModelSpec, gpus: int, batch: int, tp: int, pp: int, recompute: Recompute,
            schedule: Schedule):
    options = SearchOptions(tp=tp, pp=pp, dp=gpus // (tp * pp), recompute=recompute,
                            schedule=schedule, zero=0, top_k=1)  # 2021: no distributed optimizer
    shape = TrainingShape(batch, SEQ, execution=preset(EXECUTION))
    return search(selene(gpus), model, shape, options).best


def sc21() -> None:
    print("| model | GPUs | t/p/d | published TFLOP/s | potluck | error | potluck plan |")
    print("|---|---:|---|---:|---:|---:|---|")
    errors = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, published in SC21_TABLE_1:
        schedule = Schedule.INTERLEAVED if pp > 1 and layers // pp >= 2 else Schedule.ONE_F_ONE_B
        plan = predict(gpt(params, heads, hidden, layers), gpus, batch, tp, pp, Recompute.FULL,
                       schedule)
        tflops = eq3_flops(batch, layers, hidden) / plan.prediction.iteration_time_s / gpus / 1e12
        error = (tflops - published) / published
        errors.append(error)
        print(f"| {params}B | {gpus} | {tp}/{pp}/{gpus // (tp * pp)} | {published} | {tflops:.0f} | "
              f"{error:+.0%} | µbatch {plan.pipelines[0].micro_batch_size}, {plan.schedule.value} |")
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    print(f"\nMean absolute error {mean_abs:.1%}, worst {max(errors, key=abs):+.1%}.")


def korthikanti() -> None:
    model = gpt(530, 128, 20480, 105)
    print("\n| 530B on 2240 A100 (t=8, p=35) | published MFU | potluck MFU |")
    print("|---|---:|---:|")
    for recompute, published in ((Recompute.SELECTIVE, 0.542), (Recompute.FULL, 0.421)):
        plan = predict(model, 2240, 2240, 8, 35, recompute, Schedule.INTERLEAVED)
        print(f"| {recompute.value} recomputation | {published:.1%} | {plan.prediction.mfu:.1%} |")


if __name__ == "__main__":
    sc21()
    korthikanti()
