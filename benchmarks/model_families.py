"""Which Hugging Face decoder families potluck plans and trains, through the CLI as a user would.

For each ``model_type`` a tiny ``config.json`` is written (4 blocks, hidden 32, the byte
vocabulary, mixture-of-experts keys in every spelling, no dropout), then
``potluck plan --pp 2`` on a CPU cluster of four ranks (two pipeline stages, so a model
without a block adapter is cut by tracing; the planner picks the rest) and
``potluck train`` of that plan for a few steps. The table says what the planner chose, the
first and last loss, and for a family that does not run, the one line potluck printed.

    python benchmarks/model_families.py                      # the README's families
    python benchmarks/model_families.py --types helium nemotron olmoe

Takes about 20 s per family on two cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

README_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2", "mixtral",
                "qwen2_moe", "qwen3_moe", "gpt2", "gpt_neox", "gemma3_text", "opt", "stablelm"]
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=260, max_position_embeddings=64,
            pad_token_id=256, bos_token_id=257, eos_token_id=258, n_embd=32, n_layer=4,
            n_head=4, n_positions=64, num_local_experts=4, num_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            ffn_dim=64, word_embed_proj_dim=32, query_pre_attn_scalar=8,
            dropout=0.0, attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, residual_dropout=0.0, embedding_dropout=0.0)
CLUSTER = "nodes:\n  - name: cpu\n    gpu: cpu\n    gpus_per_node: 4\n"
STEPS = 4


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "potluck", *args], capture_output=True,
                          text=True, timeout=timeout_s)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


def try_family(model_type: str, work: Path) -> dict[str, str]:
    folder = work / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **TINY}))
    cluster = work / "cpu.yaml"
    cluster.write_text(CLUSTER)
    plan_file = folder / "plan.json"
    planned = _run(["plan", "-c", str(cluster), "-m", str(folder), "--global-batch", "8",
                    "--seq-len", "16", "--dtype", "fp32", "--pp", "2", "-o", str(plan_file),
                    "--json"], 300)
    if planned.returncode:
        return {"type": model_type, "result": "plan refused", "note": _last_line(planned.stderr)}
    layout = json.loads(planned.stdout)["layout"]
    trained = _run(["train", "--plan", str(plan_file), "--steps", str(STEPS), "--seq-len", "16",
                    "-o", str(folder / "run"), "--timeout", "120"], 600)
    if trained.returncode:
        return {"type": model_type, "result": "train failed", "layout": layout,
                "note": _last_line(trained.stderr)}
    metrics = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text()
               .splitlines() if line.strip()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    notes = json.loads(planned.stdout).get("model_notes", [])
    return {"type": model_type, "result": "trains", "layout": layout,
            "loss": f"{losses[0]:.3f} -> {losses[-1]:.3f}", "note": "; ".join(notes)[:160]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=README_TYPES)
    args = parser.parse_args()
    print(f"{len(args.types)} families, about {20 * len(args.types)} s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.types:
            started = time.perf_counter()
            row = try_family(model_type, Path(tmp))
            rows.append(row)
            print(f"{row['type']:14} {row['result']:13} {row.get('layout', ''):22} "
                  f"{row.get('loss', ''):16} {time.perf_counter() - started:5.1f} s  "
                  f"{row.get('note', '')}", flush=True)


if __name__ == "__main__":
    main()
