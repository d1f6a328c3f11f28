"""The Triton AdamW candidate against torch's AdamW, under the Triton interpreter (CPU).

TRITON_INTERPRET must be set before triton is imported, so the checks run in one fresh subprocess
(as the other kernels' tests do)."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

_SCRIPT = textwrap.dedent(
    """
    import copy, json
    import torch
    from dflash_cache.train.adamw_kernel import TritonAdamW
    from dflash_cache.train.optim import clipped_step

    def make(seed=0):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 5000), torch.nn.LayerNorm(5000), torch.nn.Linear(5000, 3))

    def groups(model):
        ps = list(model.parameters())
        return [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]

    def train(model, opt, steps, scale, max_norm, seed=1):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            (model(torch.randn(4, 8, generator=g)).square().sum() * scale).backward()
            if max_norm is None:
                opt.step()
            else:
                clipped_step(opt, list(model.parameters()), max_norm)
            opt.zero_grad(set_to_none=True)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    out = {}
    # eps = 1 makes the update depend on the gradient's scale, so a wrong clip shows
    for name, scale, max_norm in (("no clip", 1.0, None), ("under the clip", 1e-3, 1.0), ("over the clip", 1e3, 1.0)):
        kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1.0 if max_norm else 1e-8)
        ref_model, tri_model = make(), make()
        ref = train(ref_model, torch.optim.AdamW(groups(ref_model), foreach=False, **kw), 3, scale, max_norm)
        tri = train(tri_model, TritonAdamW(groups(tri_model), **kw), 3, scale, max_norm)
        out[name] = rel(tri, ref)
    # The state dict is torch's: two Triton steps, then one more by each optimiser from that state.
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    model = make()
    opt = TritonAdamW(groups(model), **kw)
    train(model, opt, 2, 1.0, None)
    twin = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(groups(twin), foreach=False, **kw)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict may share the tensors
    out["state dict"] = rel(train(model, opt, 1, 1.0, None, seed=2), train(twin, torch_opt, 1, 1.0, None, seed=2))
    out["grad_scale left behind"] = hasattr(opt, "grad_scale")
    # bf16 weights with float32 masters against torch's fused AdamW over float32 weights, fed the same
    # bf16 gradients and clip: the masters follow, each bf16 weight is its master rounded to nearest even
    g = torch.Generator().manual_seed(3)
    ref = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in ((512, 256), (3000,), (77, 5))]
    low = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    fused = torch.optim.AdamW([{"params": ref, "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    tri = TritonAdamW([{"params": low, "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    tri.lower_precision([p for p in low if p.ndim == 2])
    for scale in (1.0, 1e3, 1e-2):  # under and over the clip
        for r, w in zip(ref, low):
            grad = (torch.randn(r.shape, generator=g) * scale).to(w.dtype)
            w.grad, r.grad = grad, grad.to(torch.float32, copy=True)  # fused AdamW writes its gradients back
        clipped_step(fused, ref, 1.0)
        clipped_step(tri, low, 1.0)
    masters = tri.master_weights()
    out["masters rel"] = max(rel(masters.get(w, w).detach(), r.detach()) for r, w in zip(ref, low))
    out["masters rounded"] = all(w.dtype == torch.bfloat16 and bool(torch.equal(w, masters[w].to(torch.bfloat16)))
                                 for w in low if w.ndim == 2)
    out["moments float32"] = all(tri.state[w][k].dtype == torch.float32 for w in low for k in ("exp_avg", "exp_avg_sq"))
    print("RESULTS " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted(_SCRIPT)


@pytest.mark.parametrize("case", ["no clip", "under the clip", "over the clip"])
def test_steps_as_torch_adamw_does(interpreted, case):
    """Three steps with weight decay on the matrices only, with and without the clip as grad_scale."""
    assert interpreted[case] < 1e-6


def test_state_dict_is_torch_adamws(interpreted):
    assert interpreted["state dict"] < 1e-6
    assert interpreted["grad_scale left behind"] is False


def test_master_weights_follow_fused_adamw_over_float32_weights(interpreted):
    assert interpreted["masters rel"] < 1e-6
    assert interpreted["masters rounded"] and interpreted["moments float32"]
