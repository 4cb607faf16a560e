"""A PyTorch Lightning run that survives time limits and preemption, relaytrain owning the requeue
(docs/programs.md, "PyTorch Lightning").

    relaytrain launch --command "python examples/lightning_train.py --out \\$RELAYTRAIN_RUN_DIR/out" \\
        --name pl --nodes 1 --tasks-per-node 1 --signal USR2@180

Lightning's own Slurm auto-requeue (``SLURMEnvironment(auto_requeue=True)``, SIGUSR1) is switched
off: one owner per launch. ``RelaytrainStop`` asks relaytrain after every batch whether every rank
agreed to stop; if so it saves a Lightning checkpoint (weights, optimizer, loop state) and stops
the Trainer, and the script exits for requeue. The next job resumes with ``fit(ckpt_path=...)``.
Each step's batch is made from the global step, so the resumed run logs the uninterrupted run's losses.
"""

from relaytrain import program

program.install()  # before torch/lightning are imported: a stop signal during start-up is kept

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins.environments import SLURMEnvironment  # noqa: E402


class RelaytrainStop(L.Callback):
    """On a stop agreed by every rank: save a checkpoint now and stop (then call exit_for_requeue)."""

    def __init__(self, out: Path, step_delay: float = 0.0):
        self.out = out
        self.step_delay = step_delay  # seconds of sleep per step, to make a tiny run last

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            with open(self.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": outputs["loss"].item()}) + "\n")
        time.sleep(self.step_delay)
        if program.should_stop(trainer.global_step):  # every rank calls it after every batch
            with program.saving():
                trainer.save_checkpoint(self.out / "last.ckpt")  # a collective: every rank calls it
            trainer.should_stop = True


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(
            1000 + self.global_step
        )  # the data of this step, whatever the history
        x = torch.randn(16, 32, generator=g)
        y = (x[:, :8].sum(dim=1, keepdim=True) > 0).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(x), y)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(100_000), batch_size=1)  # indices only


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="checkpoint and loss log directory")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "last.ckpt"
    # Under Slurm, Lightning would install its own SIGUSR1 requeue: relaytrain owns the requeue here.
    plugins = [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []
    torch.manual_seed(0)
    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        plugins=plugins,
        callbacks=[RelaytrainStop(out, args.step_delay)],
        logger=False,
        enable_checkpointing=False,  # saves only on a stop; a real run also saves periodically
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = checkpoint if checkpoint.exists() else None
    if resume:
        print(f"resuming from {resume} (restart {program.restart_count()})", flush=True)
    trainer.fit(model, ckpt_path=resume, weights_only=True)  # loading a checkpoint runs no code from it
    step = trainer.global_step
    if program.stop_reason():  # RelaytrainStop saved last.ckpt and stopped the Trainer
        print(f"stopping at step {step}: {program.stop_reason()}", flush=True)
        program.exit_for_requeue(step)
    if trainer.is_global_zero:
        checksum = sum(float(p.detach().double().abs().sum()) for p in model.parameters())
        (out / "final.json").write_text(json.dumps({"checksum": checksum, "step": step}) + "\n")
    program.finish(step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
