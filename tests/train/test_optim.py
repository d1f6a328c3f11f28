"""The shared optimiser and schedule (dflash_cache.train.optim)."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.train.optim import adamw, clipped_step, warmup_cosine


def test_warmup_then_cosine_to_the_floor():
    assert [warmup_cosine(s, 100, 4) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert warmup_cosine(4, 100, 4) == pytest.approx(1.0)
    assert warmup_cosine(52, 100, 4) == pytest.approx(0.5)
    assert warmup_cosine(100, 100, 4) == pytest.approx(0.0)
    assert warmup_cosine(100, 100, 4, floor=0.1) == pytest.approx(0.1)
    assert warmup_cosine(52, 100, 4, floor=0.1) == pytest.approx(0.55)
    assert warmup_cosine(500, 100, 4) == pytest.approx(0.0), "past the end it stays at the floor"


def test_only_matrices_are_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = adamw(model, lr=1e-3, weight_decay=0.1, fused=False)
    decayed, free = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and [p.shape for p in decayed["params"]] == [(4, 4)]
    assert free["weight_decay"] == 0.0 and len(free["params"]) == 3  # linear bias, norm weight and bias


@pytest.mark.parametrize("scale", [1e-3, 1e3], ids=["under the clip", "over the clip"])
def test_fused_clipped_step_matches_clip_then_step(scale):
    """The fused optimiser's clip (its grad_scale) updates as clip_grad_norm_ followed by a step does,
    whether the norm is under max_norm or over it; the non-fused path is clip_grad_norm_ itself.
    eps = 1 makes the update depend on the gradient's scale (with AdamW's usual 1e-8 it hardly does)."""
    results = {}
    for fused, clip_in_step in ((True, True), (True, False), (False, True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1.0, weight_decay=0.1, fused=fused)
        params = list(model.parameters())
        for _ in range(3):
            (model(torch.randn(5, 8)).square().sum() * scale).backward()
            if clip_in_step:
                clipped_step(opt, params, max_norm=1.0)
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            opt.zero_grad(set_to_none=True)
        assert not hasattr(opt, "grad_scale"), "the clip must not outlive its step"
        results[fused, clip_in_step] = torch.cat([p.detach().flatten() for p in params])
    reference = results[True, False]
    torch.testing.assert_close(results[True, True], reference, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[False, True], reference, rtol=1e-5, atol=1e-6)


class _ScaleRecorder(torch.optim.SGD):
    """An optimizer that takes the clip as grad_scale, as fused AdamW and TritonAdamW do, and records it."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):
        self.seen = float(self.grad_scale)


def test_clip_of_bf16_gradients_uses_their_float32_norm():
    """bf16 gradients (the master-weight path): the clip's divisor is that of the same values in
    float32. torch's get_total_norm rounds each bf16 tensor's norm to bf16, off by up to ~0.4%."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g).mul(s).to(torch.bfloat16) for n, s in ((1000, 1.2345), (77, 3.0), (4096, 0.1))]
    params = [torch.nn.Parameter(torch.zeros(x.shape, dtype=torch.bfloat16)) for x in grads]
    for p, x in zip(params, grads, strict=True):
        p.grad = x.clone()
    opt = _ScaleRecorder(params, lr=0.1)
    clipped_step(opt, params, 1.0)
    want = (torch.linalg.vector_norm(torch.cat([x.double() for x in grads])).item() + 1e-6) / 1.0
    assert opt.seen == pytest.approx(want, rel=1e-6)


def test_loading_another_optimizers_state_keeps_the_fused_flag():
    """A state dict written by an unfused AdamW (a CPU run, or TritonAdamW's groups) loaded into a
    fused one: it stays fused and takes the clip as grad_scale (torch's load_state_dict alone would
    unfuse it, and its step then refuses grad_scale)."""
    from dflash_cache.train.optim import load_optimizer_state

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    plain_model, fused_model = model(), model()
    plain = adamw(plain_model, lr=1e-2, weight_decay=0.1, fused=False)
    plain_model(torch.ones(2, 4)).sum().backward()
    plain.step()
    fused = adamw(fused_model, lr=1e-2, weight_decay=0.1, fused=True)
    load_optimizer_state(fused, plain.state_dict())
    assert all(g["fused"] for g in fused.param_groups)
    fused_model(torch.ones(2, 4)).sum().backward()
    clipped_step(fused, list(fused_model.parameters()), 1e-3)  # the clip applies: grad_scale is passed


@pytest.mark.parametrize("fused", [False, True], ids=["clip then step", "fused"])
def test_a_step_on_gradients_that_are_not_finite_is_skipped(fused):
    """clipped_step returns whether the gradients were not finite (on the device, no host sync on
    a GPU), and then leaves the weights and the optimiser's moments as they were."""
    dev = "cuda" if fused and torch.cuda.is_available() else "cpu"
    model = torch.nn.Linear(4, 3).to(dev)
    opt = adamw(model, lr=1e-2, weight_decay=0.1, fused=fused)
    model(torch.ones(2, 4, device=dev)).sum().backward()
    assert not bool(clipped_step(opt, list(model.parameters()), 1.0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.ones(2, 4, device=dev)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    assert bool(clipped_step(opt, list(model.parameters()), 1.0))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), moments, strict=True))
