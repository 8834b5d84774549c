"""Resume guard: catch training that runs for hours while learning nothing.

Real runs have "trained" with 0 trainable parameters (a peft `LoraConfig` created but never
applied), with LoRA adapters re-frozen by a trainer, with fp16 weights under a GradScaler, with a
loss `.detach()`ed before backward, with NaN gradients, or resumed from a checkpoint whose
embedding or optimizer state no longer fits the model. Each shows up as a flat loss much later.
This package finds them up front, in four layers:

1. Findings (`problems.py`): `Problem`, `TrainingSetupError`, `TrainingSetupWarning`.
2. Setup checks (`setup.py`): `check_training_setup(model, optimizer, scaler)` looks at the
   objects before the first step (cheap, no forward pass).
3. First-step probe (`probe.py`): `StepProbe` watches the first few real optimizer steps
   (gradients arrived, are finite and non-zero, the weights actually changed, the GradScaler did
   not skip every step) and then turns itself into a no-op.
4. Checkpoint loading (`resume.py`): `ResumeGuard.load(path)` reads a checkpoint with ckptfix's
   safe readers, checks that it fits the live model/optimizer/tokenizer (CKF82x), loads it under
   a policy (strict, remap, fresh, reset), then runs 2. and drives 3.

Only torch is imported here; framework integrations live in `ckptfix.integrations`.
"""

from __future__ import annotations

from ckptfix.guard.probe import StepProbe
from ckptfix.guard.problems import Problem, TrainingSetupError, TrainingSetupWarning
from ckptfix.guard.resume import POLICIES, ResumeError, ResumeGuard, ResumeReport
from ckptfix.guard.setup import check_training_setup

__all__ = [
    "Problem",
    "TrainingSetupError",
    "TrainingSetupWarning",
    "check_training_setup",
    "StepProbe",
    "ResumeGuard",
    "ResumeReport",
    "ResumeError",
    "POLICIES",
]
