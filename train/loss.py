"""Weighted cross-entropy through the frozen LM head without ever holding [M, V] logits, and the
per-slot acceptance statistics derived from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dflash_cache.train.loss_kernel import logits_loss_and_grad_triton

DEFAULT_EPS = 1e-6


def logits_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                         total_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's part of the loss, from its logits [c, V] (the head's dtype, softmax in float32).

    Returns (sum of weights * CE, correct [c], d loss / d logits in the logits' dtype, or None when
    `total_weight` is None). grad = (softmax - onehot(label)) * weights / total_weight. Every [c, V]
    intermediate is updated in place, so eager execution holds one float32 copy of the logits.
    The other kernels in `LOSS_KERNELS` compute the same on the GPU in fewer passes.
    """
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    target = labels.clamp_min(0)  # rows with weight 0 may carry -100
    ce = lse - x.gather(1, target[:, None]).squeeze(1)
    loss_sum = torch.where(weights != 0, ce * weights, torch.zeros_like(ce)).sum()
    correct = x.argmax(dim=-1) == labels
    if total_weight is None:
        return loss_sum, correct, None
    probs = x.sub_(lse[:, None]).exp_()
    # A scatter, not a compared one-hot: as fast compiled (H200), and no [c, V] mask when eager.
    probs.scatter_add_(1, target[:, None], torch.full_like(ce[:, None], -1.0))
    probs.mul_((weights / total_weight)[:, None])
    return loss_sum, correct, probs.to(logits.dtype)


# How a chunk's logits become its loss, argmax and gradient: "torch" runs `logits_loss_and_grad`
# (any device; the trainer's with --no-compile); "triton" is the hand-written two-pass kernel, which
# also writes the gradient over the logits (GPUs; the trainer's default there). The kernels it was
# chosen over are bench/variants.py's.
LOSS_KERNELS: dict[str, Callable[[], Callable]] = {
    "torch": lambda: logits_loss_and_grad,
    "triton": lambda: logits_loss_and_grad_triton,
}


CHUNK_ALIGN = 128  # rows: a multiple of the matrix-product tile height


def even_chunk_rows(m: int, chunk_size: int) -> int:
    """Rows per chunk when `m` rows go through in chunks of at most `chunk_size`: as few chunks as
    that allows, of about equal size (a multiple of CHUNK_ALIGN where that fits). In a traced step on
    an H200, the 2,048-row tail of 30,720 rows in chunks of 4,096 ran its two vocabulary-wide products
    at 0.85 of the full chunks' rate; alone (bench/lm_head.py) it did not, and the step time did not
    move measurably: equal chunks are at worst as fast."""
    n_chunks = max(1, -(-m // chunk_size))
    rows = max(1, -(-m // n_chunks))  # 1 for no rows: the loop below then runs no chunk
    aligned = -(-rows // CHUNK_ALIGN) * CHUNK_ALIGN
    return aligned if aligned <= chunk_size else rows


class _ChunkedWeightedCE(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, the gradient wrt `hidden`; backward only scales it.

    Peak extra memory: one chunk's [chunk_size, V] logits (with the "torch" kernel also their float32
    softmax), and grad_hidden [M, H]. The two matrix products run in
    the head's dtype (bf16 on the GPU: tensor cores, float32 accumulation) and the softmax in float32;
    a float32 head keeps everything float32.
    """

    @staticmethod
    def forward(ctx, hidden, lm_head_weight, labels, weights, chunk_size, eps, need_grad, chunk_fn):
        m = hidden.shape[0]
        w_all = weights.detach().float()
        total_w = w_all.sum().clamp_min(eps)
        head = lm_head_weight.detach()
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(m, dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        rows = even_chunk_rows(m, chunk_size)
        for start in range(0, m, rows):
            end = min(start + rows, m)
            logits = hidden[start:end].detach().to(head.dtype) @ head.T
            part, correct[start:end], grad_logits = chunk_fn(logits, labels[start:end], w_all[start:end],
                                                                 total_w if need_grad else None)
            loss = loss + part
            if grad_hidden is not None and hidden.dtype == head.dtype:  # (grad_hidden: exactly with need_grad)
                torch.mm(grad_logits, head, out=grad_hidden[start:end])
            elif grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits @ head).to(hidden.dtype)
            del logits, grad_logits
        loss = loss / total_w
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        ctx.need_grad = need_grad
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grad_hidden = None
        if ctx.need_grad and ctx.needs_input_grad[0]:
            (saved,) = ctx.saved_tensors
            grad_hidden = saved * grad_loss.to(saved.dtype)
        return grad_hidden, None, None, None, None, None, None, None


def chunked_weighted_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                        weights: torch.Tensor, chunk_size: int = 4096, eps: float = DEFAULT_EPS, *,
                        kernel: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, correct) for hidden [M, H] through the frozen lm_head_weight [V, H].

    loss = sum_m weights[m] * CE(logits[m], labels[m]) / max(sum(weights), eps), a float32 scalar
    differentiable wrt `hidden` only; correct = bool [M], argmax(logits[m]) == labels[m]. Rows with
    weight 0 contribute nothing (their label may be -100). Logits exist one chunk at a time, in
    the head's dtype; the gradient wrt `hidden` is computed in the forward pass and kept as [M, H].
    `kernel` names how each chunk's softmax, loss and gradient run (`LOSS_KERNELS`).
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and lm_head_weight {tuple(lm_head_weight.shape)} "
                         "must be [M, H] and [V, H]")
    if labels.shape != hidden.shape[:1] or weights.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} and weights {tuple(weights.shape)} must be "
                         f"[{hidden.shape[0]}]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"unknown loss kernel {kernel!r}; choose one of {sorted(LOSS_KERNELS)}")
    if lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight must be frozen (requires_grad=False); this loss gives it no gradient")
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _ChunkedWeightedCE.apply(hidden, lm_head_weight, labels.long(), weights, chunk_size, eps, need_grad,
                                    LOSS_KERNELS[kernel]())


def slot_accuracy(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """correct, valid: bool [A, B] -> float32 [B], each slot's accuracy over its valid rows (0 if none)."""
    valid = valid.bool()
    hits = (correct.bool() & valid).sum(0).float()
    counts = valid.sum(0).float()
    return torch.where(counts > 0, hits / counts.clamp_min(1), torch.zeros_like(hits))


def tau_hat(acc: torch.Tensor | Sequence[float]) -> float:
    """Expected accepted length per block from per-slot accuracies of slots 1..B-1:
    1 + sum_k prod_{j<=k} acc_j (the bonus token plus the expected accepted prefix)."""
    acc = torch.as_tensor(acc, dtype=torch.float64).detach().cpu().flatten()
    return float(1.0 + torch.cumprod(acc, dim=0).sum())
