"""FLA's delta-rule kernels against ours, one case at a time (``test_fla_delta_rule.py``).

On a CPU the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is imported): ``python tests/fla_parity.py`` prints each case's largest relative errors
as JSON. Two things compiled Triton does that its interpreter does not are filled in first:
an autotuner with several configs benchmarks them on a GPU driver (one config is kept), and
FLA's kernels call ``.to(dtype)`` on loop indices, which the interpreter leaves Python ints.

FLA stays out of the test extra (``test_fla_delta_rule.WHY_APART``), so these checks run in an
environment of their own::

    python -m venv /tmp/fla && /tmp/fla/bin/pip install torch==2.13.0 && \
    /tmp/fla/bin/pip install -e '.[test,fla]' triton einops && \
    /tmp/fla/bin/python -m pytest tests/test_fla_delta_rule.py
"""

from __future__ import annotations

import json
import sys

import torch

CASES = {
    "plain": {"bsz": 2, "seqlen": 150, "key_heads": 2, "value_heads": 2, "documents": None},
    "grouped_values": {"bsz": 1, "seqlen": 130, "key_heads": 2, "value_heads": 4, "documents": None},
    "documents": {
        "bsz": 3,
        "seqlen": 150,
        "key_heads": 1,
        "value_heads": 2,
        "documents": [[0], [0, 1, 64, 129], [0, 40]],
    },
}
"""Shapes: lengths off the 64-token chunk; documents as start positions per row (a row of one
document after another's ends on the same id, starts inside a chunk and on its boundary, a
one-token document)."""


