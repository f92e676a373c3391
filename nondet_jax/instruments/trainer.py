"""The adaptor ``nondet_jax.train`` uses: instruments for a registered model and a :class:`Config`.

Two per-example modes (``InstrumentsConfig.per_example``):

* ``train_pass`` (default): the training step's own backward pass is recorded
  (:func:`.layerwise.value_grad_and_tape`, BatchNorm in training mode) and per-example
  contributions are formed from each layer's input and output gradient; they sum exactly to the
  batch gradient. With BatchNorm in training mode they are the decomposition of that gradient by
  example, not gradients of per-example losses (example ``i``'s activations also move the batch
  statistics every other example sees); without BatchNorm they are the per-example gradients.
  Models with layers the recorder does not support fall back to ``frozen_bn`` (decided while tracing).
* ``frozen_bn``: a second pass, described below.

``frozen_bn``:

* Per-example loss: the model in inference mode, so BatchNorm normalises with *fixed* statistics
  (the ``context``: the batch's own statistics at the current weights, measured by a momentum-0
  training-mode pass only at tracked steps), while dropout stays on with the example's own key
  (the classifier head is switched to training mode by a flax method interceptor).
* Per-example gradients: in inference mode examples do not interact, so they come from one
  batched backward pass of the summed loss (:mod:`.layerwise`), ``vmap(grad)`` where a layer is
  not supported.
* Curvature loss: the training loss itself (BatchNorm in training mode), so HessMaxEV is the
  sharpness of the objective SGD descends (compare it with 2 / learning rate).
* Learning rate for CABS: the schedule's value at the step.
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax.numpy as jnp
import optax

from nondet_jax.instruments import layerwise
from nondet_jax.instruments.core import Instruments, make
from nondet_jax.instruments.quantities import QUANTITIES
from nondet_jax.instruments.schedules import linear, log_over_run
from nondet_jax.models.common import Head

CROSS_ENTROPY = optax.softmax_cross_entropy_with_integer_labels  # the catalogue's per-example loss


def _head_in_training_mode(next_fun, args, kwargs, context):
    if isinstance(context.module, Head) and context.method_name == "__call__" and context.module.dropout > 0:
        if "train" in kwargs:
            kwargs = {**kwargs, "train": True}
        else:
            args = (args[0], True) + tuple(args[2:])
    return next_fun(*args, **kwargs)


def schedule_for(cfg, total_steps: int):
    """The schedule an ``InstrumentsConfig`` names."""
    if cfg.schedule == "log":
        return log_over_run(total_steps, cfg.log_points)
    return linear(cfg.every)


def model_outputs(model: nn.Module, batch_loss: Callable = CROSS_ENTROPY) -> tuple[Callable, Callable, Callable]:
    """``(example_output, batched_output, output_loss)`` of a catalogue ``model``: the logits the
    instruments use (inference mode, BatchNorm with the fixed statistics passed as ``context``, dropout
    on with the example's own key) of one example and of a whole batch, and the loss of one example's
    logits (``batch_loss``: per-example ``(logits, labels) -> losses``)."""
    def variables(params, stats):
        return {"params": params, "batch_stats": stats} if stats else {"params": params}

    def example_output(params, example, stats):
        x, _, dkey = example
        with nn.intercept_methods(_head_in_training_mode):
            return model.apply(variables(params, stats), x[None], train=False,
                               dropout_keys=None if dkey is None else dkey[None])[0]

    def batched_output(params, batch, stats):
        x, _, dkeys = batch
        with nn.intercept_methods(_head_in_training_mode):
            return model.apply(variables(params, stats), x, train=False, dropout_keys=dkeys)

    return example_output, batched_output, example_output_loss(batch_loss)


def evaluate_outputs(evaluate: Callable, batch_loss: Callable) -> tuple[Callable, Callable, Callable]:
    """:func:`model_outputs` for any model (the user's Linen or NNX module), from its
    ``evaluate(variables, x) -> (logits, features)``: inference mode, BatchNorm with the fixed
    statistics passed as ``context``, dropout off (a user's model draws dropout from one key per batch,
    which no single example's pass can reproduce)."""
    def variables(params, stats):
        return {"params": params, "batch_stats": stats}

    def example_output(params, example, stats):
        return evaluate(variables(params, stats), example[0][None])[0][0]

    def batched_output(params, batch, stats):
        return evaluate(variables(params, stats), batch[0])[0]

    return example_output, batched_output, example_output_loss(batch_loss)


def example_output_loss(batch_loss: Callable) -> Callable:
    """``(outputs, example) -> scalar`` from a per-example ``batch_loss(outputs (B, ...), labels (B, ...))``."""
    def output_loss(outputs, example):
        return batch_loss(outputs[None], example[1][None])[0]

    return output_loss


def model_losses(model: nn.Module, batch_loss: Callable = CROSS_ENTROPY,
                 outputs: tuple[Callable, Callable, Callable] | None = None) -> tuple[Callable, Callable]:
    """``(example_loss, batched_example_loss)``: the loss of :func:`model_outputs`' outputs (or of
    ``outputs``, as :func:`evaluate_outputs` gives them), for one example and for a whole batch at once."""
    example_output, batched_output, output_loss = outputs or model_outputs(model, batch_loss)

    def example_loss(params, example, stats):
        return output_loss(example_output(params, example, stats), example)

    def batched_example_loss(params, batch, stats):
        return batch_loss(batched_output(params, batch, stats), batch[1])

    return example_loss, batched_example_loss


def for_model(cfg, model: nn.Module | None, train_loss: Callable, batch_stats_of: Callable, total_steps: int, *,
              layerwise: bool = True, batch_loss: Callable = CROSS_ENTROPY,
              outputs: tuple[Callable, Callable, Callable] | None = None, shared_key: bool = False) -> Instruments:
    """Instruments for one replica of ``model``.

    Args:
      cfg: the ``InstrumentsConfig``.
      model: a catalogue model (Linen, with ``dropout_keys``), or None with ``outputs``.
      train_loss: ``(params, batch_stats, x, y, dropout_keys) -> (loss, aux)``, the training loss, with
        the outputs first in ``aux``.
      batch_stats_of: ``(params, batch_stats, x) -> batch statistics`` of ``x`` at ``params`` (``update``'s
        ``context`` is the state's ``batch_stats``, {} without BatchNorm).
      layerwise: per-example gradients from one batched backward pass (:mod:`.layerwise`; falls back
        to ``vmap(grad)`` by itself for layers it does not support); False forces ``vmap(grad)``.
      batch_loss: the per-example loss of the outputs, ``(outputs (B, ...), labels) -> (B,)``, whose mean
        ``train_loss`` is.
      outputs: ``(example_output, batched_output, output_loss)`` for a model that is not the catalogue's
        (:func:`evaluate_outputs`).
      shared_key: the model draws dropout from one key per batch, which the batch passed to ``update``
        carries broadcast along its batch axis (:func:`batch_of`); the training loss gets that one key.
    The batch passed to ``update`` is ``(x, y, dropout_keys or None)``.
    """
    if cfg.per_example not in ("train_pass", "frozen_bn"):
        raise ValueError(f"unknown per_example mode {cfg.per_example!r}; choose train_pass or frozen_bn")
    outputs = outputs or model_outputs(model, batch_loss)
    example_loss, batched_example_loss = model_losses(model, batch_loss, outputs)
    example_output, batched_output, output_loss = outputs

    def loss_of_batch(params, batch, stats):
        x, y, dkeys = batch
        return train_loss(params, stats, x, y, dkeys[0] if shared_key and dkeys is not None else dkeys)[0]

    inst = make(cfg.config, example_loss, schedule=schedule_for(cfg, total_steps), batch_loss_fn=loss_of_batch,
                context_fn=lambda params, batch, stats: batch_stats_of(params, stats, batch[0]), chunk=cfg.chunk,
                hess_iters=cfg.hess_iters, hess_probes=cfg.hess_probes, hess_tol=cfg.hess_tol or None,
                norms=cfg.norms, batched_example_loss=batched_example_loss if layerwise else None,
                example_output=example_output, output_loss=output_loss,
                batched_output=batched_output if layerwise else None, curvature=cfg.curvature)
    if cfg.per_example == "frozen_bn" or not layerwise:
        return inst
    return inst._replace(value_grad_and_tape=functools.partial(train_pass_grad, train_loss, batch_loss=batch_loss))


def batch_of(x, y, dropout, shared_key: bool):
    """The batch ``update`` takes: ``(x, y, dropout)``, a single ``dropout`` key (``shared_key``)
    broadcast along the batch axis so that every leaf has one, as chunking and ``vmap`` need."""
    if shared_key and dropout is not None:
        dropout = jnp.broadcast_to(dropout, (x.shape[0], *dropout.shape))
    return x, y, dropout


def defer_in_epoch(inst: Instruments) -> bool:
    """Whether ``nondet_jax.train`` may measure an unrolled epoch's steps after them, in one rolled
    loop: in train_pass mode without curvature quantities the instruments run no convolution (XLA:CPU
    runs convolutions inside loops on a slow path, so those stay inline)."""
    return inst.value_grad_and_tape is not None and not any(
        QUANTITIES[q].needs & {"hvp", "diagonal"} for q in inst.quantities)


def train_pass_grad(train_loss: Callable, params, batch_stats, x, y, dropout_keys, *,
                    batch_loss: Callable = CROSS_ENTROPY):
    """``jax.value_and_grad(train_loss, has_aux=True)`` plus the :class:`.layerwise.Tape` of that same
    backward pass, with output gradients of the *summed* loss and the per-example training-mode losses
    (``train_loss`` is the mean of ``batch_loss`` and returns the outputs first in its aux); the tape is
    None when a layer is not supported."""
    (loss, aux), grads, tape = layerwise.value_grad_and_tape(train_loss, params, batch_stats, x, y, dropout_keys,
                                                             training=True)
    if tape is not None:
        tape = tape.scaled(x.shape[0], batch_loss(aux[0], y))
    return (loss, aux), grads, tape
