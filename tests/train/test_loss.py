from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_cache.train.loss import chunked_weighted_ce, slot_accuracy, tau_hat

M, H, V = 37, 16, 50


def make(seed=0, zero_rows=(6, 10, 11, 36)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g)
    head = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (M,), generator=g)
    weights = torch.rand(M, generator=g) + 0.1
    idx = torch.tensor(zero_rows, dtype=torch.long)
    weights[idx] = 0.0
    labels[idx] = -100
    # Make a few rows easy so some argmaxes hit their label.
    labels[:5] = (hidden[:5] @ head.T).argmax(-1)
    return hidden, head, labels, weights


def reference(hidden, head, labels, weights):
    h = hidden.double().detach().requires_grad_(True)
    logits = h @ head.double().T
    keep = weights > 0
    ce = F.cross_entropy(logits[keep], labels[keep], reduction="none")
    loss = (ce * weights[keep].double()).sum() / weights.double().sum()
    loss.backward()
    return loss.detach(), h.grad, logits.detach().argmax(-1) == labels


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 36, 37, 4096])
def test_matches_full_logits_reference(chunk_size):
    hidden, head, labels, weights = make()
    h = hidden.clone().requires_grad_(True)
    loss, correct = chunked_weighted_ce(h, head, labels, weights, chunk_size=chunk_size)
    loss.backward()
    ref_loss, ref_grad, ref_correct = reference(hidden, head, labels, weights)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert correct.dtype == torch.bool and not correct.requires_grad
    assert torch.equal(correct, ref_correct)
    assert correct[:5].all() and not correct[[6, 10, 11, 36]].any()


def test_grad_scales_with_upstream_and_zero_rows_ignored():
    hidden, head, labels, weights = make(seed=1)
    h = hidden.clone().requires_grad_(True)
    loss, _ = chunked_weighted_ce(h, head, labels, weights, chunk_size=7)
    (3.0 * loss).backward()
    _, ref_grad, _ = reference(hidden, head, labels, weights)
    torch.testing.assert_close(h.grad.double(), 3.0 * ref_grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(h.grad[[6, 10, 11, 36]], torch.zeros(4, H))
    # Changing what a weight-0 row holds changes nothing.
    hidden2 = hidden.clone()
    hidden2[10] += 100.0
    loss2, _ = chunked_weighted_ce(hidden2, head, labels, weights, chunk_size=7)
    torch.testing.assert_close(loss2, loss.detach())


def test_all_zero_weights_and_no_grad():
    hidden, head, labels, _ = make()
    loss, correct = chunked_weighted_ce(hidden, head, labels.clamp_min(0), torch.zeros(M), chunk_size=8)
    assert loss.item() == 0.0 and correct.shape == (M,)
    h = hidden.clone().requires_grad_(True)
    with torch.no_grad():
        loss, _ = chunked_weighted_ce(h, head, labels, make()[3])
    assert not loss.requires_grad


def test_bf16_hidden_gets_bf16_grad():
    hidden, head, labels, weights = make()
    h = hidden.bfloat16().requires_grad_(True)
    loss, _ = chunked_weighted_ce(h, head.bfloat16(), labels, weights, chunk_size=10)
    loss.backward()
    assert h.grad.dtype == torch.bfloat16
    ref_loss, ref_grad, _ = reference(hidden.bfloat16().float(), head.bfloat16().float(), labels, weights)
    # a bf16 head means bf16 matrix products (logits rounded to bf16 before the float32 softmax)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-3, atol=1e-4)
    torch.testing.assert_close(h.grad.double(), ref_grad, rtol=2e-2, atol=1e-3)


def test_bf16_hidden_is_the_float32_hidden_of_its_values():
    """States handed over in the head's dtype (what training does) give the loss and correct flags of
    float32 states of the same values, and the gradient those get, which is a bf16 product's."""
    hidden, head, labels, weights = make()
    head = head.bfloat16()
    wide = hidden.bfloat16().float().requires_grad_(True)
    narrow = hidden.bfloat16().requires_grad_(True)
    (loss_w, correct_w), (loss_n, correct_n) = (chunked_weighted_ce(h, head, labels, weights, chunk_size=8)
                                                for h in (wide, narrow))
    loss_w.backward()
    loss_n.backward()
    torch.testing.assert_close(loss_n, loss_w, rtol=0, atol=0)
    assert torch.equal(correct_n, correct_w)
    assert narrow.grad.dtype == torch.bfloat16
    torch.testing.assert_close(narrow.grad, wide.grad.bfloat16(), rtol=0, atol=0)
    assert torch.equal(narrow.grad.float(), wide.grad)  # the float32 path only widened a bf16 product


def test_trainable_head_rejected():
    hidden, head, labels, weights = make()
    with pytest.raises(ValueError):
        chunked_weighted_ce(hidden, head.requires_grad_(True), labels, weights)


def test_logits_never_materialised_whole(monkeypatch):
    """No matmul ever produces more than chunk_size rows of logits."""
    hidden, head, labels, weights = make()
    shapes = []
    real_matmul = torch.Tensor.__matmul__

    def spy(a, b):
        out = real_matmul(a, b)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    h = hidden.clone().requires_grad_(True)
    loss, _ = chunked_weighted_ce(h, head, labels, weights, chunk_size=8)
    loss.backward()
    monkeypatch.undo()
    logit_shapes = [s for s in shapes if s[-1] == V]
    assert logit_shapes and all(s[0] <= 8 for s in logit_shapes)


def test_slot_accuracy():
    correct = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1], [1, 1, 1, 0]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    acc = slot_accuracy(correct, valid)
    torch.testing.assert_close(acc, torch.tensor([1.0, 0.5, 0.5, 0.0]))
    assert not torch.isnan(acc).any()


