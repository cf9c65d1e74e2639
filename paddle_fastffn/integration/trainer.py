"""The optimizer PaddleNLP's Trainer builds while the fast path is on: FastAdamW.

PaddleNLP's Trainer.create_optimizer asks the static Trainer.get_optimizer_cls_and_kwargs(args)
for its class (paddle.optimizer.AdamW for optim="adamw", the default) and builds it with the
Trainer's own arguments (learning-rate scheduler, apply_decay_param_fun, weight decay, global-norm
clipping, multi_precision under AMP O2). With FastFFNOptions.fused_optimizer, that class is
paddle_fastffn.optim.FastAdamW, a subclass of paddle.optimizer.AdamW whose per-parameter update is
our one-pass kernel (and whose global-norm clip is folded into it): same arguments, same state
names, so optimizer checkpoints load both ways with stock PaddleNLP. Other optimizers (args.optim
other than adamw) are left alone.
"""

from __future__ import annotations

from .options import FastFFNOptions
from .patching import own_attribute, restore_attribute

_ORIGINAL = {}


def _trainer_class():
    from paddlenlp.trainer import trainer

    return trainer.Trainer


def _fast_optimizer_cls_and_kwargs(args):
    optimizer_cls, kwargs = _ORIGINAL["get_optimizer_cls_and_kwargs"].__func__(args)
    import paddle

    if optimizer_cls is paddle.optimizer.AdamW:
        from ..optim import FastAdamW

        optimizer_cls = FastAdamW
    return optimizer_cls, kwargs


def apply(options: FastFFNOptions) -> None:
    if not options.fused_optimizer:
        revert()  # imports paddlenlp.trainer only where an earlier apply() patched it
        return
    trainer = _trainer_class()
    _ORIGINAL.setdefault("get_optimizer_cls_and_kwargs", own_attribute(trainer, "get_optimizer_cls_and_kwargs"))
    trainer.get_optimizer_cls_and_kwargs = staticmethod(_fast_optimizer_cls_and_kwargs)


def revert() -> None:
    if _ORIGINAL:
        restore_attribute(_trainer_class(), "get_optimizer_cls_and_kwargs", _ORIGINAL["get_optimizer_cls_and_kwargs"])
