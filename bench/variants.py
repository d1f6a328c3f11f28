"""The variants the benchmarks compare the trainer's choices against, kept out of the library.

The library runs one way; each variant here puts an alternative in place of one of its parts, by
subclassing or by setting an attribute of one object (never of a class or module, so that nothing
else in the process changes):

* `use_every_row`: a step runner's drafter forward on every row of the blocks, where the trainer
  runs the first layer's projections on the distinct block rows and the last layer's output
  projection and MLP on the scored rows only (bench/train.py --compare-full-rows); `every_row_flops`
  counts that step's work.
* `register_loss_kernels`: the LM-head loss's chunk kernels the Triton one was chosen over,
  "inductor" (torch.compile of the torch function) and "one-read" (bench/one_read_loss.py), by name
  in dflash_cache.train.loss.LOSS_KERNELS (bench/train.py --loss-kernels).
* `compile_with_options`: a drafter's layers compiled with other inductor settings
  (bench/train.py --compile-options); `compiled_state`/`set_compiled_state` swap between them.
* `LaunchedAdamW`: TritonAdamW with its kernel's launch settings chosen per step (bench/optimizer.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from dflash_cache.train.adamw_kernel import TritonAdamW
from dflash_cache.train.anchors import Blocks
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter, _own_copy, dynamic_shape_options, scored_rows
from dflash_cache.train.flops import StepFlops, linear_flops, step_flops
from dflash_cache.train.loss import LOSS_KERNELS, logits_loss_and_grad
from dflash_cache.train.step import StepRunner


def every_row_flops(cfg: DrafterConfig, *, context_tokens: int, num_blocks: int, prefix_keys: int) -> StepFlops:
    """`step_flops` of a step whose drafter runs every row of the blocks through every layer."""
    rows = num_blocks * cfg.block_size
    return dataclasses.replace(
        step_flops(cfg, context_tokens=context_tokens, num_blocks=num_blocks, prefix_keys=prefix_keys),
        linears=linear_flops(cfg, context_tokens=context_tokens, num_blocks=num_blocks, first_rows=rows,
                             last_rows=rows))


def _every_row_hidden(runner: StepRunner, net: torch.nn.Module, features: torch.Tensor, ctx_positions: torch.Tensor,
                      blocks: Blocks, masks: dict, *, static: bool, eager: bool) -> torch.Tensor:
    """StepRunner._scored_hidden on every row: the drafter's plain forward, then the scored rows."""
    head = runner.drafter.head
    hidden = net(features, ctx_positions, head.embed(blocks.input_ids.reshape(-1)), blocks.position_ids.reshape(-1),
                 masks, static=static, eager=eager, out_dtype=head.lm_head_weight.dtype)
    return scored_rows(hidden, runner.cfg.block_size)


def _every_row_step_flops(runner: StepRunner, batch, blocks: Blocks) -> float:
    if blocks.prefix_keys is None:  # as StepRunner._step_flops: called only for anchors that counted them
        raise ValueError("_step_flops: the anchors were sampled on the device, without prefix_keys")
    return every_row_flops(runner.drafter_cfg, context_tokens=batch.num_tokens, num_blocks=blocks.real_anchors,
                           prefix_keys=blocks.prefix_keys).total


def use_every_row(runner: StepRunner, on: bool = True) -> None:
    """Make `runner`'s steps run the drafter on every row of the blocks (and count their FLOPs so),
    or, with `on` False, the trainer's way again. The same step: the same loss and gradients to
    float32 rounding (tests/train/test_trainer.py checks it)."""
    if on:
        runner._scored_hidden = functools.partial(_every_row_hidden, runner)
        runner._step_flops = functools.partial(_every_row_step_flops, runner)
    else:
        runner.__dict__.pop("_scored_hidden", None)
        runner.__dict__.pop("_step_flops", None)


@functools.cache
def compiled_logits_loss_and_grad() -> Callable:
    """`logits_loss_and_grad` under torch.compile, built once per process (dynamic chunk rows): one
    generated reduction kernel per chunk, which also holds the chunk's gradient apart."""
    return torch.compile(logits_loss_and_grad, dynamic=True)


def register_loss_kernels() -> None:
    """Name the loss kernels the trainer's was chosen over in LOSS_KERNELS: "inductor" and
    "one-read" (a GPU's: bench/one_read_loss.py)."""
    def one_read() -> Callable:
        from bench.one_read_loss import logits_loss_and_grad_one_read

        return logits_loss_and_grad_one_read

    LOSS_KERNELS.setdefault("inductor", compiled_logits_loss_and_grad)
    LOSS_KERNELS.setdefault("one-read", one_read)


def compiled_state(model: DFlashDrafter) -> tuple:
    """What `compile_layers` made of `model`: its graphs and how it compiles new ones."""
    return model._dynamic_runners, model._static_runners, model.__dict__.get("_graph")


def set_compiled_state(model: DFlashDrafter, state: tuple) -> None:
    """Put back graphs `compiled_state` took."""
    model._dynamic_runners, model._static_runners, graph = state
    if graph is None:
        model.__dict__.pop("_graph", None)
    else:
        model._graph = graph


def compile_with_options(model: DFlashDrafter, options: dict, attention_kernels: str = "triton") -> tuple:
    """Compile `model`'s layers again, every graph with the inductor settings `options` too; returns
    the state it had before (`set_compiled_state` puts it back)."""
    before = compiled_state(model)

    def graph(fn: Callable, *, dynamic: bool) -> Callable:
        return torch.compile(_own_copy(fn), dynamic=dynamic,
                             options={**options, **(dynamic_shape_options() if dynamic else {})})

    model._graph = graph
    model.compile_layers(attention_kernels=attention_kernels)
    return before


class LaunchedAdamW(TritonAdamW):
    """TritonAdamW whose kernel runs `block` elements and `num_warps` warps a program, as set
    between steps (the same parameters, masters and moments for each); `block` None is the
    library's choice."""

    def __init__(self, params, *, block: int | None = None, num_warps: int | None = None, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.block, self.num_warps = block, num_warps

    def _launch(self, interpret: bool) -> tuple[int, int]:
        block, warps = super()._launch(interpret)
        return self.block or block, self.num_warps or warps