def test_tau_hat():
    for b in (2, 4, 16):
        assert tau_hat(torch.ones(b - 1)) == pytest.approx(b)
    assert tau_hat([0.5, 0.5]) == pytest.approx(1.75)
    assert tau_hat(torch.tensor([0.0, 1.0, 1.0])) == pytest.approx(1.0)
    assert math.isclose(tau_hat([0.9, 0.8]), 1 + 0.9 + 0.72)


def test_rows_of_weight_zero_can_be_left_out():
    """The trainer leaves every block's slot 0 (weight 0) out of the LM head: the loss and the
    gradients of the other rows are those of the full computation."""
    h, head, labels, weights = make()
    weights[::3] = 0.0
    keep = weights != 0
    full = h.clone().requires_grad_(True)
    loss_full, correct_full = chunked_weighted_ce(full, head, labels, weights, chunk_size=6)
    loss_full.backward()
    part = h[keep].clone().requires_grad_(True)
    loss_part, correct_part = chunked_weighted_ce(part, head, labels[keep], weights[keep], chunk_size=6)
    loss_part.backward()
    torch.testing.assert_close(loss_part, loss_full)
    torch.testing.assert_close(part.grad, full.grad[keep])
    assert torch.equal(correct_part, correct_full[keep]) and not full.grad[~keep].any()


def test_unknown_kernel_is_refused():
    hidden, head, labels, weights = make()
    with pytest.raises(ValueError, match="unknown loss kernel 'fused'"):
        chunked_weighted_ce(hidden, head, labels, weights, kernel="fused")


@pytest.mark.parametrize("m, chunk, rows", [(30720, 4096, 3840), (30720, 8192, 7680), (4096, 4096, 4096),
                                            (100, 4096, 128), (37, 7, 7), (37, 8, 8), (0, 4096, 128)])
def test_chunks_are_even_and_aligned_where_that_fits(m, chunk, rows):
    from dflash_cache.train.loss import even_chunk_rows

    got = even_chunk_rows(m, chunk)
    assert got == rows
    assert got <= chunk and -(-m // got) == -(-m // chunk)  # never more chunks than chunk_size gives
