"""What training prints: one short line per logging step, whatever the model's depth.

Trainer's own callbacks print the whole log dict, and ours carries per-teacher and per-layer figures
(`cos_layer/<teacher>/<layer>`, 30 of them on a 30-layer student): a 1,500-character line a person cannot
read. The console shows the run-level scalars (keys without a `/`); every figure stays in `metrics.jsonl`
(and TensorBoard / wandb with `report_to`).
"""

from __future__ import annotations

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

HIDDEN = {"total_flos"}
SHORT = {"learning_rate": "lr"}


def console_line(logs: dict, step: int, max_steps: int) -> str:
    """`step 4/20 | loss 1.205 | ce 0.8234 | ...`: the scalars of one log record, per-teacher / per-layer ones left out."""
    def fmt(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    shown = [f"{SHORT.get(k, k)} {fmt(v)}" for k, v in logs.items() if "/" not in k and k not in HIDDEN]
    return " | ".join([f"step {step}/{max_steps}", *shown])


class ConsoleProgressCallback(ProgressCallback):
    """Trainer's progress bar, with `console_line` instead of the log dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(console_line(logs, state.global_step, state.max_steps))


class ConsolePrinterCallback(TrainerCallback):
    """`disable_tqdm`'s printer, with `console_line` instead of the log dict."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            print(console_line(logs, state.global_step, state.max_steps), flush=True)


def use_console_callbacks(trainer) -> None:
    """Swap Trainer's printing callbacks for ours (whichever of the two `disable_tqdm` picked)."""
    for theirs, ours in ((ProgressCallback, ConsoleProgressCallback), (PrinterCallback, ConsolePrinterCallback)):
        if any(type(cb) is theirs for cb in trainer.callback_handler.callbacks):
            trainer.remove_callback(theirs)
            trainer.add_callback(ours)
