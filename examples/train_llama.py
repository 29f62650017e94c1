"""A single-device Hugging Face training script, made multi-device by potluck.

The lines marked ``# potluck`` are all that changes: build the model on the meta
device, start the plan's process groups, parallelize, and step with potluck's
trainer (each data-parallel replica takes its share of the global batch).

    potluck plan -c cluster.yaml -m tiny-llama --global-batch 8 --seq-len 64 -o plan.json
    torchrun --nproc-per-node N examples/train_llama.py plan.json   # N = GPUs in the plan
"""

import sys

from transformers import LlamaConfig, LlamaForCausalLM

import potluck  # potluck
import potluck.runtime as pr  # potluck
from potluck.data import build_dataset, builtin_corpus_path, load_tokenizer

plan = potluck.load_plan(sys.argv[1])  # potluck
config = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=260)
with pr.meta_init():  # potluck
    model = LlamaForCausalLM(config)
session = pr.start(plan)  # potluck
model = pr.parallelize(model, session)  # potluck
trainer = pr.Trainer(model, lr=1e-3)  # potluck (instead of torch.optim.AdamW + backward)
data = build_dataset(builtin_corpus_path(), load_tokenizer(None), plan.training.seq_len,
                     plan.training.global_batch)
for step in range(int(sys.argv[2]) if len(sys.argv) > 2 else 10):
    metrics = trainer.step(data.replica_rows(step, *session.layout.batch_rows))
    if session.rank == 0:
        print(f"step {step}: loss {metrics.loss:.4f}")  # noqa: T201 - an example script
session.close()
