"""bf16 linear weights with float32 masters against autocast over float32 weights, on the CPU.

The trainer's GPU precision runs here under CPU autocast, its TritonAdamW under the Triton
interpreter (in a subprocess: TRITON_INTERPRET must be set before triton is imported). Both trainers
take the same batches and anchors; the step must compute the same thing, and a checkpoint must keep
the masters, not their rounding."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflash_cache.launch import launch
from dflash_cache.train.precision import Precision, fp32_allreduce_hook, linear_weights
from tests.triton_interpreter import run_interpreted

_SCRIPT = textwrap.dedent(
    """
    import itertools, json
    from pathlib import Path
    import torch
    from safetensors.torch import load_file
    from dflash_cache.train.adamw_kernel import TritonAdamW
    from dflash_cache.train.epoch_plan import Position
    from dflash_cache.train.optim import BETAS, EPS, param_groups
    from dflash_cache.train.precision import Precision
    from dflash_cache.train.trainer import Trainer
    from tools.make_demo_drafter import demo_train_config

    torch.set_num_threads(1)
    cache, out = Path(CACHE), Path(OUT)

    def trainer(name, master):
        return Trainer.build(demo_train_config(cache, out / name, max_steps=10), device=torch.device("cpu"),
                             precision=Precision(autocast=True, master_weights=master))

    ref, low = trainer("ref", False), trainer("low", True)
    # the reference steps float32 weights with the same kernel (HAS_MASTER off) and the same clip, so
    # that any difference is the precision's; TritonAdamW against torch's AdamW: test_adamw_kernel.py
    triton_opt = TritonAdamW(param_groups(ref.model, ref.cfg.weight_decay), lr=ref.cfg.lr, betas=BETAS, eps=EPS)
    for new, old in zip(triton_opt.param_groups, ref.drafter.optimizer.param_groups, strict=True):
        new.update(lr=old["lr"], initial_lr=old["initial_lr"])
    ref.drafter.optimizer = ref.drafter.schedule.scheduler.optimizer = triton_opt
    batches = [b for _, b in itertools.islice(ref.source.iterate(Position(0, 0)), 4)]
    losses = []
    for batch in batches[:3]:
        losses.append((float(ref.runner.train_step(batch)["loss"]), float(low.runner.train_step(batch)["loss"])))
    masters = {id(p): m for p, m in low.drafter.optimizer.master_weights().items()}
    ref_params = dict(ref.model.named_parameters())
    low_params = dict(low.model.named_parameters())
    res = {
        "lowered": sorted(n for n, p in low_params.items() if p.dtype == torch.bfloat16),
        "linear names": sorted(n for n, p in low_params.items() if p.ndim == 2),
        "ref dtypes": sorted({str(p.dtype) for p in ref_params.values()}),
        "losses equal": all(a == b for a, b in losses),
        "weights rel": max(float((masters.get(id(p), p) - ref_params[n]).abs().max() / ref_params[n].abs().max())
                           for n, p in low_params.items()),
        "rounding exact": all(bool(torch.equal(p, masters[id(p)].to(p.dtype))) for p in low_params.values()
                              if id(p) in masters),
    }
    # a checkpoint holds the float32 masters; a resumed trainer gets them back, moments unrounded
    path = low.save()
    saved = load_file(path / "drafter.safetensors")
    res["saved dtypes"] = sorted({str(t.dtype) for t in saved.values()})
    res["saved are masters"] = all(bool(torch.equal(saved[n], masters.get(id(p), p).detach()))
                                   for n, p in low_params.items())
    again = trainer("low", True)
    res["restored"] = again.checkpointer.restore()
    again_params = dict(again.model.named_parameters())
    again_masters = {id(p): m for p, m in again.drafter.optimizer.master_weights().items()}
    res["masters restored"] = all(bool(torch.equal(again_masters[id(again_params[n])], masters[id(p)]))
                                  for n, p in low_params.items() if id(p) in masters)
    res["moments restored"] = all(
        again.drafter.optimizer.state[again_params[n]][k].dtype == torch.float32
        and bool(torch.equal(again.drafter.optimizer.state[again_params[n]][k], low.drafter.optimizer.state[p][k]))
        for n, p in low_params.items() for k in ("exp_avg", "exp_avg_sq"))
    low.runner.train_step(batches[3])
    again.runner.train_step(batches[3])
    res["resume exact"] = all(bool(torch.equal(again_params[n], p)) for n, p in low_params.items()) and all(
        bool(torch.equal(again_masters[id(again_params[n])], low.drafter.optimizer.master_weights()[p]))
        for n, p in low_params.items() if id(p) in masters)
    print("RESULTS " + json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def compared(demo_cache, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("precision")
    return run_interpreted(f"CACHE, OUT = {str(demo_cache)!r}, {str(out)!r}\n" + _SCRIPT)


def test_master_weights_lower_exactly_the_linear_weights(compared):
    assert compared["lowered"] == compared["linear names"] and compared["lowered"]
    assert compared["ref dtypes"] == ["torch.float32"]


def test_master_weights_step_as_autocast_over_float32_weights(compared):
    """Three steps, bit for bit: the bf16 weights are autocast's casts (to nearest even), the bf16
    weight gradients the ones autocast widens, the masters the float32 weights."""
    assert compared["losses equal"]
    assert compared["weights rel"] < 1e-6, compared["weights rel"]
    assert compared["rounding exact"]


def test_checkpoint_keeps_masters_and_resumes_bit_for_bit(compared):
    assert compared["saved dtypes"] == ["torch.float32"]
    assert compared["saved are masters"]
    assert compared["restored"] and compared["masters restored"] and compared["moments restored"]
    assert compared["resume exact"]


def test_master_weights_need_autocast():
    with pytest.raises(ValueError, match="autocast"):
        Precision(autocast=False, master_weights=True)
    assert Precision.for_device(torch.device("cpu")) == Precision(autocast=False, master_weights=False)


RANKS = 3


def _ddp_rank(out: str, *, device: torch.device, echo: Callable[[str], None]) -> None:
    """A launched rank (tests/conftest.py's preloaded server forks it): one bf16 DDP backward whose
    gradients it saves."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 3, bias=False))
    for w in linear_weights(model):
        w.data = w.data.to(torch.bfloat16)
    net = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    net.register_comm_hook(None, fp32_allreduce_hook)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank + 1)).to(torch.bfloat16)
    net(x).float().square().sum().backward()
    torch.save([p.grad.clone() for p in model.parameters()], Path(out) / f"ddp-{rank}.pt")
    # Let gloo's threads let go of the all-reduce before the group is torn down. The work holds Python
    # objects (the float32 copy; since torch 2.13, the context backward stashes), so a gloo thread that
    # drops it last takes the GIL; tearing the group down holds the GIL while it waits for that thread.
    # Without this pause 5 of 30 runs hung there (forked from a server with torch._dynamo loaded, one
    # of the first 1-3 runs); with it none of 300, 100 of them beside two busy loops.
    time.sleep(0.1)
    dist.destroy_process_group()


def test_ddp_averages_bf16_gradients_in_float32(tmp_path, preloaded_ranks):
    """Three gloo ranks (with two, a bf16 sum halved is the rounded mean too): each gradient is the
    mean of the ranks' own bf16 gradients rounded once, as a float32 sum gives it."""
    launch(_ddp_rank, (str(tmp_path),), [torch.device("cpu")] * RANKS)
    got = torch.load(tmp_path / "ddp-0.pt")
    assert all(g.dtype == torch.bfloat16 for g in got)
    for rank in range(1, RANKS):
        assert all(torch.equal(a, b) for a, b in zip(got, torch.load(tmp_path / f"ddp-{rank}.pt"), strict=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 3, bias=False)).to(
        torch.bfloat16)
    per_rank = []
    for rank in range(RANKS):
        model.zero_grad()
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank + 1)).to(torch.bfloat16)
        model(x).float().square().sum().backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
    for g, gs in zip(got, zip(*per_rank, strict=True), strict=True):
        exact = sum(x.double() for x in gs) / RANKS
        # rounded once: within half a bf16 unit (8 significant bits) of the exact mean, whatever
        # order the float32 sum took; bf16 sums round at each addition and miss that
        half_unit = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 9)
        assert ((g.double() - exact).abs() <= half_unit * (1 + 1e-5)).all()


class _Bucket:
    """What the hook reads of DDP's GradBucket."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_gloo_hook_returns_a_finished_future(tmp_path):
    """CI once aborted a rank at exit ("terminate called without an active exception"): gloo ran the
    hook's Python callback on its worker thread and released it there as the interpreter shut down.
    On a CPU the hook finishes its work before returning, so no Python is left for gloo's threads."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for _ in range(5):
            buffer = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            want = buffer.clone()
            fut = fp32_allreduce_hook(None, _Bucket(buffer))
            assert fut.done()
            assert fut.value() is buffer and torch.equal(buffer, want)
    finally:
        dist.destroy_process_group()
