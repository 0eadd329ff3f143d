"""--onednn (on by default, on a CPU): the float32 products of the models' linear layers through oneDNN, forward and
backward, instead of torch's BLAS. torch multiplies float32 matrices on an x86 CPU with MKL, which on AMD processors
runs at less than half of what oneDNN gets from the same cores (1024 x 1024 products: 209 against 473 GFLOP/s on
this project's AMD EPYC; benchmark/results/profile); bfloat16 products (--bf16) already go through oneDNN. The same
products summed in another order: float32's last bits differ, as between two batch sizes, not the arithmetic.
route() gives a model's nn.Linear layers the Linear class below (infra.models.load_pretrained, where start() has
switched it on); packed() holds their weights in oneDNN's own layout for a generate() call of 16 tokens or more
(its weights fixed), in bfloat16 under --bf16's autocast (which would otherwise cast every weight at every step).
"""

import contextlib

import torch

from .data import note

ON = False  # switch(): --onednn, on a CPU, not under ZeRO-3
MIN_STEPS = 16  # packed(): the shortest generate() call that copies the weights
PACKED = {}  # layer -> its weight in oneDNN's layout, within packed() (not on the layer, where a copy made
# meanwhile would keep it)


def product(x, weight, bias=None):
    """x (rows, in) @ weight (out, in).T + bias by oneDNN (a weight packed() or a plain one) -> (rows, out)"""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def switch(on):
    """Route the models loaded from now on (route) where on, and where this torch has oneDNN's product (else a line)."""
    global ON
    ON = False
    if on:
        try:
            ON = bool(product(torch.ones(2, 3), torch.ones(4, 3)).eq(3).all())
        except (AttributeError, RuntimeError, NotImplementedError):
            note("--onednn: this torch has no oneDNN linear product; torch's own runs the products")


class Product(torch.autograd.Function):
    """x @ weight.T + bias and its gradients, each product by oneDNN. x (rows, in), weight (out, in) -> (rows, out)"""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias = bias is not None
        return product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad, dx, dw, db = grad.contiguous(), None, None, None  # grad (rows, out)
        if ctx.needs_input_grad[0]:
            dx = product(grad, weight.t())  # (rows, out) @ (out, in)
        if ctx.needs_input_grad[1]:
            dw = product(grad.t().contiguous(), x.t().contiguous())  # (out, rows) @ (rows, in)
        if ctx.bias and ctx.needs_input_grad[2]:
            db = grad.sum(0)
        return dx, dw, db


class Linear(torch.nn.Linear):
    """nn.Linear whose float32 products on a CPU, outside autocast, run by oneDNN; under bfloat16 autocast, within
    packed(), too, on its bfloat16 copies (autocast's own product is the same oneDNN one, on weights it casts at each
    call); any other by nn.Linear's own."""

    def forward(self, x):
        w, copy = self.weight, PACKED.get(self)
        autocast = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu") if autocast else torch.float32  # the product's
        cpu = x.device.type == "cpu" and w.dtype == torch.float32 and x.numel()
        fixed = copy is not None and copy.dtype == dtype and not torch.is_grad_enabled()  # within packed()
        if cpu and fixed and x.dtype in (torch.float32, dtype):
            bias = self.bias.to(dtype) if self.bias is not None else None  # (as autocast casts x and the bias)
            return product(x.reshape(-1, x.shape[-1]).to(dtype), copy, bias).view(*x.shape[:-1], -1)
        if not cpu or x.dtype != torch.float32 or autocast:
            return super().forward(x)
        flat, shape = x.reshape(-1, x.shape[-1]), (*x.shape[:-1], w.shape[0])  # (..., in) -> (rows, in)
        bias_grad = self.bias is not None and self.bias.requires_grad
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad or bias_grad):
            return Product.apply(flat, w, self.bias).view(shape)
        return product(flat, w, self.bias).view(shape)


def route(model):
    """model with its nn.Linear layers as Linear where switched on (that class exactly: a quantized layer, an adapter's
    or a head with its own forward keeps its own). A class, not a closure: a copy of the model computes with its own
    weights."""
    if ON and isinstance(model, torch.nn.Module):
        for layer in model.modules():
            if type(layer) is torch.nn.Linear:
                layer.__class__ = Linear
    return model


@contextlib.contextmanager
def packed(model, rows, steps):
    """Within it, model's routed layers read their weights from copies in oneDNN's layout for products of about rows
    rows (a decoding step's), made on entry: for weights that do not change inside (no gradient is taken through). Under
    bfloat16 autocast (--bf16) the copies are in bfloat16, cast once instead of at every step. Only for calls of at
    least 16 steps: making the copies costs about ten steps' savings (SmolLM2-135M, 16 rows)."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
    routed = isinstance(model, torch.nn.Module) and steps >= MIN_STEPS and dtype in (torch.float32, torch.bfloat16)
    layers = model.modules() if routed else []  # (not a module: a test's stand-in, a function)
    layers = [m for m in layers if type(m) is Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    try:
        for layer in layers:
            PACKED[layer] = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().to(dtype), rows)
        yield model
    finally:
        for layer in layers:
            PACKED.pop(layer, None)
