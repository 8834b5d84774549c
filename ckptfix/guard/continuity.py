"""Does a resumed run continue where it stopped? (issue 42 item 5)

The losses a run logged before its checkpoint (a Trainer's `log_history`, restored with `trainer_state.json`)
give where the loss stood and how much it moves from one logged step to the next. The first losses logged
after the resume are compared with that: a jump beyond the run's own spread means the run did not continue
(weights or optimizer state not as saved, other data, another tokenizer). Framework-free: plain numbers in,
a `Problem` out."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ckptfix.guard.problems import Problem

WINDOW = 20  # logged losses before the checkpoint that describe where the run stood
MIN_HISTORY = 4
SPREADS = 6.0  # a jump of more than this many step-to-step spreads (median absolute change) is not noise
MIN_JUMP = 0.05  # relative to the loss: below it never a finding, however steady the run was

LIKELY_CAUSES = ("weights not loaded as saved (a table re-initialised or resized without its rows: "
                 "ignore_mismatched_sizes, a resize after loading), optimizer state dropped or another "
                 "optimizer's (CKF310, CKF303), other samples or another order (CKF314), another tokenizer "
                 "(CKF1xx: `ckptfix inspect CHECKPOINT --tokenizer TOK`)")


@dataclass(frozen=True)
class Baseline:
    """Where the loss stood at the checkpoint: the mean of its last logged values and their step-to-step spread."""

    step: int
    loss: float
    spread: float

    @property
    def limit(self) -> float:
        return self.loss + max(SPREADS * self.spread, MIN_JUMP * abs(self.loss))


def baseline(history: list[dict], step: int) -> Baseline | None:
    """From a Trainer-style log history (dicts with "step" and "loss"), the entries logged up to `step`."""
    losses = [float(h["loss"]) for h in history
              if isinstance(h, dict) and isinstance(h.get("loss"), (int, float)) and isinstance(h.get("step"), int)
              and h["step"] <= step and math.isfinite(h["loss"])][-WINDOW:]
    if len(losses) < MIN_HISTORY:
        return None
    changes = [abs(b - a) for a, b in zip(losses, losses[1:])]
    return Baseline(step, statistics.fmean(losses[-3:]), statistics.median(changes))


def jump(base: Baseline, step: int, loss: float) -> Problem | None:
    """CKF830 when the loss logged at `step` after resuming from `base.step` lies beyond the run's spread."""
    if math.isfinite(loss) and loss <= base.limit:
        return None
    return Problem("CKF830", "warning",
                   f"the run did not continue where it stopped: loss {loss:.4g} at step {step} after resuming from "
                   f"step {base.step}, where its last logged losses averaged {base.loss:.4g} and moved "
                   f"{base.spread:.3g} from one logged step to the next (limit {base.limit:.4g}). Likely: "
                   f"{LIKELY_CAUSES}")
