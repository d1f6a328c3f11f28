"""The Triton loss-chunk kernel against the torch one, under the Triton interpreter (CPU).

TRITON_INTERPRET must be set before triton is imported, so every check runs in one fresh
subprocess (as the fp8 kernels' tests do). The CUDA comparison is in test_cuda.py.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from dflash_cache.train.loss import chunked_weighted_ce, logits_loss_and_grad
    from dflash_cache.train.loss_kernel import logits_loss_and_grad_triton

    def case(rows, vocab, dtype, seed, with_grad=True):
        g = torch.Generator().manual_seed(seed)
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
        labels = torch.randint(0, vocab, (rows,), generator=g)
        weights = torch.rand(rows, generator=g) + 0.1
        weights[1], labels[1] = 0.0, -100          # a row left out (weight 0, label -100)
        labels[2] = logits[2].float().argmax()      # a row whose argmax hits its label
        # Ties: row 3's maximum twice in different column blocks (of BLOCK_V), row 4's twice in one block.
        logits[3, 7] = logits[3, vocab - 2] = 50.0
        logits[4, 5] = logits[4, 6] = 50.0
        labels[3], labels[4] = 7, 5
        total = weights.sum() if with_grad else None
        ref = logits_loss_and_grad(logits.clone(), labels, weights, total)
        buf = logits.clone()
        out = logits_loss_and_grad_triton(buf, labels, weights, total)
        res = {"loss_err": abs(float(out[0]) - float(ref[0])) / abs(float(ref[0])),
               "correct": torch.equal(out[1], ref[1]), "correct_first_tie": bool(out[1][3] and out[1][4])}
        if with_grad:
            res["in_place"] = out[2] is buf
            res["grad_err"] = float((out[2].float() - ref[2].float()).abs().max())
            res["grad_scale"] = float(ref[2].float().abs().max())
            res["zero_row"] = bool((out[2][1] == 0).all())
        else:
            res["no_grad"] = out[2] is None and torch.equal(buf, logits)
        return res

    results = {
        "one_block_f32": case(6, 50, torch.float32, 0),
        "two_blocks_f32": case(6, 9000, torch.float32, 1),
        "two_blocks_bf16": case(5, 9000, torch.bfloat16, 2),
        "no_grad": case(5, 300, torch.float32, 3, with_grad=False),
    }
    # Through the chunked loss: loss, correct and the hidden states' gradient.
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(23, 16, generator=g)
    head = torch.randn(700, 16, generator=g)
    labels = torch.randint(0, 700, (23,), generator=g)
    weights = torch.rand(23, generator=g)
    grads = []
    for kernel in ("torch", "triton"):
        h = hidden.clone().requires_grad_(True)
        loss, correct = chunked_weighted_ce(h, head, labels, weights, chunk_size=8, kernel=kernel)
        loss.backward()
        grads.append((float(loss), correct, h.grad))
    (l0, c0, g0), (l1, c1, g1) = grads
    results["chunked"] = {"loss_err": abs(l1 - l0) / abs(l0), "correct": torch.equal(c0, c1),
                          "grad_err": float((g1 - g0).abs().max()), "grad_scale": float(g0.abs().max())}
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted(_SCRIPT)


@pytest.mark.parametrize("name", ["one_block_f32", "two_blocks_f32"])
def test_float32_matches_torch(interpreted, name):
    r = interpreted[name]
    assert r["loss_err"] < 1e-5
    assert r["correct"] and r["correct_first_tie"]
    assert r["in_place"] and r["zero_row"]
    assert r["grad_err"] <= 1e-6 * max(1.0, r["grad_scale"])


def test_bf16_matches_torch_to_its_rounding(interpreted):
    """The interpreter truncates float32 -> bf16 where torch rounds: one bf16 step of the largest entry."""
    r = interpreted["two_blocks_bf16"]
    assert r["loss_err"] < 1e-5
    assert r["correct"] and r["correct_first_tie"]
    assert r["in_place"] and r["zero_row"]
    assert r["grad_err"] <= 2**-7 * r["grad_scale"]


def test_without_gradient_the_logits_are_left_alone(interpreted):
    r = interpreted["no_grad"]
    assert r["loss_err"] < 1e-5 and r["correct"] and r["no_grad"]


def test_chunked_loss_with_the_triton_kernel_matches_torch(interpreted):
    r = interpreted["chunked"]
    assert r["loss_err"] < 1e-5 and r["correct"]
    assert r["grad_err"] <= 1e-5 * r["grad_scale"]
