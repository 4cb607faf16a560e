"""A Hugging Face `transformers.Trainer` run that survives time limits and preemption (docs/programs.md).

    relaytrain launch --command "python examples/hf_trainer.py --out runs/hf/out" --name hf \\
        --nodes 1 --tasks-per-node 1 --signal USR2@180

``RelaytrainStop`` asks relaytrain at every step end whether every rank agreed to stop; if so the
Trainer saves a checkpoint (model, optimizer, scheduler, RNG states) and leaves its loop, and the
process exits for requeue. The next job resumes from the Trainer's last checkpoint. The model is a
tiny ``LlamaForCausalLM`` built from a config and the data is synthetic: nothing is downloaded.
"""

from relaytrain import program

program.install()  # before torch/transformers are imported: a stop signal during start-up is kept

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402


class RelaytrainStop(TrainerCallback):
    """On a stop agreed by every rank: save now and stop training (then call exit_for_requeue)."""

    def __init__(self, step_delay: float = 0.0):
        self.step_delay = step_delay  # seconds of sleep per step, to make a tiny run last

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.step_delay)
        if program.should_stop(state.global_step):  # every rank calls it at every step end
            control.should_save = True
            control.should_training_stop = True
        return control


class TokenData(torch.utils.data.Dataset):
    """Deterministic synthetic token sequences (no tokenizer, no download)."""

    def __init__(self, size: int, seq_len: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (size, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = LlamaConfig(vocab_size=128, num_hidden_layers=2, max_position_embeddings=64, **sizes)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",  # saves only when relaytrain says stop; a real run also saves periodically
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=TokenData(256, 16, config.vocab_size),
        callbacks=[RelaytrainStop(args.step_delay)],
    )
    last = get_last_checkpoint(args.out) if Path(args.out).is_dir() else None
    if last:
        print(f"resuming from {last} (restart {program.restart_count()})", flush=True)
    trainer.train(resume_from_checkpoint=last)
    step = trainer.state.global_step
    if program.stop_reason():  # the Trainer saved checkpoint-<step> and stopped
        program.exit_for_requeue(step)
    if trainer.is_world_process_zero():
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        checksum = sum(float(p.detach().double().abs().sum()) for p in model.parameters())
        Path(args.out, "final.json").write_text(json.dumps({"losses": losses, "checksum": checksum}) + "\n")
    program.finish(step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
