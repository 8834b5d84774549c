"""A real Lightning `ModelParallelStrategy` run (FSDP2 through Lightning, one CPU rank, gloo), in its own
process: `save FOLDER` trains two steps and `trainer.save_checkpoint`s the DCP folder Lightning writes
(`__0_0.distcp`, `.metadata`, `meta.pt`); `resume FOLDER VOCAB` builds the module for VOCAB rows and resumes
with `Trainer.fit(ckpt_path=FOLDER)`, Lightning's own loading, for one more step. Prints a JSON summary."""

from __future__ import annotations

import json
import math
import sys
import warnings

import torch

STEPS = 2


def _module(vocab_size: int):
    import lightning as L
    from torch.distributed.fsdp import fully_shard

    class TinyLM(L.LightningModule):
        def __init__(self, vocab_size: int):
            super().__init__()
            self.save_hyperparameters()
            self.emb = torch.nn.Embedding(vocab_size, 16)
            self.head = torch.nn.Linear(16, vocab_size)
            self.losses: list[float] = []

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for module in (self.emb, self.head, self):
                fully_shard(module, mesh=mesh)

        def training_step(self, batch, _):
            ids = batch[0]
            loss = torch.nn.functional.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), ids.flatten())
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TinyLM(vocab_size)


def _trainer(steps: int):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))


def _data(vocab: int):
    ids = torch.randint(0, vocab, (8, 6), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    what, folder, vocab = argv[0], argv[1], int(argv[2])
    model, trainer = _module(vocab), _trainer(STEPS if what == "save" else STEPS + 1)
    if what == "save":
        trainer.fit(model, _data(vocab))
        trainer.save_checkpoint(folder)
        rows = model.emb.weight.full_tensor()[:, :4].tolist()
    else:
        trainer.fit(model, _data(vocab), ckpt_path=folder)
        rows = model.emb.weight.full_tensor()[:, :4].tolist()
    opt = trainer.optimizers[0]
    steps = [float(s["step"]) for s in opt.state.values()]
    print(json.dumps({"global_step": trainer.global_step, "losses": model.losses, "rows": rows,
                      "adam_steps": steps, "finite": all(math.isfinite(x) for x in model.losses),
                      "lr": opt.param_groups[0]["lr"]}))


if __name__ == "__main__":
    main(sys.argv[1:])
