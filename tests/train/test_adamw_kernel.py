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
    # A gradient that is not finite: the step is skipped, weights, masters and moments untouched.
    model = make()
    opt = TritonAdamW(groups(model), **kw)
    opt.lower_precision([model[0].weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the lowered weight's forward and bf16 gradient
        train(model, opt, 1, 1.0, 1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    masters = [m.clone() for m in opt.master_weights().values()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 8)).float().sum().backward()
    model[2].weight.grad[0, 0] = float("nan")
    skipped = clipped_step(opt, list(model.parameters()), 1.0)
    out["non-finite skipped"] = bool(skipped) and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    out["non-finite moments kept"] = all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in
                                         zip(model.parameters(), moments)) and \
        all(torch.equal(a, b) for a, b in zip(opt.master_weights().values(), masters))
    out["found_inf left behind"] = hasattr(opt, "found_inf")
    from tests.train.master_weight_checks import masters_against_fused_adamw
    out |= masters_against_fused_adamw("cpu")
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


def test_a_non_finite_gradient_skips_the_step(interpreted):
    """clipped_step says the gradients were not finite and the kernel writes nothing: weights, their
    float32 masters and the moments are those before the step."""
    assert interpreted["non-finite skipped"] and interpreted["non-finite moments kept"]
    assert interpreted["found_inf left behind"] is False
