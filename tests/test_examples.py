"""The README's example script: the same losses on one process and under torchrun with pp=2."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _plan(tmp_path: Path, gpus: int, *pins: str) -> Path:
    cluster = tmp_path / f"cpu{gpus}.yaml"
    cluster.write_text(f"nodes: [{{name: cpu, gpu: cpu, gpus_per_node: {gpus}}}]\n")
    plan = tmp_path / f"plan{gpus}.json"
    subprocess.run([sys.executable, "-m", "potluck", "plan", "-c", str(cluster), "-m", "tiny-llama",
                    "--global-batch", "8", "--seq-len", "64", "-o", str(plan), "--json", *pins],
                   check=True, capture_output=True, env=ENV, timeout=120)
    return plan


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", output)]


def test_the_example_trains_alike_on_one_process_and_on_two_pipeline_stages(tmp_path):
    script = str(ROOT / "examples" / "train_llama.py")
    one = subprocess.run([sys.executable, script, str(_plan(tmp_path, 1)), "3"], env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          script, str(_plan(tmp_path, 2, "--pp", "2")), "3"], env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    assert len(_losses(one.stdout)) == 3
    assert _losses(two.stdout) == _losses(one.stdout)