def interpret_on_cpu() -> None:
    """Let FLA's kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 must be set)."""
    import triton.runtime.autotuner as autotuner

    init = autotuner.Autotuner.__init__

    def one_config(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = one_config

    class LoopIndex(int):
        def to(self, *_args, **_kwargs):
            return self

    import fla.ops  # noqa: F401  (imports every kernel module)

    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and module is not None:
            module.__dict__["range"] = lambda *bounds: map(LoopIndex, range(*bounds))


def _inputs(case: dict, device: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    bsz, seqlen, hk, hv, dim = case["bsz"], case["seqlen"], case["key_heads"], case["value_heads"], 32

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = rand(bsz, seqlen, hk, dim), rand(bsz, seqlen, hk, dim)
    v = rand(bsz, seqlen, hv, dim)
    g = -torch.nn.functional.softplus(rand(bsz, seqlen, hv)) * 0.5
    beta = torch.rand(bsz, seqlen, hv, generator=gen)
    documents = None
    if case["documents"] is not None:
        documents = torch.zeros(bsz, seqlen, dtype=torch.long)
        for row, starts in enumerate(case["documents"]):
            for start in starts[1:]:
                documents[row, start:] += 1
    tensors = [x.to(device, dtype) for x in (q, k, v)] + [g.to(device), beta.to(device, dtype)]
    return [x.requires_grad_() for x in tensors], None if documents is None else documents.to(device)


def compare(case: dict, device: str, dtype: torch.dtype) -> dict[str, float]:
    """Largest |fla - ours| / max |ours| of the output and of each input's gradient."""
    from autopar.models.qwen3_5.delta_rule import gated_delta_rule
    from autopar.models.qwen3_5.fla_delta_rule import fla_gated_delta_rule

    results = {}
    for name, kernel in (("ours", gated_delta_rule), ("fla", fla_gated_delta_rule)):
        inputs, documents = _inputs(case, device, dtype)
        out = kernel(*inputs, documents)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, out.dtype)
        (out * weights).sum().backward()
        results[name] = [out] + [x.grad for x in inputs]
    names = ["out", "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta"]
    return {
        name: ((fla.float() - ours.float()).abs().max() / ours.float().abs().max()).item()
        for name, fla, ours in zip(names, results["fla"], results["ours"])
    }


def compare_entry(case: dict, device: str, dtype: torch.dtype) -> dict[str, float]:
    """What context parallelism asks of a kernel: the rule from a given entry state (taken
    only by rows whose first token continues ``previous_document``), and a range's map
    [M | U], with gradients of every input and of the entry state."""
    from autopar.models.qwen3_5.delta_rule import AUTOPAR
    from autopar.models.qwen3_5.fla_delta_rule import FLA

    gen = torch.Generator().manual_seed(2)
    results = {}
    for kernel in (AUTOPAR, FLA):
        inputs, documents = _inputs(case, device, dtype)
        q, k, v, g, beta = inputs
        bsz, _, key_heads, key_dim = k.shape
        shape = (bsz, key_heads, v.shape[2] // key_heads, key_dim, v.shape[-1])
        entry = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.5).to(device)
        entry.requires_grad_()
        previous = None
        if documents is not None:  # the first row continues, the others start a document
            previous = documents[:, 0].clone()
            previous[1:] -= 1
        out = kernel.rule(q, k, v, g, beta, documents, entry, previous)
        maps = kernel.map(k, v, g, beta, documents, previous)
        weights = torch.randn(out.shape, generator=gen).to(device, out.dtype)
        map_weights = torch.randn(maps.shape, generator=gen).to(device)
        ((out * weights).sum() + (maps * map_weights).sum()).backward()
        results[kernel.name] = [out, maps] + [x.grad for x in (*inputs, entry)]
        gen.manual_seed(2)
    names = ["out", "map", "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta", "grad_entry"]
    return {
        name: ((fla.float() - ours.float()).abs().max() / ours.float().abs().max()).item()
        for name, fla, ours in zip(names, results["fla"], results["autopar"])
    }


def _layer_under_cp() -> dict[str, float]:
    """On one CP rank: a Gated DeltaNet layer passing states with FLA's kernels against the
    whole sequence by ours (``test_qwen3_5_context_parallel._layer_gaps``), four cases."""
    interpret_on_cpu()
    from test_qwen3_5_context_parallel import _layer_gaps

    return {
        f"cp_{'head_tail' if ht else 'in_order'}_{'documents' if packed else 'one_document'}": max(
            _layer_gaps(ht, packed, "fla")
        )
        for ht in (True, False)
        for packed in (False, True)
    }


def compare_layer(device: str, compiled: bool) -> dict[str, float]:
    """A debug Qwen3.5 Gated DeltaNet layer on packed documents, its kernel set by
    ``apply_delta_rule_kernel`` (FLA's compiled with ``fullgraph=True`` when ``compiled``)
    against autopar's, eager: largest relative errors of the output and every gradient."""
    from autopar.models import get_flavor
    from autopar.models.qwen3_5.gated_deltanet import GatedDeltaNet
    from autopar.parallel.delta_rule_kernel import apply_delta_rule_kernel

    gen = torch.Generator().manual_seed(0)
    layer = GatedDeltaNet(get_flavor("qwen3.5", "debug"))
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        layer.core.A_log.fill_(-3.0)  # slow decay: the state matters across documents' tokens
    layer.to(device)
    x = torch.randn(2, 200, layer.in_proj_q.in_features, generator=gen).to(device)
    upstream = torch.randn(2, 200, layer.out_proj.out_features, generator=gen).to(device)
    documents = torch.zeros(2, 200, dtype=torch.long)
    documents[0, 70:], documents[1, 128:] = 1, 1
    documents = documents.to(device)

    def run(kernel: str) -> list[torch.Tensor]:
        apply_delta_rule_kernel(layer, kernel, device)
        forward = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        layer.zero_grad()
        inputs = x.clone().requires_grad_()
        out = forward(inputs, documents)
        out.backward(upstream)
        apply_delta_rule_kernel(layer, "autopar", device)
        return [out.detach(), inputs.grad] + [p.grad.clone() for p in layer.parameters()]

    ours, fla = run("autopar"), run("fla")
    names = ["out", "grad_x"] + [name for name, _ in layer.named_parameters()]
    return {n: ((a - b).abs().max() / b.abs().max()).item() for n, a, b in zip(names, fla, ours)}


if __name__ == "__main__":
    interpret_on_cpu()
    from autopar.cli.spawn import run_on_ranks

    results = {name: compare(case, "cpu", torch.float32) for name, case in CASES.items()}
    for name in ("grouped_values", "documents"):
        results[f"{name}_entry"] = compare_entry(CASES[name], "cpu", torch.float32)
    results["layer_compiled"] = compare_layer("cpu", compiled=True)
    by_rank = run_on_ranks(_layer_under_cp, 2)
    results["layer_cp"] = {case: max(r[case] for r in by_rank) for case in by_rank[0]}
    print(json.dumps(results))
