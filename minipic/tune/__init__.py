"""``minipic tune``: block-attention tuning of a model from the model itself.

Modules: ``data`` (tuning items, and the split that keeps them away from ``minipic eval``'s),
``layout`` (the span layout as a transformers attention mask), ``objective`` (self-distillation:
examples and the loss), ``trainer`` (LoRA, the loop, checkpoints), ``report`` (held-out KL and
F1 against the base model), ``cli`` (the command line; its docstring is ``minipic tune
--help``'s).
"""
