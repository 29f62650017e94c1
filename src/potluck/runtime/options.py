"""How to train a plan: :class:`TrainOptions`, the options of ``potluck train``.

The entry points read them (:mod:`potluck.runtime.training` on this machine,
:mod:`potluck.runtime.worker` under torchrun, which turns them into flags and
back), and so do the pieces that act on one option each: the pre-launch
checks, the stand-in model, the batches a run reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from potluck.runtime.loop.schedule import LRSchedule, Schedule

# What the launching process acts on before any rank (or torchrun command) starts, so never
# a flag of the ranks: deleting the other run in the run directory.
LAUNCHER_ONLY = frozenset({"overwrite"})


@dataclass(frozen=True)
class TrainOptions:
    """How to train a plan. Every field but those of :data:`LAUNCHER_ONLY` is a flag of the
    torchrun worker; all but ``seq_len``, ``progress`` and ``keep_checkpoints`` are also
    flags of ``potluck train`` (those three are set from Python or by the CLI itself)."""

    steps: int = 20  # total steps of the run (a resumed run continues up to it)
    lr: float = 3e-4  # the peak learning rate (after any warm-up)
    lr_schedule: LRSchedule = LRSchedule.CONSTANT  # after the warm-up: constant or decaying
    warmup_steps: int = 0  # steps rising linearly to lr
    min_lr: float = 0.0  # where cosine and linear decay end
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    seed: int = 0
    max_grad_norm: float | None = 1.0  # clip gradients to this global norm (None: no clipping)
    out_dir: str | None = None  # metrics.jsonl (and tensorboard/) go here
    data: str | None = None  # a .txt/.jsonl file or directory; None: random tokens
    tokenizer: str | None = None  # a local HF tokenizer directory; None: bytes
    init_from: str | None = None  # a HF model directory whose weights the run starts from
    emulate: bool = False  # run the plan's devices as CPU ranks, timed like them
    dilation: float | None = None  # emulation time stretch; None: calibrate
    stand_in: str | None = None  # compute with this model (same layer count), or "tiny"
    seq_len: int | None = None  # compute with this sequence length (default: the plan's)
    timeout_s: float = 600.0  # how long a rank waits for the others
    tensorboard: bool = False
    progress: bool = True
    checkpoint_every: int = 0  # also save to out_dir/checkpoints every N steps (0: at the end only)
    keep_checkpoints: int = 2  # newest checkpoints kept (0: all), and the newest known good
    resume: bool = False  # continue from the newest checkpoint in out_dir
    overwrite: bool = False  # out_dir holds another run: the launcher deletes its files first
    trace_steps: int = 0  # record this many steps' ops into out_dir/trace.json (0: off)
    elastic: bool = False  # replan and continue when ranks die or devices join
    inject_failure: str | None = None  # "RANK@STEP": that rank is killed there (a drill)
    count_memory: bool = False  # CPU ranks count the bytes they hold (memory rows; on when emulating)

    def schedule(self) -> Schedule:
        """The learning rate of each step of this run (:mod:`potluck.runtime.loop.schedule`)."""
        return Schedule(lr=self.lr, kind=self.lr_schedule, warmup_steps=self.warmup_steps,
                        min_lr=self.min_lr, total_steps=self.steps)
