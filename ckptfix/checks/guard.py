"""The training guard's codes (CKF8xx), declared in the one registry with the checkpoint codes.

The guard looks at live torch objects, not at a `Context`, so these are declarations (code, most
severe level, title, doc) without a check function; `ckptfix.guard` makes the `Problem`s. The
README's guard table is generated from them (`guard_codes_table_markdown()`), and tests/test_docs.py
checks that every code the guard source uses is declared here. Severity is the most severe level a
code reports. CKF801-815: `check_training_setup` and the first-step probe; CKF820-839: loading a
checkpoint (`ResumeGuard`).
"""

from __future__ import annotations

from ckptfix.checks.codes import declare

declare("CKF801", "error", "0 trainable parameters",
        "No parameter requires grad (e.g. a `LoraConfig` never applied with `get_peft_model`).")
declare("CKF802", "error", "adapter parameters frozen",
        "LoRA/adapter parameters present but frozen (all: error; some: warning).")
declare("CKF803", "error", "trainable parameters outside the optimizer",
        "Trainable parameters in no optimizer param group: they never update.")
declare("CKF804", "warning", "frozen parameters in the optimizer",
        "Frozen parameters inside the optimizer: they get no gradients and will not change.")
declare("CKF805", "error", "optimizer state on another device",
        "Optimizer state on another device than its parameter.")
declare("CKF806", "error", "fp16 parameters under a GradScaler",
        "fp16 parameters under an enabled GradScaler: `unscale_` raises \"Attempting to unscale FP16 gradients\"; "
        "keep fp32 master weights with autocast, or use bf16.")
declare("CKF807", "error", "learning rate 0",
        "A param group's learning rate is 0. Info where the live scheduler raises it at its next step (the first "
        "step of a warm-up from 0; the end of a finished schedule resumed with a longer one: the first step "
        "changes nothing, then it trains); a warning at scheduler step 0 when the next lr is unknown or 0; "
        "otherwise an error (the parameters never change).")
declare("CKF808", "error", "GradScaler scale collapsed",
        "GradScaler scale below 1 (warning), below 2^-24 or not finite (error).")
declare("CKF810", "error", "no gradient at all",
        "No parameter got a gradient: the loss graph was cut (`.detach()`, `.item()`, `no_grad`).")
declare("CKF811", "error", "parameters without a gradient",
        "Some trainable parameters got no gradient.")
declare("CKF812", "error", "non-finite gradients",
        "NaN/Inf gradients (named, with counts).")
declare("CKF813", "error", "all-zero gradients",
        "Every gradient exactly zero in a step (single parameters zero on every probed step: warning).")
declare("CKF814", "error", "the step changed nothing",
        "A step left parameters with non-zero gradients unchanged.")
declare("CKF815", "error", "GradScaler skipped steps",
        "GradScaler skipped a step (warning) or every probed step (error).")
declare("CKF820", "error", "checkpoint tensor did not land",
        "A checkpoint tensor did not land in the model (values differ after loading: a shape-filtered or "
        "otherwise partial load left random weights).")
declare("CKF821", "error", "keys on one side only",
        "Parameters missing from the checkpoint (error; buffers: warning), or checkpoint tensors with no place "
        "in the model (error under strict, else a warning).")
declare("CKF822", "error", "optimizer state does not map onto the parameters",
        "Optimizer state does not map onto the parameters (count, group layout, shapes, or order: "
        "`optimizer.load_state_dict` matches by position).")
declare("CKF823", "error", "moment dtype/device differs from its parameter",
        "16-bit moments for 32-bit parameters (warning; fp16 `exp_avg_sq` underflow: error), or live state in "
        "another dtype/device than its parameter after loading (error).")
declare("CKF824", "error", "tokenizer larger than the embedding",
        "The tokenizer has more tokens than the embedding has rows.")
declare("CKF825", "error", "vocab rows differ between checkpoint and model",
        "Embedding/head row count differs between checkpoint and model (strict: error; else resized like "
        "`ckptfix repair`).")
declare("CKF826", "error", "other shape mismatch",
        "Any other tensor whose shape differs between checkpoint and model.")
declare("CKF827", "warning", "training state on one side only",
        "Optimizer/scheduler/scaler state on one side only (e.g. the scheduler would warm up again).")
declare("CKF828", "error", "tokens changed id: rows would load by id",
        "The live tokenizer gives other ids to tokens the checkpoint's rows belong to (named by its ckptfix "
        "record, its folder or `from_tokenizer=`), and the load would keep rows by id: stopped before "
        "anything is loaded.")
declare("CKF829", "error", "checkpoint not whole for its framework's resume",
        "A run folder given as one checkpoint, a Trainer checkpoint whose save did not finish (inspect's CKF311), "
        "or (the HF callback) a Trainer resume that restarted the schedule with a fresh optimizer because "
        "optimizer.pt or scheduler.pt was missing (CKF310): refused before training goes on, naming the newest "
        "whole checkpoint of the run.")
declare("CKF830", "warning", "the loss jumped after resuming",
        "The first loss logged after a resume lies beyond the run's own step-to-step spread around the losses it "
        "logged before the checkpoint (HF callback, from the restored log_history): the run did not continue "
        "where it stopped; the message lists the likely causes.")
declare("CKF831", "warning", "added tokens cannot learn",
        "The tokenizer holds tokens past its base vocabulary, but the input embedding is frozen and nothing trains "
        "its rows (PEFT LoRA without modules_to_save or trainable_token_indices): their rows stay as initialised. "
        "The HF callback says so before the first step, naming the tokens and the PEFT fix.")
