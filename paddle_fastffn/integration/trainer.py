"""The optimizer the Trainer builds while the fast path is on: FastAdamW.

The Trainer is the installed library's (library.py): PaddleFormers' is PaddleNLP's, carried on,
with the same hooks used here. PaddleNLP's Trainer.create_optimizer asks the static Trainer.get_optimizer_cls_and_kwargs(args)
for its class (paddle.optimizer.AdamW for optim="adamw", the default) and builds it with the
Trainer's own arguments (learning-rate scheduler, apply_decay_param_fun, weight decay, global-norm
clipping, multi_precision under AMP O2). With FastFFNOptions.fused_optimizer, that class is
paddle_fastffn.optim.FastAdamW, a subclass of paddle.optimizer.AdamW whose per-parameter update is
our one-pass kernel (and whose global-norm clip is folded into it): same arguments, same state
names, so optimizer checkpoints load both ways with stock PaddleNLP. Other optimizers (args.optim
other than adamw) are left alone.

Checkpoints (resume.py), installed once with the first apply() and kept after revert() (they act
only on models with fused projections or FP8 layers, whose checkpoints must stay stock): the
optimizer the Trainer creates saves and loads the stock layout of its state, and each Trainer
checkpoint gets the FP8 scaling state beside the weights, restored on resume.
"""

from __future__ import annotations

import os

from .options import FastFFNOptions
from .patching import own_attribute, restore_attribute

_ORIGINAL = {}
_CHECKPOINT_HOOKS = {}
_OPTIMIZER_STATE: dict = {}  # FastAdamW's state keywords of the options applied last


def _trainer_class():
    from .library import trainer_class

    return trainer_class()


def _fast_optimizer_cls_and_kwargs(args):
    optimizer_cls, kwargs = _ORIGINAL["get_optimizer_cls_and_kwargs"].__func__(args)
    import paddle

    if optimizer_cls is paddle.optimizer.AdamW:
        from ..optim import FastAdamW

        optimizer_cls = FastAdamW
        kwargs = {**kwargs, **_OPTIMIZER_STATE}
    return optimizer_cls, kwargs


def install_checkpoint_hooks() -> None:
    """Trainer.create_optimizer, _save_checkpoint and _load_optimizer_and_scheduler, each the
    original followed by the fast path's part of the checkpoint (resume.py)."""
    if _CHECKPOINT_HOOKS:
        return

    from ..fp8.weight_cache import track_optimizer
    from . import resume
    from .library import checkpoint_prefix

    trainer = _trainer_class()
    _CHECKPOINT_HOOKS.update(create_optimizer=trainer.create_optimizer, save_checkpoint=trainer._save_checkpoint,
                             load_optimizer=trainer._load_optimizer_and_scheduler)

    def create_optimizer(self, lr_scheduler=None):
        optimizer = _CHECKPOINT_HOOKS["create_optimizer"](self, lr_scheduler)
        # Its parameter updates re-quantise the FP8 weight copies (an instance hook on this
        # optimizer; FastAdamW does it itself): fp8/weight_cache.py.
        track_optimizer(self.optimizer)
        # unified_checkpoint keys optimizer state by the model's structured names: no renaming.
        if not getattr(self.args, "unified_checkpoint", False):
            resume.install_stock_layout(self.optimizer, self.model)
        return optimizer

    def _save_checkpoint(self, model, metrics=None):
        result = _CHECKPOINT_HOOKS["save_checkpoint"](self, model, metrics=metrics)
        folder = os.path.join(self.args.output_dir, f"{checkpoint_prefix()}-{self.state.global_step}")
        resume.save_fp8_state(self.model, folder, self.args.world_size, self.args.process_index)
        return result

    def _load_optimizer_and_scheduler(self, checkpoint):
        result = _CHECKPOINT_HOOKS["load_optimizer"](self, checkpoint)
        if checkpoint:
            resume.load_fp8_state(self.model, checkpoint, self.args.world_size, self.args.process_index)
        return result

    trainer.create_optimizer = create_optimizer
    trainer._save_checkpoint = _save_checkpoint
    trainer._load_optimizer_and_scheduler = _load_optimizer_and_scheduler


def apply(options: FastFFNOptions) -> None:
    install_checkpoint_hooks()
    if not options.fused_optimizer:
        revert()  # imports paddlenlp.trainer only where an earlier apply() patched it
        return
    _OPTIMIZER_STATE.clear()
    _OPTIMIZER_STATE.update(options.optimizer_state())
    trainer = _trainer_class()
    _ORIGINAL.setdefault("get_optimizer_cls_and_kwargs", own_attribute(trainer, "get_optimizer_cls_and_kwargs"))
    trainer.get_optimizer_cls_and_kwargs = staticmethod(_fast_optimizer_cls_and_kwargs)


def revert() -> None:
    if _ORIGINAL:
        restore_attribute(_trainer_class(), "get_optimizer_cls_and_kwargs", _ORIGINAL["get_optimizer_cls_and_kwargs"])
