"""--onednn (infra/onednn.py): a routed linear layer's output and gradients are the float64 formula's, by oneDNN's
products; route() takes nn.Linear exactly; generate() reads packed weights and draws what the plain model draws; a
script on a CPU routes its models by default and not with --no_onednn."""

import copy
import json
import os
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import infra  # noqa: E402
from infra import onednn  # noqa: E402


@pytest.fixture
def routed(monkeypatch):
    """onednn switched on, and a count of its products (put back after the test)"""
    monkeypatch.setattr(onednn, "ON", False)
    onednn.switch(True)
    assert onednn.ON, "this torch has no oneDNN product"
    calls = []
    real = onednn.product

    def counted(*args):
        calls.append(args[1].is_mkldnn)  # (whether the weight is a packed one)
        return real(*args)

    monkeypatch.setattr(onednn, "product", counted)
    return calls


def test_product_and_its_gradients_are_the_formulas(routed):
    """y = x W^T + b, dx = g W, dW = g^T x, db = sum of g, each against float64; three products by oneDNN"""
    torch.manual_seed(0)
    layer = onednn.route(torch.nn.Sequential(torch.nn.Linear(7, 5)))[0]
    assert type(layer) is onednn.Linear
    x = torch.randn(3, 4, 7, requires_grad=True)
    g = torch.randn(3, 4, 5)
    y = layer(x)
    y.backward(g)
    assert len(routed) == 3
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    x64, g64 = x.detach().double(), g.double()
    want = torch.zeros(3, 4, 5, dtype=torch.float64)
    for i in range(3):
        for j in range(4):
            for o in range(5):
                want[i, j, o] = sum(x64[i, j, k] * w[o, k] for k in range(7)) + b[o]
    torch.testing.assert_close(y.double(), want, atol=1e-6, rtol=1e-6)
    flat_x, flat_g = x64.reshape(-1, 7), g64.reshape(-1, 5)
    torch.testing.assert_close(x.grad.double(), (flat_g @ w).reshape(3, 4, 7), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layer.weight.grad.double(), flat_g.T @ flat_x, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layer.bias.grad.double(), flat_g.sum(0), atol=1e-6, rtol=1e-6)
    with torch.no_grad():  # without gradients: one product, no autograd function
        torch.testing.assert_close(layer(x).double(), want, atol=1e-6, rtol=1e-6)
    assert len(routed) == 4 and not any(routed)
    layer.weight.requires_grad_(False)  # a trainable bias alone still gets its gradient
    layer.bias.grad = None
    layer(x.detach()).backward(g)
    torch.testing.assert_close(layer.bias.grad.double(), flat_g.sum(0), atol=1e-6, rtol=1e-6)


def test_route_takes_linear_layers_exactly_and_leaves_the_rest(routed, monkeypatch):
    """nn.Linear becomes onednn.Linear (a copy too); a subclass with its own forward, or a bfloat16 layer, or a run
    switched off, keeps nn.Linear's products"""

    class Own(torch.nn.Linear):
        pass

    model = onednn.route(torch.nn.Sequential(torch.nn.Linear(4, 4), Own(4, 4), torch.nn.Linear(4, 4).bfloat16()))
    assert [type(m) for m in model] == [onednn.Linear, Own, onednn.Linear]
    assert type(copy.deepcopy(model)[0]) is onednn.Linear
    with torch.no_grad():
        model[2](torch.randn(2, 4).bfloat16())  # bfloat16: torch's own (oneDNN already), not counted
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model[0](torch.randn(2, 4))  # under autocast: autocast's bfloat16 product
    assert routed == []
    monkeypatch.setattr(onednn, "ON", False)
    assert type(onednn.route(torch.nn.Sequential(torch.nn.Linear(4, 4)))[0]) is torch.nn.Linear


@pytest.mark.parametrize("bf16", [False, True])
def test_generate_packs_the_weights_and_draws_what_the_plain_model_draws(routed, tiny_llama_dir, bf16):
    """generate() on a routed model: its products read packed weights (dropped after; under bfloat16 autocast, as
    --bf16 samples, bfloat16 copies), and its tokens on fixed uniform numbers are the plain model's; a short call (8
    tokens) reads the plain weights"""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    model = onednn.route(copy.deepcopy(plain))
    assert sum(type(m) is onednn.Linear for m in model.modules()) > 0
    seen = []
    model.lm_head.register_forward_hook(
        lambda *_: seen.append((len(onednn.PACKED), *{w.dtype for w in onednn.PACKED.values()}))
    )
    torch.manual_seed(0)
    queries = torch.randint(3, 60, (6, 5))
    mask = torch.ones_like(queries)
    mask[0, :2] = 0
    uniforms = torch.rand(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ours = infra.generate(model, queries, mask, 16, 0.9, uniforms=uniforms, group=2)
        theirs = infra.generate(plain, queries, mask, 16, 0.9, uniforms=uniforms, group=2)
    assert ours.tolist() == theirs.tolist()
    layers = sum(type(m) is onednn.Linear for m in model.modules())
    assert set(seen) == {(layers, torch.bfloat16 if bf16 else torch.float32)} and not onednn.PACKED
    assert sum(routed) >= 15 * layers  # the decoding steps' products on packed weights
    routed.clear()  # a call of fewer steps than the copies cost: the plain weights
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        infra.generate(model, queries, mask, 8, 0.9, uniforms=uniforms[:, :8], group=2)
    assert not any(routed) and (bf16 or routed)  # (under autocast, autocast's own products)


COUNTING = """
import json, runpy, sys
sys.path.insert(0, {repo!r})
import infra.onednn as onednn
real, calls, apply, updates = onednn.product, [], onednn.Product.apply, []
onednn.product = lambda *args: calls.append(1) or real(*args)
onednn.Product.apply = lambda *args: updates.append(1) or apply(*args)
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    json.dump({{"products": len(calls), "with_gradients": len(updates), "on": onednn.ON}}, open({out!r}, "w"))
"""


@pytest.mark.parametrize("flag, on", [("", True), ("--no_onednn", False)])
def test_a_script_routes_its_products_unless_told_not_to(flag, on, run, tmp_path, tiny_model_dir, tiny_prompts_file):
    """grpo.py on a CPU: its products by oneDNN by default (the update's, the sampler's), none with --no_onednn"""
    counts = tmp_path / "counts.json"
    wrapper = tmp_path / "counting.py"
    wrapper.write_text(textwrap.dedent(COUNTING.format(repo=REPO, out=str(counts))))
    result = run(
        f"{wrapper} {os.path.join(REPO, 'grpo.py')} --model_name_or_path {tiny_model_dir} --dataset_name "
        f"{tiny_prompts_file} --total_episodes 8 --per_device_train_batch_size 4 --response_length 6 "
        f"--num_sample_generations 0 --output_dir {tmp_path / 'out'} --no_save_model {flag}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(counts.read_text())
    assert found["on"] is on
    assert (found["products"] > 0) is on and (found["with_gradients"] > 0) is on
