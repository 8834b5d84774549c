"""torchtitan's own `CheckpointManager` (torchtitan 0.3.0: components/checkpointer/dcp.py) on one CPU rank
(gloo, FSDP2), in its own process. `save BASE VOCAB` trains two steps and `ckm.save`s `BASE/checkpoint/step-2`;
`resume BASE VOCAB STEP` builds the model for VOCAB rows and `ckm.load(step=STEP)`s, then takes one step.
Prints a JSON summary. torchtitan pins packages transformers 5 cannot share (huggingface_hub), so this
runs only where it is installed (`pip install --no-deps torchtitan==0.3.0 tyro spmd_types` in a venv)."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import torch


class TinyLM(torch.nn.Module):
    """torchtitan's Llama names for the vocab modules: `tok_embeddings`, `norm`, `output`."""

    def __init__(self, vocab: int):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.output = torch.nn.Linear(16, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.tok_embeddings(ids)))


class TrainState:
    """torchtitan's train state (`train.TrainState`): the step as an int32 tensor."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step, dtype=torch.int32)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    what, base, vocab = argv[0], argv[1], int(argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyLM(vocab)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})]
    opts = OptimizersContainer(OptimizersContainer.Config(param_groups=groups, implementation="for-loop"),
                               model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=10)
    state = TrainState()
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
                                      last_save_model_only=False)
    ckm = CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
                            states={"train_state": state}, sd_adapter=None, base_folder=base)

    def step(seed: int) -> float:
        ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(seed))
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opts.step()
        scheds.step()
        opts.zero_grad()
        state.step += 1
        return float(loss)

    if what == "save":
        step(1), step(2)
        ckm.save(curr_step=state.step)
        out = {"step": state.step, "rows": model.tok_embeddings.weight.full_tensor()[:, :3].tolist()}
    else:
        loaded = ckm.load(step=int(argv[3]))
        loss = step(3)
        out = {"loaded": loaded, "step": state.step, "finite": math.isfinite(loss),
               "lr": opts.optimizers[0].param_groups[0]["lr"],
               "adam_steps": sorted({float(s["step"]) for o in opts.optimizers for s in o.state.values()})}
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
